//! Tandem's Docker executor: one hardened container per task session, on bollard.
//!
//! Each session is a container started from the configured image with no network, no
//! capabilities, a read-only root, a non-root user and memory, CPU and process limits; the
//! session's workspace is bind-mounted at `/workspace`. Blocks do not go through `docker
//! exec`: a small runner (`runner.py`) is the container's main process and forks each block
//! on request over the attached stdio, which costs a few milliseconds instead of an exec
//! round trip. Every container is labelled with its owner process, removed with kill +
//! force-remove when its session ends, and reaped by the next Tandem if its owner died.

pub mod context;
mod fleet;
mod pool;
mod ports;
mod session;
mod usage;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateImageOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
};
use futures::StreamExt;
use tandem_executor::{BoxFuture, ExecError, Executor, Language, Session, SessionSpec};
use tandem_executor_kit::owner::{owner_alive, owner_tag};
use tandem_executor_kit::scratch;
use tokio::sync::OnceCell;

pub use fleet::{DockerFleet, HostSpec};
pub use tandem_executor_runner::RUNNER;

/// Label keys on every container Tandem makes.
pub mod labels {
    /// The Tandem instance (daemon id, or a per-process id for one-shot commands).
    pub const DAEMON: &str = "tandem.daemon";
    /// `host/pid:start-time` of the process that owns the container, to reap orphans.
    pub const OWNER: &str = "tandem.owner";
    /// The session's id.
    pub const SESSION: &str = "tandem.session";
    /// The task's id, when the session belongs to one.
    pub const TASK: &str = "tandem.task";
    /// Host path of a temporary workspace to remove along with the container.
    pub const WORKSPACE: &str = "tandem.workspace";
    /// The volume that holds the session's workspace, when it is the container's own.
    pub const VOLUME: &str = "tandem.volume";
    /// The executor (one connection to one engine) that made it: what its shutdown removes,
    /// and nothing another executor of the same process made.
    pub const INSTANCE: &str = "tandem.instance";
    /// A Tandem volume's name, on the engine volume that holds it on a remote host: no
    /// reaper and no shutdown removes one (only `tandem volume rm`, on this machine's).
    pub const NAMED_VOLUME: &str = "tandem.named-volume";
}

/// The engine volume that holds Tandem volume `name` on a host that cannot bind this
/// machine's directories.
pub fn engine_volume(name: &str) -> String {
    format!("tandem-volume-{name}")
}

/// Where a session's workspace lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WorkspaceMode {
    /// A host directory bind-mounted at `/workspace`: only for an engine on this machine.
    /// What a kept interpreter needs (it talks to Python over FIFOs in that directory).
    #[default]
    Bind,
    /// A volume of the session's own on the engine's machine; files go in and come out as
    /// tar archives through the engine's API, and a host copy (the mirror) is brought up to
    /// date after every block. Works with any engine, near or remote.
    Volume,
}

impl WorkspaceMode {
    /// Bind for a local socket, a volume for an engine reached over the network.
    pub fn for_host(host: &str) -> Self {
        if host.starts_with("unix://") || host.starts_with('/') {
            Self::Bind
        } else {
            Self::Volume
        }
    }
}

/// The client certificate and the authority that signed the engine's, for `tcp://` with TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate authority's certificate (PEM).
    pub ca: PathBuf,
    /// This client's certificate (PEM).
    pub cert: PathBuf,
    /// This client's private key (PEM).
    pub key: PathBuf,
}

/// Temporary workspaces live in `<workspace_dir>/tandem-docker-<pid>-<start-time>/`.
const ROOT_PREFIX: &str = "tandem-docker-";
/// Where the egress proxy's socket directory is bound inside a container behind it.
const EGRESS_DIR: &str = "/run/tandem-egress";

/// The capabilities the runner keeps (every other one is dropped); blocks have none.
pub const RUNNER_CAPS: [&str; 3] = ["SETUID", "SETGID", "KILL"];

/// The image used when none is configured.
pub const DEFAULT_IMAGE: &str = "python:3.12-slim";

