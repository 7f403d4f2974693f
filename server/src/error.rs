//! Why a request about tasks failed, by cause: the API picks its status from the variant and
//! says the cause's text, which names the problem and what to do.

use tandem_agent::team::TeamErrors;
use tandem_agent::{ApprovalError, LanguageListError};
use tandem_executor::ExecError;

use crate::policy::Refused;
use crate::store::StoreError;

/// Why a request about tasks failed; the API turns these into 4xx/5xx answers.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// The request is invalid.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// No task has that id.
    #[error("task `{0}` does not exist")]
    NotFound(String),
    /// The task exists but not the approval asked about.
    #[error(transparent)]
    Missing(#[from] MissingApproval),
    /// The task is in a state that does not allow this.
    #[error(transparent)]
    Conflict(#[from] Conflict),
    /// The operator's policy does not allow it.
    #[error(transparent)]
    NotAllowed(#[from] Refused),
    /// Something the request needs cannot serve it now.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// The daemon is stopping.
    #[error("the daemon is shutting down and takes no new work")]
    ShuttingDown,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A task's files could not be given, found or read.
    #[error(transparent)]
    Files(#[from] crate::files::FilesError),
    /// A volume could not be made, found, mounted or removed.
    #[error(transparent)]
    Volume(#[from] tandem_volumes::VolumeError),
}

/// What is wrong with a task or a request about one.
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
    /// The task says nothing.
    #[error("the task is empty; say what to do in `task`")]
    EmptyTask,
    /// The executor is not one this daemon has.
    #[error(transparent)]
    Executor(#[from] ExecError),
    /// `languages` names none, or one the executor does not run.
    #[error(transparent)]
    Languages(#[from] LanguageListError),
    /// `limits` asks for more than the daemon allows, or for zero.
    #[error("{0}")]
    Limits(String),
    /// An entry of `network.allow` does not parse.
    #[error(transparent)]
    Network(#[from] tandem_egress::RuleError),
    /// The task's approval policy does not compile.
    #[error("approval: {0}")]
    Approval(#[from] ApprovalError),
    /// `max_turns` is zero.
    #[error("max_turns must be at least 1")]
    NoTurns,
    /// `candidates` is zero or more than a turn may draw.
    #[error("candidates: {0} is not from 1 to {most}: a turn draws at least its one reply and at most {most}", most = tandem_agent::team::MOST_CANDIDATES)]
    Candidates(u32),
    /// A budget that is zero, negative or not a number, or a cost budget for a model with no
    /// price.
    #[error("{0}")]
    Budget(String),
    /// `output_schema` is not a JSON Schema, or is asked of a team.
    #[error("{0}")]
    OutputSchema(String),
    /// A timeout is zero.
    #[error("timeout_secs and block_timeout_secs must be at least 1")]
    NoTime,
    /// `keep_state` on an executor whose sessions cannot keep an interpreter.
    #[error(
        "keep_state: the {0} executor cannot keep a Python interpreter between blocks; use local or docker, or leave keep_state out"
    )]
    KeepState(String),
    /// Placement labels no host of the executor carries.
    #[error("placement: {0}")]
    Placement(String),
    /// A tool that is not offered, or a definition that is not allowed.
    #[error("tools: {0}")]
    Tools(#[from] tandem_agent::tools::ToolError),
    /// `termination` is blank.
    #[error("termination must not be empty")]
    EmptyTermination,
    /// The team does not check.
    #[error("the team does not check: {}", .0.0.join("; "))]
    Team(TeamErrors),
    /// One of the team's agents asks for something wrong (`at` names its field).
    #[error("{at}: {source}")]
    Agent {
        /// `team: team.coder.executor`.
        at: String,
        /// What is wrong there.
        source: Box<Invalid>,
    },
    /// A volume mount that cannot be made as asked.
    #[error("volumes: {0}")]
    Volumes(String),
    /// The task's check is incomplete, or set on a team's task.
    #[error("{0}")]
    Check(&'static str),
    /// A decision that does not go together (`code` with a denial, an empty `code`).
    #[error("{0}")]
    Decision(&'static str),
}

/// An approval number the task never asked for.
#[derive(Debug, thiserror::Error)]
#[error("task `{id}` never asked for approval {n}; waiting for a decision: {}", waiting_list(.waiting))]
pub struct MissingApproval {
    /// The task.
    pub id: String,
    /// The number asked about.
    pub n: u32,
    /// The approvals that do wait for a decision.
    pub waiting: Vec<u32>,
}

fn waiting_list(waiting: &[u32]) -> String {
    if waiting.is_empty() {
        return "none".to_owned();
    }
    let names: Vec<String> = waiting.iter().map(u32::to_string).collect();
    names.join(", ")
}

/// A task whose state does not allow what was asked.
#[derive(Debug, thiserror::Error)]
pub enum Conflict {
    /// Cancelling a finished task.
    #[error("task `{id}` already finished ({reason}); there is nothing to cancel")]
    Finished {
        /// The task.
        id: String,
        /// Its stop reason.
        reason: &'static str,
    },
    /// Resuming a task that is not interrupted.
    #[error("task `{id}` is {state}; only interrupted tasks can be resumed")]
    NotInterrupted {
        /// The task.
        id: String,
        /// Its state.
        state: &'static str,
    },
    /// Deciding an approval of a finished task.
    #[error("task `{0}` already finished; there is nothing to approve")]
    NothingToApprove(String),
    /// Deciding an approval twice.
    #[error("approval {n} of task `{id}` was already decided: {decision} by {by}")]
    Decided {
        /// The task.
        id: String,
        /// The approval.
        n: u32,
        /// What was decided.
        decision: &'static str,
        /// Who decided.
        by: String,
    },
    /// An MCP call cancelled while it waited for a slot.
    #[error("the call was cancelled while it waited for a slot")]
    CallCancelled,
}

/// Something a request needs that cannot serve it now.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    /// The executor's health check fails.
    #[error("the {name} executor cannot run tasks now: {problem}")]
    Executor {
        /// The executor.
        name: String,
        /// What its health check says, with the fix.
        problem: String,
    },
    /// Every execution slot stayed taken.
    #[error(
        "no execution slot was free within {wait_secs} s: this daemon runs {max} at once (--max-concurrent); try again when a task ends"
    )]
    NoSlot {
        /// How long the call waited.
        wait_secs: u64,
        /// The daemon's slots.
        max: usize,
    },
    /// The task database cannot be reached (the daemon keeps retrying).
    #[error(
        "the task database cannot be reached now, so no task can be stored; the daemon keeps retrying (running tasks keep their events), so try again shortly"
    )]
    Store,
    /// The store's writer thread is gone.
    #[error("the task store's writer is not running")]
    Writer,
    /// A lock was poisoned by a panic.
    #[error("the {0} lock is poisoned")]
    Poisoned(&'static str),
}

/// Why a block without a task (a session, `POST /v1/exec`, MCP's `execute_code`) was not
/// run or its sandbox not opened: one type for every road, which the HTTP and MCP adapters
/// only translate to their wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The API's error code.
    pub code: tandem_protocol::ApiErrorCode,
    /// What is wrong and what to do.
    pub message: String,
    /// The approval policy declined the block: a result the client's model reads, not a
    /// broken request.
    pub declined: bool,
}

impl Refusal {
    /// A refusal with `code`.
    pub fn new(code: tandem_protocol::ApiErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            declined: false,
        }
    }

    /// The request is malformed or names what is not here.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(tandem_protocol::ApiErrorCode::InvalidRequest, message)
    }

    /// The operator's policy does not allow what was asked.
    pub fn not_allowed(message: impl Into<String>) -> Self {
        Self::new(tandem_protocol::ApiErrorCode::NotAllowed, message)
    }

    /// The approval policy would hold the block for a person, and no one can be asked.
    pub fn declined(why: &str) -> Self {
        Self {
            declined: true,
            ..Self::not_allowed(format!(
                "declined: {why}; a task's blocks wait for a person's approval: submit one (POST /v1/tasks, or MCP's run_task)"
            ))
        }
    }

    /// A task error, kept as the API would answer it.
    pub fn of_task(e: &TaskError) -> Self {
        use tandem_protocol::ApiErrorCode as C;
        let code = match e {
            TaskError::NotAllowed(_) => C::NotAllowed,
            TaskError::ShuttingDown => C::ShuttingDown,
            TaskError::Unavailable(_) => C::ExecutorUnavailable,
            TaskError::Store(_) => C::Internal,
            TaskError::NotFound(_) | TaskError::Volume(tandem_volumes::VolumeError::Unknown(_)) => {
                C::NotFound
            }
            TaskError::Conflict(_)
            | TaskError::Volume(
                tandem_volumes::VolumeError::Exists(_) | tandem_volumes::VolumeError::InUse { .. },
            ) => C::Conflict,
            _ => C::InvalidRequest,
        };
        Self::new(code, e.to_string())
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}
