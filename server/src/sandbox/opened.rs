//! One sandbox open without a task, and the claim a block holds on it while it runs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_executor::{CancellationToken, Executor, Session};
use tandem_protocol::ApiErrorCode;
use tandem_protocol::session::SessionInfo;
use tokio::sync::{Notify, oneshot};

use super::{Owner, Refusal};

/// How long a kept interpreter has to pickle its globals for a snapshot.
const STATE_WAIT: Duration = Duration::from_secs(120);

/// What an [`Opened`] is made of, before its session.
pub(super) struct Made {
    pub id: String,
    pub owner: Owner,
    pub executor: String,
    pub sandbox: Arc<dyn Executor>,
    pub keep_state: bool,
    pub tools: Vec<String>,
    pub idle: Duration,
    /// Where its blocks' connections through the egress proxy are told, when it is behind it.
    pub net: Option<Arc<NetRoute>>,
    /// Each block's limits.
    pub limits: tandem_executor::Limits,
    /// What its client asked, kept for a pause that outlives the daemon.
    pub asked: Asked,
    /// Which road opened it (for the sandbox budget's labels).
    pub road: &'static str,
    /// Where a pause saves it.
    pub files: Arc<crate::files::Files>,
    /// The daemon's name on the store, which a pause records.
    pub daemon: String,
    /// The volumes its sandbox mounts.
    pub volumes: Vec<tandem_executor::VolumeBinding>,
    /// Those volumes counted as mounted for as long as this lasts (a pause included).
    pub _held: Vec<tandem_volumes::Held>,
}

/// What a session's client asked beyond its [`Made`], as a pause keeps it.
pub(super) struct Asked {
    pub limits: tandem_protocol::TaskLimits,
    pub network: Option<tandem_protocol::net::NetworkRequest>,
    pub volumes: Vec<tandem_protocol::volume::VolumeMount>,
}

/// The running block's event stream, which the egress proxy's records of the sandbox join;
/// between blocks there is no one to tell.
#[derive(Default)]
pub(crate) struct NetRoute {
    to: Mutex<Option<tokio::sync::mpsc::UnboundedSender<tandem_protocol::session::ExecEvent>>>,
    /// Where each connection is counted, by the session's executor.
    counted: Option<(crate::metrics::NetCounter, String)>,
    /// Connections the proxy holds for this sandbox, not yet recorded.
    open: std::sync::atomic::AtomicUsize,
    settled: tokio::sync::Notify,
    /// Bytes in and out over the connections recorded since the last `take_bytes`.
    bytes: Mutex<(u64, u64)>,
}

impl NetRoute {
    /// A route whose connections are also counted on `/metrics` under `executor`.
    pub(crate) fn counted(counter: crate::metrics::NetCounter, executor: &str) -> NetRoute {
        NetRoute {
            counted: Some((counter, executor.to_owned())),
            ..NetRoute::default()
        }
    }

    /// Sends what the proxy records to `to` (`None`: nowhere) until told otherwise.
    pub(crate) fn route_to(
        &self,
        to: Option<tokio::sync::mpsc::UnboundedSender<tandem_protocol::session::ExecEvent>>,
    ) {
        if let Ok(mut slot) = self.to.lock() {
            *slot = to;
        }
    }

    /// Waits (at most `within`) until every connection the sandbox opened is recorded: a
    /// block's connections close as its processes exit, a moment after its result.
    pub(crate) async fn settle(&self, within: std::time::Duration) {
        use std::sync::atomic::Ordering;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.open.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return;
            }
        }
    }
}

impl NetRoute {
    /// Bytes received and sent since the last call, and starts counting again.
    pub(crate) fn take_bytes(&self) -> (u64, u64) {
        self.bytes
            .lock()
            .map(|mut b| std::mem::take(&mut *b))
            .unwrap_or_default()
    }
}

impl tandem_egress::NetSink for NetRoute {
    fn record(&self, event: tandem_protocol::net::NetEvent) {
        if let Some((counter, executor)) = &self.counted {
            counter.count(executor, &event);
        }
        if let Ok(mut bytes) = self.bytes.lock() {
            bytes.0 = bytes.0.saturating_add(event.bytes_in);
            bytes.1 = bytes.1.saturating_add(event.bytes_out);
        }
        if let Ok(slot) = self.to.lock()
            && let Some(tx) = slot.as_ref()
        {
            let _ = tx.send(tandem_protocol::session::ExecEvent::Net(event));
        }
    }

