//! Tandem's sandboxes and tasks as a Model Context Protocol server, for the agents people
//! already use: `tandem mcp` serves it over stdio, and the daemon over streamable HTTP at
//! `/mcp` (behind the API's auth).
//!
//! Tools:
//! - `execute_code`: one block in an executor the operator's policy offers; with a
//!   `session_id`, files persist between calls in that session's workspace;
//! - `run_task`: a whole task (the pair, or a team), its events streamed as progress
//!   notifications, its answer and stop reason returned.
//!
//! Resources: each task's transcript, `tandem://tasks/{id}/transcript`.
//!
//! Sessions belong to one MCP connection: they are closed when it ends and after
//! [`SESSION_IDLE`] without use.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use rmcp::handler::server::common::schema_for_type;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    InitializeResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ProgressNotificationParam, ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult,
    Resource, ResourceContents, ServerCapabilities, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use schemars::JsonSchema;
use serde_json::{Value, json};
use tandem_executor::{
    CancellationToken, ExecContext, ExecOutcome, ExecRequest, ExitStatus, Language, Limits,
    Session, SessionSpec,
};
use tandem_protocol::{EventMsg, TaskSpec};

use crate::follow::Follower;
use crate::supervisor::{Supervisor, TaskError};

/// The largest block `execute_code` takes.
pub const MAX_CODE_BYTES: usize = 1 << 20;
/// How long an `execute_code` session lives unused.
pub const SESSION_IDLE: Duration = Duration::from_secs(600);
/// Most sessions one connection may hold at once.
const MAX_SESSIONS: usize = 8;
/// Most tool calls one connection may have running at once.
const MAX_CALLS: usize = 4;
/// Most MCP connections the daemon serves at once over HTTP.
const MAX_CONNECTIONS: usize = 64;
/// Transcripts `resources/list` shows: the latest tasks.
const LISTED_TASKS: usize = 50;

