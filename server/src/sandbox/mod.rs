//! Sandboxes open without a task, in one pool: HTTP sessions (`/v1/sessions`), the one-block
//! sandbox of `POST /v1/exec`, and MCP's `execute_code` with or without a session. Each open
//! sandbox has an [`Owner`] (the API's clients, or one MCP connection) whose caps bound how
//! many it holds; one reaper closes those unused past their idle timeout, and every one of
//! them when the daemon stops. What a block asks is checked once, by
//! [`Planner::check_block`](crate::plan::Planner::check_block); the HTTP and MCP adapters
//! only translate a [`Refusal`] to their wire.

mod api;
mod opened;
mod pause;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tandem_executor::{CancellationToken, ExecError, Executor, Session};
use tandem_protocol::ApiErrorCode;
use tandem_protocol::session::SessionInfo;

pub use crate::error::Refusal;
pub use opened::{Claim, Opened};

use crate::supervisor::Supervisor;

/// How long an open sandbox lives unused, unless it asks for less.
pub const IDLE: Duration = Duration::from_secs(600);
/// Most sandboxes the API's clients hold open at once, together, unless `[sessions]
/// without_task` lets more stand.
pub const MAX_API_SESSIONS: usize = 64;
/// Most sessions one MCP connection holds open at once.
pub const MAX_MCP_SESSIONS: usize = 8;
/// How often the reaper looks for idle sandboxes.
const REAP_EVERY: Duration = Duration::from_secs(5);

/// Who holds an open sandbox; its caps come with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// The HTTP API's clients (`/v1/sessions`), together.
    Api,
    /// One MCP connection.
    Mcp(u64),
}

impl Owner {
    /// Most sandboxes it may hold open at once, `api` for the API's clients together.
    pub fn max_open(self, api: usize) -> usize {
        match self {
            Owner::Api => api,
            Owner::Mcp(_) => MAX_MCP_SESSIONS,
        }
    }

    fn too_many(self, api: usize) -> Refusal {
        Refusal::new(
            ApiErrorCode::TooMany,
            match self {
                Owner::Api => format!(
                    "{api} sessions are open on this daemon; close one (DELETE /v1/sessions/ID) and try again"
                ),
                Owner::Mcp(_) => {
                    format!("this connection already holds {MAX_MCP_SESSIONS} sessions; reuse one")
                }
            },
        )
    }

    fn unknown(self, id: &str) -> Refusal {
        Refusal::new(
            ApiErrorCode::NotFound,
            match self {
                Owner::Api => format!(
                    "no session `{id}` is open (it was closed, went unused past its idle timeout, or the daemon restarted); open one with POST /v1/sessions"
                ),
                Owner::Mcp(_) => format!("session `{id}` was closed; use another id"),
            },
        )
    }
}

/// A snapshot store's refusal on the API's wire: an unknown snapshot is 404, a full store
/// or a damaged snapshot 409, a workspace that cannot be walked 400.
pub fn snapshot_refusal(e: tandem_snapshots::SnapshotError) -> Refusal {
    use tandem_snapshots::SnapshotError as E;
    let code = match &e {
        E::Unknown(_) => ApiErrorCode::NotFound,
        E::Quota { .. } | E::Corrupt { .. } | E::Held(_) => ApiErrorCode::Conflict,
        E::Workspace(_) => ApiErrorCode::InvalidRequest,
        E::Io { .. } => ApiErrorCode::Internal,
    };
    Refusal::new(code, e.to_string())
}

