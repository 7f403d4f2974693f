//! `tandem serve`: the daemon in the foreground.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tandem_daemon::store::PgStore;
use tandem_daemon::{Listeners, Store, Supervisor, SupervisorConfig, TaskStore};
use tandem_executor::{CancellationToken, Registry};
use tandem_executor_local::LocalExecutor;

use crate::config::{self, ExecutorSettings, FileConfig, ModelFlags, Overrides, Road, Settings};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Unix socket to listen on [default: $XDG_RUNTIME_DIR/tandem/tandem.sock, else in the state dir]
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Also listen on TCP (HOST:PORT); requests need the bearer token
    #[arg(long)]
    listen: Option<String>,
    /// Where the task database and token live [default: $XDG_STATE_HOME/tandem]
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Most tasks running at once; the rest wait in order [default: 2 x CPU cores]
    #[arg(long)]
    max_concurrent: Option<usize>,
    /// Seconds running tasks get to finish on SIGTERM before they are interrupted
    #[arg(long, default_value_t = 10.0)]
    grace: f64,
    /// Default executor for tasks that name none: auto, docker, kubernetes, wasm, local or an [executors.NAME] plugin
    #[arg(long, short = 'e', env = "TANDEM_EXECUTOR")]
    executor: Option<String>,
    /// Docker image for the docker executor
    #[arg(long, env = "TANDEM_DOCKER_IMAGE")]
    image: Option<String>,
    /// The task store: postgres://USER:PASSWORD@HOST:PORT/DATABASE for a queue several
    /// daemons share [default: [store] url, else the SQLite file in the state dir]
    #[arg(
        long = "store",
        env = "TANDEM_STORE_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    store: Option<String>,
    /// Log format on stderr: text or json
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(flatten)]
    model: ModelFlags,
}

impl ServeArgs {
    /// Whether logs are JSON lines.
    pub fn json_logs(&self) -> bool {
        self.log_format == "json"
    }
}

/// `$XDG_STATE_HOME/tandem`, else `~/.local/state/tandem`.
pub fn default_state_dir() -> PathBuf {
    crate::config::default_state_dir()
}

/// `$XDG_RUNTIME_DIR/tandem/tandem.sock`, else `tandem.sock` in the state dir.
pub fn default_socket(state_dir: &Path) -> PathBuf {
    match crate::config::runtime_dir() {
        Some(dir) => dir.join("tandem").join("tandem.sock"),
        None => state_dir.join("tandem.sock"),
    }
}

/// What the daemon tells the person who started it: plain `tandem: ...` lines on stderr, or,
/// with `--log-format json`, log records like every other line there.
#[derive(Clone, Copy)]
struct Say {
    json: bool,
}

impl Say {
    fn note(self, message: &str) {
        if self.json {
            tracing::info!("{message}");
        } else {
            line(&format!("tandem: {message}"));
        }
    }

    fn warn(self, message: &str) {
        if self.json {
            tracing::warn!("{message}");
        } else {
            line(&format!("tandem: warning: {message}"));
        }
    }
}

/// A line on stderr. `eprintln!` panics when stderr is closed (the process that started the
/// daemon is gone), which in the signal handler would leave SIGTERM unanswered; a line nobody
/// can read is dropped instead.
fn line(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{text}");
}

/// Shortest token accepted: anything shorter can be guessed over the network.
const MIN_TOKEN_CHARS: usize = 16;

/// The TCP token: `TANDEM_TOKEN`, else the token file in the state dir (made on first use,
/// when `created` is given: it is told where). An empty or short token is refused: it would
/// let anyone in.
pub fn token(state_dir: &Path, created: Option<&dyn Fn(&Path)>) -> Result<Option<String>> {
    let strong = |token: String, from: &dyn std::fmt::Display| {
        if token.chars().count() < MIN_TOKEN_CHARS {
            bail!(
                "the token in {from} is {} characters; use at least {MIN_TOKEN_CHARS} (delete the token file to have one generated)",
                token.chars().count()
            );
        }
        Ok(Some(token))
    };
    if let Some(t) = crate::config::token_from_env() {
        return strong(t, &"TANDEM_TOKEN");
    }
    let path = state_dir.join("token");
    match std::fs::read_to_string(&path) {
        Ok(t) => strong(t.trim().to_owned(), &path.display()),
        Err(_) if created.is_some() => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let token = format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            );
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("cannot write the token file {}", path.display()))?;
            f.write_all(token.as_bytes())?;
            if let Some(created) = created {
                created(&path);
            }
            Ok(Some(token))
        }
        Err(_) => Ok(None),
    }
}

