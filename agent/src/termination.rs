//! Whether the assistant said the termination string in its own words.

use pulldown_cmark::{Event, Parser, Tag, TagEnd};

/// True when `word` ends the prose of `reply`: outside code (fenced, indented or inline),
/// case-sensitive, as a whole word, with only punctuation or emphasis after it.
pub fn says_terminate(reply: &str, word: &str) -> bool {
    if word.is_empty() {
        return false;
    }
    let prose = prose_of(reply);
    let tail = prose.trim_end_matches(|c: char| {
        c.is_whitespace() || matches!(c, '.' | '!' | '*' | '_' | '"' | '\'' | ')' | '`')
    });
    let Some(before) = tail.strip_suffix(word) else {
        return false;
    };
    !before.chars().next_back().is_some_and(is_word_char)
}

/// True when `word` is said anywhere in the prose of `reply` (outside code, as a whole word):
/// a team's `mention` and `escalate`.
pub fn mentions(reply: &str, word: &str) -> bool {
    if word.is_empty() {
        return false;
    }
    let prose = prose_of(reply);
    prose.match_indices(word).any(|(at, _)| {
        let before = prose[..at].chars().next_back();
        let after = prose[at + word.len()..].chars().next();
        !before.is_some_and(is_word_char) && !after.is_some_and(is_word_char)
    })
}

/// Small models often put the termination string alone in a code block; that block is a
/// way of saying it, not code to run.
pub fn is_termination_block(code: &str, word: &str) -> bool {
    !word.is_empty() && code.trim() == word
}

/// The reply with the termination string (and what trails it) removed, for a summary.
pub fn strip_termination(reply: &str, word: &str) -> String {
    match reply.rfind(word) {
        Some(at) if !word.is_empty() => reply[..at].trim_end().to_owned(),
        _ => reply.trim_end().to_owned(),
    }
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn prose_of(markdown: &str) -> String {
    let mut prose = String::new();
    let mut in_code = 0u32;
    for event in Parser::new(markdown) {
        match event {
            Event::Start(Tag::CodeBlock(_)) => in_code += 1,
            Event::End(TagEnd::CodeBlock) => in_code = in_code.saturating_sub(1),
            Event::Text(t) if in_code == 0 => prose.push_str(&t),
            Event::SoftBreak | Event::HardBreak => prose.push('\n'),
            Event::End(_) => prose.push('\n'),
            // Inline code is a quotation, not the assistant saying it.
            Event::Code(_) => prose.push_str(" `code` "),
            _ => {}
        }
    }
    prose
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mentions_count_anywhere_in_prose_but_not_in_code() {
        assert!(mentions("Looks right. APPROVED, ship it.", "APPROVED"));
        assert!(!mentions("NOT_APPROVED yet", "APPROVED"));
        assert!(!mentions("```python\nprint('APPROVED')\n```", "APPROVED"));
        assert!(!mentions("Say `APPROVED` when done", "APPROVED"));
    }

    #[test]
    fn counts_only_at_the_end_of_prose() {
        let t = "TERMINATE";
        assert!(says_terminate("Done.\n\nTERMINATE", t));
        assert!(says_terminate("All good. TERMINATE.", t));
        assert!(says_terminate("**TERMINATE**", t));
        assert!(says_terminate("TERMINATE\n\n```python\nprint(1)\n```\n", t));
        assert!(!says_terminate(
            "I will say TERMINATE when done. Running:\n```python\nx\n```",
            t
        ));
        assert!(!says_terminate("terminate", t));
        assert!(!says_terminate("NOT_TERMINATE", t));
        assert!(!says_terminate("```python\nprint('TERMINATE')\n```", t));
        assert!(!says_terminate("Reply with `TERMINATE`", t));
        assert!(says_terminate("finished -> DONE", "DONE"));
    }

    #[test]
    fn termination_blocks_and_summary() {
        assert!(is_termination_block("TERMINATE\n", "TERMINATE"));
        assert!(!is_termination_block("print('TERMINATE')", "TERMINATE"));
        assert_eq!(
            strip_termination("The answer is 4.\nTERMINATE", "TERMINATE"),
            "The answer is 4."
        );
    }
}
