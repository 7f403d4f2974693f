//! One session's container: start it, talk to its runner, run blocks, remove it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bollard::container::LogOutput;
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, InspectContainerOptions,
    KillContainerOptionsBuilder, RenameContainerOptionsBuilder,
};
use futures::StreamExt;
use tandem_executor::scratch::TempTree;
use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Limits, Session, SessionSpec,
    scratch,
};
use tandem_executor_runner::{Changes, Conn, Frame, FrameReader, Prepared, READY_LIMIT, Request};
use tokio::io::AsyncWriteExt;

use crate::{
    DockerError, DockerExecutor, WorkspaceMode, engine, labels, remove_container, remove_volume,
};

/// Where a session container's `/workspace` comes from.
pub(crate) enum Place {
    /// A host directory, bind-mounted.
    Host(PathBuf),
    /// A volume of the session's own, by name.
    Volume(String),
}

pub(crate) struct DockerSession {
    executor: DockerExecutor,
    id: String,
    session_id: String,
    /// The workspace on this machine: the bind-mounted directory, or the mirror of the
    /// session's volume.
    workspace: PathBuf,
    /// The session's workspace volume, when its workspace is the container's own.
    volume: Option<String>,
    /// The mirror missed a block's changes: the next copy takes the whole workspace.
    resync: bool,
    owned_workspace: Option<TempTree>,
    /// A kept workspace's mode before the session opened it to the block's user.
    restore_mode: Option<u32>,
    limits: Limits,
    /// `None` after the runner died; the next block restarts the container.
    conn: Option<Conn>,
    blocks: u32,
    closed: bool,
}

impl DockerSession {
    pub(crate) async fn open(
        executor: DockerExecutor,
        spec: SessionSpec,
    ) -> Result<Self, ExecError> {
        let session_id = uuid::Uuid::new_v4().simple().to_string();
        let inner = executor.inner();
        let ws_err = |path: &Path| {
            let path = path.to_owned();
            move |source| ExecError::Workspace { path, source }
        };
        let (workspace, owned_workspace) =
            scratch::open_workspace(spec.workdir, &inner.root, "ws-")?;
        let by_volume = inner.config.workspace == WorkspaceMode::Volume;
        // Code runs as an unprivileged user that must be able to write the workspace. A kept
        // one (--workdir) holds the host user's files: the sticky bit keeps the block from
        // renaming over or removing what it does not own, and its mode is given back when
        // the session ends. A mirror is only ever written by Tandem.
        let restore_mode = match &owned_workspace {
            _ if by_volume => None,
            Some(_) => {
                set_mode(&workspace, 0o777).map_err(ws_err(&workspace))?;
                None
            }
            None => {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(&workspace)
                    .map_err(ws_err(&workspace))?
                    .permissions()
                    .mode()
                    & 0o7777;
                set_mode(&workspace, 0o1777).map_err(ws_err(&workspace))?;
                Some(mode)
            }
        };

        let mut labels: HashMap<String, String> = spec.labels.iter().cloned().collect();
        labels.insert(labels::DAEMON.to_owned(), inner.config.daemon_id.clone());
        labels.insert(labels::OWNER.to_owned(), inner.owner.clone());
        labels.insert(labels::SESSION.to_owned(), session_id.clone());
        labels.entry(labels::TASK.to_owned()).or_default();
        if owned_workspace.is_some() {
            labels.insert(
                labels::WORKSPACE.to_owned(),
                workspace.display().to_string(),
            );
        }
        if let Ok(mut live) = inner.live.lock() {
            live.insert(session_id.clone());
        }
        let place = if by_volume {
            let name = format!("tandem-ws-{session_id}");
            let volume_labels = [labels::DAEMON, labels::OWNER, labels::SESSION, labels::TASK]
                .into_iter()
                .filter_map(|k| Some((k.to_owned(), labels.get(k)?.clone())))
                .collect();
            inner
                .docker
                .create_volume(bollard::models::VolumeCreateRequest {
                    name: Some(name.clone()),
                    labels: Some(volume_labels),
                    ..Default::default()
                })
                .await
                .map_err(|e| {
                    executor.forget(&session_id);
                    ExecError::from(engine("creating the session's workspace volume")(e))
                })?;
            labels.insert(labels::VOLUME.to_owned(), name.clone());
            Place::Volume(name)
        } else {
            Place::Host(workspace.clone())
        };
        let volume = match &place {
            Place::Volume(name) => Some(name.clone()),
            Place::Host(_) => None,
        };
        let body = executor.container_body(&place, labels, &spec.limits);
        let name = format!("tandem-{}", &session_id[..12]);
        let created = match inner
            .docker
            .create_container(
                Some(CreateContainerOptionsBuilder::default().name(&name).build()),
                body,
            )
            .await
        {
            Ok(created) => created,
            Err(e) => {
                if let Some(volume) = &volume {
                    remove_volume(&inner.docker, volume).await;
                }
                executor.forget(&session_id);
                return Err(ExecError::from(DockerError::Engine {
                    what: format!("creating a container from `{}`", inner.config.image),
                    source: e,
                }));
            }
        };
        let mut session = Self {
            executor,
            id: created.id,
            session_id,
            workspace,
            volume,
            resync: false,
            owned_workspace,
            restore_mode,
            limits: spec.limits,
            conn: None,
            blocks: 0,
            closed: false,
        };
        // On failure the session is dropped, which removes the container.
        session.conn = Some(start(&session.executor, &session.id).await?);
        if session.volume.is_some()
            && tandem_executor_runner::mirror::has_entries(&session.workspace)
        {
            session.upload(None).await?;
        }
        Ok(session)
    }

