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
use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Session, SessionSpec,
};
use tandem_executor_kit::scratch;
use tandem_executor_kit::scratch::TempTree;
use tandem_executor_runner::session::{Offer, RunnerSession, Transport};
use tandem_executor_runner::{Conn, Frame, FrameReader, READY_LIMIT, Request};
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
    container: Container,
    /// Its workspace on this machine is the bind-mounted directory, or the mirror of the
    /// session's volume.
    runner: RunnerSession,
    session_id: String,
    /// The session's workspace volume, when its workspace is the container's own.
    volume: Option<String>,
    owned_workspace: Option<TempTree>,
    /// A kept workspace's mode before the session opened it to the block's user.
    restore_mode: Option<u32>,
    /// Ends the egress relay of a container on an engine reached over the network.
    relay: Option<tandem_executor::CancellationToken>,
    /// How long its opening waited for a container from the warm pool (none: it started its
    /// own).
    pool_wait: Option<Duration>,
    /// The container's memory peak as this machine's cgroup file shows it, when Tandem may
    /// reset it (the engine is local and Tandem is root); `None` until first looked for.
    peak: Option<Option<crate::usage::HostPeak>>,
    closed: bool,
}

/// A session's container, as its runner is reached and files cross into it.
struct Container {
    executor: DockerExecutor,
    id: String,
    /// The session's id and the proxy's hand, once the proxy's listener was opened in the
    /// container's network: a container started again has a new network, where the listener
    /// is opened again before its runner takes a block.
    netns: Option<(String, tandem_executor::EgressAdopt)>,
}

impl Container {
    /// [`start`], then the proxy's listener in the container's new network.
    async fn start_listening(&self) -> Result<Conn, ExecError> {
        let conn = start(&self.executor, &self.id).await?;
        if let Some((session, adopt)) = &self.netns {
            crate::ports::egress_in_netns(&self.executor.inner().docker, &self.id, session, adopt)
                .await
                .map_err(|why| {
                    ExecError::Backend(format!(
                        "the container's way out to the egress proxy: {why}"
                    ))
                })?;
        }
        Ok(conn)
    }
}