/// Settings for the Docker executor; the defaults are the hardened ones.
#[derive(Clone, Debug)]
pub struct DockerConfig {
    /// The operator's name for this engine, in messages, events and `doctor` (default: its
    /// address).
    pub name: String,
    /// Client certificates for a `tcp://` engine that checks them.
    pub tls: Option<TlsFiles>,
    /// Where sessions' workspaces live.
    pub workspace: WorkspaceMode,
    /// The engine's address (`unix://`, `tcp://`, `http(s)://` or `ssh://`), as `DOCKER_HOST`
    /// gives it to the docker CLI; default [`DEFAULT_HOST`].
    pub host: String,
    /// Image for session containers; it needs `python3` (the runner is Python).
    pub image: String,
    /// Pull the image when it is missing.
    pub pull: bool,
    /// Containers kept started and ready for the next sessions (temporary workspaces only);
    /// each is used by one session and then removed.
    pub pool_size: usize,
    /// Most containers the pool holds, ready or starting, while sessions find it empty: it
    /// grows from `pool_size` toward this under demand (0: no more than `pool_size`).
    pub pool_max: usize,
    /// Seconds without a session finding the pool empty after which it shrinks back to
    /// `pool_size`, removing the containers beyond it that sat unused that long.
    pub pool_idle_secs: u64,
    /// Memory cap per container, bytes (swap is set equal, so none is added).
    pub memory_bytes: u64,
    /// CPUs per container.
    pub cpus: f64,
    /// Most processes per container.
    pub pids: i64,
    /// Size of the `/tmp` tmpfs, bytes.
    pub tmpfs_bytes: u64,
    /// `uid:gid` code runs as (never root: the runner, which is root, relies on blocks being
    /// another user).
    pub user: String,
    /// Give containers a network (bridge) instead of none.
    pub network: bool,
    /// Mount the image's root filesystem read-only.
    pub read_only: bool,
    /// Extra environment variables passed to code (names and values), on top of the allowlist.
    pub env: Vec<(String, String)>,
    /// Languages the image can run.
    pub languages: Vec<Language>,
    /// The `tandem.daemon` label value.
    pub daemon_id: String,
    /// Where temporary workspaces are made (default `$TMPDIR`); the engine bind-mounts them,
    /// so with a remote engine this must be a directory both machines see at the same path.
    pub workspace_dir: Option<PathBuf>,
    /// An image to use instead when `image` is not present locally but this one is (the
    /// offline build, when nobody chose an image).
    pub fallback_image: Option<String>,
}

/// The image `scripts/build-sandbox-image.sh` builds offline.
pub const LOCAL_IMAGE: &str = "tandem-sandbox:latest";

/// The engine's default address: its local socket.
pub const DEFAULT_HOST: &str = "unix:///var/run/docker.sock";

impl DockerConfig {
    /// The engine's name in messages: the operator's, else its address.
    pub fn label(&self) -> &str {
        if self.name.is_empty() {
            &self.host
        } else {
            &self.name
        }
    }
}

impl Default for DockerConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            tls: None,
            workspace: WorkspaceMode::Bind,
            host: DEFAULT_HOST.to_owned(),
            image: DEFAULT_IMAGE.to_owned(),
            pull: true,
            pool_size: 2,
            pool_max: 0,
            pool_idle_secs: 60,
            memory_bytes: 512 << 20,
            cpus: 1.0,
            pids: 256,
            tmpfs_bytes: 64 << 20,
            user: "65534:65534".to_owned(),
            network: false,
            read_only: true,
            env: Vec::new(),
            languages: vec![Language::python(), Language::sh()],
            daemon_id: format!("tandem-{}", std::process::id()),
            workspace_dir: None,
            fallback_image: None,
        }
    }
}

/// Failures to reach the engine or get the image.
#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    /// The engine did not answer.
    #[error("cannot reach {host}: {reason}; {}", unreachable_advice(reason))]
    Unreachable {
        /// Where Tandem looked.
        host: String,
        /// What went wrong.
        reason: String,
    },
    /// The image is missing and could not be pulled.
    #[error(
        "docker image `{image}` is not present and pulling it failed: {reason}; with no registry, build one offline with `scripts/build-sandbox-image.sh` (used when the default image is absent), or name an image with --image (run, exec), TANDEM_DOCKER_IMAGE or [executors.docker] image"
    )]
    ImageUnavailable {
        /// The image asked for.
        image: String,
        /// Why the pull failed.
        reason: String,
    },
    /// The engine refused a request.
    #[error("{what}: {source}")]
    Engine {
        /// What Tandem was doing.
        what: String,
        /// The engine's answer.
        #[source]
        source: bollard::errors::Error,
    },
}

/// `reason`, over TLS: an engine that refuses this client's certificate says so after a TLS
/// 1.3 handshake, and what reaches the client is often only a connection closed or cancelled,
/// which is said to be that.
fn tls_reason(reason: String) -> String {
    const CLOSED: [&str; 6] = [
        "connection was not ready",
        "operation was canceled",
        "connection closed",
        "reset by peer",
        "unexpected EOF",
        "Broken pipe",
    ];
    if CLOSED.iter().any(|c| reason.contains(c)) {
        format!(
            "{reason} (the engine closed the TLS connection: it may not trust this client's certificate)"
        )
    } else {
        reason
    }
}

