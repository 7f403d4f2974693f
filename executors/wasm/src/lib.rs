//! Tandem executor that runs Python and JavaScript as WebAssembly under wasmtime: CPython
//! 3.12 and QuickJS compiled to WASI, with no container engine at all.
//!
//! Isolation is WebAssembly's and WASI's capabilities, denied by default: the guest sees its
//! session's workspace at `/workspace` and nothing else of the host (no other files, no
//! environment, no sockets, empty stdin). Every block runs in a fresh instance with a memory
//! cap, a wall-clock timeout and an optional CPU (fuel) budget.
//!
//! Nothing slow sits on the request path: the executor owns one engine and an epoch ticker,
//! each runtime is compiled once ever and then mapped from an on-disk cache ([`ModuleSource`]),
//! and its linker and pre-instance are built once per process.

mod cache;
mod capture;
mod run;
mod ticker;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, Language, Limits,
    Session, SessionSpec,
};
use tandem_executor_kit::scratch;
use tandem_executor_kit::scratch::TempTree;
use tempfile::TempDir;
use tokio::sync::OnceCell;
use wasmtime::component::{self, Component};
use wasmtime::{Config, Engine, InstancePre, Linker, Module};
use wasmtime_wasi::p1::WasiP1Ctx;

use cache::Loaded;
pub use cache::ModuleSource;
use run::{GUEST_SUPPORT, GUEST_WORKSPACE, Guest, P2};
use ticker::Ticker;

/// Environment variable naming the directory that holds the runtimes.
pub const WASM_DIR_VAR: &str = "TANDEM_WASM_DIR";

/// The script that fetches the runtimes, named in errors.
pub const FETCH_SCRIPT: &str = "scripts/fetch-wasm-runtimes.sh";

/// Settings for the WASM executor.
#[derive(Clone, Debug)]
pub struct WasmConfig {
    /// Directory holding `python.wasm` and `quickjs.wasm` (see [`default_runtimes_dir`]).
    pub runtimes_dir: PathBuf,
    /// Directory for compiled modules (see [`default_cache_dir`]).
    pub cache_dir: PathBuf,
    /// Most linear memory a block may use, bytes; a task's lower `memory_bytes` wins.
    pub memory_bytes: u64,
    /// CPU budget per block in wasmtime fuel (about one unit per instruction); `None` for no
    /// budget. CPython's start alone burns about 250 M.
    pub fuel: Option<u64>,
    /// Which CPython runs python blocks.
    pub python: PythonProfile,
}

/// Which CPython build runs python blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PythonProfile {
    /// The snapshot when it is installed, else the stock interpreter.
    #[default]
    Auto,
    /// The stock CPython-WASI (`python.wasm`): the whole standard library, about 40 ms of
    /// interpreter start per block.
    Stock,
    /// A pre-initialised CPython component (`python-snapshot.wasm`, built by the fetch
    /// script with componentize-py): starts in milliseconds, but only the standard-library
    /// modules it preloaded exist.
    Snapshot,
}

impl WasmConfig {
    /// The defaults, with the directories found through `env` (a variable's value by name;
    /// the process's own is `|name| std::env::var_os(name)`): see [`default_runtimes_dir`]
    /// and [`default_cache_dir`].
    pub fn from_env(env: &dyn Fn(&str) -> Option<OsString>) -> Self {
        Self {
            runtimes_dir: default_runtimes_dir(env),
            cache_dir: default_cache_dir(env),
            memory_bytes: 256 << 20,
            fuel: None,
            python: PythonProfile::Auto,
        }
    }
}

/// `$TANDEM_WASM_DIR`, else `$XDG_DATA_HOME/tandem/wasm`, else `~/.local/share/tandem/wasm`.
pub fn default_runtimes_dir(env: &dyn Fn(&str) -> Option<OsString>) -> PathBuf {
    if let Some(dir) = env(WASM_DIR_VAR).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    xdg_dir(env, "XDG_DATA_HOME", ".local/share").join("tandem/wasm")
}

