//! Tasks' files on the daemon: uploads waiting for a task, each task's workspace (kept after
//! it ends, so its files can be read), and the retention that removes them.
//!
//! Layout, beneath the state dir's `files/`:
//! - `uploads/ID.tar` and `ID.txt`: an upload, checked entry by entry, and what the model is
//!   told of it; removed an hour after it arrived.
//! - `tasks/ID/inputs.tar`, `inputs.txt`: a task's own link to the upload it named, so the
//!   upload expiring does not take the task's files with it.
//! - `tasks/ID/work/`: the workspace every session of the task opens.
//!
//! Ids are checked to be lowercase hex before they become paths, and everything read out
//! of a workspace goes through `archive`, beneath a directory handle, following no link.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use tandem_executor::archive::{self, ArchiveCaps, ArchiveError};
use tandem_executor::made;
use tandem_protocol::files::{FileInfo, TaskFiles, Upload};
use tokio::io::AsyncWriteExt;

use crate::store::TaskStore;

/// How long an upload no task named is kept.
pub const UPLOAD_KEEP: Duration = Duration::from_secs(3600);
/// Bytes moved at a time to and from files on disk.
pub const IO_BUFFER: usize = 1 << 20;
/// Bytes of an oversized upload read and dropped before it is refused.
const OVERSIZE_DRAIN: u64 = 16 << 20;
/// Most uploads waiting for a task at once.
pub const MAX_PENDING_UPLOADS: usize = 64;

/// Where tasks' files live and how long they stay, from `[files]`.
#[derive(Clone, Debug)]
pub struct FilesConfig {
    /// The directory that holds them (the state dir's `files/`).
    pub root: PathBuf,
    /// How long a finished task's workspace is kept.
    pub keep: Duration,
    /// Most bytes all tasks' workspaces may hold; the oldest finished ones go first.
    pub max_total_bytes: u64,
    /// Most bytes one task's workspace counts for: a task over it cannot push others' files
    /// out, and once finished it loses its own first. Also the most a `?format=tar` download
    /// of it may write.
    pub max_task_bytes: u64,
    /// What one upload may hold.
    pub upload: ArchiveCaps,
}

/// Why a file operation was refused; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    /// The upload is not there (never made, expired, or a typo).
    #[error(
        "there is no upload `{0}`: send the files to POST /v1/uploads first (an upload no task names is removed after an hour)"
    )]
    NoUpload(String),
    /// The archive was refused, entry by entry.
    #[error("the upload was refused: {0}")]
    Refused(#[source] ArchiveError),
    /// The body was larger than any archive within the caps.
    #[error(
        "the upload is over the {0} byte limit (the operator's [files] max_upload_mb); send fewer or smaller files"
    )]
    TooLarge(u64),
    /// Too many uploads wait for tasks.
    #[error(
        "{MAX_PENDING_UPLOADS} uploads already wait for a task; name them in tasks, or wait for them to expire"
    )]
    TooMany,
    /// A path that does not name a regular file of the workspace.
    #[error("{0}")]
    NotFound(String),
    /// The retention removed the task's workspace.
    #[error(
        "the files of task {task} were removed at {at_ms} ms (the operator's [files] retention)"
    )]
    Removed {
        /// The task.
        task: String,
        /// When.
        at_ms: u64,
    },
    /// The disk failed us.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

impl FilesError {
    fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let context = context.into();
        move |source| Self::Io { context, source }
    }
}

/// Tasks' files; one per daemon.
pub struct Files {
    config: FilesConfig,
    uploads: tokio::sync::Semaphore,
}

impl Files {
    /// Files under `config.root`, made (private to the daemon's user) if missing.
    pub fn new(config: FilesConfig) -> std::io::Result<Self> {
        for dir in ["uploads", "tasks"] {
            std::fs::create_dir_all(config.root.join(dir))?;
        }
        Ok(Self {
            config,
            // Each upload holds a file open and a blocking check: a few at once is plenty.
            uploads: tokio::sync::Semaphore::new(4),
        })
    }

    /// What an upload may hold.
    pub fn upload_caps(&self) -> ArchiveCaps {
        self.config.upload
    }

    fn task_dir(&self, task: &str) -> PathBuf {
        self.config.root.join("tasks").join(task)
    }

    fn upload_path(&self, id: &str, ext: &str) -> PathBuf {
        self.config.root.join("uploads").join(format!("{id}.{ext}"))
    }

