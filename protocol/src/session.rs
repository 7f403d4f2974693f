//! Sessions over HTTP: a sandbox a client holds open and runs blocks in, one after another,
//! with no model (`/v1/sessions`, and the one-shot `/v1/exec`). What Python executors of
//! other frameworks are built on.

use serde::{Deserialize, Serialize};

use crate::{BlockResult, TaskLimits};

/// `POST /v1/sessions`'s body: the sandbox to open.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionSpec {
    /// An executor the operator offers; the daemon's default when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<String>,
    /// Python blocks share one interpreter whose variables survive (local and docker).
    #[serde(default)]
    pub keep_state: bool,
    /// The id of an upload whose files are in the workspace before the first block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<String>,
    /// The id of a snapshot whose files are in the workspace before the first block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// Volumes mounted into its sandbox (docs/volumes.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::volume::VolumeMount>,
    /// Tighter per-block limits than the daemon's.
    #[serde(default, skip_serializing_if = "TaskLimits::is_empty")]
    pub limits: TaskLimits,
    /// Closed after this long without a block (at most the daemon's; 600 by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_secs: Option<u64>,
    /// Tools the blocks' code may call (`tandem_tools`), each answered by the client that
    /// follows the block's run as a stream.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ClientTool>,
    /// The hosts its blocks may reach through Tandem's egress proxy, within what the
    /// daemon allows; with none, the daemon's `[network]`, or no network at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::net::NetworkRequest>,
}

/// A tool a session's code calls and its client answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientTool {
    /// Its name: 1 to 64 letters, digits, `_` or `-`.
    pub name: String,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// An open session, as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// Its id, for the session's URLs.
    pub id: String,
    /// The executor its sandbox belongs to.
    pub executor: String,
    /// Whether Python blocks share one interpreter.
    pub keep_state: bool,
    /// The tools its code may call.
    pub tools: Vec<String>,
    /// Whether a block runs now.
    pub busy: bool,
    /// Blocks run so far.
    pub blocks: u64,
    /// When it was opened (ms since the epoch).
    pub created_ms: u64,
    /// Seconds without a block after which it is closed.
    pub idle_timeout_secs: u64,
    /// How long its opening waited for a started sandbox from the executor's warm pool, in
    /// milliseconds (0: one was ready); absent when it started one of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_wait_ms: Option<u64>,
    /// What its blocks used, summed (the peak is the largest); absent before the first
    /// block that was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<crate::Resources>,
    /// `running`, or `paused`: its sandbox is gone, its files and kept globals saved, and
    /// its next block resumes it.
    #[serde(default)]
    pub state: SessionState,
}

/// Whether a session's sandbox runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// Its sandbox is up.
    #[default]
    Running,
    /// Idle past `[sessions] pause_after_secs`: saved and its sandbox closed.
    Paused,
}

/// `GET /v1/sessions`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionList {
    /// The open sessions, oldest first.
    pub sessions: Vec<SessionInfo>,
}

/// A block to run: `POST /v1/sessions/{id}/exec`, or `POST /v1/exec` with no session.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecSpec {
    /// python, sh, javascript, ... (what the executor runs).
    pub language: String,
    /// The code.
    pub code: String,
    /// Wall-clock limit for this block in seconds, at most the operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<f64>,
    /// `/v1/exec` only: an executor the operator offers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<String>,
    /// `/v1/exec` only: the id of an upload placed in the workspace first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<String>,
    /// `/v1/exec` only: the hosts the block may reach, as a session's `network`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::net::NetworkRequest>,
}

/// What a block's run streams, one JSON object per line (`application/x-ndjson`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEvent {
    /// A piece of live output.
    Output {
        /// `stdout` or `stderr`.
        stream: crate::OutputStream,
        /// The text (pieces of up to 100 ms of output).
        text: String,
    },
    /// The code called one of the session's tools: answer it at
    /// `POST /v1/sessions/{id}/calls/{call}`.
    ToolCall {
        /// The call's id.
        call: String,
        /// The tool.
        name: String,
        /// Its arguments, as the code passed them.
        arguments: serde_json::Value,
    },
    /// A connection through the egress proxy, once it is over.
    Net(crate::net::NetEvent),
    /// How the block ended; the last line.
    Result {
        /// The block's result, as a task's `exec_result` carries it.
        result: BlockResult,
    },
    /// The sandbox failed (not the program); the last line.
    Error {
        /// What went wrong.
        error: crate::ApiErrorDetail,
    },
}

/// The answer to a tool call: `{"result": "..."}` or `{"error": "..."}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolAnswer {
    /// The tool's answer, as text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// What went wrong; the code's call raises it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /v1/sessions/{id}/files`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionFiles {
    /// The session.
    pub session: String,
    /// The regular files of its workspace, in path order.
    pub files: Vec<crate::files::FileInfo>,
}
