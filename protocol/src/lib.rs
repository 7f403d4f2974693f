//! Wire types shared by the Tandem CLI, daemon and tests.
//!
//! Everything here is plain serde data: a [`TaskSpec`] goes in, a stream of [`Event`]s
//! comes out, and the last event of every task is [`EventMsg::TaskFinished`] with a
//! [`StopReason`].
#![deny(missing_docs)]

use serde::{Deserialize, Serialize};

pub mod approval;
pub mod check;
pub mod engine;
pub mod files;
pub mod mcp;
pub mod net;
pub mod resources;
pub mod session;
pub mod task;
pub mod team;
pub mod tools;
pub mod volume;

pub use approval::{ApprovalMode, ApprovalPolicy, ApprovalRule, AutoApprove, Decision};
pub use check::{Check, CheckOutcome, Verdict};
pub use resources::{PeakScope, Resources};
pub use task::{
    ApiErrorBody, ApiErrorCode, ApiErrorDetail, ApprovalRequest, DecisionBody, TaskList,
    TaskRecord, TaskState, TaskView,
};
pub use tools::{CodeVia, ToolCall, ToolDef, ToolRef, ToolReply};

/// What a client asks Tandem to do.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    /// The task, in the user's words.
    pub task: String,
    /// Executor name (`local`, or a plugin's name); `None` picks the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<String>,
    /// Model name sent to the chat API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Base URL of the OpenAI-compatible API, overriding the configured one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Most assistant turns before the task stops with [`StopReason::MaxTurns`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_turns: Option<u32>,
    /// Most prompt tokens the task's model calls may send, all together; reached, the task
    /// stops with [`StopReason::Budget`] before its next call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_input_tokens: Option<u64>,
    /// Most tokens the task's models may write, all together: no reply is let run past it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// Most the task's model calls may cost, priced by the operator's `[model.prices]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<f64>,
    /// Wall-clock limit for the whole task, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Wall-clock limit for one code block, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_timeout_secs: Option<u64>,
    /// Replaces the default system prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Replaces the default termination string (`TERMINATE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub termination: Option<String>,
    /// The only languages the task may run (`python`, `sh`, ...); `None` allows every
    /// language the executor runs. Blocks in other languages are reported back, not run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub languages: Option<Vec<String>>,
    /// Tighter per-block limits than the daemon's; a task cannot loosen them.
    #[serde(default, skip_serializing_if = "TaskLimits::is_empty")]
    pub limits: TaskLimits,
    /// A team of agents that solves the task instead of the assistant and executor pair
    /// (docs/teams.md); `executor`, `model` and `base_url` are its agents' defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<team::TeamSpec>,
    /// Which blocks wait for a person before they run; it can only tighten the operator's
    /// `[approval]` policy (docs/approval.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalPolicy>,
    /// The id of an upload (`POST /v1/uploads`) whose files are placed in the task's
    /// workspace before its first block; the model is told what they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<String>,
    /// The id of a snapshot whose files are placed in the task's workspace before its first
    /// block, as an upload's are (not with `files`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// Volumes mounted into the task's sandboxes, named storage that outlives it
    /// (docs/volumes.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<volume::VolumeMount>,
    /// Python blocks run in one interpreter kept for the task, whose variables survive from
    /// block to block (local and docker executors); by default each block is a fresh process.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_state: bool,
    /// Labels the machine that runs the task's sandbox must carry (`{"gpu": "yes"}`): with
    /// several Docker hosts, the session goes to one whose labels include these.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub placement: std::collections::BTreeMap<String, String>,
    /// The hosts the task's sandboxes may reach, through Tandem's egress proxy and within
    /// what the daemon allows (`{"allow": ["pypi.test", "*.example.com:443"]}`); with none,
    /// the daemon's `[network]`, or no network at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<net::NetworkRequest>,
    /// How the assistant's code reaches the executor: fenced blocks (the default), the
    /// `execute_code` tool, or the tool where the server takes tools (docs/tools.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_via: Option<CodeVia>,
    /// How many replies there are to choose among, the model's own with them, when the task
    /// states examples and a reply's code first fails them: the one that holds most is kept
    /// (1 to 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidates: Option<u32>,
    /// The tools offered to the model: the operator's by name, or `command` tools defined
    /// here, which run in the task's sandbox; `None` offers every tool the operator has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<ToolRef>>,
    /// A JSON Schema the final answer must end with a value of: the value is the record's
    /// `result`, and an answer without a matching one is asked again (docs/budgets.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
    /// How `tandem eval` decides the task was solved: run in the task's sandbox after it
    /// ends, never shown to the model; the verdict is the record's `check`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<Check>,
    /// The caller's span, as a W3C `traceparent`: the task's spans join its trace. The API's
    /// `traceparent` header sets it; a malformed one is ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// Per-block limits a task asks for; each one left out keeps the daemon's. Only limits the
