//! The embedded task store: one SQLite file (WAL), used by one daemon (its state dir is
//! locked), which is therefore the only one that can hold a lease.

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{Connection, OptionalExtension, params};
use tandem_protocol::{Event, EventMsg, TaskSpec, Usage};

use super::rules::{self, RowChange};
use super::{
    Applied, Change, Claimed, Fences, NoticeSink, Renewed, Result, StoreError, TaskRecord,
    TaskState, TaskStore, decided, event, to_json,
};

/// Schema migrations, in order; `PRAGMA user_version` says how many have run.
const MIGRATIONS: &[&str] = &[
    "
    CREATE TABLE tasks (
        id TEXT PRIMARY KEY,
        queue_order INTEGER NOT NULL,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        stop_reason TEXT,
        error TEXT,
        usage TEXT NOT NULL,
        turns INTEGER NOT NULL,
        created_ms INTEGER NOT NULL,
        started_ms INTEGER,
        finished_ms INTEGER
    );
    CREATE INDEX tasks_by_state ON tasks (state, queue_order);
    CREATE TABLE events (
        task_id TEXT NOT NULL REFERENCES tasks (id),
        seq INTEGER NOT NULL,
        at_ms INTEGER NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (task_id, seq)
    ) WITHOUT ROWID;
",
    "
    -- Pages of the newest tasks (`?limit=&before=`); also marks stores that may hold the
    -- awaiting_approval state, which older daemons do not know.
    CREATE INDEX tasks_by_order ON tasks (queue_order);
",
    "
    -- When the operator's retention removed the task's workspace.
    ALTER TABLE tasks ADD COLUMN files_removed_ms INTEGER;
",
    "
    -- Leases: which daemon runs the task, under which fencing number, until when; and a
    -- cancel asked of it.
    ALTER TABLE tasks ADD COLUMN owner TEXT;
    ALTER TABLE tasks ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE tasks ADD COLUMN lease_until_ms INTEGER;
    ALTER TABLE tasks ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0;
",
    "
    -- A finished task's final answer and its check's verdict, as JSON.
    ALTER TABLE tasks ADD COLUMN outcome TEXT;
",
    "
    -- The trace a task's spans are in, when its daemon exports traces.
    ALTER TABLE tasks ADD COLUMN trace_id TEXT;
",
];

