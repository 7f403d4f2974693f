//! Sessions over HTTP (`/v1/sessions`, `/v1/exec`): sandboxes a client holds open and runs
//! blocks in with no model, as other frameworks' code executors do. A session lives until
//! its client closes it, it goes unused for its idle timeout, or the daemon stops; its
//! sandbox is closed each time (and a daemon that died has its executors reap it at start).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tandem_executor::{
    CancellationToken, ExecContext, ExecError, ExecRequest, Executor, Language, Session, Stream,
};
use tandem_protocol::session::{ExecEvent, ExecSpec, SessionInfo, SessionSpec};
use tandem_protocol::{ApiErrorCode, ApiErrorDetail, OutputStream};
use tokio::sync::{mpsc, oneshot};

use crate::supervisor::Supervisor;

/// Most sessions open at once on one daemon.
pub const MAX_SESSIONS: usize = 64;
/// How long a session lives unused, unless it asks for less.
pub const IDLE: Duration = Duration::from_secs(600);
/// The largest block a session runs.
pub const MAX_CODE_BYTES: usize = 1 << 20;
/// Most tool calls of one block that wait for their client at once.
const MAX_WAITING_CALLS: usize = 64;

/// Why a request about a session failed; the API picks its status from the code.
#[derive(Debug)]
pub struct Refusal {
    /// The API's error code.
    pub code: ApiErrorCode,
    /// What is wrong and what to do.
    pub message: String,
}

impl Refusal {
    fn new(code: ApiErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    fn invalid(message: impl Into<String>) -> Self {
        Self::new(ApiErrorCode::InvalidRequest, message)
    }

    fn unknown(id: &str) -> Self {
        Self::new(
            ApiErrorCode::NotFound,
            format!(
                "no session `{id}` is open (it was closed, went unused past its idle timeout, or the daemon restarted); open one with POST /v1/sessions"
            ),
        )
    }
}

/// The daemon's open sessions.
pub struct Sessions {
    supervisor: Arc<Supervisor>,
    map: Mutex<HashMap<String, Arc<Held>>>,
}

/// One open session.
pub struct Held {
    id: String,
    executor: String,
    sandbox: Arc<dyn Executor>,
    keep_state: bool,
    tools: Vec<String>,
    created_ms: u64,
    idle: Duration,
    /// Its host workspace, read without waiting for a running block.
    workspace: Option<PathBuf>,
    /// `None` once closed.
    session: tokio::sync::Mutex<Option<Box<dyn Session>>>,
    used: Mutex<Instant>,
    blocks: AtomicU64,
    /// The running block's cancel token.
    running: Mutex<Option<CancellationToken>>,
    /// Tool calls waiting for the client's answer, by id.
    calls: Mutex<HashMap<String, oneshot::Sender<Result<String, String>>>>,
    next_call: AtomicU64,
}

impl Held {
    fn new(
        id: String,
        executor: String,
        sandbox: Arc<dyn Executor>,
        opened: Box<dyn Session>,
        keep_state: bool,
        tools: Vec<String>,
        idle: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            executor,
            sandbox,
            keep_state,
            tools,
            created_ms: crate::now_ms(),
            idle,
            workspace: opened.workspace().map(std::path::Path::to_owned),
            session: tokio::sync::Mutex::new(Some(opened)),
            used: Mutex::new(Instant::now()),
            blocks: AtomicU64::new(0),
            running: Mutex::new(None),
            calls: Mutex::default(),
            next_call: AtomicU64::new(1),
        })
    }

    /// The session as the API shows it.
    pub fn info(&self) -> SessionInfo {
        SessionInfo {
            id: self.id.clone(),
            executor: self.executor.clone(),
            keep_state: self.keep_state,
            tools: self.tools.clone(),
            busy: self.running.lock().map(|r| r.is_some()).unwrap_or(false),
            blocks: self.blocks.load(Ordering::Relaxed),
            created_ms: self.created_ms,
            idle_timeout_secs: self.idle.as_secs(),
        }
    }

    /// Its host workspace, or why files cannot be reached.
    pub fn workspace(&self) -> Result<PathBuf, Refusal> {
        self.workspace.clone().ok_or_else(|| {
            Refusal::invalid(format!(
                "the {} executor's sessions have no workspace the daemon can read",
                self.executor
            ))
        })
    }

    async fn close(&self) {
        if let Some(token) = self.running.lock().ok().and_then(|r| r.clone()) {
            token.cancel();
        }
        let session = self.session.lock().await.take();
        if let Some(session) = session
            && let Err(e) = session.close().await
        {
            tracing::warn!(session = %self.id, error = %e, "closing a session's sandbox failed");
        }
    }

    /// Places the files of the tar archive `archive` in the workspace, within `caps`.
    pub async fn put(
        &self,
        archive: &std::path::Path,
        caps: tandem_executor::archive::ArchiveCaps,
    ) -> Result<Vec<tandem_executor::archive::ArchivedFile>, Refusal> {
        let mut guard = match self.session.try_lock() {
            Ok(guard) if self.running.lock().is_ok_and(|r| r.is_none()) => guard,
            _ => {
                return Err(Refusal::new(
                    ApiErrorCode::Conflict,
                    format!(
                        "a block runs in session `{}` now; place files between blocks",
                        self.id
                    ),
                ));
            }
        };
        let session = guard.as_mut().ok_or_else(|| Refusal::unknown(&self.id))?;
        *self.used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        session
            .put_archive(archive, caps)
            .await
            .map_err(|e| Refusal::invalid(format!("placing the files failed: {e}")))
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
                    self.id
                ),
            )),
        }
    }
}

