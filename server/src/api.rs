//! The HTTP API (see docs/api.md). Every error is `{"error": {"code", "message"}}`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use serde_json::json;
use tandem_executor::CancellationToken;
use tandem_executor_kit::RegistryBudget as _;
use tandem_protocol::task::Decided;
use tandem_protocol::{
    ApiErrorBody, ApiErrorCode, ApiErrorDetail, Event, TaskList, TaskRecord, TaskSpec, TaskView,
};
use tokio::sync::mpsc;

use crate::follow::Follower;
use crate::store::TaskState;

mod ports;
mod sessions;
mod snapshots;
mod volumes;

use crate::supervisor::{Supervisor, TaskError};
pub use ports::serve_loopback;

/// Largest request body accepted unless configured otherwise.
pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;

/// How much of an oversized body is read (and dropped) before answering 413, so that a client
/// still writing it reads the answer instead of a broken pipe; bigger bodies are cut off.
const OVERSIZE_DRAIN: usize = 16 << 20;

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: ApiErrorCode,
    message: String,
    /// Seconds after which the request may find room (`Retry-After`).
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, code: ApiErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
}

impl ApiError {
    /// A 400 `invalid_request` saying what is wrong with the request and what to send.
    fn invalid(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            ApiErrorCode::InvalidRequest,
            message,
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ApiErrorBody {
            error: ApiErrorDetail {
                code: self.code,
                message: self.message,
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(secs));
        }
        response
    }
}

impl From<TaskError> for ApiError {
    fn from(e: TaskError) -> Self {
        let retry_after = match &e {
            TaskError::Files(crate::files::FilesError::Busy { retry_secs, .. }) => {
                Some(*retry_secs)
            }
            _ => None,
        };
        let (status, code) = match &e {
            TaskError::Invalid(_) => (StatusCode::BAD_REQUEST, ApiErrorCode::InvalidRequest),
            TaskError::NotFound(_) | TaskError::Missing(_) => {
                (StatusCode::NOT_FOUND, ApiErrorCode::NotFound)
            }
            TaskError::Conflict(_) => (StatusCode::CONFLICT, ApiErrorCode::Conflict),
            TaskError::NotAllowed(_) => (StatusCode::BAD_REQUEST, ApiErrorCode::NotAllowed),
            TaskError::Unavailable(crate::error::Unavailable::Store) => (
                StatusCode::SERVICE_UNAVAILABLE,
                ApiErrorCode::StoreUnavailable,
            ),
            TaskError::Store(e) if e.unreachable() => (
                StatusCode::SERVICE_UNAVAILABLE,
                ApiErrorCode::StoreUnavailable,
            ),
            TaskError::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                ApiErrorCode::ExecutorUnavailable,
            ),
            TaskError::ShuttingDown => {
                (StatusCode::SERVICE_UNAVAILABLE, ApiErrorCode::ShuttingDown)
            }
            TaskError::Store(_) => (StatusCode::INTERNAL_SERVER_ERROR, ApiErrorCode::Internal),
            TaskError::Volume(e) => {
                use tandem_volumes::VolumeError as V;
                match e {
                    V::Unknown(_) => (StatusCode::NOT_FOUND, ApiErrorCode::NotFound),
                    V::Exists(_) | V::InUse { .. } => {
                        (StatusCode::CONFLICT, ApiErrorCode::Conflict)
                    }
                    V::Invalid(_) | V::QuotaUnavailable(_) => {
                        (StatusCode::BAD_REQUEST, ApiErrorCode::InvalidRequest)
                    }
                    V::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, ApiErrorCode::Internal),
                }
            }
            TaskError::Files(e) => {
                use crate::files::FilesError;
                match e {
                    FilesError::NoUpload(_) | FilesError::Refused(_) | FilesError::Stalled => {
                        (StatusCode::BAD_REQUEST, ApiErrorCode::InvalidRequest)
                    }
                    FilesError::TooLarge(_) => {
                        (StatusCode::PAYLOAD_TOO_LARGE, ApiErrorCode::PayloadTooLarge)
                    }
                    FilesError::TooMany | FilesError::Busy { .. } => {
                        (StatusCode::TOO_MANY_REQUESTS, ApiErrorCode::TooMany)
                    }
                    FilesError::NotFound(_) => (StatusCode::NOT_FOUND, ApiErrorCode::NotFound),
                    FilesError::Removed { .. } => (StatusCode::GONE, ApiErrorCode::Gone),
                    FilesError::Io { .. } => {
                        (StatusCode::INTERNAL_SERVER_ERROR, ApiErrorCode::Internal)
                    }
                }
            }
        };
        Self {
            retry_after,
            ..Self::new(status, code, e.to_string())
        }
    }
}

