//! The supervisor: a task's life on the daemon. It is admitted (`admission`), queued FIFO
//! for one of `max_concurrent` slots, planned (`plan`) and run, with every event stored
//! through the writer before it is sent; it is cancelled, resumed after a restart, and
//! stopped cleanly on shutdown.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_executor::{CancellationToken, Executor, Registry};
use tandem_protocol::team::TeamSpec;
use tandem_protocol::{ErrorInfo, Event, EventMsg, Message, StopReason, TaskSpec, Usage};
use tokio::sync::{Semaphore, broadcast};
use tokio_util::task::TaskTracker;

use crate::admission::Admission;
pub use crate::error::TaskError;
use crate::error::{Conflict, Unavailable};
use crate::files::Files;
use crate::metrics::Metrics;
use crate::plan::{Planner, PlannerConfig, Start, TaskDefaults, waits_for_approval};
use crate::policy::Policy;
use crate::store::{Claimed, Notice, StoreError, TaskRecord, TaskState, TaskStore};
use crate::writer::{Leases, Outlet, Write, Writes, now_ms, write_events};

/// What the supervisor needs, resolved once by the binary.
pub struct SupervisorConfig {
    /// What tasks are planned with: model, executors, defaults and policies.
    pub planner: PlannerConfig,
    /// Most tasks running at once; the rest wait in FIFO order.
    pub max_concurrent: usize,
    /// Most sandbox sessions open at once, overall and per executor: every road that opens
    /// one (tasks, teams, MCP) takes its permits from here.
    pub sessions: tandem_executor::BudgetConfig,
    /// Tasks' files: uploads, workspaces and their retention.
    pub files: Arc<Files>,
    /// This daemon's name in the store: the owner of the leases it holds. Stable across its
    /// restarts on one state dir, so that a restart takes its own tasks back at once.
    pub daemon: String,
    /// How long a lease lasts unless renewed (it is renewed every third of it): how long the
    /// tasks of a daemon that died wait before another daemon resumes them.
    pub lease: Duration,
}

/// Runs tasks; one per daemon.
pub struct Supervisor {
    store: Arc<dyn TaskStore>,
    planner: Planner,
    admission: Admission,
    store_calls: Arc<Semaphore>,
    root: CancellationToken,
    tracker: TaskTracker,
    /// The tasks this daemon runs, and what cancels each.
    held: Arc<Mutex<HashMap<String, Running>>>,
    /// Their lease epochs, which their writes carry.
    leases: Leases,
    /// Tasks whose lease another daemon took: they run nothing more here.
    lost: Arc<Mutex<HashSet<String>>>,
    /// Rung when there may be a task to claim.
    wake: Arc<tokio::sync::Notify>,
    /// Whether the store is unreachable now (the writer is retrying).
    store_down: Arc<AtomicBool>,
    daemon: String,
    lease: Duration,
    /// The daemon's runtime: notices arrive on the store's threads, and are acted on here.
    runtime: tokio::runtime::Handle,
    live: broadcast::Sender<Arc<(String, Event)>>,
    writer: Writes,
    stopping: AtomicBool,
    files: Arc<Files>,
    /// Rung when a task ends, so the retention looks at once (the space cap).
    finished: tokio::sync::Notify,
    /// Cancelled when shutdown begins: the retention stops, rather than hold up the grace
    /// period that running tasks have.
    closing: CancellationToken,
    /// Counters and histograms for `/metrics`.
    pub metrics: Metrics,
    /// Who waits for which approval, and deciding them.
    pub(crate) approvals: Arc<crate::approvals::Approvals>,
}