/// What the executor's sandboxes run, and as whom.
fn offer(executor: &DockerExecutor, egress: Option<&tandem_executor::EgressSocket>) -> Offer {
    let config = &executor.inner().config;
    let mut env = config.env.clone();
    if let Some(egress) = egress {
        env.extend(tandem_executor::egress_env());
        env.extend(egress.env.iter().cloned());
        if let Some(name) = egress.ca_bundle.as_ref().and_then(|p| p.file_name()) {
            // Bound in with the socket; or, on an engine reached over the network, written
            // by the egress relay.
            let path = match config.workspace {
                WorkspaceMode::Volume => tandem_executor_runner::relay::EGRESS_CA_PATH.to_owned(),
                _ => format!("{}/{}", crate::EGRESS_DIR, name.to_string_lossy()),
            };
            env.extend(tandem_executor::egress_ca_env(&path));
        }
    }
    Offer {
        executor: "docker",
        languages: config.languages.clone(),
        env,
        user: config.user.clone(),
    }
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
        labels.insert(labels::INSTANCE.to_owned(), inner.instance.clone());
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
        // Made on a task of the executor's, watched by `making` from here until the session
        // owns the container: an open dropped while the engine makes it (its caller went away)
        // must not leave it.
        let place = if by_volume {
            Place::Volume(format!("tandem-ws-{session_id}"))
        } else {
            Place::Host(workspace.clone())
        };
        let made = make(
            executor.clone(),
            session_id.clone(),
            place,
            labels,
            spec.limits.clone(),
            spec.egress.clone(),
            spec.volumes.clone(),
        );
        let mut making = Making::start(&executor, &session_id, made)?;
        let made = making.take().await?;
        let mut session = Self {
            runner: RunnerSession::new(
                workspace,
                made.volume.is_some(),
                offer(&executor, spec.egress.as_ref()),
                spec.limits,
            ),
            container: Container {
                executor,
                id: made.id,
                netns: None,
            },
            session_id,
            volume: made.volume,
            owned_workspace,
            restore_mode,
            relay: None,
            pool_wait: None,
            peak: None,
            closed: false,
        };
        // On failure the session is dropped, which removes the container.
        session.runner.start(&mut session.container).await?;
        let mut relay_needed = by_volume;
        if let Some(egress) = &spec.egress
            && let Some(adopt) = egress.adopt.as_ref().filter(|_| {
                session
                    .container
                    .executor
                    .egress_in_netns(!by_volume, egress)
            })
        {
            match crate::ports::egress_in_netns(
                &session.container.executor.inner().docker,
                &session.container.id,
                &session.session_id,
                adopt,
            )
            .await
            {
                Ok(()) => {
                    session.container.netns = Some((session.session_id.clone(), adopt.clone()));
                }
                Err(why) => {
                    // The relay is slower and works wherever the container runs.
                    tracing::warn!(%why, "the egress listener could not be opened in the container; relaying instead");
                    relay_needed = true;
                }
            }
        }
        if let (true, Some(egress)) = (relay_needed, &spec.egress) {
            let stop = tandem_executor::CancellationToken::new();
            session.relay = Some(stop.clone());
            crate::ports::egress(
                &session.container.executor.inner().docker,
                &session.container.id,
                tandem_executor::EGRESS_PORT,
                egress.socket.clone(),
                egress.ca_bundle.as_deref(),
                stop,
            )
            .await?;
        }
        Ok(session)
    }

    /// Starts a container for the warm pool: a temporary workspace, no task yet.
    pub(crate) async fn prestart(executor: &DockerExecutor) -> Result<Warm, ExecError> {
        let mut session = Self::open(executor.clone(), SessionSpec::default()).await?;
        // The pool owns the container now; this session must not remove it.
        session.closed = true;
        Ok(Warm {
            executor: executor.clone(),
            id: std::mem::take(&mut session.container.id),
            session_id: std::mem::take(&mut session.session_id),
            workspace: session.owned_workspace.take(),
            volume: session.volume.take(),
            conn: session.runner.take_conn(),
        })
    }

    /// Turns a pooled container into this task's session, naming it after the task (labels
    /// cannot change after create, so the name is what carries the task).
    pub(crate) async fn from_warm(
        executor: DockerExecutor,
        mut warm: Warm,
        spec: SessionSpec,
        waited: Duration,
    ) -> Result<Self, ExecError> {
        let task = spec
            .labels
            .iter()
            .find(|(k, _)| k == labels::TASK)
            .map(|(_, v)| v.as_str());
        let id = std::mem::take(&mut warm.id);
        let workspace = warm.workspace.take();
        let volume = warm.volume.take();
        let runner = RunnerSession::new(
            workspace
                .as_ref()
                .map(|w| w.path().to_owned())
                .unwrap_or_default(),
            volume.is_some(),
            offer(&executor, None),
            spec.limits,
        )
        .with_conn(warm.conn.take());
        let session = Self {
            container: Container {
                executor,
                id,
                netns: None,
            },
            runner,
            session_id: std::mem::take(&mut warm.session_id),
            volume,
            owned_workspace: workspace,
            // Pooled containers have temporary workspaces only.
            restore_mode: None,
            relay: None,
            pool_wait: Some(waited),
            peak: None,
            closed: false,
        };
        if let Some(task) = task.filter(|t| !t.is_empty()) {
            let name = format!(
                "tandem-{}-{}",
                docker_name_part(task),
                &session.session_id[..12.min(session.session_id.len())]
            );
            session
                .container
                .executor
                .inner()
                .docker
                .rename_container(
                    &session.container.id,
                    RenameContainerOptionsBuilder::default().name(&name).build(),
                )
                .await
                .map_err(engine("naming the session container after its task"))?;
        }
        Ok(session)
    }

    async fn shutdown(&mut self) -> Result<(), ExecError> {
        self.closed = true;
        if let Some(relay) = self.relay.take() {
            relay.cancel();
        }
        // Files the unprivileged user made must be removable (temporary workspace) or
        // manageable (a kept one) by the host user afterwards.
        let op = if self.owned_workspace.is_some() {
            Request::Wipe
        } else {
            Request::Release
        };
        let conn = self.runner.take_conn();
        // The volume goes with the session; the mirror is Tandem's own. The runner kills
        // every process of the blocks' user before it answers.
        let killed = match (conn, &self.volume) {
            (Some(mut conn), None) => conn.request_done(&op, Duration::from_secs(5)).await.is_ok(),
            _ => false,
        };
        let executor = self.container.executor.clone();
        let (id, volume, session) = (
            self.container.id.clone(),
            self.volume.take(),
            self.session_id.clone(),
        );
        let workspace = self.owned_workspace.take();
        let removal = {
            let executor = executor.clone();
            async move {
                remove(&executor, &id, volume, &session).await;
                match workspace {
                    Some(ws) => scratch::remove_dirs(vec![ws], executor.inner().root.clone()).await,
                    None => Ok(()),
                }
            }
        };
        if killed {
            // Nothing of the user's runs in it: its mode can be given back before it goes.
            self.restore_workdir();
            executor.remove_when_served(Box::pin(removal)).await
        } else {
            let removed = removal.await;
            self.restore_workdir();
            removed
        }
    }

    /// Gives a kept workspace its mode back, once no block can reach it.
    fn restore_workdir(&mut self) {
        let workspace = &self.runner.workspace;
        if let Some(mode) = self.restore_mode.take()
            && let Err(e) = set_mode(workspace, mode)
        {
            tracing::warn!(workdir = %workspace.display(), error = %e, "could not give the workdir its mode back");
        }
    }
}

