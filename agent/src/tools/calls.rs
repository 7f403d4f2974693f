//! The model's tool calls: put together from streamed pieces, read from a whole reply, and
//! recognised in text where a small model writes them as prose.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;
use tandem_protocol::ToolCall;

/// One streamed piece of a tool call (`choices[].delta.tool_calls[]`).
#[derive(Debug, Deserialize)]
pub(crate) struct Piece {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<PieceFunction>,
}

#[derive(Debug, Deserialize)]
struct PieceFunction {
    #[serde(default)]
    name: Option<String>,
    /// Raw, so that a piece ending inside a surrogate pair (`"\ud83c"`), which is no string
    /// on its own, is joined with the next piece instead of failing the reply.
    #[serde(default)]
    arguments: Option<Box<RawValue>>,
}

/// A call being put together.
#[derive(Debug, Default)]
struct Partial {
    id: Option<String>,
    name: String,
    arguments: String,
    /// A leading surrogate whose trailing half is in the next piece.
    high: Option<u16>,
}

/// Puts streamed pieces together by their `index`, in whatever order the indexes come.
#[derive(Debug, Default)]
pub(crate) struct Assembler {
    calls: BTreeMap<u32, Partial>,
    last: Option<u32>,
    bytes: usize,
}

impl Assembler {
    /// Adds one piece.
    pub(crate) fn push(&mut self, piece: Piece) {
        // A server that sends no index starts a new call with each new id.
        let index = piece.index.unwrap_or_else(|| match (&piece.id, self.last) {
            (Some(id), Some(last))
                if self.calls.get(&last).and_then(|c| c.id.as_ref()) != Some(id) =>
            {
                last + 1
            }
            (_, Some(last)) => last,
            (_, None) => 0,
        });
        self.last = Some(index);
        let call = self.calls.entry(index).or_default();
        if let Some(id) = piece.id.filter(|id| !id.is_empty()) {
            call.id.get_or_insert(id);
        }
        let Some(function) = piece.function else {
            return;
        };
        if let Some(name) = function.name {
            self.bytes += name.len();
            call.name.push_str(&name);
        }
        if let Some(raw) = function.arguments {
            let before = call.arguments.len();
            let raw = raw.get();
            if raw.starts_with('"') {
                decode_string(raw, &mut call.arguments, &mut call.high);
            } else if raw != "null" {
                // Some servers send the arguments as an object, not as JSON text.
                call.arguments.push_str(raw);
            }
            self.bytes += call.arguments.len() - before;
        }
    }

    /// Bytes of names and arguments so far, which count against the reply's cap.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The calls, in index order; a call with no id gets one.
    pub(crate) fn finish(self) -> Vec<ToolCall> {
        self.calls
            .into_iter()
            .enumerate()
            .map(|(n, (_, mut call))| {
                if call.high.take().is_some() {
                    call.arguments.push(char::REPLACEMENT_CHARACTER);
                }
                ToolCall {
                    id: bounded(call.id.unwrap_or_else(|| format!("call_{}", n + 1))),
                    name: bounded(call.name),
                    arguments: call.arguments,
                }
            })
            .collect()
    }
}

/// Longest call name or id kept: no tool's name is longer than 64 characters, and a call's
/// name and id go back to the model with every later turn of the conversation.
const MAX_CALL_NAME: usize = 128;

/// `name` cut to [`MAX_CALL_NAME`] bytes, marked where it was cut.
fn bounded(mut name: String) -> String {
    if name.len() > MAX_CALL_NAME {
        name.truncate(name.floor_char_boundary(MAX_CALL_NAME));
        name.push('…');
    }
    name
}

/// Decodes the JSON string `raw` (quotes included) onto `out`, carrying a leading surrogate
/// left at its end in `high`; an unpaired surrogate becomes U+FFFD.
fn decode_string(raw: &str, out: &mut String, high: &mut Option<u16>) {
    let inner = raw
        .strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .unwrap_or(raw);
    let mut chars = inner.chars();
    let plain = |c: char, out: &mut String, high: &mut Option<u16>| {
        if high.take().is_some() {
            out.push(char::REPLACEMENT_CHARACTER);
        }
        out.push(c);
    };
    while let Some(c) = chars.next() {
        if c != '\\' {
            plain(c, out, high);
            continue;
        }
        let escaped = match chars.next() {
            Some('n') => '\n',
            Some('t') => '\t',
            Some('r') => '\r',
            Some('b') => '\u{8}',
            Some('f') => '\u{c}',
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                let Ok(unit) = u16::from_str_radix(&hex, 16) else {
                    plain(char::REPLACEMENT_CHARACTER, out, high);
                    continue;
                };
                match unit {
                    0xD800..=0xDBFF => {
                        if high.replace(unit).is_some() {
                            out.push(char::REPLACEMENT_CHARACTER);
                        }
                    }
                    0xDC00..=0xDFFF => match high.take() {
                        Some(h) => {
                            let code = 0x10000
                                + ((u32::from(h) - 0xD800) << 10)
                                + (u32::from(unit) - 0xDC00);
                            out.push(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER));
                        }
                        None => out.push(char::REPLACEMENT_CHARACTER),
                    },
                    _ => plain(
                        char::from_u32(u32::from(unit)).unwrap_or(char::REPLACEMENT_CHARACTER),
                        out,
                        high,
                    ),
                }
                continue;
            }
            Some(other) => other,
            None => break,
        };
        plain(escaped, out, high);
    }
}

