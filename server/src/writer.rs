//! The store writer: the one road for a task's events and state changes, conditional ones
//! (resume, cancel) included. It gathers what
//! the turn loops and submits send, commits it in one transaction (a burst from many tasks
//! costs one commit and one log sync), holds streamed pieces briefly to merge them into one
//! row, and only then sends the events to live subscribers.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tandem_protocol::{Event, EventMsg, TaskSpec};
use tokio::sync::broadcast;

use tandem_protocol::EventMsg as Msg;

use crate::running::RunningTasks as Running;
#[cfg(test)]
use crate::store::Store;
use crate::store::{Applied, Change, Fences, StoreError, TaskState, TaskStore};

/// Work for the store's writer thread, in order.
pub(crate) enum Write {
    /// An event of task `.0`, made at `.2` under lease epoch `.3` (when the daemon holds one),
    /// weighing `.4` bytes in the backlog.
    Event(String, EventMsg, u64, Option<u64>, usize),
    /// Task `.0`'s new state, under lease epoch `.3`.
    State(String, TaskState, u64, Option<u64>),
    /// A new task; the sender learns once it is committed.
    Create(String, Box<TaskSpec>, u64, Created),
    /// Task `id` moves from `from` to `to` only if it is still in `from` (two resumes, or a
    /// resume and a cancel, race); the sender learns whether it moved.
    Transition {
        id: String,
        from: TaskState,
        to: TaskState,
        at: u64,
        moved: tokio::sync::oneshot::Sender<Result<bool, StoreError>>,
    },
    Flush(std::sync::mpsc::Sender<()>),
    /// Acknowledged once what was queued before it is committed, by the next commit that
    /// comes (not one of its own: blocks starting together share a commit and its sync).
    Barrier(std::sync::mpsc::Sender<()>),
}

/// Where the writer says whether a new task was committed.
pub(crate) type Created = tokio::sync::oneshot::Sender<Result<(), StoreError>>;

/// How long the writer gathers events after the first before it commits: concurrent tasks
/// share a commit, and a live client waits at most this long (next to a model call, nothing).
const GATHER: Duration = Duration::from_millis(2);
/// How often an idle writer looks whether the database is back.
const PROBE: Duration = Duration::from_secs(1);
/// Most changes in one commit.
const MAX_BATCH: usize = 1024;
/// Most bytes of events that tasks may have queued for the writer before a task that records
/// another waits for the writer to catch up: a task that makes events faster than the store
/// takes them is slowed down, rather than the daemon's memory growing with it.
pub(crate) const MAX_BACKLOG: usize = 32 << 20;
/// Longest a task waits for room in the backlog before it queues anyway (the writer is then
/// stuck on something this bound cannot help with).
const BACKLOG_WAIT: Duration = Duration::from_secs(60);
/// Largest text that streamed pieces are merged into.
const MAX_MERGED: usize = 64 << 10;
/// Longest a streamed piece (a model token, a chunk of output) waits for the next piece of
/// its stream before it is stored: a model streams a token every 10-50 ms, and one row and
/// one commit per token is what this saves. A live client sees the text in bursts this far
/// apart at most.
const HOLD: Duration = Duration::from_millis(100);
/// What the writer gathered since its last commit.
#[derive(Default)]
struct Batch {
    changes: Vec<Change>,
    /// Streamed pieces waiting for more of their stream, at most one per task.
    held: Vec<PendingPiece>,
    /// Submitters waiting on their task's commit, by the index of its change.
    created: Vec<(usize, Created)>,
    flushes: Vec<std::sync::mpsc::Sender<()>>,
    /// Conditional state changes, made once the changes before them are committed.
    transitions: Vec<Write>,
    /// Someone is waiting on this batch: commit without gathering more.
    urgent: bool,
    /// The lease epochs the batch's writes were made under.
    fences: Fences,
    /// The backlog's bytes of the events taken since the last commit.
    weight: usize,
}

/// A streamed piece held back to be merged with the ones that follow it.
struct PendingPiece {
    id: String,
    msg: EventMsg,
    at: u64,
    since: Instant,
    /// The epoch it was written under: it goes into the batch that stores it, which may
    /// be a later one than the batch that took it.
    fence: Option<u64>,
}

/// Told the tasks whose writes were fenced out.
pub(crate) type OnFenced = Box<dyn Fn(&[(String, u64)]) + Send>;

