//! Results a program can read: a task's output schema (a JSON Schema), the words that ask the
//! model to end with a matching JSON value, and that value found in its final answer and
//! checked, or what the model is told when there is none.

use serde_json::Value;

/// Most of an answer's end searched for a JSON value: a value is at the end of an answer,
/// and a reply can be a megabyte.
const SEARCHED: usize = 64 << 10;
/// Most places a value may start that are tried.
const STARTS: usize = 256;
/// Most validation errors the model is told of.
const TOLD: usize = 5;
/// The stack a validation runs on: it recurses once per level of the schema and the value.
const VALIDATION_STACK: usize = 64 << 20;
/// Longest a validation of one answer may take.
const VALIDATION_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// A task's output schema, compiled once.
#[derive(Clone, Debug)]
pub struct OutputSchema {
    schema: Value,
    validator: jsonschema::Validator,
}

impl OutputSchema {
    /// `schema` compiled; one that is not a JSON Schema (or refers to another document, which
    /// is never fetched) is an error naming the problem.
    pub fn new(schema: &Value) -> Result<Self, String> {
        bounded(schema).map_err(|e| format!("output_schema: {e}"))?;
        let validator = jsonschema::validator_for(schema)
            .map_err(|e| format!("output_schema: not a JSON Schema this daemon can use: {e}"))?;
        Ok(Self {
            schema: schema.clone(),
            validator,
        })
    }

    /// What the model is asked, after the task: to end its final answer with the value.
    pub fn instructions(&self) -> String {
        format!(
            "When the task is done, end your final answer with a JSON value that matches this JSON Schema, alone in a ```json block:\n{}",
            serde_json::to_string_pretty(&self.schema).unwrap_or_else(|_| self.schema.to_string())
        )
    }

    /// The value `answer` ends with, when it matches; else what the model is told.
    pub fn take(&self, answer: &str) -> Result<Value, String> {
        let candidates = candidates(answer);
        if candidates.is_empty() {
            return Err(self.ask_again("No JSON value was found in it."));
        }
        let validator = self.validator.clone();
        // Validation recurses with the schema and the value: it runs on a thread of its own
        // with a large stack, and the answer is judged unmatched past the deadline.
        let (tx, rx) = std::sync::mpsc::channel();
        let judged = std::thread::Builder::new()
            .name("output-schema".to_owned())
            .stack_size(VALIDATION_STACK)
            .spawn(move || {
                let mut first_errors = None;
                for value in candidates {
                    let errors: Vec<String> = validator
                        .iter_errors(&value)
                        .take(TOLD)
                        .map(|e| {
                            let at = e.instance_path().as_str().to_owned();
                            let at = if at.is_empty() { "/".to_owned() } else { at };
                            format!("- at {at}: {e}")
                        })
                        .collect();
                    if errors.is_empty() {
                        let _ = tx.send(Ok(value));
                        return;
                    }
                    first_errors.get_or_insert(errors);
                }
                let _ = tx.send(Err(first_errors.unwrap_or_default()));
            })
            .ok()
            .and_then(|_| rx.recv_timeout(VALIDATION_DEADLINE).ok());
        let errors = match judged {
            Some(Ok(value)) => return Ok(value),
            Some(Err(errors)) => errors.join("\n"),
            None => format!(
                "- it could not be checked within {} s",
                VALIDATION_DEADLINE.as_secs()
            ),
        };
        Err(self.ask_again(&format!(
            "Its JSON value does not match the schema:\n{errors}"
        )))
    }

    fn ask_again(&self, problem: &str) -> String {
        format!(
            "Your final answer must end with a JSON value that matches the output schema. {problem}\nReply with the corrected value alone in a ```json block."
        )
    }
}

/// Most objects and arrays one client schema may hold.
pub const MAX_NODES: usize = 10_000;
/// Deepest a client schema may nest, each `$ref` counted as deep as what it names: conversion
/// and validation walk that deep, and a chain of references is depth no parser limit sees.
pub const MAX_DEPTH: usize = 64;
/// Most `$ref`s in one client schema.
pub const MAX_REFS: usize = 1_000;
/// Most ways one value may be read along a single path: the product of the sizes of the
/// `anyOf`s, `oneOf`s and `type` lists nested in each other. A grammar keeps every reading
/// alive at once, so nesting them multiplies the engine's work with each bracket.
pub const MAX_READINGS: u64 = 256;

