//! The Tandem executor plugin surface.
//!
//! An [`Executor`] is a kind of sandbox (local processes, Docker, WASM, or your own). For
//! each task Tandem [`Executor::open`]s one [`Session`]: a workspace where files written by
//! one code block are still there for the next. Each block is an [`ExecRequest`] run with
//! [`Session::run`], which streams live output into the [`ExecContext`]'s sink and returns
//! an [`ExecOutcome`].
//!
//! Two kinds of failure are kept apart on purpose:
//! - a program that fails, times out or is killed is an `Ok(ExecOutcome)`: it goes back to
//!   the model, which can fix its code;
//! - `Err(ExecError)` means the sandbox itself broke (engine down, interpreter missing,
//!   unsupported language) and the model cannot fix it.
//!
//! Policy is data: [`Limits`] is one serde struct that every backend honours in its own
//! way. Beside the traits are the plain types they speak in: language aliases
//! ([`Language`]), bounded output capture ([`CaptureBuffer`]), what files cross a session's
//! boundary as ([`files`]), and a name-to-executor [`Registry`].
//!
//! A third-party executor depends on this crate alone; see `examples/custom-executor`. The
//! machinery the built-in executors share (archives, process supervision, the kept
//! interpreter, the tool channel, the session budget) is `tandem-executor-kit`, which a
//! plugin may use but need not.
#![deny(missing_docs)]

mod capture;
mod error;
pub mod files;
mod language;
mod limits;
mod registry;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub use capture::{CaptureBuffer, Captured, complete_utf8};
pub use error::ExecError;
pub use language::{Language, join as join_languages};
pub use limits::Limits;
pub use registry::{Registry, Wrap};
pub use tandem_protocol::{PeakScope, Resources};
pub use tokio_util::sync::CancellationToken;

/// A boxed, sendable future, as the object-safe traits here return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Runs one call that a block's code makes to its task's tools: the tool's name and its
/// arguments (JSON text); the answer, or what went wrong.
pub type ToolHandler =
    Arc<dyn Fn(String, String) -> BoxFuture<'static, Result<String, String>> + Send + Sync>;

/// The path named by a block's first line such as `# filename: src/app.py` (or `// filename:` for
/// C-like languages), if the block has one.
pub fn filename_directive(code: &str) -> Option<&str> {
    let first = code.lines().next()?.trim();
    let rest = first
        .strip_prefix('#')
        .or_else(|| first.strip_prefix("//"))?
        .trim_start();
    let name = rest.strip_prefix("filename:")?.trim();
    (!name.is_empty()).then_some(name)
}

/// A kind of sandbox that can open sessions.
pub trait Executor: Send + Sync + 'static {
    /// Registry name, such as `local` or `docker`.
    fn name(&self) -> &str;
    /// Languages this executor can run, normalised.
    fn languages(&self) -> &[Language];
    /// Opens a session: one per task, holding a workspace that persists across blocks.
    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>>;

    /// Whether `language` can run here.
    fn supports(&self, language: &Language) -> bool {
        self.languages().contains(language)
    }

    /// Whether the executor can run code now; `Err` says what is wrong and how to fix it.
    /// Cheap enough to call on every `GET /v1/executors`.
    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    /// Whether sessions can keep one Python interpreter for all their Python blocks
    /// (`tandem_executor_kit::kept::KeptSession`): the executor's sessions have a host workspace, a second
    /// session can be opened on it, and its Python has threads and FIFOs.
    fn keeps_state(&self) -> bool {
        false
    }

    /// Whether its blocks' code can call the task's tools ([`ExecContext::tools`]): the
    /// `tandem_tools` module and the `tandem-tool` command work in its sandbox.
    fn carries_tool_calls(&self) -> bool {
        false
    }

    /// Whether its sessions can be put behind the egress proxy ([`SessionSpec::egress`]):
    /// their only way out is then the proxy, and a session it cannot put there is refused.
    fn carries_egress(&self) -> bool {
        false
    }

    /// Whether its sessions can mount volumes ([`SessionSpec::volumes`]); a session that
    /// names one on an executor that cannot is refused before it opens.
    fn mounts_volumes(&self) -> bool {
        false
    }

    /// Whether a block could reach the network. An executor that cannot tell says yes: an
    /// approval policy's `ask_network` then asks rather than assumes.
    fn network(&self) -> bool {
        true
    }

    /// The machines it places sessions on, with their health and load, when it has several
    /// (empty for one that runs everything in one place).
    fn hosts(&self) -> Vec<HostStatus> {
        Vec::new()
    }

    /// Its warm pools of started sandboxes, one per machine (empty for one that keeps none).
    fn pools(&self) -> Vec<PoolStatus> {
        Vec::new()
    }
}