/// What to do about an engine that did not answer, by what was seen.
fn unreachable_advice(reason: &str) -> &'static str {
    if reason.contains("certificate") || reason.contains("alert") {
        "check the host's TLS files: its `ca` must have signed the engine's certificate, and the engine must trust `cert` (and `key`)"
    } else {
        "start Docker (`sudo systemctl start docker`) or point DOCKER_HOST (or the host's url) at a running engine"
    }
}

impl DockerError {
    /// What went wrong, without the advice on fixing it: a host's reason for being down.
    pub fn cause(&self) -> String {
        match self {
            Self::Unreachable { reason, .. } => reason.clone(),
            other => other.to_string(),
        }
    }
}

impl From<DockerError> for ExecError {
    fn from(e: DockerError) -> Self {
        match e {
            DockerError::Unreachable { .. } => ExecError::Unavailable {
                what: "the Docker engine".to_owned(),
                hint: e.to_string(),
            },
            DockerError::ImageUnavailable { ref image, .. } => ExecError::Unavailable {
                what: format!("docker image `{image}`"),
                hint: e.to_string(),
            },
            DockerError::Engine { .. } => ExecError::Backend(e.to_string()),
        }
    }
}

pub(crate) fn engine(
    what: impl Into<String>,
) -> impl FnOnce(bollard::errors::Error) -> DockerError {
    let what = what.into();
    move |source| DockerError::Engine { what, source }
}

/// Runs code in hardened Docker containers, one per session.
#[derive(Clone)]
pub struct DockerExecutor {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) docker: Docker,
    pub(crate) config: DockerConfig,
    pub(crate) owner: String,
    /// The [`labels::INSTANCE`] of what this executor makes.
    pub(crate) instance: String,
    /// This process's owner-only directory for temporary workspaces: each workspace must be
    /// world-writable for the blocks' user, so only its parent keeps other host users out.
    pub(crate) root: PathBuf,
    image_ready: OnceCell<()>,
    pub(crate) pool: pool::Pool,
    /// The session ids of this executor's containers that are in use or in the pool: any
    /// other container with this process's owner tag was lost (its engine went away while it
    /// ran) and is removed when the engine answers again.
    pub(crate) live: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The volumes and containers being made for sessions, so that shutdown can wait for
    /// them before it sweeps.
    making: tokio_util::task::TaskTracker,
    /// Held while a make starts and while shutdown closes the executor: every make starts
    /// before shutdown waits for them, or not at all.
    gate: std::sync::Mutex<()>,
}

