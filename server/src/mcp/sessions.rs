//! `execute_code`: a connection's sessions, and one block run in a sandbox the operator offers.

use super::files::{packed, run_with_files};
use super::*;

/// A connection's `execute_code` sessions by id.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Entry>>>>,
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

/// An `execute_code` call, checked.
struct Call {
    request: ExecRequest,
    sandbox: Arc<dyn tandem_executor::Executor>,
    executor: String,
    session_id: Option<String>,
    /// The files to place first, packed.
    given: Option<tempfile::NamedTempFile>,
}

struct Entry {
    /// `None` once closed.
    session: Option<Box<dyn Session>>,
    executor: String,
    used: Instant,
}

impl Sessions {
    /// Closes every session (the connection ended).
    pub async fn close_all(&self) {
        let entries: Vec<_> = self
            .map
            .lock()
            .map(|mut m| m.drain().map(|(_, e)| e).collect())
            .unwrap_or_default();
        for entry in entries {
            close(&entry).await;
        }
    }

    async fn close_idle(&self, idle: Duration) {
        let stale: Vec<_> = {
            let Ok(mut map) = self.map.lock() else {
                return;
            };
            let ids: Vec<String> = map
                .iter()
                .filter(|(_, e)| e.try_lock().is_ok_and(|e| e.used.elapsed() > idle))
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| map.remove(id)).collect()
        };
        for entry in stale {
            close(&entry).await;
        }
    }
}

async fn close(entry: &tokio::sync::Mutex<Entry>) {
    let session = entry.lock().await.session.take();
    if let Some(session) = session
        && let Err(e) = session.close().await
    {
        tracing::warn!(error = %e, "closing an MCP session's sandbox failed");
    }
}

impl Drop for Sessions {
    fn drop(&mut self) {
        let entries: Vec<_> = self
            .map
            .get_mut()
            .map(|m| m.drain().map(|(_, e)| e).collect())
            .unwrap_or_default();
        if entries.is_empty() {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                for entry in entries {
                    close(&entry).await;
                }
            });
        }
    }
}

impl TandemMcp {
    /// A server for one connection; its idle sessions are closed in the background.
    pub fn new(supervisor: Arc<Supervisor>) -> Self {
        Self::counted(supervisor, None)
    }