/// `$XDG_CACHE_HOME/tandem/wasm`, else `~/.cache/tandem/wasm`.
pub fn default_cache_dir(env: &dyn Fn(&str) -> Option<OsString>) -> PathBuf {
    xdg_dir(env, "XDG_CACHE_HOME", ".cache").join("tandem/wasm")
}

fn xdg_dir(env: &dyn Fn(&str) -> Option<OsString>, var: &str, under_home: &str) -> PathBuf {
    match env(var).filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => env("HOME")
            .map_or_else(std::env::temp_dir, PathBuf::from)
            .join(under_home),
    }
}

/// A WASI program this executor runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// CPython 3.12 with its standard library embedded (a WASI preview 1 command).
    Python,
    /// CPython 3.12 pre-initialised by componentize-py (a WASI preview 2 component).
    PythonSnapshot,
    /// QuickJS.
    QuickJs,
}

impl Runtime {
    /// Every runtime.
    pub const ALL: [Runtime; 3] = [Runtime::Python, Runtime::PythonSnapshot, Runtime::QuickJs];

    /// The language it runs.
    pub fn language(self) -> Language {
        match self {
            Self::Python | Self::PythonSnapshot => Language::python(),
            Self::QuickJs => Language::javascript(),
        }
    }

    /// Its file name in the runtimes directory.
    pub fn file_name(self) -> &'static str {
        match self {
            Self::Python => "python.wasm",
            Self::PythonSnapshot => "python-snapshot.wasm",
            Self::QuickJs => "quickjs.wasm",
        }
    }

    /// The guest's argv for running `script` (a guest path).
    fn argv(self, script: &str) -> Vec<String> {
        let argv = match self {
            Self::Python => vec!["python", "-X", "utf8", script],
            // The snapshot is told the script by its `run` export.
            Self::PythonSnapshot => vec!["python", script],
            Self::QuickJs => {
                return vec![
                    "qjs".to_owned(),
                    "--std".to_owned(),
                    "--include".to_owned(),
                    format!("{GUEST_SUPPORT}/{CHDIR_JS}"),
                    script.to_owned(),
                ];
            }
        };
        argv.into_iter().map(str::to_owned).collect()
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Whether a runtime file is installed, for `tandem doctor`.
#[derive(Clone, Debug)]
pub struct RuntimeStatus {
    /// Which runtime.
    pub runtime: Runtime,
    /// Where it is looked for.
    pub path: PathBuf,
    /// Whether the file is there.
    pub present: bool,
}

/// A runtime made ready by [`WasmExecutor::warm`].
#[derive(Clone, Debug)]
pub struct Warmed {
    /// Which runtime.
    pub runtime: Runtime,
    /// Mapped from the cache or compiled now.
    pub source: ModuleSource,
    /// How long loading took.
    pub took: Duration,
}

/// Runs python and javascript blocks as WebAssembly.
#[derive(Clone)]
pub struct WasmExecutor {
    inner: Arc<Inner>,
}

struct Inner {
    config: WasmConfig,
    engine: Engine,
    linker: Linker<Guest<WasiP1Ctx>>,
    component_linker: component::Linker<Guest<P2>>,
    ticker: Ticker,
    languages: Vec<Language>,
    /// One pre-instance per runtime, made on first use.
    prepared: [OnceCell<Arc<Prepared>>; 3],
    /// Where temporary workspaces go (see [`ROOT_PREFIX`]).
    root: PathBuf,
    /// Host directory of the [`support_files`], shown read-only to guests.
    support: PathBuf,
    /// Owns `support` when it had to be a temporary directory.
    _support_temp: Option<TempDir>,
}

/// A runtime ready to instantiate.
struct Prepared {
    pre: Pre,
    source: ModuleSource,
    took: Duration,
}

/// A compiled runtime: a core module (preview 1 command) or a component (preview 2).
enum Artifact {
    Module(Module),
    Component(Component),
}

/// A pre-instance of a core module (preview 1) or of a component (preview 2).
enum Pre {
    Module(InstancePre<Guest<WasiP1Ctx>>),
    Component(component::InstancePre<Guest<P2>>),
}

/// Files every guest loads before its block: they make `/workspace` the working directory,
/// since WASI preview 1 has no initial directory and relative paths would resolve from `/`.
fn support_files() -> [(&'static str, String); 2] {
    [
        (
            "sitecustomize.py",
            format!("import os\nos.chdir('{GUEST_WORKSPACE}')\n"),
        ),
        (CHDIR_JS, format!("os.chdir('{GUEST_WORKSPACE}');\n")),
    ]
}

/// The support file QuickJS includes before the block.
const CHDIR_JS: &str = "chdir.js";

/// Writes the support files under `cache_dir`, leaving them alone when they are already
/// there; when the cache is not writable, into a private temporary directory that lives as
/// long as the executor (returned with it).
fn support_dir(cache_dir: &Path) -> Result<(PathBuf, Option<TempDir>), ExecError> {
    let write = |dir: &Path| -> std::io::Result<()> {
        for (name, contents) in support_files() {
            let path = dir.join(name);
            if std::fs::read_to_string(&path).ok().as_deref() != Some(contents.as_str()) {
                cache::write_atomic(&path, contents.as_bytes())?;
            }
        }
        Ok(())
    };
    let preferred = cache_dir.join("support-1");
    match write(&preferred) {
        Ok(()) => Ok((preferred, None)),
        Err(e) => {
            tracing::debug!(dir = %preferred.display(), error = %e, "using a temporary directory for the WASM support files");
            let temp = tempfile::Builder::new()
                .prefix("tandem-support-")
                .tempdir()
                .and_then(|temp| write(temp.path()).map(|()| temp))
                .map_err(|e| ExecError::io("writing the WASM support files", e))?;
            Ok((temp.path().to_owned(), Some(temp)))
        }
    }
}

/// Whether `statuses` include an installed Python runtime.
fn python_in(statuses: &[RuntimeStatus]) -> bool {
    statuses
        .iter()
        .any(|s| s.runtime.language() == Language::python() && s.present)
}

/// Temporary workspaces live in `$TMPDIR/tandem-wasm-<pid>-<start-time>/` of their owner.
const ROOT_PREFIX: &str = "tandem-wasm-";

impl WasmExecutor {
    /// Builds the engine and linker and starts the epoch ticker; the runtimes are loaded on
    /// first use (or by [`WasmExecutor::warm`]), so a missing one only fails its language.
    pub fn new(config: WasmConfig) -> Result<Self, ExecError> {
        let mut engine_config = Config::new();
        engine_config
            .epoch_interruption(true)
            .consume_fuel(config.fuel.is_some());
        let engine = Engine::new(&engine_config)
            .map_err(|e| ExecError::Backend(format!("starting wasmtime failed: {e}")))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p1::add_to_linker_async(&mut linker, |guest: &mut Guest<WasiP1Ctx>| {
            &mut guest.wasi
        })
        .map_err(|e| ExecError::Backend(format!("linking WASI failed: {e}")))?;
        let mut component_linker = component::Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut component_linker)
            .map_err(|e| ExecError::Backend(format!("linking WASI preview 2 failed: {e}")))?;
        let (support, support_temp) = support_dir(&config.cache_dir)?;
        let ticker = Ticker::start(&engine)
            .map_err(|e| ExecError::io("starting the epoch ticker thread", e))?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                engine,
                linker,
                component_linker,
                ticker,
                languages: vec![Language::python(), Language::javascript()],
                prepared: [OnceCell::new(), OnceCell::new(), OnceCell::new()],
                root: scratch::process_root(ROOT_PREFIX),
                support,
                _support_temp: support_temp,
            }),
        })
    }

    /// The settings it runs with.
    pub fn config(&self) -> &WasmConfig {
        &self.inner.config
    }

    /// Which runtime files are installed.
    pub fn runtimes(&self) -> Vec<RuntimeStatus> {
        Runtime::ALL
            .iter()
            .map(|&runtime| {
                let path = self.inner.config.runtimes_dir.join(runtime.file_name());
                RuntimeStatus {
                    runtime,
                    present: path.is_file(),
                    path,
                }
            })
            .collect()
    }

    /// Whether a Python runtime is installed (what `auto` needs to pick this executor).
    pub fn python_present(&self) -> bool {
        python_in(&self.runtimes())
    }

    /// The runtime that runs `language` blocks under the configured Python profile.
    pub fn runtime_for(&self, language: &Language) -> Option<Runtime> {
        self.inner.runtime_for(language)
    }

    /// Loads every installed runtime now (compiling and caching it on first ever use) so no
    /// block pays for it; a daemon calls this in the background at start-up.
    pub async fn warm(&self) -> Vec<(Runtime, Result<Warmed, ExecError>)> {
        let mut warmed = Vec::new();
        for status in self.runtimes() {
            if !status.present {
                continue;
            }
            let result = self.inner.prepared(status.runtime).await.map(|p| Warmed {
                runtime: status.runtime,
                source: p.source,
                took: p.took,
            });
            warmed.push((status.runtime, result));
        }
        warmed
    }

    /// Makes sure every installed runtime is in the compiled cache, compiling it now if it is
    /// not, without keeping it loaded (an entry already there is not even opened): a daemon
    /// whose tasks may never use WASM pays neither the compile on a request nor the memory of
    /// mapped runtimes while idle.
    pub async fn precompile(&self) -> Vec<(Runtime, Result<Warmed, ExecError>)> {
        let mut compiled = Vec::new();
        for status in self.runtimes() {
            if !status.present {
                continue;
            }
            let inner = self.inner.clone();
            let runtime = status.runtime;
            let result = tokio::task::spawn_blocking(move || {
                let cache_dir = &inner.config.cache_dir;
                let started = std::time::Instant::now();
                if cache::has_entry(&inner.engine, &status.path, cache_dir)? {
                    return Ok(Warmed {
                        runtime,
                        source: ModuleSource::Cache,
                        took: started.elapsed(),
                    });
                }
                let loaded = inner.load(runtime, &status.path)?;
                Ok(Warmed {
                    runtime,
                    source: loaded.source,
                    took: loaded.took,
                })
            })
            .await
            .unwrap_or_else(|e| {
                Err(ExecError::Backend(format!(
                    "compiling a WASM runtime failed: {e}"
                )))
            });
            compiled.push((runtime, result));
        }
        compiled
    }

    /// Removes temporary workspaces that a Tandem which has since died left behind; returns
    /// how many it removed. (A WASM guest is not a process, so nothing else can be left.)
    pub fn reap_orphans() -> usize {
        scratch::reap_dead_roots(ROOT_PREFIX)
    }
}