/// Longest shutdown waits for warm-pool containers and sessions' containers that are still
/// being made, and then again for its sweep of this process's containers.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl DockerExecutor {
    /// Connects to the engine at `config.host`, negotiates the API version, and reaps
    /// containers whose owner died.
    pub async fn connect(mut config: DockerConfig) -> Result<Self, DockerError> {
        let host = if config.name.is_empty() || config.name == config.host {
            format!("the Docker engine at {}", config.host)
        } else {
            format!("the Docker engine `{}` at {}", config.name, config.host)
        };
        let tls = config.tls.is_some();
        let unreachable = |reason: String| DockerError::Unreachable {
            host: host.clone(),
            reason: if tls { tls_reason(reason) } else { reason },
        };
        let docker = client(&config).map_err(|e| unreachable(error_chain(&e)))?;
        let docker = tokio::time::timeout(Duration::from_secs(5), docker.negotiate_version())
            .await
            .map_err(|_| unreachable("no answer within 5 s".to_owned()))?
            .map_err(|e| unreachable(error_chain(&e)))?;
        tokio::time::timeout(Duration::from_secs(5), docker.ping())
            .await
            .map_err(|_| unreachable("no answer within 5 s".to_owned()))?
            .map_err(|e| unreachable(error_chain(&e)))?;
        if let Some(fallback) = config.fallback_image.take() {
            // Only an image that is there: a fallback never triggers a pull.
            if !image_present(&docker, &config.image).await?
                && image_present(&docker, &fallback).await?
            {
                tracing::info!(
                    absent = %config.image,
                    using = %fallback,
                    "the default image is not present; using the locally built one"
                );
                config.fallback_image = Some(std::mem::replace(&mut config.image, fallback));
            }
        }
        let base = config
            .workspace_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir);
        let executor = Self {
            inner: Arc::new(Inner {
                docker,
                root: scratch::process_root_in(&base, ROOT_PREFIX),
                config,
                owner: owner_tag(),
                instance: uuid::Uuid::new_v4().simple().to_string(),
                image_ready: OnceCell::new(),
                pool: pool::Pool::default(),
                live: Default::default(),
                making: tokio_util::task::TaskTracker::new(),
                gate: std::sync::Mutex::new(()),
            }),
        };
        let roots = scratch::reap_dead_roots_in(&base, ROOT_PREFIX);
        if roots > 0 {
            tracing::info!(roots, "removed workspace roots left by a Tandem that died");
        }
        match executor.reap_orphans().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                containers = n,
                "reaped containers left by a Tandem that died"
            ),
            Err(e) => tracing::warn!(error = %e, "looking for leftover containers failed"),
        }
        Ok(executor)
    }

    /// The engine's version, for diagnostics.
    pub async fn engine_version(&self) -> Result<String, DockerError> {
        let v = self
            .inner
            .docker
            .version()
            .await
            .map_err(engine("asking the engine for its version"))?;
        Ok(format!(
            "{} (API {})",
            v.version.unwrap_or_default(),
            v.api_version.unwrap_or_default()
        ))
    }

    /// The image sessions start from (the fallback when it replaced an absent default).
    pub fn image(&self) -> &str {
        &self.inner.config.image
    }

    /// The image that was asked for but is absent, when the fallback replaced it.
    pub fn replaced_image(&self) -> Option<&str> {
        self.inner.config.fallback_image.as_deref()
    }

    /// Whether the configured image is present locally.
    pub async fn image_present(&self) -> Result<bool, DockerError> {
        image_present(&self.inner.docker, &self.inner.config.image).await
    }

    /// Makes sure the image is present, pulling it (with `progress` lines) when allowed.
    pub async fn ensure_image(&self, progress: &(dyn Fn(&str) + Sync)) -> Result<(), DockerError> {
        let inner = &self.inner;
        inner
            .image_ready
            .get_or_try_init(|| ensure_image(&inner.docker, &inner.config, progress))
            .await
            .map(|_| ())
    }

    /// Force-removes every container (and its temporary workspace) whose owning process on
    /// this host is gone; returns how many.
    pub async fn reap_orphans(&self) -> Result<usize, DockerError> {
        let docker = &self.inner.docker;
        let mut reaped = 0;
        for (id, labels) in self.containers_labelled(labels::OWNER).await? {
            let Some(owner) = labels.get(labels::OWNER) else {
                continue;
            };
            if owner_alive(owner) {
                continue;
            }
            remove_container(docker, &id).await;
            if let Some(ws) = labels.get(labels::WORKSPACE) {
                let _ = tandem_executor_kit::keeper::remove_tree(std::path::Path::new(ws));
            }
            reaped += 1;
        }
        reaped += self.reap_volumes(|owner, _| !owner_alive(owner)).await?;
        Ok(reaped)
    }

    /// Removes this process's containers and volumes that no session holds any more: what a
    /// session on an engine that went away left behind, once the engine answers again.
    /// Returns how many.
    pub async fn reap_lost(&self) -> Result<usize, DockerError> {
        let docker = &self.inner.docker;
        let owner = format!("{}={}", labels::OWNER, self.inner.owner);
        let mut reaped = 0;
        for (id, labels) in self.containers_labelled(&owner).await? {
            if labels.get(labels::SESSION).is_some_and(|s| self.is_live(s)) {
                continue;
            }
            remove_container(docker, &id).await;
            reaped += 1;
        }
        let ours = self.inner.owner.clone();
        reaped += self
            .reap_volumes(|owner, session| owner == ours && !self.is_live(session))
            .await?;
        Ok(reaped)
    }

    /// Every container (running or not) with `label` (a key, or `key=value`): id and labels.
    async fn containers_labelled(
        &self,
        label: &str,
    ) -> Result<Vec<(String, HashMap<String, String>)>, DockerError> {
        let filters: HashMap<&str, Vec<&str>> = HashMap::from([("label", vec![label])]);
        let list = self
            .inner
            .docker
            .list_containers(Some(
                ListContainersOptionsBuilder::default()
                    .all(true)
                    .filters(&filters)
                    .build(),
            ))
            .await
            .map_err(engine("listing Tandem's containers"))?;
        Ok(list
            .into_iter()
            .filter_map(|c| Some((c.id?, c.labels?)))
            .collect())
    }

    fn is_live(&self, session: &str) -> bool {
        self.inner
            .live
            .lock()
            .map_or(true, |live| live.contains(session))
    }

    /// Removes the workspace volumes whose (owner, session) labels `dead` picks.
    async fn reap_volumes(&self, dead: impl Fn(&str, &str) -> bool) -> Result<usize, DockerError> {
        let docker = &self.inner.docker;
        let filters: HashMap<String, Vec<String>> =
            HashMap::from([("label".to_owned(), vec![labels::OWNER.to_owned()])]);
        let list = docker
            .list_volumes(Some(bollard::query_parameters::ListVolumesOptions {
                filters: Some(filters),
            }))
            .await
            .map_err(engine("listing Tandem's volumes"))?;
        let mut reaped = 0;
        for v in list.volumes.unwrap_or_default() {
            let owner = v.labels.get(labels::OWNER).map_or("", String::as_str);
            let session = v.labels.get(labels::SESSION).map_or("", String::as_str);
            if dead(owner, session) {
                remove_volume(docker, &v.name).await;
                reaped += 1;
            }
        }
        Ok(reaped)
    }

    /// Ids of the containers ready in the warm pool now.
    pub fn pooled(&self) -> Vec<String> {
        self.inner.pool.ids()
    }

    /// The warm pool now, as `/v1/executors` shows it.
    pub fn pool_status(&self) -> tandem_executor::PoolStatus {
        self.inner.pool.status(self.inner.config.label())
    }

    /// Whether the pool can serve `spec`: a temporary workspace, no labels but the task's (or
    /// the mark of a session without one), and no lower memory limit than the pool's
    /// containers have.
    fn poolable(&self, spec: &SessionSpec) -> bool {
        let c = &self.inner.config;
        // A warm container was made with no way out; one behind the proxy is made for it.
        !(spec.egress.is_some()
            || spec.workdir.is_some()
            || !spec.volumes.is_empty()
            || spec.limits.memory_bytes.is_some_and(|m| m < c.memory_bytes)
            || spec
                .labels
                .iter()
                .any(|(k, _)| k != labels::TASK && k != tandem_executor_kit::WITHOUT_TASK))
    }

    /// Shuts the executor down (daemon shutdown): it makes nothing more, removes the warm
    /// pool's containers, waits for those still being made, and then removes every container
    /// and volume it made (by their [`labels::INSTANCE`]), in any state (a session still open, a container made
    /// for an open whose caller went away, one created and never started), within a
    /// deadline; what is left then, the next Tandem reaps.
    pub async fn shutdown(&self) {
        use std::sync::atomic::Ordering;
        let inner = &self.inner;
        let pool = &inner.pool;
        {
            let _gate = inner
                .gate
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            pool.closed.store(true, Ordering::SeqCst);
            pool.stop.cancel();
        }
        for warm in pool.drain() {
            warm.remove().await;
        }
        pool.tasks.close();
        inner.making.close();
        let made = async {
            pool.tasks.wait().await;
            inner.making.wait().await;
        };
        if tokio::time::timeout(SHUTDOWN_WAIT, made).await.is_err() {
            tracing::warn!(
                "containers still being made after 30 s; removing what is there, and the next Tandem reaps the rest"
            );
        }
        match tokio::time::timeout(SHUTDOWN_WAIT, self.remove_own()).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => {
                tracing::info!(removed = n, "removed the sandboxes still there at shutdown")
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "removing the sandboxes at shutdown failed; the next Tandem reaps them")
            }
            Err(_) => tracing::warn!(
                "removing the sandboxes at shutdown took over 30 s; the next Tandem reaps what is left"
            ),
        }
    }

    /// Runs `make` (what makes a session's volume and container) on a task shutdown waits
    /// for; `None` once the executor is shut down.
    pub(crate) fn making<T: Send + 'static>(
        &self,
        make: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Option<tokio::task::JoinHandle<T>> {
        let inner = &self.inner;
        let _gate = inner
            .gate
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if inner.pool.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return None;
        }
        Some(inner.making.spawn(make))
    }

    /// Removes every container (with its temporary workspace) and volume this executor made,
    /// whatever its state; returns how many.
    async fn remove_own(&self) -> Result<usize, DockerError> {
        let docker = &self.inner.docker;
        let mine = format!("{}={}", labels::INSTANCE, self.inner.instance);
        let found = self.containers_labelled(&mine).await?;
        let removals = found.iter().map(|(id, tags)| async move {
            remove_container(docker, id).await;
            if let Some(ws) = tags.get(labels::WORKSPACE) {
                let _ = tandem_executor_kit::keeper::remove_tree(std::path::Path::new(ws));
            }
        });
        futures::future::join_all(removals).await;
        let filters: HashMap<String, Vec<String>> =
            HashMap::from([("label".to_owned(), vec![mine])]);
        let volumes = docker
            .list_volumes(Some(bollard::query_parameters::ListVolumesOptions {
                filters: Some(filters),
            }))
            .await
            .map_err(engine("listing Tandem's volumes"))?
            .volumes
            .unwrap_or_default();
        for v in &volumes {
            remove_volume(docker, &v.name).await;
        }
        Ok(found.len() + volumes.len())
    }

    /// Whether a container behind the proxy, its workspace `bound` from this machine, gets the proxy's listener opened
    /// in its network namespace by this process: the engine on this machine (its
    /// workspace bound from here), a proxy that takes listeners, and root, which entering
    /// another process's namespace takes.
    pub(crate) fn egress_in_netns(
        &self,
        bound: bool,
        egress: &tandem_executor::EgressSocket,
    ) -> bool {
        bound && egress.adopt.is_some() && nix::unistd::geteuid().is_root()
    }

    /// The container body for a session: the hardened defaults plus the session's mounts.
    pub(crate) fn container_body(
        &self,
        workspace: &session::Place,
        labels: HashMap<String, String>,
        limits: &tandem_executor::Limits,
        egress: Option<&tandem_executor::EgressSocket>,
        volumes: &[tandem_executor::VolumeBinding],
    ) -> ContainerCreateBody {
        let c = &self.inner.config;
        // A task's memory limit can lower the container's, never raise it.
        let bytes = limits
            .memory_bytes
            .map_or(c.memory_bytes, |m| m.min(c.memory_bytes));
        let memory = i64::try_from(bytes).unwrap_or(i64::MAX);
        let mut env: Vec<String> = tandem_executor_runner::base_env(&c.env)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        // Behind the proxy the container has a loopback and nothing else; the runner relays
        // its port there to the proxy's socket, bound in read-only.
        // On an engine reached over the network nothing is bound in: a relay the session
        // starts in the container carries its connections instead (`relay`).
        // Where Tandem can open the proxy's listener in the container's own network, the
        // runner relays nothing; the socket's directory is still bound in for the CA.
        let bound = matches!(workspace, session::Place::Host(_));
        let in_netns = egress.is_some_and(|e| self.egress_in_netns(bound, e));
        let session = labels.get(labels::SESSION).cloned();
        let egress_bind = egress.filter(|_| bound).and_then(|e| {
            let dir = e.socket.parent()?;
            let file = e.socket.file_name()?.to_str()?;
            match (&session, in_netns) {
                (Some(session), true) => {
                    env.push(format!("{}={session}", ports::NETNS_MARK));
                }
                _ => {
                    env.push(format!("TANDEM_EGRESS_SOCKET={EGRESS_DIR}/{file}"));
                    env.push(format!(
                        "TANDEM_EGRESS_PORT={}",
                        tandem_executor::EGRESS_PORT
                    ));
                }
            }
            Some(format!("{}:{EGRESS_DIR}:ro", dir.display()))
        });
        let open_bridge = c.network && egress.is_none();
        ContainerCreateBody {
            image: Some(c.image.clone()),
            // `-S`: the runner needs only the standard library, and importing `site` is
            // half of an interpreter's start, paid by every container of a burst.
            entrypoint: Some(vec![
                "python3".to_owned(),
                "-I".to_owned(),
                "-S".to_owned(),
                "-c".to_owned(),
                RUNNER.clone(),
            ]),
            // The runner is root with three capabilities and runs every block as `c.user`.
            cmd: Some(match workspace {
                session::Place::Host(_) => vec![c.user.clone()],
                session::Place::Volume(_) => vec![c.user.clone(), "volume".to_owned()],
            }),
            env: Some(env),
            user: Some("0:0".to_owned()),
            working_dir: Some("/workspace".to_owned()),
            labels: Some(labels),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            open_stdin: Some(true),
            stdin_once: Some(false),
            tty: Some(false),
            network_disabled: Some(!open_bridge && egress.is_none()),
            host_config: Some(HostConfig {
                binds: match workspace {
                    session::Place::Host(dir) => Some(
                        std::iter::once(format!("{}:/workspace:rw", dir.display()))
                            .chain(egress_bind)
                            .chain(volumes.iter().map(|v| {
                                format!(
                                    "{}:{}:{}",
                                    v.host_dir.display(),
                                    volume_target(&v.path),
                                    if v.read_only { "ro" } else { "rw" }
                                )
                            }))
                            .collect(),
                    ),
                    session::Place::Volume(_) => None,
                },
                mounts: match workspace {
                    session::Place::Host(_) => None,
                    session::Place::Volume(name) => Some(
                        std::iter::once(bollard::models::Mount {
                            target: Some("/workspace".to_owned()),
                            source: Some(name.clone()),
                            typ: Some(bollard::models::MountType::VOLUME),
                            read_only: Some(false),
                            ..Default::default()
                        })
                        .chain(volumes.iter().map(|v| bollard::models::Mount {
                            target: Some(volume_target(&v.path)),
                            source: Some(engine_volume(&v.name)),
                            typ: Some(bollard::models::MountType::VOLUME),
                            read_only: Some(v.read_only),
                            ..Default::default()
                        }))
                        .collect(),
                    ),
                },
                network_mode: Some(if open_bridge { "bridge" } else { "none" }.to_owned()),
                cap_drop: Some(vec!["ALL".to_owned()]),
                // What the runner needs to become the blocks' user and to kill their
                // processes; a block, once it is that user, has none of them.
                cap_add: Some(RUNNER_CAPS.iter().map(|c| (*c).to_owned()).collect()),
                security_opt: Some(vec!["no-new-privileges".to_owned()]),
                readonly_rootfs: Some(c.read_only),
                tmpfs: Some(HashMap::from([
                    (
                        "/tmp".to_owned(),
                        format!("rw,nosuid,nodev,size={},mode=1777", c.tmpfs_bytes),
                    ),
                    // The tools module and command: written by the runner, which owns it, and
                    // only read and run by blocks (/tmp is noexec).
                    (
                        "/run/tandem".to_owned(),
                        "rw,exec,nosuid,nodev,size=1m,mode=0755".to_owned(),
                    ),
                ])),
                pids_limit: Some(c.pids),
                memory: Some(memory),
                memory_swap: Some(memory),
                nano_cpus: Some((c.cpus * 1e9) as i64),
                init: Some(true),
                auto_remove: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// Where a volume's `path` is in the container: absolute as written, else in the workspace.
fn volume_target(path: &str) -> String {
    if path.starts_with('/') {
        path.trim_end_matches('/').to_owned()
    } else {
        format!("/workspace/{}", path.trim_end_matches('/'))
    }
}

impl Executor for DockerExecutor {
    fn name(&self) -> &str {
        "docker"
    }

    fn mounts_volumes(&self) -> bool {
        true
    }

    fn pools(&self) -> Vec<tandem_executor::PoolStatus> {
        let c = &self.inner.config;
        if c.pool_size == 0 && c.pool_max == 0 {
            return Vec::new();
        }
        vec![self.pool_status()]
    }

    fn keeps_state(&self) -> bool {
        // The kept interpreter's FIFOs live in a host directory the container shares.
        self.inner.config.workspace == WorkspaceMode::Bind
    }

    fn carries_tool_calls(&self) -> bool {
        // Relayed by the runner over its frames: no socket crosses into the container.
        true
    }

    fn carries_egress(&self) -> bool {
        // The proxy's socket is bound in from this machine, or reached over an exec'd relay
        // on an engine elsewhere.
        true
    }

    fn network(&self) -> bool {
        self.inner.config.network
    }

    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let image = &self.inner.config.image;
            let asked = tokio::time::timeout(Duration::from_secs(2), self.image_present()).await;
            match asked {
                Err(_) => Err("the Docker engine did not answer within 2 s".to_owned()),
                Ok(Err(e)) => Err(e.to_string()),
                Ok(Ok(true)) => Ok(()),
                // A pull can take minutes, or never work (no registry): not ready either way.
                Ok(Ok(false)) => Err(format!(
                    "image `{image}` is not present; pull it (`docker pull {image}`), or build one offline with scripts/build-sandbox-image.sh"
                )),
            }
        })
    }

    fn languages(&self) -> &[Language] {
        &self.inner.config.languages
    }

    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        Box::pin(async move {
            self.ensure_image(&|line| tracing::info!(image = %self.inner.config.image, "{line}"))
                .await?;
            let warm = match self.poolable(&spec) {
                true => self.take_warm().await,
                false => None,
            };
            let session = match warm {
                Some((warm, waited)) => {
                    session::DockerSession::from_warm(self.clone(), warm, spec, waited).await?
                }
                None => session::DockerSession::open(self.clone(), spec).await?,
            };
            self.warm_up();
            Ok(Box::new(session) as Box<dyn Session>)
        })
    }
}