impl Supervisor {
    /// A supervisor over `store`; call [`Supervisor::recover`] before serving.
    pub fn new(store: Arc<dyn TaskStore>, config: SupervisorConfig) -> Arc<Self> {
        let mut planner = Planner::new(config.planner);
        // The one place sessions are handed out: every executor a task, a team or MCP can
        // reach comes from this registry, so each of their sessions holds a permit.
        let executors = planner.executors_mut();
        *executors =
            std::mem::take(executors).with_budget(tandem_executor::Budget::new(&config.sessions));
        let (live, _) = broadcast::channel(4096);
        let (queue, writes) = std::sync::mpsc::channel();
        let leases = Leases::default();
        let store_down: Arc<AtomicBool> = Arc::default();
        let backlog: Arc<crate::writer::Backlog> = Arc::default();
        let writer = Writes::new(queue, leases.clone(), backlog.clone(), store_down.clone());
        let held: Arc<Mutex<HashMap<String, Running>>> = Arc::default();
        let lost: Arc<Mutex<HashSet<String>>> = Arc::default();
        let outlet = Outlet {
            live: live.clone(),
            fenced: Box::new({
                let (held, leases, lost) = (held.clone(), leases.clone(), lost.clone());
                move |ids: &[(String, u64)]| {
                    lose(&held, &leases, &lost, ids);
                }
            }),
            down: store_down.clone(),
            backlog,
        };
        let writer_store = store.clone();
        std::thread::Builder::new()
            .name("tandem-store-writer".to_owned())
            .spawn(move || write_events(writer_store.as_ref(), &writes, &outlet))
            .ok();
        let admission = Admission::new(config.max_concurrent, config.sessions.wait);
        Arc::new(Self {
            approvals: Arc::new(crate::approvals::Approvals::new(
                store.clone(),
                writer.clone(),
                live.clone(),
                admission.slots(),
            )),
            store,
            writer,
            admission,
            store_calls: Arc::new(Semaphore::new(STORE_CALLS)),
            planner,
            root: CancellationToken::new(),
            tracker: TaskTracker::new(),
            held,
            leases,
            lost,
            wake: Arc::new(tokio::sync::Notify::new()),
            store_down,
            daemon: config.daemon,
            lease: config.lease,
            runtime: tokio::runtime::Handle::current(),
            live,
            stopping: AtomicBool::new(false),
            files: config.files,
            finished: tokio::sync::Notify::new(),
            closing: CancellationToken::new(),
            metrics: Metrics::default(),
        })
    }

