//! The supervisor: queues tasks FIFO, runs at most `max_concurrent` at once, stores every
//! event before it is sent, and stops cleanly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_agent::team::{Node, TaskLabel, Team, executor_slot, run_team_task};
use tandem_agent::{
    ChatModel, EventSink, ModelConfig, TaskSettings, allowed_languages, render_system_prompt,
    run_task,
};
use tandem_executor::{CancellationToken, Executor, Limits, Registry, SessionSpec};
use tandem_protocol::team::{Kind, TeamSpec};
use tandem_protocol::{
    ErrorCode, ErrorInfo, Event, EventMsg, Message, Role, StopReason, TaskSpec, Usage,
};
use tokio::sync::{Semaphore, broadcast};
use tokio_util::task::TaskTracker;

pub use crate::error::TaskError;
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::store::{StoreError, TaskRecord, TaskState, TaskStore};
use crate::writer::{Write, Writes, now_ms, write_events};

/// Defaults for what a [`TaskSpec`] leaves out.
#[derive(Clone, Debug)]
pub struct TaskDefaults {
    /// Executor name.
    pub executor: String,
    /// Most assistant turns.
    pub max_turns: u32,
    /// Wall-clock limit per task.
    pub timeout: Option<Duration>,
    /// Termination string.
    pub termination: String,
    /// System prompt.
    pub system_prompt: String,
    /// Per-block limits.
    pub limits: Limits,
}

impl Default for TaskDefaults {
    fn default() -> Self {
        Self {
            executor: "local".to_owned(),
            max_turns: tandem_agent::DEFAULT_MAX_TURNS,
            timeout: None,
            termination: tandem_agent::DEFAULT_TERMINATION.to_owned(),
            system_prompt: tandem_agent::DEFAULT_SYSTEM_PROMPT.to_owned(),
            limits: Limits::default(),
        }
    }
}

/// What the supervisor needs, resolved once by the binary.
pub struct SupervisorConfig {
    /// The model server and its settings; a task may override the URL and model.
    pub model: ModelConfig,
    /// The executors tasks can name.
    pub executors: Registry,
    /// Defaults for task settings.
    pub defaults: TaskDefaults,
    /// Most tasks running at once; the rest wait in FIFO order.
    pub max_concurrent: usize,
    /// What API clients may ask for.
    pub policy: Policy,
    /// The embedded model, loaded once, for every task that names no model server.
    pub local_model: Option<Arc<dyn tandem_agent::chat::LocalModel>>,
    /// The operator's approval policy; a task's can only tighten it.
    pub approval: tandem_protocol::ApprovalPolicy,
    /// Most sandbox sessions open at once, overall and per executor: every road that opens
    /// one (tasks, teams, MCP) takes its permits from here.
    pub sessions: tandem_executor::BudgetConfig,
    /// How large a team may be.
    pub teams: tandem_protocol::team::TeamBounds,
}

/// Runs tasks; one per daemon.
pub struct Supervisor {
    store: Arc<dyn TaskStore>,
    config: SupervisorConfig,
    slots: Arc<Semaphore>,
    store_calls: Arc<Semaphore>,
    root: CancellationToken,
    tracker: TaskTracker,
    active: Mutex<HashMap<String, CancellationToken>>,
    live: broadcast::Sender<Arc<(String, Event)>>,
    writer: Writes,
    stopping: AtomicBool,
    models: Mutex<HashMap<(String, String), ChatModel>>,
    /// Each executor's last health answer and when it came.
    health: Mutex<HashMap<String, (Instant, Health)>>,
    /// Counters and histograms for `/metrics`.
    pub metrics: Metrics,
    /// Who waits for which approval, and deciding them.
    pub(crate) approvals: Arc<crate::approvals::Approvals>,
}

