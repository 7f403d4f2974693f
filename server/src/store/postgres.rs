//! The shared task store: PostgreSQL, through `tokio-postgres` and a `deadpool` pool, for
//! several daemons on one queue. A task is claimed with `FOR UPDATE SKIP LOCKED` under a lease
//! whose epoch fences every write; commits `NOTIFY` the other daemons, which `LISTEN`.
//!
//! The trait is synchronous (its callers are the writer thread and the blocking pool), so the
//! store drives its connections on a small runtime of its own and waits on it.

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use futures::StreamExt;
use tandem_protocol::{Event, EventMsg, TaskSpec};
use tokio_postgres::{AsyncMessage, NoTls, Row};

use super::rules::{self, RowChange, pg};
use super::{
    Applied, Change, Claimed, Fences, Notice, NoticeSink, Renewed, Result, StoreError, TaskRecord,
    TaskState, TaskStore, decided, event, to_json,
};

/// Schema migrations, in order; `tandem_schema.version` says how many have run.
const MIGRATIONS: &[&str] = &[
    "
    CREATE TABLE tasks (
        id TEXT PRIMARY KEY,
        queue_order BIGSERIAL NOT NULL,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        stop_reason TEXT,
        error TEXT,
        prompt_tokens BIGINT NOT NULL DEFAULT 0,
        completion_tokens BIGINT NOT NULL DEFAULT 0,
        turns BIGINT NOT NULL DEFAULT 0,
        created_ms BIGINT NOT NULL,
        started_ms BIGINT,
        finished_ms BIGINT,
        files_removed_ms BIGINT,
        owner TEXT,
        epoch BIGINT NOT NULL DEFAULT 0,
        lease_until_ms BIGINT,
        cancel_requested BOOLEAN NOT NULL DEFAULT FALSE
    );
    CREATE INDEX tasks_by_state ON tasks (state, queue_order);
    CREATE INDEX tasks_by_order ON tasks (queue_order);
    CREATE INDEX tasks_leased ON tasks (lease_until_ms)
        WHERE state IN ('running', 'awaiting_approval');
    CREATE TABLE events (
        task_id TEXT NOT NULL REFERENCES tasks (id),
        seq BIGINT NOT NULL,
        at_ms BIGINT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (task_id, seq)
    );
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

/// The database's clock in ms: leases are timed by the one clock every daemon shares.
const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// How a deadlock's victim's error begins.
const DEADLOCK: &str = "a concurrent write collided";

/// The channel every daemon listens on.
const CHANNEL: &str = "tandem";

/// Longest a call waits for a connection, and a connection to be made: an unreachable
/// database is an error the caller can act on (a 503, a retry), not a hang.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

static READS: std::sync::LazyLock<rules::Reads> =
    std::sync::LazyLock::new(|| rules::Reads::new("prompt_tokens, completion_tokens", true));

/// Tasks and events in PostgreSQL.
pub struct PgStore {
    pool: Pool,
    config: tokio_postgres::Config,
    /// The database as logs and errors name it: no password.
    shown: String,
    runtime: Option<tokio::runtime::Runtime>,
    /// The daemon this store serves, once it listens: its commits' notices are signed with
    /// it, so that it skips its own.
    daemon: std::sync::OnceLock<String>,
}

impl Drop for PgStore {
    fn drop(&mut self) {
        // Dropped on an async worker at shutdown, where a blocking drop would panic.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl PgStore {
    /// Connects to `url` (`postgres://user:password@host/db`, or key=value pairs) and runs
    /// pending migrations. `setting` names where the URL came from, for the error.
    pub fn open(url: &str, setting: &str, secrets: &StoreSecrets) -> Result<Self> {
        let mut config: tokio_postgres::Config =
            url.parse().map_err(|e| StoreError::Postgres {
                url: "(unparsed)".to_owned(),
                message: format!(
                    "{setting} is not a PostgreSQL URL ({e}); write it as postgres://USER:PASSWORD@HOST:PORT/DATABASE"
                ),
                unreachable: false,
            })?;
        if config.get_password().is_none() {
            let found = secrets.password.clone().or_else(|| {
                secrets
                    .pgpass
                    .as_deref()
                    .and_then(|f| from_pgpass(f, &config))
            });
            if let Some(password) = found {
                config.password(password);
            }
        }
        config.connect_timeout(CONNECT_TIMEOUT);
        // A connection the network cut without a word is found out in about 20 s, not the
        // system's two hours: the writer and the leases wait on it.
        config.keepalives_idle(Duration::from_secs(10));
        config.keepalives_interval(Duration::from_secs(3));
        config.keepalives_retries(3);
        config.tcp_user_timeout(Duration::from_secs(20));
        if config.get_application_name().is_none() {
            config.application_name("tandem");
        }
        let shown = shown(&config);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tandem-postgres")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Postgres {
                url: shown.clone(),
                message: format!("cannot start the store's runtime: {e}"),
                unreachable: false,
            })?;
        let manager = Manager::from_config(
            config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(8)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(CONNECT_TIMEOUT))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .recycle_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .map_err(|e| StoreError::Postgres {
                url: shown.clone(),
                message: format!("cannot make a connection pool: {e}"),
                unreachable: false,
            })?;
        let store = Self {
            pool,
            config,
            shown,
            runtime: Some(runtime),
            daemon: std::sync::OnceLock::new(),
        };
        store
            .block(store.migrate())
            .map_err(|e| store.at_start(e, setting))?;
        Ok(store)
    }

    /// The database as errors name it (no password).
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// An error at start, saying which setting to fix.
    fn at_start(&self, e: StoreError, setting: &str) -> StoreError {
        match e {
            StoreError::Postgres {
                url,
                message,
                unreachable,
            } => StoreError::Postgres {
                url,
                message: format!("{message}; check {setting}"),
                unreachable,
            },
            other => other,
        }
    }

    /// Runs `f` on the store's runtime and waits for it: from a plain thread directly, from
    /// an async worker after telling the runtime it blocks.
    fn block<F>(&self, f: F) -> F::Output
    where
        F: Future + Send,
        F::Output: Send,
    {
        let Some(rt) = &self.runtime else {
            unreachable!("the runtime is taken only on drop")
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| rt.block_on(f))
            }
            Ok(_) => std::thread::scope(|s| {
                s.spawn(|| rt.block_on(f))
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p))
            }),
            Err(_) => rt.block_on(f),
        }
    }

    async fn client(&self) -> Result<deadpool_postgres::Client> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => self.err(e),
            other => StoreError::Postgres {
                url: self.shown.clone(),
                message: format!("no connection to the database: {other}"),
                unreachable: true,
            },
        })
    }

    fn err(&self, e: tokio_postgres::Error) -> StoreError {
        pg_error(&self.shown, &e)
    }

    async fn migrate(&self) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(|e| self.err(e))?;
        // Daemons starting together: one migrates, the others wait for it.
        tx.batch_execute(
            "SELECT pg_advisory_xact_lock(7251000);
             CREATE TABLE IF NOT EXISTS tandem_schema (version INTEGER NOT NULL);
             INSERT INTO tandem_schema SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM tandem_schema);",
        )
        .await
        .map_err(|e| self.err(e))?;
        let version: i32 = tx
            .query_one("SELECT version FROM tandem_schema", &[])
            .await
            .map_err(|e| self.err(e))?
            .get(0);
        let known = MIGRATIONS.len() as i64;
        if i64::from(version) > known {
            return Err(StoreError::TooNew {
                path: self.shown.clone(),
                found: version.into(),
                known,
            });
        }
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            tx.batch_execute(migration).await.map_err(|e| self.err(e))?;
            tx.execute("UPDATE tandem_schema SET version = $1", &[&(i as i32 + 1)])
                .await
                .map_err(|e| self.err(e))?;
        }
        tx.commit().await.map_err(|e| self.err(e))
    }

    async fn records(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<TaskRecord>> {
        let client = self.client().await?;
        let rows = client.query(sql, params).await.map_err(|e| self.err(e))?;
        rows.iter().map(|r| rules::decode(row(r))).collect()
    }

    async fn events_after_async(&self, id: &str, after: u64) -> Result<Vec<Event>> {
        let client = self.client().await?;
        self.read_events(&client, id, after).await
    }

    /// Task `id`'s events after seq `after`, through `client` (a connection or a transaction).
    async fn read_events(
        &self,
        client: &impl deadpool_postgres::GenericClient,
        id: &str,
        after: u64,
    ) -> Result<Vec<Event>> {
        let rows = client
            .query(&pg(rules::EVENTS_AFTER), &[&id, &(after as i64)])
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| event(r.get(0), r.get(1), r.get::<_, &str>(2)))
            .collect()
    }

    async fn apply_async(
        &self,
        changes: &[Change],
        fences: &Fences,
        daemon: &str,
    ) -> Result<Applied> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(|e| self.err(e))?;
        let (fenced, mut last) = self.lock(&tx, changes, fences).await?;
        let (mut ev_task, mut ev_seq, mut ev_at, mut ev_body) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut stored = Vec::new();
        let mut first: Vec<(String, i64)> = Vec::new();
        let mut queued = false;
        for change in changes {
            if fenced.iter().any(|id| id == change.task()) {
                continue;
            }
            match change {
                Change::Create(id, spec, now_ms) => {
                    create(&tx, id, spec, *now_ms)
                        .await
                        .map_err(|e| self.err(e))?;
                    last.insert(id.clone(), 0);
                    queued = true;
                }
                Change::State(id, state, now_ms) => {
                    tx.execute(
                        &pg(rules::SET_STATE),
                        &[id, &state.as_str(), &(*now_ms as i64)],
                    )
                    .await
                    .map_err(|e| self.err(e))?;
                    queued |= *state == TaskState::Queued;
                }
                Change::Event(id, msg, now_ms) => {
                    let seq = last.get(id).copied().unwrap_or(0) + 1;
                    last.insert(id.clone(), seq);
                    if !first.iter().any(|(t, _)| t == id) {
                        first.push((id.clone(), seq));
                    }
                    task_update(&tx, id, msg, *now_ms)
                        .await
                        .map_err(|e| self.err(e))?;
                    ev_task.push(id.clone());
                    ev_seq.push(seq);
                    ev_at.push(*now_ms as i64);
                    ev_body.push(to_json(msg));
                    stored.push((
                        id.clone(),
                        Event {
                            seq: seq as u64,
                            at_ms: *now_ms,
                            path: None,
                            msg: msg.clone(),
                        },
                    ));
                }
            }
        }
        if !ev_task.is_empty() {
            tx.execute(
                "INSERT INTO events (task_id, seq, at_ms, body)
                 SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[])",
                &[&ev_task, &ev_seq, &ev_at, &ev_body],
            )
            .await
            .map_err(|e| self.err(e))?;
        }
        for payload in payloads(daemon, &first, queued) {
            notify(&tx, &payload).await.map_err(|e| self.err(e))?;
        }
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(Applied {
            events: stored,
            fenced,
        })
    }

    /// Locks the rows of the tasks `changes` write (but create) in one order, so two writers
    /// cannot deadlock: their epochs hold still until the commit, and their events' seqs are
    /// this writer's. The tasks whose lease is no longer the one in `fences`, and each
    /// task's last event seq.
    async fn lock(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        changes: &[Change],
        fences: &Fences,
    ) -> Result<(Vec<String>, std::collections::HashMap<String, i64>)> {
        let created: Vec<&str> = changes
            .iter()
            .filter_map(|c| match c {
                Change::Create(id, ..) => Some(id.as_str()),
                _ => None,
            })
            .collect();
        let mut touched: Vec<&str> = changes
            .iter()
            .map(Change::task)
            .filter(|id| !created.contains(id))
            .collect();
        touched.sort_unstable();
        touched.dedup();
        let locked = tx
            .query(
                "SELECT id, epoch FROM tasks WHERE id = ANY($1) ORDER BY id FOR UPDATE",
                &[&touched],
            )
            .await
            .map_err(|e| self.err(e))?;
        let fenced = locked
            .iter()
            .filter(|row| {
                let (id, epoch): (&str, i64) = (row.get(0), row.get(1));
                fences.get(id).is_some_and(|f| *f != epoch as u64)
            })
            .map(|row| row.get::<_, String>(0))
            .collect();
        let last = tx
            .query(
                "SELECT task_id, MAX(seq) FROM events WHERE task_id = ANY($1) GROUP BY task_id",
                &[&touched],
            )
            .await
            .map_err(|e| self.err(e))?
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
            .collect();
        Ok((fenced, last))
    }

    async fn claim_async(
        &self,
        daemon: &str,
        lease_ms: u64,
        now_ms: u64,
        running: &[String],
    ) -> Result<Option<Claimed>> {
        let client = self.client().await?;
        // In the rules' order, each one statement, so a task is claimed whole or not at all,
        // by one daemon.
        let (leased, lapsed_first, queue_order) =
            (rules::LEASED, rules::LAPSED_FIRST, rules::QUEUE_ORDER);
        let lapsed = format!(
            "WITH next AS (
                SELECT id FROM tasks
                WHERE {leased} AND lease_until_ms < {NOW_MS} AND id <> ALL($3)
                {lapsed_first} LIMIT 1 FOR UPDATE SKIP LOCKED)
             UPDATE tasks t SET state = 'running', owner = $1, epoch = t.epoch + 1,
                lease_until_ms = {NOW_MS} + $2
             FROM next WHERE t.id = next.id
             RETURNING t.id, t.epoch, t.cancel_requested"
        );
        let queued = format!(
            "WITH next AS (
                SELECT id FROM tasks WHERE state = 'queued' AND id <> ALL($4)
                {queue_order} LIMIT 1 FOR UPDATE SKIP LOCKED)
             UPDATE tasks t SET state = 'running', owner = $1, epoch = t.epoch + 1,
                lease_until_ms = {NOW_MS} + $2, started_ms = $3
             FROM next WHERE t.id = next.id
             RETURNING t.id, t.epoch, t.cancel_requested"
        );
        let lease = lease_ms as i64;
        let mut row = client
            .query_opt(&lapsed, &[&daemon, &lease, &running])
            .await
            .map_err(|e| self.err(e))?;
        if row.is_none() {
            row = client
                .query_opt(&queued, &[&daemon, &lease, &(now_ms as i64), &running])
                .await
                .map_err(|e| self.err(e))?;
        }
        drop(client);
        let Some(row) = row else {
            return Ok(None);
        };
        let id: String = row.get(0);
        let epoch: i64 = row.get(1);
        let cancel: bool = row.get(2);
        let sql = &READS.get;
        let record = self
            .records(sql, &[&id])
            .await?
            .pop()
            .ok_or(StoreError::Writer("lost a claimed task"))?;
        let events = self.events_after_async(&id, 0).await?;
        Ok(Some(Claimed {
            record,
            epoch: epoch as u64,
            events,
            cancel,
        }))
    }

    async fn decide_async(
        &self,
        id: &str,
        n: u32,
        msg: &EventMsg,
        now_ms: u64,
        daemon: &str,
    ) -> Result<Option<Event>> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(|e| self.err(e))?;
        let state: Option<String> = tx
            .query_opt("SELECT state FROM tasks WHERE id = $1 FOR UPDATE", &[&id])
            .await
            .map_err(|e| self.err(e))?
            .map(|r| r.get(0));
        if state.is_none_or(|s| s == TaskState::Finished.as_str()) {
            return Ok(None);
        }
        let events = self.read_events(&tx, id, 0).await?;
        if decided(&events, n) {
            return Ok(None);
        }
        let seq = events.last().map_or(0, |e| e.seq as i64) + 1;
        tx.execute(
            "INSERT INTO events (task_id, seq, at_ms, body) VALUES ($1, $2, $3, $4)",
            &[&id, &seq, &(now_ms as i64), &to_json(msg)],
        )
        .await
        .map_err(|e| self.err(e))?;
        for payload in payloads(daemon, &[(id.to_owned(), seq)], false) {
            notify(&tx, &payload).await.map_err(|e| self.err(e))?;
        }
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(Some(Event {
            seq: seq as u64,
            at_ms: now_ms,
            path: None,
            msg: msg.clone(),
        }))
    }

    /// Listens for the other daemons' notices until the store is dropped, reconnecting with
    /// backoff when the connection is lost.
    async fn listen(
        config: tokio_postgres::Config,
        shown: String,
        daemon: String,
        sink: NoticeSink,
    ) {
        let mut backoff = Duration::from_millis(100);
        let mut connected_before = false;
        loop {
            match config.connect(NoTls).await {
                Ok((client, mut connection)) => {
                    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                    let driver = tokio::spawn(async move {
                        let mut messages =
                            futures::stream::poll_fn(move |cx| connection.poll_message(cx));
                        while let Some(message) = messages.next().await {
                            match message {
                                Ok(AsyncMessage::Notification(n)) => {
                                    if tx.send(n.payload().to_owned()).is_err() {
                                        return;
                                    }
                                }
                                Ok(_) => {}
                                Err(_) => return,
                            }
                        }
                    });
                    if client
                        .batch_execute(&format!("LISTEN {CHANNEL}"))
                        .await
                        .is_ok()
                    {
                        backoff = Duration::from_millis(100);
                        if connected_before {
                            sink(Notice::Reconnected);
                        }
                        connected_before = true;
                        while let Some(payload) = rx.recv().await {
                            for notice in parse_notice(&payload, &daemon) {
                                sink(notice);
                            }
                        }
                    }
                    driver.abort();
                    tracing::warn!(store = %shown, "lost the store's notice connection; reconnecting");
                }
                Err(e) => {
                    tracing::warn!(store = %shown, error = %e, retry_in = ?backoff, "cannot listen for other daemons' notices");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

impl TaskStore for PgStore {
    fn apply(&self, changes: &[Change], fences: &Fences) -> Result<Applied> {
        let mut tries = 0;
        loop {
            match self.block(self.apply_async(changes, fences, self.signer())) {
                // Chosen as a deadlock's victim: nothing was stored; the next try can be.
                Err(StoreError::Postgres { message, .. })
                    if tries < 3 && message.starts_with(DEADLOCK) =>
                {
                    tries += 1;
                }
                other => return other,
            }
        }
    }
    fn transition(&self, id: &str, from: TaskState, to: TaskState, now_ms: u64) -> Result<bool> {
        self.block(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await.map_err(|e| self.err(e))?;
            let moved = tx
                .execute(
                    &pg(rules::TRANSITION),
                    &[&id, &from.as_str(), &to.as_str(), &(now_ms as i64)],
                )
                .await
                .map_err(|e| self.err(e))?
                == 1;
            if moved && to == TaskState::Queued {
                notify(&tx, "q").await.map_err(|e| self.err(e))?;
            }
            tx.commit().await.map_err(|e| self.err(e))?;
            Ok(moved)
        })
    }
    fn get(&self, id: &str) -> Result<Option<TaskRecord>> {
        let sql = &READS.get;
        self.block(async { Ok(self.records(sql, &[&id]).await?.pop()) })
    }
    fn list(&self, state: Option<TaskState>) -> Result<Vec<TaskRecord>> {
        let sql = &READS.list;
        let state = state.map(TaskState::as_str);
        self.block(self.records(sql, &[&state]))
    }
    fn page(
        &self,
        state: Option<TaskState>,
        before: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<TaskRecord>, Option<String>)> {
        let sql = &READS.page;
        let state = state.map(TaskState::as_str);
        let tasks = self.block(self.records(sql, &[&state, &before, &rules::page_limit(limit)]))?;
        Ok(rules::page_of(tasks, limit))
    }
    fn list_after(
        &self,
        state: Option<TaskState>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<TaskRecord>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let sql = &READS.after;
        let state = state.map(TaskState::as_str);
        self.block(self.records(sql, &[&state, &after, &limit]))
    }
    fn events_after(&self, id: &str, after: u64) -> Result<Vec<Event>> {
        self.block(self.events_after_async(id, after))
    }
    fn interrupt_running(&self, daemon: &str) -> Result<Vec<String>> {
        // The state dir's lock says this daemon's last run is dead: its leases end now, so
        // its tasks resume (here or on another daemon) without waiting for them to lapse.
        self.block(async {
            let client = self.client().await?;
            client
                .execute(
                    &format!(
                        "UPDATE tasks SET lease_until_ms = 0 WHERE owner = $1 AND {}",
                        rules::LEASED
                    ),
                    &[&daemon],
                )
                .await
                .map_err(|e| self.err(e))?;
            Ok(Vec::new())
        })
    }
    fn counts(&self) -> Result<Vec<(TaskState, u64)>> {
        self.block(async {
            let client = self.client().await?;
            let rows = client
                .query(rules::COUNTS, &[])
                .await
                .map_err(|e| self.err(e))?;
            Ok(rules::counts(
                rows.iter()
                    .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1))),
            ))
        })
    }
    fn files_removed(&self, id: &str, at_ms: u64) -> Result<()> {
        self.block(async {
            let client = self.client().await?;
            client
                .execute(&pg(rules::FILES_REMOVED), &[&id, &(at_ms as i64)])
                .await
                .map_err(|e| self.err(e))?;
            Ok(())
        })
    }
    fn claim(
        &self,
        daemon: &str,
        lease_ms: u64,
        now_ms: u64,
        running: &[String],
    ) -> Result<Option<Claimed>> {
        self.block(self.claim_async(daemon, lease_ms, now_ms, running))
    }
    fn renew(
        &self,
        daemon: &str,
        held: &[(String, u64)],
        lease_ms: u64,
        _now_ms: u64,
    ) -> Result<Renewed> {
        let ids: Vec<&str> = held.iter().map(|(id, _)| id.as_str()).collect();
        let epochs: Vec<i64> = held.iter().map(|(_, e)| *e as i64).collect();
        // The rows are locked in id order, as the writer locks them, so the two cannot
        // deadlock.
        let leased = rules::LEASED;
        let sql = format!(
            "WITH held AS (
                SELECT t.id FROM tasks t
                JOIN unnest($3::text[], $4::bigint[]) AS h(id, epoch)
                  ON t.id = h.id AND t.epoch = h.epoch
                WHERE t.owner = $1 AND t.{leased}
                ORDER BY t.id FOR UPDATE OF t)
             UPDATE tasks t SET lease_until_ms = {NOW_MS} + $2
             FROM held WHERE t.id = held.id
             RETURNING t.id, t.cancel_requested"
        );
        let rows = self.block(async {
            let client = self.client().await?;
            client
                .query(&sql, &[&daemon, &(lease_ms as i64), &ids, &epochs])
                .await
                .map_err(|e| self.err(e))
        })?;
        let mut renewed = Renewed::default();
        for (id, _) in held {
            match rows.iter().find(|r| r.get::<_, &str>(0) == id) {
                None => renewed.lost.push(id.clone()),
                Some(r) if r.get::<_, bool>(1) => renewed.cancel.push(id.clone()),
                Some(_) => {}
            }
        }
        Ok(renewed)
    }
    fn request_cancel(&self, id: &str) -> Result<()> {
        self.block(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await.map_err(|e| self.err(e))?;
            tx.execute(
                "UPDATE tasks SET cancel_requested = TRUE WHERE id = $1",
                &[&id],
            )
            .await
            .map_err(|e| self.err(e))?;
            notify(&tx, &format!("c {id}"))
                .await
                .map_err(|e| self.err(e))?;
            tx.commit().await.map_err(|e| self.err(e))
        })
    }
    fn owner(&self, id: &str, _now_ms: u64) -> Result<Option<String>> {
        let sql = format!(
            "SELECT owner FROM tasks WHERE id = $1 AND lease_until_ms >= {NOW_MS} AND {}",
            rules::LEASED
        );
        self.block(async {
            let client = self.client().await?;
            Ok(client
                .query_opt(&sql, &[&id])
                .await
                .map_err(|e| self.err(e))?
                .and_then(|r| r.get(0)))
        })
    }
    fn decide(&self, id: &str, n: u32, msg: &EventMsg, now_ms: u64) -> Result<Option<Event>> {
        self.block(self.decide_async(id, n, msg, now_ms, self.signer()))
    }
    fn notices(&self, daemon: &str, sink: NoticeSink) -> Result<()> {
        let Some(rt) = &self.runtime else {
            return Ok(());
        };
        let _ = self.daemon.set(daemon.to_owned());
        rt.spawn(Self::listen(
            self.config.clone(),
            self.shown.clone(),
            daemon.to_owned(),
            sink,
        ));
        Ok(())
    }
}