/// executors enforce per session are here (network and process counts are the executor's).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskLimits {
    /// Memory per block, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// CPU seconds per block (local and docker; wasm blocks have the wall clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_secs: Option<u64>,
    /// Largest file a block may write, bytes (local and docker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_size_bytes: Option<u64>,
    /// Bytes of each output stream kept for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_bytes: Option<u64>,
}

impl TaskLimits {
    /// Whether every limit is left to the daemon.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// One step of a task, as stored and streamed to clients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Position of the event in its task, starting at 1.
    pub seq: u64,
    /// Milliseconds since the Unix epoch when the event was made.
    pub at_ms: u64,
    /// In a team, the path of the agent whose event it is (`team/refine/critic`); see
    /// [`Speakers`]. (Not `agent`: `turn_started` and `team_ended` have a field of that name.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// What happened.
    #[serde(flatten)]
    pub msg: EventMsg,
}

/// Which agent of a team each event belongs to, from the `turn_started` events before it: the
/// latest `turn_started` of an event's turn names its agent.
#[derive(Clone, Debug, Default)]
pub struct Speakers {
    by_turn: std::collections::HashMap<u32, String>,
}

impl Speakers {
    /// The agent `msg` belongs to, if it is part of an agent's turn in a team.
    pub fn agent_of(&mut self, msg: &EventMsg) -> Option<String> {
        let turn = match msg {
            EventMsg::TurnStarted {
                turn,
                agent: Some(agent),
            } => {
                self.by_turn.insert(*turn, agent.clone());
                return Some(agent.clone());
            }
            EventMsg::TeamEnded { agent, .. } => return Some(agent.clone()),
            EventMsg::AssistantDelta { turn, .. }
            | EventMsg::ModelRetry { turn, .. }
            | EventMsg::RepliesDrawn { turn, .. }
            | EventMsg::SandboxLost { turn, .. }
            | EventMsg::AssistantMessage { turn, .. }
            | EventMsg::CodeBlock { turn, .. }
            | EventMsg::ApprovalRequested { turn, .. }
            | EventMsg::ApprovalDecided { turn, .. }
            | EventMsg::ExecOutput { turn, .. }
            | EventMsg::ExecResult { turn, .. }
            | EventMsg::Artifact { turn, .. }
            | EventMsg::ToolCall { turn, .. }
            | EventMsg::ToolResult { turn, .. }
            | EventMsg::ExecutorMessage { turn, .. } => turn,
            _ => return None,
        };
        self.by_turn.get(turn).cloned()
    }
}