impl Supervisor {
    /// A supervisor over `store`; call [`Supervisor::recover`] before serving.
    pub fn new(store: Arc<dyn TaskStore>, mut config: SupervisorConfig) -> Arc<Self> {
        // The one place sessions are handed out: every executor a task, a team or MCP can
        // reach comes from this registry, so each of their sessions holds a permit.
        config.executors = std::mem::take(&mut config.executors)
            .with_budget(tandem_executor::Budget::new(&config.sessions));
        let (live, _) = broadcast::channel(4096);
        let (queue, writes) = std::sync::mpsc::channel();
        let writer = Writes::new(queue);
        let (writer_store, writer_live) = (store.clone(), live.clone());
        std::thread::Builder::new()
            .name("tandem-store-writer".to_owned())
            .spawn(move || write_events(writer_store.as_ref(), &writes, &writer_live))
            .ok();
        let slots = Arc::new(Semaphore::new(config.max_concurrent.max(1)));
        Arc::new(Self {
            approvals: Arc::new(crate::approvals::Approvals::new(
                store.clone(),
                writer.clone(),
                slots.clone(),
            )),
            store,
            writer,
            slots,
            store_calls: Arc::new(Semaphore::new(STORE_CALLS)),
            config,
            root: CancellationToken::new(),
            tracker: TaskTracker::new(),
            active: Mutex::new(HashMap::new()),
            live,
            stopping: AtomicBool::new(false),
            models: Mutex::new(HashMap::new()),
            health: Mutex::new(HashMap::new()),
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

    /// The executors tasks can use.
    pub fn executors(&self) -> &Registry {
        &self.config.executors
    }

    /// An executor's health, checked at most every [`HEALTH_TTL`] (a submit must not wait
    /// on the engine each time).
    async fn health(&self, name: &str) -> Health {
        let cached = self.health.lock().ok().and_then(|h| {
            h.get(name)
                .filter(|(at, _)| at.elapsed() < HEALTH_TTL)
                .map(|(_, health)| health.clone())
        });
        if let Some(health) = cached {
            return health;
        }
        let Ok(executor) = self.config.executors.get(name) else {
            return Ok(());
        };
        let health = executor.health().await;
        if let Ok(mut h) = self.health.lock() {
            h.insert(name.to_owned(), (Instant::now(), health.clone()));
        }
        health
    }

    /// What a task that leaves a setting out gets.
    pub fn defaults(&self) -> &TaskDefaults {
        &self.config.defaults
    }

    /// What API clients may ask for.
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }

    /// Live events of every task, after they are stored.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<(String, Event)>> {
        self.live.subscribe()
    }

    /// Whether the daemon is stopping.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// At start-up: tasks the last daemon left running become interrupted (resumable), and
    /// queued ones are queued again in their order. A task that was waiting for an approval
    /// goes back to waiting for it (it costs nothing while it waits). Returns how many were
    /// interrupted and stay so.
    pub fn recover(self: &Arc<Self>) -> Result<usize, TaskError> {
        self.store.interrupt_running()?;
        for task in self.store.list(Some(TaskState::Queued))? {
            self.enqueue(task.id, task.spec, Vec::new());
        }
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
        Ok(interrupted)
    }

    /// A slot for an execution that is not a task (an MCP `execute_code` call): it waits
    /// behind queued tasks like one, until `cancel` fires or the sessions' wait runs out.
    pub(crate) async fn execution_slot(
        &self,
        cancel: &CancellationToken,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, TaskError> {
        let wait = self.config.sessions.wait;
        let busy = || {
            TaskError::Unavailable(format!(
                "no execution slot was free within {} s: this daemon runs {} at once (--max-concurrent); try again when a task ends",
                wait.as_secs(),
                self.config.max_concurrent
            ))
        };
        tokio::select! {
            permit = tokio::time::timeout(wait, self.slots.clone().acquire_owned()) => {
                permit.map_err(|_| busy())?.map_err(|_| TaskError::ShuttingDown)
            }
            () = cancel.cancelled() => Err(TaskError::Conflict("the call was cancelled while it waited for a slot".to_owned())),
        }
    }

    /// Executor `name`, when this daemon has it and its policy offers it to clients: the one
    /// check every road makes (a task, a team's agents, a restart, MCP).
    pub(crate) fn offered(&self, name: &str) -> Result<Arc<dyn Executor>, TaskError> {
        let executor = self
            .config
            .executors
            .get(name)
            .map_err(|e| TaskError::Invalid(e.to_string()))?;
        let policy = &self.config.policy;
        if !policy.offers(name) {
            return Err(TaskError::NotAllowed(
                policy.not_offered(name, &self.config.executors),
            ));
        }
        Ok(executor)
    }

    /// The operator's approval policy.
    pub fn approval(&self) -> &tandem_protocol::ApprovalPolicy {
        &self.config.approval
    }

    /// Checks a team within the operator's bounds.
    pub fn check_team_spec(&self, team: &TeamSpec) -> Result<Node, tandem_agent::team::TeamErrors> {
        tandem_agent::team::check_within(team, &self.config.teams)
    }

    /// Validates and queues a task; it is committed to the store when this returns.
    pub async fn submit(self: &Arc<Self>, spec: TaskSpec) -> Result<TaskRecord, TaskError> {
        self.validate(&spec)?;
        // A task for a sandbox that cannot run (an image that is not there) would spend a
        // model turn before failing; refuse it now, with the fix.
        let name = executor_name(self, &spec);
        if let Err(problem) = self.health(&name).await {
            return Err(TaskError::Unavailable(format!(
                "the {name} executor cannot run tasks now: {problem}"
            )));
        }
        let id = uuid::Uuid::now_v7().simple().to_string();
        let now = now_ms();
        // Through the writer, so concurrent submits share a commit (and its log sync).
        let (created, committed) = tokio::sync::oneshot::channel();
        let create = Write::Create(id.clone(), Box::new(spec.clone()), now, created);
        self.writer.send(create)?;
        // Queued once committed, even if this request is dropped or gives up waiting: a
        // stored task that never runs would be worse than a late one.
        let (this, queued_id, queued_spec) = (self.clone(), id.clone(), spec.clone());
        let queued = tokio::spawn(async move {
            match committed.await {
                Ok(result) => {
                    result?;
                    this.enqueue(queued_id, queued_spec, Vec::new());
                    Ok(())
                }
                Err(_) => Err(StoreError::Writer("has stopped")),
            }
        });
        match tokio::time::timeout(CREATE_TIMEOUT, queued).await {
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

    fn validate(&self, spec: &TaskSpec) -> Result<(), TaskError> {
        if self.stopping() {
            return Err(TaskError::ShuttingDown);
        }
        if spec.task.trim().is_empty() {
            return Err(TaskError::Invalid(
                "the task is empty; say what to do in `task`".to_owned(),
            ));
        }
        let name = spec
            .executor
            .as_deref()
            .unwrap_or(&self.config.defaults.executor);
        let executor = self.offered(name)?;
        let policy = &self.config.policy;
        policy
            .check(spec, &self.config.model.base_url)
            .map_err(|e| TaskError::NotAllowed(e.0))?;
        if let Some(asked) = &spec.languages {
            allowed_languages(asked, executor.as_ref())
                .map_err(|e| TaskError::Invalid(e.to_string()))?;
        }
        if let Some(team) = &spec.team {
            self.check_team(spec, team)?;
        }
        crate::policy::task_limits(&self.config.defaults.limits, &spec.limits)
            .map_err(TaskError::Invalid)?;
        tandem_agent::ApprovalGate::new(&self.config.approval, spec.approval.as_ref())
            .map_err(|e| TaskError::Invalid(format!("approval: {e}")))?;
        if spec.max_turns == Some(0) {
            return Err(TaskError::Invalid(
                "max_turns must be at least 1".to_owned(),
            ));
        }
        if spec.timeout_secs == Some(0) || spec.block_timeout_secs == Some(0) {
            return Err(TaskError::Invalid(
                "timeout_secs and block_timeout_secs must be at least 1".to_owned(),
            ));
        }
        if spec
            .termination
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(TaskError::Invalid(
                "termination must not be empty".to_owned(),
            ));
        }
        Ok(())
    }

    /// A team must check, and each of its agents stay within the policy: an executor that is
    /// offered, a model server that is allowed.
    fn check_team(&self, spec: &TaskSpec, team: &TeamSpec) -> Result<(), TaskError> {
        let root = self.check_team_spec(team).map_err(|e| {
            TaskError::Invalid(format!("the team does not check: {}", e.0.join("; ")))
        })?;
        let policy = &self.config.policy;
        let mut stack = vec![&root];
        while let Some(node) = stack.pop() {
            let at = |field: &str| format!("team: {}.{field}", node.path.replace('/', "."));
            if node.spec.kind == Kind::Executor {
                let name = node
                    .spec
                    .executor
                    .clone()
                    .unwrap_or_else(|| executor_name(self, spec));
                let executor = self.offered(&name).map_err(|e| match e {
                    TaskError::NotAllowed(m) => {
                        TaskError::NotAllowed(format!("{}: {m}", at("executor")))
                    }
                    other => TaskError::Invalid(format!("{}: {other}", at("executor"))),
                })?;
                if let Some(asked) = &node.spec.languages {
                    allowed_languages(asked, executor.as_ref())
                        .map_err(|e| TaskError::Invalid(format!("{}: {e}", at("languages"))))?;
                }
            }
            if let Some(url) = &node.spec.base_url {
                policy
                    .endpoint(url, &self.config.model.base_url)
                    .map_err(|e| TaskError::NotAllowed(format!("{}: {}", at("base_url"), e.0)))?;
            }
            stack.extend(&node.members);
        }
        Ok(())
    }

    /// Runs a team task: its agents' models and sessions within the policy, resumed from
    /// what its stored events say each agent already said.
    async fn run_team(
        self: &Arc<Self>,
        id: &str,
        spec: &TaskSpec,
        settings: TaskSettings,
        model: ChatModel,
        sink: EventSink,
        token: CancellationToken,
    ) {
        let Some(team) = &spec.team else {
            return;
        };
        let fail = |message: String| {
            self.record(
                id,
                finished(
                    StopReason::Error,
                    0,
                    Some(ErrorInfo {
                        code: ErrorCode::InvalidRequest,
                        message,
                    }),
                ),
            );
        };
        let root = match self.check_team_spec(team) {
            Ok(root) => root,
            Err(e) => return fail(e.0.join("; ")),
        };
        let task_id = id.to_owned();
        let stored = self
            .off_thread(move |sup| sup.store().events_after(&task_id, 0))
            .await;
        let replay = match stored {
            Ok(Ok(events)) => {
                let msgs: Vec<EventMsg> = events.into_iter().map(|e| e.msg).collect();
                tandem_agent::team::replay_of(&msgs)
            }
            _ => Vec::new(),
        };
        let default_executor = executor_name(self, spec);
        let models = |node: &Node| {
            let mut agent = spec.clone();
            if node.spec.model.is_some() {
                agent.model = node.spec.model.clone();
            }
            if node.spec.base_url.is_some() {
                agent.base_url = node.spec.base_url.clone();
            }
            self.model(&agent)
        };
        let slots = |node: &Node| {
            let name = node.spec.executor.as_ref().unwrap_or(&default_executor);
            let executor = self.config.executors.get(name).map_err(|e| ErrorInfo {
                code: ErrorCode::Executor,
                message: e.to_string(),
            })?;
            executor_slot(node, executor, settings.session.clone())
        };
        let max_turns = spec
            .max_turns
            .unwrap_or(tandem_agent::DEFAULT_TEAM_TURNS)
            .min(self.config.policy.max_turns);
        let team = match Team::new(
            root,
            model.clone(),
            models,
            slots,
            max_turns,
            &settings.session.limits,
        ) {
            Ok(team) => team.with_approval(settings.approval.clone()),
            Err(info) => return fail(info.message),
        };
        let label = TaskLabel {
            model: model.config().model.clone(),
            base_url: model.location(),
            executor: "team".to_owned(),
        };
        run_team_task(
            team,
            &spec.task,
            label,
            sink,
            token,
            settings.timeout,
            replay,
        )
        .await;
    }

    /// Cancels a queued, running or interrupted task.
    pub fn cancel(&self, id: &str) -> Result<TaskRecord, TaskError> {
        let record = self
            .store
            .get(id)?
            .ok_or_else(|| TaskError::NotFound(id.to_owned()))?;
        match record.state {
            TaskState::Finished => Err(TaskError::Conflict(format!(
                "task `{id}` already finished ({}); there is nothing to cancel",
                record.stop_reason.map_or("unknown", StopReason::as_str)
            ))),
            // Only if no resume took it first; then it is queued and cancelled below.
            TaskState::Interrupted
                if self.transition(id, TaskState::Interrupted, TaskState::Finished)? =>
            {
                self.record(id, finished(StopReason::Cancelled, record.turns, None));
                self.flush();
                Ok(self.store.get(id)?.unwrap_or(record))
            }
            TaskState::Interrupted
            | TaskState::Queued
            | TaskState::Running
            | TaskState::AwaitingApproval => {
                if let Some(token) = self.active.lock().ok().and_then(|a| a.get(id).cloned()) {
                    token.cancel();
                }
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
            TaskError::Conflict(format!(
                "task `{id}` is {}; only interrupted tasks can be resumed",
                state.as_str()
            ))
        };
        if record.state != TaskState::Interrupted {
            return Err(conflict(record.state));
        }
        let history = history(&self.store.events_after(id, 0)?);
        // Two resumes can both pass the check above; only the one whose change finds the
        // task still interrupted runs it.
        if !self.transition(id, TaskState::Interrupted, TaskState::Queued)? {
            return Err(conflict(TaskState::Queued));
        }
        self.enqueue(id.to_owned(), record.spec.clone(), history);
        Ok(TaskRecord {
            state: TaskState::Queued,
            ..record
        })
    }

    /// The conversation so far, rebuilt from the task's stored `events`.
    pub fn transcript(&self, record: &TaskRecord, events: &[Event]) -> Vec<Message> {
        let spec = &record.spec;
        let template = spec
            .system_prompt
            .as_deref()
            .unwrap_or(&self.config.defaults.system_prompt);
        // As the model was sent it: the prompt names the languages the task's executor runs.
        let system = match self.config.executors.get(&executor_name(self, spec)) {
            Ok(executor) => {
                let allowed = spec
                    .languages
                    .as_deref()
                    .and_then(|asked| allowed_languages(asked, executor.as_ref()).ok());
                render_system_prompt(template, executor.languages(), allowed.as_deref())
            }
            Err(_) => template.to_owned(),
        };
        let mut messages = vec![
            Message::new(Role::System, system),
            Message::new(Role::User, spec.task.clone()),
        ];
        messages.extend(conversation(events));
        messages
    }

    /// Stops: no new work; running tasks get `grace` to finish, then are cancelled and
    /// marked interrupted (queued ones stay queued for the next start); every sandbox is
    /// closed before this returns.
    pub async fn shutdown(self: &Arc<Self>, grace: Duration) {
        self.stopping.store(true, Ordering::SeqCst);
        self.tracker.close();
        // A task waiting for a person would only hold the grace period up: it is interrupted
        // now, and the next start has it wait again where it was.
        for id in self.approvals.waiting() {
            if let Some(token) = self.active.lock().ok().and_then(|a| a.get(&id).cloned()) {
                token.cancel();
            }
        }
        let running = self.active.lock().map_or(0, |a| a.len());
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
    }

    fn enqueue(self: &Arc<Self>, id: String, spec: TaskSpec, history: Vec<Message>) {
        let token = self.root.child_token();
        if let Ok(mut active) = self.active.lock() {
            active.insert(id.clone(), token.clone());
        }
        let this = self.clone();
        self.tracker.spawn(async move {
            this.run_one(&id, spec, history, token).await;
            if let Ok(mut active) = this.active.lock() {
                active.remove(&id);
            }
            this.approvals.forget(&id);
        });
    }

    async fn run_one(
        self: &Arc<Self>,
        id: &str,
        spec: TaskSpec,
        history: Vec<Message>,
        token: CancellationToken,
    ) {
        // The semaphore is fair, so tasks start in the order they were queued.
        let permit = tokio::select! {
            permit = self.slots.clone().acquire_owned() => permit,
            () = token.cancelled() => {
                if !self.stopping() {
                    // Cancelled while queued: it ends without having run.
                    self.record(id, finished(StopReason::Cancelled, 0, None));
                }
                return;
            }
        };
        let Ok(permit) = permit else {
            return;
        };
        // Shared with the approver, which gives it up while a block waits for a person. This
        // handle keeps the slot for the whole run when there is no approver: dropping the
        // last one gives the slot back.
        let permit = Arc::new(tokio::sync::Mutex::new(Some(permit)));
        let _slot = permit.clone();
        // Through the writer, in order with the task's events, so the turn loop starts at once.
        self.set_state(id, TaskState::Running);
        let (mut settings, model, executor) = match self.prepare(id, &spec, history) {
            Ok(parts) => parts,
            Err(info) => {
                self.record(id, finished(StopReason::Error, 0, Some(info)));
                return;
            }
        };
        settings.approval = match self.gate(id, &spec, permit).await {
            Ok(gate) => gate,
            Err(info) => {
                self.record(id, finished(StopReason::Error, 0, Some(info)));
                return;
            }
        };
        let this = self.clone();
        let task_id = id.to_owned();
        let executor_name = executor_name(self, &spec);
        let turn_started = Mutex::new(None::<Instant>);
        let sink = Arc::new(move |msg: EventMsg| {
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
        match &spec.team {
            None => {
                run_task(settings, &model, executor, sink, token).await;
            }
            Some(_) => {
                self.run_team(id, &spec, settings, model, sink, token).await;
            }
        }
    }

    /// The approval gate of task `id`: the operator's policy tightened by the task's, asking
    /// through the API; `None` when it lets every block through.
    async fn gate(
        self: &Arc<Self>,
        id: &str,
        spec: &TaskSpec,
        permit: Arc<tokio::sync::Mutex<Option<tokio::sync::OwnedSemaphorePermit>>>,
    ) -> Result<Option<Arc<tandem_agent::ApprovalGate>>, ErrorInfo> {
        let gate = tandem_agent::ApprovalGate::new(&self.config.approval, spec.approval.as_ref())
            .map_err(|e| ErrorInfo {
            code: ErrorCode::InvalidRequest,
            message: format!("approval: {e}"),
        })?;
        if gate.is_open() {
            return Ok(None);
        }
        let task_id = id.to_owned();
        let events = self
            .off_thread(move |sup| sup.store().events_after(&task_id, 0))
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let approver =
            crate::approvals::TaskApprover::new(self.approvals.clone(), id, permit, &events);
        Ok(Some(Arc::new(gate.with_approver(Arc::new(approver)))))
    }

    /// Queues an event for the writer, which commits it and only then sends it to live
    /// subscribers. The turn loop never waits on the disk.
    pub(crate) fn record(&self, id: &str, msg: EventMsg) {
        self.writer.record(id, msg);
    }

    /// Moves task `id` to `state`, in order with its events.
    pub(crate) fn set_state(&self, id: &str, state: TaskState) {
        self.writer.set_state(id, state);
    }

    /// Moves task `id` from `from` to `to` through the writer, after everything queued before,
    /// only if it is still in `from`; whether it moved.
    fn transition(&self, id: &str, from: TaskState, to: TaskState) -> Result<bool, TaskError> {
        let (moved, answer) = std::sync::mpsc::channel();
        let write = Write::Transition {
            id: id.to_owned(),
            from,
            to,
            at: now_ms(),
            moved,
        };
        let gone = || TaskError::Unavailable("the task store's writer is not running".to_owned());
        self.writer.send(write).map_err(|_| gone())?;
        Ok(answer
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| gone())??)
    }

    /// Waits until every event queued so far is committed.
    pub fn flush(&self) {
        self.writer.flush();
    }

    fn prepare(
        &self,
        id: &str,
        spec: &TaskSpec,
        history: Vec<Message>,
    ) -> Result<(TaskSettings, ChatModel, Arc<dyn Executor>), ErrorInfo> {
        let d = &self.config.defaults;
        let name = executor_name(self, spec);
        // A task stored under an older policy (queued or interrupted across a restart) runs
        // only if today's still allows it.
        let executor = self.offered(&name).map_err(|e| ErrorInfo {
            code: match e {
                TaskError::NotAllowed(_) => ErrorCode::InvalidRequest,
                _ => ErrorCode::Executor,
            },
            message: e.to_string(),
        })?;
        let policy = &self.config.policy;
        let invalid = |message| ErrorInfo {
            code: ErrorCode::InvalidRequest,
            message,
        };
        policy
            .check(spec, &self.config.model.base_url)
            .map_err(|e| invalid(e.0))?;
        let mut settings = TaskSettings::new(spec.task.clone());
        settings.system_prompt = spec
            .system_prompt
            .clone()
            .unwrap_or_else(|| d.system_prompt.clone());
        settings.termination = spec
            .termination
            .clone()
            .unwrap_or_else(|| d.termination.clone());
        settings.max_turns = spec.max_turns.unwrap_or(d.max_turns);
        settings.timeout = spec.timeout_secs.map(Duration::from_secs).or(d.timeout);
        let mut limits = crate::policy::task_limits(&d.limits, &spec.limits).map_err(invalid)?;
        if let Some(secs) = spec.block_timeout_secs {
            limits.wall = Duration::from_secs(secs);
        }
        settings.languages = spec
            .languages
            .as_deref()
            .map(|asked| allowed_languages(asked, executor.as_ref()))
            .transpose()
            .map_err(|e| invalid(e.to_string()))?;
        settings.session = SessionSpec {
            workdir: None,
            limits,
            labels: vec![("tandem.task".to_owned(), id.to_owned())],
        };
        settings.history = history;
        let model = self.model(spec)?;
        Ok((settings, model, executor))
    }

    /// The chat model for a task's URL and model, built once per pair. A task's URL gets the
    /// key configured for that endpoint, never the daemon's own.
    fn model(&self, spec: &TaskSpec) -> Result<ChatModel, ErrorInfo> {
        let mut config = self.config.model.clone();
        if let (Some(local), None) = (&self.config.local_model, &spec.base_url) {
            return Ok(ChatModel::local(local.clone(), config));
        }
        if let Some(url) = &spec.base_url {
            let endpoint = self
                .config
                .policy
                .endpoint(url, &self.config.model.base_url)
                .map_err(|e| ErrorInfo {
                    code: ErrorCode::InvalidRequest,
                    message: e.0,
                })?;
            if let Some(endpoint) = endpoint {
                config.base_url = endpoint.base_url.clone();
                config.api_key = endpoint.api_key.clone();
            }
        }
        if let Some(model) = &spec.model {
            config.model = model.clone();
        }
        let key = (config.base_url.clone(), config.model.clone());
        if let Some(m) = self.models.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(m);
        }
        let model = ChatModel::new(config).map_err(ErrorInfo::from)?;
        if let Ok(mut models) = self.models.lock() {
            // Model names are the client's to choose; the cache must not grow with them.
            if models.len() >= MODEL_CACHE {
                models.clear();
            }
            models.insert(key, model.clone());
        }
        Ok(model)
    }
}

/// An executor's health: `Err` says what is wrong and how to fix it.
type Health = Result<(), String>;

/// How long an executor's health answer is reused by submits.
const HEALTH_TTL: Duration = Duration::from_secs(2);

/// Most chat clients kept for reuse (one per endpoint and model name).
const MODEL_CACHE: usize = 32;

/// Store calls from the API running at once on the blocking pool.
const STORE_CALLS: usize = 2;

/// Longest a submit waits for its task to be committed.
const CREATE_TIMEOUT: Duration = Duration::from_secs(30);

fn executor_name(supervisor: &Supervisor, spec: &TaskSpec) -> String {
    spec.executor
        .clone()
        .unwrap_or_else(|| supervisor.config.defaults.executor.clone())
}

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

/// What the assistant and the executor said, in order, from the stored events.
fn conversation(events: &[Event]) -> Vec<Message> {
    events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::AssistantMessage { text, .. } => {
                Some(Message::new(Role::Assistant, text.clone()))
            }
            EventMsg::ExecutorMessage { text, .. } => Some(Message::new(Role::User, text.clone())),
            _ => None,
        })
        .collect()
}

/// The turns an interrupted task completed: a last reply that its report never answered
/// (the interruption cut its code off) is asked for again, unless one of its blocks asked
/// for approval: then its code runs again, and the approval is found where it was.
fn history(events: &[Event]) -> Vec<Message> {
    let mut messages = conversation(events);
    if messages.last().is_some_and(|m| m.role == Role::Assistant) && !waits_for_approval(events) {
        messages.pop();
    }
    messages
}

/// Whether the task's last reply asked for an approval and was never answered by a report.
fn waits_for_approval(events: &[Event]) -> bool {
    let last_reply = events
        .iter()
        .rposition(|e| matches!(e.msg, EventMsg::AssistantMessage { .. }));
    last_reply.is_some_and(|at| {
        let after = &events[at..];
        after
            .iter()
            .any(|e| matches!(e.msg, EventMsg::ApprovalRequested { .. }))
            && !after.iter().any(|e| {
                matches!(
                    e.msg,
                    EventMsg::ExecutorMessage { .. } | EventMsg::TaskFinished { .. }
                )
            })
    })
}
