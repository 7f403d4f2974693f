//! `execute_code`: one block in a sandbox the operator offers, in the daemon's pool of
//! sandboxes without a task; with a `session_id`, in one of the connection's sandboxes.

use super::files::{packed, run_with_files};
use super::*;
use crate::sandbox::{OpenAsk, Owner, Pool, Refusal};

/// A connection's place in the pool: the sandboxes it holds are closed when it ends.
pub struct Sessions {
    pool: Arc<Pool>,
    owner: Owner,
    /// Counts the connection among the daemon's while it lives.
    _counted: Option<Counted>,
}

/// One of the daemon's MCP connections; dropping it frees its place.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Sessions {
    /// Closes every session (the connection ended).
    pub async fn close_all(&self) {
        self.pool.close_owner(self.owner).await;
    }
}

impl Drop for Sessions {
    fn drop(&mut self) {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (pool, owner) = (self.pool.clone(), self.owner);
            handle.spawn(async move { pool.close_owner(owner).await });
        }
    }
}

/// A refusal as MCP says it: a declined block is a result the client's model reads; any
/// other refusal is an error of the call.
fn refused(refusal: Refusal) -> Result<CallToolResult, ErrorData> {
    use tandem_protocol::ApiErrorCode as C;
    if refusal.declined {
        return Ok(declined(refusal.message));
    }
    Err(match refusal.code {
        C::Internal | C::ExecutorUnavailable | C::ShuttingDown | C::StoreUnavailable => {
            ErrorData::internal_error(refusal.message, None)
        }
        _ => ErrorData::invalid_params(refusal.message, None),
    })
}

impl TandemMcp {
    /// A server for one connection, its sandboxes in `pool`.
    pub fn new(pool: Arc<Pool>) -> Self {
        Self::counted(pool, None)
    }

    /// A server for one connection counted in `live` while it lives.
    pub(super) fn counted(pool: Arc<Pool>, live: Option<Arc<AtomicUsize>>) -> Self {
        let links_ports = live.is_some();
        let sessions = Arc::new(Sessions {
            owner: pool.connection(),
            pool: pool.clone(),
            _counted: live.map(Counted),
        });
        Self {
            supervisor: pool.supervisor().clone(),
            links_ports,
            sessions,
            calls: Arc::new(tokio::sync::Semaphore::new(MAX_CALLS)),
        }
    }

    /// The connection's sessions, to close them when it ends.
    pub fn sessions(&self) -> Arc<Sessions> {
        self.sessions.clone()
    }

    /// `snapshot`: one of this connection's sessions' workspace, kept.
    pub(super) async fn snapshot(&self, args: SnapshotArgs) -> Result<CallToolResult, ErrorData> {
        let opened = match self
            .sessions
            .pool
            .get(self.sessions.owner, &args.session_id)
        {
            Ok(opened) => opened,
            Err(refusal) => return refused(refusal),
        };
        match opened
            .snapshot(self.supervisor.files().snapshots(), args.name)
            .await
        {
            Ok(record) => {
                let text = format!(
                    "snapshot {} of session {}: {} files, {} bytes{}",
                    record.id,
                    args.session_id,
                    record.files,
                    record.bytes,
                    record
                        .not_saved
                        .iter()
                        .map(|n| format!("\nnot saved: {} ({})", n.name, n.why))
                        .collect::<String>()
                );
                let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
                result.structured_content = serde_json::to_value(&record).ok();
                Ok(result)
            }
            Err(refusal) => refused(refusal),
        }
    }

    pub(super) async fn execute_code(
        &self,
        args: ExecuteCodeArgs,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        match self.execute(args, context).await {
            Ok(result) => Ok(result),
            Err(Failed::Refused(refusal)) => refused(refusal),
            Err(Failed::Error(e)) => Err(e),
        }
    }