impl TaskStore for Store {
    fn apply(&self, changes: &[Change], fences: &Fences) -> Result<Applied> {
        self.apply_fenced(changes, fences)
    }
    fn transition(&self, id: &str, from: TaskState, to: TaskState, now_ms: u64) -> Result<bool> {
        Store::transition(self, id, from, to, now_ms)
    }
    fn get(&self, id: &str) -> Result<Option<TaskRecord>> {
        Store::get(self, id)
    }
    fn list(&self, state: Option<TaskState>) -> Result<Vec<TaskRecord>> {
        Store::list(self, state)
    }
    fn page(
        &self,
        state: Option<TaskState>,
        before: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<TaskRecord>, Option<String>)> {
        Store::page(self, state, before, limit)
    }
    fn list_after(
        &self,
        state: Option<TaskState>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<TaskRecord>> {
        Store::list_after(self, state, after, limit)
    }
    fn events_after(&self, id: &str, after: u64) -> Result<Vec<Event>> {
        Store::events_after(self, id, after)
    }
    fn interrupt_running(&self, _daemon: &str) -> Result<Vec<String>> {
        Store::interrupt_running(self)
    }
    fn counts(&self) -> Result<Vec<(TaskState, u64)>> {
        Store::counts(self)
    }
    fn files_removed(&self, id: &str, at_ms: u64) -> Result<()> {
        self.with(|c| {
            c.execute(rules::FILES_REMOVED, rusqlite::params![id, at_ms as i64])
                .map(drop)
        })
    }
    fn claim(
        &self,
        daemon: &str,
        lease_ms: u64,
        now_ms: u64,
        running: &[String],
    ) -> Result<Option<Claimed>> {
        let claimed = self.with_db(|db| {
            // Not synced on its own: the task's first event, committed in full, syncs the
            // log with the claim in it; a claim lost with the power leaves the task queued,
            // and it is claimed again and resumes from what was stored.
            db.conn.pragma_update(None, "synchronous", "NORMAL")?;
            let claimed = db.transaction(|db| {
                let now = now_ms as i64;
                // The order is the rules'; the daemon's own tasks are skipped here, not in
                // SQL, as SQLite binds no arrays.
                let mut lapsed = db.conn.prepare_cached(&format!(
                    "SELECT id, state FROM tasks
                     WHERE {} AND lease_until_ms < ?1 {}",
                    rules::LEASED,
                    rules::LAPSED_FIRST
                ))?;
                let next: Option<(String, String)> = lapsed
                    .query_map([now], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .filter_map(std::result::Result::ok)
                    .find(|(id, _): &(String, String)| !running.contains(id));
                drop(lapsed);
                let next = match next {
                    Some(found) => Some(found),
                    None => db
                        .conn
                        .prepare_cached(&format!(
                            "SELECT id, state FROM tasks WHERE state = 'queued' {}",
                            rules::QUEUE_ORDER
                        ))?
                        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                        .filter_map(std::result::Result::ok)
                        .find(|(id, _): &(String, String)| !running.contains(id)),
                };
                let Some((id, _)) = next else {
                    return Ok(None);
                };
                db.count_move(&id, TaskState::Running)?;
                let (epoch, cancel): (i64, bool) = db
                    .conn
                    .prepare_cached(
                        "UPDATE tasks SET state = 'running', owner = ?2, epoch = epoch + 1,
                            lease_until_ms = ?3 + ?4,
                            started_ms = CASE WHEN state = 'queued' THEN ?3 ELSE started_ms END
                         WHERE id = ?1 RETURNING epoch, cancel_requested",
                    )?
                    .query_row(params![id, daemon, now, lease_ms as i64], |r| {
                        Ok((r.get(0)?, r.get(1)?))
                    })?;
                Ok(Some((id, epoch, cancel)))
            });
            db.conn.pragma_update(None, "synchronous", "FULL")?;
            claimed
        })?;
        let Some((id, epoch, cancel)) = claimed else {
            return Ok(None);
        };
        let record = Store::get(self, &id)?.ok_or(StoreError::Writer("lost a claimed task"))?;
        let events = Store::events_after(self, &id, 0)?;
        Ok(Some(Claimed {
            record,
            epoch: epoch as u64,
            events,
            cancel,
        }))
    }
    fn renew(
        &self,
        daemon: &str,
        held: &[(String, u64)],
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<Renewed> {
        self.with_db(|db| {
            db.transaction(|db| {
                let mut renewed = Renewed::default();
                for (id, epoch) in held {
                    let kept: Option<bool> = db
                        .conn
                        .prepare_cached(&format!(
                            "UPDATE tasks SET lease_until_ms = ?4 + ?5
                             WHERE id = ?1 AND owner = ?2 AND epoch = ?3 AND {}
                             RETURNING cancel_requested",
                            rules::LEASED
                        ))?
                        .query_row(
                            params![id, daemon, *epoch as i64, now_ms as i64, lease_ms as i64],
                            |r| r.get(0),
                        )
                        .optional()?;
                    match kept {
                        None => renewed.lost.push(id.clone()),
                        Some(true) => renewed.cancel.push(id.clone()),
                        Some(false) => {}
                    }
                }
                Ok(renewed)
            })
        })
    }
    fn request_cancel(&self, id: &str) -> Result<()> {
        self.with(|c| {
            c.prepare_cached("UPDATE tasks SET cancel_requested = 1 WHERE id = ?1")?
                .execute([id])
                .map(drop)
        })
    }
    fn owner(&self, id: &str, now_ms: u64) -> Result<Option<String>> {
        self.with(|c| {
            c.prepare_cached(&format!(
                "SELECT owner FROM tasks WHERE id = ?1 AND lease_until_ms >= ?2 AND {}",
                rules::LEASED
            ))?
            .query_row(params![id, now_ms as i64], |r| r.get(0))
            .optional()
        })
        .map(Option::flatten)
    }
    fn decide(&self, id: &str, n: u32, msg: &EventMsg, now_ms: u64) -> Result<Option<Event>> {
        let events = Store::events_after(self, id, 0)?;
        let finished = Store::get(self, id)?.is_none_or(|t| t.state == TaskState::Finished);
        // This daemon is the database's only writer, and the caller holds the task's
        // approvals: nothing can store a decision between the check and the write.
        if finished || decided(&events, n) {
            return Ok(None);
        }
        let stored = Store::apply(self, &[Change::Event(id.to_owned(), msg.clone(), now_ms)])?;
        Ok(stored.into_iter().next().map(|(_, e)| e))
    }
    fn notices(&self, _daemon: &str, _sink: NoticeSink) -> Result<()> {
        Ok(())
    }
}

/// The task store; cheap operations behind one connection.
pub struct Store {
    conn: Mutex<Db>,
    path: String,
}

/// The connection plus what the hot paths would otherwise query for every time: each task's
/// last event seq (a streamed reply is dozens of events), the next queue position, and the
/// number of tasks in each state (`/metrics` is scraped often; counting rows grows with the
/// history). This connection is the database's only writer, so they stay true.
struct Db {
    conn: Connection,
    last_seq: std::collections::HashMap<String, i64>,
    next_order: i64,
    counts: [u64; TaskState::ALL.len()],
}

impl Db {
    /// Reads the queue position and state counts afresh (at open, and after a rollback).
    fn reload(&mut self) -> rusqlite::Result<()> {
        self.last_seq.clear();
        self.next_order = self
            .conn
            .prepare_cached("SELECT COALESCE(MAX(queue_order), 0) + 1 FROM tasks")?
            .query_row([], |r| r.get(0))?;
        self.counts = [0; TaskState::ALL.len()];
        let mut stmt = self.conn.prepare_cached(rules::COUNTS)?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        for row in rows {
            let (state, n) = row?;
            let state = TaskState::parse(&state).unwrap_or(TaskState::Interrupted);
            self.counts[state as usize] += u64::try_from(n).unwrap_or(0);
        }
        Ok(())
    }

    /// Moves task `id` to `state` in the counts, from whatever it is stored as now.
    fn count_move(&mut self, id: &str, state: TaskState) -> rusqlite::Result<()> {
        let old: Option<String> = self
            .conn
            .prepare_cached("SELECT state FROM tasks WHERE id = ?1")?
            .query_row([id], |r| r.get(0))
            .optional()?;
        if let Some(old) = old.as_deref().and_then(TaskState::parse) {
            self.counts[old as usize] = self.counts[old as usize].saturating_sub(1);
            self.counts[state as usize] += 1;
        }
        Ok(())
    }

    /// Runs `f` in a transaction; on any error it is rolled back and the in-memory state
    /// read again, so nothing counted in it survives. The statements are cached: parsing
    /// BEGIN and COMMIT anew for every burst of events showed up in profiles.
    fn transaction<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        self.conn.prepare_cached("BEGIN")?.execute([])?;
        let result = f(self).and_then(|value| {
            self.conn.prepare_cached("COMMIT")?.execute([])?;
            Ok(value)
        });
        if result.is_err() {
            if !self.conn.is_autocommit() {
                let _ = self
                    .conn
                    .prepare_cached("ROLLBACK")
                    .and_then(|mut s| s.execute([]));
            }
            if let Err(e) = self.reload() {
                // The rollback itself is sound; only the in-memory counts may now be off.
                tracing::error!(error = %e, "cannot re-read the queue and task counts after a rollback; /metrics may be off until the daemon restarts");
            }
        }
        result
    }
}

impl Store {
    /// Opens (creating if needed) the database at `path` and runs pending migrations.
    pub fn open(path: &Path) -> Result<Self> {
        let display = path.display().to_string();
        let sql = |source| StoreError::Sqlite {
            path: display.clone(),
            source,
        };
        let conn = Connection::open(path).map_err(sql)?;
        // WAL: readers never block the writer. FULL syncs the log at each commit, so what a
        // client was sent survives a power loss too, not only a kill -9; the writer commits
        // in batches, so that costs one fsync (a fraction of a millisecond) per batch.
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 5000;",
        )
        .map_err(sql)?;
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(sql)?;
        let known = MIGRATIONS.len() as i64;
        if version > known {
            return Err(StoreError::TooNew {
                path: display,
                found: version,
                known,
            });
        }
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            let tx = conn.unchecked_transaction().map_err(sql)?;
            tx.execute_batch(migration).map_err(sql)?;
            tx.pragma_update(None, "user_version", i as i64 + 1)
                .map_err(sql)?;
            tx.commit().map_err(sql)?;
        }
        conn.set_prepared_statement_cache_capacity(32);
        let mut db = Db {
            conn,
            last_seq: std::collections::HashMap::new(),
            next_order: 1,
            counts: [0; TaskState::ALL.len()],
        };
        db.reload().map_err(sql)?;
        Ok(Self {
            conn: Mutex::new(db),
            path: display,
        })
    }