/// What an open made on the engine: the container, and the session's volume when it has one.
struct Made {
    id: String,
    volume: Option<String>,
}

/// Makes a session's volume (for a [`Place::Volume`]) and its container; what it made is
/// removed again when the container cannot be.
async fn make(
    executor: DockerExecutor,
    session_id: String,
    place: Place,
    mut labels: HashMap<String, String>,
    limits: tandem_executor::Limits,
    egress: Option<tandem_executor::EgressSocket>,
    volumes: Vec<tandem_executor::VolumeBinding>,
) -> Result<Made, ExecError> {
    let inner = executor.inner();
    if let Place::Volume(_) = &place
        && let Err(e) = engine_volumes(&executor, &volumes).await
    {
        executor.forget(&session_id);
        return Err(e);
    }
    let volume = match &place {
        Place::Volume(name) => {
            let volume_labels = [
                labels::DAEMON,
                labels::OWNER,
                labels::INSTANCE,
                labels::SESSION,
                labels::TASK,
            ]
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
            Some(name.clone())
        }
        Place::Host(_) => None,
    };
    let body = executor.container_body(&place, labels, &limits, egress.as_ref(), &volumes);
    let name = format!("tandem-{}", &session_id[..12]);
    match inner
        .docker
        .create_container(
            Some(CreateContainerOptionsBuilder::default().name(&name).build()),
            body,
        )
        .await
    {
        Ok(created) => Ok(Made {
            id: created.id,
            volume,
        }),
        Err(e) => {
            if let Some(volume) = &volume {
                remove_volume(&inner.docker, volume).await;
            }
            executor.forget(&session_id);
            Err(ExecError::from(DockerError::Engine {
                what: format!("creating a container from `{}`", inner.config.image),
                source: e,
            }))
        }
    }
}

/// Makes sure each of `volumes` has its engine volume on an engine that cannot bind this
/// machine's directories (a remote host); one with a quota cannot be had there.
async fn engine_volumes(
    executor: &DockerExecutor,
    volumes: &[tandem_executor::VolumeBinding],
) -> Result<(), ExecError> {
    for v in volumes {
        if v.max_mb.is_some() {
            return Err(ExecError::Unavailable {
                what: format!("volume `{}` on this host", v.name),
                hint: "a volume with a quota is a filesystem on the daemon's machine, which a remote engine cannot mount; run the session on the daemon's own engine, or use a volume without a quota".to_owned(),
            });
        }
        if !v.path.starts_with('/') {
            return Err(ExecError::Unavailable {
                what: format!("volume `{}` inside the workspace", v.name),
                hint: "on a remote engine the workspace is copied out after each block, and a volume inside it would be copied too: mount it at an absolute path such as /data".to_owned(),
            });
        }
        // Creating a volume that exists answers with it: each session asks.
        executor
            .inner()
            .docker
            .create_volume(bollard::models::VolumeCreateRequest {
                name: Some(crate::engine_volume(&v.name)),
                labels: Some(HashMap::from([(
                    labels::NAMED_VOLUME.to_owned(),
                    v.name.clone(),
                )])),
                ..Default::default()
            })
            .await
            .map_err(|e| ExecError::from(engine("making the volume on the engine")(e)))?;
    }
    Ok(())
}

/// A [`make`] under way on a task of the executor's own, so that the engine's answer is
/// always heard: until [`Making::take`] hands over what it made, dropping this (its open was
/// cancelled) removes that once it is made.
struct Making {
    executor: DockerExecutor,
    session_id: String,
    task: Option<tokio::task::JoinHandle<Result<Made, ExecError>>>,
}

impl Making {
    /// Starts `make`, unless the executor is shutting down (nothing new is made then, so
    /// that shutdown's sweep finds everything).
    fn start(
        executor: &DockerExecutor,
        session_id: &str,
        make: impl std::future::Future<Output = Result<Made, ExecError>> + Send + 'static,
    ) -> Result<Self, ExecError> {
        match executor.making(make) {
            Some(task) => Ok(Self {
                executor: executor.clone(),
                session_id: session_id.to_owned(),
                task: Some(task),
            }),
            None => {
                executor.forget(session_id);
                Err(ExecError::Unavailable {
                    what: format!("the Docker engine {}", executor.label()),
                    hint: "Tandem is shutting down and opens no new sandboxes; try again on the next daemon".to_owned(),
                })
            }
        }
    }

    /// What was made, once it is; from then on it is the caller's to remove.
    async fn take(&mut self) -> Result<Made, ExecError> {
        let Some(task) = self.task.as_mut() else {
            return Err(ExecError::Backend(
                "the session container was taken twice".to_owned(),
            ));
        };
        let made = task.await;
        self.task = None;
        made.map_err(|e| {
            self.executor.forget(&self.session_id);
            ExecError::Backend(format!("making the session container stopped: {e}"))
        })?
    }
}