/// Takes the state dir's exclusive lock (held until the daemon exits, released by the kernel
/// however it exits) and writes this daemon's pid into the lock file.
fn lock_state_dir(state_dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = state_dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    // A daemon killed a moment ago may still be letting go of it.
    let mut file = file;
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let locked = loop {
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Err((f, nix::errno::Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                file = f;
                std::thread::sleep(Duration::from_millis(50));
            }
            other => break other,
        }
    };
    match locked {
        Ok(mut lock) => {
            lock.set_len(0)?;
            lock.rewind()?;
            write!(lock, "{}", std::process::id())?;
            Ok(lock)
        }
        Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            bail!(
                "the state dir {} is in use by another tandem daemon (pid {}); stop it first, or give this one another --state-dir",
                state_dir.display(),
                holder.trim()
            )
        }
        Err((_, e)) => Err(anyhow::Error::from(e))
            .with_context(|| format!("cannot lock the state dir {}", state_dir.display())),
    }
}

/// A daemon's parts, ready for tasks, before it listens.
struct Started {
    supervisor: Arc<Supervisor>,
    state_dir: PathBuf,
    /// Held until the daemon exits: one daemon per state dir.
    _lock: nix::fcntl::Flock<std::fs::File>,
    docker: Option<crate::executors::Docker>,
    /// Its claims are deleted at shutdown, as Docker's containers are removed.
    kubernetes: Option<tandem_executor_kubernetes::KubernetesExecutor>,
    default_executor: String,
    max_concurrent: usize,
    grace: Duration,
    /// The TCP listener's bounds.
    limits: tandem_daemon::ConnLimits,
}

/// Arguments of `tandem mcp`.
#[derive(Debug, clap::Args)]
pub struct McpArgs {
    /// Where its tasks are kept [default: a temporary directory, removed on exit]
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Default executor for execute_code and run_task: auto, docker, kubernetes, wasm, local or a plugin
    #[arg(long, short = 'e', env = "TANDEM_EXECUTOR")]
    executor: Option<String>,
    /// Docker image for the docker executor
    #[arg(long, env = "TANDEM_DOCKER_IMAGE")]
    image: Option<String>,
    #[command(flatten)]
    model: ModelFlags,
}

/// `tandem mcp`: Tandem's executors and tasks as an MCP server on stdin and stdout (logs on
/// stderr), until the client goes.
pub async fn mcp(args: McpArgs, file: FileConfig) -> Result<u8> {
    let temp = match &args.state_dir {
        Some(_) => None,
        None => Some(tempfile::Builder::new().prefix("tandem-mcp-").tempdir()?),
    };
    let state_dir = args
        .state_dir
        .clone()
        .or_else(|| temp.as_ref().map(|t| t.path().to_owned()));
    let serve_args = ServeArgs {
        socket: None,
        listen: None,
        state_dir,
        max_concurrent: None,
        grace: 2.0,
        executor: args.executor,
        image: args.image,
        log_format: "text".to_owned(),
        model: args.model,
        // As `serve`: TANDEM_STORE_URL, else `[store] url`.
        store: config::store_url_env(),
    };
    let started = start(&serve_args, file, Say { json: false }).await?;
    let served = tandem_daemon::mcp::serve_stdio(started.supervisor.clone()).await;
    started.supervisor.shutdown(started.grace).await;
    if let Some(d) = started.docker {
        d.shutdown().await;
    }
    if let Some(k) = started.kubernetes {
        k.shutdown().await;
    }
    served.map_err(|e| anyhow::anyhow!("MCP over stdio: {e}"))?;
    Ok(crate::exit::DONE)
}