    /// The workspace of `task`, made if missing. It is open to every user because a Docker
    /// block runs as another one; the state dir above it is the daemon's alone.
    pub fn workspace(&self, task: &str) -> Result<PathBuf, FilesError> {
        use std::os::unix::fs::PermissionsExt;
        let work = self.task_dir(task).join("work");
        std::fs::create_dir_all(&work).map_err(FilesError::io("making the task's workspace"))?;
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o1777))
            .map_err(FilesError::io("opening the task's workspace"))?;
        Ok(work)
    }

    /// The files `task` was given, if any: their archive, and what the model is told.
    pub fn inputs(&self, task: &str) -> Result<Option<(PathBuf, String)>, FilesError> {
        let dir = self.task_dir(task);
        let archive = dir.join("inputs.tar");
        if !archive.exists() {
            return Ok(None);
        }
        let listing = std::fs::read_to_string(dir.join("inputs.txt"))
            .map_err(FilesError::io("reading what the task was given"))?;
        Ok(Some((archive, listing)))
    }

    /// Whether the upload `id` is there to be named.
    pub fn has_upload(&self, id: &str) -> bool {
        valid_id(id) && self.upload_path(id, "tar").is_file()
    }

    /// The archive of upload `id`, when it is there to be named.
    pub fn upload_archive(&self, id: &str) -> Option<PathBuf> {
        self.has_upload(id).then(|| self.upload_path(id, "tar"))
    }

    /// Gives `task` the files of upload `id`, by a link of its own: the upload stays for
    /// other tasks until it expires.
    pub fn claim(&self, id: &str, task: &str) -> Result<(), FilesError> {
        if !self.has_upload(id) {
            return Err(FilesError::NoUpload(id.to_owned()));
        }
        let dir = self.task_dir(task);
        std::fs::create_dir_all(&dir).map_err(FilesError::io("making the task's file dir"))?;
        for ext in ["tar", "txt"] {
            let to = dir.join(format!("inputs.{ext}"));
            match std::fs::hard_link(self.upload_path(id, ext), &to) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(FilesError::NoUpload(id.to_owned()));
                }
                Err(e) => return Err(FilesError::io("keeping the upload for the task")(e)),
            }
        }
        Ok(())
    }

    /// Receives an upload: the tar archive in `body`, written to disk as it arrives and
    /// checked entry by entry (paths, kinds, sizes) before it can be named.
    pub async fn receive(&self, body: Body) -> Result<Upload, FilesError> {
        let _permit = self.uploads.acquire().await;
        let pending = std::fs::read_dir(self.config.root.join("uploads"))
            .map_err(FilesError::io("listing uploads"))?
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tar"))
            .count();
        if pending >= MAX_PENDING_UPLOADS {
            return Err(FilesError::TooMany);
        }
        let id = uuid::Uuid::new_v4().simple().to_string();
        let part = self.upload_path(&id, "part");
        let result = self.receive_into(&id, &part, body).await;
        if result.is_err() {
            let _ = std::fs::remove_file(&part);
        }
        result
    }

    async fn receive_into(&self, id: &str, part: &Path, body: Body) -> Result<Upload, FilesError> {
        let caps = self.config.upload;
        // The archive's own bytes past its contents: a header and padding per entry, and the
        // end blocks.
        let raw_cap = caps
            .max_bytes
            .saturating_add((caps.max_entries as u64).saturating_mul(1536))
            .saturating_add(10240);
        // Written in large pieces: each write of a tokio file is a trip to the blocking pool.
        let mut file = tokio::io::BufWriter::with_capacity(
            IO_BUFFER,
            tokio::fs::File::create(part)
                .await
                .map_err(FilesError::io("storing the upload"))?,
        );
        let mut stream = body.into_data_stream();
        let mut total = 0u64;
        while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
            let chunk = chunk.map_err(|e| FilesError::Io {
                context: "reading the upload".to_owned(),
                source: std::io::Error::other(e.to_string()),
            })?;
            total += chunk.len() as u64;
            if total > raw_cap {
                // Read on a little, unkept, so a client still writing hears the answer rather
                // than a broken connection; past that it is closed on.
                if total > raw_cap.saturating_add(OVERSIZE_DRAIN) {
                    return Err(FilesError::TooLarge(caps.max_bytes));
                }
                continue;
            }
            file.write_all(&chunk)
                .await
                .map_err(FilesError::io("storing the upload"))?;
        }
        if total > raw_cap {
            return Err(FilesError::TooLarge(caps.max_bytes));
        }
        file.flush()
            .await
            .map_err(FilesError::io("storing the upload"))?;
        file.get_ref()
            .sync_all()
            .await
            .map_err(FilesError::io("storing the upload"))?;
        drop(file);
        let (part, tar, txt) = (
            part.to_owned(),
            self.upload_path(id, "tar"),
            self.upload_path(id, "txt"),
        );
        let checked = tokio::task::spawn_blocking(move || -> Result<_, FilesError> {
            // One read checks it and finds what the model is told.
            let read = std::fs::File::open(&part)
                .map(|f| std::io::BufReader::with_capacity(IO_BUFFER, f))
                .map_err(FilesError::io("reading the upload"))?;
            let (files, listing) = archive::inspect(read, caps).map_err(FilesError::Refused)?;
            std::fs::write(&txt, listing).map_err(FilesError::io("storing the upload"))?;
            std::fs::rename(&part, &tar).map_err(FilesError::io("storing the upload"))?;
            Ok(files)
        })
        .await
        .map_err(|e| FilesError::Io {
            context: "checking the upload".to_owned(),
            source: std::io::Error::other(e.to_string()),
        })??;
        let bytes = checked.iter().map(|f| f.bytes).sum();
        Ok(Upload {
            id: id.to_owned(),
            files: checked
                .into_iter()
                .map(|f| FileInfo {
                    path: slashed(&f.path),
                    bytes: f.bytes,
                    modified_ms: None,
                    given: false,
                })
                .collect(),
            bytes,
            expires_ms: ms(SystemTime::now() + UPLOAD_KEEP),
        })
    }

    /// The regular files of `task`'s workspace.
    pub fn list(&self, task: &str) -> Result<TaskFiles, FilesError> {
        let work = self.task_dir(task).join("work");
        let files = list_dir(&work)?;
        // The daemon wrote and checked this archive; one that no longer reads marks nothing
        // as given, so a client keeps every file rather than lose one.
        let given = std::fs::File::open(self.task_dir(task).join("inputs.tar"))
            .ok()
            .and_then(|f| made::Given::of_archive(std::io::BufReader::new(f)).ok())
            .unwrap_or_default();
        Ok(TaskFiles {
            task: task.to_owned(),
            files: files
                .into_iter()
                .map(|f| FileInfo {
                    path: slashed(&f.path),
                    bytes: f.bytes,
                    modified_ms: Some(f.modified_ms),
                    given: given.unchanged(&work, &f),
                })
                .collect(),
        })
    }

    /// Opens the file at `path` in `task`'s workspace, with its size; links are refused.
    pub fn open(&self, task: &str, path: &str) -> Result<(std::fs::File, u64), FilesError> {
        open_in(
            &self.task_dir(task).join("work"),
            path,
            &format!("task {task}"),
            &format!("/v1/tasks/{task}/files"),
        )
    }

    /// Packs `task`'s whole workspace into a temporary tar file, opened and already
    /// unlinked, so it goes away with the handle.
    pub fn pack(&self, task: &str) -> Result<std::fs::File, FilesError> {
        self.pack_dir(&self.task_dir(task).join("work"))
    }

    /// Packs the workspace `work` as [`Files::pack`] does a task's.
    pub fn pack_dir(&self, work: &Path) -> Result<std::fs::File, FilesError> {
        let mut out = tempfile::tempfile_in(&self.config.root)
            .map_err(FilesError::io("packing the workspace"))?;
        if work.is_dir() {
            // Bounded as the workspace's share of the disk is: a sparse file cannot make a
            // download write more than a task may hold.
            let caps = ArchiveCaps {
                max_bytes: self.config.max_task_bytes,
                max_entries: 100_000,
            };
            archive::pack(work, "", &mut out, caps)
                .map_err(|e| FilesError::NotFound(format!("packing the workspace: {e}")))?;
        } else {
            // An empty archive: its two end blocks.
            std::io::Write::write_all(&mut out, &[0u8; 1024])
                .map_err(FilesError::io("packing the workspace"))?;
        }
        use std::io::Seek;
        out.rewind()
            .map_err(FilesError::io("packing the workspace"))?;
        Ok(out)
    }

    /// Removes what the retention says must go: uploads past their hour, workspaces of
    /// tasks finished longer than `keep` ago, then the oldest finished ones while all of
    /// them hold more than `max_total_bytes`, and those of tasks the store does not know.
    /// A task still queued or running keeps its files. Returns the tasks whose files went.
    pub fn sweep(&self, store: &dyn TaskStore) -> Vec<String> {
        let now = SystemTime::now();
        self.sweep_uploads(now);
        let Ok(dirs) = std::fs::read_dir(self.config.root.join("tasks")) else {
            return Vec::new();
        };
        let mut removed = Vec::new();
        let mut finished = Vec::new();
        let mut total = 0u64;
        for dir in dirs.filter_map(Result::ok) {
            let name = dir.file_name().to_string_lossy().into_owned();
            let record = match store.get(&name) {
                Ok(record) => record,
                Err(e) => {
                    tracing::warn!(task = %name, error = %e, "retention could not read the task");
                    continue;
                }
            };
            let Some(record) = record else {
                // A task whose creation failed after its files were linked; a young one may
                // be a task whose record is still on its way to the store.
                let old = dir
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| now.duration_since(t).ok())
                    .is_some_and(|age| age > UPLOAD_KEEP);
                if old && self.remove(&name, store, false) {
                    removed.push(name);
                }
                continue;
            };
            let held = size_of(&dir.path(), self.config.max_task_bytes);
            // A task counts for no more than its own cap: past it, it cannot push another
            // task's files out, only lose its own.
            let size = held.min(self.config.max_task_bytes);
            total = total.saturating_add(size);
            if let Some(done) = record
                .finished_ms
                .filter(|_| record.files_removed_ms.is_none())
            {
                let expired = ms(now).saturating_sub(done) > self.config.keep.as_millis() as u64;
                if expired || held > self.config.max_task_bytes {
                    if self.remove(&name, store, true) {
                        total = total.saturating_sub(size);
                        removed.push(name);
                    }
                } else {
                    finished.push((done, name, size));
                }
            }
        }
        finished.sort();
        for (_, name, size) in finished {
            if total <= self.config.max_total_bytes {
                break;
            }
            if self.remove(&name, store, true) {
                total = total.saturating_sub(size);
                removed.push(name);
            }
        }
        removed
    }

    fn sweep_uploads(&self, now: SystemTime) {
        let Ok(entries) = std::fs::read_dir(self.config.root.join("uploads")) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > UPLOAD_KEEP);
            if old {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    fn remove(&self, task: &str, store: &dyn TaskStore, note: bool) -> bool {
        match tandem_executor::keeper::remove_tree(&self.task_dir(task)) {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(task, error = %e, "retention could not remove the task's files");
                return false;
            }
        }
        if note && let Err(e) = store.files_removed(task, ms(SystemTime::now())) {
            tracing::warn!(task, error = %e, "retention could not note the removal");
        }
        tracing::info!(task, "removed the task's files (retention)");
        true
    }

    /// How often [`Files::sweep`] runs: often enough that nothing outlives its time by more
    /// than a quarter of it, and at most once a minute.
    pub fn sweep_every(&self) -> Duration {
        (self.config.keep / 4).clamp(Duration::from_millis(200), Duration::from_secs(60))
    }
}