    /// A server for one connection counted in `live` while it lives.
    pub(super) fn counted(supervisor: Arc<Supervisor>, live: Option<Arc<AtomicUsize>>) -> Self {
        let sessions = Arc::new(Sessions {
            map: Mutex::default(),
            _counted: live.map(Counted),
        });
        let weak: Weak<Sessions> = Arc::downgrade(&sessions);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SESSION_IDLE / 10);
            loop {
                tick.tick().await;
                let Some(sessions) = weak.upgrade() else {
                    return;
                };
                sessions.close_idle(SESSION_IDLE).await;
            }
        });
        Self {
            supervisor,
            sessions,
            calls: Arc::new(tokio::sync::Semaphore::new(MAX_CALLS)),
        }
    }

    /// The connection's sessions, to close them when it ends.
    pub fn sessions(&self) -> Arc<Sessions> {
        self.sessions.clone()
    }

    pub(super) async fn execute_code(
        &self,
        args: ExecuteCodeArgs,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let call = match self.call_of(args)? {
            Ok(call) => call,
            Err(declined) => return Ok(declined),
        };
        // Like a task, a call takes one of the daemon's execution slots while it runs.
        let _slot = self
            .supervisor
            .execution_slot(&context.ct)
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let ctx = ExecContext::new(context.ct.clone());
        let limits = self.supervisor.defaults().limits.clone();
        let caps = self.supervisor.files().upload_caps();
        let given = call.given.as_ref().map(|f| (f.path(), caps));
        let (outcome, pictures) = match call.session_id.clone() {
            None => {
                let mut session = open(&*call.sandbox, limits).await?;
                let ran = run_with_files(session.as_mut(), given, call.request, ctx).await;
                let _ = session.close().await;
                ran?
            }
            Some(id) => {
                let entry = self
                    .session(&id, &call.executor, &*call.sandbox, limits)
                    .await?;
                let mut entry = entry.lock().await;
                entry.used = Instant::now();
                match entry.session.as_mut() {
                    Some(session) => {
                        run_with_files(session.as_mut(), given, call.request, ctx).await?
                    }
                    None => {
                        return Err(ErrorData::invalid_params(
                            format!("session `{id}` was closed; use another id"),
                            None,
                        ));
                    }
                }
            }
        };
        let mut result = outcome_result(&outcome, call.session_id.as_deref());
        result.content.extend(pictures);
        Ok(result)
    }

    /// The call `args` ask for, checked against the caps, the executor and the operator's
    /// policy; `Ok(Err(result))` when the policy declines it without a person to ask.
    fn call_of(&self, args: ExecuteCodeArgs) -> Result<Result<Call, CallToolResult>, ErrorData> {
        let ExecuteCodeArgs {
            language,
            code,
            session_id,
            executor,
            timeout_secs,
            files,
        } = args;
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
        if code.len() > MAX_CODE_BYTES {
            return Err(ErrorData::invalid_params(
                format!(
                    "code is {} bytes; execute_code takes at most {MAX_CODE_BYTES}",
                    code.len()
                ),
                None,
            ));
        }
        if let Some(id) = &session_id
            && (id.is_empty()
                || id.len() > 64
                || !id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
        {
            return Err(ErrorData::invalid_params(
                "session_id must be 1 to 64 letters, digits, `-` or `_`",
                None,
            ));
        }
        let executor = executor.unwrap_or_else(|| self.supervisor.defaults().executor.clone());
        let sandbox = self
            .supervisor
            .offered(&executor)
            .map_err(|e| ErrorData::invalid_params(e.to_string(), None))?;
        let language = Language::new(&language);
        if !sandbox.supports(&language) {
            return Err(ErrorData::invalid_params(
                tandem_executor::ExecError::unsupported(&language, &executor, sandbox.languages())
                    .to_string(),
                None,
            ));
        }
        let mut request = ExecRequest::new(language.clone(), code);
        if let Some(secs) = timeout_secs {
            if secs.is_nan() || secs <= 0.0 {
                return Err(ErrorData::invalid_params(
                    "timeout_secs must be a positive number",
                    None,
                ));
            }
            let asked = Duration::try_from_secs_f64(secs)
                .map_err(|_| ErrorData::invalid_params("timeout_secs is too large", None))?;
            request.timeout = Some(asked.min(self.supervisor.policy().max_block_timeout));
        }
        // The operator's approval policy holds here as in a task. No one can be asked in the
        // middle of a tool call, so a block that needs a person is refused with the way to
        // get one: a task, whose blocks wait for approval.
        let gate = tandem_agent::ApprovalGate::new(self.supervisor.approval(), None)
            .map_err(|e| ErrorData::internal_error(format!("approval: {e}"), None))?;
        if let Some(why) = gate.unattended(&language, sandbox.as_ref(), &request.code) {
            return Ok(Err(declined(format!(
                "declined: {why}; run_task runs code whose blocks wait for a person's approval in the daemon"
            ))));
        }
        Ok(Ok(Call {
            request,
            sandbox,
            executor,
            session_id,
            given,
        }))
    }

    /// The session `id` of this connection, opened on first use.
    async fn session(
        &self,
        id: &str,
        executor: &str,
        sandbox: &dyn tandem_executor::Executor,
        limits: Limits,
    ) -> Result<Arc<tokio::sync::Mutex<Entry>>, ErrorData> {
        let existing = self
            .sessions
            .map
            .lock()
            .ok()
            .and_then(|m| m.get(id).cloned());
        if let Some(entry) = existing {
            let owner = entry.lock().await.executor.clone();
            if owner != executor {
                return Err(ErrorData::invalid_params(
                    format!("session `{id}` runs on the {owner} executor, not {executor}"),
                    None,
                ));
            }
            return Ok(entry);
        }
        if self.sessions.map.lock().map(|m| m.len()).unwrap_or(0) >= MAX_SESSIONS {
            return Err(ErrorData::invalid_params(
                format!("this connection already holds {MAX_SESSIONS} sessions; reuse one"),
                None,
            ));
        }
        let session = open(sandbox, limits).await?;
        let entry = Arc::new(tokio::sync::Mutex::new(Entry {
            session: Some(session),
            executor: executor.to_owned(),
            used: Instant::now(),
        }));
        let raced = self.sessions.map.lock().ok().map(|mut m| {
            m.entry(id.to_owned())
                .or_insert_with(|| entry.clone())
                .clone()
        });
        match raced {
            // Another call opened it first: this one is closed, theirs used.
            Some(theirs) if !Arc::ptr_eq(&theirs, &entry) => {
                close(&entry).await;
                Ok(theirs)
            }
            _ => Ok(entry),
        }
    }
}

async fn open(
    sandbox: &dyn tandem_executor::Executor,
    limits: Limits,
) -> Result<Box<dyn Session>, ErrorData> {
    sandbox
        .open(SessionSpec {
            limits,
            labels: vec![(tandem_executor::WITHOUT_TASK.to_owned(), "mcp".to_owned())],
            ..SessionSpec::default()
        })
        .await
        .map_err(|e| ErrorData::internal_error(format!("opening a sandbox failed: {e}"), None))
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
    };
    let mut text = match exit_code {
        Some(code) => format!("exit {code}"),
        None => status,
    };
    text.push_str(&format!(" in {duration_ms:.0} ms\n"));
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