pub async fn serve(args: ServeArgs, file: FileConfig) -> Result<u8> {
    let say = Say {
        json: args.json_logs(),
    };
    let Started {
        supervisor,
        state_dir,
        _lock,
        docker,
        kubernetes,
        default_executor,
        max_concurrent,
        grace,
        limits,
    } = start(&args, file, say).await?;
    let socket = args
        .socket
        .clone()
        .unwrap_or_else(|| default_socket(&state_dir));
    let unix = tandem_daemon::bind_unix(&socket).await?;
    let tcp = match &args.listen {
        Some(addr) => {
            // Only where it is: logs are read by more people than the token file.
            let created = |path: &Path| {
                say.note(&format!(
                    "generated a TCP token in {} (owner-only; send it as `Authorization: Bearer <token>`)",
                    path.display()
                ));
            };
            let token = token(&state_dir, Some(&created))?.unwrap_or_default();
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?;
            Some((listener, token))
        }
        None => None,
    };
    tracing::info!(
        socket = %socket.display(),
        tcp = args.listen.as_deref().unwrap_or("off"),
        state_dir = %state_dir.display(),
        executor = %default_executor,
        max_concurrent,
        "tandem daemon ready"
    );
    if !say.json {
        // The JSON log has the same in its "ready" record.
        say.note(&format!(
            "serving on unix://{}{} (executor {default_executor}, {max_concurrent} at once)",
            socket.display(),
            args.listen
                .as_deref()
                .map(|a| format!(" and tcp://{a}"))
                .unwrap_or_default()
        ));
    }

    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone(), say);
    tandem_daemon::serve(
        supervisor,
        Listeners {
            unix: Some(unix),
            tcp,
            limits,
        },
        tandem_daemon::api::DEFAULT_BODY_LIMIT,
        grace,
        shutdown,
    )
    .await
    .context("serving failed")?;
    if let Some(d) = docker {
        d.shutdown().await;
    }
    if let Some(k) = kubernetes {
        k.shutdown().await;
    }
    let _ = std::fs::remove_file(&socket);
    tracing::info!("tandem daemon stopped");
    Ok(crate::exit::DONE)
}

/// The task store the settings name (`--store`, `TANDEM_STORE_URL`, `[store] url`, else the
/// SQLite file in the state dir), this daemon's name on it, and its lease.
fn open_store(
    args: &ServeArgs,
    file: &FileConfig,
    state_dir: &Path,
) -> Result<(Arc<dyn TaskStore>, String, Duration)> {
    let lease = match file.store.lease_secs {
        Some(secs) if !(1.0..=3600.0).contains(&secs) => {
            bail!("[store] lease_secs must be between 1 and 3600 (it is {secs})")
        }
        Some(secs) => Duration::from_secs_f64(secs),
        None => Duration::from_secs(30),
    };
    let daemon = match &file.store.daemon {
        Some(name) if name.trim().is_empty() || name.contains(char::is_whitespace) => {
            bail!("[store] daemon must be a name without spaces (it is {name:?})")
        }
        Some(name) => name.clone(),
        None => default_daemon_name(state_dir),
    };
    // The flag, then the environment (clap reads both into `args.store`), then the file.
    let from_env = config::store_url_env();
    let (url, setting) = match (&args.store, &file.store.url) {
        (Some(url), _) if from_env.as_deref() == Some(url.as_str()) => {
            (Some(url), "TANDEM_STORE_URL")
        }
        (Some(url), _) => (Some(url), "--store"),
        (None, Some(url)) => (Some(url), "[store] url in tandem.toml"),
        (None, None) => (None, ""),
    };
    let store: Arc<dyn TaskStore> = match url {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            if setting == "--store" && crate::store::has_password(url) {
                bail!(
                    "--store carries a password, which every process on this host can read in the daemon's command line; give the URL without it and the password in [store] password_file, PGPASSWORD or ~/.pgpass, or the whole URL in TANDEM_STORE_URL"
                );
            }
            let secrets = crate::store::secrets(file.store.password_file.as_deref())?;
            let store =
                PgStore::open(url, setting, &secrets).context("cannot open the task database")?;
            tracing::info!(store = store.shown(), daemon = %daemon, "tasks are kept in PostgreSQL");
            Arc::new(store)
        }
        // Not the text itself: it may carry a password.
        Some(_) => bail!(
            "{setting} is not a postgres:// URL; write it as postgres://USER:PASSWORD@HOST:PORT/DATABASE, or leave it out to keep tasks in the SQLite file in the state dir"
        ),
        None => Arc::new(
            Store::open(&state_dir.join("tandem.db")).context("cannot open the task database")?,
        ),
    };
    Ok((store, daemon, lease))
}