    /// Copies the mirror (`None`), or these files of it, into the session's volume, owned by
    /// the blocks' user, and has the runner take it as seen (those files are no block's
    /// changes).
    async fn upload(&mut self, files: Option<Vec<PathBuf>>) -> Result<(), ExecError> {
        let inner = self.executor.inner();
        let owner = tandem_executor_runner::mirror::block_owner(&inner.config.user);
        let packed = tandem_executor_runner::mirror::pack(&self.workspace, files, owner).await?;
        let body = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(packed));
        inner
            .docker
            .upload_to_container(
                &self.id,
                Some(
                    bollard::query_parameters::UploadToContainerOptionsBuilder::default()
                        .path("/workspace")
                        .build(),
                ),
                bollard::body_try_stream(body),
            )
            .await
            .map_err(engine("copying files into the session's volume"))?;
        self.request_done(&Request::Rescan).await
    }

    /// Sends `op` to the runner and waits for its `d`.
    async fn request_done(&mut self, op: &Request<'_>) -> Result<(), ExecError> {
        match self.conn.as_mut() {
            Some(conn) => conn.request_done(op, READY_LIMIT).await,
            None => Err(ExecError::Backend(
                "the session container is not running".to_owned(),
            )),
        }
    }

    /// Brings the mirror up to date with what a block changed in the volume, through the
    /// engine's archive calls.
    async fn sync(&mut self, changes: Changes, inline: Vec<u8>) -> Result<(), ExecError> {
        let mut fetch = Archives {
            docker: self.executor.inner().docker.clone(),
            id: self.id.clone(),
        };
        tandem_executor_runner::mirror::sync(
            &self.workspace,
            changes,
            inline,
            self.resync,
            &mut fetch,
        )
        .await?;
        self.resync = false;
        Ok(())
    }

    /// Starts a container for the warm pool: a temporary workspace, no task yet.
    pub(crate) async fn prestart(executor: &DockerExecutor) -> Result<Warm, ExecError> {
        let mut session = Self::open(executor.clone(), SessionSpec::default()).await?;
        // The pool owns the container now; this session must not remove it.
        session.closed = true;
        Ok(Warm {
            executor: executor.clone(),
            id: std::mem::take(&mut session.id),
            session_id: std::mem::take(&mut session.session_id),
            workspace: session.owned_workspace.take(),
            volume: session.volume.take(),
            conn: session.conn.take(),
        })
    }

    /// Turns a pooled container into this task's session, naming it after the task (labels
    /// cannot change after create, so the name is what carries the task).
    pub(crate) async fn from_warm(
        executor: DockerExecutor,
        mut warm: Warm,
        spec: SessionSpec,
    ) -> Result<Self, ExecError> {
        let task = spec
            .labels
            .iter()
            .find(|(k, _)| k == labels::TASK)
            .map(|(_, v)| v.as_str());
        let id = std::mem::take(&mut warm.id);
        let workspace = warm.workspace.take();
        let session = Self {
            workspace: workspace
                .as_ref()
                .map(|w| w.path().to_owned())
                .unwrap_or_default(),
            executor,
            id,
            session_id: std::mem::take(&mut warm.session_id),
            volume: warm.volume.take(),
            resync: false,
            owned_workspace: workspace,
            // Pooled containers have temporary workspaces only.
            restore_mode: None,
            limits: spec.limits,
            conn: warm.conn.take(),
            blocks: 0,
            closed: false,
        };
        if let Some(task) = task.filter(|t| !t.is_empty()) {
            let name = format!(
                "tandem-{}-{}",
                docker_name_part(task),
                &session.session_id[..12.min(session.session_id.len())]
            );
            session
                .executor
                .inner()
                .docker
                .rename_container(
                    &session.id,
                    RenameContainerOptionsBuilder::default().name(&name).build(),
                )
                .await
                .map_err(engine("naming the session container after its task"))?;
        }
        Ok(session)
    }

    /// Brings a container whose runner died back up (files in the workspace survive).
    async fn restart(&mut self) -> Result<(), ExecError> {
        let docker = &self.executor.inner().docker;
        let kill = KillContainerOptionsBuilder::default()
            .signal("KILL")
            .build();
        let _ = docker.kill_container(&self.id, Some(kill)).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let state = match docker
                .inspect_container(&self.id, None::<InspectContainerOptions>)
                .await
            {
                Ok(found) => found.state,
                Err(e) => {
                    let e = engine("inspecting the session container")(e).into();
                    return Err(lost_or(&self.executor, e).await);
                }
            };
            if !state.and_then(|s| s.running).unwrap_or(false) {
                break;
            }
            if Instant::now() > deadline {
                return Err(ExecError::Backend(
                    "the session container did not stop within 10 s".to_owned(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.conn = match start(&self.executor, &self.id).await {
            Ok(conn) => Some(conn),
            Err(e) => return Err(lost_or(&self.executor, e).await),
        };
        if self.volume.is_some() {
            // The new runner has seen nothing: it takes the volume as it is, which the last
            // copy out already holds.
            self.request_done(&Request::Rescan).await?;
        }
        Ok(())
    }

    async fn run_block(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> Result<ExecOutcome, ExecError> {
        let executor = self.executor.clone();
        let inner = executor.inner();
        if self.conn.is_none() {
            self.restart().await?;
        }
        self.blocks += 1;
        let sandbox = tandem_executor_runner::Sandbox {
            executor: "docker",
            languages: &inner.config.languages,
            env: tandem_executor_runner::base_env(&inner.config.env).collect(),
        };
        let Some(conn) = self.conn.as_mut() else {
            return Err(ExecError::Backend(
                "the session container is not running".to_owned(),
            ));
        };
        let limits = self.limits.clone();
        let block =
            match tandem_executor_runner::run(conn, &sandbox, &req, &ctx, &limits, self.blocks)
                .await
            {
                Ok(Prepared::Ready(block)) => block,
                Ok(Prepared::Refused(outcome)) => return Ok(outcome),
                Err(e) => return Err(e),
            };
        if !block.answered {
            // No report: the runner is gone or stuck. Kill the container; the next block
            // starts it again.
            tracing::warn!(container = %self.id, "the runner stopped answering; restarting the container for the next block");
            self.conn = None;
            let kill = KillContainerOptionsBuilder::default()
                .signal("KILL")
                .build();
            let _ = inner.docker.kill_container(&self.id, Some(kill)).await;
            if let Err(reason) = self.executor.answers().await {
                return Err(ExecError::Lost {
                    host: inner.config.label().to_owned(),
                    reason,
                });
            }
        }
        if let Some(e) = &block.runner_error {
            // What the block changed was not reported: the next copy takes it all.
            self.resync = true;
            return Err(ExecError::Backend(format!("Tandem's runner failed: {e}")));
        }
        let mut block = *block;
        if self.volume.is_some() {
            // Copied out after every block: the host copy is what the task's files API shows
            // and what carries the task on if this engine goes away.
            let (changes, inline) = block.take_changes();
            if let Err(e) = self.sync(changes, inline).await {
                tracing::warn!(container = %self.id, error = %e, "copying the workspace out failed; the next block copies all of it");
                self.resync = true;
            }
        }
        Ok(block.outcome())
    }

    async fn shutdown(&mut self) -> Result<(), ExecError> {
        self.closed = true;
        // Files the unprivileged user made must be removable (temporary workspace) or
        // manageable (a kept one) by the host user afterwards.
        let op = if self.owned_workspace.is_some() {
            Request::Wipe
        } else {
            Request::Release
        };
        if self.volume.is_some() {
            // The volume goes with the session; the mirror is Tandem's own.
            self.conn = None;
        }
        if let Some(mut conn) = self.conn.take() {
            let _ = conn.request_done(&op, Duration::from_secs(5)).await;
        }
        remove_container(&self.executor.inner().docker, &self.id).await;
        if let Some(volume) = self.volume.take() {
            remove_volume(&self.executor.inner().docker, &volume).await;
        }
        self.executor.forget(&self.session_id);
        self.restore_workdir();
        if let Some(ws) = self.owned_workspace.take() {
            scratch::remove_dirs(vec![ws], self.executor.inner().root.clone()).await?;
        }
        Ok(())
    }

    /// Gives a kept workspace its mode back, once no block can reach it.
    fn restore_workdir(&mut self) {
        if let Some(mode) = self.restore_mode.take()
            && let Err(e) = set_mode(&self.workspace, mode)
        {
            tracing::warn!(workdir = %self.workspace.display(), error = %e, "could not give the workdir its mode back");
        }
    }
}

impl Session for DockerSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(self.run_block(req, ctx))
    }

    fn workspace(&self) -> Option<&Path> {
        Some(&self.workspace)
    }

    fn put_archive(
        &mut self,
        archive: &Path,
        caps: tandem_executor::archive::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<tandem_executor::archive::ArchivedFile>, ExecError>> {
        let archive = archive.to_owned();
        Box::pin(async move {
            // Bound into the container, the files must be the blocks' user's to change (a
            // mirror is copied to the volume as theirs below).
            let owner = self.volume.is_none().then(|| {
                let (uid, gid) =
                    tandem_executor_runner::mirror::block_owner(&self.executor.inner().config.user);
                (
                    u32::try_from(uid).unwrap_or(65534),
                    u32::try_from(gid).unwrap_or(65534),
                )
            });
            let placed = tandem_executor::place_archive_for(
                Some(self.workspace.clone()),
                archive,
                caps,
                owner,
            )
            .await?;
            if self.volume.is_some() {
                // Checked and placed on this machine first; the volume then gets those files
                // from the mirror, as the blocks' user's.
                let paths: Vec<PathBuf> = placed.iter().map(|f| f.path.clone()).collect();
                self.upload(Some(paths)).await?;
            }
            Ok(placed)
        })
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        Box::pin(async move { self.shutdown().await })
    }
}

impl Drop for DockerSession {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        // Dropped without close (a cancelled task, a failed open): remove the container in
        // the background; if the process exits first, the next Tandem reaps it.
        let executor = self.executor.clone();
        let (id, session_id) = (self.id.clone(), self.session_id.clone());
        let ws = self.owned_workspace.take();
        let volume = self.volume.take();
        let (workdir, mode) = (self.workspace.clone(), self.restore_mode.take());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let docker = &executor.inner().docker;
                remove_container(docker, &id).await;
                if let Some(volume) = volume {
                    remove_volume(docker, &volume).await;
                }
                executor.forget(&session_id);
                drop(ws);
                if let Some(mode) = mode {
                    let _ = set_mode(&workdir, mode);
                }
            });
        }
    }
}