/// One MCP connection's server.
#[derive(Clone)]
pub struct TandemMcp {
    supervisor: Arc<Supervisor>,
    sessions: Arc<Sessions>,
    calls: Arc<tokio::sync::Semaphore>,
}

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
    fn counted(supervisor: Arc<Supervisor>, live: Option<Arc<AtomicUsize>>) -> Self {
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

    async fn execute_code(
        &self,
        args: ExecuteCodeArgs,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let ExecuteCodeArgs {
            language,
            code,
            session_id,
            executor,
            timeout_secs,
            files,
        } = args;
        let caps = self.supervisor.files().upload_caps();
        // On disk, where a session's put_archive reads it.
        let given = match files.as_deref() {
            None | Some([]) => None,
            Some(files) => {
                let archive = packed(files, caps)?;
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
        let defaults = self.supervisor.defaults();
        let executor = executor.unwrap_or_else(|| defaults.executor.clone());
        let policy = self.supervisor.policy();
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
            request.timeout = Some(asked.min(policy.max_block_timeout));
        }
        // The operator's approval policy holds here as in a task. No one can be asked in the
        // middle of a tool call, so a block that needs a person is refused with the way to
        // get one: a task, whose blocks wait for approval.
        let gate = tandem_agent::ApprovalGate::new(self.supervisor.approval(), None)
            .map_err(|e| ErrorData::internal_error(format!("approval: {e}"), None))?;
        if let Some(why) = gate.unattended(&language, sandbox.as_ref(), &request.code) {
            return Ok(declined(format!(
                "declined: {why}; run_task runs code whose blocks wait for a person's approval in the daemon"
            )));
        }
        // Like a task, a call takes one of the daemon's execution slots while it runs.
        let _slot = self
            .supervisor
            .execution_slot(&context.ct)
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let ctx = ExecContext::new(context.ct.clone());
        let limits = defaults.limits.clone();
        let given = given.as_ref().map(|f| (f.path(), caps));
        let (outcome, pictures) = match session_id.clone() {
            None => {
                let mut session = open(&*sandbox, limits).await?;
                let ran = run_with_files(session.as_mut(), given, request, ctx).await;
                let _ = session.close().await;
                ran?
            }
            Some(id) => {
                let entry = self.session(&id, &executor, &*sandbox, limits).await?;
                let mut entry = entry.lock().await;
                entry.used = Instant::now();
                match entry.session.as_mut() {
                    Some(session) => run_with_files(session.as_mut(), given, request, ctx).await?,
                    None => {
                        return Err(ErrorData::invalid_params(
                            format!("session `{id}` was closed; use another id"),
                            None,
                        ));
                    }
                }
            }
        };
        let mut result = outcome_result(&outcome, session_id.as_deref());
        result.content.extend(pictures);
        Ok(result)
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

    async fn run_task(
        &self,
        args: RunTaskArgs,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut spec = TaskSpec {
            task: args.task,
            executor: args.executor,
            max_turns: args.max_turns,
            keep_state: args.keep_state.unwrap_or(false),
            placement: args.placement.unwrap_or_default(),
            code_via: args
                .code_via
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: String| ErrorData::invalid_params(e, None))?,
            tools: args
                .tools
                .map(|tools| {
                    tools
                        .into_iter()
                        .map(serde_json::from_value)
                        .collect::<Result<Vec<tandem_protocol::ToolRef>, _>>()
                })
                .transpose()
                .map_err(|e| {
                    ErrorData::invalid_params(
                        format!("tools: each is a tool's name or {{name, command, ...}} (docs/tools.md): {e}"),
                        None,
                    )
                })?,
            ..TaskSpec::default()
        };
        if let Some(files) = args.files.as_deref().filter(|f| !f.is_empty()) {
            let files_of = self.supervisor.files();
            let archive = packed(files, files_of.upload_caps())?;
            let upload = files_of
                .receive(axum::body::Body::from(archive))
                .await
                .map_err(|e| ErrorData::invalid_params(format!("files: {e}"), None))?;
            spec.files = Some(upload.id);
        }
        if let Some(team) = args.team {
            spec.team = Some(serde_json::from_value(team).map_err(|e| {
                ErrorData::invalid_params(format!("team is not a team (docs/teams.md): {e}"), None)
            })?);
        }
        // Subscribed before the task exists, so that none of its events is missed.
        let live = self.supervisor.subscribe();
        let record = self.supervisor.submit(spec).await.map_err(|e| match e {
            TaskError::Invalid(_) | TaskError::NotAllowed(_) | TaskError::Unavailable(_) => {
                ErrorData::invalid_params(e.to_string(), None)
            }
            other => ErrorData::internal_error(other.to_string(), None),
        })?;
        let id = record.id;
        let progress = context.meta.get_progress_token();
        let mut sent = 0u32;
        let mut drawn = Vec::new();
        let mut called = Vec::new();
        let mut follower = Follower::new(
            self.supervisor.clone(),
            id.clone(),
            0,
            Some(live),
            CancellationToken::new(),
        );
        let finished = loop {
            let next = tokio::select! {
                () = context.ct.cancelled() => {
                    let _ = self.supervisor.cancel(&id);
                    return Err(ErrorData::internal_error(format!("task {id} was cancelled by the client"), None));
                }
                next = follower.next() => next,
            };
            let Some(event) = next else {
                return Err(ErrorData::internal_error(
                    "the daemon is shutting down; the task is kept and can be resumed",
                    None,
                ));
            };
            if let Some(token) = &progress {
                sent += 1;
                let message = serde_json::to_string(&event).unwrap_or_default();
                let _ = context
                    .peer
                    .notify_progress(
                        ProgressNotificationParam::new(token.clone(), f64::from(sent))
                            .with_message(message),
                    )
                    .await;
            }
            match event.msg {
                EventMsg::Artifact {
                    file, mime, bytes, ..
                } => drawn.push((file, mime, bytes)),
                EventMsg::ToolResult {
                    name,
                    is_error,
                    duration_ms,
                    ..
                } => called
                    .push(json!({"name": name, "is_error": is_error, "duration_ms": duration_ms})),
                EventMsg::TaskFinished { .. } => break event.msg,
                _ => {}
            }
        };
        let EventMsg::TaskFinished {
            stop_reason,
            turns,
            error,
            summary,
            ..
        } = finished
        else {
            return Err(ErrorData::internal_error(
                "the task ended without its last event",
                None,
            ));
        };
        let uri = transcript_uri(&id);
        let pictures: Vec<Value> = drawn
            .iter()
            .map(|(path, mime, bytes)| {
                json!({"path": path, "mime": mime, "bytes": bytes, "uri": file_uri(&id, path)})
            })
            .collect();
        // What the task made stays in its workspace, as resources: the files it was not given
        // (or changed), named so the agent can read them.
        let files_of = self.supervisor.files().clone();
        let task = id.clone();
        let made: Vec<Value> = tokio::task::spawn_blocking(move || files_of.list(&task))
            .await
            .ok()
            .and_then(Result::ok)
            .map(|list| {
                list.files
                    .into_iter()
                    .filter(|f| {
                        !f.given && !tandem_executor::made::is_tandems(std::path::Path::new(&f.path))
                    })
                    .map(|f| json!({"path": f.path, "bytes": f.bytes, "uri": file_uri(&id, &f.path)}))
                    .collect()
            })
            .unwrap_or_default();
        let structured = json!({
            "task_id": id,
            "stop_reason": stop_reason,
            "turns": turns,
            "answer": summary,
            "error": error,
            "transcript": uri,
            "pictures": pictures,
            "files": made,
            "tool_calls": called,
        });
        let text = match (&summary, &error) {
            (_, Some(e)) => format!("task {id} failed: {}\n(transcript: {uri})", e.message),
            (Some(answer), None) => format!(
                "{answer}\n\n(task {id}: {stop_reason:?} after {turns} turns; transcript: {uri})"
            ),
            (None, None) => {
                format!("task {id} ended: {stop_reason:?} after {turns} turns (transcript: {uri})")
            }
        };
        let text = match made.len() {
            0 => text,
            n => format!(
                "{text}\n(the task made {n} file{}: {})",
                if n == 1 { "" } else { "s" },
                made.iter()
                    .take(MADE_NAMED)
                    .filter_map(|f| f["uri"].as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
                    + if n > MADE_NAMED { ", ..." } else { "" }
            ),
        };
        let mut content = vec![ContentBlock::text(text)];
        // The last version of each picture, as the task left it.
        let mut seen = std::collections::HashSet::new();
        let last: Vec<_> = drawn
            .iter()
            .rev()
            .filter(|(path, _, _)| seen.insert(path.clone()))
            .take(MAX_PICTURES)
            .collect();
        for (path, mime, _) in last.into_iter().rev() {
            let read = self.supervisor.files().open(&id, path);
            if let Ok((file, len)) = read
                && let Some(image) = image_of(file, len, mime)
            {
                content.push(image);
            }
        }
        let mut result = CallToolResult::success(content);
        result.structured_content = Some(structured);
        Ok(result)
    }
}

/// Most files a task made that `run_task`'s text names; `files` lists them all.
const MADE_NAMED: usize = 20;

/// Most pictures one tool result carries as images; the rest are named by their URIs.
const MAX_PICTURES: usize = 8;
/// Largest picture a tool result carries whole.
const MAX_PICTURE_BYTES: u64 = 4 << 20;

/// `file` as image content, when it is small enough to carry.
fn image_of(mut file: std::fs::File, len: u64, mime: &str) -> Option<ContentBlock> {
    use base64::Engine as _;
    use std::io::Read as _;
    if len > MAX_PICTURE_BYTES {
        return None;
    }
    let mut bytes = Vec::new();
    (&mut file).take(len).read_to_end(&mut bytes).ok()?;
    Some(ContentBlock::image(
        base64::engine::general_purpose::STANDARD.encode(bytes),
        mime,
    ))
}

/// Files given to a call, packed into a tar archive (checked again where they are placed).
/// Each has exactly one of `text` and `base64`.
fn packed(
    files: &[FileArg],
    caps: tandem_executor::archive::ArchiveCaps,
) -> Result<Vec<u8>, ErrorData> {
    use base64::Engine as _;
    let bad = |message: String| ErrorData::invalid_params(message, None);
    if files.len() > caps.max_entries {
        return Err(bad(format!(
            "files: {} files; at most {} may be given",
            files.len(),
            caps.max_entries
        )));
    }
    let mut builder = tar::Builder::new(Vec::new());
    let mut total = 0u64;
    for (i, f) in files.iter().enumerate() {
        let data = match (&f.text, &f.base64) {
            (Some(text), None) => text.clone().into_bytes(),
            (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|e| {
                    bad(format!(
                        "files[{i}] ({}): base64 does not decode: {e}",
                        f.path
                    ))
                })?,
            _ => {
                return Err(bad(format!(
                    "files[{i}] ({}): give exactly one of `text` and `base64`",
                    f.path
                )));
            }
        };
        total += data.len() as u64;
        if total > caps.max_bytes {
            return Err(bad(format!(
                "files: over the {} byte limit (at `{}`)",
                caps.max_bytes, f.path
            )));
        }
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, &f.path, &data[..])
            .map_err(|e| {
                bad(format!(
                    "files[{i}]: `{}` cannot be a file's path: {e}",
                    f.path
                ))
            })?;
    }
    builder
        .into_inner()
        .map_err(|e| ErrorData::internal_error(format!("packing the files failed: {e}"), None))
}

/// Runs `request` in `session` after placing `given` (a tar archive and its caps) there; the
/// outcome and the pictures the block wrote, as image content.
async fn run_with_files(
    session: &mut dyn Session,
    given: Option<(&std::path::Path, tandem_executor::archive::ArchiveCaps)>,
    request: ExecRequest,
    ctx: ExecContext,
) -> Result<(ExecOutcome, Vec<ContentBlock>), ErrorData> {
    if let Some((archive, caps)) = given {
        session
            .put_archive(archive, caps)
            .await
            .map_err(|e| ErrorData::invalid_params(format!("files: {e}"), None))?;
    }
    let workspace = session.workspace().map(std::path::Path::to_owned);
    let before = tandem_agent::blocks::pictures_in(workspace.clone()).await;
    let outcome = session
        .run(request, ctx)
        .await
        .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
    let mut images = Vec::new();
    if let Some(workspace) = &workspace {
        let drawn = tandem_agent::blocks::drawn_since(
            &before,
            tandem_agent::blocks::pictures_in(Some(workspace.clone())).await,
        );
        for picture in drawn.into_iter().take(MAX_PICTURES) {
            let path = picture.path.to_string_lossy();
            if let Ok((file, len)) = tandem_executor::archive::read(workspace, &path)
                && let Some(image) = image_of(file, len, picture.mime)
            {
                images.push(image);
            }
        }
    }
    Ok((outcome, images))
}

/// A file of a task's workspace, as an MCP resource.
fn file_uri(id: &str, path: &str) -> String {
    format!("tandem://tasks/{id}/files/{path}")
}

impl TandemMcp {
    /// The file `path` of task `id`'s workspace, as text or as a base64 blob.
    async fn read_file(
        &self,
        id: &str,
        path: &str,
        uri: &str,
    ) -> Result<ReadResourceResponse, ErrorData> {
        use base64::Engine as _;
        use std::io::Read as _;
        let (id, path) = (id.to_owned(), path.to_owned());
        let read = self
            .supervisor
            .off_thread(move |sup| -> Result<Vec<u8>, TaskError> {
                let record = sup
                    .store()
                    .get(&id)?
                    .ok_or_else(|| TaskError::NotFound(id.clone()))?;
                if let Some(at_ms) = record.files_removed_ms {
                    return Err(crate::files::FilesError::Removed { task: id, at_ms }.into());
                }
                let (file, len) = sup.files().open(&id, &path)?;
                if len > MAX_RESOURCE_BYTES {
                    return Err(crate::files::FilesError::NotFound(format!(
                        "`{path}` is {len} bytes, over the {MAX_RESOURCE_BYTES} a resource carries; GET /v1/tasks/{id}/files/{path} serves it whole"
                    ))
                    .into());
                }
                let mut bytes = Vec::new();
                file.take(len)
                    .read_to_end(&mut bytes)
                    .map_err(|e| crate::files::FilesError::NotFound(e.to_string()))?;
                Ok(bytes)
            })
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?
            .map_err(|e| ErrorData::resource_not_found(e.to_string(), None))?;
        let (mime, _) = crate::files::media_type(uri);
        let contents = match String::from_utf8(read) {
            Ok(text) if mime.starts_with("text/") || mime == "application/json" => {
                ResourceContents::text(text, uri.to_owned())
            }
            Ok(text) => ResourceContents::blob(
                base64::engine::general_purpose::STANDARD.encode(text),
                uri.to_owned(),
            ),
            Err(e) => ResourceContents::blob(
                base64::engine::general_purpose::STANDARD.encode(e.into_bytes()),
                uri.to_owned(),
            ),
        };
        Ok(ReadResourceResult::new(vec![contents.with_mime_type(mime)]).into())
    }
}

/// Largest file a resource read carries.
const MAX_RESOURCE_BYTES: u64 = 16 << 20;

fn transcript_uri(id: &str) -> String {
    format!("tandem://tasks/{id}/transcript")
}

/// `execute_code`'s arguments; the tool's schema is derived from them.
#[derive(Debug, serde::Deserialize, JsonSchema)]
struct ExecuteCodeArgs {
    /// python, sh, javascript, ... (what the executor runs)
    language: String,
    /// The code to run.
    #[schemars(length(max = MAX_CODE_BYTES))]
    code: String,
    /// Files persist between calls with the same id (closed when the connection ends or after 10 minutes unused)
    session_id: Option<String>,
    /// A sandbox the operator offers (default: the daemon's)
    executor: Option<String>,
    /// Wall-clock limit for the block, in seconds (at most the operator's).
    #[schemars(extend("exclusiveMinimum" = 0))]
    timeout_secs: Option<f64>,
    /// Files to place in the workspace before the code runs
    files: Option<Vec<FileArg>>,
}

/// A file given to a call: where it goes and what it holds.
#[derive(Debug, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct FileArg {
    /// Its path in the workspace, relative (`data/sales.csv`)
    path: String,
    /// Its content, when it is text
    text: Option<String>,
    /// Its content, base64-encoded (for binary files)
    base64: Option<String>,
}