/// What [`PgStore::import`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Imported {
    /// Tasks moved.
    pub tasks: usize,
    /// Their events.
    pub events: usize,
    /// Tasks left out because the database has them already (a migration run again).
    pub present: usize,
}

impl PgStore {
    /// Copies `tasks` (in queue order) with their events, keeping ids, seqs, states, usage
    /// and times; a task that was running becomes interrupted (no daemon runs it now). One
    /// transaction per task, so a migration cut off part way runs again to completion.
    pub fn import(&self, tasks: Vec<(TaskRecord, Vec<Event>)>) -> Result<Imported> {
        self.block(async {
            let mut done = Imported::default();
            let mut client = self.client().await?;
            for (task, events) in tasks {
                let tx = client.transaction().await.map_err(|e| self.err(e))?;
                let state = match task.state {
                    TaskState::Running | TaskState::AwaitingApproval => TaskState::Interrupted,
                    other => other,
                };
                let inserted = tx
                    .execute(
                        "INSERT INTO tasks (id, state, spec, stop_reason, error, prompt_tokens,
                            completion_tokens, turns, created_ms, started_ms, finished_ms,
                            files_removed_ms, outcome, trace_id)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
                         ON CONFLICT (id) DO NOTHING",
                        &[
                            &task.id,
                            &state.as_str(),
                            &to_json(&task.spec),
                            &task.stop_reason.map(|r| r.as_str()),
                            &task.error.as_ref().map(to_json),
                            &(task.usage.prompt_tokens as i64),
                            &(task.usage.completion_tokens as i64),
                            &i64::from(task.turns),
                            &(task.created_ms as i64),
                            &task.started_ms.map(|v| v as i64),
                            &task.finished_ms.map(|v| v as i64),
                            &task.files_removed_ms.map(|v| v as i64),
                            &outcome_json(&task),
                            &task.trace_id,
                        ],
                    )
                    .await
                    .map_err(|e| self.err(e))?;
                if inserted == 0 {
                    done.present += 1;
                    continue;
                }
                let ids: Vec<&str> = events.iter().map(|_| task.id.as_str()).collect();
                let seqs: Vec<i64> = events.iter().map(|e| e.seq as i64).collect();
                let ats: Vec<i64> = events.iter().map(|e| e.at_ms as i64).collect();
                let bodies: Vec<String> = events.iter().map(|e| to_json(&e.msg)).collect();
                tx.execute(
                    "INSERT INTO events (task_id, seq, at_ms, body)
                     SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[])",
                    &[&ids, &seqs, &ats, &bodies],
                )
                .await
                .map_err(|e| self.err(e))?;
                tx.commit().await.map_err(|e| self.err(e))?;
                done.tasks += 1;
                done.events += events.len();
            }
            Ok(done)
        })
    }

    fn signer(&self) -> &str {
        self.daemon.get().map_or("", String::as_str)
    }
}