impl Inner {
    fn runtime_for(&self, language: &Language) -> Option<Runtime> {
        match language.as_str() {
            "python" => Some(match self.config.python {
                PythonProfile::Stock => Runtime::Python,
                PythonProfile::Snapshot => Runtime::PythonSnapshot,
                PythonProfile::Auto => {
                    let snapshot = Runtime::PythonSnapshot.file_name();
                    if self.config.runtimes_dir.join(snapshot).is_file() {
                        Runtime::PythonSnapshot
                    } else {
                        Runtime::Python
                    }
                }
            }),
            "javascript" => Some(Runtime::QuickJs),
            _ => None,
        }
    }

    /// The pre-instance for `runtime`, loaded on first call; a failure is not remembered, so
    /// installing the runtime fixes the next block.
    async fn prepared(self: &Arc<Self>, runtime: Runtime) -> Result<Arc<Prepared>, ExecError> {
        let cell = &self.prepared[runtime.index()];
        cell.get_or_try_init(|| {
            let inner = self.clone();
            async move {
                tokio::task::spawn_blocking(move || inner.prepare(runtime))
                    .await
                    .map_err(|e| {
                        ExecError::Backend(format!("loading a WASM runtime failed: {e}"))
                    })?
            }
        })
        .await
        .cloned()
    }

