//! Tasks' files on the daemon: uploads waiting for a task, each task's workspace (kept after
//! it ends, so its files can be read), and the retention that removes them.
//!
//! Layout, beneath the state dir's `files/`:
//! - `uploads/ID.tar` and `ID.txt`: an upload, checked entry by entry, and what the model is
//!   told of it; removed an hour after it arrived. `uploads/ID.part`: one on its way in, or
//!   an archive for a session's workspace, removed once placed.
//! - `tasks/ID/inputs.tar`, `inputs.txt`: a task's own link to the upload it named, so the
//!   upload expiring does not take the task's files with it.
//! - `tasks/ID/work/`: the workspace every session of the task opens.
//!
//! Ids are checked to be lowercase hex before they become paths, and everything read out
//! of a workspace goes through `archive`, beneath a directory handle, following no link.
//!
//! Bounds across requests: at most [`MAX_RECEIVING`] archives are received (or placed) at
//! once, each within `[files] max_upload_mb`, and at most [`MAX_PENDING_UPLOADS`] wait for a
//! task; a workspace downloaded as tar is sent as it is packed, holding a few pieces in
//! memory and nothing on disk, at most [`MAX_PACKS`] at once.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use tandem_executor_kit::archive::{self, ArchiveCaps, ArchiveError};
use tandem_executor_kit::made;
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
/// Most archives received (uploads and session puts) at once: each holds a file of up to
/// `[files] max_upload_mb` on disk and a blocking check.
pub const MAX_RECEIVING: usize = 4;
/// Longest an archive waits for one of those places before it is refused (429).
pub const RECEIVE_WAIT: Duration = Duration::from_secs(30);
/// Longest an archive's sender may go without sending a byte; then it is refused, and its
/// place goes to another.
pub const RECEIVE_STALL: Duration = Duration::from_secs(60);
/// Most workspaces sent as tar (`?format=tar`) at once: each holds a blocking thread and
/// a few pieces of 256 KiB in memory while its client reads.
pub const MAX_PACKS: usize = 16;
/// Longest a tar download waits for one of those places before it is refused (429).
pub const PACK_WAIT: Duration = Duration::from_secs(10);
/// Longest a tar download's client may take no bytes; then it is cut off, and its place
/// goes to another.
pub const PACK_STALL: Duration = Duration::from_secs(60);
/// Bytes of a download (a file, or a pack) read and sent at a time: about what a client
/// that stops reading holds of the daemon's memory.
pub const SEND_PIECE: usize = 256 << 10;
/// Pieces of a pack packed ahead of its client.
const PACK_PIECES: usize = 4;
/// Most entries a workspace's listing or tar download walks.
const PACK_ENTRIES: usize = 100_000;

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
    /// out, and once finished it loses its own first. Also the most file content a
    /// `?format=tar` download of it may send.
    pub max_task_bytes: u64,
    /// What one upload may hold.
    pub upload: ArchiveCaps,
    /// What the snapshots (kept beside the files, in `snapshots/`) may hold.
    pub snapshots: tandem_snapshots::Caps,
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
    /// The daemon does as many of these at once as it will; a later try may find room.
    #[error("{what}; try again in {retry_secs} s")]
    Busy {
        /// What is under way, and the bound.
        what: String,
        /// When to try again, in seconds (the answer's `Retry-After`).
        retry_secs: u64,
    },
    /// The sender stopped sending the archive.
    #[error(
        "the archive stalled: no bytes arrived for {} s; send it again",
        RECEIVE_STALL.as_secs()
    )]
    Stalled,
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
    snapshots: tandem_snapshots::Store,
    volumes: tandem_volumes::Volumes,
    uploads: tokio::sync::Semaphore,
    packs: Arc<tokio::sync::Semaphore>,
}

/// An archive received for a session's workspace and checked: on disk only until it is
/// placed, removed when this is dropped, and never an upload a task could name.
pub struct Received<'a> {
    path: PathBuf,
    /// What it holds.
    pub upload: Upload,
    /// Its place among the archives received at once, kept until it is placed.
    _place: tokio::sync::SemaphorePermit<'a>,
}