/// What happened, tagged by `type` on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventMsg {
    /// The task began.
    TaskStarted {
        /// The task text.
        task: String,
        /// Model name used.
        model: String,
        /// API base URL used.
        base_url: String,
        /// Executor name used.
        executor: String,
        /// The task span's W3C `traceparent`, when traces are exported.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trace: Option<String>,
    },
    /// Turn `turn` starts: the assistant of a pair is asked for its reply, or, in a team,
    /// `agent` takes the turn (the team's running count), and the events that follow, up to
    /// the next of these, are its own. One event for both; a team's was called `agent_turn`,
    /// which is still read as this.
    #[serde(alias = "agent_turn")]
    TurnStarted {
        /// Turn number, starting at 1.
        turn: u32,
        /// In a team, the agent's path from the top of the team (`team/refine/critic`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent: Option<String>,
    },
    /// In a team, a chat or a loop ended, and why (the condition that fired, an escalation,
    /// its iteration limit).
    TeamEnded {
        /// The team's path (`team/refine`).
        agent: String,
        /// What ended it, in words (`mention APPROVED by reviewer`, `critic said STOP`).
        by: String,
    },
    /// A streamed piece of the assistant's reply.
    AssistantDelta {
        /// Turn number.
        turn: u32,
        /// The new text.
        text: String,
    },
    /// The machine a block's sandbox ran on stopped answering while the block ran: the
    /// session is opened again on another (from the workspace as the last finished block
    /// left it) and the block runs again there; its output so far is void.
    SandboxLost {
        /// Turn number.
        turn: u32,
        /// Block index within the turn.
        index: u32,
        /// The host that was lost, by the operator's name for it.
        host: String,
        /// What was seen.
        reason: String,
    },
    /// The model call failed in a way worth retrying; streamed text of this turn is discarded.
    ModelRetry {
        /// Turn number.
        turn: u32,
        /// Retry number, starting at 1.
        attempt: u32,
        /// How long Tandem waits before retrying.
        delay_ms: u64,
        /// Why.
        reason: String,
    },
    /// The agent's own reply did not hold the task's examples, so more were drawn to the same
    /// view and one kept; the `assistant_message` that follows is the one kept.
    RepliesDrawn {
        /// Turn number.
        turn: u32,
        /// Replies drawn beside the agent's own.
        drawn: u32,
        /// Which reply is kept: 0 for the agent's own, else the drawn one's number.
        chosen: u32,
        /// Examples the kept reply's code holds.
        held: u32,
        /// Examples the task states that were run.
        examples: u32,
    },
    /// The assistant's complete reply for a turn.
    AssistantMessage {
        /// Turn number.
        turn: u32,
        /// The whole reply.
        text: String,
        /// Tokens used by this call, when the server reported them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
        /// The tools it called natively, in order.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall>,
    },
    /// A code block is about to run (or be reported as not runnable).
    CodeBlock {
        /// Turn number.
        turn: u32,
        /// Position of the block in the reply, starting at 1.
        index: u32,
        /// Normalised language, or `None` when the block was untagged and could not be guessed.
        language: Option<String>,
        /// The code.
        code: String,
    },
    /// A block waits for a person to approve, edit or deny it.
    ApprovalRequested {
        /// Turn number.
        turn: u32,
        /// Block index.
        index: u32,
        /// The task's approval number, from 1: what `POST /v1/tasks/{id}/approvals/{n}` names.
        n: u32,
        /// Normalised language.
        language: String,
        /// The code that would run.
        code: String,
        /// The name of the rule that asked, when one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rule: Option<String>,
        /// Why it asks, in words.
        reason: String,
    },
    /// A block's approval was decided: by a person, a rule, or the timeout.
    ApprovalDecided {
        /// Turn number.
        turn: u32,
        /// Block index.
        index: u32,
        /// The approval number; 0 when a rule decided without asking.
        n: u32,
        /// What was decided.
        decision: Decision,
        /// Who decided: `user`, `rule` or `timeout`.
        by: String,
        /// The code a person edited it to, when they did; it runs instead.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<String>,
        /// The reason given (what the model is told on a denial).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// The rule that decided, when one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rule: Option<String>,
    },
    /// Live output of a running block.
    ExecOutput {
        /// Turn number.
        turn: u32,
        /// Block index.
        index: u32,
        /// Which stream.
        stream: OutputStream,
        /// The text (lossily decoded).
        text: String,
    },
    /// A block finished.
    ExecResult {
        /// Turn number.
        turn: u32,
        /// Block index.
        index: u32,
        /// The outcome.
        result: BlockResult,
    },
    /// A connection the sandbox asked its egress proxy for, allowed or denied, once it is
    /// over.
    Net(net::NetEvent),
    /// A block wrote a picture (a PNG, JPEG, GIF, WebP or SVG file, or a figure it showed)
    /// into the workspace.
    Artifact {
        /// Turn number.
        turn: u32,
        /// Block index.
        index: u32,
        /// Its path in the workspace (`file`, not `path`: an event's `path` names the agent).
        file: String,
        /// Its media type (`image/png`, ...).
        mime: String,
        /// Its size in bytes.
        bytes: u64,
        /// Where to download it, on a daemon (`/v1/tasks/{id}/files/{path}`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        href: Option<String>,
    },
    /// `tandem run` kept a file the task made, on the machine it ran from (said by the
    /// command after the task ends; a daemon never stores it).
    FileSaved {
        /// Its path in the workspace.
        file: String,
        /// Its size in bytes.
        bytes: u64,
        /// Where it was written.
        to: String,
    },
    /// A tool call is taken up: a command, HTTP or MCP call after its approval; an
    /// `execute_code` call before its block's events, approval included.
    ToolCall {
        /// Turn number.
        turn: u32,
        /// Its position among the reply's blocks and calls, from 1.
        index: u32,
        /// The call's id (made up for a call written as text).
        id: String,
        /// The tool.
        name: String,
        /// Its arguments, as the model wrote them.
        arguments: String,
    },
    /// A tool call was answered.
    ToolResult {
        /// Turn number.
        turn: u32,
        /// Its position among the reply's blocks and calls.
        index: u32,
        /// The call's id.
        id: String,
        /// The tool.
        name: String,
        /// What the model reads.
        result: String,
        /// Whether the call failed (bad arguments, an unknown tool, a failing program).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        is_error: bool,
        /// How long it took, in milliseconds.
        duration_ms: u64,
    },
    /// The executor agent's reply to the assistant (what the model sees next).
    ExecutorMessage {
        /// Turn number.
        turn: u32,
        /// The message text: its report on the reply's blocks (empty when it had only calls).
        text: String,
        /// The answers to the reply's native tool calls, one per call, in the calls' order.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_results: Vec<ToolReply>,
    },
    /// The task ended; always the last event.
    TaskFinished {
        /// Why it ended.
        stop_reason: StopReason,
        /// Assistant turns taken.
        turns: u32,
        /// Total tokens used.
        usage: Usage,
        /// Wall time of the task in milliseconds.
        elapsed_ms: u64,
        /// Set when `stop_reason` is `error`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<ErrorInfo>,
        /// The assistant's last reply with the termination string removed, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        summary: Option<String>,
        /// The task's check's verdict, when it has a check and ran to an end.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        check: Option<Box<CheckOutcome>>,
        /// What the task's model calls cost, when every model it called has a price.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost: Option<f64>,
        /// Set when `stop_reason` is `budget`: which budget, and how much was spent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        budget: Option<Box<BudgetReached>>,
        /// The JSON value the final answer ended with, checked against the task's
        /// `output_schema` (without one, the record's `result` is the answer's text).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<Box<serde_json::Value>>,
        /// The task's answer: the model's final statement, else what its code last printed
        /// in a clean run; empty when there is neither (`no_answer` says why).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answer: Option<String>,
        /// Where `answer` comes from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answer_from: Option<AnswerFrom>,
        /// Why the task has no answer, when it has none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        no_answer: Option<String>,
    },
}