/// `run_task`'s arguments; the tool's schema is derived from them.
#[derive(Debug, serde::Deserialize, JsonSchema)]
struct RunTaskArgs {
    /// The task, in words.
    task: String,
    /// A sandbox the operator offers (default: the daemon's)
    executor: Option<String>,
    /// A team of agents, as in the HTTP API (docs/teams.md)
    #[schemars(extend("type" = "object"))]
    team: Option<Value>,
    /// Most turns.
    #[schemars(range(min = 1))]
    max_turns: Option<u32>,
    /// Files to place in the task's workspace; the model is told what they are
    files: Option<Vec<FileArg>>,
    /// Python blocks share one interpreter whose variables survive (local and docker)
    keep_state: Option<bool>,
    /// Labels the Docker host that runs the task's sandbox must carry ({"gpu": "yes"})
    placement: Option<std::collections::BTreeMap<String, String>>,
    /// How the model's code reaches the sandbox: blocks, tool (the execute_code tool call) or auto
    #[schemars(extend("enum" = ["blocks", "tool", "auto"]))]
    code_via: Option<String>,
    /// Tools offered to the model: names of the operator's tools, or command tools defined
    /// here ({name, description, parameters, command}), which run in the task's sandbox
    tools: Option<Vec<Value>>,
}

