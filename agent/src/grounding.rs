//! Answers grounded in what ran: the blocks a model writes as its code's output (claims, not
//! programs), the values a statement and an output hold, whether they disagree, and the
//! task's answer at its end.

use pulldown_cmark::{CodeBlockKind, Event, Parser, Tag};
use tandem_executor::Language;

/// What the message that tells a model its statement and its code's output disagree says;
/// the model's answer to it may end the task as an answer after a clean run does.
pub const TOLD_MARK: &str = "What your code printed is what ran.";

/// Most bytes of an answer kept; the middle of a longer one is cut, as output is.
pub const ANSWER_CAP: usize = 8 * 1024;

/// Whether a block in `language` is what the model says its code printed: shown output, not
/// data to keep and not a program.
pub fn is_claim_language(language: &Language) -> bool {
    matches!(
        language.as_str(),
        "output"
            | "out"
            | "console"
            | "text"
            | "txt"
            | "plaintext"
            | "plain"
            | "stdout"
            | "result"
            | "results"
    )
}

/// Whether an untagged block is only a value (a number, a quoted string, a list of them),
/// which a model writes as what it expects its code to print; run as Python it would do
/// nothing.
pub fn is_literal(code: &str) -> bool {
    let lines: Vec<&str> = code
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    !lines.is_empty()
        && lines.len() <= 20
        && lines.iter().all(|l| {
            l.chars().any(|c| c.is_ascii_digit())
                && l.chars().all(|c| {
                    c.is_ascii_digit()
                        || c.is_whitespace()
                        || matches!(
                            c,
                            '.' | ','
                                | '-'
                                | '+'
                                | '['
                                | ']'
                                | '('
                                | ')'
                                | '\''
                                | '"'
                                | ':'
                                | '%'
                                | '$'
                                | 'e'
                                | 'E'
                                | '/'
                        )
                })
        })
}

/// The numbers written in `text`: digits with `,` between groups of three, a sign and a
/// decimal part; `$` and `%` are not part of them.
pub fn numbers(text: &str) -> Vec<f64> {
    written_numbers(text).into_iter().map(|(n, _)| n).collect()
}

/// [`numbers`], each with how many decimal places it was written with.
fn written_numbers(text: &str) -> Vec<(f64, i32)> {
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !bytes[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        // A digit right after a letter or `_` is part of a name (`x2`, `log10`).
        let start = i;
        let named =
            start > 0 && (bytes[start - 1].is_ascii_alphabetic() || bytes[start - 1] == b'_');
        let mut digits = String::new();
        while i < bytes.len() {
            let b = bytes[i];
            if b.is_ascii_digit() {
                digits.push(char::from(b));
                i += 1;
            } else if b == b','
                && bytes
                    .get(i + 1..i + 4)
                    .is_some_and(|g| g.iter().all(u8::is_ascii_digit))
                && !bytes.get(i + 4).is_some_and(u8::is_ascii_digit)
            {
                i += 1;
            } else {
                break;
            }
        }
        if bytes.get(i) == Some(&b'.') && bytes.get(i + 1).is_some_and(u8::is_ascii_digit) {
            digits.push('.');
            i += 1;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                digits.push(char::from(bytes[i]));
                i += 1;
            }
        }
        if named {
            continue;
        }
        let negative = start > 0
            && bytes[start - 1] == b'-'
            && !(start > 1 && bytes[start - 2].is_ascii_alphanumeric());
        let places = digits
            .split_once('.')
            .map_or(0, |(_, f)| i32::try_from(f.len()).unwrap_or(i32::MAX));
        if let Ok(n) = digits.parse::<f64>() {
            found.push((if negative { -n } else { n }, places));
        }
    }
    found
}

/// Whether two numbers are the same value as people write them (`19` and `19.0`, `0.1 + 0.2`
/// and `0.3`).
fn same(a: f64, b: f64, tolerance: f64) -> bool {
    (a - b).abs() <= tolerance.max(1e-9 * a.abs().max(b.abs()).max(1.0))
}

