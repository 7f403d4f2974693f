//! The messages of the plugin protocol (docs/executor-protocol.md), as Tandem reads and
//! writes them.

use serde::{Deserialize, Serialize};
use tandem_executor::{ExitStatus, Stream};

/// The protocol version this Tandem speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// What a plugin answers to `initialize`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct Initialized {
    pub protocol_version: u32,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub languages: Option<Vec<String>>,
    #[serde(default)]
    pub enforces: Vec<String>,
}

/// What a plugin answers to `session/open`.
#[derive(Debug, Deserialize)]
pub(crate) struct Opened {
    pub session: String,
}

/// How a block ended, as a plugin reports it.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Status {
    Exited(i32),
    Signaled(i32),
    TimedOut,
    OutOfMemory,
    Cancelled,
}

impl From<Status> for ExitStatus {
    fn from(s: Status) -> Self {
        match s {
            Status::Exited(code) => Self::Exited(code),
            Status::Signaled(signal) => Self::Signaled(signal),
            Status::TimedOut => Self::TimedOut,
            Status::OutOfMemory => Self::OutOfMemory,
            Status::Cancelled => Self::Cancelled,
        }
    }
}

/// What a plugin answers to `session/run`; output it did not stream comes here.
#[derive(Debug, Deserialize)]
pub(crate) struct Ran {
    pub status: Status,
    #[serde(default)]
    pub duration_secs: Option<f64>,
    #[serde(default)]
    pub stdout: String,
    #[serde(default)]
    pub stderr: String,
    /// What the block used, as the plugin measured it.
    #[serde(default)]
    pub resources: Option<tandem_executor::Resources>,
}

/// Which stream a `session/output` notification carries.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum StreamName {
    Stdout,
    Stderr,
}

impl From<StreamName> for Stream {
    fn from(s: StreamName) -> Self {
        match s {
            StreamName::Stdout => Self::Stdout,
            StreamName::Stderr => Self::Stderr,
        }
    }
}

/// A `session/output` notification: more of a running block's output.
#[derive(Debug, Deserialize)]
pub(crate) struct Output {
    /// The id of the `session/run` request.
    pub run: u64,
    pub stream: StreamName,
    pub text: String,
    /// Bytes the plugin dropped before this text (it caps output itself).
    #[serde(default)]
    pub skipped: u64,
}