impl From<crate::StoreError> for ApiError {
    fn from(e: crate::StoreError) -> Self {
        TaskError::from(e).into()
    }
}

/// Runs store work off the async workers: the store's lock may wait for the writer's
/// commit, and the async workers (two on a small machine) must keep serving meanwhile.
async fn blocking<T: Send + 'static>(
    sup: &Arc<Supervisor>,
    f: impl FnOnce(&Arc<Supervisor>) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    sup.off_thread(f).await.map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ApiErrorCode::Internal,
            format!("a store call failed: {e}"),
        )
    })?
}

/// A TCP connection's place among those that have not shown the token, given up by its
/// first request that does.
#[derive(Clone)]
pub struct Unauthenticated(Arc<std::sync::Mutex<Option<tokio::sync::OwnedSemaphorePermit>>>);

impl Unauthenticated {
    /// A connection holding `permit` until it authenticates.
    pub fn new(permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self(Arc::new(std::sync::Mutex::new(Some(permit))))
    }

    fn authenticated(&self) {
        if let Ok(mut permit) = self.0.lock() {
            permit.take();
        }
    }
}

#[derive(Clone)]
struct AppState {
    supervisor: Arc<Supervisor>,
    sessions: Arc<crate::sandbox::Pool>,
    shutdown: CancellationToken,
    body_limit: usize,
}