/// The host's name and a hash of the state dir: the same across a daemon's restarts, and
/// different for two daemons on one host.
fn default_daemon_name(state_dir: &Path) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tandem".to_owned());
    let dir = state_dir
        .canonicalize()
        .unwrap_or_else(|_| state_dir.to_owned());
    // FNV-1a: stable across builds, unlike the standard library's hasher.
    let hash = dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
        });
    format!("{host}-{:08x}", hash as u32)
}

/// Everything up to listening: the state dir locked, the store open, the executors, policy,
/// defaults and model resolved, what a dead daemon left reaped, and its tasks recovered.
async fn start(args: &ServeArgs, file: FileConfig, say: Say) -> Result<Started> {
    let settings = Settings::resolve(
        file,
        &Overrides {
            executor: args.executor.as_deref(),
            image: args.image.as_deref(),
            model: &args.model,
            road: Road::Daemon,
        },
    );
    // A daemon uses every part: a mistake in one is told now, before anything slow starts.
    settings.model.get()?;
    settings.teams.get()?;
    settings.defaults.get()?;
    let file = &settings.file;
    harden()?;
    let state_dir = state_dir(args)?;
    // One daemon per state dir: a second one would mark the first one's tasks interrupted.
    let _lock = lock_state_dir(&state_dir)?;
    let grace = config::secs_to_duration(args.grace, "--grace")?;
    let max_concurrent = match args.max_concurrent {
        Some(0) => bail!("--max-concurrent must be at least 1"),
        Some(n) => n,
        None => 2 * std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    // Read before anything slow starts, so a mistake in them is told at once.
    let sessions = config::sessions(file, max_concurrent)?;
    let files = std::sync::Arc::new(
        tandem_daemon::files::Files::new(config::files(file, &state_dir)?)
            .with_context(|| format!("cannot make the files dir in {}", state_dir.display()))?,
    );
    let limits = config::conn_limits(file)?;
    let (store, daemon, lease) = open_store(args, file, &state_dir)?;
    let offered = executors(&settings.executors, say).await?;
    // A cap for an executor the daemon does not have is a typo that would cap nothing.
    for name in sessions.per_executor.keys() {
        offered.registry.get(name).with_context(|| {
            format!("[sessions.executors] names `{name}`, which this daemon does not have")
        })?;
    }
    let policy = policy(file, &offered, say)?;
    if let Some(d) = &offered.docker
        && offered.default == "docker"
    {
        d.warm_up();
    }
    let local = model(&settings, say).await?;
    let mut planner = crate::planner::config(
        &settings,
        offered.registry,
        offered.default.clone(),
        policy,
        local,
    )
    .await?;
    files.volumes().mount_all();
    planner.volumes = Some(files.volumes().clone());
    let supervisor = Supervisor::new(
        store,
        SupervisorConfig {
            planner,
            max_concurrent,
            sessions,
            files,
            daemon,
            lease,
            pausing: config::pausing(file)?,
        },
    );
    recover(&supervisor).await?;
    Ok(Started {
        supervisor,
        state_dir,
        _lock,
        docker: offered.docker,
        kubernetes: offered.kubernetes,
        default_executor: offered.default,
        max_concurrent,
        grace,
        limits,
    })
}

/// Keeps what the daemon holds from code that runs as its user, and its descriptors from
/// running out.
fn harden() -> Result<()> {
    // The daemon holds the model's API key (in its environment) and the token: code running
    // as the same user (the local executor) must not read them from /proc/<daemon>/environ,
    // mem or fd. A non-dumpable process's /proc entries belong to root.
    nix::sys::prctl::set_dumpable(false).context("cannot make the daemon non-dumpable")?;
    // TCP connections are capped well below the hard limit ([server] max_connections), so
    // with the soft limit raised to it the Unix socket, the store and sandboxes keep
    // descriptors whatever a TCP peer holds.
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
    Ok(())
}

/// The state dir, made and kept to the user alone: transcripts, the token and the socket
/// live there.
fn state_dir(args: &ServeArgs) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("cannot create the state dir {}", state_dir.display()))?;
    std::fs::set_permissions(&state_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot restrict the state dir {}", state_dir.display()))?;
    Ok(state_dir)
}

