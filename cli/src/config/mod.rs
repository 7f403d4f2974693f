//! Settings resolved once per command, in this order: flags, then environment, then
//! `tandem.toml`, then defaults, into one [`Settings`] (or, for a command that runs code but
//! no task, [`ExecutorSettings`]). Every environment variable Tandem reads is read here;
//! commands read the resolved fields and resolve nothing themselves.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tandem_agent::ModelConfig;
use tandem_daemon::TaskDefaults;
use tandem_executor::{Language, Limits};
use tandem_executor_docker::DockerConfig;
use tandem_executor_local::LocalConfig;
use tandem_executor_plugin::PluginConfig;
use tandem_executor_wasm::{PythonProfile, WasmConfig};

mod file;
mod settings;

pub use file::*;
pub use settings::*;

/// Tandem's directory under the XDG base directory `var`, else under `~/{under_home}`.
pub(crate) fn xdg_dir(var: &str, under_home: &str) -> Option<PathBuf> {
    let base = std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(under_home)))?;
    Some(base.join("tandem"))
}

/// `$XDG_STATE_HOME/tandem`, else `~/.local/state/tandem`: the daemon's state dir, and where
/// the egress proxy's CA is kept by default.
pub fn default_state_dir() -> PathBuf {
    xdg_dir("XDG_STATE_HOME", ".local/state").unwrap_or_else(|| std::env::temp_dir().join("tandem"))
}

/// Flags that override the model settings.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ModelFlags {
    /// Model name [env: TANDEM_MODEL; default: gpt-4o-mini]
    #[arg(long)]
    pub model: Option<String>,
    /// OpenAI-compatible API base URL [env: OPENAI_BASE_URL; default: https://api.openai.com/v1]
    #[arg(long)]
    pub base_url: Option<String>,
    /// Wait for whole replies instead of streaming tokens
    #[arg(long)]
    pub no_stream: bool,
}

/// The editor for an edited block: `VISUAL`, else `EDITOR`, else `vi`.
pub(crate) fn editor() -> String {
    env("VISUAL")
        .or_else(|| env("EDITOR"))
        .unwrap_or_else(|| "vi".to_owned())
}

/// `TANDEM_TOKEN`, the TCP token, when set.
pub(crate) fn token_from_env() -> Option<String> {
    env("TANDEM_TOKEN")
}

/// `XDG_RUNTIME_DIR`, when set.
pub(crate) fn runtime_dir() -> Option<PathBuf> {
    env("XDG_RUNTIME_DIR").map(PathBuf::from)
}

/// Whether `NO_COLOR` asks for no colour (set at all, as no-color.org says).
pub(crate) fn no_color() -> bool {
    std::env::var_os("NO_COLOR").is_some()
}

/// What the terminal says of itself (`TERM`, `TERM_PROGRAM`, `LC_TERMINAL`,
/// `KITTY_WINDOW_ID`, `TMUX`) and `TANDEM_PICTURES`, for pictures shown inline.
pub(crate) fn terminal() -> crate::picture::Terminal {
    crate::picture::Terminal {
        asked: env("TANDEM_PICTURES").unwrap_or_default(),
        term: env("TERM").unwrap_or_default(),
        program: env("TERM_PROGRAM").unwrap_or_default(),
        lc_terminal: env("LC_TERMINAL").unwrap_or_default(),
        kitty: env("KITTY_WINDOW_ID").is_some(),
        tmux: env("TMUX").is_some(),
    }
}

/// `TANDEM_STORE_URL`, which `serve` also takes as `--store` through clap; read here to say
/// which of the two named the store, and for `tandem mcp`, which has no flag for it.
pub(crate) fn store_url_env() -> Option<String> {
    env("TANDEM_STORE_URL")
}

/// `PGPASSWORD`, libpq's password for the store when neither its URL nor `[store]
/// password_file` gives one.
pub(crate) fn pg_password_env() -> Option<String> {
    env("PGPASSWORD")
}

/// libpq's password file: `PGPASSFILE`, else `~/.pgpass`.
pub(crate) fn pg_pass_file() -> Option<PathBuf> {
    std::env::var_os("PGPASSFILE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pgpass")))
}

/// A variable's value; unset and empty are the same.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The model settings: flags, then `TANDEM_MODEL`/`OPENAI_BASE_URL`/`OPENAI_API_KEY`, then the file.
fn model_config(flags: &ModelFlags, file: &FileConfig) -> Result<ModelConfig> {
    let defaults = ModelConfig::default();
    let m = &file.model;
    let max_retries = match env("TANDEM_MAX_RETRIES") {
        Some(v) => v
            .parse()
            .with_context(|| format!("TANDEM_MAX_RETRIES=`{v}` is not a whole number"))?,
        None => m.max_retries.unwrap_or(defaults.max_retries),
    };
    Ok(ModelConfig {
        base_url: flags
            .base_url
            .clone()
            .or_else(|| env("OPENAI_BASE_URL"))
            .or_else(|| m.base_url.clone())
            .unwrap_or(defaults.base_url),
        api_key: env("OPENAI_API_KEY").or_else(|| m.api_key.clone()),
        model: model_named(flags, file).unwrap_or(defaults.model),
        stream: !flags.no_stream && m.stream.unwrap_or(true),
        max_retries,
        temperature: m.temperature,
        max_tokens: m.max_tokens,
        seed: m.seed,
        stop: m.stop.clone().unwrap_or_default(),
        max_reply_bytes: match m.max_reply_bytes {
            Some(0) => bail!("[model] max_reply_bytes must be at least 1"),
            Some(n) => n,
            None => defaults.max_reply_bytes,
        },
        tool_required: match m.tool_choice.as_deref() {
            None | Some("auto") => false,
            Some("required") => true,
            Some(other) => bail!("[model] tool_choice must be auto or required, got `{other}`"),
        },
        ..defaults
    })
}