/// A tool call in a whole (not streamed) reply.
#[derive(Debug, Deserialize)]
pub(crate) struct WholeCall {
    #[serde(default)]
    id: Option<String>,
    function: WholeFunction,
}

#[derive(Debug, Deserialize)]
struct WholeFunction {
    name: String,
    #[serde(default)]
    arguments: serde_json::Value,
}

/// The calls of a whole reply; arguments sent as an object are taken as its JSON text.
pub(crate) fn whole(calls: &[WholeCall]) -> Vec<ToolCall> {
    calls
        .iter()
        .enumerate()
        .map(|(n, c)| ToolCall {
            id: bounded(
                c.id.clone()
                    .filter(|id| !id.is_empty())
                    .unwrap_or_else(|| format!("call_{}", n + 1)),
            ),
            name: bounded(c.function.name.clone()),
            arguments: match &c.function.arguments {
                serde_json::Value::String(text) => text.clone(),
                serde_json::Value::Null => String::new(),
                other => other.to_string(),
            },
        })
        .collect()
}

/// The tool calls a model wrote as text: `<tool_call>{...}</tool_call>` elements, a
/// `<tools>[...]</tools>` element, or a reply that is nothing but a JSON object (or a list of
/// them, fenced or not) naming a tool `known` knows. Each has a made-up id (`text_call_N`).
pub fn calls_in_text(text: &str, known: &dyn Fn(&str) -> bool) -> Vec<ToolCall> {
    let mut found = Vec::new();
    for tag in ["tool_call", "tools"] {
        let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
        let mut rest = text;
        while let Some(start) = rest.find(&open) {
            let after = &rest[start + open.len()..];
            let (inner, next) = match after.find(&close) {
                Some(end) => (&after[..end], &after[end + close.len()..]),
                // A reply cut off (or a model that forgot to close) still meant the call.
                None => (after, ""),
            };
            for value in json_values(inner).into_iter().flatten() {
                collect(&value, &mut found, &|_| true);
            }
            rest = next;
        }
    }
    if found.is_empty() {
        let bare = text.trim();
        // One fenced block, whatever its info string says (small models fence a call as
        // `python` as often as `json`).
        let bare = bare
            .strip_prefix("```")
            .and_then(|b| b.split_once('\n'))
            .and_then(|(_, b)| b.trim_end().strip_suffix("```"))
            .unwrap_or(bare);
        // One value, or several one after another (a model that makes two calls may write
        // two objects): all of the text must be JSON.
        for value in json_values(bare).into_iter().flatten() {
            collect(&value, &mut found, known);
        }
    }
    found
        .into_iter()
        .enumerate()
        .map(|(n, (name, arguments))| ToolCall {
            id: format!("text_call_{}", n + 1),
            name: bounded(name),
            arguments,
        })
        .collect()
}

/// The JSON values `text` is made of, one or several one after another; `None` when any of
/// it is not JSON.
fn json_values(text: &str) -> Option<Vec<serde_json::Value>> {
    serde_json::Deserializer::from_str(text.trim())
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .ok()
        .filter(|v| !v.is_empty())
}

/// Whether `code` is nothing but JSON (a call written as a fenced block, not code to run).
pub fn is_json(code: &str) -> bool {
    json_values(code).is_some()
}