impl Sessions {
    /// No sessions yet; idle ones are closed in the background, and all of them when
    /// `shutdown` fires.
    pub fn new(supervisor: Arc<Supervisor>, shutdown: CancellationToken) -> Arc<Self> {
        let sessions = Arc::new(Self {
            supervisor,
            map: Mutex::default(),
        });
        let weak: Weak<Sessions> = Arc::downgrade(&sessions);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = shutdown.cancelled() => {
                        if let Some(sessions) = weak.upgrade() {
                            sessions.close_all().await;
                        }
                        return;
                    }
                }
                let Some(sessions) = weak.upgrade() else {
                    return;
                };
                sessions.close_idle().await;
            }
        });
        sessions
    }

    async fn close_all(&self) {
        let all: Vec<_> = self
            .map
            .lock()
            .map(|mut m| m.drain().map(|(_, h)| h).collect())
            .unwrap_or_default();
        for held in all {
            held.close().await;
        }
    }

    async fn close_idle(&self) {
        let stale: Vec<_> = {
            let Ok(mut map) = self.map.lock() else {
                return;
            };
            let ids: Vec<String> = map
                .values()
                .filter(|h| {
                    h.running.lock().is_ok_and(|r| r.is_none())
                        && h.used.lock().is_ok_and(|u| u.elapsed() > h.idle)
                })
                .map(|h| h.id.clone())
                .collect();
            ids.iter().filter_map(|id| map.remove(id)).collect()
        };
        for held in stale {
            tracing::info!(session = %held.id, "closing a session unused past its idle timeout");
            held.close().await;
        }
    }

    /// The open session `id`.
    pub fn get(&self, id: &str) -> Result<Arc<Held>, Refusal> {
        self.map
            .lock()
            .ok()
            .and_then(|m| m.get(id).cloned())
            .ok_or_else(|| Refusal::unknown(id))
    }

    /// The open sessions, oldest first.
    pub fn list(&self) -> Vec<SessionInfo> {
        let mut all: Vec<SessionInfo> = self
            .map
            .lock()
            .map(|m| m.values().map(|h| h.info()).collect())
            .unwrap_or_default();
        all.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        all
    }

    /// Closes session `id`; what it was.
    pub async fn close(&self, id: &str) -> Result<SessionInfo, Refusal> {
        let held = self
            .map
            .lock()
            .ok()
            .and_then(|mut m| m.remove(id))
            .ok_or_else(|| Refusal::unknown(id))?;
        let info = held.info();
        held.close().await;
        Ok(info)
    }

    /// Opens a session as `spec` asks, checked against the operator's policy.
    pub async fn open(&self, spec: SessionSpec) -> Result<SessionInfo, Refusal> {
        if self.supervisor.stopping() {
            return Err(Refusal::new(
                ApiErrorCode::ShuttingDown,
                "the daemon is shutting down and opens no new sessions",
            ));
        }
        if self.map.lock().map(|m| m.len()).unwrap_or(0) >= MAX_SESSIONS {
            return Err(Refusal::new(
                ApiErrorCode::TooMany,
                format!(
                    "{MAX_SESSIONS} sessions are open on this daemon; close one (DELETE /v1/sessions/ID) and try again"
                ),
            ));
        }
        let mut tools = Vec::new();
        for tool in &spec.tools {
            if !tandem_protocol::tools::valid_tool_name(&tool.name) {
                return Err(Refusal::invalid(format!(
                    "tool name `{}` must be 1 to 64 letters, digits, `_` or `-`",
                    tool.name.chars().take(80).collect::<String>()
                )));
            }
            if tools.contains(&tool.name) {
                return Err(Refusal::invalid(format!(
                    "tool `{}` is named twice",
                    tool.name
                )));
            }
            tools.push(tool.name.clone());
        }
        let idle = match spec.idle_timeout_secs {
            Some(0) => return Err(Refusal::invalid("idle_timeout_secs must be at least 1")),
            Some(secs) => Duration::from_secs(secs.min(IDLE.as_secs())),
            None => IDLE,
        };
        let (executor, sandbox) = self.executor(spec.executor.as_deref())?;
        if spec.keep_state && !sandbox.keeps_state() {
            return Err(Refusal::invalid(format!(
                "the {executor} executor cannot keep an interpreter (keep_state); use local or docker, or leave keep_state out"
            )));
        }
        if !tools.is_empty() && !sandbox.carries_tool_calls() {
            return Err(Refusal::invalid(format!(
                "code in the {executor} executor cannot call tools; use local or docker, or leave tools out"
            )));
        }
        let limits = crate::policy::task_limits(&self.supervisor.defaults().limits, &spec.limits)
            .map_err(Refusal::invalid)?;
        let inputs = self.inputs(spec.files.as_deref())?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let opened = open(&sandbox, limits, inputs, spec.keep_state, "session").await?;
        let held = Held::new(
            id.clone(),
            executor,
            sandbox,
            opened,
            spec.keep_state,
            tools,
            idle,
        );
        let info = held.info();
        let raced = match self.map.lock() {
            Ok(mut map) if map.len() < MAX_SESSIONS && !self.supervisor.stopping() => {
                map.insert(id, held.clone());
                false
            }
            _ => true,
        };
        if raced {
            held.close().await;
            return Err(Refusal::new(
                ApiErrorCode::TooMany,
                format!("{MAX_SESSIONS} sessions are open on this daemon; close one and try again"),
            ));
        }
        Ok(info)
    }

    /// The archive of the upload `files` names, if it names one that is here.
    fn inputs(&self, files: Option<&str>) -> Result<Option<PathBuf>, Refusal> {
        let Some(upload) = files else {
            return Ok(None);
        };
        self.supervisor
            .files()
            .upload_archive(upload)
            .map(Some)
            .ok_or_else(|| {
                Refusal::invalid(format!(
                    "`files` names no upload here: `{}`; POST a tar archive to /v1/uploads first",
                    tandem_protocol::files::shown(upload)
                ))
            })
    }

    /// The executor `name` (or the daemon's default), offered to clients.
    fn executor(&self, name: Option<&str>) -> Result<(String, Arc<dyn Executor>), Refusal> {
        let name = name
            .map(str::to_owned)
            .unwrap_or_else(|| self.supervisor.defaults().executor.clone());
        let sandbox = self.supervisor.offered(&name).map_err(|e| {
            let code = match e {
                crate::TaskError::NotAllowed(_) => ApiErrorCode::NotAllowed,
                _ => ApiErrorCode::InvalidRequest,
            };
            Refusal::new(code, e.to_string())
        })?;
        Ok((name, sandbox))
    }

    /// The block `spec` asks for, checked: the executor runs its language, its code is
    /// within bounds, and the operator's approval policy lets it run unattended.
    fn request(&self, sandbox: &dyn Executor, spec: &ExecSpec) -> Result<ExecRequest, Refusal> {
        if spec.code.len() > MAX_CODE_BYTES {
            return Err(Refusal::invalid(format!(
                "code is {} bytes; a block may hold at most {MAX_CODE_BYTES}",
                spec.code.len()
            )));
        }
        let language = Language::new(&spec.language);
        if !sandbox.supports(&language) {
            return Err(Refusal::invalid(
                ExecError::unsupported(&language, sandbox.name(), sandbox.languages()).to_string(),
            ));
        }
        let mut request = ExecRequest::new(language.clone(), spec.code.clone());
        if let Some(secs) = spec.timeout_secs {
            if !secs.is_finite() || secs <= 0.0 {
                return Err(Refusal::invalid(
                    "timeout_secs must be a positive number of seconds",
                ));
            }
            let max = self.supervisor.policy().max_block_timeout;
            let asked = Duration::try_from_secs_f64(secs).unwrap_or(max);
            if asked > max {
                return Err(Refusal::new(
                    ApiErrorCode::NotAllowed,
                    format!(
                        "timeout_secs {secs} is above the operator's block timeout cap of {} s; ask for less",
                        max.as_secs()
                    ),
                ));
            }
            request.timeout = Some(asked);
        }
        // No one can be asked in the middle of a client's call: a block the policy would
        // hold for a person is refused, with the way to get one.
        let gate = tandem_agent::ApprovalGate::new(self.supervisor.approval(), None)
            .map_err(|e| Refusal::new(ApiErrorCode::Internal, format!("approval: {e}")))?;
        if let Some(why) = gate.unattended(&language, sandbox, &request.code) {
            return Err(Refusal::new(
                ApiErrorCode::NotAllowed,
                format!(
                    "declined: {why}; submit a task instead, whose blocks wait for a person's approval"
                ),
            ));
        }
        Ok(request)
    }

    /// Runs one block in session `id`, its events sent to `events` as they come. `streamed`:
    /// whether a client reads them as they come and so can answer tool calls.
    pub async fn exec(
        self: &Arc<Self>,
        id: &str,
        spec: ExecSpec,
        streamed: bool,
    ) -> Result<mpsc::UnboundedReceiver<ExecEvent>, Refusal> {
        if spec.executor.is_some() || spec.files.is_some() {
            return Err(Refusal::invalid(
                "`executor` and `files` are for POST /v1/exec; a session's executor and files were set when it was opened (POST /v1/sessions/ID/files adds files)",
            ));
        }
        let held = self.get(id)?;
        let request = self.request(&*held.sandbox, &spec)?;
        let cancel = CancellationToken::new();
        {
            let Ok(mut running) = held.running.lock() else {
                return Err(Refusal::new(ApiErrorCode::Internal, "a lock was poisoned"));
            };
            if running.is_some() {
                return Err(Refusal::new(
                    ApiErrorCode::Conflict,
                    format!(
                        "a block runs in session `{id}` now; wait for its result or cancel it (POST /v1/sessions/{id}/cancel)"
                    ),
                ));
            }
            *running = Some(cancel.clone());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let sessions = self.clone();
        tokio::spawn(async move {
            let ended = sessions
                .run(&held, request, cancel.clone(), tx.clone(), streamed)
                .await;
            if let Ok(mut running) = held.running.lock() {
                *running = None;
            }
            if let Ok(mut calls) = held.calls.lock() {
                calls.clear();
            }
            *held.used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
            let last = match ended {
                Ok(result) => ExecEvent::Result { result },
                Err(error) => {
                    // A sandbox that broke is not run in again: the session is closed, and
                    // the client told to open another.
                    let _ = sessions.close(&held.id).await;
                    ExecEvent::Error { error }
                }
            };
            let _ = tx.send(last);
        });
        Ok(rx)
    }

    async fn run(
        &self,
        held: &Arc<Held>,
        request: ExecRequest,
        cancel: CancellationToken,
        tx: mpsc::UnboundedSender<ExecEvent>,
        streamed: bool,
    ) -> Result<tandem_protocol::BlockResult, ApiErrorDetail> {
        let broken = |message: String| ApiErrorDetail {
            code: ApiErrorCode::ExecutorUnavailable,
            message,
        };
        // Like a task's block, it takes one of the daemon's execution slots while it runs.
        let stop = cancel.clone();
        let _slot = tokio::select! {
            slot = self.supervisor.execution_slot(&cancel) => slot.map_err(|e| broken(e.to_string()))?,
            () = tx.closed() => { stop.cancel(); return Err(broken("the client went away".to_owned())); }
        };
        let mut guard = held.session.lock().await;
        let Some(session) = guard.as_mut() else {
            return Err(ApiErrorDetail {
                code: ApiErrorCode::NotFound,
                message: format!("session `{}` was closed; open another", held.id),
            });
        };
        let sink_tx = tx.clone();
        let pending: Arc<Mutex<[Vec<u8>; 2]>> = Arc::default();
        let sink = Arc::new(move |stream: Stream, bytes: &[u8]| {
            let (which, slot) = match stream {
                Stream::Stdout => (OutputStream::Stdout, 0),
                Stream::Stderr => (OutputStream::Stderr, 1),
            };
            let Ok(mut pending) = pending.lock() else {
                return;
            };
            // A character split between two pieces is sent whole with the second.
            let buf = &mut pending[slot];
            buf.extend_from_slice(bytes);
            let whole = tandem_executor::complete_utf8(buf);
            if whole == 0 {
                return;
            }
            let text = String::from_utf8_lossy(&buf[..whole]).into_owned();
            buf.drain(..whole);
            let _ = sink_tx.send(ExecEvent::Output {
                stream: which,
                text,
            });
        });
        let mut ctx = ExecContext::new(cancel.clone()).with_sink(sink);
        if !held.tools.is_empty() {
            ctx = ctx.with_tools(handler(held, tx.clone(), streamed));
        }
        let language = request.language.clone();
        held.blocks.fetch_add(1, Ordering::Relaxed);
        let run = session.run(request, ctx);
        tokio::pin!(run);
        // A client that stops reading cancels its block: nobody would see its result.
        let outcome = tokio::select! {
            outcome = &mut run => outcome,
            () = tx.closed() => { cancel.cancel(); run.await }
        };
        match outcome {
            Ok(outcome) => Ok(tandem_agent::blocks::to_result(&language, outcome)),
            Err(e) => Err(broken(format!(
                "the sandbox failed: {e}; the session was closed, open another"
            ))),
        }
    }

    /// Runs one block in a sandbox of its own, opened for it and closed after: `POST /v1/exec`.
    pub async fn exec_once(
        self: &Arc<Self>,
        spec: ExecSpec,
    ) -> Result<mpsc::UnboundedReceiver<ExecEvent>, Refusal> {
        let files = spec.files.clone();
        let executor = spec.executor.clone();
        let (executor, sandbox) = self.executor(executor.as_deref())?;
        let request = self.request(&*sandbox, &spec)?;
        let inputs = self.inputs(files.as_deref())?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let limits = self.supervisor.defaults().limits.clone();
        let opened = open(&sandbox, limits, inputs, false, "exec").await?;
        let held = Held::new(id, executor, sandbox, opened, false, Vec::new(), IDLE);
        let (tx, rx) = mpsc::unbounded_channel();
        let sessions = self.clone();
        tokio::spawn(async move {
            let ended = sessions
                .run(&held, request, CancellationToken::new(), tx.clone(), false)
                .await;
            held.close().await;
            let _ = tx.send(match ended {
                Ok(result) => ExecEvent::Result { result },
                Err(error) => ExecEvent::Error { error },
            });
        });
        Ok(rx)
    }
}

