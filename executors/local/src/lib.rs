//! Tandem executor that runs code blocks as local subprocesses.
//!
//! Not a security boundary: it keeps code away from the daemon's secrets (empty environment
//! plus an allowlist), bounds it with rlimits and a wall-clock timeout, and kills every
//! process a block started when the block ends. Use the Docker or WASM executor to contain
//! untrusted code.

mod confine;
mod forkserver;
mod holder;
mod interpreters;
mod kill;
mod run;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, Language, Limits,
    Session, SessionSpec,
};
use tandem_executor_kit::scratch::TempTree;
use tandem_executor_kit::{owner, scratch};

pub use confine::{Confine, Support};
use forkserver::ForkServer;
pub use interpreters::Interpreters;

/// Settings for the local executor.
#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// Python interpreter to use instead of `python3` from PATH.
    pub python: Option<PathBuf>,
    /// Node.js binary to use instead of `node` from PATH.
    pub node: Option<PathBuf>,
    /// PATH searched for interpreters and given to code; [`DEFAULT_PATH`] when `None` (the
    /// CLI passes its own).
    pub path: Option<String>,
    /// LANG given to code; `C.UTF-8` when `None` (the CLI passes its own).
    pub lang: Option<String>,
    /// Extra environment variables passed to code (names and values), on top of the allowlist.
    pub env: Vec<(String, String)>,
    /// Run python blocks as forks of a warm interpreter instead of fresh `python3` starts.
    pub python_fork_server: bool,
    /// Whether blocks are confined by the kernel (Landlock, a network namespace, seccomp).
    pub confine: Confine,
    /// Whether confined blocks may use the network.
    pub network: bool,
    /// Paths confined blocks may read besides the system's and the interpreters'.
    pub read_paths: Vec<PathBuf>,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            python: None,
            node: None,
            path: None,
            lang: None,
            env: Vec::new(),
            python_fork_server: true,
            confine: Confine::Auto,
            network: false,
            read_paths: Vec::new(),
        }
    }
}

/// Why blocks under `config` run unconfined on this machine; `None` when they are confined.
fn unconfined_because(config: &LocalConfig) -> Option<String> {
    let support = Support::probe();
    if config.confine == Confine::Off {
        Some("confine = \"off\"".to_owned())
    } else if !config.python_fork_server {
        Some("confinement is applied by the fork server, which is off".to_owned())
    } else if !support.can_confine() {
        Some(format!(
            "this kernel cannot confine blocks ({})",
            support.describe()
        ))
    } else {
        None
    }
}

/// How blocks under `config` run on this machine: `Ok` with what confines them, or `Err`
/// with why they are unconfined.
pub fn confinement(config: &LocalConfig) -> Result<String, String> {
    match unconfined_because(config) {
        None => Ok(format!(
            "confined ({}; network {}; {})",
            Support::probe().describe(),
            if config.network { "on" } else { "off" },
            if Support::probe().pid_namespaces() {
                "a PID namespace per block"
            } else {
                "processes visible"
            }
        )),
        Some(why) => Err(format!("unconfined: {why}")),
    }
}

/// The PATH interpreters are looked up on when the config names none.
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Runs python, sh and (when node is installed) javascript as local processes.
pub struct LocalExecutor {
    inner: Arc<Inner>,
}

struct Inner {
    config: LocalConfig,
    path: String,
    /// Resolved on first use: resolving a version-manager shim costs a process start, which
    /// `tandem run` should not pay before its first model request.
    interpreters: OnceLock<Interpreters>,
    languages: Vec<Language>,
    env: Vec<(String, String)>,
    /// Where temporary workspaces go (see [`ROOT_PREFIX`]).
    root: PathBuf,
    /// What confined blocks may read, found once.
    readable: OnceLock<Vec<PathBuf>>,
    /// Started on the first python block; `Err` once starting it failed (then blocks spawn).
    fork_server: tokio::sync::Mutex<Option<Result<Arc<ForkServer>, ()>>>,
}