/// The API's routes. With `token`, every request must carry `Authorization: Bearer <token>`
/// (for TCP); without, the Unix socket's permissions are the access control.
pub fn router(
    supervisor: Arc<Supervisor>,
    sessions: Arc<crate::sandbox::Pool>,
    token: Option<String>,
    body_limit: usize,
    shutdown: CancellationToken,
) -> Router {
    let state = AppState {
        sessions,
        supervisor: supervisor.clone(),
        shutdown: shutdown.clone(),
        body_limit,
    };
    let pool = state.sessions.clone();
    // A signed link stands in for the token: its routes are outside the token's layer.
    let linked = Router::new()
        .route("/v1/ports/{link}", any(ports::add_slash))
        .route("/v1/ports/{link}/", any(ports::linked_port))
        .route("/v1/ports/{link}/{*rest}", any(ports::linked_port))
        .with_state(state.clone());
    let mut app = Router::new()
        .route("/v1/tasks", post(create_task).get(list_tasks))
        .route("/v1/tasks/{id}", get(get_task))
        .route("/v1/tasks/{id}/cancel", post(cancel_task))
        .route("/v1/tasks/{id}/resume", post(resume_task))
        .route("/v1/tasks/{id}/events", get(task_events))
        .route("/v1/tasks/{id}/approvals/{n}", post(decide_approval))
        .route("/v1/tasks/{id}/files", get(task_files))
        .route("/v1/tasks/{id}/files/{*path}", get(task_file))
        .route("/v1/uploads", post(upload))
        .route("/v1/exec", post(sessions::exec_once))
        .route(
            "/v1/sessions",
            post(sessions::open_session).get(sessions::list_sessions),
        )
        .route(
            "/v1/sessions/{id}",
            get(sessions::get_session).delete(sessions::close_session),
        )
        .route("/v1/sessions/{id}/exec", post(sessions::exec_in_session))
        .route("/v1/sessions/{id}/cancel", post(sessions::cancel_block))
        .route(
            "/v1/sessions/{id}/calls/{call}",
            post(sessions::answer_call),
        )
        .route(
            "/v1/sessions/{id}/files",
            get(sessions::session_files).post(sessions::put_session_files),
        )
        .route(
            "/v1/sessions/{id}/files/{*path}",
            get(sessions::session_file),
        )
        .route("/v1/tasks/{id}/ports", get(ports::task_ports))
        .route("/v1/tasks/{id}/ports/{port}", any(ports::add_slash))
        .route("/v1/tasks/{id}/ports/{port}/", any(ports::task_port))
        .route("/v1/tasks/{id}/ports/{port}/{*rest}", any(ports::task_port))
        .route("/v1/tasks/{id}/links", post(ports::task_link))
        .route("/v1/tasks/{id}/snapshot", post(snapshots::snapshot_task))
        .route(
            "/v1/sessions/{id}/snapshot",
            post(snapshots::snapshot_session),
        )
        .route("/v1/snapshots", get(snapshots::list_snapshots))
        .route(
            "/v1/snapshots/{id}",
            get(snapshots::get_snapshot).delete(snapshots::remove_snapshot),
        )
        .route("/v1/snapshots/{id}/fork", post(snapshots::fork_snapshot))
        .route(
            "/v1/volumes",
            get(volumes::list_volumes).post(volumes::create_volume),
        )
        .route(
            "/v1/volumes/{name}",
            get(volumes::get_volume).delete(volumes::remove_volume),
        )
        .route("/v1/sessions/{id}/ports", get(ports::session_ports))
        .route("/v1/sessions/{id}/ports/{port}", any(ports::add_slash))
        .route("/v1/sessions/{id}/ports/{port}/", any(ports::session_port))
        .route(
            "/v1/sessions/{id}/ports/{port}/{*rest}",
            any(ports::session_port),
        )
        .route("/v1/sessions/{id}/links", post(ports::session_link))
        .route("/v1/teams/parse", post(parse_team))
        .route("/v1/executors", get(executors))
        .route("/v1/engine", get(engine))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state)
        .nest_service("/mcp", crate::mcp::http_service(pool, shutdown.clone()));
    if let Some(token) = token {
        let expected: Arc<str> = format!("Bearer {token}").into();
        app = app.layer(middleware::from_fn(move |req: Request, next: Next| {
            let expected = expected.clone();
            async move {
                let given = req
                    .headers()
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok());
                if given.is_some_and(|g| bool::from(subtle::ConstantTimeEq::ct_eq(g.as_bytes(), expected.as_bytes()))) {
                    // The connection has shown the token: it no longer counts against the
                    // cap on connections that have not.
                    if let Some(pending) = req.extensions().get::<Unauthenticated>() {
                        pending.authenticated();
                    }
                    next.run(req).await
                } else {
                    ApiError::new(
                        StatusCode::UNAUTHORIZED,
                        ApiErrorCode::Unauthorized,
                        "missing or wrong bearer token: send `Authorization: Bearer <token>` with the daemon's token (TANDEM_TOKEN, or the token file in its state dir)",
                    )
                    .into_response()
                }
            }
        }));
    }
    // The page is public: it holds no data, and asks for the token before any API call.
    crate::web::router().merge(linked).merge(app)
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ApiErrorCode::NotFound,
        "no such endpoint; see docs/api.md",
    )
}

async fn create_task(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<TaskRecord>), ApiError> {
    let body = read_limited(&headers, body, state.body_limit).await?;
    // With the path of a bad field (`team.agents.critic.escalte: unknown field ...`).
    let mut spec: TaskSpec =
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(&body))
            .map_err(|e| {
                ApiError::invalid(format!(
                        "the body is not a valid task: {}; send JSON like {{\"task\": \"print the 10th prime\"}}",
                        tandem_agent::team::path_error(&e)
                    ),
                )
            })?;
    // The header wins over the body's field; either is kept only if it could be one.
    spec.traceparent = traceparent(&headers).or_else(|| {
        spec.traceparent
            .as_deref()
            .and_then(tandem_agent::trace::caller)
    });
    if let Some(snap) = spec.from_snapshot.clone() {
        let (upload, keeps_state) = snapshot_upload(&state, &snap, spec.files.is_some()).await?;
        spec.files = Some(upload);
        // Its globals are loaded by a kept interpreter, as a session from it loads them.
        spec.keep_state |= keeps_state;
    }
    let record = state.supervisor.submit(spec).await?;
    Ok((StatusCode::CREATED, Json(record)))
}