impl DockerExecutor {
    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Drops `session` from the live set: its container and volume are gone, or going.
    pub(crate) fn forget(&self, session: &str) {
        if let Ok(mut live) = self.inner.live.lock() {
            live.remove(session);
        }
    }

    /// Whether the engine answers a ping within 5 s; if not, why.
    pub async fn answers(&self) -> Result<(), String> {
        match tokio::time::timeout(Duration::from_secs(5), self.inner.docker.ping()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(error_chain(&e)),
            Err(_) => Err("no answer within 5 s".to_owned()),
        }
    }

    /// The operator's name for this engine (its address when none was given).
    pub fn label(&self) -> &str {
        self.inner.config.label()
    }
}

async fn image_present(docker: &Docker, image: &str) -> Result<bool, DockerError> {
    match docker.inspect_image(image).await {
        Ok(_) => Ok(true),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(false),
        Err(e) => Err(engine(format!("inspecting image `{image}`"))(e)),
    }
}

async fn ensure_image(
    docker: &Docker,
    config: &DockerConfig,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<(), DockerError> {
    let image = &config.image;
    if image_present(docker, image).await? {
        return Ok(());
    }
    let unavailable = |reason: String| DockerError::ImageUnavailable {
        image: image.clone(),
        reason,
    };
    if !config.pull {
        return Err(unavailable("pulling is turned off".to_owned()));
    }
    progress(&format!("pulling {image}"));
    let (name, tag) = split_tag(image);
    let mut pull = docker.create_image(
        Some(
            CreateImageOptionsBuilder::default()
                .from_image(name)
                .tag(tag)
                .build(),
        ),
        None,
        None,
    );
    let mut last = String::new();
    while let Some(item) = pull.next().await {
        let info = item.map_err(|e| unavailable(e.to_string()))?;
        if let Some(detail) = info.error_detail.and_then(|d| d.message) {
            return Err(unavailable(detail));
        }
        let line = [info.id, info.status]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(": ");
        if !line.is_empty() && line != last {
            progress(&line);
            last = line;
        }
    }
    if image_present(docker, image).await? {
        Ok(())
    } else {
        Err(unavailable("the pull ended without the image".to_owned()))
    }
}

/// `name[:tag]`, where a `:` inside a registry host's port is not a tag.
fn split_tag(image: &str) -> (&str, &str) {
    match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name, tag),
        _ => (image, "latest"),
    }
}

