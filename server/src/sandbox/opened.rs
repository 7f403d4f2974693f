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

impl tandem_egress::NetSink for NetRoute {
    fn record(&self, event: tandem_protocol::net::NetEvent) {
        if let Some((counter, executor)) = &self.counted {
            counter.count(executor, &event);
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
    /// Its host workspace, read without waiting for a running block.
    workspace: Option<PathBuf>,
    /// `None` once closed.
    session: tokio::sync::Mutex<Option<Box<dyn Session>>>,
    /// The way in to its ports, reached without waiting for a running block.
    ports: Option<Arc<dyn tandem_executor::Ports>>,
    used: Mutex<Instant>,
    blocks: AtomicU64,
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
            workspace: session.workspace().map(std::path::Path::to_owned),
            ports: session.ports(),
            session: tokio::sync::Mutex::new(Some(session)),
            used: Mutex::new(Instant::now()),
            blocks: AtomicU64::new(0),
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
        self.ports.clone()
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
        }
    }

    /// Whether no block runs and it has gone unused past its idle timeout.
    pub(super) fn idle_past(&self) -> bool {
        self.running.lock().is_ok_and(|r| r.is_none())
            && self.used.lock().is_ok_and(|u| u.elapsed() > self.made.idle)
    }

    fn touch(&self) {
        *self.used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// Its host workspace, or why files cannot be reached.
    pub fn workspace(&self) -> Result<PathBuf, Refusal> {
        self.workspace.clone().ok_or_else(|| {
            Refusal::invalid(format!(
                "the {} executor's sessions have no workspace the daemon can read",
                self.made.executor
            ))
        })
    }

    /// Cancels its running block and closes its sandbox.
    pub async fn close(&self) {
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

    /// Places the files of the tar archive `archive` in the workspace, within `caps`,
    /// between blocks.
    pub async fn put(
        &self,
        archive: &std::path::Path,
        caps: tandem_executor_kit::archive::ArchiveCaps,
    ) -> Result<Vec<tandem_executor_kit::archive::ArchivedFile>, Refusal> {
        let mut guard = match self.session.try_lock() {
            Ok(guard) if self.running.lock().is_ok_and(|r| r.is_none()) => guard,
            _ => {
                return Err(Refusal::new(
                    ApiErrorCode::Conflict,
                    format!(
                        "a block runs in session `{}` now; place files between blocks",
                        self.made.id
                    ),
                ));
            }
        };
        let session = guard
            .as_mut()
            .ok_or_else(|| self.made.owner.unknown(&self.made.id))?;
        self.touch();
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

    /// The executor's session, `None` when the sandbox was closed meanwhile.
    pub async fn session(&self) -> tokio::sync::MutexGuard<'_, Option<Box<dyn Session>>> {
        self.opened.blocks.fetch_add(1, Ordering::Relaxed);
        self.opened.touch();
        self.opened.session.lock().await
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