impl EventMsg {
    /// A `task_finished` event that says only why the task ended, its turns, tokens, time and
    /// error: no summary, check, cost, budget, result or answer.
    pub fn finished(
        stop_reason: StopReason,
        turns: u32,
        usage: Usage,
        elapsed_ms: u64,
        error: Option<ErrorInfo>,
    ) -> Self {
        Self::TaskFinished {
            stop_reason,
            turns,
            usage,
            elapsed_ms,
            error,
            summary: None,
            check: None,
            cost: None,
            budget: None,
            result: None,
            answer: None,
            answer_from: None,
            no_answer: None,
        }
    }
}

/// Where a task's answer comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerFrom {
    /// The model's final statement, which agrees with what its code printed.
    Model,
    /// What the task's code last printed in a clean run: the model stated no answer, or
    /// one its code's output contradicts.
    Output,
}

impl AnswerFrom {
    /// The snake_case name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Model => "model",
            Self::Output => "output",
        }
    }
}

/// The budget a task reached.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BudgetReached {
    /// Its name in the task: `max_input_tokens`, `max_output_tokens` or `max_cost`.
    pub budget: String,
    /// The task's limit.
    pub limit: f64,
    /// What the task had spent when it stopped.
    pub spent: f64,
}

impl BudgetReached {
    /// One line for people: which budget, the limit and what was spent.
    pub fn message(&self) -> String {
        let (limit, spent) = if self.budget == "max_cost" {
            (format!("{:.4}", self.limit), format!("{:.4}", self.spent))
        } else {
            (format!("{}", self.limit), format!("{}", self.spent))
        };
        format!(
            "the task reached its {} of {limit} ({spent} spent); raise it to let the task go on",
            self.budget
        )
    }
}