async fn create(
    tx: &tokio_postgres::Transaction<'_>,
    id: &str,
    spec: &TaskSpec,
    now_ms: u64,
) -> std::result::Result<(), tokio_postgres::Error> {
    tx.execute(
        "INSERT INTO tasks (id, state, spec, created_ms) VALUES ($1, 'queued', $2, $3)",
        &[&id, &to_json(spec), &(now_ms as i64)],
    )
    .await
    .map(drop)
}

/// What an event changes in its task's row.
async fn task_update(
    tx: &tokio_postgres::Transaction<'_>,
    id: &str,
    msg: &EventMsg,
    now_ms: u64,
) -> std::result::Result<(), tokio_postgres::Error> {
    match rules::row_change(msg, now_ms) {
        Some(RowChange::Traced { trace_id }) => {
            tx.execute(&pg(rules::TRACED), &[&id, &trace_id]).await?;
        }
        Some(RowChange::Turn { turn, usage }) => {
            tx.execute(
                "UPDATE tasks SET turns = $2, prompt_tokens = prompt_tokens + $3,
                    completion_tokens = completion_tokens + $4 WHERE id = $1",
                &[
                    &id,
                    &i64::from(turn),
                    &(usage.prompt_tokens as i64),
                    &(usage.completion_tokens as i64),
                ],
            )
            .await?;
        }
        Some(RowChange::Finished {
            stop_reason,
            error,
            turns,
            at_ms,
            outcome,
        }) => {
            tx.execute(
                "UPDATE tasks SET state = 'finished', stop_reason = $2, error = $3, turns = $4,
                    finished_ms = $5, lease_until_ms = NULL, outcome = $6 WHERE id = $1",
                &[
                    &id,
                    &stop_reason.as_str(),
                    &error,
                    &i64::from(turns),
                    &(at_ms as i64),
                    &outcome,
                ],
            )
            .await?;
        }
        None => {}
    }
    Ok(())
}

