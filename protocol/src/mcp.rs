//! What Tandem's MCP tools return as structured content (`structuredContent`), typed once for
//! the server that fills it and any client that reads it.

use serde::{Deserialize, Serialize};

use crate::{ErrorInfo, StopReason};

/// `execute_code`'s result when the block ran.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecuteCodeResult {
    /// The exit code, when the block exited.
    pub exit_code: Option<i32>,
    /// How it ended: `exited`, `timed out`, `out of memory`, `cancelled`, `killed by signal N`.
    pub status: String,
    /// What it printed (capped, lossily decoded).
    pub stdout: String,
    /// What it printed on stderr (capped, lossily decoded).
    pub stderr: String,
    /// Whether stdout was cut to the cap.
    pub stdout_truncated: bool,
    /// Whether stderr was cut to the cap.
    pub stderr_truncated: bool,
    /// Wall time, in milliseconds.
    pub duration_ms: f64,
    /// The session it ran in, when the call named one.
    pub session_id: Option<String>,
    /// What it used, where the executor measures it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<crate::Resources>,
}

/// `execute_code`'s result when the block was not run (a person or a rule declined it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Declined {
    /// Always `declined`.
    pub status: String,
    /// Why, for the client's model.
    pub reason: String,
}

/// `run_task`'s result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunTaskResult {
    /// The task's id on the daemon.
    pub task_id: String,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// Assistant turns taken.
    pub turns: u32,
    /// The task's answer: the model's final statement, else what its code last printed in a
    /// clean run; `null` when there is neither (`no_answer` says why).
    pub answer: Option<String>,
    /// Where `answer` comes from: `model` or `output`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_from: Option<crate::AnswerFrom>,
    /// Why the task has no answer, when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_answer: Option<String>,
    /// The verdict of the task's check, when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<crate::CheckOutcome>,
    /// What its model calls cost, when its model has a price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    /// The budget it stopped at, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::BudgetReached>,
    /// The value its answer ended with, checked against its `output_schema`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    /// What failed, when it ended in an error.
    pub error: Option<ErrorInfo>,
    /// The transcript's resource URI.
    pub transcript: String,
    /// Every picture its blocks drew, in order.
    pub pictures: Vec<PictureRef>,
    /// The files it made (or changed), as resources.
    pub files: Vec<FileRef>,
    /// The tools it called, in order.
    pub tool_calls: Vec<ToolCallRef>,
}

/// A picture a task drew.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PictureRef {
    /// Its path in the workspace.
    pub path: String,
    /// Its media type.
    pub mime: String,
    /// Its size.
    pub bytes: u64,
    /// Its resource URI.
    pub uri: String,
}

/// A file a task made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileRef {
    /// Its path in the workspace.
    pub path: String,
    /// Its size.
    pub bytes: u64,
    /// Its resource URI.
    pub uri: String,
}

/// A tool a task called.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCallRef {
    /// The tool.
    pub name: String,
    /// Whether it failed.
    pub is_error: bool,
    /// How long it took.
    pub duration_ms: u64,
}