/// A bound a client's JSON Schema passes, found before it is compiled, validated or made a
/// grammar; the message names the bound and where it was passed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unbounded {
    /// Too many objects and arrays.
    #[error("has more than {MAX_NODES} objects and arrays; send a smaller schema")]
    Nodes,
    /// Too deep, counting references.
    #[error(
        "nests deeper than {MAX_DEPTH} levels at {at}, each `$ref` counted as deep as what it names; flatten it"
    )]
    Depth {
        /// Where, as a JSON pointer into the schema.
        at: String,
    },
    /// Too many references.
    #[error("has more than {MAX_REFS} `$ref`s; inline or merge definitions")]
    Refs,
    /// A reference to something outside the schema, which is never fetched.
    #[error(
        "`$ref` `{target}` at {at} is not a reference into this schema (`#` or `#/...`); other documents are never fetched"
    )]
    NotLocal {
        /// Where.
        at: String,
        /// What it names.
        target: String,
    },
    /// A reference to nothing.
    #[error("`$ref` `{target}` at {at} names nothing in this schema")]
    Missing {
        /// Where.
        at: String,
        /// What it names.
        target: String,
    },
    /// References that lead back to themselves.
    #[error(
        "`$ref` at {at} leads back to itself: recursive schemas are not accepted; write out the levels you need"
    )]
    Cycle {
        /// Where.
        at: String,
    },
    /// A reference resolved by where it is used, or a nested base that moves what `#` names:
    /// either would let a validator follow what this check did not.
    #[error(
        "`{keyword}` at {at} is not accepted in a client's schema: use `$ref` to `#/...` from the root's `$defs`"
    )]
    Unfollowed {
        /// Where.
        at: String,
        /// The keyword.
        keyword: &'static str,
    },
    /// Alternatives nested so that a value has too many readings.
    #[error(
        "nests alternatives (`anyOf`, `oneOf`, `type` lists) so that a value at {at} can be read more than {MAX_READINGS} ways at once; make the alternatives fewer or not nested"
    )]
    Readings {
        /// Where.
        at: String,
    },
}

/// Checks `schema` against the bounds above without recursion, following local `$ref`s.
/// Every client schema passes here before anything else walks it.
pub fn bounded(schema: &Value) -> Result<(), Unbounded> {
    use std::collections::HashMap;

    // Each node's address in the tree is its identity; the tree is borrowed throughout.
    type Key = *const Value;
    struct Node<'a> {
        value: &'a Value,
        at: String,
    }
    enum Mark {
        Open,
        Done { depth: usize, readings: u64 },
    }

    let mut nodes = 0usize;
    let mut refs = 0usize;
    let mut marks: HashMap<Key, Mark> = HashMap::new();
    // (node, whether its children have been pushed)
    let mut stack: Vec<(Node<'_>, bool)> = vec![(
        Node {
            value: schema,
            at: String::new(),
        },
        false,
    )];
    fn children<'a>(schema: &'a Value, node: &Node<'a>) -> Result<Vec<Node<'a>>, Unbounded> {
        let mut out = Vec::new();
        match node.value {
            Value::Object(map) => {
                for keyword in ["$dynamicRef", "$recursiveRef", "$id"] {
                    let nested = keyword == "$id" && !node.at.is_empty();
                    if map.get(keyword).is_some_and(Value::is_string)
                        && (nested || keyword.ends_with("Ref"))
                    {
                        return Err(Unbounded::Unfollowed {
                            at: if node.at.is_empty() {
                                "/".to_owned()
                            } else {
                                node.at.clone()
                            },
                            keyword,
                        });
                    }
                }
                for (k, v) in map {
                    if v.is_object() || v.is_array() {
                        out.push(Node {
                            value: v,
                            at: format!("{}/{}", node.at, k.replace('~', "~0").replace('/', "~1")),
                        });
                    }
                }
                if let Some(Value::String(target)) = map.get("$ref") {
                    let at = if node.at.is_empty() {
                        "/".to_owned()
                    } else {
                        node.at.clone()
                    };
                    let Some(pointer) = target.strip_prefix('#') else {
                        return Err(Unbounded::NotLocal {
                            at,
                            target: target.clone(),
                        });
                    };
                    if !(pointer.is_empty() || pointer.starts_with('/')) {
                        return Err(Unbounded::NotLocal {
                            at,
                            target: target.clone(),
                        });
                    }
                    let decoded = percent_decoded(pointer);
                    let value = schema.pointer(&decoded).ok_or_else(|| Unbounded::Missing {
                        at: at.clone(),
                        target: target.clone(),
                    })?;
                    out.push(Node { value, at: decoded });
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    if v.is_object() || v.is_array() {
                        out.push(Node {
                            value: v,
                            at: format!("{}/{i}", node.at),
                        });
                    }
                }
            }
            _ => {}
        }
        Ok(out)
    }
    while let Some((node, expanded)) = stack.pop() {
        let key: Key = node.value;
        if expanded {
            let mut depth = 0;
            let mut readings = 1u64;
            for child in children(schema, &node)? {
                if let Some(Mark::Done {
                    depth: d,
                    readings: r,
                }) = marks.get(&(child.value as Key))
                {
                    depth = depth.max(*d);
                    readings = readings.max(*r);
                }
            }
            let depth = depth + 1;
            let readings = readings.saturating_mul(ways(node.value));
            let at = if node.at.is_empty() {
                "/".to_owned()
            } else {
                node.at.clone()
            };
            if depth > MAX_DEPTH {
                return Err(Unbounded::Depth { at });
            }
            if readings > MAX_READINGS {
                return Err(Unbounded::Readings { at });
            }
            marks.insert(key, Mark::Done { depth, readings });
            continue;
        }
        match marks.get(&key) {
            Some(Mark::Done { .. }) => continue,
            Some(Mark::Open) => {
                let at = if node.at.is_empty() {
                    "/".to_owned()
                } else {
                    node.at.clone()
                };
                return Err(Unbounded::Cycle { at });
            }
            None => {}
        }
        nodes += 1;
        if nodes > MAX_NODES {
            return Err(Unbounded::Nodes);
        }
        if node.value.get("$ref").is_some_and(Value::is_string) {
            refs += 1;
            if refs > MAX_REFS {
                return Err(Unbounded::Refs);
            }
        }
        marks.insert(key, Mark::Open);
        let kids = children(schema, &node)?;
        stack.push((node, true));
        for child in kids {
            match marks.get(&(child.value as Key)) {
                Some(Mark::Done { .. }) => {}
                Some(Mark::Open) => {
                    let at = if child.at.is_empty() {
                        "/".to_owned()
                    } else {
                        child.at
                    };
                    return Err(Unbounded::Cycle { at });
                }
                None => stack.push((child, false)),
            }
        }
    }
    Ok(())
}