/// The executors a daemon has, and which one tasks get when they name none.
struct Offered {
    registry: Registry,
    /// The executor tasks get by default (`auto` decided).
    default: String,
    /// What the operator named (`auto`, or an executor).
    named: String,
    docker: Option<crate::executors::Docker>,
    kubernetes: Option<tandem_executor_kubernetes::KubernetesExecutor>,
}

/// Every executor the daemon can offer; `auto` decides the default once, at start.
async fn executors(settings: &ExecutorSettings, say: Say) -> Result<Offered> {
    let mut registry = Registry::new();
    registry.register(Arc::new(LocalExecutor::new(settings.local.get()?.clone())));
    let docker = settings.docker.get()?;
    let connected = crate::executors::Docker::connect(docker, Some(docker.pool_size)).await;
    // A bad `[executors.wasm]` is a configuration error, not an executor that is missing.
    let wasm = tandem_executor_wasm::WasmExecutor::new(settings.wasm.get()?.clone())
        .map_err(anyhow::Error::from);
    let named = settings.default.clone();
    let default = match named.as_str() {
        "auto" => match crate::executors::why_not_docker(connected.as_ref()).await {
            None => "docker".to_owned(),
            Some(why) => {
                let (name, why) = crate::executors::without_docker(why, wasm.as_ref());
                if name == "local" {
                    say.warn(&format!(
                        "no sandbox is available here ({why}); tasks default to the local executor"
                    ));
                } else {
                    tracing::info!(executor = name, %why, "default executor chosen");
                }
                name.to_owned()
            }
        },
        other => other.to_owned(),
    };
    match wasm {
        Ok(wasm) => {
            registry.register(Arc::new(wasm.clone()));
            warm_wasm(wasm, default == "wasm");
        }
        Err(e) => tracing::warn!(error = %e, "the wasm executor is not available"),
    }
    let docker = match connected {
        Ok(d) => {
            registry.register(d.executor());
            Some(d)
        }
        Err(e) => {
            tracing::info!(error = %e, "the docker executor is not available");
            None
        }
    };
    let kubernetes = others(&mut registry, settings, say).await?;
    registry.get(&default)?;
    Ok(Offered {
        registry,
        default,
        named,
        docker,
        kubernetes,
    })
}

/// Compiles the WASM runtimes (once per machine) now, which keeps it off every task's path;
/// they are kept loaded (`load`) only when tasks default to wasm, since that costs memory.
fn warm_wasm(wasm: tandem_executor_wasm::WasmExecutor, load: bool) {
    tokio::spawn(async move {
        let results = if load {
            wasm.warm().await
        } else {
            wasm.precompile().await
        };
        for (runtime, result) in results {
            if let Err(e) = result {
                tracing::warn!(runtime = runtime.file_name(), error = %e, "a WASM runtime cannot be loaded");
            }
        }
    });
}

/// The Kubernetes executor and the plugins the operator configured; the Kubernetes executor
/// again, for shutdown.
async fn others(
    registry: &mut Registry,
    settings: &ExecutorSettings,
    say: Say,
) -> Result<Option<tandem_executor_kubernetes::KubernetesExecutor>> {
    // A configured cluster that does not answer is left out, as an unreachable Docker engine
    // is, but said aloud: the operator asked for it.
    let mut kubernetes = None;
    if settings.kubernetes.get()?.is_some() {
        match crate::executors::kubernetes(settings).await {
            Ok(k) => {
                registry.register(Arc::new(k.clone()));
                kubernetes = Some(k);
            }
            Err(e) => say.warn(&format!("executor `kubernetes` is not available: {e:#}")),
        }
    }
    // A plugin that names no languages in the config is started now to ask for them; one
    // that cannot start is left out, as an unreachable Docker engine is.
    for name in settings.plugins.keys() {
        match crate::executors::plugin(name, settings).await {
            Ok(Some(plugin)) => {
                registry.register(Arc::new(plugin));
            }
            Ok(None) => {}
            Err(e) => say.warn(&format!("executor `{name}` is not available: {e:#}")),
        }
    }
    Ok(kubernetes)
}