    async fn execute(
        &self,
        args: ExecuteCodeArgs,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, Failed> {
        let ExecuteCodeArgs {
            language,
            code,
            session_id,
            executor,
            timeout_secs,
            files,
            network,
            from_snapshot,
            volumes,
        } = args;
        let pool = &self.sessions.pool;
        // Restored only for a sandbox this call opens; a session's first call decides.
        let fresh = session_id
            .as_deref()
            .is_none_or(|id| pool.get(self.sessions.owner, id).is_err());
        let restored = match from_snapshot.as_deref() {
            Some(snap) if fresh => Some(pool.restored(snap).await?),
            _ => None,
        };
        let (_, sandbox) = self
            .supervisor
            .planner()
            .block_executor(executor.as_deref())?;
        let request =
            self.supervisor
                .planner()
                .check_block(&*sandbox, &language, code, timeout_secs)?;
        // On disk, where a session's put_archive reads it.
        let given = match files.as_deref() {
            None | Some([]) => None,
            Some(files) => {
                let archive = packed(files, self.supervisor.files().upload_caps())?;
                let file = tempfile::NamedTempFile::new()
                    .and_then(|mut f| std::io::Write::write_all(&mut f, &archive).map(|()| f))
                    .map_err(|e| {
                        ErrorData::internal_error(format!("packing the files failed: {e}"), None)
                    })?;
                Some(file)
            }
        };
        let ask = OpenAsk {
            executor,
            network: network.map(|n| tandem_protocol::net::NetworkRequest { allow: n.allow }),
            files: restored.as_ref().map(|r| r.tar.to_path_buf()),
            restores_state: restored.as_ref().is_some_and(|r| r.keeps_state),
            volumes: volumes
                .unwrap_or_default()
                .into_iter()
                .map(super::VolumeArg::mount)
                .collect(),
            ..OpenAsk::default()
        };
        let opened = match &session_id {
            Some(id) => pool.open_or_get(self.sessions.owner, id, ask).await?,
            None => pool.open_for_one(ask, "mcp").await?,
        };
        drop(restored);
        let ran = async {
            let claim = opened.claim_in_turn(context.ct.clone()).await?;
            // Like a task, a call takes one of the daemon's execution slots while it runs.
            let _slot = self
                .supervisor
                .execution_slot(&context.ct)
                .await
                .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
            let mut guard = claim.session().await.map_err(Failed::Refused)?;
            let Some(session) = guard.as_mut() else {
                return Err(Failed::Refused(Refusal::invalid(format!(
                    "session `{}` was closed; use another id",
                    opened.id()
                ))));
            };
            let caps = self.supervisor.files().upload_caps();
            let given = given.as_ref().map(|f| (f.path(), caps));
            let ctx = ExecContext::new(context.ct.clone());
            let (net_tx, net_rx) = tokio::sync::mpsc::unbounded_channel();
            if let Some(route) = opened.net_route() {
                route.take_bytes();
                route.route_to(Some(net_tx));
            }
            let mut ran = run_with_files(session.as_mut(), given, request, ctx).await;
            if let Some(route) = opened.net_route() {
                route.settle(std::time::Duration::from_secs(2)).await;
                route.route_to(None);
                let (bytes_in, bytes_out) = route.take_bytes();
                if let Ok((outcome, _)) = &mut ran {
                    let r = outcome.resources.get_or_insert_with(Default::default);
                    r.net_bytes_in = Some(bytes_in);
                    r.net_bytes_out = Some(bytes_out);
                }
            }
            if let Ok((outcome, _)) = &ran
                && let Some(r) = &outcome.resources
            {
                opened.add_resources(r);
                self.supervisor.metrics.resources(opened.executor(), r);
            }
            Ok::<_, Failed>((ran?, net_rx))
        }
        .await;
        // A server the block left listening in a session that stays open: a link to each
        // port, which the client opens without the token.
        let mut served = Vec::new();
        if session_id.is_some()
            && self.links_ports
            && let Some(ports) = opened.ports()
            && let Ok(listening) = ports.listening().await
        {
            let expires = crate::now_ms() / 1000 + PORT_LINK_SECS;
            for port in listening {
                let link = self.supervisor.links.sign(
                    crate::ports::Holder::Session,
                    opened.id(),
                    port,
                    expires,
                );
                served.push(format!(
                    "port {port} is listening: the daemon serves it at /v1/ports/{link}/ for an hour, while this session is open"
                ));
            }
        }
        if session_id.is_none() {
            opened.close().await;
        }
        let ((outcome, pictures), mut net_rx) = ran?;
        let mut result = outcome_result(&outcome, session_id.as_deref());
        result.content.extend(pictures);
        if !served.is_empty() {
            result.content.push(ContentBlock::text(served.join("\n")));
        }
        // Each connection the block made through the egress proxy, one line each.
        let mut nets = Vec::new();
        while let Ok(event) = net_rx.try_recv() {
            if let tandem_protocol::session::ExecEvent::Net(net) = event {
                nets.push(net.line());
            }
        }
        if !nets.is_empty() {
            result.content.push(ContentBlock::text(nets.join("\n")));
        }
        Ok(result)
    }
}

/// How long the link to a port an MCP answer names lasts.
const PORT_LINK_SECS: u64 = 3600;

/// Why a call failed: refused by the pool's one check, or broken on the way.
enum Failed {
    Refused(Refusal),
    Error(ErrorData),
}

impl From<Refusal> for Failed {
    fn from(r: Refusal) -> Self {
        Failed::Refused(r)
    }
}

impl From<ErrorData> for Failed {
    fn from(e: ErrorData) -> Self {
        Failed::Error(e)
    }
}
/// A call's result when the block was not run: an error result the client's model reads.
fn declined(text: String) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(text.clone())]);
    result.structured_content = serde_json::to_value(tandem_protocol::mcp::Declined {
        status: "declined".to_owned(),
        reason: text,
    })
    .ok();
    result
}