/// The model named by the flags, `TANDEM_MODEL` or the file, if any.
fn model_named(flags: &ModelFlags, file: &FileConfig) -> Option<String> {
    flags
        .model
        .clone()
        .or_else(|| env("TANDEM_MODEL"))
        .or_else(|| file.model.model.clone())
}

/// Whether a model server is named anywhere: a base URL or an API key, in the flags, the
/// environment or the file.
fn server_named(flags: &ModelFlags, file: &FileConfig) -> bool {
    let m = &file.model;
    flags.base_url.is_some()
        || env("OPENAI_BASE_URL").is_some()
        || m.base_url.is_some()
        || env("OPENAI_API_KEY").is_some()
        || m.api_key.is_some()
}

/// The models directory: `TANDEM_MODELS_DIR`, then `[model] models_dir`, then the cache.
pub fn models_dir(file: &FileConfig) -> Result<PathBuf> {
    env("TANDEM_MODELS_DIR")
        .map(PathBuf::from)
        .or_else(|| file.model.models_dir.clone())
        .or_else(|| Some(xdg_dir("XDG_CACHE_HOME", ".cache")?.join("models")))
        .context(
            "no models directory: set TANDEM_MODELS_DIR (neither XDG_CACHE_HOME nor HOME is set)",
        )
}

/// The Hugging Face hub's endpoint: `HF_ENDPOINT`, as the hub's own clients read it.
pub fn hub_endpoint() -> String {
    env("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".to_owned())
}

/// The caps on open sandbox sessions, from `[sessions]`, for a daemon running
/// `max_concurrent` tasks at once.
pub fn sessions(
    file: &FileConfig,
    max_concurrent: usize,
) -> Result<tandem_executor_kit::BudgetConfig> {
    let s = &file.sessions;
    let max = match s.max {
        Some(0) => bail!("[sessions] max must be at least 1"),
        Some(n) => n,
        None => max_concurrent.saturating_mul(4),
    };
    let wait = match s.wait_secs {
        Some(0) => bail!("[sessions] wait_secs must be at least 1"),
        Some(n) => Duration::from_secs(n),
        None => Duration::from_secs(120),
    };
    if let Some((name, _)) = s.executors.iter().find(|(_, n)| **n == 0) {
        bail!("[sessions.executors] {name} must be at least 1");
    }
    // Tasks keep a sandbox each for as many as run at once, whatever clients hold.
    let without_task = match s.without_task {
        Some(0) => bail!("[sessions] without_task must be at least 1"),
        Some(n) if n > max => {
            bail!(
                "[sessions] without_task is {n}, more than [sessions] max ({max}); give at most {max}"
            )
        }
        Some(n) => n,
        None => max.saturating_sub(max_concurrent).max(1),
    };
    let mut config = tandem_executor_kit::BudgetConfig::new(max, wait);
    config.per_executor = s.executors.clone();
    config.without_task = Some(without_task);
    Ok(config)
}

/// When idle sessions are paused, from `[sessions]`.
pub fn pausing(file: &FileConfig) -> Result<tandem_daemon::policy::Pausing> {
    let s = &file.sessions;
    let mut pausing = tandem_daemon::policy::Pausing::default();
    match s.pause_after_secs {
        Some(0) => bail!("[sessions] pause_after_secs must be at least 1"),
        Some(n) => pausing.after = Some(Duration::from_secs(n)),
        None => {}
    }
    match s.paused_keep_secs {
        Some(0) => bail!("[sessions] paused_keep_secs must be at least 1"),
        Some(_) if s.pause_after_secs.is_none() => {
            bail!(
                "[sessions] paused_keep_secs is set but pause_after_secs is not; set both, or neither"
            )
        }
        Some(n) => pausing.keep = Duration::from_secs(n),
        None => {}
    }
    Ok(pausing)
}

/// Where a daemon keeps tasks' files and for how long, from `[files]`.
pub fn files(file: &FileConfig, state_dir: &Path) -> Result<tandem_daemon::files::FilesConfig> {
    let f = &file.files;
    let positive = |key: &str, value: Option<u64>, default: u64| match value {
        Some(0) => bail!("[files] {key} must be at least 1"),
        Some(n) => Ok(n),
        None => Ok(default),
    };
    let mb = |n: u64| n.saturating_mul(1 << 20);
    let entries = match f.max_upload_files {
        Some(0) => bail!("[files] max_upload_files must be at least 1"),
        Some(n) => n,
        None => tandem_executor_kit::archive::ArchiveCaps::default().max_entries,
    };
    Ok(tandem_daemon::files::FilesConfig {
        root: f.dir.clone().unwrap_or_else(|| state_dir.join("files")),
        keep: Duration::from_secs(positive("keep_secs", f.keep_secs, 7 * 24 * 3600)?),
        max_total_bytes: mb(positive("max_total_mb", f.max_total_mb, 10240)?),
        max_task_bytes: mb(positive("max_task_mb", f.max_task_mb, 1024)?),
        upload: tandem_executor_kit::archive::ArchiveCaps {
            max_bytes: mb(positive("max_upload_mb", f.max_upload_mb, 256)?),
            max_entries: entries,
        },
        snapshots: snapshots(file)?,
    })
}

/// What the snapshots may hold, from `[snapshots]`.
fn snapshots(file: &FileConfig) -> Result<tandem_snapshots::Caps> {
    let s = &file.snapshots;
    let defaults = tandem_snapshots::Caps::default();
    let positive = |key: &str, value: Option<u64>, default: u64| match value {
        Some(0) => bail!("[snapshots] {key} must be at least 1"),
        Some(n) => Ok(n),
        None => Ok(default),
    };
    Ok(tandem_snapshots::Caps {
        max_count: usize::try_from(positive(
            "max_count",
            s.max_count,
            defaults.max_count as u64,
        )?)
        .unwrap_or(usize::MAX),
        max_bytes: positive("max_mb", s.max_mb, defaults.max_bytes >> 20)?.saturating_mul(1 << 20),
        max_entries: defaults.max_entries,
    })
}