/// The client for `config`'s engine: TLS with its files when it names them, else by the
/// address's scheme (and `DOCKER_TLS_VERIFY`/`DOCKER_CERT_PATH` for `tcp://`, as the docker
/// CLI reads them).
fn client(config: &DockerConfig) -> Result<Docker, bollard::errors::Error> {
    match &config.tls {
        Some(tls) => Docker::connect_with_ssl(
            &config.host,
            &tls.key,
            &tls.cert,
            &tls.ca,
            120,
            bollard::API_DEFAULT_VERSION,
        ),
        None => Docker::connect_with_host(&config.host),
    }
}

/// An error's deepest cause, which is where a TLS or connection failure says what was wrong,
/// after its parent when that is a short word on it (`tcp connect error`); the links above
/// name the HTTP client's layers.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut links = vec![e.to_string()];
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if links.last().is_none_or(|l| !l.contains(&text)) {
            links.push(text);
        }
        cause = c.source();
    }
    let deepest = links.pop().unwrap_or_default();
    match links.pop() {
        Some(parent) if parent.len() <= 40 => format!("{parent}: {deepest}"),
        _ => deepest,
    }
}

/// Removes a volume, ignoring one already gone.
pub(crate) async fn remove_volume(docker: &Docker, name: &str) {
    let opts = bollard::query_parameters::RemoveVolumeOptionsBuilder::default()
        .force(true)
        .build();
    match docker.remove_volume(name, Some(opts)).await {
        Ok(()) => {}
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => {}
        Err(e) => tracing::warn!(volume = name, error = %e, "removing a volume failed"),
    }
}

