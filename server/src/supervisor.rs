//! The supervisor: a task's life on the daemon. It is admitted (`admission`), queued FIFO
//! for one of `max_concurrent` slots, planned (`plan`) and run, with every event stored
//! through the writer before it is sent; it is cancelled, resumed after a restart, and
//! stopped cleanly on shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tandem_executor::{CancellationToken, Registry};
use tandem_executor_kit::RegistryBudget as _;
use tandem_protocol::team::TeamSpec;
use tandem_protocol::{ErrorInfo, Event, EventMsg, Message, StopReason, TaskSpec, Usage};
use tokio::sync::{Semaphore, broadcast};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::admission::Admission;
pub use crate::error::TaskError;
use crate::error::{Conflict, Unavailable};
use crate::files::Files;
pub use crate::files::file_href;
use crate::metrics::Metrics;
use crate::plan::{Planner, PlannerConfig, Start, TaskDefaults, waits_for_approval};
use crate::policy::Policy;
use crate::running::RunningTasks;
use crate::sink::{TaskSink, Then};
use crate::store::{Claimed, Notice, StoreError, TaskRecord, TaskState, TaskStore};
use crate::writer::{Outlet, Write, Writes, now_ms, write_events};

/// What the supervisor needs, resolved once by the binary.
pub struct SupervisorConfig {
    /// What tasks are planned with: model, executors, defaults and policies.
    pub planner: PlannerConfig,
    /// Most tasks running at once; the rest wait in FIFO order.
    pub max_concurrent: usize,
    /// Most sandbox sessions open at once, overall and per executor: every road that opens
    /// one (tasks, teams, MCP) takes its permits from here.
    pub sessions: tandem_executor_kit::BudgetConfig,
    /// Tasks' files: uploads, workspaces and their retention.
    pub files: Arc<Files>,
    /// This daemon's name in the store: the owner of the leases it holds. Stable across its
    /// restarts on one state dir, so that a restart takes its own tasks back at once.
    pub daemon: String,
    /// How long a lease lasts unless renewed (it is renewed every third of it): how long the
    /// tasks of a daemon that died wait before another daemon resumes them.
    pub lease: Duration,
    /// When idle sessions are paused instead of closed.
    pub pausing: crate::policy::Pausing,
}

/// Runs tasks; one per daemon.
pub struct Supervisor {
    store: Stored,
    planner: Planner,
    admission: Admission,
    life: Life,
    /// The tasks this daemon runs: what cancels each, its lease, whether it was lost.
    held: RunningTasks,
    leasing: Leasing,
    /// Every write to the store, in order; stored events go out live from it.
    writer: Writes,
    files: Arc<Files>,
    pausing: crate::policy::Pausing,
    /// How many sessions `[sessions] without_task` lets stand without a task.
    pub(crate) without_task: Option<usize>,
    /// Counters and histograms for `/metrics`.
    pub metrics: Metrics,
    /// The ports of the tasks' open sandboxes, which the API publishes.
    pub ports: crate::ports::PortBook,
    /// Signs the links that open a sandbox's port without the token, for every listener.
    pub links: Arc<crate::ports::Links>,
    /// Who waits for which approval, and deciding them.
    pub(crate) approvals: Arc<crate::approvals::Approvals>,
}

/// The store, and the calls the API may make of it at once.
struct Stored {
    tasks: Arc<dyn TaskStore>,
    calls: Arc<Semaphore>,
}

/// Where the daemon is in its own life: running, closing, stopping.
struct Life {
    /// Cancels every task (the end of shutdown's grace).
    root: CancellationToken,
    /// The tasks and background work shutdown waits for.
    tracker: TaskTracker,
    /// Set when shutdown begins: no new work.
    stopping: AtomicBool,
    /// Cancelled when shutdown begins: claims and the retention stop, rather than hold up
    /// the grace period that running tasks have.
    closing: CancellationToken,
    /// Rung when a task ends, so the retention looks at once (the space cap).
    finished: tokio::sync::Notify,
}

