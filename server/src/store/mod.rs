//! The durable task store: tasks, their append-only events, and the leases under which a
//! daemon runs them. One interface, two engines: a SQLite file ([`Store`], the embedded
//! default, one daemon) and PostgreSQL ([`PgStore`], the shared queue of several daemons).
//!
//! Every event is committed here before any client sees it, so what a client was shown is
//! never lost in a crash, and `Last-Event-ID` resumes from exactly what was stored.

use std::collections::HashMap;

use tandem_protocol::{Event, EventMsg, TaskSpec};

pub use tandem_protocol::task::{TaskRecord, TaskState};

mod postgres;
mod rules;
mod sqlite;

pub use postgres::{Imported, PgStore, StoreSecrets};
pub use sqlite::Store;

/// One write the store applies in order with others: an event, or a task's new state.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// A new queued task `.0`, asked at `.2`.
    Create(String, Box<TaskSpec>, u64),
    /// An event of task `.0`, made at `.2` (ms since the epoch).
    Event(String, EventMsg, u64),
    /// Task `.0` is now in state `.1`, since `.2`.
    State(String, TaskState, u64),
}

impl Change {
    /// The task it changes.
    pub fn task(&self) -> &str {
        let (Self::Create(id, ..) | Self::Event(id, ..) | Self::State(id, ..)) = self;
        id
    }
}

/// The lease epochs a batch's writes were made under, by task: a task whose stored epoch is
/// another has been taken over, and its writes in the batch are dropped (fenced out).
pub type Fences = HashMap<String, u64>;

/// What a batch stored.
#[derive(Debug, Default)]
pub struct Applied {
    /// The events as stored, in order.
    pub events: Vec<(String, Event)>,
    /// Tasks whose writes were refused: their lease is another daemon's now.
    pub fenced: Vec<String>,
}

/// A task this daemon now runs, under lease `epoch`.
#[derive(Debug)]
pub struct Claimed {
    /// The task as it was claimed (running now).
    pub record: TaskRecord,
    /// The lease's fencing number: every write for the task carries it.
    pub epoch: u64,
    /// What it stored before (a resumed task's past).
    pub events: Vec<Event>,
    /// A cancel was asked for it and not yet carried out.
    pub cancel: bool,
}

/// What renewing the leases found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Renewed {
    /// Held tasks whose lease is no longer this daemon's (taken over, or ended).
    pub lost: Vec<String>,
    /// Held tasks someone asked to cancel.
    pub cancel: Vec<String>,
}

/// Something another daemon did that this one may need to act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// Another daemon stored events of task `.0`, the first with seq `.1`.
    Events(String, u64),
    /// A task was queued (or requeued): there may be work to claim.
    Queued,
    /// Someone asked to cancel task `.0`.
    Cancel(String),
    /// The store's feed of notices was cut and is back: something may have been missed.
    Reconnected,
}

/// Where a store delivers notices.
pub type NoticeSink = Box<dyn Fn(Notice) + Send + Sync>;

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed.
    #[error("task store {path}: {source}")]
    Sqlite {
        /// The database file.
        path: String,
        /// What SQLite said.
        #[source]
        source: rusqlite::Error,
    },
    /// PostgreSQL failed or could not be reached.
    #[error("task store {url}: {message}")]
    Postgres {
        /// The database, its password hidden.
        url: String,
        /// What failed, and what to do.
        message: String,
        /// Whether the database could not be reached (or went away): worth retrying.
        unreachable: bool,
    },
    /// A stored value did not decode (a newer daemon's data, or corruption).
    #[error("task store: a stored {what} does not decode: {source}")]
    Decode {
        /// Which value.
        what: &'static str,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The database was written by a newer Tandem.
    #[error(
        "task store {path} has schema version {found}, newer than this Tandem knows ({known}); upgrade Tandem or use another store"
    )]
    TooNew {
        /// The database.
        path: String,
        /// Its version.
        found: i64,
        /// The newest this build knows.
        known: i64,
    },
    /// A lock was poisoned by a panic elsewhere.
    #[error("task store: lock poisoned")]
    Poisoned,
    /// The writer thread did not answer.
    #[error("task store: the writer {0}; see the daemon's log")]
    Writer(&'static str),
}

impl StoreError {
    /// Whether the database could not be reached: the call may work if tried again later.
    pub fn unreachable(&self) -> bool {
        matches!(
            self,
            Self::Postgres {
                unreachable: true,
                ..
            }
        )
    }
}

/// Store results.
pub type Result<T> = std::result::Result<T, StoreError>;

