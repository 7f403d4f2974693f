//! `/v1/sessions` and `/v1/exec`: sandboxes a client runs blocks in with no model.

use tandem_protocol::session::{
    ExecEvent, ExecSpec, SessionFiles, SessionInfo, SessionList, SessionSpec, ToolAnswer,
};

use super::*;
use crate::sandbox::{Owner, Refusal};

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        Self::new(status_of(r.code), r.code, r.message)
    }
}

fn status_of(code: ApiErrorCode) -> StatusCode {
    match code {
        ApiErrorCode::InvalidRequest | ApiErrorCode::NotAllowed => StatusCode::BAD_REQUEST,
        ApiErrorCode::NotFound => StatusCode::NOT_FOUND,
        ApiErrorCode::Conflict => StatusCode::CONFLICT,
        ApiErrorCode::TooMany => StatusCode::TOO_MANY_REQUESTS,
        ApiErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ApiErrorCode::ExecutorUnavailable
        | ApiErrorCode::ShuttingDown
        | ApiErrorCode::StoreUnavailable
        | ApiErrorCode::ModelUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A JSON body of type `T`, or a 400 naming the bad field and showing what to send.
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    example: &str,
) -> Result<T, ApiError> {
    let body = read_limited(headers, body, state.body_limit).await?;
    let body = if body.is_empty() { &b"{}"[..] } else { &body };
    serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(body)).map_err(|e| {
        ApiError::invalid(format!(
            "the body is not valid: {}; send JSON like {example}",
            tandem_agent::team::path_error(&e)
        ))
    })
}

/// Whether the client reads a block's run as a stream of lines.
fn streamed(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"))
}

/// `POST /v1/sessions`.
pub(super) async fn open_session(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<SessionInfo>), ApiError> {
    let spec: SessionSpec = json_body(
        &state,
        &headers,
        body,
        r#"{"executor": "docker", "keep_state": true}"#,
    )
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(state.sessions.open_session(spec).await?),
    ))
}

/// `GET /v1/sessions`.
pub(super) async fn list_sessions(State(state): State<AppState>) -> Json<SessionList> {
    Json(SessionList {
        sessions: state.sessions.list(Owner::Api),
    })
}