/// One machine's warm pool of started sandboxes, as `/v1/executors` and `/metrics` show it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStatus {
    /// The machine's name (the engine's address when the operator gave none).
    pub host: String,
    /// Sandboxes ready now.
    pub ready: usize,
    /// Sandboxes being started now.
    pub starting: usize,
    /// Sessions waiting for one now.
    pub waiting: usize,
    /// How many it aims to hold: `pool_size` at rest, up to `pool_max` under demand.
    pub target: usize,
    /// Sessions that found one ready.
    pub hits: u64,
    /// Sessions that found none and waited for the next.
    pub misses: u64,
    /// Milliseconds those sessions waited, all together.
    pub waited_ms: u64,
    /// Closed sessions' sandboxes, their processes killed, whose removal waits until no
    /// session waits for one.
    pub closing: usize,
}

/// One machine an executor places sessions on, as `doctor`, `/v1/executors`, `/metrics` and
/// the web page show it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HostStatus {
    /// The operator's name for it.
    pub name: String,
    /// Its address.
    pub url: String,
    /// Whether it answered the last probe.
    pub up: bool,
    /// Why it is down, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Sessions open on it now.
    pub sessions: usize,
    /// Most sessions it takes.
    pub capacity: usize,
    /// Its labels, which a task's placement picks by.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Where its sessions' workspaces live (`bind` or `volume`).
    pub workspace: &'static str,
}

/// A kept interpreter's globals, saved between blocks by [`Session::save_state`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedState {
    /// Bytes of the pickle written (0: nothing to keep, and no file written).
    pub bytes: u64,
    /// The globals it holds, by name.
    pub saved: Vec<String>,
    /// The globals it does not hold, each with why.
    pub not_saved: Vec<(String, String)>,
}

/// One task's sandbox. Dropping it without [`Session::close`] must still clean up.
pub trait Session: Send {
    /// Runs one block to completion, timeout or cancellation.
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>>;
    /// The host directory that holds the session's files, if it has one.
    fn workspace(&self) -> Option<&Path>;
    /// The name of the machine it was placed on, for an executor with several.
    fn host(&self) -> Option<&str> {
        None
    }
    /// How long its opening waited for a started sandbox from the executor's warm pool
    /// (`None`: it did not wait, or the executor keeps no pool).
    fn pool_wait(&self) -> Option<Duration> {
        None
    }
    /// Reaches the sandbox's own TCP ports from Tandem's side, to publish the servers its
    /// blocks leave running; `None` for a sandbox whose ports Tandem cannot reach.
    fn ports(&self) -> Option<Arc<dyn Ports>> {
        None
    }
    /// Releases the sandbox (processes, containers, temporary files).
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>>;
    /// Saves the kept interpreter's globals (as a pickle made inside the sandbox) to the host
    /// file `dest`, at most `max_bytes` of it, within `wait`; `None` for a session that keeps
    /// no interpreter.
    fn save_state(
        &mut self,
        dest: &Path,
        max_bytes: u64,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Option<SavedState>, ExecError>> {
        let _ = (dest, max_bytes, wait);
        Box::pin(async { Ok(None) })
    }
    /// Places the regular files and directories of the tar archive at `archive` (on the
    /// host) in the workspace, within `caps`. A session with a host workspace places them
    /// there (`tandem_executor_kit::place_archive` does it beneath the workspace's handle);
    /// one that does not override this says it cannot take files.
    fn put_archive(
        &mut self,
        archive: &Path,
        caps: files::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<files::ArchivedFile>, ExecError>> {
        let _ = (archive, caps);
        Box::pin(async {
            Err(ExecError::Unavailable {
                what: "placing files in this executor's sessions".to_owned(),
                hint: "it has no workspace Tandem can reach; run the task on local, docker or wasm"
                    .to_owned(),
            })
        })
    }
}

/// A byte stream both ways, such as a connection to a port inside a sandbox.
pub trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Duplex for T {}

/// The way in to one sandbox's TCP ports, kept apart from its [`Session`] so that a
/// connection can be made while a block runs. It holds no sandbox alive: once the session
/// closes, [`Ports::dial`] fails.
pub trait Ports: Send + Sync {
    /// A connection to `port` on the sandbox's own loopback, as its servers see a local
    /// client. An error names what failed, such as nothing listening on `port`.
    fn dial(&self, port: u16) -> BoxFuture<'_, Result<Box<dyn Duplex>, ExecError>>;
    /// The TCP ports the sandbox's code listens on now, sorted (Tandem's own listeners in it
    /// left out).
    fn listening(&self) -> BoxFuture<'_, Result<Vec<u16>, ExecError>>;
}

/// How to open a session.
#[derive(Clone, Debug, Default)]
pub struct SessionSpec {
    /// Use this host directory as the workspace and keep it afterwards; `None` makes a
    /// temporary one that is removed on close.
    pub workdir: Option<PathBuf>,
    /// Resource limits for every block in the session.
    pub limits: Limits,
    /// Labels for the sandbox (task id, daemon id), used to find leftovers.
    pub labels: Vec<(String, String)>,
    /// A tar archive on the host whose files are placed in the workspace when the session
    /// opens (the files a task was given).
    pub inputs: Option<PathBuf>,
    /// Python blocks share one interpreter whose globals survive (`tandem_executor_kit::kept::KeptSession`);
    /// only for executors that [`Executor::keeps_state`].
    pub keep_state: bool,
    /// Labels the machine that runs the session must carry (`gpu=yes`), for executors that
    /// place sessions on one of several; the others ignore them.
    pub placement: Vec<(String, String)>,
    /// The session's one way out: its blocks reach the network only through the egress
    /// proxy serving this socket, for executors that [`Executor::carries_egress`]; `None`
    /// leaves the executor's own network setting.
    pub egress: Option<EgressSocket>,
    /// Volumes mounted into the sandbox, for executors that [`Executor::mounts_volumes`].
    pub volumes: Vec<VolumeBinding>,
}

/// A volume mounted into a session's sandbox: named storage that outlives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeBinding {
    /// Its name; a sandbox on another machine (a remote Docker host, a pod) mounts the
    /// storage of that name there (`tandem-volume-NAME`).
    pub name: String,
    /// Its directory on this machine.
    pub host_dir: PathBuf,
    /// Where the sandbox sees it: relative to the workspace, or absolute
    /// (`tandem_protocol::volume::mount_path` checked it).
    pub path: String,
    /// Whether the sandbox may only read it.
    pub read_only: bool,
    /// Its quota in MiB: a filesystem on this machine, which a sandbox elsewhere cannot
    /// mount.
    pub max_mb: Option<u64>,
}

/// A Unix socket on this machine where Tandem's egress proxy serves one session's policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EgressSocket {
    /// The socket's path; its directory holds nothing else and may be bound into a sandbox.
    pub socket: PathBuf,
    /// What the sandbox's environment is given beyond the proxy's address (the package
    /// index pip is pointed at).
    pub env: Vec<(String, String)>,
    /// The certificates the sandbox trusts (the system's and the proxy's CA), a file in the
    /// socket's directory, when the proxy answers some hosts itself.
    pub ca_bundle: Option<PathBuf>,
    /// Serves the same policy on a listener the executor opened inside the sandbox's own
    /// network namespace, when it can: the sandbox's connections then reach the proxy with no
    /// relay copying them in between.
    pub adopt: Option<EgressAdopt>,
}