/// What a sandbox is opened with.
#[derive(Debug, Default)]
pub struct OpenAsk {
    /// The executor; the daemon's default when `None`.
    pub executor: Option<String>,
    /// Keep a Python interpreter between blocks.
    pub keep_state: bool,
    /// The tools its code may call, by name.
    pub tools: Vec<String>,
    /// Close it after this long unused (at most [`IDLE`]).
    pub idle_timeout_secs: Option<u64>,
    /// Its limits, within the daemon's.
    pub limits: tandem_protocol::TaskLimits,
    /// A tar archive of files placed in its workspace first.
    pub files: Option<PathBuf>,
    /// The hosts its blocks may reach through the egress proxy.
    pub network: Option<tandem_protocol::net::NetworkRequest>,
    /// `files` hold a snapshot's kept globals: the interpreter is kept (where the executor
    /// can keep one) to load them.
    pub restores_state: bool,
    /// Volumes mounted into it.
    pub volumes: Vec<tandem_protocol::volume::VolumeMount>,
}

/// Every sandbox open without a task, by owner and id.
pub struct Pool {
    supervisor: Arc<Supervisor>,
    open: Mutex<HashMap<(Owner, String), Arc<Opened>>>,
    next_connection: AtomicU64,
    /// Most sandboxes the API's clients hold open at once: as many as `[sessions]
    /// without_task` lets stand, and never fewer than the fixed floor (past it a client is
    /// refused; within it, it waits for the budget).
    api_max: usize,
}

