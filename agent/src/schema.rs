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
        let mut first_errors = None;
        for value in candidates {
            let errors: Vec<String> = self
                .validator
                .iter_errors(&value)
                .take(TOLD)
                .map(|e| {
                    let at = e.instance_path().as_str().to_owned();
                    let at = if at.is_empty() { "/".to_owned() } else { at };
                    format!("- at {at}: {e}")
                })
                .collect();
            if errors.is_empty() {
                return Ok(value);
            }
            first_errors.get_or_insert(errors);
        }
        let errors = first_errors.unwrap_or_default().join("\n");
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

    #[test]
    fn a_huge_answer_is_searched_in_bounded_time() {
        let s = schema();
        let answer = format!("{}{{\"answer\": 5}}", "[{".repeat(200_000));
        assert_eq!(s.take(&answer), Ok(json!({"answer": 5})));
    }
}
