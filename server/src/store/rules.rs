//! The task store's rules, free of any engine: what an event changes in its task's row, how a
//! row becomes a record, the order tasks are claimed and listed in, and how a page is cut.
//! Each engine turns them into its own statements and nothing else; the store kit
//! (`tests/tests/store_kit.rs`) holds both engines to the same behaviour.
//!
//! Statements shared by both engines are written once with `?N` placeholders (SQLite's);
//! [`pg`] gives PostgreSQL's spelling. Parameters that may be NULL are cast where they are
//! compared with NULL, as PostgreSQL must know their type.

use tandem_protocol::{EventMsg, StopReason, TaskRecord, TaskState, Usage};

use super::{Result, StoreError, parse};

/// What one event changes in its task's row, beside the event itself.
#[derive(Debug, PartialEq)]
pub(crate) enum RowChange {
    /// The task started with its spans exported: the first run's trace is the task's.
    Traced {
        /// The trace's id.
        trace_id: String,
    },
    /// An assistant message with usage: the task is at `turn`, and `usage` adds to the task's.
    /// Usage is the sum of the messages' (a resumed task's run knows only its own part).
    Turn {
        /// The turn the message ended.
        turn: u32,
        /// Its tokens.
        usage: Usage,
    },
    /// The task ended: it is finished, with why, its error and its turns. Its usage stays the
    /// sum of its messages', so the end does not overwrite it; its lease ends with it.
    Finished {
        /// Why it ended.
        stop_reason: StopReason,
        /// The error, as stored JSON.
        error: Option<String>,
        /// Turns taken.
        turns: u32,
        /// When it ended.
        at_ms: u64,
        /// Its final answer and its check's verdict, as stored JSON ([`Outcome`]).
        outcome: Option<String>,
    },
}

/// What a finished task left beside its stop reason, stored as one JSON column.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct Outcome {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    check: Option<tandem_protocol::CheckOutcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cost: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    budget: Option<tandem_protocol::BudgetReached>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    answer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    answer_from: Option<tandem_protocol::AnswerFrom>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    no_answer: Option<String>,
}

impl Outcome {
    /// Whether there is nothing to store.
    fn is_empty(&self) -> bool {
        self.answer.is_none()
            && self.no_answer.is_none()
            && self.result.is_none()
            && self.check.is_none()
            && self.cost.is_none()
            && self.budget.is_none()
    }
}

/// What `msg`, stored at `now_ms`, changes in its task's row; `None` for the events that are
/// only events.
pub(crate) fn row_change(msg: &EventMsg, now_ms: u64) -> Option<RowChange> {
    match msg {
        EventMsg::TaskStarted {
            trace: Some(traceparent),
            ..
        } => tandem_protocol::trace_id_of(traceparent).map(|id| RowChange::Traced {
            trace_id: id.to_owned(),
        }),
        EventMsg::AssistantMessage {
            turn,
            usage: Some(usage),
            ..
        } => Some(RowChange::Turn {
            turn: *turn,
            usage: *usage,
        }),
        EventMsg::TaskFinished {
            stop_reason,
            turns,
            error,
            summary,
            check,
            cost,
            budget,
            result,
            answer,
            answer_from,
            no_answer,
            ..
        } => Some(RowChange::Finished {
            stop_reason: *stop_reason,
            error: error.as_ref().map(super::to_json),
            turns: *turns,
            at_ms: now_ms,
            outcome: Some(Outcome {
                // A value checked against the task's schema, else the answer's words.
                result: result
                    .as_deref()
                    .cloned()
                    .or_else(|| summary.clone().map(serde_json::Value::String)),
                check: check.as_deref().cloned(),
                cost: *cost,
                budget: budget.as_deref().cloned(),
                answer: answer.clone(),
                answer_from: *answer_from,
                no_answer: no_answer.clone(),
            })
            .filter(|o| !o.is_empty())
            .map(|o| super::to_json(&o)),
        }),
        _ => None,
    }
}

/// The `outcome` column of `task`, when it has a final answer or a check.
pub(crate) fn outcome_of(task: &TaskRecord) -> Option<String> {
    Some(Outcome {
        result: task.result.clone(),
        check: task.check.clone(),
        cost: task.cost,
        budget: task.budget.clone(),
        answer: task.answer.clone(),
        answer_from: task.answer_from,
        no_answer: task.no_answer.clone(),
    })
    .filter(|o| !o.is_empty())
    .map(|o| super::to_json(&o))
}