/// Which output stream a piece of text came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// The outcome of one code block, as reported to clients and in `tandem exec --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockResult {
    /// Normalised language.
    pub language: Option<String>,
    /// How it ended.
    pub status: BlockStatus,
    /// Exit code when `status` is `exited`.
    pub exit_code: Option<i32>,
    /// Captured stdout (capped, lossily decoded).
    pub stdout: String,
    /// Captured stderr (capped, lossily decoded).
    pub stderr: String,
    /// Whether either stream was cut to fit the output cap.
    pub truncated: bool,
    /// Wall time of the execution in milliseconds.
    pub duration_ms: u64,
    /// What it used of the machine, where the executor measures it (boxed: most events
    /// carry none, and every event is as large as its largest kind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Box<Resources>>,
}

impl BlockResult {
    /// Whether the block counts as a success (exited with 0, or was skipped as data).
    pub fn succeeded(&self) -> bool {
        matches!(self.status, BlockStatus::Exited if self.exit_code == Some(0))
            || self.status == BlockStatus::Skipped
    }
}

/// How a block ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockStatus {
    /// The program exited by itself; see `exit_code`.
    Exited,
    /// It ran past its wall-clock limit and was killed.
    TimedOut,
    /// It was killed by a signal (CPU limit, its own `kill`, ...).
    Killed,
    /// It ran out of memory.
    OutOfMemory,
    /// The task was cancelled while it ran.
    Cancelled,
    /// Its language is not supported by the executor; it never ran.
    Unsupported,
    /// It is data or prose (`text`, `json`, ...), not a program; it was not run.
    Skipped,
    /// An earlier block in the same reply failed, so it was not run.
    NotRun,
    /// The reply was cut off inside this block, so it was not run.
    Incomplete,
    /// A person or the approval policy declined it; it never ran.
    Declined,
    /// The sandbox itself failed (not the program).
    Error,
}

impl BlockStatus {
    /// The snake_case name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exited => "exited",
            Self::TimedOut => "timed_out",
            Self::Killed => "killed",
            Self::OutOfMemory => "out_of_memory",
            Self::Cancelled => "cancelled",
            Self::Unsupported => "unsupported",
            Self::Skipped => "skipped",
            Self::NotRun => "not_run",
            Self::Incomplete => "incomplete",
            Self::Declined => "declined",
            Self::Error => "error",
        }
    }
}

/// Token counts reported by the model server, or estimated where it reported none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens sent to the model.
    pub prompt_tokens: u64,
    /// Tokens the model produced.
    pub completion_tokens: u64,
    /// Some of these counts are Tandem's estimate (the server's answer carried no usage), not
    /// the server's; absent (false) in records written before it existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub estimated: bool,
}

impl Usage {
    /// Counts the server reported.
    pub fn reported(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            estimated: false,
        }
    }

    /// Adds another call's usage to this one; a sum with an estimate in it is an estimate.
    pub fn add(&mut self, other: Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.estimated |= other.estimated;
    }
}

/// Why a task ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The assistant said the termination string.
    Terminated,
    /// The assistant answered in words, without the termination string, right after its
    /// code ran cleanly.
    Answered,
    /// The code ran cleanly and held every example the task states.
    ExamplesHeld,
    /// The turn limit was reached.
    MaxTurns,
    /// The task's wall-clock limit was reached.
    Timeout,
    /// A budget of the task (`max_input_tokens`, `max_output_tokens`, `max_cost`) was reached.
    Budget,
    /// Someone cancelled the task.
    Cancelled,
    /// Tandem, the model server or the sandbox failed; see the `error` field.
    Error,
    /// The model sent again code it had run, unchanged, and it ran as before.
    Repeated,
}

impl StopReason {
    /// The snake_case name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Terminated => "terminated",
            Self::Answered => "answered",
            Self::ExamplesHeld => "examples_held",
            Self::MaxTurns => "max_turns",
            Self::Timeout => "timeout",
            Self::Budget => "budget",
            Self::Cancelled => "cancelled",
            Self::Error => "error",
            Self::Repeated => "repeated",
        }
    }
}