/// Attaches to the container, starts it and waits for the runner to say it is ready.
async fn start(executor: &DockerExecutor, id: &str) -> Result<Conn, ExecError> {
    let docker = &executor.inner().docker;
    let attach = docker
        .attach_container(
            id,
            Some(
                AttachContainerOptionsBuilder::default()
                    .stream(true)
                    .stdin(true)
                    .stdout(true)
                    .stderr(true)
                    .build(),
            ),
        )
        .await
        .map_err(engine("attaching to the session container"))?;
    docker
        .start_container(id, None)
        .await
        .map_err(engine("starting the session container"))?;
    let (mut conn, reader) = Conn::new(attach.input);
    tokio::spawn(read_frames(attach.output, reader));
    let image = &executor.inner().config.image;
    match conn.ready().await {
        Ok(Ok(())) => Ok(conn),
        Ok(Err(other)) => Err(ExecError::Unavailable {
            what: format!("Tandem's runner in image `{image}`"),
            hint: format!(
                "it did not start ({}); the image needs python3 on its PATH",
                match other {
                    Some(Frame::Error(e)) => e,
                    Some(f) => format!("unexpected {f:?}"),
                    None => "the container exited".to_owned(),
                }
            ),
        }),
        Err(_) => Err(ExecError::Backend(format!(
            "the session container from `{image}` did not get ready within {READY_LIMIT:?}"
        ))),
    }
}

