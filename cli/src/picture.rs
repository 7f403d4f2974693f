//! Pictures shown inline in the transcript, on a terminal that speaks an image protocol:
//! kitty's graphics protocol, iTerm2's inline images (which WezTerm speaks too), or sixel.
//! The picture came from a sandbox: a PNG is decoded for sixel within fixed bounds.

use std::fmt::Write as _;

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
    /// DEC sixel graphics (foot, mlterm, Windows Terminal, xterm built with it).
    Sixel,
}

impl Protocol {
    /// What `terminal` speaks: what `TANDEM_PICTURES` says (`kitty`, `iterm`, `sixel`,
    /// `none`) when set, else what the terminal says of itself.
    pub fn detect(terminal: &Terminal) -> Option<Self> {
        Self::from_env(
            &terminal.asked,
            &terminal.term,
            &terminal.program,
            &terminal.lc_terminal,
            terminal.kitty,
        )
    }

    fn from_env(asked: &str, term: &str, program: &str, lc: &str, kitty: bool) -> Option<Self> {
        match asked.trim().to_ascii_lowercase().as_str() {
            "kitty" => return Some(Self::Kitty),
            "iterm" | "iterm2" => return Some(Self::ITerm),
            "sixel" => return Some(Self::Sixel),
            "none" | "off" | "0" => return None,
            _ => {}
        }
        if kitty || term == "xterm-kitty" || term == "xterm-ghostty" || program == "ghostty" {
            Some(Self::Kitty)
        } else if program == "iTerm.app" || program == "WezTerm" || lc == "iTerm2" {
            Some(Self::ITerm)
        } else if term.starts_with("foot") || term.starts_with("mlterm") || term.contains("sixel") {
            Some(Self::Sixel)
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
            Self::Sixel => {
                if mime != "image/png" {
                    return None;
                }
                escapes.push(sixel(data)?);
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

/// Most pixels a PNG may say it has to be decoded for sixel; a larger one (or a
/// decompression bomb) is shown by its path only.
const SIXEL_MAX_PIXELS: u64 = 4096 * 4096;
/// Width in pixels a picture is drawn at in sixel: small, as the others are.
const SIXEL_WIDTH: u32 = 320;

/// `data`, a PNG, as a sixel image no wider than [`SIXEL_WIDTH`], in 216 colours (a 6x6x6
/// cube), its transparent pixels left as they are; `None` when it does not decode.
fn sixel(data: &[u8]) -> Option<String> {
    let (width, height, rgba) = decode_png(data)?;
    let (w, h) = if width > SIXEL_WIDTH {
        let h = (u64::from(height) * u64::from(SIXEL_WIDTH) / u64::from(width)).max(1);
        (SIXEL_WIDTH, u32::try_from(h).ok()?)
    } else {
        (width, height)
    };
    let level = |v: u8| (u16::from(v) * 5 + 127) / 255;
    // Each drawn pixel takes its nearest source pixel: its colour in the cube, or none where
    // that is mostly transparent.
    let colour_at = |x: u32, y: u32| -> Option<u16> {
        let sx = u64::from(x) * u64::from(width) / u64::from(w);
        let sy = u64::from(y) * u64::from(height) / u64::from(h);
        let at = usize::try_from((sy * u64::from(width) + sx) * 4).ok()?;
        let px = rgba.get(at..at + 4)?;
        (px[3] >= 128).then(|| level(px[0]) * 36 + level(px[1]) * 6 + level(px[2]))
    };
    // P2 = 1: pixels no colour sets stay as the screen was.
    let mut out = format!("\x1bP0;1q\"1;1;{w};{h}");
    for i in 0..216u16 {
        let _ = write!(
            out,
            "#{i};2;{};{};{}",
            i / 36 * 20,
            i / 6 % 6 * 20,
            i % 6 * 20
        );
    }
    let cols = usize::try_from(w).ok()?;
    for band in (0..h).step_by(6) {
        let rows = (h - band).min(6);
        let mut colours: Vec<(u16, Vec<u8>)> = Vec::new();
        for x in 0..w {
            for r in 0..rows {
                let Some(c) = colour_at(x, band + r) else {
                    continue;
                };
                let slot = match colours.iter().position(|(k, _)| *k == c) {
                    Some(slot) => slot,
                    None => {
                        colours.push((c, vec![0; cols]));
                        colours.len() - 1
                    }
                };
                colours[slot].1[x as usize] |= 1 << r;
            }
        }
        for (n, (colour, bits)) in colours.iter().enumerate() {
            if n > 0 {
                // Back to the band's start, for the next colour.
                out.push('$');
            }
            let _ = write!(out, "#{colour}");
            let mut x = 0;
            while x < bits.len() {
                let run = bits[x..].iter().take_while(|&&b| b == bits[x]).count();
                let ch = char::from(0x3f + bits[x]);
                if run > 3 {
                    let _ = write!(out, "!{run}{ch}");
                } else {
                    out.extend(std::iter::repeat_n(ch, run));
                }
                x += run;
            }
        }
        out.push('-');
    }
    out.push_str("\x1b\\");
    Some(out)
}

/// A PNG's width, height and RGBA pixels, decoded within [`SIXEL_MAX_PIXELS`] and 64 MiB.
fn decode_png(data: &[u8]) -> Option<(u32, u32, Vec<u8>)> {
    use png::{ColorType, Transformations};
    let mut decoder =
        png::Decoder::new_with_limits(std::io::Cursor::new(data), png::Limits { bytes: 64 << 20 });
    decoder.set_transformations(Transformations::ALPHA | Transformations::STRIP_16);
    let mut reader = decoder.read_info().ok()?;
    let (width, height) = reader.info().size();
    if width == 0 || height == 0 || u64::from(width) * u64::from(height) > SIXEL_MAX_PIXELS {
        return None;
    }
    let mut buf = vec![0; reader.output_buffer_size()?];
    let frame = reader.next_frame(&mut buf).ok()?;
    let channels = match frame.color_type {
        ColorType::Grayscale => 1,
        ColorType::GrayscaleAlpha => 2,
        ColorType::Rgb => 3,
        ColorType::Rgba => 4,
        ColorType::Indexed => return None,
    };
    let row_bytes = usize::try_from(width).ok()? * channels;
    let mut rgba = Vec::with_capacity(row_bytes / channels * 4 * usize::try_from(height).ok()?);
    for y in 0..usize::try_from(height).ok()? {
        let start = y * frame.line_size;
        for px in buf.get(start..start + row_bytes)?.chunks_exact(channels) {
            rgba.extend_from_slice(&match *px {
                [g] => [g, g, g, 255],
                [g, a] => [g, g, g, a],
                [r, g, b] => [r, g, b, 255],
                [r, g, b, a] => [r, g, b, a],
                _ => return None,
            });
        }
    }
    Some((width, height, rgba))
}

/// What the terminal says of itself in the environment, and what the user asked for
/// (`config::terminal` reads it).
#[derive(Debug, Default)]
pub struct Terminal {
    /// `TANDEM_PICTURES`.
    pub asked: String,
    /// `TERM`.
    pub term: String,
    /// `TERM_PROGRAM`.
    pub program: String,
    /// `LC_TERMINAL` (iTerm2 sets it, and ssh passes it on).
    pub lc_terminal: String,
    /// Whether `KITTY_WINDOW_ID` is set.
    pub kitty: bool,
    /// Whether output goes through tmux (`TMUX`), which passes an escape on only when it is
    /// wrapped.
    pub tmux: bool,
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

    /// A 2x2 PNG: red, blue on the first row, red, blue on the second.
    const PNG: &[u8] = &[
        0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44,
        0x52, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x02, 0x08, 0x02, 0x00, 0x00, 0x00, 0xfd,
        0xd4, 0x9a, 0x73, 0x00, 0x00, 0x00, 0x10, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8,
        0xcf, 0x00, 0x04, 0xff, 0x19, 0x20, 0x14, 0x00, 0x1b, 0xf2, 0x03, 0xfd, 0xd6, 0x96, 0xf2,
        0x2b, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
    ];

    #[test]
    fn a_png_is_drawn_in_sixel_pixel_by_pixel() {
        let out = Protocol::Sixel
            .encode(PNG, "image/png", false)
            .unwrap_or_default();
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(
            text.starts_with("\x1bP0;1q\"1;1;2;2#0;2;0;0;0#1;2;0;0;20"),
            "{text:.60}"
        );
        // Red is colour 180 (5,0,0), blue 5 (0,0,5): each column is two pixels high, sixel
        // bits 0 and 1, `B`; red in the first column, blue in the second.
        assert!(text.ends_with("#180B?$#5?B-\x1b\\\n"), "{text}");
    }

    #[test]
    fn a_png_too_large_or_broken_is_not_drawn() {
        // A well-formed PNG that says it is 100,000 x 100,000 pixels (30 GB decoded).
        let bomb: &[u8] = &[
            0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48,
            0x44, 0x52, 0x00, 0x01, 0x86, 0xa0, 0x00, 0x01, 0x86, 0xa0, 0x08, 0x02, 0x00, 0x00,
            0x00, 0x27, 0x30, 0x9c, 0x9f, 0x00, 0x00, 0x00, 0x08, 0x49, 0x44, 0x41, 0x54, 0x78,
            0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01, 0x48, 0x06, 0x89, 0xd2, 0x00, 0x00, 0x00,
            0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
        ];
        assert_eq!(Protocol::Sixel.encode(bomb, "image/png", false), None);
        assert_eq!(
            Protocol::Sixel.encode(b"not a png", "image/png", false),
            None
        );
        assert_eq!(Protocol::Sixel.encode(PNG, "image/jpeg", false), None);
        assert_eq!(
            Protocol::from_env("", "foot", "", "", false),
            Some(Protocol::Sixel)
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