/// How this daemon takes part in the store's queue.
struct Leasing {
    /// Its name in the store: the owner of its leases.
    daemon: String,
    /// How long a lease lasts unless renewed.
    lease: Duration,
    /// Rung when there may be a task to claim.
    wake: Arc<tokio::sync::Notify>,
    /// The daemon's runtime: notices arrive on the store's threads, and are acted on here.
    runtime: tokio::runtime::Handle,
}

impl Supervisor {
    /// A supervisor over `store`; call [`Supervisor::recover`] before serving.
    pub fn new(store: Arc<dyn TaskStore>, config: SupervisorConfig) -> Arc<Self> {
        let mut planner = Planner::new(config.planner);
        // The one place sessions are handed out: every executor a task, a team or MCP can
        // reach comes from this registry, so each of their sessions holds a permit.
        let executors = planner.executors_mut();
        *executors = std::mem::take(executors)
            .with_budget(tandem_executor_kit::Budget::new(&config.sessions));
        let (live, _) = broadcast::channel(4096);
        let (queue, writes) = std::sync::mpsc::channel();
        let held = RunningTasks::default();
        let store_down: Arc<AtomicBool> = Arc::default();
        let backlog: Arc<crate::writer::Backlog> = Arc::default();
        let writer = Writes::new(
            queue,
            held.clone(),
            backlog.clone(),
            store_down.clone(),
            live.clone(),
        );
        let outlet = Outlet {
            live: live.clone(),
            fenced: Box::new({
                let held = held.clone();
                move |ids: &[(String, u64)]| {
                    held.lose(ids);
                }
            }),
            down: store_down,
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
                live,
                admission.slots(),
            )),
            store: Stored {
                tasks: store,
                calls: Arc::new(Semaphore::new(STORE_CALLS)),
            },
            writer,
            admission,
            planner,
            life: Life {
                root: CancellationToken::new(),
                tracker: TaskTracker::new(),
                stopping: AtomicBool::new(false),
                closing: CancellationToken::new(),
                finished: tokio::sync::Notify::new(),
            },
            held,
            leasing: Leasing {
                daemon: config.daemon,
                lease: config.lease,
                wake: Arc::new(tokio::sync::Notify::new()),
                runtime: tokio::runtime::Handle::current(),
            },
            files: config.files,
            without_task: config.sessions.without_task,
            pausing: config.pausing,
            metrics: Metrics::default(),
            ports: crate::ports::PortBook::default(),
            links: Arc::default(),
        })
    }

    /// Runs `f` (store work) on the blocking pool, at most `STORE_CALLS` (2) at once: every
    /// store call waits on one connection, so more threads would only queue on its lock, and
    /// a burst of requests would otherwise grow the blocking pool by a thread each.
    pub async fn off_thread<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Arc<Supervisor>) -> T + Send + 'static,
    ) -> Result<T, tokio::task::JoinError> {
        let permit = self.store.calls.clone().acquire_owned().await;
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            f(&this)
        })
        .await
    }

    /// The store, for reads.
    pub fn store(&self) -> &dyn TaskStore {
        self.store.tasks.as_ref()
    }

    /// Tasks' files.
    pub fn files(&self) -> &Arc<Files> {
        &self.files
    }

    /// When idle sessions are paused.
    pub fn pausing(&self) -> crate::policy::Pausing {
        self.pausing
    }

    /// The executors tasks can use.
    pub fn executors(&self) -> &Registry {
        &self.planner.config().executors
    }

    /// What tasks are planned with: the model, the embedded one, executors and defaults.
    pub fn planner_config(&self) -> &crate::plan::PlannerConfig {
        self.planner.config()
    }

    /// What the embedded model's engine is doing, when this daemon serves one.
    pub fn engine_stats(&self) -> Option<tandem_protocol::engine::EngineStats> {
        self.planner.config().local_model.as_ref()?.stats()
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
        self.writer.live().subscribe()
    }

    /// This daemon's name on the store, and how many tasks it runs now.
    pub fn running_here(&self) -> (&str, usize) {
        (&self.leasing.daemon, self.held.len())
    }

    /// Whether the daemon is stopping.
    pub fn stopping(&self) -> bool {
        self.life.stopping.load(Ordering::SeqCst)
    }

    /// At start-up: tasks the last daemon left running become interrupted (resumable; in a
    /// shared store its leases end instead and the tasks resume), and a task that was waiting
    /// for an approval goes back to waiting for it (it costs nothing while it waits). Then
    /// the daemon starts claiming queued tasks, renewing its leases, and hearing what other
    /// daemons on the store do. Returns how many tasks were interrupted and stay so.
    pub async fn recover(self: &Arc<Self>) -> Result<usize, TaskError> {
        let (mut interrupted, waiting) = self
            .off_thread(|sup| -> Result<(usize, Vec<String>), StoreError> {
                let store = sup.store.tasks.as_ref();
                store.interrupt_running(&sup.leasing.daemon)?;
                let (mut interrupted, mut waiting) = (0, Vec::new());
                for task in store.list(Some(TaskState::Interrupted))? {
                    if waits_for_approval(&store.events_after(&task.id, 0)?) {
                        waiting.push(task.id);
                    } else {
                        interrupted += 1;
                    }
                }
                Ok((interrupted, waiting))
            })
            .await
            .map_err(|_| TaskError::from(Unavailable::Writer))??;
        for id in waiting {
            if let Err(e) = self.resume(&id).await {
                // It stays interrupted, for `tandem resume` to try again.
                tracing::warn!(task = %id, error = %e, "a task waiting for approval could not wait again");
                interrupted += 1;
            }
        }
        let this = Arc::downgrade(self);
        self.store.tasks.notices(
            &self.leasing.daemon,
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
            let Some(permit) = self.admission.task_slot(&self.life.closing).await else {
                return;
            };
            let (daemon, lease) = (self.leasing.daemon.clone(), self.leasing.lease);
            let running = self.held.ids();
            // Not through `off_thread`: claims and renewals must not queue behind the API's
            // reads, or a busy daemon's leases would lapse.
            let store = self.store.tasks.clone();
            let claimed = tokio::task::spawn_blocking(move || {
                store.claim(&daemon, lease.as_millis() as u64, now_ms(), &running)
            })
            .await;
            let pause = match claimed {
                Ok(Ok(Some(task))) if self.life.closing.is_cancelled() => {
                    // Claimed as shutdown began: back to the queue, for any daemon.
                    let (store, id) = (self.store.tasks.clone(), task.record.id.clone());
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
                () = self.life.closing.cancelled() => return,
                () = self.leasing.wake.notified() => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Renews the leases of the tasks running here every third of a lease, until shutdown;
    /// a task whose lease was taken stops here, and one someone asked to cancel is cancelled.
    async fn renew_loop(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.life.root.cancelled() => return,
                () = tokio::time::sleep(self.leasing.lease / 3) => {}
            }
            let held = self.held.leases();
            if held.is_empty() {
                continue;
            }
            let (daemon, lease, asked) = (
                self.leasing.daemon.clone(),
                self.leasing.lease,
                held.clone(),
            );
            let store = self.store.tasks.clone();
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
                    if self.held.lose(&lost) {
                        tracing::warn!(tasks = ?lost, "leases lost to another daemon; those tasks stop here");
                    }
                    for id in renewed.cancel {
                        self.held.cancel(&id);
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
            Notice::Queued | Notice::Reconnected => self.leasing.wake.notify_one(),
            Notice::Cancel(id) => {
                self.held.cancel(&id);
            }
            Notice::Events(id, first) => {
                let mine = self.held.holds(&id);
                // Read only when someone here follows it, or it is this daemon's (an
                // approval decided on another daemon).
                if !mine && self.writer.live().receiver_count() == 0 {
                    return;
                }
                let this = self.clone();
                self.leasing.runtime.spawn(async move {
                    let read = this
                        .off_thread(move |sup| {
                            sup.store
                                .tasks
                                .events_after(&id, first.saturating_sub(1))
                                .map(|e| (id, e))
                        })
                        .await;
                    if let Ok(Ok((id, events))) = read {
                        for e in events {
                            if mine {
                                this.approvals.heard(&id, &e);
                            }
                            let _ = this.writer.live().send(Arc::new((id.clone(), e)));
                        }
                    }
                });
            }
        }
    }

    /// A slot for an execution that is not a task (an MCP `execute_code` call).
    pub(crate) async fn execution_slot(
        &self,
        cancel: &CancellationToken,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, TaskError> {
        self.admission.execution_slot(cancel).await
    }

    /// What checks tasks and blocks against the operator's policy.
    pub(crate) fn planner(&self) -> &crate::plan::Planner {
        &self.planner
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
    pub async fn submit(self: &Arc<Self>, mut spec: TaskSpec) -> Result<TaskRecord, TaskError> {
        // Every road's traceparent is kept only if it is one, whoever set it.
        spec.traceparent = spec
            .traceparent
            .as_deref()
            .and_then(tandem_agent::trace::caller);
        if self.stopping() {
            return Err(TaskError::ShuttingDown);
        }
        if self.writer.store_down() {
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
        let wake = self.leasing.wake.clone();
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
    pub async fn cancel(self: &Arc<Self>, id: &str) -> Result<TaskRecord, TaskError> {
        let record = self.stored(id).await?;
        match record.state {
            TaskState::Finished => Err(Conflict::Finished {
                id: id.to_owned(),
                reason: record.stop_reason.map_or("unknown", StopReason::as_str),
            }
            .into()),
            // Only if no resume or claim took it first; then it runs, and is cancelled below.
            from @ (TaskState::Interrupted | TaskState::Queued)
                if self.transition(id, from, TaskState::Finished).await? =>
            {
                self.record(id, finished(StopReason::Cancelled, record.turns, None));
                let id = id.to_owned();
                let after = self
                    .off_thread(move |sup| {
                        sup.flush();
                        sup.store.tasks.get(&id)
                    })
                    .await
                    .map_err(|_| TaskError::from(Unavailable::Writer))??;
                Ok(after.unwrap_or(record))
            }
            TaskState::Interrupted
            | TaskState::Queued
            | TaskState::Running
            | TaskState::AwaitingApproval => {
                // Stored first, so that it holds wherever the task runs, or resumes after
                // its daemon died.
                let asked = id.to_owned();
                self.off_thread(move |sup| sup.store.tasks.request_cancel(&asked))
                    .await
                    .map_err(|_| TaskError::from(Unavailable::Writer))??;
                self.held.cancel(id);
                Ok(record)
            }
        }
    }

    /// Continues an interrupted task from its stored transcript.
    pub async fn resume(self: &Arc<Self>, id: &str) -> Result<TaskRecord, TaskError> {
        if self.stopping() {
            return Err(TaskError::ShuttingDown);
        }
        let record = self.stored(id).await?;
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
        if !self
            .transition(id, TaskState::Interrupted, TaskState::Queued)
            .await?
        {
            return Err(conflict(TaskState::Queued));
        }
        self.leasing.wake.notify_one();
        Ok(TaskRecord {
            state: TaskState::Queued,
            ..record
        })
    }

    /// Task `id` as stored, read off the runtime's workers.
    async fn stored(self: &Arc<Self>, id: &str) -> Result<TaskRecord, TaskError> {
        let asked = id.to_owned();
        self.off_thread(move |sup| sup.store.tasks.get(&asked))
            .await
            .map_err(|_| TaskError::from(Unavailable::Writer))??
            .ok_or_else(|| TaskError::NotFound(id.to_owned()))
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
        let (this, stop) = (self.clone(), self.life.closing.clone());
        self.life.tracker.spawn(async move {
            let every = this.files.sweep_every();
            loop {
                let swept = this
                    .off_thread(|sup| sup.files.sweep(sup.store.tasks.as_ref()))
                    .await;
                if let Ok(removed) = swept
                    && !removed.is_empty()
                {
                    tracing::debug!(count = removed.len(), "retention removed tasks' files");
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                    () = this.life.finished.notified() => {}
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
        self.life.stopping.store(true, Ordering::SeqCst);
        self.life.closing.cancel();
        self.life.tracker.close();
        // A task waiting for a person would only hold the grace period up: it is interrupted
        // now, and the next start has it wait again where it was.
        for id in self.approvals.waiting() {
            self.held.cancel(&id);
        }
        let running = self.held.len();
        if running > 0 {
            tracing::info!(tasks = running, ?grace, "waiting for running tasks");
        }
        if tokio::time::timeout(grace, self.life.tracker.wait())
            .await
            .is_err()
        {
            tracing::info!("grace period over; interrupting the remaining tasks");
            self.life.root.cancel();
            // Cancellation reaches sandboxes at once; closing them is bounded by the executors.
            if tokio::time::timeout(Duration::from_secs(30), self.life.tracker.wait())
                .await
                .is_err()
            {
                tracing::warn!("some tasks did not stop within 30 s of being cancelled");
            }
        }
        let _ = self.off_thread(|sup| sup.flush()).await;
        self.life.root.cancel();
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
        let token = self.life.root.child_token();
        self.held.take(&id, epoch, token.clone());
        let this = self.clone();
        self.life.tracker.spawn(async move {
            if cancel {
                // Cancelled while no daemon ran it (queued, or its daemon died).
                this.record(&id, finished(StopReason::Cancelled, record.turns, None));
            } else {
                let span = task_span(&id, &record, &events);
                this.run_one(&id, record.spec, events, token, permit)
                    .instrument(span)
                    .await;
            }
            this.held.release(&id);
            this.life.finished.notify_one();
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
                stored && !sup.held.is_lost(&id)
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
        let rules = TaskSink::new(id, planned.executor(), planned.model(), self.held.clone());
        let sink = Arc::new(move |msg: EventMsg| {
            match rules.take(msg, &this.metrics, this.stopping()) {
                Then::Record(msg) => this.record(&task_id, msg),
                // In order with the task's events, like every other write.
                Then::Interrupt => this.writer.set_state(&task_id, TaskState::Interrupted),
            }
        });
        planned
            .publishing(&self.ports, id)
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
    async fn transition(
        &self,
        id: &str,
        from: TaskState,
        to: TaskState,
    ) -> Result<bool, TaskError> {
        // Queued behind a writer that retries, it would be made after its caller was told it
        // failed.
        if self.writer.store_down() {
            return Err(Unavailable::Store.into());
        }
        let (moved, answer) = tokio::sync::oneshot::channel();
        let write = Write::Transition {
            id: id.to_owned(),
            from,
            to,
            at: now_ms(),
            moved,
        };
        let gone = || TaskError::from(Unavailable::Writer);
        self.writer.send(write).map_err(|_| gone())?;
        match tokio::time::timeout(TRANSITION_WAIT, answer).await {
            Ok(Ok(moved)) => Ok(moved?),
            _ => Err(gone()),
        }
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

/// Longest a cancel or resume waits for the writer to say whether the task moved.
const TRANSITION_WAIT: Duration = Duration::from_secs(10);

/// Longest a submit waits for its task to be committed.
const CREATE_TIMEOUT: Duration = Duration::from_secs(30);

/// A run's span: a child of the task's first run when it is resumed (and linked to it), so
/// that every run of a task is in one trace; else of the caller's span, when it sent one.
/// A first run also shows the time it waited in the queue.
fn task_span(id: &str, record: &TaskRecord, events: &[Event]) -> tracing::Span {
    use tandem_agent::trace;
    let agent = if record.spec.team.is_some() {
        "team"
    } else {
        "tandem"
    };
    let span = trace::task(id, agent);
    if span.is_disabled() {
        return span;
    }
    let first = events.iter().find_map(|e| match &e.msg {
        EventMsg::TaskStarted {
            trace: Some(first), ..
        } => Some(first.as_str()),
        _ => None,
    });
    match (first, record.spec.traceparent.as_deref()) {
        (Some(first), _) => {
            trace::set_parent(&span, first);
            trace::link(&span, first);
        }
        (None, Some(caller)) => {
            trace::set_parent(&span, caller);
        }
        (None, None) => {}
    }
    if events.is_empty() {
        let asked = std::time::UNIX_EPOCH + Duration::from_millis(record.created_ms);
        trace::queued(&span, asked);
    }
    span
}

fn finished(stop_reason: StopReason, turns: u32, error: Option<ErrorInfo>) -> EventMsg {
    EventMsg::finished(stop_reason, turns, Usage::default(), 0, error)
}
