//! A task's check: how `tandem eval` decides that a task was solved. It runs after the task
//! ends, in the task's own sandbox with the task's limits, and the model never sees it.

use serde::{Deserialize, Serialize};

/// What must hold of a finished task; every part given must.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Check {
    /// Text the final answer, or the output of one of the task's blocks, must contain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<String>,
    /// A file, relative to the workspace, that must exist when the task ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// What `file` must hold, leading and trailing whitespace aside.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contents: Option<String>,
    /// A program run in the workspace: exit 0 is solved, 1 unsolved, anything else (or a
    /// crash of the check's own code) a check error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program: Option<String>,
    /// The program's language [default: python].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    /// The value the task's answer must give (a number, a string or a list of them), read
    /// from its answer line (docs/eval.md); never from the blocks' output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
    /// How far a number of the answer may be from a numeric `value` [default: exact, within
    /// rounding].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerance: Option<f64>,
}

impl Check {
    /// Why the check cannot be run, if it cannot: it checks nothing, or gives half of a part.
    pub fn problem(&self) -> Option<&'static str> {
        if self.expect.is_none()
            && self.file.is_none()
            && self.program.is_none()
            && self.value.is_none()
        {
            return Some("check: give at least one of expect, value, file or program");
        }
        if self.tolerance.is_some() && self.value.is_none() {
            return Some("check.tolerance: needs check.value, the number it is the tolerance of");
        }
        if self
            .tolerance
            .is_some_and(|t| !t.is_finite() || t.is_sign_negative())
        {
            return Some("check.tolerance: must be a finite number, 0 or more");
        }
        if let Some(v) = &self.value
            && let Some(problem) = value_problem(v)
        {
            return Some(problem);
        }
        if self.contents.is_some() && self.file.is_none() {
            return Some("check.contents: needs check.file, the file it is the contents of");
        }
        if self.language.is_some() && self.program.is_none() {
            return Some("check.language: needs check.program, the program it is the language of");
        }
        if self.expect.as_deref().is_some_and(|e| e.trim().is_empty()) {
            return Some("check.expect: is empty, so it would hold of any task");
        }
        None
    }
}

/// Why `value` cannot be a check's value: only numbers, strings and flat lists of them are.
fn value_problem(value: &serde_json::Value) -> Option<&'static str> {
    use serde_json::Value;
    let scalar = |v: &Value| match v {
        Value::Number(_) => true,
        Value::String(s) => !s.trim().is_empty(),
        _ => false,
    };
    match value {
        Value::Array(items) if !items.is_empty() && items.iter().all(scalar) => None,
        Value::Array(_) => Some(
            "check.value: a list must hold at least one item, each a number or a non-empty string",
        ),
        v if scalar(v) => None,
        _ => Some("check.value: give a number, a non-empty string or a list of them"),
    }
}

/// What a check decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every part held.
    Solved,
    /// A part did not hold.
    Unsolved,
    /// The check itself failed (its code crashed, timed out, or the sandbox could not run
    /// it): the task is neither solved nor unsolved.
    Error,
}

impl Verdict {
    /// The snake_case name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Solved => "solved",
            Self::Unsolved => "unsolved",
            Self::Error => "error",
        }
    }
}

/// A check's verdict and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckOutcome {
    /// Solved, unsolved or a check error.
    pub verdict: Verdict,
    /// Which part did not hold, or what the check's program printed (capped).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// With a `value` check: whether the output of the task's code held the value, so that
    /// a value printed but missing from the answer can be told from one never found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub printed: Option<bool>,
}

impl CheckOutcome {
    /// The detail in one line: a traceback's last line (the exception), else the first line.
    pub fn gist(&self) -> &str {
        gist(&self.detail)
    }
}

/// `detail` in one line: a traceback's last line (the exception), else its first line.
pub fn gist(detail: &str) -> &str {
    let mut lines = detail.lines().map(str::trim).filter(|l| !l.is_empty());
    if detail.contains("Traceback (most recent call last):") {
        lines.next_back().unwrap_or_default()
    } else {
        lines.next().unwrap_or_default()
    }
}