/// What API clients may ask for, checked against the executors the daemon has; what is
/// risky or odd in it said aloud.
fn policy(file: &FileConfig, offered: &Offered, say: Say) -> Result<tandem_daemon::policy::Policy> {
    let mut policy = config::policy(file)?;
    for name in policy.executors.iter().flatten() {
        offered.registry.get(name).with_context(|| {
            format!("[policy] executors names `{name}`, which this daemon does not have")
        })?;
    }
    // Naming `local` as the tasks' executor (not `auto` landing on it) is the operator's
    // choice to offer it.
    if policy.executors.is_none() && offered.named == tandem_daemon::policy::LOCAL {
        policy.executors = Some(
            offered
                .registry
                .names()
                .into_iter()
                .map(str::to_owned)
                .collect(),
        );
    }
    if policy.offers(tandem_daemon::policy::LOCAL) {
        say.warn(
            "API clients may use the local executor, which is not a security boundary: its code runs as this daemon's user and can read the daemon's files (its store and token among them)",
        );
    }
    if !policy.offers(&offered.default) {
        say.warn(&policy.not_offered(&offered.default, &offered.registry));
    }
    Ok(policy)
}

/// The model tasks get when they name no model server; an embedded one is loaded once here
/// and shared by every task.
async fn model(
    settings: &Settings,
    say: Say,
) -> Result<Option<(Arc<dyn tandem_agent::chat::LocalModel>, String)>> {
    let local_model = match crate::provider::choose(&settings.provider) {
        Ok(crate::provider::Provider::Embedded { name, path }) => {
            let loaded = match crate::provider::load(&name, path.clone(), &settings.provider).await
            {
                Ok(loaded) => loaded,
                Err(e) => {
                    // The daemon stays up for what does not need the model (tasks that name
                    // a server, reads, files); the tasks that do fail with this reason.
                    say.warn(&format!(
                        "{e:#}; tasks that name no model server fail until the model is fixed and the daemon restarted"
                    ));
                    let broken = crate::provider::Unloadable::new(&name, &format!("{e:#}"));
                    return Ok(Some((Arc::new(broken), name)));
                }
            };
            let draft = crate::provider::draft(&settings.provider)?
                .map(|d| format!(", drafting with {}", d.display()))
                .unwrap_or_default();
            say.note(&format!(
                "model: {name}, embedded ({}{draft}); tasks that name no model server use it",
                path.display()
            ));
            Some((loaded, name))
        }
        Ok(crate::provider::Provider::Server) => None,
        Err(e) if settings.provider.asked.as_deref() == Some("embedded") => {
            // The embedded model was asked for and its file is not there: its tasks fail
            // with that reason, not with a server's that nobody named.
            say.warn(&format!(
                "{e:#}; tasks that name no model server fail until the model is fixed and the daemon restarted"
            ));
            let name = settings
                .provider
                .named
                .clone()
                .unwrap_or_else(|| "(none pulled)".to_owned());
            let broken = crate::provider::Unloadable::new(&name, &format!("{e:#}"));
            Some((
                Arc::new(broken) as Arc<dyn tandem_agent::chat::LocalModel>,
                name,
            ))
        }
        Err(e) => {
            say.warn(&format!(
                "{e:#}; tasks fail until a client names a model server"
            ));
            None
        }
    };
    Ok(local_model)
}

/// Removes the sandboxes a crashed daemon left (local blocks, local, WASM and plugin
/// workspaces; docker containers were reaped when the docker executor connected), takes its
/// tasks back, and starts the retention.
async fn recover(supervisor: &Arc<Supervisor>) -> Result<()> {
    let reaped = tokio::task::spawn_blocking(|| {
        LocalExecutor::reap_orphans()
            + tandem_executor_wasm::WasmExecutor::reap_orphans()
            + tandem_executor_plugin::PluginExecutor::reap_orphans()
    })
    .await
    .unwrap_or(0);
    if reaped > 0 {
        tracing::info!(
            reaped,
            "removed local processes and workspaces left by a Tandem that died"
        );
    }
    let interrupted = supervisor.recover().await?;
    supervisor.keep_files_tidy();
    if interrupted > 0 {
        tracing::info!(
            interrupted,
            "tasks the last daemon left running are interrupted"
        );
    }
    Ok(())
}

/// SIGTERM or SIGINT starts a graceful shutdown; a second one exits at once.
fn spawn_signal_handler(shutdown: CancellationToken, say: Say) {
    use tokio::signal::unix::{SignalKind, signal};
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        say.note("shutting down (again to quit at once)");
        shutdown.cancel();
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        std::process::exit(i32::from(crate::exit::CANCELLED));
    });
}