/// What the egress proxy takes over from inside a sandbox's own network namespace, under the
/// session's policy until the session ends: the listener its blocks reach the proxy by, and
/// the namespace itself, whose every other way out the proxy then catches and records.
#[derive(Clone)]
pub struct EgressAdopt {
    listen: AdoptListener,
    catch: AdoptNetns,
}

type AdoptListener = Arc<dyn Fn(std::net::TcpListener) -> std::io::Result<()> + Send + Sync>;
type AdoptNetns = Arc<dyn Fn(std::os::fd::OwnedFd) -> std::io::Result<()> + Send + Sync>;

impl EgressAdopt {
    /// From what serves a listener and what catches a namespace's other traffic.
    pub fn new(
        listen: impl Fn(std::net::TcpListener) -> std::io::Result<()> + Send + Sync + 'static,
        catch: impl Fn(std::os::fd::OwnedFd) -> std::io::Result<()> + Send + Sync + 'static,
    ) -> Self {
        Self {
            listen: Arc::new(listen),
            catch: Arc::new(catch),
        }
    }

    /// Serves `listener` under the session's policy; within the Tokio runtime.
    pub fn adopt(&self, listener: std::net::TcpListener) -> std::io::Result<()> {
        (self.listen)(listener)
    }

    /// Gives the network namespace `netns` (an open `/proc/<pid>/ns/net`) a way out that
    /// leads only to the proxy's records: whatever its sandbox sends anywhere but to the
    /// proxy is refused at once and recorded as a denied connection. Blocking (it enters
    /// the namespace on a thread of its own); it needs the right to manage that namespace's
    /// network, and without it the sandbox keeps having no route, its attempts refused
    /// unseen.
    pub fn catch(&self, netns: std::os::fd::OwnedFd) -> std::io::Result<()> {
        (self.catch)(netns)
    }
}

impl std::fmt::Debug for EgressAdopt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EgressAdopt")
    }
}

impl PartialEq for EgressAdopt {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.listen, &other.listen)
    }
}

impl Eq for EgressAdopt {}