    /// Runs `f` (store work) on the blocking pool, at most `STORE_CALLS` (2) at once: every
    /// store call waits on one connection, so more threads would only queue on its lock, and
    /// a burst of requests would otherwise grow the blocking pool by a thread each.
    pub async fn off_thread<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Arc<Supervisor>) -> T + Send + 'static,
    ) -> Result<T, tokio::task::JoinError> {
        let permit = self.store_calls.clone().acquire_owned().await;
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            f(&this)
        })
        .await
    }

    /// The store, for reads.
    pub fn store(&self) -> &dyn TaskStore {
        self.store.as_ref()
    }

    /// Tasks' files.
    pub fn files(&self) -> &Arc<Files> {
        &self.files
    }

    /// The executors tasks can use.
    pub fn executors(&self) -> &Registry {
        &self.planner.config().executors
    }

    /// What a task that leaves a setting out gets.
    pub fn defaults(&self) -> &TaskDefaults {
        &self.planner.config().defaults
    }

    /// What API clients may ask for.
    pub fn policy(&self) -> &Policy {
        &self.planner.config().policy
    }

    /// Live events of every task, after they are stored.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<(String, Event)>> {
        self.live.subscribe()
    }

    /// This daemon's name on the store, and how many tasks it runs now.
    pub fn running_here(&self) -> (&str, usize) {
        (&self.daemon, self.held.lock().map_or(0, |h| h.len()))
    }

    /// Whether the daemon is stopping.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// At start-up: tasks the last daemon left running become interrupted (resumable; in a
    /// shared store its leases end instead and the tasks resume), and a task that was waiting
    /// for an approval goes back to waiting for it (it costs nothing while it waits). Then
    /// the daemon starts claiming queued tasks, renewing its leases, and hearing what other
    /// daemons on the store do. Returns how many tasks were interrupted and stay so.
    pub fn recover(self: &Arc<Self>) -> Result<usize, TaskError> {
        self.store.interrupt_running(&self.daemon)?;
        let mut interrupted = 0;
        for task in self.store.list(Some(TaskState::Interrupted))? {
            if !waits_for_approval(&self.store.events_after(&task.id, 0)?) {
                interrupted += 1;
            } else if let Err(e) = self.resume(&task.id) {
                // It stays interrupted, for `tandem resume` to try again.
                tracing::warn!(task = %task.id, error = %e, "a task waiting for approval could not wait again");
                interrupted += 1;
            }
        }
        let this = Arc::downgrade(self);
        self.store.notices(
            &self.daemon,
            Box::new(move |notice| {
                if let Some(sup) = this.upgrade() {
                    sup.heard(notice);
                }
            }),
        )?;
        let (claims, renewals) = (self.clone(), self.clone());
        // Not tracked: shutdown waits for the tasks, which need their leases renewed until
        // they end; it stops both loops once they have.
        tokio::spawn(async move { claims.claim_loop().await });
        tokio::spawn(async move { renewals.renew_loop().await });
        Ok(interrupted)
    }

    /// Claims queued tasks while there are free slots, until shutdown: woken by a submit
    /// here or a notice from another daemon, and looking anyway every second (a lease that
    /// lapsed tells no one).
    async fn claim_loop(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let Some(permit) = self.admission.task_slot(&self.closing).await else {
                return;
            };
            let (daemon, lease) = (self.daemon.clone(), self.lease);
            let running: Vec<String> = self
                .held
                .lock()
                .map(|h| h.keys().cloned().collect())
                .unwrap_or_default();
            // Not through `off_thread`: claims and renewals must not queue behind the API's
            // reads, or a busy daemon's leases would lapse.
            let store = self.store.clone();
            let claimed = tokio::task::spawn_blocking(move || {
                store.claim(&daemon, lease.as_millis() as u64, now_ms(), &running)
            })
            .await;
            let pause = match claimed {
                Ok(Ok(Some(task))) if self.closing.is_cancelled() => {
                    // Claimed as shutdown began: back to the queue, for any daemon.
                    let (store, id) = (self.store.clone(), task.record.id.clone());
                    let _ = tokio::task::spawn_blocking(move || {
                        store.transition(&id, TaskState::Running, TaskState::Queued, now_ms())
                    })
                    .await;
                    return;
                }
                Ok(Ok(Some(task))) => {
                    backoff = Duration::from_millis(100);
                    self.start(task, permit);
                    continue;
                }
                Ok(Ok(None)) => CLAIM_POLL,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "cannot claim a task");
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    backoff
                }
                Err(_) => backoff,
            };
            drop(permit);
            tokio::select! {
                () = self.closing.cancelled() => return,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Renews the leases of the tasks running here every third of a lease, until shutdown;
    /// a task whose lease was taken stops here, and one someone asked to cancel is cancelled.
    async fn renew_loop(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.root.cancelled() => return,
                () = tokio::time::sleep(self.lease / 3) => {}
            }
            let held: Vec<(String, u64)> = self
                .leases
                .lock()
                .map(|l| l.iter().map(|(id, e)| (id.clone(), *e)).collect())
                .unwrap_or_default();
            if held.is_empty() {
                continue;
            }
            let (daemon, lease, asked) = (self.daemon.clone(), self.lease, held.clone());
            let store = self.store.clone();
            let renewed = tokio::task::spawn_blocking(move || {
                store.renew(&daemon, &held, lease.as_millis() as u64, now_ms())
            })
            .await;
            match renewed {
                Ok(Ok(renewed)) => {
                    let lost: Vec<(String, u64)> = asked
                        .into_iter()
                        .filter(|(id, _)| renewed.lost.contains(id))
                        .collect();
                    // A task that ended meanwhile is no longer leased: `lose` passes it by.
                    if lose(&self.held, &self.leases, &self.lost, &lost) {
                        tracing::warn!(tasks = ?lost, "leases lost to another daemon; those tasks stop here");
                    }
                    for id in renewed.cancel {
                        self.cancel_here(&id);
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot renew the leases of running tasks")
                }
                Err(_) => {}
            }
        }
    }

    /// Acts on what another daemon did.
    fn heard(self: &Arc<Self>, notice: Notice) {
        match notice {
            Notice::Queued | Notice::Reconnected => self.wake.notify_one(),
            Notice::Cancel(id) => {
                self.cancel_here(&id);
            }
            Notice::Events(id, first) => {
                let mine = self.held.lock().is_ok_and(|h| h.contains_key(&id));
                // Read only when someone here follows it, or it is this daemon's (an
                // approval decided on another daemon).
                if !mine && self.live.receiver_count() == 0 {
                    return;
                }
                let this = self.clone();
                self.runtime.spawn(async move {
                    let read = this
                        .off_thread(move |sup| {
                            sup.store
                                .events_after(&id, first.saturating_sub(1))
                                .map(|e| (id, e))
                        })
                        .await;
                    if let Ok(Ok((id, events))) = read {
                        for e in events {
                            if mine {
                                this.approvals.heard(&id, &e);
                            }
                            let _ = this.live.send(Arc::new((id.clone(), e)));
                        }
                    }
                });
            }
        }
    }

    /// Cancels task `id` if it runs here; whether it did.
    fn cancel_here(&self, id: &str) -> bool {
        match self
            .held
            .lock()
            .ok()
            .and_then(|h| h.get(id).map(|r| r.token.clone()))
        {
            Some(token) => {
                token.cancel();
                true
            }
            None => false,
        }
    }

    /// A slot for an execution that is not a task (an MCP `execute_code` call).
    pub(crate) async fn execution_slot(
        &self,
        cancel: &CancellationToken,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, TaskError> {
        self.admission.execution_slot(cancel).await
    }

    /// Executor `name`, when this daemon has it and its policy offers it.
    pub(crate) fn offered(&self, name: &str) -> Result<Arc<dyn Executor>, TaskError> {
        self.planner.offered(name)
    }

    /// The operator's approval policy.
    pub fn approval(&self) -> &tandem_protocol::ApprovalPolicy {
        &self.planner.config().approval
    }

    /// Checks a team within the operator's bounds.
    pub fn check_team_spec(
        &self,
        team: &TeamSpec,
    ) -> Result<tandem_agent::team::Node, tandem_agent::team::TeamErrors> {
        self.planner.check_team_spec(team)
    }

    /// Validates and queues a task; it is committed to the store when this returns.
    pub async fn submit(self: &Arc<Self>, spec: TaskSpec) -> Result<TaskRecord, TaskError> {
        if self.stopping() {
            return Err(TaskError::ShuttingDown);
        }
        if self.store_down.load(Ordering::SeqCst) {
            return Err(Unavailable::Store.into());
        }
        self.admission.admit(&self.planner, &spec).await?;
        let id = uuid::Uuid::now_v7().simple().to_string();
        if let Some(upload) = &spec.files {
            // Before the task is stored, so a stored task always has its files; a link left
            // by a task that then failed to store is removed by the retention.
            let (files, upload, task) = (self.files.clone(), upload.clone(), id.clone());
            tokio::task::spawn_blocking(move || files.claim(&upload, &task))
                .await
                .map_err(|e| crate::files::FilesError::Io {
                    context: "giving the task its files".to_owned(),
                    source: std::io::Error::other(e.to_string()),
                })??;
        }
        let now = now_ms();
        // Through the writer, so concurrent submits share a commit (and its log sync).
        let (created, committed) = tokio::sync::oneshot::channel();
        let create = Write::Create(id.clone(), Box::new(spec.clone()), now, created);
        self.writer.send(create)?;
        // Queued once committed, even if this request is dropped or gives up waiting: a
        // stored task that never runs would be worse than a late one.
        let wake = self.wake.clone();
        let queued = tokio::spawn(async move {
            match committed.await {
                Ok(result) => {
                    result?;
                    wake.notify_one();
                    Ok(())
                }
                Err(_) => Err(StoreError::Writer("has stopped")),
            }
        });
        match tokio::time::timeout(CREATE_TIMEOUT, queued).await {
            Ok(Ok(Err(e))) if e.unreachable() => return Err(Unavailable::Store.into()),
            Ok(Ok(result)) => result?,
            Ok(Err(_)) => return Err(StoreError::Writer("has stopped").into()),
            Err(_) => {
                return Err(StoreError::Writer(
                    "did not commit the task within 30 s (it runs if the commit lands later)",
                )
                .into());
            }
        }
        Ok(TaskRecord::queued(&id, spec, now))
    }

    /// Cancels a queued, running or interrupted task, wherever it runs: one running on
    /// another daemon is told through the store.
    pub fn cancel(&self, id: &str) -> Result<TaskRecord, TaskError> {
        let record = self
            .store
            .get(id)?
            .ok_or_else(|| TaskError::NotFound(id.to_owned()))?;
        match record.state {
            TaskState::Finished => Err(Conflict::Finished {
                id: id.to_owned(),
                reason: record.stop_reason.map_or("unknown", StopReason::as_str),
            }
            .into()),
            // Only if no resume or claim took it first; then it runs, and is cancelled below.
            from @ (TaskState::Interrupted | TaskState::Queued)
                if self.transition(id, from, TaskState::Finished)? =>
            {
                self.record(id, finished(StopReason::Cancelled, record.turns, None));
                self.flush();
                Ok(self.store.get(id)?.unwrap_or(record))
            }
            TaskState::Interrupted
            | TaskState::Queued
            | TaskState::Running
            | TaskState::AwaitingApproval => {
                // Stored first, so that it holds wherever the task runs, or resumes after
                // its daemon died.
                self.store.request_cancel(id)?;
                self.cancel_here(id);
                Ok(record)
            }
        }
    }

    /// Continues an interrupted task from its stored transcript.
    pub fn resume(self: &Arc<Self>, id: &str) -> Result<TaskRecord, TaskError> {
        if self.stopping() {
            return Err(TaskError::ShuttingDown);
        }
        let record = self
            .store
            .get(id)?
            .ok_or_else(|| TaskError::NotFound(id.to_owned()))?;
        let conflict = |state: TaskState| {
            TaskError::from(Conflict::NotInterrupted {
                id: id.to_owned(),
                state: state.as_str(),
            })
        };
        if record.state != TaskState::Interrupted {
            return Err(conflict(record.state));
        }
        // Two resumes can both pass the check above; only the one whose change finds the
        // task still interrupted queues it.
        if !self.transition(id, TaskState::Interrupted, TaskState::Queued)? {
            return Err(conflict(TaskState::Queued));
        }
        self.wake.notify_one();
        Ok(TaskRecord {
            state: TaskState::Queued,
            ..record
        })
    }

    /// The workspace of task `id` and the files it was given; a task that resumes finds
    /// them placed already.
    fn task_files(
        &self,
        id: &str,
        resuming: bool,
    ) -> Result<(std::path::PathBuf, Option<crate::plan::Inputs>), crate::files::FilesError> {
        let workdir = self.files.workspace(id)?;
        let inputs = self
            .files
            .inputs(id)?
            .map(|(archive, listing)| crate::plan::Inputs {
                archive: (!resuming).then_some(archive),
                listing,
            });
        Ok((workdir, inputs))
    }

    /// Removes tasks' files as the retention says, now and then until shutdown.
    pub fn keep_files_tidy(self: &Arc<Self>) {
        let (this, stop) = (self.clone(), self.closing.clone());
        self.tracker.spawn(async move {
            let every = this.files.sweep_every();
            loop {
                let swept = this
                    .off_thread(|sup| sup.files.sweep(sup.store.as_ref()))
                    .await;
                if let Ok(removed) = swept
                    && !removed.is_empty()
                {
                    tracing::debug!(count = removed.len(), "retention removed tasks' files");
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                    () = this.finished.notified() => {}
                }
            }
        });
    }

    /// The conversation so far, rebuilt from the task's stored `events`.
    pub fn transcript(&self, record: &TaskRecord, events: &[Event]) -> Vec<Message> {
        self.planner.transcript(&record.spec, events)
    }

    /// Stops: no new work; running tasks get `grace` to finish, then are cancelled and
    /// marked interrupted (queued ones stay queued for the next start); every sandbox is
    /// closed before this returns.
    pub async fn shutdown(self: &Arc<Self>, grace: Duration) {
        self.stopping.store(true, Ordering::SeqCst);
        self.closing.cancel();
        self.tracker.close();
        // A task waiting for a person would only hold the grace period up: it is interrupted
        // now, and the next start has it wait again where it was.
        for id in self.approvals.waiting() {
            self.cancel_here(&id);
        }
        let running = self.held.lock().map_or(0, |a| a.len());
        if running > 0 {
            tracing::info!(tasks = running, ?grace, "waiting for running tasks");
        }
        if tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::info!("grace period over; interrupting the remaining tasks");
            self.root.cancel();
            // Cancellation reaches sandboxes at once; closing them is bounded by the executors.
            if tokio::time::timeout(Duration::from_secs(30), self.tracker.wait())
                .await
                .is_err()
            {
                tracing::warn!("some tasks did not stop within 30 s of being cancelled");
            }
        }
        let _ = self.off_thread(|sup| sup.flush()).await;
        self.root.cancel();
    }

    /// Runs a claimed task in its slot; its writes carry its lease's epoch until it ends.
    fn start(self: &Arc<Self>, task: Claimed, permit: tokio::sync::OwnedSemaphorePermit) {
        let Claimed {
            record,
            epoch,
            events,
            cancel,
        } = task;
        let id = record.id.clone();
        let token = self.root.child_token();
        let in_block = Arc::new(AtomicBool::new(false));
        if let Ok(mut held) = self.held.lock() {
            let running = Running {
                token: token.clone(),
                in_block: in_block.clone(),
            };
            held.insert(id.clone(), running);
        }
        if let Ok(mut leases) = self.leases.lock() {
            leases.insert(id.clone(), epoch);
        }
        if let Ok(mut lost) = self.lost.lock() {
            lost.remove(&id);
        }
        let this = self.clone();
        self.tracker.spawn(async move {
            if cancel {
                // Cancelled while no daemon ran it (queued, or its daemon died).
                this.record(&id, finished(StopReason::Cancelled, record.turns, None));
            } else {
                this.run_one(&id, record.spec, events, token, permit, in_block)
                    .await;
            }
            if let Ok(mut held) = this.held.lock() {
                held.remove(&id);
            }
            if let Ok(mut leases) = this.leases.lock() {
                leases.remove(&id);
            }
            this.finished.notify_one();
            this.approvals.forget(&id);
        });
    }

    /// What a block asks before it runs: that everything the task wrote so far is stored
    /// under its lease, so a daemon that lost the task (paused, cut off) runs no more of it.
    fn guard(self: &Arc<Self>, id: &str) -> tandem_agent::approval::Guard {
        let (this, id) = (Arc::downgrade(self), id.to_owned());
        Arc::new(move || {
            let (this, id) = (this.clone(), id.clone());
            Box::pin(async move {
                let Some(sup) = this.upgrade() else {
                    return false;
                };
                // While the database is away the writer keeps retrying: the block waits for
                // it rather than run before its start is stored.
                // Not through `off_thread`: a wait through an outage must not hold up the
                // API's reads.
                let writer = sup.writer.clone();
                let stored = tokio::task::spawn_blocking(move || writer.barrier_for(GUARD_WAIT))
                    .await
                    .unwrap_or(false);
                stored && !sup.lost.lock().is_ok_and(|l| l.contains(&id))
            })
        })
    }

    async fn run_one(
        self: &Arc<Self>,
        id: &str,
        spec: TaskSpec,
        events: Vec<Event>,
        token: CancellationToken,
        permit: tokio::sync::OwnedSemaphorePermit,
        in_block: Arc<AtomicBool>,
    ) {
        // Shared with the approver, which gives it up while a block waits for a person. This
        // handle keeps the slot for the whole run when there is no approver: dropping the
        // last one gives the slot back.
        let permit = Arc::new(tokio::sync::Mutex::new(Some(permit)));
        let _slot = permit.clone();
        let (workdir, inputs) = match self.task_files(id, !events.is_empty()) {
            Ok(found) => found,
            Err(e) => {
                let info = ErrorInfo {
                    code: tandem_protocol::ErrorCode::Executor,
                    message: e.to_string(),
                };
                self.record(id, finished(StopReason::Error, 0, Some(info)));
                return;
            }
        };
        let start = Start {
            labels: vec![("tandem.task".to_owned(), id.to_owned())],
            events: &events,
            workdir: Some(workdir),
            inputs,
        };
        let mut planned = match self.planner.plan(&spec, start) {
            Ok(planned) => planned,
            Err(info) => {
                self.record(id, finished(StopReason::Error, 0, Some(info)));
                return;
            }
        };
        if let Some(told) = planned.take_told() {
            self.record(id, told);
        }
        let approver: Option<Arc<dyn tandem_agent::Approver>> = planned.gated().then(|| {
            Arc::new(crate::approvals::TaskApprover::new(
                self.approvals.clone(),
                id,
                permit,
                &events,
            )) as _
        });
        let this = self.clone();
        let task_id = id.to_owned();
        let executor_name = planned.executor().to_owned();
        let turn_started = Mutex::new(None::<Instant>);
        let (lost, stop) = (self.lost.clone(), token.clone());
        let sink = Arc::new(move |mut msg: EventMsg| {
            if let EventMsg::Artifact { file, href, .. } = &mut msg {
                *href = Some(file_href(&task_id, file));
            }
            // A task lost to another daemon while a block ran lets the block end (the new
            // holder does not run it again), then stops.
            match &msg {
                EventMsg::CodeBlock { .. } => in_block.store(true, Ordering::SeqCst),
                EventMsg::ExecResult { .. } => {
                    in_block.store(false, Ordering::SeqCst);
                    if lost.lock().is_ok_and(|l| l.contains(&task_id)) {
                        stop.cancel();
                    }
                }
                _ => {}
            }
            match &msg {
                EventMsg::TurnStarted { .. } => {
                    if let Ok(mut t) = turn_started.lock() {
                        *t = Some(Instant::now());
                    }
                }
                EventMsg::AssistantMessage { usage, .. } => {
                    if let Some(started) = turn_started.lock().ok().and_then(|mut t| t.take()) {
                        this.metrics.model_latency(started.elapsed());
                    }
                    if let Some(u) = usage {
                        this.metrics.tokens(*u);
                    }
                }
                EventMsg::ExecResult { result, .. } => {
                    this.metrics.execution(&executor_name, result);
                }
                // A shutdown interrupts the task rather than ending it: it can resume.
                EventMsg::TaskFinished {
                    stop_reason: StopReason::Cancelled,
                    ..
                } if this.stopping() => {
                    // In order with the task's events, like every other write.
                    this.writer.set_state(&task_id, TaskState::Interrupted);
                    return;
                }
                _ => {}
            }
            this.record(&task_id, msg);
        });
        planned
            .run(approver, Some(self.guard(id)), sink, token)
            .await;
    }

    /// Queues an event for the writer, which commits it and only then sends it to live
    /// subscribers. The turn loop never waits on the disk.
    pub(crate) fn record(&self, id: &str, msg: EventMsg) {
        self.writer.record(id, msg);
    }

    /// Moves task `id` from `from` to `to` through the writer, after everything queued before,
    /// only if it is still in `from`; whether it moved.
    fn transition(&self, id: &str, from: TaskState, to: TaskState) -> Result<bool, TaskError> {
        // Queued behind a writer that retries, it would be made after its caller was told it
        // failed.
        if self.store_down.load(Ordering::SeqCst) {
            return Err(Unavailable::Store.into());
        }
        let (moved, answer) = std::sync::mpsc::channel();
        let write = Write::Transition {
            id: id.to_owned(),
            from,
            to,
            at: now_ms(),
            moved,
        };
        let gone = || TaskError::from(Unavailable::Writer);
        self.writer.send(write).map_err(|_| gone())?;
        Ok(answer
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| gone())??)
    }

    /// Waits until every event queued so far is committed.
    pub fn flush(&self) {
        self.writer.flush();
    }
}