    /// Loads `runtime` from `path` through the cache, as the kind of artifact it is (blocking).
    fn load(&self, runtime: Runtime, path: &Path) -> Result<Loaded<Artifact>, ExecError> {
        let cache_dir = &self.config.cache_dir;
        Ok(match runtime {
            Runtime::PythonSnapshot => {
                cache::load::<Component>(&self.engine, path, cache_dir)?.map(Artifact::Component)
            }
            Runtime::Python | Runtime::QuickJs => {
                cache::load::<Module>(&self.engine, path, cache_dir)?.map(Artifact::Module)
            }
        })
    }

    fn prepare(&self, runtime: Runtime) -> Result<Arc<Prepared>, ExecError> {
        let path = self.config.runtimes_dir.join(runtime.file_name());
        if !path.is_file() {
            return Err(ExecError::Unavailable {
                what: format!(
                    "the WASM {} runtime ({})",
                    runtime.language(),
                    path.display()
                ),
                hint: format!(
                    "run {FETCH_SCRIPT} to install it, or set {WASM_DIR_VAR} to a directory that holds {}",
                    runtime.file_name()
                ),
            });
        }
        let link_err = |e: wasmtime::Error| {
            ExecError::Backend(format!(
                "{} cannot be linked against WASI: {e}",
                path.display()
            ))
        };
        let Loaded {
            artifact,
            source,
            took,
        } = self.load(runtime, &path)?;
        let pre = match artifact {
            Artifact::Component(c) => Pre::Component(
                self.component_linker
                    .instantiate_pre(&c)
                    .map_err(link_err)?,
            ),
            Artifact::Module(m) => Pre::Module(self.linker.instantiate_pre(&m).map_err(link_err)?),
        };
        tracing::info!(
            runtime = runtime.file_name(),
            ?source,
            ms = took.as_millis() as u64,
            "WASM runtime loaded"
        );
        Ok(Arc::new(Prepared { pre, source, took }))
    }
}