/// Answers a block's tool calls by asking the client that follows its run.
fn handler(
    held: &Arc<Held>,
    tx: mpsc::UnboundedSender<ExecEvent>,
    streamed: bool,
) -> tandem_executor::toolchannel::ToolHandler {
    let held = Arc::downgrade(held);
    Arc::new(
        move |name: String,
              arguments: String|
              -> futures::future::BoxFuture<'static, Result<String, String>> {
            let held = held.clone();
            let tx = tx.clone();
            Box::pin(async move {
                let held = held.upgrade().ok_or("the session was closed")?;
                if !held.tools.contains(&name) {
                    return Err(format!(
                        "no tool `{name}` in this session; its tools are: {}",
                        held.tools.join(", ")
                    ));
                }
                if !streamed {
                    return Err("tool calls are answered only when the block's run is read as a stream (Accept: application/x-ndjson)".to_owned());
                }
                let arguments = serde_json::from_str(&arguments)
                    .unwrap_or(serde_json::Value::String(arguments));
                let call = format!("call_{}", held.next_call.fetch_add(1, Ordering::Relaxed));
                let (answer, answered) = oneshot::channel();
                {
                    let mut calls = held.calls.lock().map_err(|_| "a lock was poisoned")?;
                    if calls.len() >= MAX_WAITING_CALLS {
                        return Err(format!(
                            "{MAX_WAITING_CALLS} tool calls already wait for their answers"
                        ));
                    }
                    calls.insert(call.clone(), answer);
                }
                tx.send(ExecEvent::ToolCall {
                    call,
                    name,
                    arguments,
                })
                .map_err(|_| "the client went away".to_owned())?;
                answered
                    .await
                    .map_err(|_| "the block ended before the client answered".to_owned())?
            })
        },
    )
}