/// A task's row as either engine reads it, before decoding: text where the engine keeps text.
#[derive(Debug)]
pub(crate) struct Row {
    /// The task's id.
    pub id: String,
    /// Its state's name.
    pub state: String,
    /// Its spec, as JSON.
    pub spec: String,
    /// Why it stopped, by name.
    pub stop_reason: Option<String>,
    /// Its error, as JSON.
    pub error: Option<String>,
    /// Prompt tokens used so far.
    pub prompt_tokens: i64,
    /// Completion tokens used so far.
    pub completion_tokens: i64,
    /// Turns taken.
    pub turns: i64,
    /// When things happened to it.
    pub times: Times,
    /// Its final answer and check, as JSON ([`Outcome`]).
    pub outcome: Option<String>,
    /// The id of the trace of its first run.
    pub trace_id: Option<String>,
}

/// When things happened to a task, in ms since the epoch.
#[derive(Debug)]
pub(crate) struct Times {
    /// When it was asked.
    pub created_ms: i64,
    /// When it first ran.
    pub started_ms: Option<i64>,
    /// When it finished.
    pub finished_ms: Option<i64>,
    /// When its workspace was removed.
    pub files_removed_ms: Option<i64>,
}

/// The record a row holds. A state this build does not know reads as interrupted, so an
/// older daemon sharing a store with a newer one shows the task rather than failing.
pub(crate) fn decode(row: Row) -> Result<TaskRecord> {
    let json = |what: &'static str, text: &str| -> Result<serde_json::Value> {
        serde_json::from_str(text).map_err(|source| StoreError::Decode { what, source })
    };
    let outcome: Outcome = row
        .outcome
        .map(|o| json("outcome", &o).and_then(|v| parse("outcome", v)))
        .transpose()?
        .unwrap_or_default();
    Ok(TaskRecord {
        id: row.id,
        state: TaskState::parse(&row.state).unwrap_or(TaskState::Interrupted),
        spec: parse("task spec", json("task spec", &row.spec)?)?,
        stop_reason: row
            .stop_reason
            .map(|s| parse("stop reason", serde_json::Value::String(s)))
            .transpose()?,
        error: row
            .error
            .map(|e| json("error", &e).and_then(|v| parse("error", v)))
            .transpose()?,
        usage: Usage {
            prompt_tokens: millis(row.prompt_tokens),
            completion_tokens: millis(row.completion_tokens),
            estimated: false,
        },
        turns: u32::try_from(row.turns).unwrap_or(0),
        created_ms: millis(row.times.created_ms),
        started_ms: row.times.started_ms.map(millis),
        finished_ms: row.times.finished_ms.map(millis),
        files_removed_ms: row.times.files_removed_ms.map(millis),
        result: outcome.result,
        check: outcome.check,
        cost: outcome.cost,
        budget: outcome.budget,
        answer: outcome.answer,
        answer_from: outcome.answer_from,
        no_answer: outcome.no_answer,
        trace_id: row.trace_id,
    })
}