/// How many readings a schema object offers by itself: its alternatives' counts multiplied.
fn ways(value: &Value) -> u64 {
    let Some(map) = value.as_object() else {
        return 1;
    };
    ["anyOf", "oneOf", "type"]
        .iter()
        .filter_map(|k| map.get(*k).and_then(Value::as_array))
        .map(|a| a.len().max(1) as u64)
        .fold(1u64, u64::saturating_mul)
}

/// A JSON pointer taken from a URI fragment: `%XX` escapes decoded (an invalid one is kept).
fn percent_decoded(pointer: &str) -> String {
    if !pointer.contains('%') {
        return pointer.to_owned();
    }
    let bytes = pointer.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = pointer.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The JSON values `text` may end with, the likeliest first: its fenced blocks that parse,
/// last first; the whole text; then each object or array that starts in its end, last first.
fn candidates(text: &str) -> Vec<Value> {
    let mut found: Vec<Value> = crate::extract::extract_code_blocks(text)
        .iter()
        .rev()
        .filter_map(|b| serde_json::from_str(b.code.trim()).ok())
        .collect();
    if let Ok(whole) = serde_json::from_str(text.trim()) {
        found.push(whole);
    }
    let from = text.floor_char_boundary(text.len().saturating_sub(SEARCHED));
    let tail = &text[from..];
    let starts = tail
        .char_indices()
        .filter(|(_, c)| *c == '{' || *c == '[')
        .map(|(i, _)| i)
        .collect::<Vec<_>>();
    for start in starts.into_iter().rev().take(STARTS) {
        let mut values = serde_json::Deserializer::from_str(&tail[start..]).into_iter::<Value>();
        if let Some(Ok(value)) = values.next() {
            found.push(value);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn schema() -> OutputSchema {
        OutputSchema::new(&json!({
            "type": "object",
            "required": ["answer"],
            "properties": {"answer": {"type": "integer"}},
        }))
        .unwrap()
    }

    #[test]
    fn the_value_is_found_in_a_block_in_words_or_alone() {
        let s = schema();
        assert_eq!(
            s.take("Done.\n```json\n{\"answer\": 42}\n```\n"),
            Ok(json!({"answer": 42}))
        );
        assert_eq!(s.take("{\"answer\": 7}"), Ok(json!({"answer": 7})));
        assert_eq!(
            s.take("The result is {\"answer\": 3} as computed."),
            Ok(json!({"answer": 3}))
        );
        // An earlier example does not win over the answer at the end.
        assert_eq!(
            s.take("```json\n{\"answer\": 1}\n```\nso finally:\n```json\n{\"answer\": 2}\n```"),
            Ok(json!({"answer": 2}))
        );
    }

    #[test]
    fn a_missing_or_wrong_value_says_what_to_fix() {
        let s = schema();
        let none = s.take("I am done.").unwrap_err();
        assert!(none.contains("No JSON value was found"), "{none}");
        let wrong = s.take("```json\n{\"answer\": \"42\"}\n```").unwrap_err();
        assert!(
            wrong.contains("at /answer") && wrong.contains("integer"),
            "{wrong}"
        );
        let missing = s.take("{\"other\": 1}").unwrap_err();
        assert!(missing.contains("answer"), "{missing}");
    }

    #[test]
    fn a_schema_that_is_not_one_is_refused_and_no_document_is_fetched() {
        let bad = OutputSchema::new(&json!({"type": "no-such-type"})).unwrap_err();
        assert!(bad.starts_with("output_schema: "), "{bad}");
        let remote = OutputSchema::new(&json!({"$ref": "http://127.0.0.1:9/schema.json"}));
        assert!(remote.is_err());
    }

    /// `n` definitions, each a `$ref` to the next: JSON depth 4 however long the chain.
    fn chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(
                format!("d{i}"),
                json!({"$ref": format!("#/$defs/d{}", i + 1)}),
            );
        }
        defs.insert(format!("d{n}"), json!({"type": "integer"}));
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs})
    }

    /// `levels` of `anyOf` of two arrays, each holding the next level by reference.
    fn ambiguous(levels: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..levels {
            let next = json!({"$ref": format!("#/$defs/l{}", i + 1)});
            defs.insert(
                format!("l{i}"),
                json!({"anyOf": [{"type": "array", "items": next}, {"type": "array", "items": next}]}),
            );
        }
        defs.insert(format!("l{levels}"), json!({"type": "integer"}));
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/l0"}}, "$defs": defs})
    }

    #[test]
    fn reference_chains_cycles_and_alternative_bombs_are_refused_naming_the_bound() {
        // Checked on this test thread's ordinary stack: nothing here recurses.
        assert_eq!(bounded(&chain(24_000)), Err(Unbounded::Refs));
        let wide = Value::Array((0..10_001).map(|_| json!({})).collect());
        assert_eq!(bounded(&wide), Err(Unbounded::Nodes));
        assert!(matches!(bounded(&chain(100)), Err(Unbounded::Depth { .. })));
        let bomb = bounded(&ambiguous(30)).unwrap_err();
        assert!(matches!(bomb, Unbounded::Readings { .. }), "{bomb}");
        assert!(bomb.to_string().contains("256"), "{bomb}");
        let cycle = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"});
        assert!(matches!(bounded(&cycle), Err(Unbounded::Cycle { .. })));
        assert!(matches!(
            bounded(&json!({"items": {"$ref": "#"}})),
            Err(Unbounded::Cycle { .. })
        ));
        assert!(matches!(
            bounded(&json!({"$ref": "http://127.0.0.1:9/s.json"})),
            Err(Unbounded::NotLocal { .. })
        ));
        assert!(matches!(
            bounded(&json!({"$ref": "#/$defs/none"})),
            Err(Unbounded::Missing { .. })
        ));
        assert!(matches!(
            bounded(&json!({"properties": {"a": {"$id": "x", "$defs": {}}}})),
            Err(Unbounded::Unfollowed { .. })
        ));
        let mut refs = serde_json::Map::new();
        for i in 0..1_001 {
            refs.insert(format!("p{i}"), json!({"$ref": "#/$defs/n"}));
        }
        let many = json!({"properties": refs, "$defs": {"n": {"type": "number"}}});
        assert_eq!(bounded(&many), Err(Unbounded::Refs));
        // The output schema and its answers are held to the same bounds.
        let refused = OutputSchema::new(&chain(24_000)).unwrap_err();
        assert!(
            refused.starts_with("output_schema: has more than"),
            "{refused}"
        );
    }

    #[test]
    fn ordinary_schemas_with_shared_definitions_and_some_alternatives_pass() {
        assert_eq!(bounded(&chain(40)), Ok(()));
        assert_eq!(bounded(&ambiguous(4)), Ok(()));
        let shared = json!({
            "type": "object",
            "properties": {
                "from": {"$ref": "#/$defs/point"},
                "to": {"$ref": "#/$defs/point"},
                "kind": {"type": ["string", "null"], "enum": ["a", "b", null]},
                "path~1x": {"anyOf": [{"type": "string"}, {"type": "number"}]},
            },
            "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
        });
        assert_eq!(bounded(&shared), Ok(()));
        let s = OutputSchema::new(&chain(40)).unwrap();
        assert_eq!(s.take("{\"a\": 3}"), Ok(json!({"a": 3})));
        assert!(s.take("{\"a\": \"x\"}").is_err());
    }

    #[test]
    fn a_huge_answer_is_searched_in_bounded_time() {
        let s = schema();
        let answer = format!("{}{{\"answer\": 5}}", "[{".repeat(200_000));
        assert_eq!(s.take(&answer), Ok(json!({"answer": 5})));
    }
}