async fn notify(
    tx: &tokio_postgres::Transaction<'_>,
    payload: &str,
) -> std::result::Result<(), tokio_postgres::Error> {
    tx.execute("SELECT pg_notify($1, $2)", &[&CHANNEL, &payload])
        .await
        .map(drop)
}

/// Longest notice payload sent (PostgreSQL takes up to 8000 bytes).
const MAX_PAYLOAD: usize = 7000;

/// The notices for a commit by `daemon`: each task's first new event (`e`), in as few
/// payloads as fit, and `q` when a task was queued.
fn payloads(daemon: &str, first: &[(String, i64)], queued: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for (id, seq) in first {
        if current.len() + id.len() + 24 > MAX_PAYLOAD {
            out.push(std::mem::take(&mut current));
        }
        if current.is_empty() {
            current = format!("e {daemon}");
        }
        current.push_str(&format!(" {id}:{seq}"));
    }
    if !current.is_empty() {
        out.push(current);
    }
    if queued {
        out.push("q".to_owned());
    }
    out
}

/// What a payload tells daemon `me`; its own events are left out.
fn parse_notice(payload: &str, me: &str) -> Vec<Notice> {
    let mut words = payload.split(' ');
    match words.next() {
        Some("q") => vec![Notice::Queued],
        Some("c") => words
            .next()
            .map(|id| Notice::Cancel(id.to_owned()))
            .into_iter()
            .collect(),
        Some("e") => {
            let from = words.next().unwrap_or_default();
            if from == me && !me.is_empty() {
                return Vec::new();
            }
            words
                .filter_map(|w| w.rsplit_once(':'))
                .filter_map(|(id, seq)| Some(Notice::Events(id.to_owned(), seq.parse().ok()?)))
                .collect()
        }
        _ => Vec::new(),
    }
}