    fn with<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> Result<T> {
        self.with_db(|db| f(&db.conn))
    }

    fn with_db<T>(&self, f: impl FnOnce(&mut Db) -> rusqlite::Result<T>) -> Result<T> {
        let mut db = self.conn.lock().map_err(|_| StoreError::Poisoned)?;
        f(&mut db).map_err(|source| StoreError::Sqlite {
            path: self.path.clone(),
            source,
        })
    }

    /// Applies changes (of any tasks, in order) in one transaction, so a burst costs one
    /// commit, one log sync. Returns the events as stored.
    pub fn apply(&self, changes: &[Change]) -> Result<Vec<(String, Event)>> {
        Ok(self.apply_fenced(changes, &Fences::new())?.events)
    }

    /// [`Store::apply`], leaving out the changes of tasks whose lease epoch is no longer the
    /// one in `fences`.
    pub fn apply_fenced(&self, changes: &[Change], fences: &Fences) -> Result<Applied> {
        self.with_db(|db| {
            db.transaction(|db| {
                let mut fenced = Vec::new();
                for (id, epoch) in fences {
                    let stored: Option<i64> = db
                        .conn
                        .prepare_cached("SELECT epoch FROM tasks WHERE id = ?1")?
                        .query_row([id], |r| r.get(0))
                        .optional()?;
                    if stored.is_some_and(|e| e as u64 != *epoch) {
                        fenced.push(id.clone());
                    }
                }
                let mut stored = Vec::with_capacity(changes.len());
                for change in changes {
                    if fenced.iter().any(|id| id == change.task()) {
                        continue;
                    }
                    match change {
                        Change::Event(id, msg, now_ms) => {
                            stored.push((id.clone(), append_one(db, id, msg, *now_ms)?));
                        }
                        Change::State(id, state, now_ms) => set_state(db, id, *state, *now_ms)?,
                        Change::Create(id, spec, now_ms) => create(db, id, spec, *now_ms)?,
                    }
                }
                Ok(Applied {
                    events: stored,
                    fenced,
                })
            })
        })
    }