/// The snapshot `snap`'s files as an upload a task names: checked against their hashes,
/// then received as any upload is; and whether it holds kept globals.
async fn snapshot_upload(
    state: &AppState,
    snap: &str,
    with_files: bool,
) -> Result<(String, bool), ApiError> {
    if with_files {
        return Err(ApiError::invalid(
            "`files` and `from_snapshot` both fill the workspace; send one",
        ));
    }
    let restored = state.sessions.restored(snap).await?;
    let file = tokio::fs::File::open(&restored.tar).await.map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ApiErrorCode::Internal,
            format!("reading the restored snapshot: {e}"),
        )
    })?;
    let body = Body::from_stream(tokio_util::io::ReaderStream::new(file));
    let upload = state
        .supervisor
        .files()
        .receive(body)
        .await
        .map_err(TaskError::from)?;
    Ok((upload.id, restored.keeps_state))
}

/// The caller's W3C `traceparent` header, when it sent one that could be one.
pub(crate) fn traceparent(headers: &HeaderMap) -> Option<String> {
    tandem_agent::trace::caller(headers.get("traceparent")?.to_str().ok()?)
}

/// The body, or 413 when it is over `limit`. An oversized body up to [`OVERSIZE_DRAIN`] is
/// read to its end first: hyper closes a connection whose body is left unread, and a client
/// that is still writing would see that instead of the answer.
async fn read_limited(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ApiErrorCode::PayloadTooLarge,
            format!("the request body is over the {limit} byte limit"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > OVERSIZE_DRAIN) {
        return Err(too_large());
    }
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut total = 0usize;
    while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
        let chunk = chunk
            .map_err(|e| ApiError::invalid(format!("reading the request body failed: {e}")))?;
        total += chunk.len();
        if total > OVERSIZE_DRAIN {
            break;
        }
        if total <= limit {
            kept.extend_from_slice(&chunk);
        }
    }
    if total > limit {
        return Err(too_large());
    }
    Ok(Bytes::from(kept))
}

/// Most tasks one page may ask for.
const MAX_PAGE: usize = 500;

/// `GET /v1/tasks`'s query.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    state: Option<TaskState>,
    limit: Option<usize>,
    before: Option<String>,
}

/// `GET /v1/tasks/{id}/events`'s query.
#[derive(Debug, serde::Deserialize)]
struct EventsQuery {
    /// The seq to start after, when there is no `Last-Event-ID`.
    after: Option<String>,
    /// `false`: only the stored events.
    follow: Option<bool>,
}

/// A query that does not parse, as a 400 that says what `fix` says to send.
fn bad_query(rejection: &QueryRejection, fix: &str) -> ApiError {
    ApiError::invalid(format!("{}; {fix}", rejection.body_text()))
}

async fn list_tasks(
    State(state): State<AppState>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let names: Vec<&str> = TaskState::ALL.iter().map(|s| s.as_str()).collect();
    let Query(query) = query.map_err(|e| {
        bad_query(
            &e,
            &format!(
                "use state (one of: {}), limit (1 to {MAX_PAGE}) and before",
                names.join(", ")
            ),
        )
    })?;
    let filter = query.state;
    let limit = match query.limit {
        None => None,
        Some(n) if (1..=MAX_PAGE).contains(&n) => Some(n),
        Some(n) => {
            return Err(ApiError::invalid(format!(
                "limit `{n}` is not a whole number from 1 to {MAX_PAGE}"
            )));
        }
    };
    let before = query.before;
    if before.is_some() && limit.is_none() {
        return Err(ApiError::invalid(
            "`before` pages through the newest tasks; give `limit` too (e.g. limit=50)".to_owned(),
        ));
    }
    match limit {
        // Without a limit: every task, oldest first, as before paging existed. Streamed a
        // chunk at a time, so the daemon holds one chunk per listing however large the store.
        None => Ok(stream_tasks(state.supervisor.clone(), filter)),
        Some(limit) => {
            let (tasks, next) = blocking(&state.supervisor, move |sup| {
                Ok(sup.store().page(filter, before.as_deref(), limit)?)
            })
            .await?;
            Ok(Json(TaskList { tasks, next }).into_response())
        }
    }
}