/// A tool's arguments as `T`; what does not fit says which argument and why.
fn arguments<T: serde::de::DeserializeOwned>(
    args: serde_json::Map<String, Value>,
) -> Result<T, ErrorData> {
    serde_path_to_error::deserialize(Value::Object(args)).map_err(|e| {
        let inner = e.inner().to_string();
        let message = match inner
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'))
        {
            Some(field) => format!("`{field}` is required"),
            None => format!("`{}`: {inner}", e.path()),
        };
        ErrorData::invalid_params(message, None)
    })
}

async fn open(
    sandbox: &dyn tandem_executor::Executor,
    limits: Limits,
) -> Result<Box<dyn Session>, ErrorData> {
    sandbox
        .open(SessionSpec {
            limits,
            ..SessionSpec::default()
        })
        .await
        .map_err(|e| ErrorData::internal_error(format!("opening a sandbox failed: {e}"), None))
}

/// A call that could not be carried out, said as a result the client's model reads.
fn tool_error(text: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

/// A call's result when the block was not run: an error result the client's model reads.
fn declined(text: String) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(text.clone())]);
    result.structured_content = Some(json!({"status": "declined", "reason": text}));
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
    let structured = json!({
        "exit_code": exit_code,
        "status": status,
        "stdout": stdout,
        "stderr": stderr,
        "stdout_truncated": outcome.stdout.truncated(),
        "stderr_truncated": outcome.stderr.truncated(),
        "duration_ms": duration_ms,
        "session_id": session_id,
    });
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
    result.structured_content = Some(structured);
    result
}