    /// Moves a task from `from` to `to` in one statement, only if it is still in `from`;
    /// `false` when it was not (another request changed it first, or there is no such task).
    pub fn transition(
        &self,
        id: &str,
        from: TaskState,
        to: TaskState,
        now_ms: u64,
    ) -> Result<bool> {
        self.with_db(|db| {
            let changed = db.conn.prepare_cached(rules::TRANSITION)?.execute(params![
                id,
                from.as_str(),
                to.as_str(),
                now_ms as i64
            ])?;
            if changed == 1 {
                db.counts[from as usize] = db.counts[from as usize].saturating_sub(1);
                db.counts[to as usize] += 1;
            }
            Ok(changed == 1)
        })
    }

    /// One task, if it exists.
    pub fn get(&self, id: &str) -> Result<Option<TaskRecord>> {
        let row = self.with(|c| {
            c.prepare_cached(&READS.get)?
                .query_row([id], raw_row)
                .optional()
        })?;
        row.map(rules::decode).transpose()
    }

    /// Tasks, oldest first, optionally only those in `state`.
    pub fn list(&self, state: Option<TaskState>) -> Result<Vec<TaskRecord>> {
        let rows = self.with(|c| {
            let mut stmt = c.prepare_cached(&READS.list)?;
            let rows = stmt
                .query_map([state.map(TaskState::as_str)], raw_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })?;
        rows.into_iter().map(rules::decode).collect()
    }

    /// At most `limit` tasks, newest first, queued before task `before` when given,
    /// optionally only those in `state`; and the id to pass as `before` for the next page.
    pub fn page(
        &self,
        state: Option<TaskState>,
        before: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<TaskRecord>, Option<String>)> {
        let rows = self.with(|c| {
            let mut stmt = c.prepare_cached(&READS.page)?;
            let rows = stmt
                .query_map(
                    params![
                        state.map(TaskState::as_str),
                        before,
                        rules::page_limit(limit)
                    ],
                    raw_row,
                )?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })?;
        let tasks = rows
            .into_iter()
            .map(rules::decode)
            .collect::<Result<Vec<_>>>()?;
        Ok(rules::page_of(tasks, limit))
    }

    /// At most `limit` tasks in queue order, after task `after` when given, optionally only
    /// those in `state`: the unpaged listing reads the store this way, a chunk at a time.
    pub fn list_after(
        &self,
        state: Option<TaskState>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<TaskRecord>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.with(|c| {
            let mut stmt = c.prepare_cached(&READS.after)?;
            let rows = stmt
                .query_map(params![state.map(TaskState::as_str), after, limit], raw_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })?;
        rows.into_iter().map(rules::decode).collect()
    }

    /// Events of a task with seq above `after`, in order.
    pub fn events_after(&self, id: &str, after: u64) -> Result<Vec<Event>> {
        let rows = self.with(|c| {
            let mut stmt = c.prepare_cached(rules::EVENTS_AFTER)?;
            let rows = stmt
                .query_map(params![id, after as i64], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                    ))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })?;
        rows.into_iter()
            .map(|(seq, at, body)| event(seq, at, &body))
            .collect()
    }

    /// At start-up: tasks that were running when the last daemon died become interrupted.
    /// Returns their ids.
    pub fn interrupt_running(&self) -> Result<Vec<String>> {
        self.with_db(|db| {
            db.transaction(|db| {
                let rows = db
                    .conn
                    .prepare(&format!(
                        "SELECT id, state FROM tasks WHERE {}",
                        rules::LEASED
                    ))?
                    .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                db.conn.execute(
                    &format!(
                        "UPDATE tasks SET state = 'interrupted' WHERE {}",
                        rules::LEASED
                    ),
                    [],
                )?;
                let mut ids = Vec::with_capacity(rows.len());
                for (id, state) in rows {
                    let from = TaskState::parse(&state).unwrap_or(TaskState::Running);
                    let count = &mut db.counts[from as usize];
                    *count = count.saturating_sub(1);
                    db.counts[TaskState::Interrupted as usize] += 1;
                    ids.push(id);
                }
                Ok(ids)
            })
        })
    }

    /// How many tasks are in each state, for metrics (kept in memory, no query).
    pub fn counts(&self) -> Result<Vec<(TaskState, u64)>> {
        self.with_db(|db| Ok(TaskState::ALL.map(|s| (s, db.counts[s as usize])).to_vec()))
    }
}

/// Inserts one event (and updates its task row) inside the caller's transaction.
fn create(db: &mut Db, id: &str, spec: &TaskSpec, now_ms: u64) -> rusqlite::Result<()> {
    db.conn
        .prepare_cached(
            "INSERT INTO tasks (id, queue_order, state, spec, usage, turns, created_ms)
             VALUES (?1, ?2, 'queued', ?3, ?4, 0, ?5)",
        )?
        .execute(params![
            id,
            db.next_order,
            to_json(spec),
            to_json(&Usage::default()),
            now_ms as i64
        ])?;
    db.next_order += 1;
    db.counts[TaskState::Queued as usize] += 1;
    // A new task has no events: its first append needs no MAX(seq) query (which SQLite
    // re-prepared on every run, the costliest statement in profiles).
    db.last_seq.insert(id.to_owned(), 0);
    Ok(())
}

fn set_state(db: &mut Db, id: &str, state: TaskState, now_ms: u64) -> rusqlite::Result<()> {
    db.count_move(id, state)?;
    db.conn
        .prepare_cached(rules::SET_STATE)?
        .execute(params![id, state.as_str(), now_ms as i64])
        .map(|_| ())
}

fn append_one(db: &mut Db, task_id: &str, msg: &EventMsg, now_ms: u64) -> rusqlite::Result<Event> {
    let seq = match db.last_seq.get(task_id) {
        Some(last) => last + 1,
        None => db
            .conn
            .prepare_cached("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE task_id = ?1")?
            .query_row([task_id], |r| r.get(0))?,
    };
    let event = Event {
        seq: seq as u64,
        at_ms: now_ms,
        path: None,
        msg: msg.clone(),
    };
    let conn = &db.conn;
    conn.prepare_cached("INSERT INTO events (task_id, seq, at_ms, body) VALUES (?1, ?2, ?3, ?4)")?
        .execute(params![task_id, seq, now_ms as i64, to_json(msg)])?;
    match rules::row_change(msg, now_ms) {
        Some(RowChange::Traced { trace_id }) => {
            conn.prepare_cached(rules::TRACED)?
                .execute(params![task_id, trace_id])?;
        }
        Some(RowChange::Turn { turn, usage }) => {
            conn.prepare_cached(
                "UPDATE tasks SET turns = ?2, usage = json_object(
                        'prompt_tokens', json_extract(usage, '$.prompt_tokens') + ?3,
                        'completion_tokens', json_extract(usage, '$.completion_tokens') + ?4)
                     WHERE id = ?1",
            )?
            .execute(params![
                task_id,
                turn,
                usage.prompt_tokens as i64,
                usage.completion_tokens as i64
            ])?;
        }
        Some(RowChange::Finished {
            stop_reason,
            error,
            turns,
            at_ms,
            outcome,
        }) => {
            db.count_move(task_id, TaskState::Finished)?;
            db.conn
                .prepare_cached(
                    "UPDATE tasks SET state = 'finished', stop_reason = ?2, error = ?3,
                        turns = ?4, finished_ms = ?5, lease_until_ms = NULL, outcome = ?6
                     WHERE id = ?1",
                )?
                .execute(params![
                    task_id,
                    stop_reason.as_str(),
                    error,
                    turns,
                    at_ms as i64,
                    outcome
                ])?;
        }
        None => {}
    }
    if matches!(msg, EventMsg::TaskFinished { .. }) {
        // A finished task gets no more events until (and unless) it is resumed.
        db.last_seq.remove(task_id);
    } else {
        db.last_seq.insert(task_id.to_owned(), seq);
    }
    Ok(event)
}

