//! `/v1/volumes`: named storage that outlives tasks, mounted by the `volumes` of a task's
//! or a session's spec (docs/volumes.md).

use super::*;
use tandem_protocol::volume::{VolumeInfo, VolumeSpec};

/// `f` on the volume store, off the async workers (making a quota formats a filesystem).
async fn on_volumes<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&tandem_volumes::Volumes) -> Result<T, tandem_volumes::VolumeError> + Send + 'static,
) -> Result<T, ApiError> {
    blocking(&state.supervisor, move |sup| {
        f(sup.files().volumes()).map_err(|e| ApiError::from(TaskError::from(e)))
    })
    .await
}

/// `POST /v1/volumes`.
pub(super) async fn create_volume(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<VolumeInfo>), ApiError> {
    let spec: VolumeSpec =
        super::sessions::json_body(&state, &headers, body, r#"{"name": "data", "max_mb": 512}"#)
            .await?;
    let made = on_volumes(&state, move |v| v.create(&spec)).await?;
    Ok((StatusCode::CREATED, Json(made)))
}

/// `GET /v1/volumes`.
pub(super) async fn list_volumes(
    State(state): State<AppState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let volumes = on_volumes(&state, |v| v.list()).await?;
    Ok(Json(json!({ "volumes": volumes })))
}

/// `GET /v1/volumes/{name}`.
pub(super) async fn get_volume(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<VolumeInfo>, ApiError> {
    Ok(Json(on_volumes(&state, move |v| v.get(&name)).await?))
}

/// `DELETE /v1/volumes/{name}`: refused while a sandbox has it mounted.
pub(super) async fn remove_volume(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<VolumeInfo>, ApiError> {
    Ok(Json(on_volumes(&state, move |v| v.remove(&name)).await?))
}