/// What the daemon needs of a task store. Everything above the store reaches it through this
/// trait alone, so the engine is a setting: nothing above it knows which one it has.
pub trait TaskStore: Send + Sync {
    /// Applies `changes` (of any tasks, in order) at once; a change of a task in `fences`
    /// applies only while the task's lease epoch is still that one.
    fn apply(&self, changes: &[Change], fences: &Fences) -> Result<Applied>;
    /// Moves a task from `from` to `to` only if it is still in `from`; whether it moved.
    fn transition(&self, id: &str, from: TaskState, to: TaskState, now_ms: u64) -> Result<bool>;
    /// One task, if it exists.
    fn get(&self, id: &str) -> Result<Option<TaskRecord>>;
    /// Every task in queue order, optionally only those in `state`.
    fn list(&self, state: Option<TaskState>) -> Result<Vec<TaskRecord>>;
    /// At most `limit` tasks, newest first, before task `before` when given; and the next
    /// page's `before`.
    fn page(
        &self,
        state: Option<TaskState>,
        before: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<TaskRecord>, Option<String>)>;
    /// At most `limit` tasks in queue order, after task `after` when given.
    fn list_after(
        &self,
        state: Option<TaskState>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<TaskRecord>>;
    /// Events of a task with seq above `after`, in order.
    fn events_after(&self, id: &str, after: u64) -> Result<Vec<Event>>;
    /// At start-up, for daemon `daemon`: the running tasks no live daemon can be running any
    /// more. In a store one daemon owns (its state dir locked), that is every running task,
    /// and they become interrupted (their ids are returned); in a shared store only this
    /// daemon's own, whose leases are ended so that any daemon resumes them at once.
    fn interrupt_running(&self, daemon: &str) -> Result<Vec<String>>;
    /// How many tasks are in each state.
    fn counts(&self) -> Result<Vec<(TaskState, u64)>>;
    /// Notes that the task's workspace was removed at `at_ms`.
    fn files_removed(&self, id: &str, at_ms: u64) -> Result<()>;
    /// Claims the next task for `daemon` for `lease_ms`: the oldest queued one, or one whose
    /// daemon's lease ran out (it died, or was cut off); it is running under a new epoch.
    /// Tasks in `running` (the daemon's own, whose lease lapsed while it still runs them: it
    /// renews them instead) are left out.
    fn claim(
        &self,
        daemon: &str,
        lease_ms: u64,
        now_ms: u64,
        running: &[String],
    ) -> Result<Option<Claimed>>;
    /// Extends `daemon`'s leases of `held` (task, epoch) by `lease_ms`.
    fn renew(
        &self,
        daemon: &str,
        held: &[(String, u64)],
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<Renewed>;
    /// Asks for task `id` to be cancelled wherever it runs; the daemon holding it is told.
    fn request_cancel(&self, id: &str) -> Result<()>;
    /// The daemon that holds task `id`'s lease now, if any (running or waiting for approval).
    fn owner(&self, id: &str, now_ms: u64) -> Result<Option<String>>;
    /// Stores the decision `msg` (an `ApprovalDecided`) of approval `n` of task `id`, only
    /// if none is stored yet and the task has not finished; the event as stored, or `None`.
    fn decide(&self, id: &str, n: u32, msg: &EventMsg, now_ms: u64) -> Result<Option<Event>>;
    /// Starts telling `sink` what other daemons do (a store only one daemon uses has
    /// nothing to tell, and returns at once).
    fn notices(&self, daemon: &str, sink: NoticeSink) -> Result<()>;
}

/// Whether `events` hold a decision of approval `n`.
pub(crate) fn decided(events: &[Event], n: u32) -> bool {
    events
        .iter()
        .any(|e| matches!(e.msg, EventMsg::ApprovalDecided { n: m, .. } if m == n))
}

/// A plain value's JSON text.
pub(crate) fn to_json<T: serde::Serialize>(value: &T) -> String {
    // Our own plain data types always serialise.
    serde_json::to_string(value).unwrap_or_default()
}

/// Decodes a stored value.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(
    what: &'static str,
    v: serde_json::Value,
) -> Result<T> {
    serde_json::from_value(v).map_err(|source| StoreError::Decode { what, source })
}

/// Decodes a stored event body.
pub(crate) fn event(seq: i64, at_ms: i64, body: &str) -> Result<Event> {
    Ok(Event {
        seq: seq as u64,
        at_ms: at_ms as u64,
        path: None,
        msg: serde_json::from_str(body).map_err(|source| StoreError::Decode {
            what: "event",
            source,
        })?,
    })
}