impl Executor for WasmExecutor {
    fn name(&self) -> &str {
        "wasm"
    }

    fn network(&self) -> bool {
        // WASI preview 1 has no sockets, and no socket is granted.
        false
    }

    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        let statuses = self.runtimes();
        let python = python_in(&statuses);
        let missing: Vec<String> = statuses
            .iter()
            .filter(|r| !r.present)
            .map(|r| r.path.display().to_string())
            .collect();
        Box::pin(async move {
            match (python, missing.is_empty()) {
                (_, true) => Ok(()),
                (true, false) => Err(format!(
                    "degraded: {} missing; run {FETCH_SCRIPT}",
                    missing.join(", ")
                )),
                (false, false) => Err(format!(
                    "no Python runtime ({} missing); run {FETCH_SCRIPT}",
                    missing.join(", ")
                )),
            }
        })
    }

    fn languages(&self) -> &[Language] {
        &self.inner.languages
    }

    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let session = tokio::task::spawn_blocking(move || WasmSession::create(inner, spec))
                .await
                .map_err(|e| ExecError::Backend(format!("opening a WASM session failed: {e}")))??;
            Ok(Box::new(session) as Box<dyn Session>)
        })
    }
}

/// One task's workspace; each block is a fresh instance that sees it at `/workspace`.
struct WasmSession {
    inner: Arc<Inner>,
    workspace: PathBuf,
    /// Owns the workspace when Tandem made it, so it is removed with the session.
    owned_workspace: Option<TempTree>,
    limits: Limits,
    blocks: u32,
}

impl WasmSession {
    fn create(inner: Arc<Inner>, spec: SessionSpec) -> Result<Self, ExecError> {
        let (workspace, owned_workspace) =
            scratch::open_workspace(spec.workdir, &inner.root, "workspace-")?;
        Ok(Self {
            inner,
            workspace,
            owned_workspace,
            limits: spec.limits,
            blocks: 0,
        })
    }
}

impl Session for WasmSession {
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
                ..
            } = *self;
            scratch::remove_dirs(owned_workspace.into_iter().collect(), inner.root.clone()).await
        })
    }
}