impl Drop for Making {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        let (executor, session_id) = (self.executor.clone(), self.session_id.clone());
        // Without a runtime the task is gone too; shutdown's sweep or the next Tandem reaps.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Ok(Ok(made)) = task.await {
                    remove(&executor, &made.id, made.volume, &session_id).await;
                }
            });
        }
    }
}

impl Transport for Container {
    fn name(&self) -> &str {
        &self.id
    }

    fn start(&mut self) -> BoxFuture<'_, Result<Conn, ExecError>> {
        Box::pin(self.start_listening())
    }

    /// Kills the container and starts it again: its runner is its first process.
    fn restart(&mut self) -> BoxFuture<'_, Result<Conn, ExecError>> {
        Box::pin(async move {
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
            match self.start_listening().await {
                Ok(conn) => Ok(conn),
                Err(e) => Err(lost_or(&self.executor, e).await),
            }
        })
    }

    /// Kills the container (the next block starts it again); the session is lost when its
    /// engine no longer answers.
    fn stop(&mut self) -> BoxFuture<'_, Result<(), ExecError>> {
        Box::pin(async move {
            let inner = self.executor.inner();
            let kill = KillContainerOptionsBuilder::default()
                .signal("KILL")
                .build();
            let _ = inner.docker.kill_container(&self.id, Some(kill)).await;
            self.executor
                .answers()
                .await
                .map_err(|reason| ExecError::Lost {
                    host: inner.config.label().to_owned(),
                    reason,
                })
        })
    }

    fn unpack(&mut self, archive: std::fs::File) -> BoxFuture<'_, Result<(), ExecError>> {
        Box::pin(async move {
            let body = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(archive));
            self.executor
                .inner()
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
            Ok(())
        })
    }

    fn fetcher(&self) -> Box<dyn tandem_executor_runner::mirror::Fetch> {
        Box::new(Archives {
            docker: self.executor.inner().docker.clone(),
            id: self.id.clone(),
        })
    }
}

impl Session for DockerSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(async move {
            let peak = self
                .peak
                .get_or_insert_with(|| crate::usage::HostPeak::find(&self.container.id));
            let reset = peak.as_mut().is_some_and(|p| p.reset());
            let mut outcome = self.runner.run(&mut self.container, req, ctx).await?;
            if reset
                && let Some(resources) = outcome.resources.as_mut()
                && let Some(bytes) = peak.as_mut().and_then(|p| p.read())
            {
                resources.peak_memory_bytes = Some(bytes);
                resources.peak_memory_scope = Some(tandem_executor::PeakScope::Block);
            }
            Ok(outcome)
        })
    }

    fn workspace(&self) -> Option<&Path> {
        Some(&self.runner.workspace)
    }

    fn pool_wait(&self) -> Option<Duration> {
        self.pool_wait
    }

    fn put_archive(
        &mut self,
        archive: &Path,
        caps: tandem_executor_kit::archive::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<tandem_executor_kit::archive::ArchivedFile>, ExecError>> {
        Box::pin(
            self.runner
                .put_archive(&mut self.container, archive.to_owned(), caps),
        )
    }

    fn ports(&self) -> Option<std::sync::Arc<dyn tandem_executor::Ports>> {
        Some(std::sync::Arc::new(crate::ports::DockerPorts {
            docker: self.container.executor.inner().docker.clone(),
            id: self.container.id.clone(),
        }))
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        Box::pin(async move { self.shutdown().await })
    }
}

impl Drop for DockerSession {
    fn drop(&mut self) {
        if let Some(relay) = self.relay.take() {
            relay.cancel();
        }
        if self.closed {
            return;
        }
        // Dropped without close (a cancelled task, a failed open): remove the container in
        // the background; if the process exits first, the next Tandem reaps it.
        let executor = self.container.executor.clone();
        let (id, session_id) = (self.container.id.clone(), self.session_id.clone());
        let ws = self.owned_workspace.take();
        let volume = self.volume.take();
        let (workdir, mode) = (self.runner.workspace.clone(), self.restore_mode.take());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                remove(&executor, &id, volume, &session_id).await;
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
        remove(&self.executor, &id, self.volume.take(), &self.session_id).await;
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
                remove(&executor, &id, volume, &session_id).await;
                drop(ws);
            });
        }
    }
}

/// Removes a session's container and its volume, and forgets the session.
async fn remove(executor: &DockerExecutor, id: &str, volume: Option<String>, session: &str) {
    let docker = &executor.inner().docker;
    remove_container(docker, id).await;
    if let Some(volume) = volume {
        remove_volume(docker, &volume).await;
    }
    executor.forget(session);
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
