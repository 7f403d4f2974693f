//! Text a model or a sandboxed program wrote, made inert before a terminal sees it.
//!
//! A terminal obeys the control characters in what it is sent: ESC starts CSI (cursor moves,
//! screen clears), OSC (window title, OSC 8 links, OSC 52 clipboard writes), DCS, APC, PM and
//! SOS sequences; U+0080..U+009F are the same introducers in one character (U+009B is CSI,
//! U+009D OSC); BEL rings, backspace writes over what was shown. Every such character is
//! written as the `\u{..}` escape `tandem_protocol::files::shown` writes for a file name, so
//! what follows it is plain text and a sequence split between two pieces of a stream is
//! harmless in each. Newlines and tabs stay. SGR colour from a program is escaped as well:
//! the transcript colours only what it says itself. Backslashes are not doubled (unlike a
//! file name): prose and code are full of them, and no escape written here can act.
//!
//! A carriage return not followed by a line feed would let later text write over a line
//! already shown (a progress bar does, and so could text hiding a line from the person
//! approving it): it ends the line instead, so each overwrite is a line of its own.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` is written as an escape: a control character (C0, DEL, C1) other than a
/// newline, tab or carriage return, or a character that reorders or breaks a line.
fn escaped(c: char) -> bool {
    (c.is_control() && !matches!(c, '\n' | '\t' | '\r'))
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn push_escape(out: &mut String, c: char) {
    let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
}

/// A stream of text (a reply as it streams, a program's output) written to a terminal in
/// pieces; remembers only whether the last piece ended in a carriage return.
#[derive(Debug, Default)]
pub struct Inert {
    after_cr: bool,
}

impl Inert {
    /// `piece`, the next part of the stream, as it may be written.
    pub fn piece<'a>(&mut self, piece: &'a str) -> Cow<'a, str> {
        let after_cr = std::mem::take(&mut self.after_cr);
        let plain = !piece.chars().any(|c| escaped(c) || c == '\r');
        if plain && !(after_cr && piece.starts_with('\n')) {
            return Cow::Borrowed(piece);
        }
        let mut out = String::with_capacity(piece.len() + 16);
        let mut chars = piece.chars().peekable();
        if after_cr && chars.peek() == Some(&'\n') {
            // The line feed of a `\r\n` split between pieces: the `\r` ended the line.
            chars.next();
        }
        while let Some(c) = chars.next() {
            match c {
                '\r' => {
                    if chars.peek() == Some(&'\n') {
                        chars.next();
                    }
                    out.push('\n');
                }
                c if escaped(c) => push_escape(&mut out, c),
                c => out.push(c),
            }
        }
        self.after_cr = piece.ends_with('\r');
        Cow::Owned(out)
    }

    /// Forgets a carriage return that ended the last piece: something else was written since.
    pub fn interrupt(&mut self) {
        self.after_cr = false;
    }
}

/// `text`, whole, as it may be written.
pub fn text(text: &str) -> Cow<'_, str> {
    Inert::default().piece(text)
}

/// `text` as it may be written on one line (a rule's label): newlines, tabs and carriage
/// returns are escaped too.
pub fn line(text: &str) -> Cow<'_, str> {
    if !text.chars().any(|c| escaped(c) || c.is_control()) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if escaped(c) || c.is_control() {
            push_escape(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A JSON line with the C1 controls in its strings written as `\u00XX` escapes, which
/// `serde_json` writes raw: the same JSON, inert if a terminal shows it.
pub fn json(line: String) -> String {
    if !line.chars().any(|c| ('\u{80}'..='\u{9f}').contains(&c)) {
        return line;
    }
    let mut out = String::with_capacity(line.len() + 16);
    for c in line.chars() {
        if ('\u{80}'..='\u{9f}').contains(&c) {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `s` holds a character a terminal acts on, other than a newline or a tab.
    fn acts(s: &str) -> bool {
        s.chars()
            .any(|c| c.is_control() && !matches!(c, '\n' | '\t'))
    }

    #[test]
    fn every_control_character_is_escaped_as_a_file_name_is_and_newlines_and_tabs_stay() {
        for c in (0u32..0x20).chain(0x7f..0xa0).filter_map(char::from_u32) {
            if matches!(c, '\n' | '\t' | '\r') {
                continue;
            }
            let s = c.to_string();
            assert_eq!(text(&s), tandem_protocol::files::shown(&s), "{c:?}");
            assert_eq!(line(&s), tandem_protocol::files::shown(&s), "{c:?}");
        }
        assert_eq!(text("a\tb\nc \\n"), "a\tb\nc \\n");
        assert_eq!(line("a\tb\nc"), "a\\u{9}b\\u{a}c");
        assert_eq!(text("r\u{202e}gnp.exe"), "r\\u{202e}gnp.exe");
    }

    #[test]
    fn a_sequence_split_anywhere_between_pieces_is_escaped_in_each() {
        let stream = "a\u{1b}]52;c;aGk=\u{7}b\u{9b}2Jc\u{1b}[1A\u{8}\u{8}d\u{9d}0;x\u{9c}\r\n";
        let whole = text(stream).into_owned();
        assert!(!acts(&whole), "{whole:?}");
        let chars: Vec<char> = stream.chars().collect();
        for at in 0..=chars.len() {
            let (a, b): (String, String) =
                (chars[..at].iter().collect(), chars[at..].iter().collect());
            let mut s = Inert::default();
            let out = format!("{}{}", s.piece(&a), s.piece(&b));
            assert_eq!(out, whole, "split at {at}");
        }
    }

    #[test]
    fn a_lone_carriage_return_ends_the_line_instead_of_writing_over_it() {
        assert_eq!(text("50%\r100%\r\ndone\r"), "50%\n100%\ndone\n");
        let mut s = Inert::default();
        assert_eq!(s.piece("safe\r"), "safe\n");
        s.interrupt();
        assert_eq!(s.piece("\nnext"), "\nnext");
    }

    #[test]
    fn json_lines_carry_c1_controls_escaped_and_read_back_the_same() {
        let line =
            serde_json::to_string(&serde_json::json!({ "text": "a\u{9b}2J\u{1b}]0;t\u{7}é" }))
                .unwrap_or_default();
        let out = json(line);
        assert!(!acts(&out), "{out:?}");
        let back: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        assert_eq!(back["text"], "a\u{9b}2J\u{1b}]0;t\u{7}é");
    }
}