/// Calls in `value`: an object with a `name` and `arguments` (or `parameters`), or a list of
/// such objects.
fn collect(
    value: &serde_json::Value,
    found: &mut Vec<(String, String)>,
    known: &dyn Fn(&str) -> bool,
) {
    match value {
        serde_json::Value::Array(items) => {
            for item in items {
                collect(item, found, known);
            }
        }
        serde_json::Value::Object(map) => {
            let call = map
                .get("function")
                .and_then(|f| f.as_object())
                .unwrap_or(map);
            let Some(name) = call.get("name").and_then(|n| n.as_str()) else {
                return;
            };
            // An unknown name still makes a call of an object shaped as nothing but one:
            // the model is then told which tools there are.
            let shaped = call.contains_key("arguments") || call.contains_key("parameters");
            let only_a_call = call
                .keys()
                .all(|k| ["name", "arguments", "parameters", "id", "type"].contains(&k.as_str()));
            if !(known(name) || shaped && only_a_call) {
                return;
            }
            let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
                Some(serde_json::Value::String(text)) => text.clone(),
                Some(other) => other.to_string(),
                None => "{}".to_owned(),
            };
            found.push((name.to_owned(), arguments));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(json: &str) -> Piece {
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    #[test]
    fn pieces_join_by_index_even_interleaved_and_split_inside_escapes_and_characters() {
        let mut a = Assembler::default();
        for p in [
            r#"{"index":1,"id":"call_b","type":"function","function":{"name":"wc","arguments":""}}"#,
            r#"{"index":0,"id":"call_a","type":"function","function":{"name":"execute_code","arguments":"{\"code\": \"print('\\"}}"#,
            r#"{"index":1,"function":{"arguments":"{\"text\": \"caf"}}"#,
            r#"{"index":0,"function":{"arguments":"u00e9 \ud83c"}}"#,
            r#"{"index":1,"function":{"arguments":"\u00e9\"}"}}"#,
            r#"{"index":0,"function":{"arguments":"\udf89')\", \"language\": \"python\"}"}}"#,
        ] {
            a.push(piece(p));
        }
        assert_eq!(
            a.finish(),
            [
                ToolCall {
                    id: "call_a".into(),
                    name: "execute_code".into(),
                    arguments: r#"{"code": "print('\u00e9 🎉')", "language": "python"}"#.into(),
                },
                ToolCall {
                    id: "call_b".into(),
                    name: "wc".into(),
                    arguments: r#"{"text": "café"}"#.into(),
                },
            ]
        );
    }

    #[test]
    fn a_lone_surrogate_is_a_replacement_character_and_missing_ids_are_made() {
        let mut a = Assembler::default();
        a.push(piece(r#"{"function":{"name":"x","arguments":"\"\ud83c"}}"#));
        a.push(piece(r#"{"function":{"arguments":"\""}}"#));
        assert_eq!(
            a.finish(),
            [ToolCall {
                id: "call_1".into(),
                name: "x".into(),
                arguments: "\"\u{fffd}\"".into(),
            }]
        );
    }

    #[test]
    fn calls_written_as_text_are_recognised() {
        let known = |n: &str| n == "execute_code";
        let tagged = "Let me run it.\n<tool_call>\n{\"name\": \"execute_code\", \"arguments\": {\"code\": \"print(1)\"}}\n</tool_call>";
        assert_eq!(
            calls_in_text(tagged, &known),
            [ToolCall {
                id: "text_call_1".into(),
                name: "execute_code".into(),
                arguments: r#"{"code":"print(1)"}"#.into(),
            }]
        );
        let listed = r#"<tools>[{"name": "execute_code", "arguments": "{\"code\": \"1\"}"}, {"name": "nope", "parameters": {}}]</tools>"#;
        let calls = calls_in_text(listed, &known);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, r#"{"code": "1"}"#);
        assert_eq!(calls[1].name, "nope");
        let long = format!(
            r#"<tools>[{{"name": "{}", "arguments": {{}}}}]</tools>"#,
            "n".repeat(200_000)
        );
        let calls = calls_in_text(&long, &known);
        assert_eq!(calls[0].name, format!("{}…", "n".repeat(MAX_CALL_NAME)));
        // Objects one after another in the element, not a list.
        let listed = "<tools>\n  {\"name\": \"execute_code\", \"arguments\": {}}\n  {\"name\": \"wc\", \"arguments\": {}}\n</tools>";
        assert_eq!(calls_in_text(listed, &known).len(), 2);
        let bare = "```json\n{\"name\": \"execute_code\", \"arguments\": {\"code\": \"2\"}}\n```";
        assert_eq!(calls_in_text(bare, &known).len(), 1);
        // Fenced as Python, as a real 1.5B model wrote it.
        let fenced = "```python\n{\n  \"name\": \"execute_code\",\n  \"arguments\": {\"code\": \"3\"}\n}\n```";
        assert_eq!(calls_in_text(fenced, &known).len(), 1);
        // Two objects one after the other, in one fence.
        let two = "```python\n{\"name\": \"execute_code\", \"arguments\": {\"code\": \"1\"}}\n{\"name\": \"execute_code\", \"arguments\": {\"code\": \"2\"}}\n```";
        assert_eq!(calls_in_text(two, &known).len(), 2);
        assert!(
            calls_in_text(
                "{\"name\": \"execute_code\", \"arguments\": {}} and prose",
                &known
            )
            .is_empty()
        );
        // A bare object counts when it names a tool the model has, or is shaped as nothing
        // but a call (then the model is told its tool is unknown); other JSON is not a call.
        assert_eq!(
            calls_in_text(r#"{"name": "python", "arguments": {}}"#, &known).len(),
            1
        );
        assert!(calls_in_text(r#"{"name": "Bob", "age": 7, "arguments": {}}"#, &known).is_empty());
        assert!(calls_in_text(r#"{"name": "Bob"}"#, &known).is_empty());
        assert!(calls_in_text("Just prose with {braces}.", &known).is_empty());
    }
}
