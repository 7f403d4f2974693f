//! Pictures shown inline in the transcript, on a terminal that speaks an image protocol:
//! kitty's graphics protocol or iTerm2's inline images (which WezTerm speaks too).

use base64::Engine as _;

/// Columns a picture takes: small, under its line.
const COLUMNS: u32 = 40;
/// Largest picture shown inline; a larger one is named only.
pub const MAX_BYTES: u64 = 8 << 20;
/// Base64 characters per kitty escape, as the protocol asks.
const KITTY_CHUNK: usize = 4096;

/// An image protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// kitty's graphics protocol (kitty, Ghostty, Konsole).
    Kitty,
    /// iTerm2's inline images (iTerm2, WezTerm).
    ITerm,
}

impl Protocol {
    /// What this terminal speaks: `TANDEM_PICTURES` (`kitty`, `iterm`, `none`) when set,
    /// else what the terminal says of itself in the environment.
    pub fn detect() -> Option<Self> {
        let var = |name: &str| std::env::var(name).unwrap_or_default();
        Self::from_env(
            &var("TANDEM_PICTURES"),
            &var("TERM"),
            &var("TERM_PROGRAM"),
            &var("LC_TERMINAL"),
            std::env::var_os("KITTY_WINDOW_ID").is_some(),
        )
    }

    fn from_env(asked: &str, term: &str, program: &str, lc: &str, kitty: bool) -> Option<Self> {
        match asked.trim().to_ascii_lowercase().as_str() {
            "kitty" => return Some(Self::Kitty),
            "iterm" | "iterm2" => return Some(Self::ITerm),
            "none" | "off" | "0" => return None,
            _ => {}
        }
        if kitty || term == "xterm-kitty" || term == "xterm-ghostty" || program == "ghostty" {
            Some(Self::Kitty)
        } else if program == "iTerm.app" || program == "WezTerm" || lc == "iTerm2" {
            Some(Self::ITerm)
        } else {
            None
        }
    }

    /// The bytes that show `data`, a picture of type `mime`, under the current line (ending
    /// on a new line); `None` for a type this protocol does not show. Inside tmux each
    /// escape is wrapped to pass through to the terminal (tmux's `allow-passthrough`).
    pub fn encode(self, data: &[u8], mime: &str, tmux: bool) -> Option<Vec<u8>> {
        let b64 = base64::engine::general_purpose::STANDARD.encode(data);
        let mut escapes: Vec<String> = Vec::new();
        match self {
            Self::Kitty => {
                // Only PNG is sent as a file; kitty would need other formats decoded.
                if mime != "image/png" {
                    return None;
                }
                let chunks: Vec<&[u8]> = b64.as_bytes().chunks(KITTY_CHUNK).collect();
                for (i, chunk) in chunks.iter().enumerate() {
                    let more = u8::from(i + 1 < chunks.len());
                    let chunk = String::from_utf8_lossy(chunk);
                    // q=2: the terminal answers nothing, so no reply lands on stdin.
                    escapes.push(if i == 0 {
                        format!("\x1b_Gf=100,a=T,q=2,c={COLUMNS},m={more};{chunk}\x1b\\")
                    } else {
                        format!("\x1b_Gm={more};{chunk}\x1b\\")
                    });
                }
            }
            Self::ITerm => {
                if !matches!(mime, "image/png" | "image/jpeg" | "image/gif") {
                    return None;
                }
                escapes.push(format!(
                    "\x1b]1337;File=inline=1;size={};width={COLUMNS};preserveAspectRatio=1:{b64}\x07",
                    data.len()
                ));
            }
        }
        let mut out = Vec::with_capacity(b64.len() + 64);
        for e in escapes {
            if tmux {
                out.extend_from_slice(b"\x1bPtmux;");
                out.extend_from_slice(e.replace('\x1b', "\x1b\x1b").as_bytes());
                out.extend_from_slice(b"\x1b\\");
            } else {
                out.extend_from_slice(e.as_bytes());
            }
        }
        out.push(b'\n');
        Some(out)
    }
}

/// Whether output goes through tmux, which passes an escape on only when it is wrapped.
pub fn in_tmux() -> bool {
    std::env::var_os("TMUX").is_some_and(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_terminal_is_known_by_what_it_says_and_the_user_decides_first() {
        assert_eq!(
            Protocol::from_env("", "xterm-kitty", "", "", false),
            Some(Protocol::Kitty)
        );
        assert_eq!(
            Protocol::from_env("", "screen", "", "", true),
            Some(Protocol::Kitty)
        );
        assert_eq!(
            Protocol::from_env("", "xterm-256color", "iTerm.app", "", false),
            Some(Protocol::ITerm)
        );
        assert_eq!(
            Protocol::from_env("", "tmux-256color", "tmux", "iTerm2", false),
            Some(Protocol::ITerm)
        );
        assert_eq!(
            Protocol::from_env("", "xterm-256color", "", "", false),
            None
        );
        assert_eq!(
            Protocol::from_env("none", "xterm-kitty", "", "", true),
            None
        );
        assert_eq!(
            Protocol::from_env("iterm", "xterm-kitty", "", "", false),
            Some(Protocol::ITerm)
        );
    }

    #[test]
    fn a_kitty_picture_is_sent_in_chunks_that_read_back_whole() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let out = Protocol::Kitty
            .encode(&data, "image/png", false)
            .unwrap_or_default();
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(
            text.starts_with("\x1b_Gf=100,a=T,q=2,c=40,m=1;"),
            "{text:.40}"
        );
        assert!(text.ends_with("\x1b\\\n"));
        let mut b64 = String::new();
        for part in text.trim_end().split("\x1b\\").filter(|p| !p.is_empty()) {
            let (_, payload) = part.split_once(';').unwrap_or_default();
            assert!(payload.len() <= KITTY_CHUNK);
            b64.push_str(payload);
        }
        let back = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap_or_default();
        assert_eq!(back, data);
        assert!(text.contains("\x1b_Gm=0;"));
        // Not a PNG: kitty is sent none.
        assert_eq!(
            Protocol::Kitty.encode(b"<svg/>", "image/svg+xml", false),
            None
        );
    }

    #[test]
    fn inside_tmux_every_escape_is_wrapped_with_its_escapes_doubled() {
        let out = Protocol::ITerm
            .encode(b"GIF89a", "image/gif", true)
            .unwrap_or_default();
        let text = String::from_utf8(out).unwrap_or_default();
        assert_eq!(
            text,
            "\x1bPtmux;\x1b\x1b]1337;File=inline=1;size=6;width=40;preserveAspectRatio=1:R0lGODlh\x07\x1b\\\n"
        );
    }
}