/// Store calls from the API running at once on the blocking pool.
const STORE_CALLS: usize = 2;

/// Longest a block waits for its start to be stored (the database away) before it is given
/// up as cancelled.
const GUARD_WAIT: Duration = Duration::from_secs(600);

/// How often a daemon with free slots looks for work no one told it of (a lapsed lease).
const CLAIM_POLL: Duration = Duration::from_secs(1);

/// A task running here.
struct Running {
    /// Cancels it.
    token: CancellationToken,
    /// Whether one of its blocks runs now.
    in_block: Arc<AtomicBool>,
}

/// Marks the tasks of `ids` (each with the epoch its daemon lost) as taken by another daemon
/// and stops them here: at once, or when the block running now ends (the daemon that took
/// the task does not run it again, so it must not be cut short). Either way no further block
/// starts: the guard sees them lost. A task this daemon has claimed again since, under a
/// newer epoch, is left alone. Whether any was running here.
fn lose(
    held: &Mutex<HashMap<String, Running>>,
    leases: &Leases,
    lost: &Mutex<HashSet<String>>,
    ids: &[(String, u64)],
) -> bool {
    let (Ok(held), Ok(leases), Ok(mut lost)) = (held.lock(), leases.lock(), lost.lock()) else {
        return false;
    };
    let mut any = false;
    for (id, epoch) in ids {
        if leases.get(id) != Some(epoch) {
            continue;
        }
        let Some(r) = held.get(id) else {
            continue;
        };
        any = true;
        lost.insert(id.clone());
        if !r.in_block.load(Ordering::SeqCst) {
            r.token.cancel();
        }
    }
    any
}

/// Longest a submit waits for its task to be committed.
const CREATE_TIMEOUT: Duration = Duration::from_secs(30);

fn finished(stop_reason: StopReason, turns: u32, error: Option<ErrorInfo>) -> EventMsg {
    EventMsg::TaskFinished {
        stop_reason,
        turns,
        usage: Usage::default(),
        elapsed_ms: 0,
        error,
        summary: None,
    }
}

/// Where the API serves file `path` of task `task`, its parts percent-encoded.
pub fn file_href(task: &str, path: &str) -> String {
    let mut href = format!("/v1/tasks/{task}/files/");
    for (i, part) in path.split('/').enumerate() {
        if i > 0 {
            href.push('/');
        }
        for b in part.bytes() {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                href.push(b as char);
            } else {
                href.push_str(&format!("%{b:02X}"));
            }
        }
    }
    href
}