/// How large a team may be, from `[teams]`, within the ceilings that keep checking it safe.
pub fn teams(file: &FileConfig) -> Result<tandem_protocol::team::TeamBounds> {
    use tandem_protocol::team::TeamBounds;
    let t = file.teams;
    for (key, value, ceiling) in [
        ("max_depth", t.max_depth, TeamBounds::DEPTH_CEILING),
        ("max_agents", t.max_agents, TeamBounds::AGENTS_CEILING),
        ("max_parallel", t.max_parallel, TeamBounds::AGENTS_CEILING),
    ] {
        if !(1..=ceiling).contains(&value) {
            bail!("[teams] {key} is {value}; give a number from 1 to {ceiling}");
        }
    }
    Ok(t)
}

/// The TCP listener's bounds, from `[server]`.
pub fn conn_limits(file: &FileConfig) -> Result<tandem_daemon::ConnLimits> {
    let s = &file.server;
    let defaults = tandem_daemon::ConnLimits::default();
    let at_least_one = |value: Option<u64>, key: &str, default: u64| match value {
        Some(0) => bail!("[server] {key} must be at least 1"),
        Some(n) => Ok(n),
        None => Ok(default),
    };
    let count = |value: Option<usize>, key: &str, default: usize| {
        at_least_one(value.map(|n| n as u64), key, default as u64)
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    };
    Ok(tandem_daemon::ConnLimits {
        header_timeout: Duration::from_secs(at_least_one(
            s.header_timeout_secs,
            "header_timeout_secs",
            defaults.header_timeout.as_secs(),
        )?),
        max_connections: count(
            s.max_connections,
            "max_connections",
            defaults.max_connections,
        )?,
        max_unauthenticated: count(
            s.max_unauthenticated,
            "max_unauthenticated",
            defaults.max_unauthenticated,
        )?,
    })
}