async fn open(
    sandbox: &Arc<dyn Executor>,
    limits: tandem_executor::Limits,
    inputs: Option<PathBuf>,
    keep_state: bool,
    road: &str,
) -> Result<Box<dyn Session>, Refusal> {
    // No task's label: the executor labels the sandbox with its owner and session (what
    // reaping needs), and a session with no task can take a container the warm pool started.
    let spec = tandem_executor::SessionSpec {
        limits,
        keep_state,
        // Counted against the share of sandboxes clients may hold without a task.
        labels: vec![(tandem_executor::WITHOUT_TASK.to_owned(), road.to_owned())],
        ..tandem_executor::SessionSpec::default()
    };
    let unavailable = |e: ExecError| {
        // A full budget is the client's to wait out, not the executor's failure.
        let code = match e {
            ExecError::Busy { .. } => ApiErrorCode::TooMany,
            _ => ApiErrorCode::ExecutorUnavailable,
        };
        Refusal::new(
            code,
            format!("opening a {} sandbox failed: {e}", sandbox.name()),
        )
    };
    let mut opened = sandbox.open(spec.clone()).await.map_err(unavailable)?;
    if let Some(inputs) = inputs {
        let caps = tandem_executor::archive::ArchiveCaps {
            max_bytes: u64::MAX,
            max_entries: usize::MAX,
        };
        if let Err(e) = opened.put_archive(&inputs, caps).await {
            let _ = opened.close().await;
            return Err(Refusal::invalid(format!("placing the files failed: {e}")));
        }
    }
    if keep_state {
        opened = Box::new(tandem_executor::kept::KeptSession::new(
            opened,
            sandbox.clone(),
            spec,
        ));
    }
    Ok(opened)
}
