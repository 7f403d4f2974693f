//! Files given to calls, and what tasks made, as MCP content and resources.

use super::*;

/// Most files a task made that `run_task`'s text names; `files` lists them all.
pub(super) const MADE_NAMED: usize = 20;

/// Most pictures one tool result carries as images; the rest are named by their URIs.
pub(super) const MAX_PICTURES: usize = 8;
/// Largest picture a tool result carries whole.
const MAX_PICTURE_BYTES: u64 = 4 << 20;

/// `file` as image content, when it is small enough to carry.
pub(super) fn image_of(mut file: std::fs::File, len: u64, mime: &str) -> Option<ContentBlock> {
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
pub(super) fn packed(
    files: &[FileArg],
    caps: tandem_executor_kit::archive::ArchiveCaps,
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
pub(super) async fn run_with_files(
    session: &mut dyn Session,
    given: Option<(&std::path::Path, tandem_executor_kit::archive::ArchiveCaps)>,
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
            if let Ok((file, len)) = tandem_executor_kit::archive::read(workspace, &path)
                && let Some(image) = image_of(file, len, picture.mime)
            {
                images.push(image);
            }
        }
    }
    Ok((outcome, images))
}

/// A file of a task's workspace, as an MCP resource.
pub(super) fn file_uri(id: &str, path: &str) -> String {
    format!("tandem://tasks/{id}/files/{path}")
}

impl TandemMcp {
    /// The file `path` of task `id`'s workspace, as text or as a base64 blob.
    pub(super) async fn read_file(
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

pub(super) fn transcript_uri(id: &str) -> String {
    format!("tandem://tasks/{id}/transcript")
}