/// SQLite keeps a task's usage as one JSON value.
const USAGE: &str =
    "json_extract(usage, '$.prompt_tokens'), json_extract(usage, '$.completion_tokens')";

static READS: std::sync::LazyLock<rules::Reads> =
    std::sync::LazyLock::new(|| rules::Reads::new(USAGE, false));

fn raw_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<rules::Row> {
    Ok(rules::Row {
        id: r.get(0)?,
        state: r.get(1)?,
        spec: r.get(2)?,
        stop_reason: r.get(3)?,
        error: r.get(4)?,
        prompt_tokens: r.get(5)?,
        completion_tokens: r.get(6)?,
        turns: r.get(7)?,
        times: rules::Times {
            created_ms: r.get(8)?,
            started_ms: r.get(9)?,
            finished_ms: r.get(10)?,
            files_removed_ms: r.get(11)?,
        },
        outcome: r.get(12)?,
        trace_id: r.get(13)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_protocol::StopReason;

    /// Adds queued task `id`, asking `task`.
    fn create(store: &Store, id: &str, task: &str, now_ms: u64) {
        let spec = TaskSpec {
            task: task.to_owned(),
            ..TaskSpec::default()
        };
        store
            .apply(&[Change::Create(id.into(), Box::new(spec), now_ms)])
            .unwrap();
    }

    #[test]
    fn tasks_and_events_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tandem.db");
        {
            let store = Store::open(&path).unwrap();
            create(&store, "a", "first", 1);
            create(&store, "b", "second", 2);
            let stored = store
                .apply(&[
                    Change::State("a".into(), TaskState::Running, 3),
                    Change::Event(
                        "a".into(),
                        EventMsg::TurnStarted {
                            turn: 1,
                            agent: None,
                        },
                        4,
                    ),
                    Change::Event(
                        "b".into(),
                        EventMsg::TurnStarted {
                            turn: 1,
                            agent: None,
                        },
                        4,
                    ),
                    Change::Event(
                        "a".into(),
                        EventMsg::AssistantMessage {
                            turn: 1,
                            text: "hi".into(),
                            usage: Some(Usage {
                                prompt_tokens: 10,
                                completion_tokens: 3,
                                estimated: false,
                            }),
                            tool_calls: Vec::new(),
                        },
                        5,
                    ),
                ])
                .unwrap();
            let seqs: Vec<(&str, u64)> = stored.iter().map(|(t, e)| (t.as_str(), e.seq)).collect();
            assert_eq!(seqs, [("a", 1), ("b", 1), ("a", 2)]);
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.interrupt_running().unwrap(), ["a"]);
        let a = store.get("a").unwrap().unwrap();
        assert_eq!(
            (a.state, a.turns, a.usage, a.started_ms),
            (
                TaskState::Interrupted,
                1,
                Usage {
                    prompt_tokens: 10,
                    completion_tokens: 3,
                    estimated: false,
                },
                Some(3)
            )
        );
        let after = store.events_after("a", 1).unwrap();
        assert_eq!(after.len(), 1);
        assert_eq!(after[0].seq, 2);
        // A new process continues each task's seq from what is on disk.
        let next = store
            .apply(&[Change::Event(
                "a".into(),
                EventMsg::TurnStarted {
                    turn: 2,
                    agent: None,
                },
                6,
            )])
            .unwrap();
        assert_eq!(next[0].1.seq, 3);
        let queued: Vec<String> = store
            .list(Some(TaskState::Queued))
            .unwrap()
            .into_iter()
            .map(|t| t.id)
            .collect();
        assert_eq!(queued, ["b"]);
        assert!(store.get("nope").unwrap().is_none());
    }

    #[test]
    fn finishing_records_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        create(&store, "t", "x", 1);
        store
            .apply(&[Change::Event(
                "t".into(),
                EventMsg::finished(StopReason::MaxTurns, 3, Usage::default(), 9, None),
                7,
            )])
            .unwrap();
        let t = store.get("t").unwrap().unwrap();
        assert_eq!(
            (t.state, t.stop_reason, t.turns, t.finished_ms),
            (TaskState::Finished, Some(StopReason::MaxTurns), 3, Some(7))
        );
        assert_eq!(
            store.counts().unwrap(),
            [
                (TaskState::Queued, 0),
                (TaskState::Running, 0),
                (TaskState::AwaitingApproval, 0),
                (TaskState::Interrupted, 0),
                (TaskState::Finished, 1)
            ]
        );
    }

    fn counts(store: &Store) -> Vec<u64> {
        store
            .counts()
            .unwrap()
            .into_iter()
            .map(|(_, n)| n)
            .collect()
    }

    #[test]
    fn state_counts_follow_every_change_and_match_the_rows_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let done =
            |turns| EventMsg::finished(StopReason::Terminated, turns, Usage::default(), 1, None);
        {
            let store = Store::open(&path).unwrap();
            for id in ["a", "b", "c", "d"] {
                create(&store, id, id, 1);
            }
            assert_eq!(counts(&store), [4, 0, 0, 0, 0]);
            let (queued, running) = (TaskState::Queued, TaskState::Running);
            assert!(store.transition("a", queued, running, 2).unwrap());
            assert!(store.transition("b", queued, running, 2).unwrap());
            // Only from the state it is in, and only tasks that exist.
            assert!(!store.transition("b", queued, running, 2).unwrap());
            assert!(!store.transition("nope", queued, running, 2).unwrap());
            assert_eq!(counts(&store), [2, 2, 0, 0, 0]);
            store
                .apply(&[Change::Event("a".into(), done(1), 3)])
                .unwrap();
            assert_eq!(counts(&store), [2, 1, 0, 0, 1]);
            // A failed batch rolls back whole, counts included.
            let bad = store.apply(&[
                Change::Event("c".into(), done(1), 4),
                Change::State("a".into(), TaskState::Running, 4),
                Change::Event(
                    "missing".into(),
                    EventMsg::TurnStarted {
                        turn: 1,
                        agent: None,
                    },
                    4,
                ),
            ]);
            assert!(bad.is_err());
            assert_eq!(counts(&store), [2, 1, 0, 0, 1]);
            assert_eq!(store.get("c").unwrap().unwrap().state, TaskState::Queued);
            store
                .apply(&[Change::State("c".into(), TaskState::AwaitingApproval, 5)])
                .unwrap();
            assert_eq!(counts(&store), [1, 1, 1, 0, 1]);
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(counts(&store), [1, 1, 1, 0, 1]);
        // Running and waiting for approval alike were cut off by the stop.
        let mut interrupted = store.interrupt_running().unwrap();
        interrupted.sort();
        assert_eq!(interrupted, ["b", "c"]);
        assert_eq!(counts(&store), [1, 0, 0, 2, 1]);
        assert!(
            store
                .transition("b", TaskState::Interrupted, TaskState::Queued, 5)
                .unwrap()
        );
        assert_eq!(counts(&store), [2, 0, 0, 1, 1]);
        // Queue order continues after the tasks already stored.
        create(&store, "e", "e", 6);
        let order: Vec<String> = store
            .list(Some(TaskState::Queued))
            .unwrap()
            .into_iter()
            .map(|t| t.id)
            .collect();
        assert_eq!(order, ["b", "d", "e"]);
    }

    #[test]
    fn a_newer_schema_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        Connection::open(&path)
            .unwrap()
            .pragma_update(None, "user_version", 99)
            .unwrap();
        let err = Store::open(&path).err().unwrap().to_string();
        assert!(
            err.contains("schema version 99") && err.contains("upgrade Tandem"),
            "{err}"
        );
    }
}