/// Where the writer tells what it stored and what it could not.
pub(crate) struct Outlet {
    /// Live subscribers, sent the events once stored.
    pub(crate) live: broadcast::Sender<Arc<(String, Event)>>,
    /// Told the tasks whose writes were fenced out, with the epoch they carried: their lease
    /// is another daemon's.
    pub(crate) fenced: OnFenced,
    /// Whether the database is unreachable now (the writer is retrying).
    pub(crate) down: Arc<std::sync::atomic::AtomicBool>,
    /// The bytes of events queued and not yet committed.
    pub(crate) backlog: Arc<Backlog>,
}

/// The bytes of events queued for the writer and not yet committed, which tasks wait on.
#[derive(Default)]
pub(crate) struct Backlog {
    bytes: std::sync::Mutex<usize>,
    drained: std::sync::Condvar,
}

impl Backlog {
    /// Waits (at most [`BACKLOG_WAIT`]) while more than `limit` bytes are queued, then counts
    /// `weight` more; not while `down` (a writer that retries a database that is away drains
    /// nothing; the events are kept in order meanwhile).
    fn admit(&self, weight: usize, limit: usize, down: &std::sync::atomic::AtomicBool) {
        let Ok(mut bytes) = self.bytes.lock() else {
            return;
        };
        let deadline = Instant::now() + BACKLOG_WAIT;
        while *bytes > limit && !down.load(std::sync::atomic::Ordering::SeqCst) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    queued = *bytes,
                    "the store writer has not caught up in {BACKLOG_WAIT:?}; queueing anyway"
                );
                break;
            }
            // Woken by each commit; the slice keeps a change of `down` from being missed.
            match self
                .drained
                .wait_timeout(bytes, left.min(Duration::from_millis(200)))
            {
                Ok((b, _)) => bytes = b,
                Err(_) => return,
            }
        }
        *bytes += weight;
    }

    /// Counts `weight` bytes as committed and wakes the tasks waiting for room.
    fn drained(&self, weight: usize) {
        if weight == 0 {
            return;
        }
        if let Ok(mut bytes) = self.bytes.lock() {
            *bytes = bytes.saturating_sub(weight);
        }
        self.drained.notify_all();
    }

    /// The bytes queued now.
    fn queued(&self) -> usize {
        self.bytes.lock().map_or(0, |b| *b)
    }

    /// Whether more than `limit` bytes are queued (so that a record would wait).
    fn queued_over(&self, limit: usize) -> bool {
        self.queued() > limit
    }
}

/// What an event weighs in the backlog: the length of its JSON, counted without making it.
fn weight(msg: &EventMsg) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = serde_json::to_writer(&mut count, msg);
    count.0
}

impl Batch {
    fn fence(&mut self, id: &str, fence: Option<u64>) {
        if let Some(epoch) = fence {
            let held = self.fences.entry(id.to_owned()).or_insert(epoch);
            *held = (*held).max(epoch);
        }
    }

    fn take(&mut self, write: Write) {
        if let Write::Event(.., weight) = &write {
            self.weight += weight;
        }
        match write {
            Write::Event(id, msg, at, fence, _) if is_piece(&msg) => self.hold(id, msg, at, fence),
            Write::Event(id, msg, at, fence, _) => {
                self.fence(&id, fence);
                self.release(&id);
                self.changes.push(Change::Event(id, msg, at));
            }
            Write::State(id, state, at, fence) => {
                self.fence(&id, fence);
                self.release(&id);
                self.changes.push(Change::State(id, state, at));
            }
            Write::Create(id, spec, at, created) => {
                self.created.push((self.changes.len(), created));
                self.changes.push(Change::Create(id, spec, at));
                self.urgent = true;
            }
            Write::Flush(ack) => {
                self.release_due(None);
                self.flushes.push(ack);
                self.urgent = true;
            }
            Write::Barrier(ack) => self.flushes.push(ack),
            transition @ Write::Transition { .. } => {
                if let Write::Transition { id, .. } = &transition {
                    self.release(id);
                }
                self.transitions.push(transition);
                self.urgent = true;
            }
        }
    }