impl Inner {
    /// The confinement policy of a session with `workspace` and `tmp`; an error when it is
    /// required and the kernel cannot apply it.
    fn policy(
        &self,
        workspace: &Path,
        tmp: &Path,
        tools: &Path,
        volumes: &[tandem_executor::VolumeBinding],
    ) -> Result<Option<confine::Policy>, ExecError> {
        let (read_only, writable): (Vec<_>, Vec<_>) = volumes.iter().partition(|v| v.read_only);
        match (unconfined_because(&self.config), self.config.confine) {
            (None, _) => confine::policy(
                workspace,
                tmp,
                &writable
                    .iter()
                    .map(|v| v.host_dir.clone())
                    .collect::<Vec<_>>(),
                &self
                    .readable
                    .get_or_init(|| {
                        confine::readable(&self.interpreters().prefixes(), &self.config.read_paths)
                    })
                    .iter()
                    .cloned()
                    .chain([tools.to_owned()])
                    .chain(read_only.iter().map(|v| v.host_dir.clone()))
                    .collect::<Vec<_>>(),
                self.config.network,
                self.config.confine == Confine::Required,
            )
            .map(Some)
            .map_err(|e| ExecError::io("making the session's Landlock ruleset", e)),
            (Some(why), Confine::Required) => Err(ExecError::Unavailable {
                what: "confinement of local blocks".to_owned(),
                hint: format!(
                    "{why}; set [executors.local] confine = \"auto\" to run unconfined, or use the docker or wasm executor"
                ),
            }),
            (Some(why), Confine::Auto) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| tracing::warn!("local blocks run unconfined: {why}"));
                Ok(None)
            }
            (Some(_), Confine::Off) => Ok(None),
        }
    }

    fn interpreters(&self) -> &Interpreters {
        self.interpreters
            .get_or_init(|| Interpreters::discover(&self.config, &self.path))
    }

    /// The running fork server for `python`, started or restarted as needed; `None` when it
    /// is turned off or cannot start, and blocks then run as fresh processes.
    async fn fork_server(&self, python: &Path) -> Option<Arc<ForkServer>> {
        if !self.config.python_fork_server {
            return None;
        }
        let mut slot = self.fork_server.lock().await;
        match slot.as_ref() {
            Some(Ok(server)) if server.alive() => return Some(server.clone()),
            Some(Err(())) => return None,
            _ => {}
        }
        let mut env = self.env.clone();
        env.push(("PATH".to_owned(), self.interpreters().path_env.clone()));
        env.push(("PYTHONDONTWRITEBYTECODE".to_owned(), "1".to_owned()));
        let no_network = unconfined_because(&self.config).is_none() && !self.config.network;
        match ForkServer::start(python, &env, no_network) {
            Ok(server) => {
                let server = Arc::new(server);
                *slot = Some(Ok(server.clone()));
                Some(server)
            }
            Err(e) => {
                tracing::warn!(error = %e, "the Python fork server did not start; python blocks will start fresh interpreters");
                *slot = Some(Err(()));
                None
            }
        }
    }
}

impl LocalExecutor {
    /// Finds the interpreters on PATH; a missing python or node just drops that language.
    pub fn new(config: LocalConfig) -> Self {
        let path = config
            .path
            .clone()
            .unwrap_or_else(|| DEFAULT_PATH.to_owned());
        let languages = Interpreters::languages_on(&config, &path);
        let lang = config.lang.clone().unwrap_or_else(|| "C.UTF-8".to_owned());
        // The owner tag rides along in every block's environment (and the fork server's, which
        // its forks show in /proc), so a later Tandem can find what a dead one left running.
        let mut env = vec![
            ("LANG".to_owned(), lang),
            (owner::OWNER_VAR.to_owned(), owner::owner_tag()),
        ];
        env.extend(config.env.iter().cloned());
        Self {
            inner: Arc::new(Inner {
                config,
                path,
                interpreters: OnceLock::new(),
                readable: OnceLock::new(),
                languages,
                env,
                root: scratch::process_root(ROOT_PREFIX),
                fork_server: tokio::sync::Mutex::new(None),
            }),
        }
    }

    /// The interpreters, resolved on first call (this may start `python3` once).
    pub fn interpreters(&self) -> &Interpreters {
        self.inner.interpreters()
    }

    /// Kills processes and removes temporary directories that a Tandem which has since died
    /// left behind (a daemon killed with SIGKILL cannot clean up); returns how many things it
    /// removed. A daemon calls this at start-up.
    pub fn reap_orphans() -> usize {
        kill::kill_orphans() + scratch::reap_dead_roots(ROOT_PREFIX)
    }
}

/// Temporary workspaces live in `$TMPDIR/tandem-local-<pid>-<start-time>/` of their owner.
const ROOT_PREFIX: &str = "tandem-local-";