/// Whether `id` has the form of an upload or task id: the only names turned into paths.
/// Opens the file at `path` in the workspace `work` of `owner` (named in errors with where
/// its files are listed), with its size; links are refused.
pub fn open_in(
    work: &Path,
    path: &str,
    owner: &str,
    listing: &str,
) -> Result<(std::fs::File, u64), FilesError> {
    let shown = tandem_protocol::files::shown(path);
    archive::read(work, path).map_err(|e| match e {
        ArchiveError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            FilesError::NotFound(format!(
                "{owner} has no file `{shown}`; GET {listing} lists its files"
            ))
        }
        other => FilesError::NotFound(format!(
            "`{shown}` cannot be read: {}",
            tandem_protocol::files::shown(&other.to_string())
        )),
    })
}

/// The regular files of the workspace `work`, in path order (none when it is not there).
pub fn list_dir(work: &Path) -> Result<Vec<archive::ListedFile>, FilesError> {
    if !work.is_dir() {
        return Ok(Vec::new());
    }
    archive::list(work, 100_000)
        .map_err(|e| FilesError::NotFound(format!("listing the workspace: {e}")))
}

pub fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit())
}

pub(crate) fn slashed(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Bytes `dir` holds on disk (allocated blocks, so a sparse file weighs what it costs),
/// following no link; a tree too wide or deep to measure within the entry bound counts as
/// over `cap`.
fn size_of(dir: &Path, cap: u64) -> u64 {
    match tandem_executor::keeper::usage(dir, MEASURE_ENTRIES) {
        Ok(usage) if usage.capped => usage.allocated.max(cap.saturating_add(1)),
        Ok(usage) => usage.allocated,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "retention could not measure a task's files");
            0
        }
    }
}

/// Most entries of one task's files retention measures.
const MEASURE_ENTRIES: u64 = 1_000_000;

/// The media type a workspace file is served as, and whether a browser may show it.
pub fn media_type(path: &str) -> (&'static str, bool) {
    if let Some(picture) = archive::picture_type(Path::new(path)) {
        return (picture, true);
    }
    let ext = path
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "txt" | "md" | "csv" | "tsv" | "log" | "py" | "sh" | "js" | "rs" | "toml" | "yaml"
        | "yml" => ("text/plain; charset=utf-8", true),
        "json" => ("application/json", true),
        _ => ("application/octet-stream", false),
    }
}

/// Where the API serves file `path` of task `task`, its parts percent-encoded.
pub fn file_href(task: &str, path: &str) -> String {
    let mut href = format!("/v1/tasks/{task}/files/");
    for (i, part) in path.split('/').enumerate() {
        if i > 0 {
            href.push('/');
        }
        for b in part.bytes() {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                href.push(b as char);
            } else {
                href.push_str(&format!("%{b:02X}"));
            }
        }
    }
    href
}