/// The variables that make a block's TLS clients trust the bundle at `path` (inside the
/// sandbox): OpenSSL's, Python's `requests` and pip's, curl's, git's and Node's.
pub fn egress_ca_env(path: &str) -> Vec<(String, String)> {
    [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "PIP_CERT",
        "GIT_SSL_CAINFO",
        "NODE_EXTRA_CA_CERTS",
    ]
    .into_iter()
    .map(|k| (k.to_owned(), path.to_owned()))
    .collect()
}

/// The port inside a sandbox where its blocks find the egress proxy (on its own loopback).
pub const EGRESS_PORT: u16 = 3128;

/// The variables that point a block's HTTP clients (curl, pip, npm, Python's and Node's)
/// at the egress proxy inside its sandbox.
pub fn egress_env() -> Vec<(String, String)> {
    let proxy = format!("http://127.0.0.1:{EGRESS_PORT}");
    let local = "localhost,127.0.0.1,::1".to_owned();
    [
        ("HTTP_PROXY", proxy.clone()),
        ("HTTPS_PROXY", proxy.clone()),
        ("http_proxy", proxy.clone()),
        ("https_proxy", proxy.clone()),
        ("NO_PROXY", local.clone()),
        ("no_proxy", local),
        ("npm_config_proxy", proxy.clone()),
        ("npm_config_https_proxy", proxy),
        ("NODE_USE_ENV_PROXY", "1".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// One code block to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecRequest {
    /// Normalised language.
    pub language: Language,
    /// The code, as the model wrote it.
    pub code: String,
    /// Overrides the session's wall-clock limit for this block.
    pub timeout: Option<Duration>,
    /// Runs in a fresh process that shares no kept interpreter and runs nothing earlier blocks
    /// left for an interpreter's start (a Python user site's `usercustomize` and `.pth` files
    /// in the workspace, which is its home): a task's check.
    pub isolated: bool,
}

impl ExecRequest {
    /// A request with the session's default timeout.
    pub fn new(language: Language, code: impl Into<String>) -> Self {
        Self {
            language,
            code: code.into(),
            timeout: None,
            isolated: false,
        }
    }

    /// The same request, run apart from what earlier blocks left for an interpreter
    /// ([`ExecRequest::isolated`]).
    #[must_use]
    pub fn isolated(mut self) -> Self {
        self.isolated = true;
        self
    }
}

/// Which stream a chunk of live output came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Receives live output while a block runs; called from the executor's reader tasks.
pub type OutputSink = Arc<dyn Fn(Stream, &[u8]) + Send + Sync>;

/// Per-run context: how to stop the run and where live output goes.
#[derive(Clone)]
pub struct ExecContext {
    /// Cancelling this kills the block at once; the outcome is [`ExitStatus::Cancelled`].
    pub cancel: CancellationToken,
    /// Live output; it sees the kept head of each stream (half of `Limits::output_bytes`).
    pub sink: OutputSink,
    /// Answers calls the block's code makes to its task's tools, where the executor can carry
    /// them ([`Executor::carries_tool_calls`]).
    pub tools: Option<ToolHandler>,
}

impl ExecContext {
    /// A context that discards live output.
    pub fn new(cancel: CancellationToken) -> Self {
        Self {
            cancel,
            sink: Arc::new(|_, _| {}),
            tools: None,
        }
    }

    /// Lets the block's code call tools, answered by `handler`.
    pub fn with_tools(mut self, handler: ToolHandler) -> Self {
        self.tools = Some(handler);
        self
    }

    /// Sends live output to `sink`.
    pub fn with_sink(mut self, sink: OutputSink) -> Self {
        self.sink = sink;
        self
    }
}

impl std::fmt::Debug for ExecContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecContext")
            .field("cancel", &self.cancel)
            .finish_non_exhaustive()
    }
}

/// How a program ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    /// It exited with this code.
    Exited(i32),
    /// A signal killed it.
    Signaled(i32),
    /// It passed its wall-clock limit and was killed.
    TimedOut,
    /// It ran out of memory and was killed.
    OutOfMemory,
    /// The run was cancelled and the program killed.
    Cancelled,
}

/// The result of running one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecOutcome {
    /// How it ended.
    pub status: ExitStatus,
    /// Captured standard output.
    pub stdout: Captured,
    /// Captured standard error.
    pub stderr: Captured,
    /// Wall time from start to end.
    pub duration: Duration,
    /// What the block used, where the executor measures it.
    pub resources: Option<Resources>,
}

impl ExecOutcome {
    /// An outcome for a request refused before anything ran, with exit code 1 and `message`
    /// on stderr (such as a `# filename:` path outside the workspace).
    pub fn refused(message: &str) -> Self {
        let mut stderr = CaptureBuffer::new(usize::MAX);
        stderr.push(message.as_bytes());
        Self {
            status: ExitStatus::Exited(1),
            stdout: Captured::default(),
            stderr: stderr.finish(),
            duration: Duration::ZERO,
            resources: None,
        }
    }
}