/// A stored count or time; a negative one (never written by Tandem) reads as 0.
fn millis(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// The columns a [`Row`] is read from, in its fields' order; `usage` is the engine's own
/// spelling of the prompt and completion token columns.
pub(crate) fn columns(usage: &str) -> String {
    format!(
        "id, state, spec, stop_reason, error, {usage}, turns, created_ms, started_ms, \
         finished_ms, files_removed_ms, outcome, trace_id"
    )
}

/// The states in which a task holds a lease (a daemon runs it, or it waits on a person).
pub(crate) const LEASED: &str = "state IN ('running', 'awaiting_approval')";

/// Which task a daemon claims: first one whose lease lapsed (its daemon died or was cut off),
/// the one that lapsed longest ago first; then the oldest queued task. A task the claiming
/// daemon still runs itself is never claimed by it (it renews the lease instead).
pub(crate) const LAPSED_FIRST: &str = "ORDER BY lease_until_ms, queue_order";
/// Queued tasks are claimed, and every listing runs, in the order the tasks were asked.
pub(crate) const QUEUE_ORDER: &str = "ORDER BY queue_order";

/// Every task, optionally only those in state `?1`, in queue order.
pub(crate) fn list_sql(columns: &str) -> String {
    format!(
        "SELECT {columns} FROM tasks WHERE CAST(?1 AS TEXT) IS NULL OR state = ?1 {QUEUE_ORDER}"
    )
}

/// Up to `?3` tasks, newest first, asked before task `?2` when given, optionally only those in
/// state `?1`. An unknown `?2` matches no row, so the page is empty, not the first one.
pub(crate) fn page_sql(columns: &str) -> String {
    format!(
        "SELECT {columns} FROM tasks
         WHERE (CAST(?1 AS TEXT) IS NULL OR state = ?1)
           AND (CAST(?2 AS TEXT) IS NULL
                OR queue_order < (SELECT queue_order FROM tasks WHERE id = ?2))
         ORDER BY queue_order DESC LIMIT ?3"
    )
}

/// Up to `?3` tasks in queue order, asked after task `?2` when given, optionally only those in
/// state `?1`.
pub(crate) fn after_sql(columns: &str) -> String {
    format!(
        "SELECT {columns} FROM tasks
         WHERE (CAST(?1 AS TEXT) IS NULL OR state = ?1)
           AND (CAST(?2 AS TEXT) IS NULL
                OR queue_order > (SELECT queue_order FROM tasks WHERE id = ?2))
         {QUEUE_ORDER} LIMIT ?3"
    )
}

/// Moves task `?1` from state `?2` to `?3` at `?4`, only if it is still in `?2`; a task that
/// starts running has started then.
pub(crate) const TRANSITION: &str = "UPDATE tasks SET state = ?3,
        started_ms = CASE WHEN ?3 = 'running' THEN ?4 ELSE started_ms END
     WHERE id = ?1 AND state = ?2";

/// Sets task `?1`'s state to `?2` at `?3`; a task that starts running has started then.
pub(crate) const SET_STATE: &str = "UPDATE tasks SET state = ?2,
        started_ms = CASE WHEN ?2 = 'running' THEN ?3 ELSE started_ms END
     WHERE id = ?1";

/// Notes that task `?1` is traced in trace `?2`, unless an earlier run was.
pub(crate) const TRACED: &str = "UPDATE tasks SET trace_id = COALESCE(trace_id, ?2) WHERE id = ?1";

/// Notes that task `?1`'s workspace was removed at `?2`.
pub(crate) const FILES_REMOVED: &str = "UPDATE tasks SET files_removed_ms = ?2 WHERE id = ?1";

/// Task `?1`'s events after seq `?2`, in order.
pub(crate) const EVENTS_AFTER: &str =
    "SELECT seq, at_ms, body FROM events WHERE task_id = ?1 AND seq > ?2 ORDER BY seq";

/// How many tasks are in each state.
pub(crate) const COUNTS: &str = "SELECT state, COUNT(*) FROM tasks GROUP BY state";

/// The reads of task rows, their text built once per engine rather than at every call.
pub(crate) struct Reads {
    /// One task by id (`?1`).
    pub get: String,
    /// [`list_sql`].
    pub list: String,
    /// [`page_sql`].
    pub page: String,
    /// [`after_sql`].
    pub after: String,
}

impl Reads {
    /// The reads of an engine whose usage columns are spelled `usage`, in PostgreSQL's
    /// spelling when `postgres`.
    pub(crate) fn new(usage: &str, postgres: bool) -> Self {
        let columns = columns(usage);
        let spell = |sql: String| if postgres { pg(&sql) } else { sql };
        Self {
            get: spell(format!("SELECT {columns} FROM tasks WHERE id = ?1")),
            list: spell(list_sql(&columns)),
            page: spell(page_sql(&columns)),
            after: spell(after_sql(&columns)),
        }
    }
}

/// `sql` with PostgreSQL's placeholders (`$N` for `?N`). The statements here hold no `?`
/// but placeholders.
pub(crate) fn pg(sql: &str) -> String {
    sql.replace('?', "$")
}

/// The page of at most `limit` tasks among `tasks` (read with one more than `limit`, to know
/// whether there is a next page), and the `before` of the next page.
pub(crate) fn page_of(
    mut tasks: Vec<TaskRecord>,
    limit: usize,
) -> (Vec<TaskRecord>, Option<String>) {
    let more = tasks.len() > limit;
    tasks.truncate(limit);
    let next = more.then(|| tasks.last().map(|t| t.id.clone())).flatten();
    (tasks, next)
}

/// The `LIMIT` that reads one task past a page of `limit`.
pub(crate) fn page_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX).saturating_add(1)
}