impl Pool {
    /// An empty pool whose reaper closes idle sandboxes, and all of them when `shutdown`
    /// fires.
    pub fn new(supervisor: Arc<Supervisor>, shutdown: CancellationToken) -> Arc<Self> {
        let api_max = supervisor
            .without_task
            .map_or(MAX_API_SESSIONS, |n| n.max(MAX_API_SESSIONS));
        let pool = Arc::new(Self {
            supervisor,
            api_max,
            open: Mutex::default(),
            next_connection: AtomicU64::new(1),
        });
        let weak: Weak<Pool> = Arc::downgrade(&pool);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REAP_EVERY);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = shutdown.cancelled() => {
                        if let Some(pool) = weak.upgrade() {
                            // A paused session outlives the daemon: what it was saved as stays.
                            pool.close_where(|_, _| true, true).await;
                        }
                        return;
                    }
                }
                let Some(pool) = weak.upgrade() else {
                    return;
                };
                let pausing = pool.supervisor.pausing();
                if let Some(after) = pausing.after {
                    pool.pause_idle(after).await;
                }
                pool.close_where(|owner, opened| opened.expired(owner, &pausing), false)
                    .await;
            }
        });
        pool
    }

    /// The daemon it serves.
    pub fn supervisor(&self) -> &Arc<Supervisor> {
        &self.supervisor
    }

    /// An owner for a new MCP connection.
    pub fn connection(&self) -> Owner {
        Owner::Mcp(self.next_connection.fetch_add(1, Ordering::Relaxed))
    }

    /// The open sandbox `id` of `owner`.
    pub fn get(&self, owner: Owner, id: &str) -> Result<Arc<Opened>, Refusal> {
        self.open
            .lock()
            .ok()
            .and_then(|m| m.get(&(owner, id.to_owned())).cloned())
            .ok_or_else(|| owner.unknown(id))
    }

    /// The open sandbox `id`, whoever holds it: for a signed link, which its holder was given.
    pub fn find(&self, id: &str) -> Option<Arc<Opened>> {
        self.open
            .lock()
            .ok()?
            .iter()
            .find(|((_, open), _)| open == id)
            .map(|(_, opened)| opened.clone())
    }

    /// The sandboxes `owner` holds open, oldest first.
    pub fn list(&self, owner: Owner) -> Vec<SessionInfo> {
        let mut all: Vec<SessionInfo> = self
            .open
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|((o, _), _)| *o == owner)
                    .map(|(_, opened)| opened.info())
                    .collect()
            })
            .unwrap_or_default();
        all.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        all
    }

    /// How many sandboxes `owner` holds open.
    fn held_by(map: &HashMap<(Owner, String), Arc<Opened>>, owner: Owner) -> usize {
        map.keys().filter(|(o, _)| *o == owner).count()
    }

    /// Closes `owner`'s sandbox `id`; what it was.
    pub async fn close(&self, owner: Owner, id: &str) -> Result<SessionInfo, Refusal> {
        let opened = self
            .open
            .lock()
            .ok()
            .and_then(|mut m| m.remove(&(owner, id.to_owned())))
            .ok_or_else(|| owner.unknown(id))?;
        let info = opened.info();
        opened.close().await;
        Ok(info)
    }

    /// Closes every sandbox `owner` holds (its MCP connection ended).
    pub async fn close_owner(&self, owner: Owner) {
        self.close_where(|o, _| o == owner, false).await;
    }

    /// Closes the sandboxes `which` picks; with `leaving` (the daemon stops), a paused one
    /// keeps what it was saved as, to be taken back at the next start.
    async fn close_where(&self, which: impl Fn(Owner, &Opened) -> bool, leaving: bool) {
        let closing: Vec<Arc<Opened>> = {
            let Ok(mut map) = self.open.lock() else {
                return;
            };
            let keys: Vec<(Owner, String)> = map
                .iter()
                .filter(|((owner, _), opened)| which(*owner, opened))
                .map(|(key, _)| key.clone())
                .collect();
            keys.iter().filter_map(|key| map.remove(key)).collect()
        };
        for opened in closing {
            tracing::debug!(session = %opened.id(), "closing a sandbox without a task");
            if leaving {
                opened.leave().await;
            } else {
                opened.close().await;
            }
        }
    }

    /// Pauses the API's sessions unused for `after` (one at a time: each is a snapshot).
    async fn pause_idle(&self, after: Duration) {
        let idle: Vec<Arc<Opened>> = match self.open.lock() {
            Ok(map) => map
                .iter()
                .filter(|((owner, _), o)| *owner == Owner::Api && o.may_pause(after))
                .map(|(_, o)| o.clone())
                .collect(),
            Err(_) => return,
        };
        for opened in idle {
            opened.pause().await;
        }
    }

    /// Takes back the sessions paused before the daemon last stopped, still paused: each
    /// resumes at its next block. One this daemon cannot open any more (its executor gone,
    /// the policy changed) is left on disk and named in the log.
    pub fn recover_paused(&self) {
        let files = self.supervisor.files().clone();
        let (daemon, _) = self.supervisor.running_here();
        let own = pause::kept(files.root())
            .into_iter()
            .filter(|r| r.daemon.is_empty() || r.daemon == daemon);
        for record in own {
            let ask = OpenAsk {
                executor: Some(record.executor.clone()),
                keep_state: record.keep_state,
                tools: record.tools.clone(),
                idle_timeout_secs: Some(record.idle_timeout_secs),
                limits: record.limits.clone(),
                files: None,
                network: record.network.clone(),
                restores_state: false,
                volumes: record.volumes.clone(),
            };
            let made = match self.made(Owner::Api, record.id.clone(), &ask, "session") {
                Ok(made) => made,
                Err(e) => {
                    tracing::warn!(session = %record.id, snapshot = %record.snapshot, error = %e.message, "a paused session cannot be taken back; its snapshot is kept");
                    continue;
                }
            };
            let opened = Opened::paused(made, &record);
            if let Ok(mut map) = self.open.lock() {
                map.insert((Owner::Api, record.id.clone()), opened);
            }
        }
    }

    /// Opens a sandbox for `owner` as `ask` says, named `id` (a new one when `None`), and
    /// keeps it open until it is closed, goes idle, or its owner or the daemon goes.
    pub async fn open(
        &self,
        owner: Owner,
        id: Option<String>,
        ask: OpenAsk,
    ) -> Result<Arc<Opened>, Refusal> {
        if let Some(id) = &id {
            valid_id(id)?;
        }
        self.room_for(owner)?;
        let road = match owner {
            Owner::Api => "session",
            Owner::Mcp(_) => "mcp",
        };
        let id = id.unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        let opened = self.opened(owner, id.clone(), ask, road).await?;
        let raced = match self.open.lock() {
            Ok(mut map)
                if Self::held_by(&map, owner) < owner.max_open(self.api_max)
                    && !self.supervisor.stopping() =>
            {
                match map.entry((owner, id)) {
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        slot.insert(opened.clone());
                        None
                    }
                    // Another call opened it first: this one is closed, theirs used.
                    std::collections::hash_map::Entry::Occupied(theirs) => {
                        Some(Ok(theirs.get().clone()))
                    }
                }
            }
            _ => Some(Err(owner.too_many(self.api_max))),
        };
        match raced {
            None => Ok(opened),
            Some(other) => {
                opened.close().await;
                other
            }
        }
    }

    /// `owner`'s sandbox `id`, opened with `ask` on first use; refused when it is open on
    /// another executor than `ask` names.
    pub async fn open_or_get(
        &self,
        owner: Owner,
        id: &str,
        ask: OpenAsk,
    ) -> Result<Arc<Opened>, Refusal> {
        let existing = self
            .open
            .lock()
            .ok()
            .and_then(|m| m.get(&(owner, id.to_owned())).cloned());
        let Some(opened) = existing else {
            return self.open(owner, Some(id.to_owned()), ask).await;
        };
        let asked = ask
            .executor
            .as_deref()
            .unwrap_or(&self.supervisor.defaults().executor);
        if opened.executor() != asked {
            return Err(Refusal::invalid(format!(
                "session `{id}` runs on the {} executor, not {asked}",
                opened.executor()
            )));
        }
        Ok(opened)
    }

    /// A sandbox for one block, in no list: the caller closes it after the block.
    pub async fn open_for_one(
        &self,
        ask: OpenAsk,
        road: &'static str,
    ) -> Result<Arc<Opened>, Refusal> {
        self.refuse_if_stopping()?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        self.opened(Owner::Api, id, ask, road).await
    }

    fn refuse_if_stopping(&self) -> Result<(), Refusal> {
        if self.supervisor.stopping() {
            return Err(Refusal::new(
                ApiErrorCode::ShuttingDown,
                "the daemon is shutting down and opens no new sandboxes",
            ));
        }
        Ok(())
    }

    fn room_for(&self, owner: Owner) -> Result<(), Refusal> {
        self.refuse_if_stopping()?;
        let held = self
            .open
            .lock()
            .map(|m| Self::held_by(&m, owner))
            .unwrap_or(0);
        let api = self.api_max;
        if held >= owner.max_open(api) {
            return Err(owner.too_many(api));
        }
        Ok(())
    }

    /// A sandbox opened as `ask` says, checked against the operator's policy.
    async fn opened(
        &self,
        owner: Owner,
        id: String,
        ask: OpenAsk,
        road: &'static str,
    ) -> Result<Arc<Opened>, Refusal> {
        let made = self.made(owner, id, &ask, road)?;
        let session = start(
            &made.sandbox,
            made.limits.clone(),
            ask.files,
            made.keep_state,
            road,
            made.volumes.clone(),
        )
        .await?;
        Ok(Opened::new(made, session))
    }

    /// What a sandbox `ask` says is made of, checked against the operator's policy, before
    /// its session is opened.
    fn made(
        &self,
        owner: Owner,
        id: String,
        ask: &OpenAsk,
        road: &'static str,
    ) -> Result<opened::Made, Refusal> {
        let mut tools: Vec<String> = Vec::new();
        for tool in &ask.tools {
            if !tandem_protocol::tools::valid_tool_name(tool) {
                return Err(Refusal::invalid(format!(
                    "tool name `{}` must be 1 to 64 letters, digits, `_` or `-`",
                    tool.chars().take(80).collect::<String>()
                )));
            }
            if tools.contains(tool) {
                return Err(Refusal::invalid(format!("tool `{tool}` is named twice")));
            }
            tools.push(tool.clone());
        }
        let idle = match ask.idle_timeout_secs {
            Some(0) => return Err(Refusal::invalid("idle_timeout_secs must be at least 1")),
            Some(secs) => Duration::from_secs(secs.min(IDLE.as_secs())),
            None => IDLE,
        };
        let planner = self.supervisor.planner();
        let (executor, sandbox) = planner.block_executor(ask.executor.as_deref())?;
        if ask.keep_state && !sandbox.keeps_state() {
            return Err(Refusal::invalid(format!(
                "the {executor} executor cannot keep an interpreter (keep_state); use local or docker, or leave keep_state out"
            )));
        }
        let keep_state = ask.keep_state || (ask.restores_state && sandbox.keeps_state());
        if !tools.is_empty() && !sandbox.carries_tool_calls() {
            return Err(Refusal::invalid(format!(
                "code in the {executor} executor cannot call tools; use local or docker, or leave tools out"
            )));
        }
        let limits = crate::policy::task_limits(&self.supervisor.defaults().limits, &ask.limits)
            .map_err(Refusal::invalid)?;
        planner
            .check_volumes(&ask.volumes, &*sandbox)
            .map_err(|e| Refusal::of_task(&e))?;
        let (volumes, held) = planner
            .hold_volumes(&ask.volumes)
            .map_err(|e| Refusal::of_task(&e))?;
        let (sandbox, net) = match planner.block_network(ask.network.as_ref(), &*sandbox)? {
            Some((egress, policy)) => {
                let route = Arc::new(opened::NetRoute::counted(
                    self.supervisor.metrics.net_counter(),
                    &executor,
                ));
                let behind: Arc<dyn Executor> = Arc::new(tandem_egress::Behind::new(
                    sandbox,
                    egress,
                    Arc::new(policy),
                    route.clone(),
                ));
                (behind, Some(route))
            }
            None => (sandbox, None),
        };
        Ok(opened::Made {
            id,
            owner,
            executor,
            sandbox,
            keep_state,
            tools,
            idle,
            net,
            limits,
            asked: opened::Asked {
                limits: ask.limits.clone(),
                network: ask.network.clone(),
                volumes: ask.volumes.clone(),
            },
            volumes,
            _held: held,
            road,
            files: self.supervisor.files().clone(),
            daemon: self.supervisor.running_here().0.to_owned(),
        })
    }
}