impl Executor for LocalExecutor {
    fn name(&self) -> &str {
        "local"
    }

    fn keeps_state(&self) -> bool {
        true
    }

    fn carries_tool_calls(&self) -> bool {
        // The fork server hands each block its channel.
        self.inner
            .interpreters()
            .program(&Language::python())
            .is_some()
    }

    fn carries_egress(&self) -> bool {
        // The relay needs a network namespace per block, which a confined fork server's user
        // namespace gives; unconfined, or with the network on, a block could go around it.
        unconfined_because(&self.inner.config).is_none()
            && !self.inner.config.network
            && self.inner.config.python_fork_server
    }

    fn network(&self) -> bool {
        // Only confinement takes the network away.
        self.inner.config.network || unconfined_because(&self.inner.config).is_some()
    }

    fn languages(&self) -> &[Language] {
        &self.inner.languages
    }

    fn mounts_volumes(&self) -> bool {
        true
    }

    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let session = tokio::task::spawn_blocking(move || LocalSession::create(inner, spec))
                .await
                .map_err(|e| {
                    ExecError::Backend(format!("opening a local session failed: {e}"))
                })??;
            Ok(Box::new(session) as Box<dyn Session>)
        })
    }
}

/// Where a session's tools module is, in its scratch directory.
pub(crate) const TOOLS_DIR: &str = "tools";

/// A workspace directory plus a private scratch directory for TMPDIR.
struct LocalSession {
    inner: Arc<Inner>,
    workspace: PathBuf,
    /// Owns the workspace when Tandem made it, so it is removed with the session.
    owned_workspace: Option<TempTree>,
    scratch: TempTree,
    limits: Limits,
    blocks: u32,
    /// What confines its blocks; `None` when they run unconfined.
    policy: Option<confine::Policy>,
    /// The egress proxy's socket, the blocks' one way out, when the session is behind it.
    egress: Option<PathBuf>,
    /// Where the proxy takes the holder's listener itself (no relay between).
    adopt: Option<tandem_executor::EgressAdopt>,
    /// Whether the session has a network of its own (a holder), whose ports it publishes:
    /// confined blocks without the machine's network.
    publishes: bool,
    /// The session's holder, once its first block has started it; ended with the session.
    holder: holder::HolderGuard,
    /// What the proxy gives blocks behind it in their environment.
    egress_env: Vec<(String, String)>,
}

impl LocalSession {
    fn create(inner: Arc<Inner>, spec: SessionSpec) -> Result<Self, ExecError> {
        inner.interpreters();
        let scratch = scratch::temp_in(&inner.root, "tandem-scratch-")
            .map_err(|e| ExecError::io("creating a scratch directory", e))?;
        std::fs::create_dir(scratch.path().join("tmp")).map_err(|source| ExecError::Workspace {
            path: scratch.path().to_owned(),
            source,
        })?;
        // The tools module lives beside the block's tmp, not in it: readable by the block,
        // written once here before any block runs, and never again, so nothing a block
        // plants can turn a write of Tandem's into one elsewhere on the host.
        let tools = scratch.path().join(TOOLS_DIR);
        tandem_executor_kit::toolchannel::install(&tools)
            .map_err(|e| ExecError::io("installing the tools module", e))?;
        let (workspace, owned_workspace) =
            scratch::open_workspace(spec.workdir, &inner.root, "tandem-workspace-")?;
        let policy = inner.policy(
            &workspace,
            &scratch.path().join("tmp"),
            &tools,
            &spec.volumes,
        )?;
        place_volumes(&workspace, &spec.volumes, policy.is_some())?;
        let mut egress_env: Vec<(String, String)> = spec
            .egress
            .as_ref()
            .map(|e| e.env.clone())
            .unwrap_or_default();
        if let Some(bundle) = spec.egress.as_ref().and_then(|e| e.ca_bundle.as_ref()) {
            // Beside the tools module: readable by the confined block, written before any
            // block runs.
            let copy = tools.join("egress-ca.pem");
            std::fs::copy(bundle, &copy)
                .map_err(|e| ExecError::io("placing the egress proxy's CA bundle", e))?;
            egress_env.extend(tandem_executor::egress_ca_env(&copy.to_string_lossy()));
        }
        let publishes =
            policy.is_some() && !inner.config.network && inner.config.python_fork_server;
        Ok(Self {
            inner,
            workspace,
            owned_workspace,
            scratch,
            limits: spec.limits,
            blocks: 0,
            publishes,
            holder: holder::HolderGuard(Arc::new(std::sync::Mutex::new(holder::Slot::Waiting))),
            policy,
            egress_env,
            adopt: spec.egress.as_ref().and_then(|e| e.adopt.clone()),
            egress: spec.egress.map(|e| e.socket),
        })
    }
}