/// Tasks the unpaged listing reads from the store and writes out at a time.
const LIST_CHUNK: usize = 4;

/// `{"tasks": [...]}` with every task in `state`, written as the store is read. A store
/// failure midway ends the body early (the client sees a cut-off answer, not a short list).
fn stream_tasks(sup: Arc<Supervisor>, state: Option<TaskState>) -> Response {
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    tokio::spawn(async move {
        if tx
            .send(Ok(Bytes::from_static(b"{\"tasks\":[")))
            .await
            .is_err()
        {
            return;
        }
        let mut after: Option<String> = None;
        let mut first = true;
        loop {
            let from = after.clone();
            let chunk = sup
                .off_thread(move |sup| sup.store().list_after(state, from.as_deref(), LIST_CHUNK))
                .await;
            let read = match chunk {
                Ok(Ok(tasks)) => Ok(tasks),
                Ok(Err(e)) => Err(std::io::Error::other(e)),
                Err(e) => Err(std::io::Error::other(e)),
            };
            let tasks = match read {
                Ok(tasks) => tasks,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            let mut out = Vec::new();
            for task in &tasks {
                if !first {
                    out.push(b',');
                }
                first = false;
                if let Err(e) = serde_json::to_writer(&mut out, task) {
                    let _ = tx.send(Err(std::io::Error::other(e))).await;
                    return;
                }
            }
            // A client that left stops the reading.
            if tx.send(Ok(Bytes::from(out))).await.is_err() {
                return;
            }
            match tasks.last() {
                Some(last) if tasks.len() == LIST_CHUNK => after = Some(last.id.clone()),
                _ => break,
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"]}"))).await;
    });
    let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn decide_approval(
    State(state): State<AppState>,
    Path((id, n)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Decided>, ApiError> {
    let n: u32 =
        n.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
            ApiError::invalid(format!("approval `{n}` is not a number from 1 up"))
        })?;
    let body = read_limited(&headers, body, state.body_limit).await?;
    let decision: crate::approvals::DecisionBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(format!(
            "the body is not a decision: {e}; send {{\"decision\": \"approve\"}}, or {{\"decision\": \"deny\", \"reason\": \"...\"}}, or approve with \"code\" to run an edited block"
        ))
    })?;
    let decided = blocking(&state.supervisor, move |sup| {
        Ok(sup.approvals.decide(&id, n, decision)?)
    })
    .await?;
    Ok(Json(Decided { approval: decided }))
}

/// A team file's TOML as the JSON a task's `team` takes, checked: for clients (the page)
/// that hold a team file but no TOML parser.
async fn parse_team(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let body = read_limited(&headers, body, state.body_limit).await?;
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::invalid("the team file is not UTF-8 text".to_owned()))?;
    let de = toml::Deserializer::parse(text)
        .map_err(|e| ApiError::invalid(format!("the team file is not TOML: {e}")))?;
    let spec: tandem_protocol::team::TeamSpec =
        serde_path_to_error::deserialize(de).map_err(|e| {
            ApiError::invalid(format!(
                "the team file does not check: {}",
                tandem_agent::team::path_error(&e)
            ))
        })?;
    state.supervisor.check_team_spec(&spec).map_err(|e| {
        ApiError::invalid(format!("the team file does not check: {}", e.0.join("; ")))
    })?;
    Ok(Json(json!({ "team": spec })))
}

/// `POST /v1/uploads`: a tar archive of files for tasks to name in `files`.
async fn upload(
    State(state): State<AppState>,
    body: Body,
) -> Result<(StatusCode, Json<tandem_protocol::files::Upload>), ApiError> {
    let upload = state
        .supervisor
        .files()
        .receive(body)
        .await
        .map_err(TaskError::from)?;
    Ok((StatusCode::CREATED, Json(upload)))
}

/// `GET /v1/tasks/{id}/files`'s query.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FilesQuery {
    /// `tar`: the whole workspace as one tar archive instead of a list.
    format: Option<FilesFormat>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum FilesFormat {
    Json,
    Tar,
}