/// A client-chosen id: 1 to 64 letters, digits, `-` or `_`.
fn valid_id(id: &str) -> Result<(), Refusal> {
    if id.is_empty()
        || id.len() > 64
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Refusal::invalid(
            "session_id must be 1 to 64 letters, digits, `-` or `_`",
        ));
    }
    Ok(())
}

/// The executor's session for a sandbox without a task, its files placed and, with
/// `keep_state`, an interpreter kept.
pub(super) async fn start(
    sandbox: &Arc<dyn Executor>,
    limits: tandem_executor::Limits,
    files: Option<PathBuf>,
    keep_state: bool,
    road: &str,
    volumes: Vec<tandem_executor::VolumeBinding>,
) -> Result<Box<dyn Session>, Refusal> {
    // No task's label: the executor labels the sandbox with its owner and session (what
    // reaping needs), and a sandbox with no task can take a container the warm pool started.
    let spec = tandem_executor::SessionSpec {
        limits,
        keep_state,
        // Counted against the share of sandboxes clients may hold without a task.
        labels: vec![(
            tandem_executor_kit::WITHOUT_TASK.to_owned(),
            road.to_owned(),
        )],
        volumes,
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
    let mut session = sandbox.open(spec.clone()).await.map_err(unavailable)?;
    if let Some(files) = files {
        let caps = tandem_executor_kit::archive::ArchiveCaps {
            max_bytes: u64::MAX,
            max_entries: usize::MAX,
        };
        if let Err(e) = session.put_archive(&files, caps).await {
            let _ = session.close().await;
            return Err(Refusal::invalid(format!("placing the files failed: {e}")));
        }
    }
    if keep_state {
        session = Box::new(tandem_executor_kit::kept::KeptSession::new(
            session,
            sandbox.clone(),
            spec,
        ));
    }
    Ok(session)
}