fn tools() -> Vec<Tool> {
    vec![
        Tool::new(
            "execute_code",
            "Run one code block in one of Tandem's sandboxes and return its exit code, stdout, stderr, whether output was truncated, and how long it took. Give a session_id to keep files between calls.",
            schema_for_type::<ExecuteCodeArgs>(),
        ),
        Tool::new(
            "run_task",
            "Solve a coding task with Tandem: a model writes code, a sandbox runs it, turn after turn until done. Progress notifications carry the task's events; the result is the final answer and why the task stopped.",
            schema_for_type::<RunTaskArgs>(),
        ),
    ]
}

impl ServerHandler for TandemMcp {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new("tandem", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "execute_code runs code in a sandbox; run_task solves a whole coding task. Task transcripts are resources.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let name = request.name.as_ref();
        if !matches!(name, "execute_code" | "run_task") {
            return Err(ErrorData::invalid_params(
                format!("no tool `{name}`; the tools are execute_code and run_task"),
                None,
            ));
        }
        // A call to a tool that exists but cannot be carried out (arguments that fail the
        // schema or the policy, a cap, a sandbox that broke) is a tool result with isError,
        // as the MCP specification asks (SEP-1303): the client's model reads it and can
        // correct itself. Only a call naming no tool is a protocol error.
        let Ok(_call) = self.calls.clone().try_acquire_owned() else {
            return Ok(tool_error(format!(
                "this connection already has {MAX_CALLS} tool calls running; wait for one to end"
            ))
            .into());
        };
        let result = match name {
            "execute_code" => match arguments(args) {
                Ok(args) => self.execute_code(args, &context).await,
                Err(e) => Err(e),
            },
            _ => match arguments(args) {
                Ok(args) => self.run_task(args, &context).await,
                Err(e) => Err(e),
            },
        };
        Ok(result
            .unwrap_or_else(|e| tool_error(e.message.into_owned()))
            .into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        // The newest tasks only, read off the async workers like every other store call.
        let page = self
            .supervisor
            .off_thread(|sup| sup.store().page(None, None, LISTED_TASKS))
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let (tasks, _) = page.map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let resources = tasks
            .into_iter()
            .take(LISTED_TASKS)
            .map(|t| {
                let name: String = t.spec.task.chars().take(80).collect();
                Resource::new(transcript_uri(&t.id), name)
                    .with_description(format!(
                        "the transcript of task {} ({})",
                        t.id,
                        t.state.as_str()
                    ))
                    .with_mime_type("text/markdown")
            })
            .collect();
        Ok(ListResourcesResult::with_all_items(resources))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        if let Some((id, path)) = request
            .uri
            .strip_prefix("tandem://tasks/")
            .and_then(|rest| rest.split_once("/files/"))
        {
            return self.read_file(id, path, &request.uri).await;
        }
        let id = request
            .uri
            .strip_prefix("tandem://tasks/")
            .and_then(|rest| rest.strip_suffix("/transcript"))
            .ok_or_else(|| {
                ErrorData::resource_not_found(
                    format!(
                        "no resource {}; transcripts are tandem://tasks/ID/transcript, files tandem://tasks/ID/files/PATH",
                        request.uri
                    ),
                    None,
                )
            })?;
        // Off the async workers, as the API reads the store: a read may wait on the writer's
        // commit.
        let wanted = id.to_owned();
        let read = self
            .supervisor
            .off_thread(move |sup| {
                let record = sup.store().get(&wanted)?;
                Ok::<_, crate::StoreError>(match record {
                    Some(record) => Some((sup.store().events_after(&wanted, 0)?, record)),
                    None => None,
                })
            })
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let (events, record) =
            read.ok_or_else(|| ErrorData::resource_not_found(format!("no task {id}"), None))?;
        let messages = self.supervisor.transcript(&record, &events);
        let mut text = format!("# Task {id}\n\n{}\n", record.spec.task);
        for m in messages {
            let who = m
                .name
                .clone()
                .unwrap_or_else(|| format!("{:?}", m.role).to_lowercase());
            text.push_str(&format!("\n## {who}\n\n{}\n", m.content));
        }
        Ok(ReadResourceResult::new(vec![
            ResourceContents::text(text, request.uri.clone()).with_mime_type("text/markdown"),
        ])
        .into())
    }
}

/// Serves MCP over this process's stdin and stdout until the client goes; its sessions are
/// closed then.
pub async fn serve_stdio(supervisor: Arc<Supervisor>) -> Result<(), String> {
    let server = TandemMcp::new(supervisor);
    let sessions = server.sessions();
    let running = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| format!("the MCP client did not start a session: {e}"))?;
    let ended = running.waiting().await;
    sessions.close_all().await;
    ended.map(|_| ()).map_err(|e| e.to_string())
}