impl Received<'_> {
    /// The archive, to be placed.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Received<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Files {
    /// Files under `config.root`, made (private to the daemon's user) if missing.
    pub fn new(config: FilesConfig) -> std::io::Result<Self> {
        for dir in ["uploads", "tasks"] {
            std::fs::create_dir_all(config.root.join(dir))?;
        }
        let snapshots =
            tandem_snapshots::Store::open(&config.root.join("snapshots"), config.snapshots)
                .map_err(std::io::Error::other)?;
        let volumes = tandem_volumes::Volumes::open(&config.root.join("volumes"))
            .map_err(std::io::Error::other)?;
        Ok(Self {
            config,
            snapshots,
            volumes,
            uploads: tokio::sync::Semaphore::new(MAX_RECEIVING),
            packs: Arc::new(tokio::sync::Semaphore::new(MAX_PACKS)),
        })
    }

    /// The directory that holds them all.
    pub fn root(&self) -> &Path {
        &self.config.root
    }

    /// The snapshots of sandboxes' workspaces.
    pub fn snapshots(&self) -> &tandem_snapshots::Store {
        &self.snapshots
    }

    /// The volumes, named storage that outlives tasks; retention never touches them.
    pub fn volumes(&self) -> &tandem_volumes::Volumes {
        &self.volumes
    }

    /// Where the archives restored from snapshots are made, beside the uploads.
    pub fn scratch(&self) -> PathBuf {
        self.config.root.join("uploads")
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

    /// A place among the archives received at once, waited for at most [`RECEIVE_WAIT`].
    async fn receiving(&self) -> Result<tokio::sync::SemaphorePermit<'_>, FilesError> {
        let busy = || FilesError::Busy {
            what: format!(
                "{MAX_RECEIVING} archives (uploads and session files) are being received now, the most this daemon takes at once"
            ),
            retry_secs: RECEIVE_WAIT.as_secs(),
        };
        tokio::time::timeout(RECEIVE_WAIT, self.uploads.acquire())
            .await
            .map_err(|_| busy())?
            .map_err(|_| busy())
    }

    /// Receives an upload: the tar archive in `body`, written to disk as it arrives and
    /// checked entry by entry (paths, kinds, sizes) before it can be named.
    pub async fn receive(&self, body: Body) -> Result<Upload, FilesError> {
        let _place = self.receiving().await?;
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
        let kept = (self.upload_path(&id, "tar"), self.upload_path(&id, "txt"));
        let result = self.receive_into(&part, body, Some(kept)).await;
        if result.is_err() {
            let _ = std::fs::remove_file(&part);
        }
        Ok(upload_of(id, result?, SystemTime::now() + UPLOAD_KEEP))
    }

    /// Receives an archive for a session's workspace, checked as an upload is but kept only
    /// until it is placed: it is no upload, and counts against none.
    pub async fn receive_unkept(&self, body: Body) -> Result<Received<'_>, FilesError> {
        let place = self.receiving().await?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let part = self.upload_path(&id, "part");
        match self.receive_into(&part, body, None).await {
            Ok(files) => Ok(Received {
                path: part,
                upload: upload_of(id, files, SystemTime::now()),
                _place: place,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&part);
                Err(e)
            }
        }
    }

    /// Writes the archive in `body` to `part` and checks it; with `keep` (its archive and
    /// listing paths), moves it there, to be named.
    async fn receive_into(
        &self,
        part: &Path,
        body: Body,
        keep: Option<(PathBuf, PathBuf)>,
    ) -> Result<Vec<archive::ArchivedFile>, FilesError> {
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
        loop {
            // A sender that stops sending gives its place back rather than hold it.
            let next = tokio::time::timeout(RECEIVE_STALL, futures::StreamExt::next(&mut stream))
                .await
                .map_err(|_| FilesError::Stalled)?;
            let Some(chunk) = next else {
                break;
            };
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
        let part = part.to_owned();
        tokio::task::spawn_blocking(move || -> Result<_, FilesError> {
            // One read checks it and finds what the model is told.
            let read = std::fs::File::open(&part)
                .map(|f| std::io::BufReader::with_capacity(IO_BUFFER, f))
                .map_err(FilesError::io("reading the upload"))?;
            let (files, listing) = archive::inspect(read, caps).map_err(FilesError::Refused)?;
            if let Some((tar, txt)) = keep {
                std::fs::write(&txt, listing).map_err(FilesError::io("storing the upload"))?;
                std::fs::rename(&part, &tar).map_err(FilesError::io("storing the upload"))?;
            }
            Ok(files)
        })
        .await
        .map_err(|e| FilesError::Io {
            context: "checking the upload".to_owned(),
            source: std::io::Error::other(e.to_string()),
        })?
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

    /// The workspace of `task`, where it is or would be.
    pub fn task_work(&self, task: &str) -> PathBuf {
        self.task_dir(task).join("work")
    }

    /// The workspace `work` as a tar archive, sent as it is packed: nothing is written to
    /// disk, and a few pieces are held in memory. A download waits at most [`PACK_WAIT`] for
    /// one of [`MAX_PACKS`] places; a client that leaves stops its pack at once, and one
    /// that takes nothing for [`PACK_STALL`] is cut off. A workspace over what a task may
    /// hold (counted as the bytes sent: a sparse file costs its whole length) or too wide is
    /// refused before anything is sent.
    pub async fn pack_stream(&self, work: PathBuf) -> Result<Body, FilesError> {
        let busy = || FilesError::Busy {
            what: format!(
                "{MAX_PACKS} workspace downloads (?format=tar) are being sent now, the most this daemon sends at once"
            ),
            retry_secs: PACK_WAIT.as_secs(),
        };
        let place = tokio::time::timeout(PACK_WAIT, self.packs.clone().acquire_owned())
            .await
            .map_err(|_| busy())?
            .map_err(|_| busy())?;
        // Bounded as the workspace's share of the disk is: a sparse file cannot make a
        // download send more than a task may hold.
        let caps = ArchiveCaps {
            max_bytes: self.config.max_task_bytes,
            max_entries: PACK_ENTRIES,
        };
        let checked = work.clone();
        tokio::task::spawn_blocking(move || fits(&checked, caps))
            .await
            .map_err(|e| FilesError::Io {
                context: "packing the workspace".to_owned(),
                source: std::io::Error::other(e.to_string()),
            })??;
        let (tx, rx) = tokio::sync::mpsc::channel(PACK_PIECES);
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let _place = place;
            let mut out = Pieces {
                tx,
                runtime,
                piece: Vec::with_capacity(SEND_PIECE),
                ended: false,
            };
            let packed = if work.is_dir() {
                archive::pack(&work, "", &mut out, caps)
                    .map(drop)
                    .map_err(|e| std::io::Error::other(format!("packing the workspace: {e}")))
            } else {
                // An empty archive: its two end blocks.
                std::io::Write::write_all(&mut out, &[0u8; 1024])
            };
            match packed.and_then(|()| std::io::Write::flush(&mut out)) {
                Ok(()) => {}
                Err(e) if out.ended => {
                    tracing::debug!(work = %work.display(), error = %e, "a tar download ended early");
                }
                Err(e) => {
                    // The workspace changed under the pack: the client sees the archive cut
                    // short, never one that reads as whole.
                    tracing::warn!(work = %work.display(), error = %e, "a tar download failed");
                    let _ = out.send(Err(e));
                }
            }
        });
        Ok(Body::from_stream(futures::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|piece| (piece, rx)) },
        )))
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
        match tandem_executor_kit::keeper::remove_tree(&self.task_dir(task)) {
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
    archive::list(work, PACK_ENTRIES)
        .map_err(|e| FilesError::NotFound(format!("listing the workspace: {e}")))
}