/// A state counts table from `(state name, count)` rows, every state present.
pub(crate) fn counts(rows: impl IntoIterator<Item = (String, i64)>) -> Vec<(TaskState, u64)> {
    let mut counts = [0u64; TaskState::ALL.len()];
    for (state, n) in rows {
        let state = TaskState::parse(&state).unwrap_or(TaskState::Interrupted);
        counts[state as usize] += u64::try_from(n).unwrap_or(0);
    }
    TaskState::ALL.map(|s| (s, counts[s as usize])).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_protocol::{ErrorCode, ErrorInfo, TaskSpec};

    #[test]
    fn only_assistant_messages_with_usage_and_the_end_change_the_row() {
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            estimated: false,
        };
        let msg = EventMsg::AssistantMessage {
            turn: 2,
            text: "hi".into(),
            usage: Some(usage),
            tool_calls: Vec::new(),
        };
        assert_eq!(
            row_change(&msg, 5),
            Some(RowChange::Turn { turn: 2, usage })
        );
        let bare = EventMsg::AssistantMessage {
            turn: 2,
            text: "hi".into(),
            usage: None,
            tool_calls: Vec::new(),
        };
        assert_eq!(row_change(&bare, 5), None);
        let started = EventMsg::TurnStarted {
            turn: 1,
            agent: None,
        };
        assert_eq!(row_change(&started, 5), None);
        let end = EventMsg::finished(
            StopReason::Error,
            3,
            usage,
            7,
            Some(ErrorInfo {
                code: ErrorCode::ModelUnreachable,
                message: "down".into(),
            }),
        );
        let Some(RowChange::Finished {
            stop_reason,
            error: Some(error),
            turns: 3,
            at_ms: 9,
            outcome: None,
        }) = row_change(&end, 9)
        else {
            panic!("not an end: {:?}", row_change(&end, 9));
        };
        assert_eq!(stop_reason, StopReason::Error);
        assert!(error.contains("down"), "{error}");
    }

    #[test]
    fn a_page_says_where_the_next_starts_only_when_there_is_one() {
        let task = |id: &str| TaskRecord::queued(id, TaskSpec::default(), 1);
        let (page, next) = page_of(vec![task("c"), task("b"), task("a")], 2);
        assert_eq!(page.len(), 2);
        assert_eq!(next.as_deref(), Some("b"));
        let (page, next) = page_of(vec![task("b"), task("a")], 2);
        assert_eq!((page.len(), next), (2, None));
        assert_eq!(page_limit(usize::MAX), i64::MAX);
    }

    #[test]
    fn postgres_spelling_changes_only_placeholders() {
        assert_eq!(
            pg(TRANSITION).replace('$', "?"),
            TRANSITION,
            "a `$` in a shared statement"
        );
        assert!(pg(&list_sql("id")).contains("CAST($1 AS TEXT) IS NULL OR state = $1"));
    }

    #[test]
    fn a_state_this_build_does_not_know_reads_as_interrupted() {
        let row = Row {
            id: "t".into(),
            state: "teleported".into(),
            spec: "{\"task\":\"x\"}".into(),
            stop_reason: None,
            error: None,
            prompt_tokens: 5,
            completion_tokens: -5,
            turns: -1,
            times: Times {
                created_ms: 1,
                started_ms: None,
                finished_ms: None,
                files_removed_ms: None,
            },
            outcome: Some("{\"result\":\"42\",\"check\":{\"verdict\":\"solved\"}}".into()),
            trace_id: None,
        };
        let record = decode(row).unwrap();
        assert_eq!(record.result, Some(serde_json::json!("42")));
        assert_eq!(
            record.check.map(|c| c.verdict),
            Some(tandem_protocol::Verdict::Solved)
        );
        assert_eq!((record.state, record.turns), (TaskState::Interrupted, 0));
        assert_eq!(
            (record.usage.prompt_tokens, record.usage.completion_tokens),
            (5, 0)
        );
    }
}