fn outcome_result(outcome: &ExecOutcome, session_id: Option<&str>) -> CallToolResult {
    let (status, exit_code) = match outcome.status {
        ExitStatus::Exited(code) => ("exited".to_owned(), Some(code)),
        ExitStatus::Signaled(signal) => (format!("killed by signal {signal}"), None),
        ExitStatus::TimedOut => ("timed out".to_owned(), None),
        ExitStatus::OutOfMemory => ("out of memory".to_owned(), None),
        ExitStatus::Cancelled => ("cancelled".to_owned(), None),
    };
    let (stdout, stderr) = (outcome.stdout.to_text(), outcome.stderr.to_text());
    let duration_ms = outcome.duration.as_secs_f64() * 1000.0;
    let structured = tandem_protocol::mcp::ExecuteCodeResult {
        exit_code,
        status: status.clone(),
        stdout: stdout.clone(),
        stderr: stderr.clone(),
        stdout_truncated: outcome.stdout.truncated(),
        stderr_truncated: outcome.stderr.truncated(),
        duration_ms,
        session_id: session_id.map(str::to_owned),
        resources: outcome.resources.clone(),
    };
    let mut text = match exit_code {
        Some(code) => format!("exit {code}"),
        None => status,
    };
    text.push_str(&format!(" in {duration_ms:.0} ms"));
    if let Some(used) = outcome.resources.as_ref().map(|r| r.summary())
        && !used.is_empty()
    {
        text.push_str(" · ");
        text.push_str(&used);
    }
    text.push('\n');
    if !stdout.is_empty() {
        text.push_str(&format!("--- stdout\n{stdout}"));
    }
    if !stderr.is_empty() {
        text.push_str(&format!("--- stderr\n{stderr}"));
    }
    let mut result = if exit_code == Some(0) {
        CallToolResult::success(vec![ContentBlock::text(text)])
    } else {
        CallToolResult::error(vec![ContentBlock::text(text)])
    };
    result.structured_content = serde_json::to_value(structured).ok();
    result
}