/// A failure that ended a task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// Machine-readable kind.
    pub code: ErrorCode,
    /// One line for people: what failed and what to check.
    pub message: String,
}

/// Machine-readable error kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The model server could not be reached.
    ModelUnreachable,
    /// The model server rejected the API key.
    ModelAuth,
    /// The model or the endpoint does not exist.
    ModelNotFound,
    /// The model server rejected the request.
    ModelRequest,
    /// The model server kept failing (5xx, 429) after retries.
    ModelUnavailable,
    /// The model server answered something that is not the OpenAI API.
    ModelProtocol,
    /// The executor could not be used (unknown, broken sandbox).
    Executor,
    /// The request was invalid.
    InvalidRequest,
    /// A bug in Tandem.
    Internal,
}

/// The trace id of a W3C `traceparent` (`version-traceid-spanid-flags`): 32 lowercase hex
/// digits, not all zero; `None` for anything else.
pub fn trace_id_of(traceparent: &str) -> Option<&str> {
    let id = traceparent.split('-').nth(1)?;
    (id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && id.bytes().any(|b| b != b'0'))
    .then_some(id)
}

impl ErrorCode {
    /// The snake_case name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ModelUnreachable => "model_unreachable",
            Self::ModelAuth => "model_auth",
            Self::ModelNotFound => "model_not_found",
            Self::ModelRequest => "model_request",
            Self::ModelUnavailable => "model_unavailable",
            Self::ModelProtocol => "model_protocol",
            Self::Executor => "executor",
            Self::InvalidRequest => "invalid_request",
            Self::Internal => "internal",
        }
    }
}

/// One message of a conversation, as sent to the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Who said it.
    pub role: Role,
    /// What was said.
    pub content: String,
    /// The speaker's name, in a team: each agent sees the others' messages as `user`
    /// messages that carry the speaker's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant's native tool calls.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        with = "tools::wire_calls"
    )]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// The speaker of a [`Message`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Instructions for the assistant.
    System,
    /// The task, and the executor agent's reports.
    User,
    /// The model.
    Assistant,
    /// The answer to one of the model's tool calls.
    Tool,
}

impl Role {
    /// The snake_case name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }
}

impl Message {
    /// A message with `role` and `content`.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// The answer to tool call `reply.id`.
    pub fn tool(reply: &ToolReply) -> Self {
        Self {
            tool_call_id: Some(reply.id.clone()),
            ..Self::new(Role::Tool, reply.content.clone())
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_trace_id_is_read_only_from_a_traceparent_that_could_be_one() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        assert_eq!(
            super::trace_id_of(&format!("00-{id}-00f067aa0ba902b7-01")),
            Some(id)
        );
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert_eq!(super::trace_id_of(bad), None, "{bad}");
        }
    }

    use super::*;

    /// Every event reads back as it was written, in a team (with the agent's `path`) and out
    /// of one: a field of an event that shared a name with the envelope's would be taken by
    /// the envelope and the event would no longer read.
    #[test]
    fn events_read_back_as_written() {
        let msgs = [
            EventMsg::Artifact {
                turn: 2,
                index: 1,
                file: "out/chart.png".to_owned(),
                mime: "image/png".to_owned(),
                bytes: 512,
                href: Some("/v1/tasks/t/files/out/chart.png".to_owned()),
            },
            EventMsg::TurnStarted {
                turn: 3,
                agent: Some("team/coder".to_owned()),
            },
        ];
        for msg in msgs {
            for path in [None, Some("team/runner".to_owned())] {
                let event = Event {
                    seq: 7,
                    at_ms: 1,
                    path,
                    msg: msg.clone(),
                };
                let text = serde_json::to_string(&event).unwrap_or_default();
                let back: Event = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{text} does not read back: {e}"));
                assert_eq!(back, event, "{text}");
            }
        }
    }
}

/// `secs` since the Unix epoch as RFC 3339 in UTC.
pub fn rfc3339(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm, as arithmetic).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod date_tests {
    use super::rfc3339;

    #[test]
    fn dates_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_796_083_200), "2026-12-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }
}