    fn started(&self) {
        self.open.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    fn finished(&self) {
        let before = self.open.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        if before <= 1 {
            self.settled.notify_waiters();
        }
    }
}

/// A tool call's answer, sent to the block that waits for it.
pub(super) type CallAnswer = oneshot::Sender<Result<String, String>>;

/// One open sandbox: its executor's session and what the pool knows of it.
pub struct Opened {
    made: Made,
    created_ms: u64,
    /// How long its opening waited for a started sandbox from the executor's warm pool.
    pool_wait_ms: Option<u64>,
    /// Its host workspace, read without waiting for a running block; `None` while paused.
    workspace: Mutex<Option<PathBuf>>,
    /// `None` once closed, and while paused.
    session: tokio::sync::Mutex<Option<Box<dyn Session>>>,
    /// The way in to its ports, reached without waiting for a running block.
    ports: Mutex<Option<Arc<dyn tandem_executor::Ports>>>,
    /// The snapshot it was saved as, while it is paused.
    paused: Mutex<Option<String>>,
    /// Set when a pause would lose something (or failed): not tried again until its next
    /// block.
    unpausable: std::sync::atomic::AtomicBool,
    used: Mutex<Instant>,
    blocks: AtomicU64,
    /// What its blocks used, summed; `None` before the first that was measured.
    totals: Mutex<Option<tandem_protocol::Resources>>,
    /// The running block's cancel token; at most one block runs at a time.
    running: Mutex<Option<CancellationToken>>,
    /// Set once it is closed.
    closed: std::sync::atomic::AtomicBool,
    /// Told when the running block ends, to the claims that wait their turn.
    freed: Notify,
    /// Tool calls waiting for the client's answer, by id.
    pub(super) calls: Mutex<HashMap<String, CallAnswer>>,
    pub(super) next_call: AtomicU64,
}

impl Opened {
    pub(super) fn new(made: Made, session: Box<dyn Session>) -> Arc<Self> {
        Arc::new(Self {
            made,
            created_ms: crate::now_ms(),
            pool_wait_ms: session
                .pool_wait()
                .map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX)),
            workspace: Mutex::new(session.workspace().map(std::path::Path::to_owned)),
            ports: Mutex::new(session.ports()),
            session: tokio::sync::Mutex::new(Some(session)),
            paused: Mutex::new(None),
            unpausable: std::sync::atomic::AtomicBool::new(false),
            used: Mutex::new(Instant::now()),
            blocks: AtomicU64::new(0),
            totals: Mutex::new(None),
            running: Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
            freed: Notify::new(),
            calls: Mutex::default(),
            next_call: AtomicU64::new(1),
        })
    }

    /// A session paused before the daemon last stopped, as `record` kept it.
    pub(super) fn paused(made: Made, record: &super::pause::PausedRecord) -> Arc<Self> {
        Arc::new(Self {
            made,
            created_ms: record.created_ms,
            pool_wait_ms: None,
            workspace: Mutex::new(None),
            ports: Mutex::new(None),
            session: tokio::sync::Mutex::new(None),
            paused: Mutex::new(Some(record.snapshot.clone())),
            unpausable: std::sync::atomic::AtomicBool::new(false),
            used: Mutex::new(Instant::now()),
            blocks: AtomicU64::new(record.blocks),
            totals: Mutex::new(None),
            running: Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
            freed: Notify::new(),
            calls: Mutex::default(),
            next_call: AtomicU64::new(1),
        })
    }

    /// The way in to its TCP ports, while it is open and its executor has one.
    pub fn ports(&self) -> Option<Arc<dyn tandem_executor::Ports>> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        self.ports.lock().ok().and_then(|p| p.clone())
    }

    fn paused_as(&self) -> Option<String> {
        self.paused.lock().ok().and_then(|p| p.clone())
    }

    /// Its id, unique for its owner.
    pub fn id(&self) -> &str {
        &self.made.id
    }

    /// The executor it runs on.
    pub fn executor(&self) -> &str {
        &self.made.executor
    }

    /// The executor itself.
    pub fn sandbox(&self) -> &Arc<dyn Executor> {
        &self.made.sandbox
    }

    /// The tools its code may call.
    pub fn tools(&self) -> &[String] {
        &self.made.tools
    }

    /// Where the egress proxy's records of its blocks go, when it is behind the proxy.
    pub(crate) fn net_route(&self) -> Option<&NetRoute> {
        self.made.net.as_deref()
    }

    /// Who holds it.
    pub fn owner(&self) -> Owner {
        self.made.owner
    }

    /// Adds a block's figures to the session's totals.
    pub fn add_resources(&self, block: &tandem_protocol::Resources) {
        if let Ok(mut totals) = self.totals.lock() {
            totals.get_or_insert_with(Default::default).add(block);
        }
    }

    /// The sandbox as the API shows it.
    pub fn info(&self) -> SessionInfo {
        SessionInfo {
            id: self.made.id.clone(),
            executor: self.made.executor.clone(),
            keep_state: self.made.keep_state,
            tools: self.made.tools.clone(),
            busy: self.running.lock().map(|r| r.is_some()).unwrap_or(false),
            blocks: self.blocks.load(Ordering::Relaxed),
            created_ms: self.created_ms,
            idle_timeout_secs: self.made.idle.as_secs(),
            pool_wait_ms: self.pool_wait_ms,
            resources: self.totals.lock().ok().and_then(|t| t.clone()),
            state: if self.paused_as().is_some() {
                tandem_protocol::session::SessionState::Paused
            } else {
                tandem_protocol::session::SessionState::Running
            },
        }
    }

    /// How long it has gone unused; `None` while a block runs.
    fn idle_for(&self) -> Option<Duration> {
        if self.running.lock().map_or(true, |r| r.is_some()) {
            return None;
        }
        self.used.lock().ok().map(|u| u.elapsed())
    }

    /// Whether it is to be closed now: a paused one unused for `pausing.keep`; a running one
    /// past its idle timeout, unless it is the API's and pauses instead.
    pub(super) fn expired(&self, owner: Owner, pausing: &crate::policy::Pausing) -> bool {
        let Some(idle) = self.idle_for() else {
            return false;
        };
        if self.paused_as().is_some() {
            return idle > pausing.keep;
        }
        let pauses = owner == Owner::Api
            && pausing.after.is_some()
            && !self.unpausable.load(Ordering::Relaxed);
        !pauses && idle > self.made.idle
    }

    /// Whether it is running, unused for `after`, and may be paused.
    pub(super) fn may_pause(&self, after: Duration) -> bool {
        self.paused_as().is_none()
            && !self.closed.load(Ordering::Acquire)
            && !self.unpausable.load(Ordering::Relaxed)
            && self.idle_for().is_some_and(|idle| idle >= after)
    }

    /// Saves it as a snapshot and closes its sandbox, between blocks; its next block opens a
    /// new one from the snapshot. Not paused (and not tried again until its next block) when
    /// something would be lost: a server it left listening, a global or file the snapshot
    /// cannot hold.
    pub(super) async fn pause(&self) {
        let Ok(mut guard) = self.session.try_lock() else {
            return;
        };
        if self.idle_for().is_none() || guard.is_none() || self.paused_as().is_some() {
            return;
        }
        let id = self.made.id.clone();
        let refuse = |why: String| {
            self.unpausable.store(true, Ordering::Relaxed);
            tracing::info!(session = %id, "not pausing the session: {why}");
        };
        if let Some(ports) = self.ports()
            && let Ok(listening) = ports.listening().await
            && let Some(port) = listening.first()
        {
            return refuse(format!("a server its blocks left listens on port {port}"));
        }
        let Some(session) = guard.as_mut() else {
            return;
        };
        let store = self.made.files.snapshots().clone();
        let record = match self
            .snapshot_of(
                session,
                &store,
                Some(format!("paused session {id}")),
                "pause",
            )
            .await
        {
            Ok(record) => record,
            Err(e) => return refuse(e.message),
        };
        let forget = |why: String| {
            let store = store.clone();
            let snap = record.id.clone();
            tokio::task::spawn_blocking(move || store.remove(&snap));
            refuse(why);
        };
        if let Some(lost) = record.not_saved.first() {
            return forget(format!(
                "a snapshot cannot hold {} ({}){}",
                lost.name,
                lost.why,
                if record.not_saved.len() > 1 {
                    format!(" and {} more", record.not_saved.len() - 1)
                } else {
                    String::new()
                }
            ));
        }
        let kept = super::pause::PausedRecord {
            id: id.clone(),
            executor: self.made.executor.clone(),
            keep_state: self.made.keep_state,
            tools: self.made.tools.clone(),
            idle_timeout_secs: self.made.idle.as_secs(),
            limits: self.made.asked.limits.clone(),
            network: self.made.asked.network.clone(),
            volumes: self.made.asked.volumes.clone(),
            snapshot: record.id.clone(),
            daemon: self.made.daemon.clone(),
            created_ms: self.created_ms,
            blocks: self.blocks.load(Ordering::Relaxed),
        };
        let root = self.made.files.root().to_owned();
        let written = tokio::task::spawn_blocking(move || super::pause::keep(&root, &kept)).await;
        match written {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return forget(format!("its record could not be written: {e}")),
            Err(e) => return forget(format!("its record could not be written: {e}")),
        }
        // Said paused only once its sandbox is gone; a block that comes meanwhile waits for
        // the guard, then resumes it.
        if let Ok(mut p) = self.ports.lock() {
            *p = None;
        }
        if let Some(session) = guard.take()
            && let Err(e) = session.close().await
        {
            tracing::warn!(session = %id, error = %e, "closing a paused session's sandbox failed");
        }
        if let Ok(mut w) = self.workspace.lock() {
            *w = None;
        }
        if let Ok(mut paused) = self.paused.lock() {
            *paused = Some(record.id.clone());
        }
        drop(guard);
        tracing::info!(session = %id, snapshot = %record.id, "paused the session");
    }

    /// Opens a new sandbox from what it was paused as, into `slot`; nothing when it is not
    /// paused. The saved snapshot goes once the new sandbox holds it.
    async fn resume_into(&self, slot: &mut Option<Box<dyn Session>>) -> Result<(), Refusal> {
        if slot.is_some() || self.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        let Some(snap) = self.paused_as() else {
            return Ok(());
        };
        let files = self.made.files.clone();
        let restoring = snap.clone();
        let tar = tokio::task::spawn_blocking(move || {
            files
                .snapshots()
                .restore_tar(&restoring, &files.scratch(), None)
        })
        .await
        .map_err(|e| Refusal::new(ApiErrorCode::Internal, format!("resuming the session: {e}")))?
        .map_err(|e| {
            Refusal::new(
                ApiErrorCode::Conflict,
                format!(
                    "session `{}` is paused and cannot be resumed: {e}",
                    self.made.id
                ),
            )
        })?;
        let session = super::start(
            &self.made.sandbox,
            self.made.limits.clone(),
            Some(tar.to_path_buf()),
            self.made.keep_state,
            self.made.road,
            self.made.volumes.clone(),
        )
        .await?;
        drop(tar);
        if let Ok(mut w) = self.workspace.lock() {
            *w = session.workspace().map(std::path::Path::to_owned);
        }
        if let Ok(mut p) = self.ports.lock() {
            *p = session.ports();
        }
        *slot = Some(session);
        if let Ok(mut paused) = self.paused.lock() {
            *paused = None;
        }
        self.forget_pause(&snap).await;
        tracing::info!(session = %self.made.id, "resumed the paused session");
        Ok(())
    }

    /// Removes what a pause saved: its record, then its snapshot.
    async fn forget_pause(&self, snap: &str) {
        let files = self.made.files.clone();
        let id = self.made.id.clone();
        let snap = snap.to_owned();
        let _ = tokio::task::spawn_blocking(move || {
            super::pause::forget(files.root(), &id);
            if let Err(e) = files.snapshots().remove(&snap) {
                tracing::warn!(session = %id, error = %e, "removing a paused session's snapshot failed");
            }
        })
        .await;
    }

    /// Resumes it if it is paused, between blocks (a block that runs now has it running).
    pub async fn wake(&self) -> Result<(), Refusal> {
        let mut guard = self.session.lock().await;
        self.resume_into(&mut guard).await
    }

    fn touch(&self) {
        *self.used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// Its host workspace, or why files cannot be reached.
    pub fn workspace(&self) -> Result<PathBuf, Refusal> {
        if self.paused_as().is_some() {
            return Err(Refusal::new(
                ApiErrorCode::Conflict,
                format!(
                    "session `{}` is paused; its next block resumes it",
                    self.made.id
                ),
            ));
        }
        self.workspace
            .lock()
            .ok()
            .and_then(|w| w.clone())
            .ok_or_else(|| {
                Refusal::invalid(format!(
                    "the {} executor's sessions have no workspace the daemon can read",
                    self.made.executor
                ))
            })
    }

    /// Cancels its running block and closes its sandbox; a paused one's snapshot goes.
    pub async fn close(&self) {
        self.leave().await;
        let paused = self.paused.lock().ok().and_then(|mut p| p.take());
        if let Some(snap) = paused {
            self.forget_pause(&snap).await;
        }
    }

    /// Cancels its running block and closes its sandbox, keeping what a pause saved (the
    /// daemon stops, and takes the paused session back when it starts).
    pub async fn leave(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.cancel();
        let session = self.session.lock().await.take();
        if let Some(session) = session
            && let Err(e) = session.close().await
        {
            tracing::warn!(session = %self.made.id, error = %e, "closing a sandbox failed");
        }
        self.freed.notify_waiters();
    }

    /// Its session, held so that no block starts until the guard is dropped; a 409 saying
    /// `what` waits for the block that runs now.
    fn between_blocks(
        &self,
        what: &str,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<Box<dyn Session>>>, Refusal> {
        match self.session.try_lock() {
            Ok(guard) if self.running.lock().is_ok_and(|r| r.is_none()) => {
                self.touch();
                Ok(guard)
            }
            _ => Err(Refusal::new(
                ApiErrorCode::Conflict,
                format!(
                    "a block runs in session `{}` now; {what} between blocks",
                    self.made.id
                ),
            )),
        }
    }

    /// Places the files of the tar archive `archive` in the workspace, within `caps`,
    /// between blocks.
    pub async fn put(
        &self,
        archive: &std::path::Path,
        caps: tandem_executor_kit::archive::ArchiveCaps,
    ) -> Result<Vec<tandem_executor_kit::archive::ArchivedFile>, Refusal> {
        self.wake().await?;
        let mut guard = self.between_blocks("place files")?;
        let session = guard
            .as_mut()
            .ok_or_else(|| self.made.owner.unknown(&self.made.id))?;
        session
            .put_archive(archive, caps)
            .await
            .map_err(|e| Refusal::invalid(format!("placing the files failed: {e}")))
    }

    /// Takes a snapshot of its workspace (and its kept globals) into `store`, between blocks
    /// (no block starts while it is taken); a paused session is resumed first.
    pub async fn snapshot(
        &self,
        store: &tandem_snapshots::Store,
        name: Option<String>,
    ) -> Result<tandem_snapshots::Record, Refusal> {
        self.wake().await?;
        let mut guard = self.between_blocks("take its snapshot")?;
        let session = guard
            .as_mut()
            .ok_or_else(|| self.made.owner.unknown(&self.made.id))?;
        self.snapshot_of(session, store, name, "session").await
    }

    /// A snapshot of `session` (this sandbox's, held between blocks), its source `kind`.
    async fn snapshot_of(
        &self,
        session: &mut Box<dyn Session>,
        store: &tandem_snapshots::Store,
        name: Option<String>,
        kind: &str,
    ) -> Result<tandem_snapshots::Record, Refusal> {
        let work = self.workspace()?;
        let source = tandem_snapshots::Source {
            kind: kind.into(),
            id: self.made.id.clone(),
            executor: self.made.executor.clone(),
        };
        let internal = |what: &str, e: &dyn std::fmt::Display| {
            Refusal::new(ApiErrorCode::Internal, format!("{what}: {e}"))
        };
        // The interpreter pickles its globals inside the sandbox; the daemon only keeps the
        // bytes, bounded by what the store has left.
        let pickle = tempfile::NamedTempFile::new_in(store.scratch())
            .map_err(|e| internal("taking the snapshot", &e))?
            .into_temp_path();
        let left = {
            let store = store.clone();
            tokio::task::spawn_blocking(move || store.room())
                .await
                .map_err(|e| internal("taking the snapshot", &e))?
                .map_err(super::snapshot_refusal)?
        };
        let state = session
            .save_state(&pickle, left, STATE_WAIT)
            .await
            .map_err(|e| {
                Refusal::new(
                    ApiErrorCode::Conflict,
                    format!("{e}; no snapshot was taken"),
                )
            })?;
        let (saved, not_saved, kept) = match state {
            Some(state) => (
                state.saved,
                state
                    .not_saved
                    .into_iter()
                    .map(|(name, why)| tandem_snapshots::NotSaved { name, why })
                    .collect(),
                state.bytes > 0,
            ),
            None => (Vec::new(), Vec::new(), false),
        };
        let store = store.clone();
        let taken = tokio::task::spawn_blocking(move || {
            let state = kept.then_some(&*pickle);
            store.take(&work, name, source, saved, not_saved, state)
        })
        .await
        .map_err(|e| internal("taking the snapshot", &e))?;
        taken.map_err(super::snapshot_refusal)
    }

    /// Cancels the block that runs now, if one does; whether one did.
    pub fn cancel(&self) -> bool {
        match self.running.lock().ok().and_then(|r| r.clone()) {
            Some(token) => {
                token.cancel();
                true
            }
            None => false,
        }
    }

    /// Answers the tool call `call` of the running block.
    pub fn answer(&self, call: &str, reply: Result<String, String>) -> Result<(), Refusal> {
        let waiting = self.calls.lock().ok().and_then(|mut c| c.remove(call));
        match waiting {
            Some(tx) => {
                // The block may have ended meanwhile; the answer then goes nowhere.
                let _ = tx.send(reply);
                Ok(())
            }
            None => Err(Refusal::new(
                ApiErrorCode::NotFound,
                format!(
                    "session `{}` has no tool call `{call}` waiting (answered already, or its block ended)",
                    self.made.id
                ),
            )),
        }
    }

    /// The right to run one block now, cancelled by `cancel`; refused while another runs.
    pub fn claim(self: &Arc<Self>, cancel: CancellationToken) -> Result<Claim, Refusal> {
        let Ok(mut running) = self.running.lock() else {
            return Err(Refusal::new(ApiErrorCode::Internal, "a lock was poisoned"));
        };
        if running.is_some() {
            let id = &self.made.id;
            return Err(Refusal::new(
                ApiErrorCode::Conflict,
                format!(
                    "a block runs in session `{id}` now; wait for its result or cancel it (POST /v1/sessions/{id}/cancel)"
                ),
            ));
        }
        *running = Some(cancel);
        Ok(Claim {
            opened: self.clone(),
        })
    }

    /// The right to run one block, once the block that runs now (if any) has ended.
    pub async fn claim_in_turn(
        self: &Arc<Self>,
        cancel: CancellationToken,
    ) -> Result<Claim, Refusal> {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the check, so an end between the two is not missed.
            freed.as_mut().enable();
            if self.closed.load(Ordering::SeqCst) {
                return Err(self.made.owner.unknown(&self.made.id));
            }
            match self.claim(cancel.clone()) {
                Ok(claim) => return Ok(claim),
                Err(refused) if refused.code != ApiErrorCode::Conflict => return Err(refused),
                Err(_) => {}
            }
            tokio::select! {
                () = &mut freed => {}
                () = cancel.cancelled() => {
                    return Err(Refusal::new(ApiErrorCode::Conflict, "cancelled while another block ran"));
                }
            }
        }
    }
}

/// The right to run one block in an [`Opened`]; dropping it frees the sandbox for the next.
pub struct Claim {
    opened: Arc<Opened>,
}

impl Claim {
    /// The sandbox it runs in.
    pub fn opened(&self) -> &Arc<Opened> {
        &self.opened
    }

    /// The executor's session (a paused one resumed first), `None` when the sandbox was
    /// closed meanwhile.
    pub async fn session(
        &self,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<Box<dyn Session>>>, Refusal> {
        self.opened.blocks.fetch_add(1, Ordering::Relaxed);
        self.opened.touch();
        self.opened.unpausable.store(false, Ordering::Relaxed);
        let mut guard = self.opened.session.lock().await;
        self.opened.resume_into(&mut guard).await?;
        Ok(guard)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Ok(mut running) = self.opened.running.lock() {
            *running = None;
        }
        if let Ok(mut calls) = self.opened.calls.lock() {
            calls.clear();
        }
        self.opened.touch();
        self.opened.freed.notify_waiters();
    }
}