/// Feeds what the attached runner writes to its connection.
async fn read_frames(
    mut output: std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>,
    >,
    mut reader: FrameReader,
) {
    while let Some(item) = output.next().await {
        let more = match item {
            Ok(LogOutput::StdOut { message }) => reader.stdout(&message),
            Ok(LogOutput::StdErr { message }) => reader.stderr(&message),
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(error = %e, "the runner's output stream ended");
                false
            }
        };
        if !more {
            return;
        }
    }
}

/// A started container waiting in the pool, with its runner attached. Dropping it removes
/// the container and its workspace.
pub(crate) struct Warm {
    executor: DockerExecutor,
    id: String,
    session_id: String,
    workspace: Option<TempTree>,
    volume: Option<String>,
    conn: Option<Conn>,
}

impl Warm {
    /// The container's id.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// Whether its runner is still attached (a container that died in the pool is not).
    pub(crate) fn alive(&mut self) -> bool {
        self.conn.as_mut().is_some_and(Conn::alive)
    }

    /// Removes the container and its workspace now.
    pub(crate) async fn remove(mut self) {
        let id = std::mem::take(&mut self.id);
        let docker = &self.executor.inner().docker;
        remove_container(docker, &id).await;
        if let Some(volume) = self.volume.take() {
            remove_volume(docker, &volume).await;
        }
        self.executor.forget(&self.session_id);
        if let Some(ws) = self.workspace.take() {
            let _ = tokio::task::spawn_blocking(move || ws.close()).await;
        }
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        if self.id.is_empty() {
            return;
        }
        let (executor, id, ws, volume) = (
            self.executor.clone(),
            std::mem::take(&mut self.id),
            self.workspace.take(),
            self.volume.take(),
        );
        let session_id = self.session_id.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let docker = &executor.inner().docker;
                remove_container(docker, &id).await;
                if let Some(volume) = volume {
                    remove_volume(docker, &volume).await;
                }
                executor.forget(&session_id);
                drop(ws);
            });
        }
    }
}