/// The daemon's policy for API clients, from `[policy]`.
pub fn policy(file: &FileConfig) -> Result<tandem_daemon::Policy> {
    use tandem_daemon::policy;
    let p = &file.policy;
    let secs = |value: Option<u64>, key: &str, default: Duration| match value {
        Some(0) => bail!("[policy] {key} must be at least 1"),
        Some(n) => Ok(Duration::from_secs(n)),
        None => Ok(default),
    };
    let endpoints = p
        .model_endpoints
        .iter()
        .map(|e| {
            if !(e.base_url.starts_with("http://") || e.base_url.starts_with("https://")) {
                bail!(
                    "[[policy.model_endpoints]] base_url `{}` must start with http:// or https://",
                    e.base_url
                );
            }
            let api_key = match (&e.api_key, &e.api_key_env) {
                (Some(_), Some(_)) => bail!(
                    "[[policy.model_endpoints]] {}: give api_key or api_key_env, not both",
                    e.base_url
                ),
                (Some(key), None) => Some(key.clone()),
                (None, Some(var)) => Some(env(var).with_context(|| {
                    format!(
                        "[[policy.model_endpoints]] {}: the environment variable {var} named by api_key_env is not set",
                        e.base_url
                    )
                })?),
                (None, None) => None,
            };
            Ok(tandem_daemon::Endpoint {
                base_url: e.base_url.trim_end_matches('/').to_owned(),
                api_key,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(tandem_daemon::Policy {
        executors: p.executors.clone(),
        endpoints,
        max_timeout: secs(
            p.max_timeout_secs,
            "max_timeout_secs",
            policy::DEFAULT_MAX_TIMEOUT,
        )?,
        max_block_timeout: secs(
            p.max_block_timeout_secs,
            "max_block_timeout_secs",
            policy::DEFAULT_MAX_BLOCK_TIMEOUT,
        )?,
        max_turns: match p.max_turns {
            Some(0) => bail!("[policy] max_turns must be at least 1"),
            Some(n) => n,
            None => policy::DEFAULT_MAX_TURNS,
        },
        max_candidates: match p.max_candidates {
            Some(0) => bail!("[policy] max_candidates must be at least 1"),
            Some(n) if n > tandem_agent::team::MOST_CANDIDATES => bail!(
                "[policy] max_candidates {n} is above {}, the most replies a turn chooses among",
                tandem_agent::team::MOST_CANDIDATES
            ),
            Some(n) => n,
            None => tandem_agent::team::MOST_CANDIDATES,
        },
        any_endpoint: false,
        budget: budget(
            "[policy]",
            p.max_input_tokens,
            p.max_output_tokens,
            p.max_cost,
        )?,
    })
}

/// Budgets from a section of the file, refusing ones no task could stay within.
fn budget(
    section: &str,
    max_input_tokens: Option<u64>,
    max_output_tokens: Option<u64>,
    max_cost: Option<f64>,
) -> Result<tandem_agent::budget::Budget> {
    for (key, n) in [
        ("max_input_tokens", max_input_tokens),
        ("max_output_tokens", max_output_tokens),
    ] {
        if n == Some(0) {
            bail!("{section} {key} must be at least 1");
        }
    }
    if let Some(cost) = max_cost
        && !(cost.is_finite() && cost > 0.0)
    {
        bail!("{section} max_cost must be a number above 0, not {cost}");
    }
    Ok(tandem_agent::budget::Budget {
        max_input_tokens,
        max_output_tokens,
        max_cost,
    })
}

/// `[model.prices]`, each a price a cost can be counted with.
pub fn prices(
    file: &FileConfig,
) -> Result<std::collections::BTreeMap<String, tandem_agent::budget::Price>> {
    for (name, price) in &file.model.prices {
        if !price.is_valid() {
            bail!(
                "[model.prices.\"{name}\"]: input and output must be numbers of at least 0 (the price of a million tokens)"
            );
        }
    }
    Ok(file.model.prices.clone())
}

/// Limits from the file, with a block timeout from flags on top.
pub fn limits(file: &FileConfig, wall: Option<f64>, flag: &str) -> Result<Limits> {
    let mut limits = file.limits.clone().unwrap_or_default();
    if let Some(secs) = wall {
        limits.wall = secs_to_duration(secs, flag)?;
    }
    Ok(limits)
}

/// A daemon task's wall-clock limit when neither it nor `[task] timeout_secs` sets one.
pub const DAEMON_TASK_TIMEOUT: Duration = Duration::from_secs(1800);

/// The road a task takes, for what it gets when it does not say.
#[derive(Debug, Clone, Copy)]
pub enum Road {
    /// `tandem run` in this process, with its `--timeout` and `--block-timeout`.
    InProcess {
        /// `--timeout`, in seconds.
        timeout: Option<f64>,
        /// `--block-timeout`, in seconds.
        block_timeout: Option<f64>,
    },
    /// A daemon's task, which carries its own limits in its spec.
    Daemon,
}

/// What a task that does not say gets, on either road, its executor being `executor`. The
/// roads differ in one thing, here: a daemon's task gets [`DAEMON_TASK_TIMEOUT`] when neither
/// it nor `[task] timeout_secs` sets a limit, since nothing a client forgets may run forever
/// on a shared daemon; in process, the person at the terminal stops it.
fn task_defaults(file: &FileConfig, executor: String, road: Road) -> Result<TaskDefaults> {
    let from_file = file.task.timeout_secs.map(Duration::from_secs);
    let (timeout, block_timeout) = match road {
        Road::InProcess {
            timeout,
            block_timeout,
        } => (
            match timeout {
                Some(secs) => Some(secs_to_duration(secs, "--timeout")?),
                None => from_file,
            },
            block_timeout,
        ),
        Road::Daemon => (Some(from_file.unwrap_or(DAEMON_TASK_TIMEOUT)), None),
    };
    Ok(TaskDefaults {
        executor,
        max_turns: file.task.max_turns,
        timeout,
        termination: file
            .task
            .termination
            .clone()
            .unwrap_or_else(|| tandem_agent::DEFAULT_TERMINATION.to_owned()),
        system_prompt: match &file.task.system_prompt_file {
            Some(p) => std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the system prompt file {}", p.display()))?,
            None => tandem_agent::DEFAULT_SYSTEM_PROMPT.to_owned(),
        },
        limits: limits(file, block_timeout, "--block-timeout")?,
        code_via: file.model.code_via.unwrap_or_default(),
        budget: budget(
            "[task]",
            file.task.max_input_tokens,
            file.task.max_output_tokens,
            file.task.max_cost,
        )?,
    })
}

/// Seconds from a flag, refusing negative, zero and absurd values.
pub fn secs_to_duration(secs: f64, flag: &str) -> Result<Duration> {
    positive_secs(secs).map_err(|e| anyhow::anyhow!("{flag} {e}"))
}

/// `secs` as a duration, when it is a positive number a duration holds; else why not.
pub fn positive_secs(secs: f64) -> std::result::Result<Duration, String> {
    if secs.is_nan() || secs <= 0.0 {
        return Err(format!("must be a positive number of seconds, got {secs}"));
    }
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{secs} is too large"))
}

/// Settings for the local executor.
fn local_config(file: &FileConfig) -> Result<LocalConfig> {
    let l = &file.executors.local;
    let confine = match l.confine.as_deref() {
        None => tandem_executor_local::Confine::Auto,
        Some(text) => text
            .parse()
            .map_err(|e: String| anyhow::anyhow!("[executors.local] {e}"))?,
    };
    Ok(LocalConfig {
        python: l.python.clone(),
        node: l.node.clone(),
        path: env("PATH"),
        lang: env("LANG"),
        env: l.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        python_fork_server: l.fork_server.unwrap_or(true),
        confine,
        network: l.network == Some(NetworkSwitch::Open),
        read_paths: l.read_paths.clone(),
    })
}

/// Settings for the WASM executor: the runtimes from `TANDEM_WASM_DIR`, then the file; the
/// rest from the file over the defaults.
fn wasm_config(file: &FileConfig) -> Result<WasmConfig> {
    let w = &file.executors.wasm;
    let defaults = WasmConfig::from_env(&|k| std::env::var_os(k));
    let python = match w.python.as_deref() {
        None | Some("auto") => PythonProfile::Auto,
        Some("snapshot") => PythonProfile::Snapshot,
        Some("stock") => PythonProfile::Stock,
        Some(other) => {
            bail!("[executors.wasm] python must be auto, snapshot or stock, got `{other}`")
        }
    };
    Ok(WasmConfig {
        runtimes_dir: env(tandem_executor_wasm::WASM_DIR_VAR)
            .map(PathBuf::from)
            .or_else(|| w.runtimes_dir.clone())
            .unwrap_or(defaults.runtimes_dir),
        cache_dir: w.cache_dir.clone().unwrap_or(defaults.cache_dir),
        memory_bytes: w.memory_bytes.unwrap_or(defaults.memory_bytes),
        fuel: w.fuel.or(defaults.fuel),
        python,
    })
}

/// Names `--executor` takes besides the plugins.
pub const BUILT_IN_EXECUTORS: [&str; 5] = ["auto", "docker", "kubernetes", "local", "wasm"];

/// How to start the plugin `[executors.NAME]`; its environment is Tandem's PATH, HOME,
/// LANG, USER and TMPDIR (no keys or tokens) and its own `env`.
fn plugin_config(name: &str, section: &PluginSection) -> Result<PluginConfig> {
    if BUILT_IN_EXECUTORS.contains(&name) {
        bail!("[executors.{name}] names a built-in executor; a plugin needs a name of its own");
    }
    if section.command.first().is_none_or(String::is_empty) {
        bail!("[executors.{name}] command must name a program: command = [\"prog\", \"arg\", ...]");
    }
    let mut config = PluginConfig::new(name, section.command.clone());
    config.env = ["PATH", "HOME", "LANG", "USER", "TMPDIR"]
        .into_iter()
        .filter_map(|k| env(k).map(|v| (k.to_owned(), v)))
        .chain(section.env.iter().map(|(k, v)| (k.clone(), v.clone())))
        .collect();
    config.cwd.clone_from(&section.cwd);
    config.languages = section
        .languages
        .as_ref()
        .map(|l| l.iter().map(|n| Language::new(n)).collect());
    if let Some(secs) = section.start_timeout_secs {
        config.start_timeout =
            secs_to_duration(secs, &format!("[executors.{name}] start_timeout_secs"))?;
    }
    Ok(config)
}

/// The executor name: the flag, then `TANDEM_EXECUTOR`, then `[task] executor`, then `auto`.
fn executor_name(flag: Option<&str>, file: &FileConfig) -> String {
    // A flag filled from an empty variable by clap counts as unset, as the variable does.
    flag.filter(|f| !f.is_empty())
        .map(str::to_owned)
        .or_else(|| env("TANDEM_EXECUTOR"))
        .or_else(|| file.task.executor.clone())
        .unwrap_or_else(|| "auto".to_owned())
}

/// `ca`, `cert` and `key` together, or none of them.
fn tls_files(
    section: &str,
    ca: &Option<PathBuf>,
    cert: &Option<PathBuf>,
    key: &Option<PathBuf>,
) -> Result<Option<tandem_executor_docker::TlsFiles>> {
    match (ca, cert, key) {
        (None, None, None) => Ok(None),
        (Some(ca), Some(cert), Some(key)) => Ok(Some(tandem_executor_docker::TlsFiles {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
        })),
        _ => bail!("{section} needs all of ca, cert and key for TLS, or none of them"),
    }
}

/// `bind` or `volume`, else the default for `host`; bind only for a local socket.
fn workspace_mode(
    section: &str,
    asked: Option<&str>,
    host: &str,
) -> Result<tandem_executor_docker::WorkspaceMode> {
    use tandem_executor_docker::WorkspaceMode;
    let local = WorkspaceMode::for_host(host) == WorkspaceMode::Bind;
    match asked {
        None => Ok(WorkspaceMode::for_host(host)),
        Some("volume") => Ok(WorkspaceMode::Volume),
        Some("bind") if local => Ok(WorkspaceMode::Bind),
        Some("bind") => bail!(
            "{section} workspace = \"bind\" needs an engine on this machine (a unix:// socket); {host} is another machine's, so use \"volume\""
        ),
        Some(other) => bail!("{section} workspace must be \"bind\" or \"volume\", not {other:?}"),
    }
}

/// The engines of `[[executors.docker.hosts]]`, each with the shared settings of
/// `[executors.docker]`; empty when there are none.
fn docker_hosts(
    file: &FileConfig,
    image: Option<&str>,
) -> Result<Vec<tandem_executor_docker::HostSpec>> {
    let d = &file.executors.docker;
    if d.hosts.is_empty() {
        return Ok(Vec::new());
    }
    let mut base = docker_config(file, image)?;
    // One name for the image on every host: a fallback could resolve differently on each.
    base.fallback_image = None;
    if d.image.is_none() && image.is_none() && env("TANDEM_DOCKER_IMAGE").is_none() {
        base.image = tandem_executor_docker::LOCAL_IMAGE.to_owned();
    }
    base.pool_size = d.pool_size.unwrap_or(2);
    base.pool_max = d.pool_max.unwrap_or(base.pool_size.max(16));
    base.pool_idle_secs = d.pool_idle_secs.unwrap_or(60);
    let mut names = std::collections::BTreeSet::new();
    d.hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let section = format!("[[executors.docker.hosts]] #{}", i + 1);
            let name = h.name.clone().unwrap_or_else(|| h.url.clone());
            if !names.insert(name.clone()) {
                bail!("{section}: two hosts are named `{name}`; give each its own name");
            }
            if h.capacity == Some(0) {
                bail!("{section} ({name}): capacity must be at least 1");
            }
            Ok(tandem_executor_docker::HostSpec {
                config: DockerConfig {
                    name,
                    host: h.url.clone(),
                    tls: tls_files(&section, &h.ca, &h.cert, &h.key)?,
                    workspace: workspace_mode(&section, h.workspace.as_deref(), &h.url)?,
                    // A host holds no more than its capacity, its pool included (a
                    // pool_size set over it is refused in `docker_pool`).
                    pool_size: base.pool_size.min(h.capacity.unwrap_or(8)),
                    pool_max: base.pool_max.min(h.capacity.unwrap_or(8)),
                    ..base.clone()
                },
                capacity: h.capacity.unwrap_or(8),
                labels: h.labels.clone(),
            })
        })
        .collect()
}

/// The warm pool's `pool_size`, `pool_max` and `pool_idle_secs`, checked against each other
/// and against each host's `capacity` where the operator set one.
pub(crate) fn docker_pool(
    file: &FileConfig,
    hosts: &[tandem_executor_docker::HostSpec],
) -> Result<(usize, usize, u64)> {
    let d = &file.executors.docker;
    let size = d.pool_size.unwrap_or(2);
    if let Some(size) = d.pool_size {
        for (h, spec) in d.hosts.iter().zip(hosts) {
            if let Some(capacity) = h.capacity
                && size > capacity
            {
                bail!(
                    "[executors.docker] pool_size ({size}) is over the capacity ({capacity}) of host `{}`: a host holds no more containers than its capacity, its warm pool included; lower pool_size or raise that capacity",
                    spec.config.label()
                );
            }
        }
    }
    let max = match d.pool_max {
        Some(max) if max < size => bail!(
            "[executors.docker] pool_max ({max}) is below pool_size ({size}): the pool grows from pool_size to pool_max; raise pool_max or lower pool_size"
        ),
        Some(max) => {
            for (h, spec) in d.hosts.iter().zip(hosts) {
                if let Some(capacity) = h.capacity
                    && max > capacity
                {
                    bail!(
                        "[executors.docker] pool_max ({max}) is over the capacity ({capacity}) of host `{}`: a host holds no more containers than its capacity; lower pool_max or raise that capacity",
                        spec.config.label()
                    );
                }
            }
            max
        }
        None => size.max(16),
    };
    let idle = match d.pool_idle_secs {
        Some(0) => bail!("[executors.docker] pool_idle_secs must be at least 1"),
        Some(secs) => secs,
        None => 60,
    };
    Ok((size, max, idle))
}

/// How often a fleet probes its hosts.
fn docker_probe(file: &FileConfig) -> Result<std::time::Duration> {
    match file.executors.docker.probe_secs {
        None => Ok(std::time::Duration::from_secs(2)),
        Some(s) if s > 0.0 && s <= 3600.0 => Ok(std::time::Duration::from_secs_f64(s)),
        Some(s) => bail!("[executors.docker] probe_secs must be between 0 and 3600, got {s}"),
    }
}

/// Settings for the Docker executor: the image from `--image`, then `TANDEM_DOCKER_IMAGE`,
/// then the file; the rest from the file over the hardened defaults.
fn docker_config(file: &FileConfig, image: Option<&str>) -> Result<DockerConfig> {
    let d = &file.executors.docker;
    let defaults = DockerConfig::default();
    if let Some(cpus) = d.cpus
        && !(cpus > 0.0 && cpus <= 1024.0)
    {
        bail!("[executors.docker] cpus must be between 0 and 1024, got {cpus}");
    }
    let chosen = image
        .filter(|i| !i.is_empty())
        .map(str::to_owned)
        .or_else(|| env("TANDEM_DOCKER_IMAGE"))
        .or_else(|| d.image.clone());
    let (host, tls) = match (&d.host, env("DOCKER_HOST")) {
        (Some(host), _) => (host.clone(), None),
        (None, Some(host)) => (host, None),
        (None, None) => tandem_executor_docker::context::config_dir()
            .and_then(|dir| {
                tandem_executor_docker::context::current_context(
                    &dir,
                    env("DOCKER_CONTEXT").as_deref(),
                )
            })
            .unwrap_or((defaults.host, None)),
    };
    let tls = tls_files("[executors.docker]", &d.ca, &d.cert, &d.key)?.or(tls);
    let workspace = workspace_mode("[executors.docker]", d.workspace.as_deref(), &host)?;
    Ok(DockerConfig {
        name: String::new(),
        tls,
        workspace,
        host,
        // Nobody chose an image: the offline build stands in when the default is absent.
        fallback_image: chosen
            .is_none()
            .then(|| tandem_executor_docker::LOCAL_IMAGE.to_owned()),
        image: chosen.unwrap_or(defaults.image),
        pull: d.pull.unwrap_or(defaults.pull),
        // A one-shot command would only start containers to throw away; the pool is for
        // processes that open many sessions.
        pool_size: 0,
        pool_max: 0,
        pool_idle_secs: 60,
        memory_bytes: d.memory_bytes.unwrap_or(defaults.memory_bytes),
        cpus: d.cpus.unwrap_or(defaults.cpus),
        pids: d.pids.unwrap_or(defaults.pids),
        tmpfs_bytes: d.tmpfs_bytes.unwrap_or(defaults.tmpfs_bytes),
        user: d.user.clone().unwrap_or(defaults.user),
        network: match d.network {
            Some(switch) => switch == NetworkSwitch::Open,
            None => defaults.network,
        },
        read_only: d.read_only.unwrap_or(defaults.read_only),
        env: d.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        languages: match &d.languages {
            Some(names) => names.iter().map(|n| Language::new(n)).collect(),
            None => defaults.languages,
        },
        daemon_id: defaults.daemon_id,
        workspace_dir: d.workspace_dir.clone(),
    })
}

/// Settings for the Kubernetes executor; `None` when `[executors.kubernetes]` is absent.
fn kubernetes_config(
    file: &FileConfig,
) -> Result<Option<tandem_executor_kubernetes::KubernetesConfig>> {
    let Some(k) = &file.executors.kubernetes else {
        return Ok(None);
    };
    let defaults = tandem_executor_kubernetes::KubernetesConfig::default();
    let nonempty = |value: &Option<String>, key: &str| -> Result<Option<String>> {
        match value {
            Some(v) if v.trim().is_empty() => {
                bail!("[executors.kubernetes] {key} is empty; name one or leave it out")
            }
            other => Ok(other.clone()),
        }
    };
    Ok(Some(tandem_executor_kubernetes::KubernetesConfig {
        url: nonempty(&k.url, "url")?,
        kubeconfig: k.kubeconfig.clone(),
        context: nonempty(&k.context, "context")?,
        namespace: nonempty(&k.namespace, "namespace")?.unwrap_or(defaults.namespace),
        warm_pool: nonempty(&k.warm_pool, "warm_pool")?.unwrap_or(defaults.warm_pool),
        container: nonempty(&k.container, "container")?,
        user: nonempty(&k.user, "user")?.unwrap_or(defaults.user),
        languages: match &k.languages {
            Some(names) => names.iter().map(|n| Language::new(n)).collect(),
            None => defaults.languages,
        },
        env: k.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        daemon_id: defaults.daemon_id,
        ready_timeout: match k.ready_timeout_secs {
            Some(secs) => secs_to_duration(secs, "[executors.kubernetes] ready_timeout_secs")?,
            None => defaults.ready_timeout,
        },
        workspace_dir: k.workspace_dir.clone(),
        volume_access_mode: match nonempty(&k.volume_access_mode, "volume_access_mode")? {
            Some(mode)
                if tandem_executor_kubernetes::VOLUME_ACCESS_MODES.contains(&mode.as_str()) =>
            {
                mode
            }
            Some(mode) => bail!(
                "[executors.kubernetes] volume_access_mode `{mode}` is not one of {}",
                tandem_executor_kubernetes::VOLUME_ACCESS_MODES.join(", ")
            ),
            None => defaults.volume_access_mode,
        },
        volume_storage_class: nonempty(&k.volume_storage_class, "volume_storage_class")?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_roads_get_the_same_defaults_but_the_daemons_timeout() -> Result<()> {
        let here = || Road::InProcess {
            timeout: None,
            block_timeout: None,
        };
        let mut file = FileConfig::default();
        let (ran, served) = (
            task_defaults(&file, "local".into(), here())?,
            task_defaults(&file, "local".into(), Road::Daemon)?,
        );
        assert_eq!(ran.timeout, None);
        assert_eq!(served.timeout, Some(DAEMON_TASK_TIMEOUT));
        assert_eq!(
            (
                ran.max_turns,
                &ran.termination,
                &ran.system_prompt,
                ran.limits.wall,
                ran.code_via
            ),
            (
                served.max_turns,
                &served.termination,
                &served.system_prompt,
                served.limits.wall,
                served.code_via
            )
        );
        // The file's limit is both roads' own.
        file.task.timeout_secs = Some(60);
        for road in [here(), Road::Daemon] {
            let d = task_defaults(&file, "local".into(), road)?;
            assert_eq!(d.timeout, Some(Duration::from_secs(60)));
        }
        // The flags, in process, over the file; a bad one is named by its flag.
        let flags = |timeout, block_timeout| Road::InProcess {
            timeout,
            block_timeout,
        };
        let d = task_defaults(&file, "local".into(), flags(Some(1.5), Some(3.0)))?;
        assert_eq!(
            (d.timeout, d.limits.wall),
            (Some(Duration::from_millis(1500)), Duration::from_secs(3))
        );
        let bad = task_defaults(&file, "local".into(), flags(None, Some(-1.0)))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            bad.starts_with("--block-timeout must be a positive"),
            "{bad}"
        );
        Ok(())
    }

    #[test]
    fn the_readme_example_config_parses() {
        let readme = include_str!("../../../README.md");
        let blocks = tandem_agent::extract_code_blocks(readme);
        // The example under "Configuration".
        let toml_block = blocks
            .iter()
            .find(|b| b.language.as_deref() == Some("toml") && b.code.contains("[limits]"))
            .unwrap();
        let file: FileConfig = toml::from_str(&toml_block.code).unwrap();
        assert_eq!(file.model.model.as_deref(), Some("qwen2.5-coder:7b"));
        let limits = file.limits.unwrap();
        assert_eq!(limits.wall, Duration::from_secs(60));
        assert_eq!(limits.output_bytes, 65536);
        assert_eq!(file.executors.local.env.len(), 1);
        // Every other example in the README, the security model and the approval guide is
        // valid too (unknown keys are errors), and its approval policy can be used.
        let security = tandem_agent::extract_code_blocks(include_str!("../../../docs/security.md"));
        let approval = tandem_agent::extract_code_blocks(include_str!("../../../docs/approval.md"));
        let tools = tandem_agent::extract_code_blocks(include_str!("../../../docs/tools.md"));
        for block in blocks
            .iter()
            .chain(&security)
            .chain(&approval)
            .chain(&tools)
            .filter(|b| b.language.as_deref() == Some("toml"))
        {
            let file = toml::from_str::<FileConfig>(&block.code)
                .unwrap_or_else(|e| panic!("README example does not parse: {e}\n{}", block.code));
            tandem_agent::ApprovalGate::new(&file.approval, None).unwrap();
            sessions(&file, 4).unwrap();
            teams(&file).unwrap();
            conn_limits(&file).unwrap();
        }
    }

    #[test]
    fn a_pool_that_cannot_hold_is_refused_naming_both_figures() -> Result<()> {
        let hosts = "[[executors.docker.hosts]]\nname = \"a\"\nurl = \"unix:///var/run/docker.sock\"\ncapacity = 3\n";
        let check = |pool: &str| -> Result<(usize, usize, u64)> {
            let file: FileConfig = toml::from_str(&format!("[executors.docker]\n{pool}\n{hosts}"))?;
            let specs = docker_hosts(&file, Some("img"))?;
            docker_pool(&file, &specs)
        };
        for (pool, error) in [
            (
                "pool_size = 3\npool_max = 2",
                "[executors.docker] pool_max (2) is below pool_size (3)",
            ),
            (
                "pool_size = 2\npool_max = 5",
                "[executors.docker] pool_max (5) is over the capacity (3) of host `a`",
            ),
            (
                "pool_size = 4",
                "[executors.docker] pool_size (4) is over the capacity (3) of host `a`",
            ),
            (
                "pool_idle_secs = 0",
                "[executors.docker] pool_idle_secs must be at least 1",
            ),
        ] {
            let got = check(pool).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(got.starts_with(error), "{pool}: {got}");
        }
        assert_eq!(check("pool_size = 3\npool_max = 3")?, (3, 3, 60));
        // Unset, the pool stays within each host's capacity.
        let file: FileConfig = toml::from_str(&format!(
            "[executors.docker]\n{}",
            hosts.replace("capacity = 3", "capacity = 1")
        ))?;
        let specs = docker_hosts(&file, Some("img"))?;
        assert_eq!(
            (specs[0].config.pool_size, specs[0].config.pool_max),
            (1, 1)
        );
        Ok(())
    }

    #[test]
    fn limits_a_daemon_is_given_are_checked_and_defaulted() {
        let file = |text: &str| toml::from_str::<FileConfig>(text).unwrap();
        let defaults = sessions(&file(""), 3).unwrap();
        assert_eq!(
            (defaults.total, defaults.wait, defaults.without_task),
            (12, Duration::from_secs(120), Some(9))
        );
        let set = sessions(
            &file("[sessions]\nmax = 5\nwait_secs = 9\n[sessions.executors]\nwasm = 2\n"),
            3,
        )
        .unwrap();
        assert_eq!((set.total, set.per_executor["wasm"]), (5, 2));
        for (text, error) in [
            ("[sessions]\nmax = 0\n", "[sessions] max must be at least 1"),
            (
                "[sessions]\nmax = 4\nwithout_task = 5\n",
                "[sessions] without_task is 5, more than [sessions] max (4); give at most 4",
            ),
            (
                "[sessions.executors]\ndocker = 0\n",
                "[sessions.executors] docker must be at least 1",
            ),
        ] {
            assert_eq!(sessions(&file(text), 3).unwrap_err().to_string(), error);
        }
        assert_eq!(
            teams(&file("[teams]\nmax_agents = 2000\n"))
                .unwrap_err()
                .to_string(),
            "[teams] max_agents is 2000; give a number from 1 to 1024"
        );
        assert_eq!(
            conn_limits(&file("[server]\nmax_unauthenticated = 0\n"))
                .unwrap_err()
                .to_string(),
            "[server] max_unauthenticated must be at least 1"
        );
        assert!(toml::from_str::<FileConfig>("[teams]\nmax_dept = 3\n").is_err());
    }

    #[test]
    fn pausing_settings_and_their_errors() {
        let parse = |text: &str| pausing(&toml::from_str::<FileConfig>(text).unwrap());
        let off = parse("").unwrap();
        assert_eq!(off.after, None);
        assert_eq!(off.keep, Duration::from_secs(7 * 24 * 3600));
        let on = parse("[sessions]\npause_after_secs = 300\npaused_keep_secs = 86400\n").unwrap();
        assert_eq!(on.after, Some(Duration::from_secs(300)));
        assert_eq!(on.keep, Duration::from_secs(86400));
        for (text, said) in [
            (
                "[sessions]\npause_after_secs = 0\n",
                "[sessions] pause_after_secs must be at least 1",
            ),
            (
                "[sessions]\npaused_keep_secs = 60\n",
                "[sessions] paused_keep_secs is set but pause_after_secs is not; set both, or neither",
            ),
            (
                "[sessions]\npause_after_secs = 5\npaused_keep_secs = 0\n",
                "[sessions] paused_keep_secs must be at least 1",
            ),
        ] {
            assert_eq!(parse(text).unwrap_err().to_string(), said);
        }
    }

    #[test]
    fn wasm_python_profiles() {
        let parse = |text: &str| wasm_config(&toml::from_str::<FileConfig>(text).unwrap());
        let python = |text: &str| parse(text).unwrap().python;
        assert_eq!(python(""), PythonProfile::Auto);
        assert_eq!(
            python("[executors.wasm]\npython = \"stock\"\n"),
            PythonProfile::Stock
        );
        assert_eq!(
            python("[executors.wasm]\npython = \"snapshot\"\n"),
            PythonProfile::Snapshot
        );
        let err = parse("[executors.wasm]\npython = \"pypy\"\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "[executors.wasm] python must be auto, snapshot or stock, got `pypy`"
        );
    }

    #[test]
    fn policy_settings_and_their_errors() {
        let parse = |text: &str| policy(&toml::from_str::<FileConfig>(text).unwrap());
        let default = parse("").unwrap();
        assert_eq!(default.executors, None);
        assert_eq!(default.max_turns, 100);
        assert_eq!(default.max_candidates, 8);
        assert_eq!(default.max_block_timeout, Duration::from_secs(3600));
        let set = parse(
            "[policy]\nexecutors = [\"wasm\"]\nmax_turns = 5\n[[policy.model_endpoints]]\nbase_url = \"http://h:1/v1/\"\napi_key = \"k\"\n",
        )
        .unwrap();
        assert_eq!(set.executors, Some(vec!["wasm".to_owned()]));
        assert_eq!(set.max_turns, 5);
        assert_eq!(
            set.endpoints,
            [tandem_daemon::Endpoint {
                base_url: "http://h:1/v1".to_owned(),
                api_key: Some("k".to_owned())
            }]
        );
        let error = |text: &str| parse(text).unwrap_err().to_string();
        assert_eq!(
            error("[policy]\nmax_turns = 0\n"),
            "[policy] max_turns must be at least 1"
        );
        assert_eq!(
            parse("[policy]\nmax_candidates = 2\n")
                .unwrap()
                .max_candidates,
            2
        );
        assert_eq!(
            error("[policy]\nmax_candidates = 0\n"),
            "[policy] max_candidates must be at least 1"
        );
        assert_eq!(
            error("[policy]\nmax_candidates = 9\n"),
            "[policy] max_candidates 9 is above 8, the most replies a turn chooses among"
        );
        assert_eq!(
            error("[[policy.model_endpoints]]\nbase_url = \"h:1\"\n"),
            "[[policy.model_endpoints]] base_url `h:1` must start with http:// or https://"
        );
        assert_eq!(
            error(
                "[[policy.model_endpoints]]\nbase_url = \"http://h\"\napi_key_env = \"TANDEM_TEST_UNSET_KEY\"\n"
            ),
            "[[policy.model_endpoints]] http://h: the environment variable TANDEM_TEST_UNSET_KEY named by api_key_env is not set"
        );
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_name() {
        let err = toml::from_str::<FileConfig>("[model]\nbase_ur = \"x\"\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `base_ur`"), "{err}");
        // Settings no executor would honour are refused, not silently ignored.
        for key in ["pids = 10", "network = true"] {
            let err = toml::from_str::<FileConfig>(&format!("[limits]\n{key}\n")).unwrap_err();
            assert!(err.to_string().contains("unknown field"), "{key}: {err}");
        }
    }
}