/// The task `id`, when it exists and its files are still kept.
fn files_kept(sup: &Supervisor, id: &str) -> Result<(), ApiError> {
    let record = sup
        .store()
        .get(id)?
        .ok_or_else(|| TaskError::NotFound(id.to_owned()))?;
    if let Some(at_ms) = record.files_removed_ms {
        return Err(TaskError::from(crate::files::FilesError::Removed {
            task: id.to_owned(),
            at_ms,
        })
        .into());
    }
    Ok(())
}

/// `GET /v1/tasks/{id}/files`: the regular files of the task's workspace, or all of them as
/// a tar archive with `?format=tar`.
async fn task_files(
    State(state): State<AppState>,
    Path(id): Path<String>,
    query: Result<Query<FilesQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) =
        query.map_err(|e| bad_query(&e, "send ?format=json (the default) or ?format=tar"))?;
    if matches!(query.format, Some(FilesFormat::Tar)) {
        let kept = id.clone();
        blocking(&state.supervisor, move |sup| files_kept(sup, &kept)).await?;
        // Packed beyond the store's calls: a pack lasts as long as its client reads.
        let files = state.supervisor.files();
        let body = files
            .pack_stream(files.task_work(&id))
            .await
            .map_err(TaskError::from)?;
        return Ok(tar_answer(body, &id));
    }
    blocking(&state.supervisor, move |sup| {
        files_kept(sup, &id)?;
        Ok(Json(sup.files().list(&id).map_err(TaskError::from)?).into_response())
    })
    .await
}

/// `GET /v1/tasks/{id}/files/{path}`: one regular file of the task's workspace. Served so a
/// browser never runs it: pictures and plain text as what they are, with no scripts, and
/// everything else as a download.
async fn task_file(
    State(state): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let (file, len, name) = blocking(&state.supervisor, move |sup| {
        files_kept(sup, &id)?;
        let (file, len) = sup.files().open(&id, &path).map_err(TaskError::from)?;
        Ok((file, len, path))
    })
    .await?;
    Ok(served_file(file, len, &name))
}

/// A workspace file named `name` as an answer that a browser never runs: pictures and plain
/// text as what they are, with no scripts, and everything else as a download.
fn served_file(file: std::fs::File, len: u64, name: &str) -> Response {
    let (mime, inline) = crate::files::media_type(name);
    // A header value takes printable ASCII only; a name the code chose may hold anything.
    let base: String = name
        .rsplit('/')
        .next()
        .unwrap_or("file")
        .chars()
        .map(|c| match c {
            ' '..='~' if c != '"' && c != '\\' => c,
            _ => '_',
        })
        .collect();
    let disposition = if inline {
        format!("inline; filename=\"{base}\"")
    } else {
        format!("attachment; filename=\"{base}\"")
    };
    let body = file_body(file, len);
    (
        [
            (header::CONTENT_TYPE, mime.to_owned()),
            (header::CONTENT_LENGTH, len.to_string()),
            (header::CONTENT_DISPOSITION, disposition),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_owned()),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; style-src 'unsafe-inline'; sandbox".to_owned(),
            ),
        ],
        body,
    )
        .into_response()
}

/// A workspace being packed, `body`, as a tar download named `name`.tar.
fn tar_answer(body: Body, name: &str) -> Response {
    (
        [
            (header::CONTENT_TYPE, "application/x-tar".to_owned()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{name}.tar\""),
            ),
        ],
        body,
    )
        .into_response()
}

/// The first `len` bytes of `file` as a body, read a piece at a time on the blocking pool as
/// the client takes them: a client that stalls holds no thread. A file that shrinks
/// meanwhile ends the body early (the client sees it cut short against its length), never
/// with other bytes.
fn file_body(file: std::fs::File, len: u64) -> Body {
    Body::from_stream(futures::stream::unfold(
        Some((file, len)),
        |state| async move { next_piece(state?).await },
    ))
}