/// `text` as a container-name fragment: `[A-Za-z0-9_.-]`, at most 64 characters.
fn docker_name_part(text: &str) -> String {
    text.chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// `error`, or that the session was lost when its engine no longer answers.
async fn lost_or(executor: &DockerExecutor, error: ExecError) -> ExecError {
    match executor.answers().await {
        Ok(()) => error,
        Err(reason) => ExecError::Lost {
            host: executor.label().to_owned(),
            reason,
        },
    }
}

/// Copies paths out of a container through the engine's archive call.
struct Archives {
    docker: bollard::Docker,
    id: String,
}

impl tandem_executor_runner::mirror::Fetch for Archives {
    fn fetch(
        &mut self,
        path: String,
        max_bytes: u64,
    ) -> BoxFuture<'_, Result<Option<std::fs::File>, ExecError>> {
        Box::pin(async move {
            use tokio::io::AsyncSeekExt;
            let io = |e| ExecError::io("copying the workspace out", e);
            let mut written: u64 = 0;
            let mut out = tokio::fs::File::from_std(tempfile::tempfile().map_err(io)?);
            let mut stream = self.docker.download_from_container(
                &self.id,
                Some(
                    bollard::query_parameters::DownloadFromContainerOptionsBuilder::default()
                        .path(&path)
                        .build(),
                ),
            );
            while let Some(chunk) = stream.next().await {
                match chunk {
                    Ok(bytes) => {
                        written = written.saturating_add(bytes.len() as u64);
                        if written > max_bytes {
                            return Err(tandem_executor_runner::mirror::over_max(&path, max_bytes));
                        }
                        out.write_all(&bytes).await.map_err(io)?;
                    }
                    Err(bollard::errors::Error::DockerResponseServerError {
                        status_code: 404,
                        ..
                    }) => return Ok(None),
                    Err(e) => {
                        return Err(DockerError::Engine {
                            what: format!("copying `{path}` out of the session container"),
                            source: e,
                        }
                        .into());
                    }
                }
            }
            out.flush().await.map_err(io)?;
            out.rewind().await.map_err(io)?;
            Ok(Some(out.into_std().await))
        })
    }
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}