    /// Makes the conditional state changes, after the batch's other changes are committed
    /// (nothing of their tasks can follow them in the same batch: their callers wait).
    fn transition(&mut self, store: &dyn TaskStore) {
        for t in self.transitions.drain(..) {
            if let Write::Transition {
                id,
                from,
                to,
                at,
                moved,
            } = t
            {
                let _ = moved.send(store.transition(&id, from, to, at));
            }
        }
    }

    /// Holds a streamed piece, appended to its task's held piece when both are of one stream.
    /// Any other change of the task releases the held piece first, so its order is kept.
    fn hold(&mut self, id: String, msg: EventMsg, at: u64, fence: Option<u64>) {
        let held = self.held.iter().position(|h| h.id == id);
        let msg = match held {
            Some(i) => match merge(&mut self.held[i].msg, msg) {
                None => return,
                Some(msg) => {
                    self.unhold(i);
                    msg
                }
            },
            None => msg,
        };
        self.held.push(PendingPiece {
            id,
            msg,
            at,
            since: Instant::now(),
            fence,
        });
    }

    /// Moves held piece `i` into the batch.
    fn unhold(&mut self, i: usize) {
        let h = self.held.swap_remove(i);
        self.fence(&h.id, h.fence);
        self.changes.push(Change::Event(h.id, h.msg, h.at));
    }

    /// Moves task `id`'s held piece into the batch.
    fn release(&mut self, id: &str) {
        if let Some(i) = self.held.iter().position(|h| h.id == id) {
            self.unhold(i);
        }
    }

    /// Moves the pieces held since before `now - HOLD` (all of them for `None`) into the batch.
    fn release_due(&mut self, now: Option<Instant>) {
        let due = |h: &PendingPiece| now.is_none_or(|now| h.since + HOLD <= now);
        let mut i = 0;
        while i < self.held.len() {
            if due(&self.held[i]) {
                self.unhold(i);
            } else {
                i += 1;
            }
        }
    }

    /// When the oldest held piece is due.
    fn next_due(&self) -> Option<Instant> {
        self.held.iter().map(|h| h.since + HOLD).min()
    }