/// `n` as people write it: no `.0` on a whole number.
fn written(n: f64) -> String {
    if n.fract() == 0.0 && n.abs() < 1e15 {
        format!("{n:.0}")
    } else {
        format!("{n}")
    }
}

/// The last non-empty line of `text`, trimmed.
fn last_line(text: &str) -> Option<&str> {
    text.lines().map(str::trim).rfind(|l| !l.is_empty())
}

/// Where what the code printed and what the model says of it disagree, in one sentence for
/// the model; `None` when they agree or cannot be compared. They disagree when the last line
/// printed holds numbers and the statement holds numbers, none of them the same, or when the
/// last line printed is a number alone and the statement holds none.
pub fn disagreement(printed: &str, said: &str) -> Option<String> {
    let line = last_line(printed)?;
    let printed_numbers = written_numbers(line);
    if printed_numbers.is_empty() {
        return None;
    }
    // A statement with an answer line is held to that line.
    let said_numbers = match labelled(said) {
        Some(line) => written_numbers(&line),
        None => written_numbers(said),
    };
    let bare = printed_numbers.len() == 1 && is_literal(line);
    let shown = |text: &str| clip(text.trim(), 200);
    if said_numbers.is_empty() {
        return bare.then(|| {
            format!(
                "Your code printed {}; your reply does not say it.",
                shown(line)
            )
        });
    }
    // A number said rounded from one printed (3.333 of 3.3333, 19 of 19.4) agrees with it.
    let agree = said_numbers.iter().any(|(s, s_places)| {
        printed_numbers.iter().any(|(p, p_places)| {
            let places = (*s_places).min(*p_places).min(15);
            same(*p, *s, 0.5 * 10f64.powi(-places))
        })
    });
    (!agree).then(|| {
        let mut said: Vec<String> = Vec::new();
        for (n, _) in said_numbers {
            let n = written(n);
            if !said.contains(&n) {
                said.push(n);
            }
        }
        let said = match said.as_slice() {
            [one] => one.clone(),
            [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
            [] => String::new(),
        };
        format!("Your code printed {}; your reply says {said}.", shown(line))
    })
}

/// What a claim (a block the model wrote as its code's output) and what the code printed
/// differ in, for the model; `None` when they hold the same lines.
pub fn claim_differs(claim: &str, printed: &str) -> Option<String> {
    let lines = |t: &str| -> Vec<String> {
        t.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    };
    if lines(claim) == lines(printed) {
        return None;
    }
    let (claim, printed) = (claim.trim(), printed.trim());
    Some(if !claim.contains('\n') && !printed.contains('\n') {
        format!(
            "Your code printed {}; your reply says {}.",
            shown_value(printed),
            shown_value(claim)
        )
    } else {
        format!(
            "Your code printed:\n{}\nYour reply says it printed:\n{}",
            clip(printed, 1000),
            clip(claim, 1000)
        )
    })
}

fn shown_value(text: &str) -> String {
    if text.is_empty() {
        "nothing".to_owned()
    } else {
        clip(text, 200)
    }
}

/// `text` cut to about `cap` bytes: its head and tail, at character boundaries, with a note
/// where the middle was.
pub fn clip(text: &str, cap: usize) -> String {
    if text.len() <= cap {
        return text.to_owned();
    }
    let head = text.floor_char_boundary(cap / 2);
    let tail = text.floor_char_boundary(text.len() - cap / 2);
    format!(
        "{}\n[... {} bytes cut ...]\n{}",
        &text[..head],
        tail - head,
        &text[tail..]
    )
}

/// A reply's statement: its words without the blocks of code it sent or of output it
/// claimed, and without the termination words; data blocks (a JSON answer) are kept.
pub fn statement(reply: &str, words: &[String]) -> String {
    let mut cuts = Vec::new();
    for (event, range) in Parser::new(reply).into_offset_iter() {
        if let Event::Start(Tag::CodeBlock(kind)) = event {
            let language = match &kind {
                CodeBlockKind::Fenced(info) => info.split_whitespace().next().map(Language::new),
                CodeBlockKind::Indented => None,
            };
            let keep = language
                .as_ref()
                .is_some_and(|l| l.is_data() && !is_claim_language(l));
            if !keep {
                cuts.push(range);
            }
        }
    }
    let mut text = String::with_capacity(reply.len());
    let mut at = 0;
    for range in cuts {
        if range.start >= at {
            text.push_str(&reply[at..range.start]);
            at = range.end;
        }
    }
    text.push_str(&reply[at.min(reply.len())..]);
    for word in words.iter().filter(|w| !w.is_empty()) {
        text = text.replace(word.as_str(), "");
    }
    let mut out = String::new();
    let mut blank = false;
    for line in text.lines().map(str::trim_end) {
        if line.trim().is_empty() {
            blank = !out.is_empty();
            continue;
        }
        if blank {
            out.push('\n');
            blank = false;
        }
        out.push_str(line);
        out.push('\n');
    }
    out.trim().to_owned()
}

/// What follows `Answer:` on the last line of `text` that starts with it (markdown marks
/// aside).
fn labelled(text: &str) -> Option<String> {
    text.lines().rev().find_map(|l| {
        let l = l.trim().trim_start_matches(['*', '#', '-', '>', ' ']);
        let head = l.get(..7)?;
        head.eq_ignore_ascii_case("answer:")
            .then(|| l[7..].trim_start_matches(['*', ' ']).to_owned())
    })
}

/// The line of an answer a value is read from: the last that starts with `Answer:`
/// (markdown marks aside), else the last non-empty line.
pub fn answer_line(answer: &str) -> String {
    labelled(answer)
        .or_else(|| last_line(answer).map(str::to_owned))
        .unwrap_or_default()
        .replace(['*', '`'], "")
        .trim()
        .to_owned()
}

/// Whether `line` gives `value`: a number among its numbers (within `tolerance`), a string
/// among its words (any case), or a list's items in order.
pub fn gives(line: &str, value: &serde_json::Value, tolerance: f64) -> bool {
    use serde_json::Value;
    match value {
        Value::Number(n) => n
            .as_f64()
            .is_some_and(|v| numbers(line).iter().any(|x| same(*x, v, tolerance))),
        Value::String(s) => has_words(line, s),
        Value::Array(items) => {
            let found = list_items(line);
            found.len() == items.len()
                && found.iter().zip(items).all(|(f, item)| match item {
                    Value::Number(n) => n.as_f64().is_some_and(|v| {
                        let got = numbers(f);
                        got.len() == 1 && same(got[0], v, tolerance)
                    }),
                    Value::String(s) => f.eq_ignore_ascii_case(s.trim()),
                    _ => false,
                })
        }
        _ => false,
    }
}

/// Whether `needle` is in `line` as whole words, in any case.
fn has_words(line: &str, needle: &str) -> bool {
    let (line, needle) = (line.to_lowercase(), needle.trim().to_lowercase());
    if needle.is_empty() {
        return false;
    }
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    line.match_indices(&needle).any(|(at, _)| {
        !word(line[..at].chars().next_back()) && !word(line[at + needle.len()..].chars().next())
    })
}

/// The items of a list written in `line`: inside its first `[...]` when it has one, else
/// separated by commas; quotes and spaces around each are not part of it.
fn list_items(line: &str) -> Vec<String> {
    let inner = match (line.find('['), line.rfind(']')) {
        (Some(open), Some(close)) if open < close => &line[open + 1..close],
        _ => line,
    };
    inner
        .split(',')
        .map(|item| {
            item.trim()
                .trim_matches(|c: char| matches!(c, '\'' | '"' | '.' | ' '))
                .to_owned()
        })
        .filter(|item| !item.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numbers_as_people_write_them() {
        assert_eq!(numbers("It costs $1,234.50 (12%)."), vec![1234.5, 12.0]);
        assert_eq!(numbers("x2 = -3 and 4-5"), vec![-3.0, 4.0, 5.0]);
        assert_eq!(
            numbers("1,23 and 10,000,000"),
            vec![1.0, 23.0, 10_000_000.0]
        );
        assert!(numbers("no digits").is_empty());
    }

    #[test]
    fn a_statement_and_an_output_disagree_only_on_their_numbers() {
        assert_eq!(
            disagreement("total\n19\n", "The answer is 20."),
            Some("Your code printed 19; your reply says 20.".to_owned())
        );
        assert_eq!(disagreement("19\n", "There are 19 apples."), None);
        assert_eq!(disagreement("19.0\n", "19"), None);
        // Rounded is not contradicted.
        assert_eq!(disagreement("3.3333333\n", "Answer: 3.333"), None);
        assert!(disagreement("3.3333333\n", "Answer: 3.34").is_some());
        // An answer line is what is held to the output.
        assert!(disagreement("19\n", "Apples: 19\nAnswer: 20").is_some());
        assert_eq!(
            disagreement("19\n", "I apologize for the confusion."),
            Some("Your code printed 19; your reply does not say it.".to_owned())
        );
        // Words printed cannot be compared with numbers said.
        assert_eq!(disagreement("done\n", "it is 3"), None);
        assert_eq!(
            disagreement("Saved 120 bytes\n", "The file is written."),
            None
        );
    }

    #[test]
    fn a_claim_is_compared_line_by_line() {
        assert_eq!(claim_differs("19\n", "  19\n\n"), None);
        assert_eq!(
            claim_differs("20", "19\n"),
            Some("Your code printed 19; your reply says 20.".to_owned())
        );
        assert!(
            claim_differs("1\n2", "1\n3")
                .unwrap()
                .contains("Your code printed:\n1\n3")
        );
    }

    #[test]
    fn untagged_values_are_claims_and_code_is_not() {
        assert!(is_literal("20\n"));
        assert!(is_literal("[1, 2, 3]"));
        assert!(is_literal("3.14\n-2"));
        assert!(!is_literal("print(20)"));
        assert!(!is_literal("x = 1"));
        assert!(!is_literal("\n"));
    }

    #[test]
    fn the_statement_is_the_words_without_code_claims_or_the_word() {
        let words = vec!["TERMINATE".to_owned()];
        let reply = "Let me compute.\n```python\nprint(19)\n```\n```output\n20\n```\nThe answer is 20.\n\nTERMINATE";
        assert_eq!(
            statement(reply, &words),
            "Let me compute.\n\nThe answer is 20."
        );
        let data = "Here:\n```json\n{\"a\": 1}\n```\nTERMINATE";
        assert!(statement(data, &words).contains("{\"a\": 1}"));
        assert_eq!(statement("TERMINATE", &words), "");
    }

    #[test]
    fn values_are_read_from_the_answer_line() {
        assert_eq!(answer_line("Work...\n**Answer:** 42\nTERMINATE"), "42");
        assert_eq!(
            answer_line("first\nThe total is `19`.\n"),
            "The total is 19."
        );
        assert!(gives("The total is $1,234.50.", &json!(1234.5), 0.0));
        assert!(gives("about 3.33333", &json!(3.33), 0.01));
        assert!(!gives("about 3.4", &json!(3.33), 0.01));
        assert!(gives("It was a Tuesday.", &json!("tuesday"), 0.0));
        assert!(!gives("Tuesdays", &json!("tuesday"), 0.0));
        assert!(gives("[1, 2, 3]", &json!([1, 2, 3]), 0.0));
        assert!(gives("'ann', 'bo'", &json!(["Ann", "Bo"]), 0.0));
        assert!(!gives("[1, 3, 2]", &json!([1, 2, 3]), 0.0));
    }

    #[test]
    fn long_output_keeps_its_head_and_tail() {
        assert_eq!(clip("short", 10), "short");
        let cut = clip(&format!("{}{}", "a".repeat(50), "z".repeat(50)), 20);
        assert_eq!(
            cut,
            format!(
                "{}\n[... 80 bytes cut ...]\n{}",
                "a".repeat(10),
                "z".repeat(10)
            )
        );
        // Never inside a character.
        let cut = clip(&"é".repeat(20), 9);
        assert!(cut.starts_with("éé\n[..."), "{cut}");
    }
}