/// Makes each volume appear where its `path` names inside the workspace: a link to its
/// directory, which the session's ruleset alone lets blocks reach (read-only where asked).
fn place_volumes(
    workspace: &Path,
    volumes: &[tandem_executor::VolumeBinding],
    confined: bool,
) -> Result<(), ExecError> {
    for v in volumes {
        let unavailable = |hint: String| ExecError::Unavailable {
            what: format!("volume `{}` at `{}` on the local executor", v.name, v.path),
            hint,
        };
        if v.path.starts_with('/') {
            return Err(unavailable(
                "local blocks share this machine's filesystem: mount the volume inside the workspace (a relative path such as `data`), or at /data on docker".into(),
            ));
        }
        if v.read_only && !confined {
            return Err(unavailable(
                "a read-only volume needs confined blocks (Landlock), which this machine or the [executors.local] confine setting does not give; use docker".into(),
            ));
        }
        link_beneath(workspace, Path::new(&v.path), &v.host_dir).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                unavailable("the workspace already has something there; name another path".into())
            } else {
                ExecError::Workspace {
                    path: workspace.join(&v.path),
                    source: e,
                }
            }
        })?;
    }
    Ok(())
}

/// Makes the link `rel` beneath `workspace` to `target`, its parents made as needed, every
/// step opened beneath the one before without following a link: a kept workspace is what
/// earlier blocks shaped, and a link they planted on the way must not lead the daemon's own
/// write elsewhere on the host. A link already there to `target` (a second session on the
/// workspace) is kept.
fn link_beneath(workspace: &Path, rel: &Path, target: &Path) -> std::io::Result<()> {
    use nix::fcntl::{OFlag, openat, readlinkat};
    use nix::sys::stat::{Mode, mkdirat};
    use std::os::fd::AsFd;
    let errno = |e: nix::errno::Errno| std::io::Error::from_raw_os_error(e as i32);
    let parts = tandem_executor_kit::keeper::plain(rel)
        .filter(|p| !p.is_empty())
        .ok_or_else(|| {
            std::io::Error::other(format!("`{}` leaves the workspace", rel.display()))
        })?;
    let (name, parents) = parts
        .split_last()
        .ok_or_else(|| std::io::Error::other("no name"))?;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = tandem_executor_kit::keeper::open_root(workspace)?;
    for part in parents {
        match mkdirat(dir.as_fd(), *part, Mode::from_bits_truncate(0o777)) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(errno(e)),
        }
        dir = openat(dir.as_fd(), *part, flags, Mode::empty()).map_err(errno)?;
    }
    if readlinkat(dir.as_fd(), *name).is_ok_and(|to| Path::new(&to) == target) {
        return Ok(());
    }
    nix::unistd::symlinkat(target, dir.as_fd(), *name).map_err(errno)
}

