//! Fenced code blocks out of a markdown reply, following CommonMark (pulldown-cmark).

use std::ops::Range;

use pulldown_cmark::{CodeBlockKind, Event, Parser, Tag, TagEnd};
use serde::{Deserialize, Serialize};
use tandem_executor::Language;

/// A fenced code block found in a reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeBlock {
    /// Alias-normalised first word of the info string; `None` when untagged.
    pub language: Option<String>,
    /// The whole info string, attributes included.
    pub info: String,
    /// The code, with `\n` line endings.
    pub code: String,
    /// The reply ended before the closing fence (it was probably cut off).
    pub unterminated: bool,
}

/// HTML blocks are searched for fences this many levels deep.
const MAX_HTML_DEPTH: u8 = 2;

/// Every non-empty fenced block, in order. Indented blocks and inline code are ignored.
pub fn extract_code_blocks(markdown: &str) -> Vec<CodeBlock> {
    let mut blocks = Vec::new();
    collect(markdown, 0, &mut blocks);
    blocks
}

fn collect(markdown: &str, depth: u8, out: &mut Vec<CodeBlock>) {
    let mut current: Option<(String, Range<usize>, String)> = None;
    let mut html: Option<String> = None;
    for (event, range) in Parser::new(markdown).into_offset_iter() {
        match event {
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(info))) => {
                current = Some((info.into_string(), range, String::new()));
            }
            Event::Text(text) => {
                if let Some((_, _, code)) = current.as_mut() {
                    code.push_str(&text);
                }
            }
            Event::End(TagEnd::CodeBlock) => {
                if let Some((info, range, code)) = current.take() {
                    let code = code.replace("\r\n", "\n");
                    if code.trim().is_empty() {
                        continue;
                    }
                    out.push(CodeBlock {
                        language: language_of(&info),
                        unterminated: !is_closed(&markdown[range]),
                        info: info.trim().to_owned(),
                        code,
                    });
                }
            }
            Event::Start(Tag::HtmlBlock) => html = Some(String::new()),
            Event::Html(text) => {
                if let Some(buf) = html.as_mut() {
                    buf.push_str(&text);
                }
            }
            Event::End(TagEnd::HtmlBlock) => {
                if let Some(buf) = html.take()
                    && depth < MAX_HTML_DEPTH
                {
                    collect(&strip_tag_lines(&buf), depth + 1, out);
                }
            }
            _ => {}
        }
    }
}

/// Models wrap code in `<details>` or `<div>` without the blank line CommonMark needs to
/// end the HTML block; blanking the tag-only lines lets the fences inside parse.
fn strip_tag_lines(html: &str) -> String {
    html.lines()
        .map(|line| {
            let t = line.trim();
            if t.starts_with('<') && t.ends_with('>') {
                ""
            } else {
                line
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first word of an info string (`python title="x"`, `{.python}`, `js:app.js`),
/// normalised.
fn language_of(info: &str) -> Option<String> {
    let word = info.split_whitespace().next()?;
    let word = word.trim_start_matches(['{', '.']);
    let end = word.find([',', ':', '{', '}', ';']).unwrap_or(word.len());
    let word = &word[..end];
    (!word.is_empty()).then(|| Language::new(word).as_str().to_owned())
}

/// Whether the source of a fenced block ends with a closing fence. pulldown-cmark closes an
/// open fence silently at the end of the document, so this is how a cut-off reply shows.
fn is_closed(source: &str) -> bool {
    let source = source.trim_end_matches(['\n', '\r']);
    let mut lines = source.lines();
    let Some(open) = lines.next() else {
        return false;
    };
    let open = open.trim_start();
    let Some(fence_char) = open.chars().next() else {
        return false;
    };
    let fence_len = open.chars().take_while(|c| *c == fence_char).count();
    let Some(last) = lines.last() else {
        return false;
    };
    // Closing lines inside block quotes carry their `>` markers.
    let last = last
        .trim()
        .trim_start_matches(|c: char| c == '>' || c.is_whitespace());
    let close_len = last.chars().take_while(|c| *c == fence_char).count();
    close_len >= fence_len && last.chars().all(|c| c == fence_char)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(lang: Option<&str>, info: &str, code: &str, unterminated: bool) -> CodeBlock {
        CodeBlock {
            language: lang.map(str::to_owned),
            info: info.to_owned(),
            code: code.to_owned(),
            unterminated,
        }
    }

    #[test]
    fn backtick_and_tilde_fences_of_any_length() {
        let md =
            "a\n```py\nprint(1)\n```\n~~~bash\necho hi\n~~~\n`````js\nconsole.log('```')\n`````\n";
        assert_eq!(
            extract_code_blocks(md),
            vec![
                one(Some("python"), "py", "print(1)\n", false),
                one(Some("sh"), "bash", "echo hi\n", false),
                one(Some("javascript"), "js", "console.log('```')\n", false),
            ]
        );
    }

    #[test]
    fn fences_in_lists_quotes_and_html() {
        let md = "1. step\n   ```python\n   x = 1\n   ```\n\n> ```sh\n> ls\n> ```\n\n<details>\n<summary>code</summary>\n```python\nprint(2)\n```\n</details>\n";
        assert_eq!(
            extract_code_blocks(md),
            vec![
                one(Some("python"), "python", "x = 1\n", false),
                one(Some("sh"), "sh", "ls\n", false),
                one(Some("python"), "python", "print(2)\n", false),
            ]
        );
    }

    #[test]
    fn info_attributes_and_crlf() {
        let md = "```python title=\"x.py\"\r\nprint(1)\r\nprint(2)\r\n```\r\n";
        assert_eq!(
            extract_code_blocks(md),
            vec![one(
                Some("python"),
                "python title=\"x.py\"",
                "print(1)\nprint(2)\n",
                false
            )]
        );
    }

    #[test]
    fn never_indented_or_inline_and_skips_empty() {
        let md = "Use `print(1)` inline.\n\n    indented = True\n\n```python\n   \n```\n\n```\nuntagged\n```\n";
        assert_eq!(
            extract_code_blocks(md),
            vec![one(None, "", "untagged\n", false)]
        );
    }

    #[test]
    fn cut_off_fence_is_unterminated() {
        let md = "Here:\n```python\nfor i in range(3):\n    print(i)";
        assert_eq!(
            extract_code_blocks(md),
            vec![one(
                Some("python"),
                "python",
                "for i in range(3):\n    print(i)",
                true
            )]
        );
        let md = "````python\nprint('```')\n```\n";
        assert!(extract_code_blocks(md)[0].unterminated);
    }
}
