//! The task API's answers: a task's record and view, a page of tasks, an approval a block
//! asked for, a decision on it, and the error every refusal carries.

use serde::{Deserialize, Serialize};

use crate::{Decision, ErrorInfo, Message, StopReason, TaskSpec, Usage};

/// Where a task is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// Waiting for a free slot.
    Queued,
    /// Being worked on.
    Running,
    /// A block waits for a person's decision (`POST /v1/tasks/{id}/approvals/{n}`); it
    /// holds no execution slot meanwhile.
    AwaitingApproval,
    /// The daemon stopped (crash or shutdown) while it ran; `resume` continues it.
    Interrupted,
    /// Ended; see its stop reason.
    Finished,
}

impl TaskState {
    /// The snake_case name used in the store and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::AwaitingApproval => "awaiting_approval",
            Self::Interrupted => "interrupted",
            Self::Finished => "finished",
        }
    }

    /// Every state, in the order metrics list them.
    pub const ALL: [Self; 5] = [
        Self::Queued,
        Self::Running,
        Self::AwaitingApproval,
        Self::Interrupted,
        Self::Finished,
    ];

    /// Parses a state name, as given in `?state=`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|state| state.as_str() == s)
    }
}

/// A task as stored, without its events.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// Task id.
    pub id: String,
    /// Where it is.
    pub state: TaskState,
    /// What was asked.
    pub spec: TaskSpec,
    /// Why it ended, once finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
    /// What failed, when it ended in an error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
    /// Tokens used so far.
    pub usage: Usage,
    /// Assistant turns taken so far.
    pub turns: u32,
    /// Milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// When it last started running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<u64>,
    /// When it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_ms: Option<u64>,
    /// When its workspace was removed (the operator's `[files]` retention); its files can no
    /// longer be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files_removed_ms: Option<u64>,
    /// The task's final answer, once it ended with one: the assistant's last reply without
    /// the termination string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    /// The task's answer once it ended: the model's final statement, else what its code
    /// last printed in a clean run (`answer_from` says which).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Where `answer` comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_from: Option<crate::AnswerFrom>,
    /// Why the task ended without an answer, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_answer: Option<String>,
    /// The verdict of the task's `check`, once it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<crate::CheckOutcome>,
    /// What its model calls cost, once it ended, when every model it called has a price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    /// The budget it stopped at, when `stop_reason` is `budget`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::BudgetReached>,
    /// The id of the trace its spans are in, once it started with traces exported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

impl TaskRecord {
    /// A task just queued.
    pub fn queued(id: &str, spec: TaskSpec, now_ms: u64) -> Self {
        Self {
            id: id.to_owned(),
            state: TaskState::Queued,
            spec,
            stop_reason: None,
            error: None,
            usage: Usage::default(),
            turns: 0,
            created_ms: now_ms,
            started_ms: None,
            finished_ms: None,
            files_removed_ms: None,
            result: None,
            answer: None,
            answer_from: None,
            no_answer: None,
            check: None,
            cost: None,
            budget: None,
            trace_id: None,
        }
    }
}

/// `GET /v1/tasks/{id}`: the record, the conversation so far and the approval it waits for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskView {
    /// The stored task.
    #[serde(flatten)]
    pub record: TaskRecord,
    /// The conversation as the model was sent it, system prompt first.
    #[serde(default)]
    pub transcript: Vec<Message>,
    /// The approval a block waits for, while the task is not finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_approval: Option<ApprovalRequest>,
    /// The daemon that runs it now, by its name on the task store (while it runs or waits
    /// for an approval).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon: Option<String>,
}

/// `GET /v1/tasks`: tasks, and with `limit`, where the next page starts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskList {
    /// The tasks.
    pub tasks: Vec<TaskRecord>,
    /// The `before` of the next page; `null` on the last one (absent with no `limit`).
    #[serde(default)]
    pub next: Option<String>,
}

/// A block that asked for a person's decision, as the task's events tell it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalRequest {
    /// Approval number, from 1 within the task.
    pub n: u32,
    /// Turn number.
    pub turn: u32,
    /// Block index.
    pub index: u32,
    /// Language.
    pub language: String,
    /// The code it asked about.
    pub code: String,
    /// The rule that asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Why it asked.
    pub reason: String,
}

/// `POST /v1/tasks/{id}/approvals/{n}`'s body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionBody {
    /// Approve or deny.
    pub decision: Decision,
    /// The code to run instead (approve only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// Why (told to the model on a denial).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `POST /v1/tasks/{id}/approvals/{n}`'s answer: the approval decided.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decided {
    /// The approval.
    pub approval: ApprovalRequest,
}

/// What kind of refusal an API error is; the message says the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiErrorCode {
    /// 400: the request is malformed or asks for something impossible.
    InvalidRequest,
    /// 400: the operator's policy does not allow it.
    NotAllowed,
    /// 401: no token, or the wrong one.
    Unauthorized,
    /// 404: no such task, approval or endpoint.
    NotFound,
    /// 409: the task's state does not allow it.
    Conflict,
    /// 410: the task's files were removed by the operator's retention.
    Gone,
    /// 413: the body is over the daemon's limit.
    PayloadTooLarge,
    /// 429: too many of something wait already (uploads); try again later.
    TooMany,
    /// 503: the executor cannot run code now.
    ExecutorUnavailable,
    /// The task database cannot be reached now; try again shortly.
    StoreUnavailable,
    /// 503: the daemon is stopping.
    ShuttingDown,
    /// 503: the daemon serves no embedded model (`/v1/chat/completions`), or it failed.
    ModelUnavailable,
    /// 500: the daemon failed.
    Internal,
    /// A code this client does not know (a newer daemon's).
    #[serde(other)]
    Other,
}

/// Every API error's body: `{"error": {"code": ..., "message": ...}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiErrorBody {
    /// The error.
    pub error: ApiErrorDetail,
}

/// What an API error says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiErrorDetail {
    /// What kind of refusal.
    pub code: ApiErrorCode,
    /// What is wrong and what to do.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_and_codes_round_trip_by_their_wire_names() {
        for state in TaskState::ALL {
            let wire = serde_json::to_value(state).unwrap();
            assert_eq!(wire, state.as_str());
            assert_eq!(TaskState::parse(state.as_str()), Some(state));
        }
        let code: ApiErrorCode = serde_json::from_str("\"payload_too_large\"").unwrap();
        assert_eq!(code, ApiErrorCode::PayloadTooLarge);
        let newer: ApiErrorCode = serde_json::from_str("\"rate_limited\"").unwrap();
        assert_eq!(newer, ApiErrorCode::Other);
    }
}

#[cfg(test)]
mod dialect {
    use crate::{Event, EventMsg};

    #[test]
    fn a_pair_and_a_team_start_turns_with_one_event_and_old_team_events_still_read() {
        let pair = EventMsg::TurnStarted {
            turn: 1,
            agent: None,
        };
        // The pair's event is what it always was on the wire.
        assert_eq!(
            serde_json::to_value(&pair).unwrap(),
            serde_json::json!({"type": "turn_started", "turn": 1})
        );
        let stored = r#"{"seq":4,"at_ms":9,"type":"agent_turn","turn":3,"agent":"team/coder"}"#;
        let event: Event = serde_json::from_str(stored).unwrap();
        assert_eq!(
            event.msg,
            EventMsg::TurnStarted {
                turn: 3,
                agent: Some("team/coder".to_owned()),
            }
        );
        let served = serde_json::to_value(&event).unwrap();
        assert_eq!(served["type"], "turn_started");
        assert_eq!(served["agent"], "team/coder");
    }
}