/// The next piece of a file of which `left` bytes are still to be sent, and what is left
/// after it; `None` at its end.
async fn next_piece(
    (mut file, left): (std::fs::File, u64),
) -> Option<(std::io::Result<Bytes>, Option<(std::fs::File, u64)>)> {
    use std::io::Read as _;
    if left == 0 {
        return None;
    }
    let want = left.min(crate::files::SEND_PIECE as u64);
    let read = tokio::task::spawn_blocking(move || {
        let mut piece = Vec::with_capacity(usize::try_from(want).unwrap_or(0));
        let read = (&mut file).take(want).read_to_end(&mut piece);
        (file, read.map(|_| piece))
    })
    .await;
    match read {
        Ok((_, Ok(piece))) if piece.is_empty() => None,
        Ok((file, Ok(piece))) => {
            let left = left - piece.len() as u64;
            Some((Ok(Bytes::from(piece)), Some((file, left))))
        }
        Ok((_, Err(e))) => Some((Err(e), None)),
        Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
    }
}

async fn get_task(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<TaskView>, ApiError> {
    blocking(&state.supervisor, move |sup| {
        let record = sup
            .store()
            .get(&id)?
            .ok_or(TaskError::NotFound(id.clone()))?;
        // One read of the events serves the transcript and the waiting approval.
        let events = sup.store().events_after(&record.id, 0)?;
        let pending_approval = (record.state != TaskState::Finished)
            .then(|| {
                crate::approvals::requested(&events)
                    .into_iter()
                    .rfind(|r| r.ruling.is_none())
                    .map(|r| r.asked)
            })
            .flatten();
        let daemon = matches!(
            record.state,
            TaskState::Running | TaskState::AwaitingApproval
        )
        .then(|| sup.store().owner(&record.id, crate::now_ms()))
        .transpose()?
        .flatten();
        Ok(Json(TaskView {
            transcript: sup.transcript(&record, &events),
            record,
            pending_approval,
            daemon,
        }))
    })
    .await
}

async fn cancel_task(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<TaskRecord>, ApiError> {
    let record = state.supervisor.cancel(&id).await?;
    Ok(Json(record))
}

async fn resume_task(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<TaskRecord>, ApiError> {
    let record = state.supervisor.resume(&id).await?;
    Ok(Json(record))
}

/// The embedded model as an OpenAI-compatible chat API.
async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let unavailable = |message: String| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ApiErrorCode::ModelUnavailable,
            message,
        )
    };
    let (local, name) = {
        let planner = state.supervisor.planner_config();
        (planner.local_model.clone(), planner.model.model.clone())
    };
    let Some(model) = local else {
        return Err(unavailable(
            "this daemon serves no embedded model: its tasks use a model server; ask that server, or start the daemon with [model] provider = \"embedded\"".to_owned(),
        ));
    };
    let body = read_limited(&headers, body, state.body_limit).await?;
    let request: crate::openai::ChatRequest =
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(&body))
            .map_err(|e| {
                ApiError::invalid(format!(
                    "the body is not a chat completion request: {e}; send JSON like {{\"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}"
                ))
            })?;
    let asked = request.asked().map_err(ApiError::invalid)?;
    crate::openai::answer(model, name, asked)
        .await
        .map_err(|refusal| match refusal {
            crate::openai::Refusal::Busy(message) => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                ApiErrorCode::TooMany,
                message,
            ),
            crate::openai::Refusal::Failed(message) => unavailable(message),
        })
}

/// What the embedded model's engine is doing; `null` when this daemon's tasks use a server.
async fn engine(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({ "engine": state.supervisor.engine_stats() }))
}