fn row(r: &Row) -> rules::Row {
    rules::Row {
        id: r.get(0),
        state: r.get(1),
        spec: r.get(2),
        stop_reason: r.get(3),
        error: r.get(4),
        prompt_tokens: r.get(5),
        completion_tokens: r.get(6),
        turns: r.get(7),
        times: rules::Times {
            created_ms: r.get(8),
            started_ms: r.get(9),
            finished_ms: r.get(10),
            files_removed_ms: r.get(11),
        },
        outcome: r.get(12),
        trace_id: r.get(13),
    }
}

/// A copied task's final answer and check, as the `outcome` column holds them.
fn outcome_json(task: &TaskRecord) -> Option<String> {
    rules::outcome_of(task)
}

/// The database as `user@host:port/db`: what errors and logs show, never the password.
fn shown(config: &tokio_postgres::Config) -> String {
    let host = config
        .get_hosts()
        .first()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".to_owned());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "postgres://{}@{host}:{port}/{}",
        config.get_user().unwrap_or("(user)"),
        config
            .get_dbname()
            .or(config.get_user())
            .unwrap_or("(database)")
    )
}

/// Where the store's password comes from when its URL has none: never the command line.
#[derive(Clone, Debug, Default)]
pub struct StoreSecrets {
    /// The password itself (from `[store] password_file` or `PGPASSWORD`).
    pub password: Option<String>,
    /// A libpq password file (`PGPASSFILE`, else `~/.pgpass`), looked up as libpq does.
    pub pgpass: Option<std::path::PathBuf>,
}