/// `GET /v1/sessions/{id}`.
pub(super) async fn get_session(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SessionInfo>, ApiError> {
    Ok(Json(state.sessions.get(Owner::Api, &id)?.info()))
}

/// `DELETE /v1/sessions/{id}`: closes it and its sandbox.
pub(super) async fn close_session(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SessionInfo>, ApiError> {
    Ok(Json(state.sessions.close(Owner::Api, &id).await?))
}

/// `POST /v1/sessions/{id}/cancel`: kills the block that runs now.
pub(super) async fn cancel_block(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let opened = state.sessions.get(Owner::Api, &id)?;
    let cancelled = opened.cancel();
    Ok(Json(json!({"session": id, "cancelled": cancelled})))
}

/// `POST /v1/sessions/{id}/calls/{call}`: the answer to a tool call of the running block.
pub(super) async fn answer_call(
    State(state): State<AppState>,
    Path((id, call)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let answer: ToolAnswer = json_body(
        &state,
        &headers,
        body,
        r#"{"result": "42"} or {"error": "why"}"#,
    )
    .await?;
    let reply = match answer {
        ToolAnswer {
            result: Some(result),
            error: None,
        } => Ok(result),
        ToolAnswer {
            result: None,
            error: Some(error),
        } => Err(error),
        _ => {
            return Err(ApiError::invalid(
                "send exactly one of `result` and `error`",
            ));
        }
    };
    state.sessions.get(Owner::Api, &id)?.answer(&call, reply)?;
    Ok(Json(json!({"session": id, "call": call})))
}

/// `POST /v1/sessions/{id}/exec`: runs one block; its result, or with
/// `Accept: application/x-ndjson` its events as they come.
pub(super) async fn exec_in_session(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let spec: ExecSpec = json_body(
        &state,
        &headers,
        body,
        r#"{"language": "python", "code": "print(1)"}"#,
    )
    .await?;
    let streamed = streamed(&headers);
    let events = state.sessions.exec(&id, spec, streamed).await?;
    answer(events, streamed).await
}

/// `POST /v1/exec`: one block in a sandbox of its own.
pub(super) async fn exec_once(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let spec: ExecSpec = json_body(
        &state,
        &headers,
        body,
        r#"{"language": "python", "code": "print(1)", "executor": "docker"}"#,
    )
    .await?;
    let streamed = streamed(&headers);
    let events = state.sessions.exec_once(spec).await?;
    answer(events, streamed).await
}

/// The block's events as lines, or its result alone. Dropping `events` (the client left)
/// cancels the block.
async fn answer(
    mut events: mpsc::UnboundedReceiver<ExecEvent>,
    streamed: bool,
) -> Result<Response, ApiError> {
    if streamed {
        let lines = futures::stream::unfold(events, |mut events| async move {
            let event = events.recv().await?;
            let mut line = serde_json::to_vec(&event).unwrap_or_default();
            line.push(b'\n');
            Some((Ok::<_, Infallible>(Bytes::from(line)), events))
        });
        return Ok((
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            Body::from_stream(lines),
        )
            .into_response());
    }
    while let Some(event) = events.recv().await {
        match event {
            ExecEvent::Result { result } => return Ok(Json(result).into_response()),
            ExecEvent::Error { error } => {
                return Err(ApiError::new(
                    status_of(error.code),
                    error.code,
                    error.message,
                ));
            }
            ExecEvent::Output { .. } | ExecEvent::ToolCall { .. } | ExecEvent::Net(_) => {}
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        ApiErrorCode::Internal,
        "the block's run ended without a result",
    ))
}

/// `GET /v1/sessions/{id}/files`: the regular files of its workspace, or all as tar.
pub(super) async fn session_files(
    State(state): State<AppState>,
    Path(id): Path<String>,
    query: Result<Query<FilesQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) =
        query.map_err(|e| bad_query(&e, "send ?format=json (the default) or ?format=tar"))?;
    let opened = state.sessions.get(Owner::Api, &id)?;
    opened.wake().await?;
    let work = opened.workspace()?;
    if matches!(query.format, Some(FilesFormat::Tar)) {
        let body = state
            .supervisor
            .files()
            .pack_stream(work)
            .await
            .map_err(TaskError::from)?;
        return Ok(tar_answer(body, &id));
    }
    blocking(&state.supervisor, move |_| {
        let files = crate::files::list_dir(&work).map_err(TaskError::from)?;
        Ok(Json(SessionFiles {
            session: id,
            // Tandem's own files (a kept interpreter's scripts and pipes) are not the code's.
            files: files
                .into_iter()
                .filter(|f| !tandem_executor_kit::archive::is_tandems(&f.path))
                .map(|f| tandem_protocol::files::FileInfo {
                    path: crate::files::slashed(&f.path),
                    bytes: f.bytes,
                    modified_ms: Some(f.modified_ms),
                    given: false,
                })
                .collect(),
        })
        .into_response())
    })
    .await
}

/// `GET /v1/sessions/{id}/files/{path}`: one file, served as a task's are.
pub(super) async fn session_file(
    State(state): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let opened = state.sessions.get(Owner::Api, &id)?;
    opened.wake().await?;
    let work = opened.workspace()?;
    let (file, len, name) = blocking(&state.supervisor, move |_| {
        let (file, len) = crate::files::open_in(
            &work,
            &path,
            &format!("session {id}"),
            &format!("/v1/sessions/{id}/files"),
        )
        .map_err(TaskError::from)?;
        Ok((file, len, path))
    })
    .await?;
    Ok(served_file(file, len, &name))
}

/// `POST /v1/sessions/{id}/files` with a tar archive: its files placed in the workspace,
/// checked as an upload's are. The archive is kept only until it is placed: it is no
/// upload, and takes no place among those waiting for tasks.
pub(super) async fn put_session_files(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Body,
) -> Result<(StatusCode, Json<tandem_protocol::files::Upload>), ApiError> {
    let opened = state.sessions.get(Owner::Api, &id)?;
    let files = state.supervisor.files();
    let received = files.receive_unkept(body).await.map_err(TaskError::from)?;
    opened.put(received.path(), files.upload_caps()).await?;
    Ok((StatusCode::CREATED, Json(received.upload.clone())))
}