async fn executors(State(state): State<AppState>) -> Json<serde_json::Value> {
    let executors = state.supervisor.executors();
    let policy = state.supervisor.policy();
    let checks = executors.iter().map(|e| e.health());
    let health = futures::future::join_all(checks).await;
    let list: Vec<serde_json::Value> = executors
        .iter()
        .zip(health)
        .map(|(e, health)| {
            let offered = policy.offers(e.name());
            let mut entry = json!({
                "name": e.name(),
                "languages": e.languages().iter().map(|l| l.as_str()).collect::<Vec<_>>(),
                "health": if health.is_ok() { "ok" } else { "unavailable" },
                "offered": offered,
            });
            let hosts = e.hosts();
            if !hosts.is_empty() {
                entry["hosts"] = json!(hosts);
            }
            let pools = e.pools();
            if !pools.is_empty() {
                entry["pools"] = json!(pools);
            }
            // Whether a task that names hosts can run here, and why not.
            entry["network"] = match state
                .supervisor
                .planner_config()
                .network
                .network_problem(&**e)
            {
                None => json!("behind the egress proxy"),
                Some(why) => json!(format!("no network policy: {why}")),
            };
            if let Err(problem) = health {
                entry["problem"] = json!(problem);
            } else if !offered {
                entry["problem"] = json!(policy.not_offered(e.name(), executors));
            }
            entry
        })
        .collect();
    Json(json!({ "executors": list }))
}

async fn healthz(State(state): State<AppState>) -> (StatusCode, Json<serde_json::Value>) {
    // A load balancer stops sending work; reads and streams are still served meanwhile.
    if state.supervisor.stopping() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": "stopping" })),
        )
    } else {
        (StatusCode::OK, Json(json!({ "status": "ok" })))
    }
}

async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let text = blocking(&state.supervisor, |sup| {
        let open = sup
            .executors()
            .budget()
            .map_or(0, tandem_executor_kit::Budget::in_use);
        let hosts: Vec<_> = sup
            .executors()
            .iter()
            .flat_map(|e| {
                let name = e.name().to_owned();
                e.hosts().into_iter().map(move |h| (name.clone(), h))
            })
            .collect();
        let pools: Vec<_> = sup
            .executors()
            .iter()
            .flat_map(|e| {
                let name = e.name().to_owned();
                e.pools().into_iter().map(move |p| (name.clone(), p))
            })
            .collect();
        Ok(sup.metrics.render(
            &sup.store().counts()?,
            open,
            &hosts,
            &pools,
            sup.running_here(),
            sup.engine_stats().as_ref(),
        ))
    })
    .await?;
    Ok(([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response())
}

/// Stored events after `Last-Event-ID` (or `?after=`), then live ones until the task ends
/// (`?follow=false`: only the stored ones).
async fn task_events(
    State(state): State<AppState>,
    Path(id): Path<String>,
    query: Result<Query<EventsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Query(query) =
        query.map_err(|e| bad_query(&e, "use after (an event seq) and follow (true or false)"))?;
    let after_text = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or(query.after);
    let after = match after_text {
        None => 0,
        Some(t) => t.trim().parse::<u64>().map_err(|_| {
            ApiError::invalid(format!(
                "Last-Event-ID `{t}` is not an event seq (a whole number)"
            ))
        })?,
    };
    let sup = state.supervisor.clone();
    let wanted = id.clone();
    if blocking(&sup, move |sup| Ok(sup.store().get(&wanted)?))
        .await?
        .is_none()
    {
        return Err(TaskError::NotFound(id).into());
    }
    let follow = query.follow.unwrap_or(true);
    // Subscribe before reading the store, so nothing falls between the two.
    let live = sup.subscribe();
    let (tx, mut rx) = mpsc::channel::<SseEvent>(256);
    let follower = Follower::new(
        sup,
        id,
        after,
        follow.then_some(live),
        state.shutdown.clone(),
    );
    tokio::spawn(forward(follower, tx));
    let stream =
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>)));
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

fn sse_event(e: &Event) -> SseEvent {
    // Serialised once: the `type` names the SSE event, the whole is its data.
    let value = serde_json::to_value(e).unwrap_or_default();
    let kind = value["type"].as_str().unwrap_or_default().to_owned();
    SseEvent::default()
        .id(e.seq.to_string())
        .event(kind)
        .data(value.to_string())
}

/// Sends task `id`'s events to `tx` as SSE events until they end or the client leaves.
async fn forward(mut follower: Follower, tx: mpsc::Sender<SseEvent>) {
    loop {
        let next = tokio::select! {
            e = follower.next() => e,
            () = tx.closed() => return,
        };
        let Some(e) = next else {
            return;
        };
        if tx.send(sse_event(&e)).await.is_err() {
            return;
        }
    }
}