impl LocalSession {
    /// The id of the session's holder on `server`, started on first use; `None` when the
    /// session has none (its blocks then share the fork server's empty network). Behind the
    /// egress proxy a holder is the only way out, so one that cannot start fails the block.
    async fn hold(&self, server: &Arc<ForkServer>) -> Result<Option<u64>, ExecError> {
        if !self.publishes {
            return Ok(None);
        }
        let slot = self.holder.0.clone();
        let lost = || ExecError::Backend("the session's holder lock is poisoned".into());
        {
            let slot = slot.lock().map_err(|_| lost())?;
            match &*slot {
                holder::Slot::Open(h) if Arc::ptr_eq(&h.server, server) => return Ok(Some(h.id)),
                holder::Slot::Failed(_) if self.egress.is_none() => return Ok(None),
                holder::Slot::Closed => {
                    return Err(ExecError::Backend("the session is closed".into()));
                }
                _ => {}
            }
        }
        let (server, egress) = (server.clone(), self.egress.clone());
        let adopt = self.adopt.clone().filter(|_| egress.is_some());
        let taking = adopt.is_some();
        let catcher = adopt.clone();
        let started = tokio::task::spawn_blocking(move || {
            let h = holder::Holder::start(&server, egress.as_deref(), taking)
                .map_err(|e| ExecError::Backend(e.to_string()))?;
            let listener = if taking { Some(h.listener()?) } else { None };
            // The session's other ways out are caught and told. Without it (the daemon may
            // not manage that network) the session still has no route: what its blocks try
            // is refused, only not seen.
            if let Some(catcher) = catcher {
                match h.netns().and_then(|ns| {
                    catcher
                        .catch(ns)
                        .map_err(|e| ExecError::io("catching the session's other traffic", e))
                }) {
                    Ok(()) => {}
                    Err(e) => tracing::debug!(error = %e, "attempts around the egress proxy will be refused but not recorded"),
                }
            }
            Ok::<_, ExecError>((h, listener))
        })
        .await
        .map_err(|e| ExecError::Backend(format!("starting the session's holder: {e}")))?;
        // The proxy serves the holder's listener itself from here: a block's connection
        // reaches it with nothing copying it in between.
        let started = started.and_then(|(h, listener)| {
            if let (Some(adopt), Some(listener)) = (&adopt, listener) {
                adopt
                    .adopt(listener)
                    .map_err(|e| ExecError::io("serving the session's egress listener", e))?;
            }
            Ok(h)
        });
        let mut slot = slot.lock().map_err(|_| lost())?;
        match started {
            Ok(h) => {
                let id = h.id;
                *slot = holder::Slot::Open(Arc::new(h));
                Ok(Some(id))
            }
            Err(e) if self.egress.is_some() => {
                *slot = holder::Slot::Failed(e.to_string());
                Err(ExecError::Unavailable {
                    what: "the way out through the egress proxy".into(),
                    hint: format!("the session's network of its own did not start: {e}"),
                })
            }
            Err(e) => {
                tracing::warn!(error = %e, "a local session's network of its own did not start; its blocks share the fork server's, and its ports are not published");
                *slot = holder::Slot::Failed(e.to_string());
                Ok(None)
            }
        }
    }
}

impl Session for LocalSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(async move {
            self.blocks += 1;
            run::run_block(self, req, ctx).await
        })
    }

    fn workspace(&self) -> Option<&Path> {
        Some(&self.workspace)
    }

    fn ports(&self) -> Option<Arc<dyn tandem_executor::Ports>> {
        self.publishes.then(|| {
            Arc::new(holder::LocalPorts(self.holder.0.clone())) as Arc<dyn tandem_executor::Ports>
        })
    }

    fn put_archive(
        &mut self,
        archive: &Path,
        caps: tandem_executor::files::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<tandem_executor::files::ArchivedFile>, ExecError>> {
        tandem_executor_kit::put_in_workspace(self.workspace(), archive, caps)
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        Box::pin(async move {
            let Self {
                inner,
                owned_workspace,
                scratch: scratch_dir,
                ..
            } = *self;
            let dirs = std::iter::once(scratch_dir)
                .chain(owned_workspace)
                .collect();
            scratch::remove_dirs(dirs, inner.root.clone()).await
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn a_volume_link_is_made_beneath_the_workspace_and_never_through_a_planted_link() {
        let ws = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let volume = tempfile::tempdir().unwrap();
        // Made, its parents too; made again (a second session) is kept.
        link_beneath(ws.path(), Path::new("a/b/vol"), volume.path()).unwrap();
        link_beneath(ws.path(), Path::new("a/b/vol"), volume.path()).unwrap();
        assert_eq!(
            std::fs::read_link(ws.path().join("a/b/vol")).unwrap(),
            volume.path()
        );
        // A block of an earlier session planted a link where a parent goes: refused, and
        // nothing is made where it points.
        std::os::unix::fs::symlink(elsewhere.path(), ws.path().join("planted")).unwrap();
        assert!(link_beneath(ws.path(), Path::new("planted/vol"), volume.path()).is_err());
        // And at the name itself: refused as taken, not written through.
        std::os::unix::fs::symlink(elsewhere.path(), ws.path().join("taken")).unwrap();
        let e = link_beneath(ws.path(), Path::new("taken"), volume.path()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
        assert!(link_beneath(ws.path(), Path::new("../out"), volume.path()).is_err());
    }
}