pub fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What the API answers of a received archive `id` holding `files`.
fn upload_of(id: String, files: Vec<archive::ArchivedFile>, expires: SystemTime) -> Upload {
    let bytes = files.iter().map(|f| f.bytes).sum();
    Upload {
        id,
        files: files
            .into_iter()
            .map(|f| FileInfo {
                path: slashed(&f.path),
                bytes: f.bytes,
                modified_ms: None,
                given: false,
            })
            .collect(),
        bytes,
        expires_ms: ms(expires),
    }
}

/// Whether the workspace `work` packs within `caps`, by its files' sizes: checked before a
/// download's answer starts, so a refusal is an answer rather than an archive cut short.
fn fits(work: &Path, caps: ArchiveCaps) -> Result<(), FilesError> {
    let mut bytes = 0u64;
    for file in list_dir(work)? {
        bytes = bytes.saturating_add(file.bytes);
        if bytes > caps.max_bytes {
            let over = ArchiveError::TooLarge {
                path: slashed(&file.path),
                max: caps.max_bytes,
            };
            return Err(FilesError::NotFound(format!(
                "packing the workspace: {over}"
            )));
        }
    }
    Ok(())
}

/// A pack's bytes on their way to its client, a piece at a time. A write that finds
/// [`PACK_PIECES`] pieces not yet taken waits for the client, at most [`PACK_STALL`], and
/// fails at once when the client has left: either way the pack stops.
struct Pieces {
    tx: tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
    runtime: tokio::runtime::Handle,
    piece: Vec<u8>,
    /// The client left or stalled: nothing more goes to it.
    ended: bool,
}

impl Pieces {
    fn send(&mut self, item: std::io::Result<Bytes>) -> std::io::Result<()> {
        use tokio::sync::mpsc::error::SendTimeoutError;
        // On the blocking pool, never a runtime's worker: waiting here is allowed.
        match self
            .runtime
            .block_on(self.tx.send_timeout(item, PACK_STALL))
        {
            Ok(()) => Ok(()),
            Err(SendTimeoutError::Timeout(_)) => {
                self.ended = true;
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the client took nothing for {} s", PACK_STALL.as_secs()),
                ))
            }
            Err(SendTimeoutError::Closed(_)) => {
                self.ended = true;
                Err(std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    "the client left",
                ))
            }
        }
    }

    fn ship(&mut self) -> std::io::Result<()> {
        if self.piece.is_empty() {
            return Ok(());
        }
        let piece = std::mem::replace(&mut self.piece, Vec::with_capacity(SEND_PIECE));
        self.send(Ok(Bytes::from(piece)))
    }
}

impl std::io::Write for Pieces {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len().min(SEND_PIECE - self.piece.len());
        self.piece.extend_from_slice(&buf[..n]);
        if self.piece.len() >= SEND_PIECE {
            self.ship()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.ship()
    }
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
    match tandem_executor_kit::keeper::usage(dir, MEASURE_ENTRIES) {
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