/// The password `pgpass` (lines of `host:port:database:user:password`, `*` matching any,
/// `\:` and `\\` escaped) holds for `config`'s first host, port, database and user. As
/// libpq, a file others may read is ignored.
fn from_pgpass(pgpass: &std::path::Path, config: &tokio_postgres::Config) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(pgpass).ok()?;
    if meta.mode() & 0o077 != 0 {
        tracing::warn!(file = %pgpass.display(), "the password file is readable by others; it is ignored (chmod 600 it)");
        return None;
    }
    let text = std::fs::read_to_string(pgpass).ok()?;
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "localhost".to_owned(),
    };
    let port = config
        .get_ports()
        .first()
        .copied()
        .unwrap_or(5432)
        .to_string();
    let user = config.get_user().unwrap_or_default().to_owned();
    let db = config.get_dbname().unwrap_or(&user).to_owned();
    let wanted = [host, port, db, user];
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let fields = pgpass_fields(line);
            let [h, p, d, u, pw] = <[String; 5]>::try_from(fields).ok()?;
            [h, p, d, u]
                .iter()
                .zip(&wanted)
                .all(|(field, want)| field == "*" || field == want)
                .then_some(pw)
        })
}

fn pgpass_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let (Some(next), Some(field)) = (chars.next(), fields.last_mut()) {
                    field.push(next);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => {
                if let Some(field) = fields.last_mut() {
                    field.push(c);
                }
            }
        }
    }
    fields
}

