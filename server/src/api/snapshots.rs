//! `/v1/snapshots`: immutable copies of a session's or a task's workspace, and sessions
//! opened from them (`from_snapshot`, fork).

use super::*;
use crate::sandbox::{Owner, Refusal, snapshot_refusal};

/// The body of a snapshot's creation.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SnapshotAsk {
    /// A name to find it by.
    #[serde(default)]
    name: Option<String>,
}

/// The body of a fork.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ForkAsk {
    /// How many sessions to open.
    count: usize,
    /// Their executor; the daemon's default when left out.
    #[serde(default)]
    executor: Option<String>,
}

/// Most sessions one fork opens.
const MOST_FORKS: usize = 16;

/// A name: at most 128 characters, none of them control characters.
fn checked_name(name: Option<String>) -> Result<Option<String>, ApiError> {
    match name {
        Some(n) if n.chars().count() > 128 || n.chars().any(char::is_control) => Err(
            ApiError::invalid("name: at most 128 characters, and no control characters"),
        ),
        other => Ok(other),
    }
}

/// `POST /v1/sessions/{id}/snapshot`.
pub(super) async fn snapshot_session(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<tandem_snapshots::Record>), ApiError> {
    let asked: SnapshotAsk =
        super::sessions::json_body(&state, &headers, body, r#"{"name": "after setup"}"#).await?;
    let name = checked_name(asked.name)?;
    let opened = state.sessions.get(Owner::Api, &id)?;
    let record = opened
        .snapshot(state.supervisor.files().snapshots(), name)
        .await?;
    Ok((StatusCode::CREATED, Json(record)))
}

/// `POST /v1/tasks/{id}/snapshot`: a task that is finished, interrupted or waiting for a
/// person, whose workspace is still kept.
pub(super) async fn snapshot_task(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<tandem_snapshots::Record>), ApiError> {
    let asked: SnapshotAsk =
        super::sessions::json_body(&state, &headers, body, r#"{"name": "after setup"}"#).await?;
    let name = checked_name(asked.name)?;
    let record = blocking(&state.supervisor, move |sup| {
        let task = sup
            .store()
            .get(&id)?
            .ok_or_else(|| TaskError::NotFound(id.clone()))?;
        if matches!(
            task.state,
            tandem_protocol::task::TaskState::Queued | tandem_protocol::task::TaskState::Running
        ) {
            return Err(ApiError::from(Refusal::new(
                ApiErrorCode::Conflict,
                format!(
                    "task `{id}` is {} and its files change as it runs; take its snapshot once it is finished or waiting for a decision",
                    task.state.as_str()
                ),
            )));
        }
        files_kept(sup, &id)?;
        let files = sup.files();
        let work = files.task_work(&id);
        if !work.is_dir() {
            return Err(ApiError::from(Refusal::new(
                ApiErrorCode::Conflict,
                format!("task `{id}` has no workspace here: its sandbox is gone and kept no files"),
            )));
        }
        let source = tandem_snapshots::Source {
            kind: "task".into(),
            id: id.clone(),
            executor: task.spec.executor.clone().unwrap_or_default(),
        };
        // Said, never dropped silently: a task's interpreter ended with its run.
        let not_saved = if task.spec.keep_state {
            vec![tandem_snapshots::NotSaved {
                name: "(the kept interpreter's globals)".into(),
                why: "a task's interpreter ends with its run; a session's snapshot keeps its globals".into(),
            }]
        } else {
            Vec::new()
        };
        files
            .snapshots()
            .take(&work, name, source, Vec::new(), not_saved, None)
            .map_err(|e| ApiError::from(snapshot_refusal(e)))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(record)))
}

/// `f` on the snapshot store, off the async workers.
async fn on_store<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&tandem_snapshots::Store) -> Result<T, tandem_snapshots::SnapshotError>
    + Send
    + 'static,
) -> Result<T, ApiError> {
    blocking(&state.supervisor, move |sup| {
        f(sup.files().snapshots()).map_err(|e| ApiError::from(snapshot_refusal(e)))
    })
    .await
}

/// `GET /v1/snapshots`.
pub(super) async fn list_snapshots(
    State(state): State<AppState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    // What a paused session was saved as is the daemon's, not the client's.
    let snapshots: Vec<_> = on_store(&state, |store| store.list())
        .await?
        .into_iter()
        .filter(|r| r.source.kind != PAUSED)
        .collect();
    Ok(Json(json!({ "snapshots": snapshots })))
}

/// `GET /v1/snapshots/{id}`.
pub(super) async fn get_snapshot(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<tandem_snapshots::Record>, ApiError> {
    Ok(Json(on_store(&state, move |store| store.get(&id)).await?))
}

/// `DELETE /v1/snapshots/{id}`.
pub(super) async fn remove_snapshot(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<tandem_snapshots::Record>, ApiError> {
    Ok(Json(
        on_store(&state, move |store| {
            let record = store.get(&id)?;
            if record.source.kind == PAUSED {
                return Err(tandem_snapshots::SnapshotError::Held(format!(
                    "snapshot `{id}` holds paused session `{}`, and goes when it resumes or is closed (DELETE /v1/sessions/{})",
                    record.source.id, record.source.id
                )));
            }
            store.remove(&id)
        })
        .await?,
    ))
}

/// The source kind of what a paused session was saved as.
const PAUSED: &str = "pause";

/// `POST /v1/snapshots/{id}/fork`: `count` sessions opened at once from it.
pub(super) async fn fork_snapshot(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    let asked: ForkAsk =
        super::sessions::json_body(&state, &headers, body, r#"{"count": 4}"#).await?;
    if !(1..=MOST_FORKS).contains(&asked.count) {
        return Err(ApiError::invalid(format!(
            "count: from 1 to {MOST_FORKS} sessions at once"
        )));
    }
    let sessions = state
        .sessions
        .fork(&id, asked.count, asked.executor)
        .await?;
    Ok((StatusCode::CREATED, Json(json!({ "sessions": sessions }))))
}