/// MCP over streamable HTTP, one [`TandemMcp`] per MCP session, for the API's `/mcp`.
pub fn http_service(
    supervisor: Arc<Supervisor>,
    shutdown: CancellationToken,
) -> rmcp::transport::streamable_http_server::StreamableHttpService<
    TandemMcp,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(SESSION_IDLE);
    // The API's own auth (the socket's permissions, or the bearer token) guards /mcp; a
    // Host check would refuse a daemon reached by its name.
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_cancellation_token(shutdown.child_token());
    let live = Arc::new(AtomicUsize::new(0));
    StreamableHttpService::new(
        move || {
            // Each connection holds sessions and calls; past the cap a new one is refused
            // (idle ones close after SESSION_IDLE and free their place).
            if live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                live.fetch_sub(1, Ordering::SeqCst);
                return Err(std::io::Error::other(format!(
                    "the daemon already serves {MAX_CONNECTIONS} MCP connections; close one or wait for an idle one to time out"
                )));
            }
            Ok(TandemMcp::counted(supervisor.clone(), Some(live.clone())))
        },
        Arc::new(sessions),
        config,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schemas_are_derived_from_the_arguments_the_tools_parse() {
        let tools = tools();
        let execute = serde_json::to_value(&*tools[0].input_schema).unwrap();
        let mut required: Vec<&str> = execute["required"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        required.sort_unstable();
        assert_eq!(required, ["code", "language"], "{execute}");
        let props = &execute["properties"];
        assert_eq!(props["code"]["maxLength"], MAX_CODE_BYTES, "{execute}");
        assert_eq!(props["timeout_secs"]["exclusiveMinimum"], 0, "{execute}");
        assert!(
            props["session_id"]["description"]
                .as_str()
                .is_some_and(|d| d.contains("persist")),
            "{execute}"
        );
        let run = serde_json::to_value(&*tools[1].input_schema).unwrap();
        assert_eq!(run["required"], json!(["task"]), "{run}");
        assert_eq!(run["properties"]["max_turns"]["minimum"], 1, "{run}");
    }

    #[test]
    fn arguments_that_do_not_fit_name_the_argument() {
        let parse = |v: Value| {
            arguments::<ExecuteCodeArgs>(v.as_object().cloned().unwrap())
                .map(|_| ())
                .map_err(|e| e.message.into_owned())
        };
        assert_eq!(
            parse(json!({"language": "python"})),
            Err("`code` is required".to_owned())
        );
        let wrong = parse(json!({"language": 5, "code": "x"})).unwrap_err();
        assert!(
            wrong.starts_with("`language`: invalid type: integer `5`"),
            "{wrong}"
        );
        assert_eq!(parse(json!({"language": "sh", "code": "x"})), Ok(()));
    }
}