    /// Commits the changes in one transaction, then tells the submitters and sends the events
    /// to live subscribers. While the database cannot be reached it keeps the changes, in
    /// order, and tries again with backoff; new tasks are refused at once instead, so their
    /// submitters hear of it (a 503) rather than wait.
    fn commit(&mut self, store: &dyn TaskStore, out: &Outlet) {
        if self.changes.is_empty() {
            return;
        }
        let mut backoff = Duration::from_millis(50);
        let applied = loop {
            match store.apply(&self.changes, &self.fences) {
                Err(e) if e.unreachable() => {
                    went_down(out, &e);
                    self.refuse_creates(&e);
                    if self.changes.is_empty() {
                        return;
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                other => break other,
            }
        };
        came_back(out);
        let mut created = std::mem::take(&mut self.created).into_iter().peekable();
        let applied = match applied {
            Ok(applied) => {
                for (_, waiter) in created {
                    let _ = waiter.send(Ok(()));
                }
                applied
            }
            // One bad change must not cost the others: apply them one by one.
            Err(e) => {
                tracing::warn!(error = %e, changes = self.changes.len(), "a batch failed; storing its changes one by one");
                let mut all = Applied::default();
                for (i, change) in self.changes.iter().enumerate() {
                    let result = apply_retrying(store, change, &self.fences, out);
                    let waiter = created.next_if(|(at, _)| *at == i).map(|(_, w)| w);
                    match (result, waiter) {
                        (Ok(one), waiter) => {
                            all.events.extend(one.events);
                            all.fenced.extend(one.fenced);
                            if let Some(w) = waiter {
                                let _ = w.send(Ok(()));
                            }
                        }
                        (Err(e), Some(w)) => {
                            let _ = w.send(Err(e));
                        }
                        (Err(e), None) => {
                            tracing::error!(error = %e, ?change, "cannot store a change");
                        }
                    }
                }
                all.fenced.sort();
                all.fenced.dedup();
                all
            }
        };
        if !applied.fenced.is_empty() {
            tracing::warn!(tasks = ?applied.fenced, "another daemon holds these tasks now; their writes from here were refused");
            let fenced: Vec<(String, u64)> = applied
                .fenced
                .iter()
                .filter_map(|id| Some((id.clone(), *self.fences.get(id)?)))
                .collect();
            (out.fenced)(&fenced);
        }
        for item in applied.events {
            let _ = out.live.send(Arc::new(item));
        }
        self.changes.clear();
        self.fences.clear();
    }

    /// Takes the new tasks out of the batch, telling their submitters `e`.
    fn refuse_creates(&mut self, e: &StoreError) {
        let refusal = || match e {
            StoreError::Postgres { url, message, .. } => StoreError::Postgres {
                url: url.clone(),
                message: message.clone(),
                unreachable: true,
            },
            other => StoreError::Postgres {
                url: String::new(),
                message: other.to_string(),
                unreachable: true,
            },
        };
        if self.created.is_empty() {
            return;
        }
        let mut waiters = std::mem::take(&mut self.created).into_iter().peekable();
        let mut kept = Vec::with_capacity(self.changes.len());
        for (i, change) in std::mem::take(&mut self.changes).into_iter().enumerate() {
            match waiters.next_if(|(at, _)| *at == i) {
                Some((_, waiter)) => {
                    let _ = waiter.send(Err(refusal()));
                }
                None => kept.push(change),
            }
        }
        self.changes = kept;
    }
}

/// Stores one change, retrying with backoff while the database cannot be reached: a change
/// is dropped only when the store refuses it, never because the database was away.
fn apply_retrying(
    store: &dyn TaskStore,
    change: &Change,
    fences: &Fences,
    out: &Outlet,
) -> Result<Applied, StoreError> {
    let mut backoff = Duration::from_millis(50);
    loop {
        match store.apply(std::slice::from_ref(change), fences) {
            Err(e) if e.unreachable() && !matches!(change, Change::Create(..)) => {
                went_down(out, &e);
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            other => {
                if other.is_ok() {
                    came_back(out);
                }
                return other;
            }
        }
    }
}

fn went_down(out: &Outlet, e: &StoreError) {
    if !out.down.swap(true, std::sync::atomic::Ordering::SeqCst) {
        tracing::warn!(error = %e, "the task database is unreachable; keeping the tasks' events and retrying");
    }
}

fn came_back(out: &Outlet) {
    if out.down.swap(false, std::sync::atomic::Ordering::SeqCst) {
        tracing::info!("the task database is back");
    }
}

/// The writer thread: commits whatever is waiting in one transaction (a burst from many
/// tasks costs one commit), then sends the events to live subscribers.
pub(crate) fn write_events(
    store: &dyn TaskStore,
    writes: &std::sync::mpsc::Receiver<Write>,
    out: &Outlet,
) {
    use std::sync::mpsc::RecvTimeoutError;
    let mut batch = Batch::default();
    loop {
        // While the database is down and nothing is written, it is looked at every second:
        // submits are refused until it is back, so no commit would tell.
        let down = out.down.load(std::sync::atomic::Ordering::SeqCst);
        let first = match (batch.next_due(), down) {
            (None, false) => writes.recv().map_err(|_| RecvTimeoutError::Disconnected),
            (None, true) => writes.recv_timeout(PROBE),
            (Some(due), _) => writes.recv_timeout(due.saturating_duration_since(Instant::now())),
        };
        if down && matches!(first, Err(RecvTimeoutError::Timeout)) && store.counts().is_ok() {
            came_back(out);
        }
        match first {
            Ok(write) => {
                batch.take(write);
                // Sleeping, not waiting on the channel: the writes that arrive meanwhile do
                // not each wake this thread, which on a busy machine costs more than storing
                // them. A submit or a flush waiting on the commit is not kept waiting.
                if !batch.urgent && !batch.changes.is_empty() {
                    std::thread::sleep(GATHER);
                }
                // Bounded, so a steady stream cannot keep flushes and held pieces waiting.
                for write in writes.try_iter().take(MAX_BATCH) {
                    batch.take(write);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        batch.release_due(Some(Instant::now()));
        batch.commit(store, out);
        // Pieces still held count as drained: they are at most one merged piece per task.
        out.backlog.drained(std::mem::take(&mut batch.weight));
        batch.transition(store);
        for ack in batch.flushes.drain(..) {
            let _ = ack.send(());
        }
        batch.urgent = false;
    }
    batch.release_due(None);
    batch.commit(store, out);
    batch.transition(store);
}

/// Whether an event is a piece of streamed text, which the next piece can be appended to.
fn is_piece(msg: &EventMsg) -> bool {
    matches!(
        msg,
        EventMsg::AssistantDelta { .. } | EventMsg::ExecOutput { .. }
    )
}

/// Appends `next`'s text to `into` when both are pieces of one stream; gives it back if not.
fn merge(into: &mut EventMsg, next: EventMsg) -> Option<EventMsg> {
    let (text, more) = match (into, &next) {
        (
            EventMsg::AssistantDelta { turn, text },
            EventMsg::AssistantDelta {
                turn: next_turn,
                text: more,
            },
        ) if turn == next_turn => (text, more),
        (
            EventMsg::ExecOutput {
                turn,
                index,
                stream,
                text,
            },
            EventMsg::ExecOutput {
                turn: next_turn,
                index: next_index,
                stream: next_stream,
                text: more,
            },
        ) if (*turn, *index, *stream) == (*next_turn, *next_index, *next_stream) => (text, more),
        _ => return Some(next),
    };
    if text.len() + more.len() > MAX_MERGED {
        return Some(next);
    }
    text.push_str(more);
    None
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use tandem_protocol::OutputStream;

    use super::*;

    fn delta(turn: u32, text: &str) -> EventMsg {
        EventMsg::AssistantDelta {
            turn,
            text: text.to_owned(),
        }
    }

    fn output(index: u32, stream: OutputStream, text: &str) -> EventMsg {
        EventMsg::ExecOutput {
            turn: 1,
            index,
            stream,
            text: text.to_owned(),
        }
    }

    /// What `batch` would store, task by task, in order.
    fn per_task(batch: Batch) -> BTreeMap<String, Vec<Change>> {
        let mut tasks: BTreeMap<String, Vec<Change>> = BTreeMap::new();
        for change in batch.changes {
            let (Change::Event(id, ..) | Change::State(id, ..) | Change::Create(id, ..)) = &change;
            tasks.entry(id.clone()).or_default().push(change);
        }
        tasks
    }

    fn events_of(items: Vec<(&str, EventMsg)>) -> BTreeMap<String, Vec<EventMsg>> {
        let mut batch = Batch::default();
        for (id, msg) in items {
            batch.take(Write::Event(id.to_owned(), msg, 0, None, 0));
        }
        batch.release_due(None);
        per_task(batch)
            .into_iter()
            .map(|(id, changes)| {
                let msgs = changes.into_iter().map(|c| match c {
                    Change::Event(_, msg, _) => msg,
                    other => panic!("only events were taken: {other:?}"),
                });
                (id, msgs.collect())
            })
            .collect()
    }

    #[test]
    fn streamed_pieces_of_one_stream_merge_across_other_tasks_events() {
        let got = events_of(vec![
            ("a", delta(1, "Hel")),
            ("b", delta(1, "x")),
            ("a", delta(1, "lo")),
            (
                "b",
                EventMsg::TurnStarted {
                    turn: 2,
                    agent: None,
                },
            ),
            ("a", delta(2, "next turn")),
            ("b", delta(2, "y")),
            ("a", output(1, OutputStream::Stdout, "1\n")),
            ("a", output(1, OutputStream::Stdout, "2\n")),
            ("a", output(1, OutputStream::Stderr, "oops")),
            ("a", output(1, OutputStream::Stdout, "3\n")),
            ("a", output(2, OutputStream::Stdout, "other block")),
        ]);
        assert_eq!(
            got["a"],
            [
                delta(1, "Hello"),
                delta(2, "next turn"),
                output(1, OutputStream::Stdout, "1\n2\n"),
                output(1, OutputStream::Stderr, "oops"),
                output(1, OutputStream::Stdout, "3\n"),
                output(2, OutputStream::Stdout, "other block"),
            ]
        );
        assert_eq!(
            got["b"],
            [
                delta(1, "x"),
                EventMsg::TurnStarted {
                    turn: 2,
                    agent: None
                },
                delta(2, "y")
            ]
        );
    }

    #[test]
    fn another_change_of_the_task_or_the_size_cap_stops_a_merge() {
        let big = "x".repeat(MAX_MERGED);
        let got = events_of(vec![
            ("a", delta(1, "one")),
            (
                "a",
                EventMsg::TurnStarted {
                    turn: 1,
                    agent: None,
                },
            ),
            ("a", delta(1, "two")),
            ("a", delta(1, &big)),
        ]);
        assert_eq!(
            got["a"],
            [
                delta(1, "one"),
                EventMsg::TurnStarted {
                    turn: 1,
                    agent: None
                },
                delta(1, "two"),
                delta(1, &big),
            ]
        );
        let mut batch = Batch::default();
        batch.take(Write::Event("a".into(), delta(1, "one"), 0, None, 0));
        batch.take(Write::State("a".into(), TaskState::Interrupted, 0, None));
        batch.take(Write::Event("a".into(), delta(1, "two"), 0, None, 0));
        batch.release_due(None);
        assert_eq!(
            per_task(batch)["a"],
            [
                Change::Event("a".into(), delta(1, "one"), 0),
                Change::State("a".into(), TaskState::Interrupted, 0),
                Change::Event("a".into(), delta(1, "two"), 0),
            ]
        );
    }

    #[test]
    fn a_streamed_piece_is_held_for_its_time_at_most() {
        let mut batch = Batch::default();
        let start = Instant::now();
        batch.take(Write::Event("a".into(), delta(1, "tok"), 0, None, 0));
        batch.release_due(Some(start));
        assert!(batch.changes.is_empty());
        let due = batch.next_due().unwrap();
        assert!(due >= start + HOLD && due <= Instant::now() + HOLD);
        batch.release_due(Some(due));
        assert_eq!(
            batch.changes,
            [Change::Event("a".into(), delta(1, "tok"), 0)]
        );
        assert!(batch.next_due().is_none());
    }

    fn outlet(live: broadcast::Sender<Arc<(String, Event)>>) -> Outlet {
        Outlet {
            live,
            fenced: Box::new(|_| {}),
            down: Arc::default(),
            backlog: Arc::default(),
        }
    }

    /// A store in a temporary directory (kept while the guard lives) holding queued task `a`.
    fn store_with_task_a() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("tandem.db")).unwrap();
        store
            .apply(&[Change::Create("a".into(), Box::default(), 1)])
            .unwrap();
        (dir, store)
    }

    #[test]
    fn a_held_piece_keeps_the_fence_it_was_written_under() {
        let (_dir, store) = store_with_task_a();
        store
            .apply(&[Change::Create("b".into(), Box::default(), 1)])
            .unwrap();
        // This daemon holds `a` under epoch 1, for a lease that has lapsed by 20.
        assert_eq!(store.claim("d", 0, 10, &[]).unwrap().unwrap().epoch, 1);
        let (live, _seen) = broadcast::channel(16);
        let told: Arc<std::sync::Mutex<Vec<(String, u64)>>> = Arc::default();
        let out = Outlet {
            fenced: Box::new({
                let told = told.clone();
                move |ids| told.lock().unwrap().extend_from_slice(ids)
            }),
            ..outlet(live)
        };
        let mut batch = Batch::default();
        // A's piece waits for more of its stream while B's event is committed alone.
        batch.take(Write::Event("a".into(), delta(1, "late"), 0, Some(1), 0));
        let turn = EventMsg::TurnStarted {
            turn: 1,
            agent: None,
        };
        batch.take(Write::Event("b".into(), turn, 0, None, 0));
        batch.commit(&store, &out);
        // Another daemon takes `a` over before the piece is stored: the piece is refused.
        assert_eq!(store.claim("e", 60_000, 20, &[]).unwrap().unwrap().epoch, 2);
        batch.release_due(None);
        batch.commit(&store, &out);
        assert!(store.events_after("a", 0).unwrap().is_empty());
        assert_eq!(store.events_after("b", 0).unwrap().len(), 1);
        assert_eq!(*told.lock().unwrap(), [("a".to_owned(), 1)]);
    }

    #[test]
    fn a_task_that_outruns_the_writer_waits_and_one_whose_database_is_away_does_not() {
        let backlog = Arc::new(Backlog::default());
        let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let limit = 1000;
        let peak = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // Four producers of 100-byte events against a writer that drains 100 bytes a
        // millisecond: the backlog never holds more than the limit and one event each.
        let producers: Vec<_> = (0..4)
            .map(|_| {
                let (backlog, down, peak) = (backlog.clone(), down.clone(), peak.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        backlog.admit(100, limit, &down);
                        peak.fetch_max(backlog.queued(), std::sync::atomic::Ordering::SeqCst);
                    }
                })
            })
            .collect();
        let drained = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (backlog, drained) = (backlog.clone(), drained.clone());
            std::thread::spawn(move || {
                while !drained.load(std::sync::atomic::Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                    backlog.drained(100);
                }
            })
        };
        for p in producers {
            p.join().unwrap();
        }
        drained.store(true, std::sync::atomic::Ordering::SeqCst);
        writer.join().unwrap();
        let peak = peak.load(std::sync::atomic::Ordering::SeqCst);
        assert!(peak <= limit + 4 * 100, "the backlog reached {peak} bytes");
        // Nothing drains while the database is away, and nobody waits for it.
        let stuck = Backlog::default();
        down.store(true, std::sync::atomic::Ordering::SeqCst);
        for _ in 0..100 {
            stuck.admit(100, limit, &down);
        }
        assert_eq!(stuck.queued(), 100 * 100);
    }

    #[test]
    fn a_committed_event_leaves_the_backlog() {
        let (_dir, store) = store_with_task_a();
        let (tx, rx) = std::sync::mpsc::channel();
        let (live, _seen) = broadcast::channel(16);
        let out = outlet(live);
        let msg = EventMsg::TurnStarted {
            turn: 1,
            agent: None,
        };
        let w = weight(&msg);
        assert_eq!(w, serde_json::to_vec(&msg).unwrap().len());
        out.backlog.admit(w, MAX_BACKLOG, &out.down);
        tx.send(Write::Event("a".into(), msg, 1, None, w)).unwrap();
        drop(tx);
        write_events(&store, &rx, &out);
        assert_eq!(out.backlog.queued(), 0);
    }

    #[test]
    fn a_bad_change_in_a_batch_costs_only_itself() {
        let (_dir, store) = store_with_task_a();
        let (tx, rx) = std::sync::mpsc::channel();
        let (live, mut seen) = broadcast::channel(16);
        tx.send(Write::State("a".into(), TaskState::Running, 2, None))
            .unwrap();
        tx.send(Write::Event("a".into(), delta(1, "kept"), 3, None, 0))
            .unwrap();
        tx.send(Write::Event(
            "ghost".into(),
            delta(1, "no such task"),
            3,
            None,
            0,
        ))
        .unwrap();
        tx.send(Write::Event(
            "a".into(),
            EventMsg::TurnStarted {
                turn: 2,
                agent: None,
            },
            4,
            None,
            0,
        ))
        .unwrap();
        let (new_ok, new_told) = tokio::sync::oneshot::channel();
        tx.send(Write::Create("b".into(), Box::default(), 5, new_ok))
            .unwrap();
        let (twice_ok, twice_told) = tokio::sync::oneshot::channel();
        tx.send(Write::Create("a".into(), Box::default(), 5, twice_ok))
            .unwrap();
        drop(tx);
        write_events(&store, &rx, &outlet(live));
        new_told.blocking_recv().unwrap().unwrap();
        let twice = twice_told.blocking_recv().unwrap().unwrap_err();
        assert!(
            twice.to_string().contains("UNIQUE constraint failed"),
            "{twice}"
        );
        assert_eq!(store.get("b").unwrap().unwrap().state, TaskState::Queued);
        let events = store.events_after("a", 0).unwrap();
        assert_eq!(
            events
                .iter()
                .map(|e| (e.seq, e.msg.clone()))
                .collect::<Vec<_>>(),
            [
                (1, delta(1, "kept")),
                (
                    2,
                    EventMsg::TurnStarted {
                        turn: 2,
                        agent: None
                    }
                )
            ]
        );
        assert_eq!(store.get("a").unwrap().unwrap().state, TaskState::Running);
        // Only what was stored reached live subscribers.
        assert_eq!(seen.try_recv().unwrap().1.seq, 1);
        assert_eq!(seen.try_recv().unwrap().1.seq, 2);
        assert!(seen.try_recv().is_err());
    }

    #[test]
    fn a_conditional_change_follows_what_was_queued_before_it_and_says_if_it_moved() {
        let (_dir, store) = store_with_task_a();
        let (tx, rx) = std::sync::mpsc::channel();
        let (live, _seen) = broadcast::channel(16);
        let transition = |from, to| {
            let (moved, answer) = tokio::sync::oneshot::channel();
            tx.send(Write::Transition {
                id: "a".into(),
                from,
                to,
                at: 3,
                moved,
            })
            .unwrap();
            answer
        };
        // Queued before it in the same batch: the task is interrupted by then.
        tx.send(Write::State("a".into(), TaskState::Interrupted, 2, None))
            .unwrap();
        let first = transition(TaskState::Interrupted, TaskState::Queued);
        let second = transition(TaskState::Interrupted, TaskState::Queued);
        drop(tx);
        write_events(&store, &rx, &outlet(live));
        assert!(first.blocking_recv().unwrap().unwrap());
        assert!(
            !second.blocking_recv().unwrap().unwrap(),
            "two resumes both moved it"
        );
        assert_eq!(store.get("a").unwrap().unwrap().state, TaskState::Queued);
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The road every state change takes to the store: writes queued for the writer thread, in
/// order. Cloning shares the queue.
#[derive(Clone)]
pub(crate) struct Writes {
    queue: std::sync::mpsc::Sender<Write>,
    /// The tasks running here: their writes carry their lease's epoch.
    held: Running,
    backlog: Arc<Backlog>,
    /// Whether the database is away (then nothing waits on the backlog).
    down: Arc<std::sync::atomic::AtomicBool>,
    /// Where stored events go out to live subscribers (the writer sends them once stored).
    live: broadcast::Sender<Arc<(String, Event)>>,
}

impl Writes {
    /// A handle on the writer that reads `queue` (and drains `backlog` as it commits, and
    /// sends what it stored on `live`); a task's writes carry its epoch in `held`.
    pub(crate) fn new(
        queue: std::sync::mpsc::Sender<Write>,
        held: Running,
        backlog: Arc<Backlog>,
        down: Arc<std::sync::atomic::AtomicBool>,
        live: broadcast::Sender<Arc<(String, Event)>>,
    ) -> Self {
        Self {
            queue,
            held,
            backlog,
            down,
            live,
        }
    }

    /// Whether the database cannot be reached now (the writer is retrying).
    pub(crate) fn store_down(&self) -> bool {
        self.down.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Where stored events go out; also what a read of another daemon's events sends on.
    pub(crate) fn live(&self) -> &broadcast::Sender<Arc<(String, Event)>> {
        &self.live
    }

    /// Queues `write`; `Err` when the writer has stopped.
    pub(crate) fn send(&self, write: Write) -> Result<(), StoreError> {
        self.queue
            .send(write)
            .map_err(|_| StoreError::Writer("has stopped"))
    }

    fn fence(&self, id: &str) -> Option<u64> {
        self.held.epoch(id)
    }

    /// Queues event `msg` of task `id`, stamped now. While the writer is more than
    /// [`MAX_BACKLOG`] behind, the caller (a task's turn loop or block) waits for it here: on
    /// a runtime's worker, that worker is handed off first, so the rest of the daemon goes on.
    pub(crate) fn record(&self, id: &str, msg: Msg) {
        let weight = weight(&msg);
        let admit = || self.backlog.admit(weight, MAX_BACKLOG, &self.down);
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread && self.backlog.queued_over(MAX_BACKLOG) {
            tokio::task::block_in_place(admit);
        } else {
            admit();
        }
        if self
            .send(Write::Event(
                id.to_owned(),
                msg,
                now_ms(),
                self.fence(id),
                weight,
            ))
            .is_err()
        {
            tracing::error!(task = id, "the store writer is gone; an event was lost");
        }
    }

    /// Moves task `id` to `state`, in order with its events.
    pub(crate) fn set_state(&self, id: &str, state: TaskState) {
        let _ = self.send(Write::State(id.to_owned(), state, now_ms(), self.fence(id)));
    }

    /// Waits until every write queued so far is committed (at most 10 s).
    pub(crate) fn flush(&self) {
        self.flush_for(Duration::from_secs(10));
    }

    /// Waits until every write queued so far is committed, at most `wait`; whether it was.
    pub(crate) fn flush_for(&self, wait: Duration) -> bool {
        let (ack, done) = std::sync::mpsc::channel();
        self.send(Write::Flush(ack)).is_ok() && done.recv_timeout(wait).is_ok()
    }

    /// [`Writes::flush_for`] through the next commit the writer makes anyway, which the
    /// writes of other tasks share (a flush commits at once, alone).
    pub(crate) fn barrier_for(&self, wait: Duration) -> bool {
        let (ack, done) = std::sync::mpsc::channel();
        self.send(Write::Barrier(ack)).is_ok() && done.recv_timeout(wait).is_ok()
    }
}