/// A PostgreSQL error as the daemon reports it: what went wrong and what to do.
fn pg_error(shown: &str, e: &tokio_postgres::Error) -> StoreError {
    let Some(db) = e.as_db_error() else {
        // No answer from the server: it is down, restarting, or the network is cut.
        let cause =
            std::error::Error::source(e).map_or_else(|| e.to_string(), |s| format!("{e}: {s}"));
        return StoreError::Postgres {
            url: shown.to_owned(),
            message: format!("cannot reach the database ({cause})"),
            unreachable: true,
        };
    };
    let code = db.code().code();
    let message = match code {
        "40P01" | "40001" => format!("{DEADLOCK}: {}", db.message()),
        "28P01" | "28000" => format!(
            "the database refused the login ({}); check the user and password",
            db.message()
        ),
        "3D000" => format!(
            "{}; create it (createdb) or name another database",
            db.message()
        ),
        _ => db.message().to_owned(),
    };
    StoreError::Postgres {
        url: shown.to_owned(),
        message,
        // Connection exceptions, and the server shutting down or starting up.
        unreachable: code.starts_with("08") || code.starts_with("57P"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_a_daemon_skips_its_own_events() {
        let first = vec![("a".to_owned(), 3), ("b".to_owned(), 1)];
        let sent = payloads("d1", &first, true);
        assert_eq!(sent, ["e d1 a:3 b:1", "q"]);
        assert_eq!(
            parse_notice(&sent[0], "d2"),
            [Notice::Events("a".into(), 3), Notice::Events("b".into(), 1)]
        );
        assert!(parse_notice(&sent[0], "d1").is_empty());
        assert_eq!(parse_notice("c t1", "d1"), [Notice::Cancel("t1".into())]);
        assert!(parse_notice("garbage", "d1").is_empty());
    }

    #[test]
    fn a_long_commit_is_told_in_payloads_postgres_accepts() {
        let first: Vec<(String, i64)> = (0..1000).map(|i| (format!("{i:032}"), 1)).collect();
        let sent = payloads("d", &first, false);
        assert!(sent.len() > 1);
        assert!(sent.iter().all(|p| p.len() <= 8000));
        let told: usize = sent.iter().map(|p| parse_notice(p, "x").len()).sum();
        assert_eq!(told, 1000);
    }

    #[test]
    fn the_url_shown_hides_the_password() {
        let config: tokio_postgres::Config = "postgres://tandem:s3cret@db.example:6543/tasks"
            .parse()
            .unwrap();
        let shown = shown(&config);
        assert_eq!(shown, "postgres://tandem@db.example:6543/tasks");
    }
}