/// Kills and removes a container at once (no graceful stop), ignoring one already gone.
pub(crate) async fn remove_container(docker: &Docker, id: &str) {
    let opts = RemoveContainerOptionsBuilder::default()
        .force(true)
        .v(true)
        .build();
    match docker.remove_container(id, Some(opts)).await {
        Ok(()) => {}
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => {}
        Err(e) => tracing::warn!(container = id, error = %e, "removing a container failed"),
    }
}

/// The environment code gets, and nothing else of the host's: the allowlist plus the
/// configured extras. The container starts with it; each block gets it too.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tls_connection_the_engine_closes_is_told_as_its_certificate() {
        let e = |reason: String| DockerError::Unreachable {
            host: "the Docker engine `b` at tcp://127.0.0.1:1".to_owned(),
            reason,
        };
        let closed = e(tls_reason(
            "operation was canceled: connection was not ready".to_owned(),
        ))
        .to_string();
        assert!(
            closed.ends_with("check the host's TLS files: its `ca` must have signed the engine's certificate, and the engine must trust `cert` (and `key`)"),
            "{closed}"
        );
        // Refused outright is an engine that is not there, TLS or not.
        let refused = e(tls_reason("Connection refused (os error 111)".to_owned())).to_string();
        assert!(refused.contains("start Docker"), "{refused}");
    }

    #[test]
    fn image_tags() {
        assert_eq!(split_tag("python:3.12-slim"), ("python", "3.12-slim"));
        assert_eq!(split_tag("python"), ("python", "latest"));
        assert_eq!(
            split_tag("registry:5000/team/img"),
            ("registry:5000/team/img", "latest")
        );
        assert_eq!(
            split_tag("registry:5000/img:v1"),
            ("registry:5000/img", "v1")
        );
    }
}
