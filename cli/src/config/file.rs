//! The format of `tandem.toml`: its sections as they are written, and reading the file. What
//! a setting means once flags and the environment are applied is the parent module's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;
use tandem_executor::Limits;

use super::xdg_dir;

/// The contents of `tandem.toml`; unknown keys are rejected so typos do not pass silently.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub model: ModelSection,
    #[serde(default)]
    pub task: TaskSection,
    #[serde(default)]
    pub limits: Option<Limits>,
    #[serde(default)]
    pub executors: ExecutorsSection,
    #[serde(default)]
    pub policy: PolicySection,
    /// `[approval]`: which blocks wait for a person (docs/approval.md).
    #[serde(default)]
    pub approval: tandem_protocol::ApprovalPolicy,
    /// `[sessions]`: how many sandboxes a daemon keeps open at once.
    #[serde(default)]
    pub sessions: SessionsSection,
    /// `[teams]`: how large a team a daemon runs.
    #[serde(default)]
    pub teams: tandem_protocol::team::TeamBounds,
    /// `[server]`: what a TCP peer of the daemon may hold.
    #[serde(default)]
    pub server: ServerSection,
    /// `[files]`: what a task may be given and how long a daemon keeps its workspace.
    #[serde(default)]
    pub files: FilesSection,
    /// `[snapshots]`: how many snapshots of sandboxes are kept, and how much (docs/snapshots.md).
    #[serde(default)]
    pub snapshots: SnapshotsSection,
    /// `[tools.NAME]`: the functions offered to the model (docs/tools.md).
    #[serde(default)]
    pub tools: tandem_agent::tools::Catalog,
    /// `[store]`: where the daemon keeps its tasks (docs/store.md).
    #[serde(default)]
    pub store: StoreSection,
    /// `[telemetry]`: where traces are exported (docs/telemetry.md).
    #[serde(default)]
    pub telemetry: tandem_telemetry::TelemetryConfig,
    /// `[network]`: what sandboxes reach through the egress proxy (docs/network.md).
    #[serde(default)]
    pub network: Option<NetworkSection>,
}

/// An executor's `network`: `false`, `true` or `"policy"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetworkSwitch {
    /// Never any network, whatever `[network]` or a task asks.
    Off,
    /// The open network (Docker's bridge, the host's), no proxy: unguarded.
    Open,
    /// Behind the egress proxy, under the task's policy.
    Policy,
}

impl<'de> Deserialize<'de> for NetworkSwitch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bool(bool),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bool(false) => Ok(NetworkSwitch::Off),
            Raw::Bool(true) => Ok(NetworkSwitch::Open),
            Raw::Text(t) if t == "policy" => Ok(NetworkSwitch::Policy),
            Raw::Text(t) => Err(serde::de::Error::custom(format!(
                "network = {t:?}: it is false (no network), true (the open network, unguarded) or \"policy\" (behind Tandem's egress proxy)"
            ))),
        }
    }
}

impl NetworkSwitch {
    /// The switch that applies: the one set, else `policy`, which gives a task no network
    /// unless `[network]` or the task itself names hosts.
    pub fn resolve(set: Option<NetworkSwitch>) -> NetworkSwitch {
        set.unwrap_or(NetworkSwitch::Policy)
    }
}

/// `[network]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSection {
    /// Hosts, `*.domains`, `host:port`s and `CIDR[:port]`s a sandbox may reach.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Entries refused even when `allow` names them.
    #[serde(default)]
    pub deny: Vec<String>,
    /// Bytes a task may carry through the proxy, both directions.
    pub max_bytes: Option<u64>,
    /// Connections a sandbox may hold open at once.
    pub max_connections: Option<u32>,
    /// Connections one block may make in all.
    pub max_block_connections: Option<u32>,
    /// Names the proxy answers itself instead of asking DNS (`"pypi.test" = ["203.0.113.5"]`).
    #[serde(default)]
    pub resolve: BTreeMap<String, Vec<std::net::IpAddr>>,
    /// `[network.packages]`: the package index sandboxes install from, through a cache.
    pub packages: Option<PackagesSection>,
    /// `[network.secrets.NAME]`: headers the proxy adds for a host, never in a sandbox.
    #[serde(default)]
    pub secrets: BTreeMap<String, SecretSection>,
    /// PEM files of roots trusted, beside the system's, for the brokered hosts the proxy
    /// speaks TLS to itself.
    #[serde(default)]
    pub upstream_ca: Vec<PathBuf>,
    /// Where the CA for brokered hosts is kept (default `$XDG_STATE_HOME/tandem/egress-ca`).
    pub ca_dir: Option<PathBuf>,
}

/// `[network.secrets.NAME]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSection {
    /// The host (or `*.domain`) whose requests get the header.
    pub host: String,
    /// The header's name (`Authorization`).
    pub header: String,
    /// An environment variable of the daemon holding the header's whole value.
    pub value_env: Option<String>,
    /// A file holding the header's whole value (a trailing newline is dropped).
    pub value_file: Option<PathBuf>,
}

/// `[network.packages]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackagesSection {
    /// A PEP 503 simple index (`http://host/simple/`) that pip inside is pointed at.
    pub python: Option<String>,
    /// An npm registry (`http://host/`) that npm inside is pointed at.
    pub npm: Option<String>,
    /// The cache's bound in MiB (default 2048).
    pub max_cache_mb: Option<u64>,
    /// Where the cache is kept (default `$XDG_CACHE_HOME/tandem/packages`).
    pub cache_dir: Option<PathBuf>,
}

/// `[store]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    /// `postgres://USER:PASSWORD@HOST:PORT/DATABASE`: the queue several daemons share; leave
    /// it out for the SQLite file in the state dir (one daemon).
    pub url: Option<String>,
    /// This daemon's name among those on one store (default: the host name and a hash of
    /// the state dir, the same across its restarts).
    pub daemon: Option<String>,
    /// Seconds a lease on a running task lasts unless renewed (default 30): how long the
    /// tasks of a daemon that died wait before another resumes them.
    pub lease_secs: Option<f64>,
    /// A file holding the store's password, for a `url` without one (else `PGPASSWORD`,
    /// else `~/.pgpass`): a password is never shown, and never in a command line.
    pub password_file: Option<PathBuf>,
}

/// `[snapshots]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsSection {
    /// Most snapshots kept at once (default 100).
    pub max_count: Option<u64>,
    /// Most megabytes (MiB) of content all snapshots hold together, shared content counted
    /// once (default 10240).
    pub max_mb: Option<u64>,
}

/// `[files]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilesSection {
    /// Where uploads and workspaces live (default: `files` in the state dir). Daemons on one
    /// PostgreSQL store share one directory on shared storage, so a task finds its files on
    /// whichever daemon claims it.
    pub dir: Option<PathBuf>,
    /// Most megabytes (MiB) of file content one upload may hold (default 256).
    pub max_upload_mb: Option<u64>,
    /// Most files and directories one upload may hold (default 10000).
    pub max_upload_files: Option<usize>,
    /// Seconds a finished task's workspace is kept (default 7 days).
    pub keep_secs: Option<u64>,
    /// Most megabytes (MiB) all tasks' workspaces may hold; the oldest finished go first
    /// (default 10240).
    pub max_total_mb: Option<u64>,
    /// Most megabytes (MiB) one task's workspace counts for, on disk; a finished task over it
    /// loses its files first, and a tar download of it writes no more (default 1024).
    pub max_task_mb: Option<u64>,
}

/// `[sessions]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionsSection {
    /// Most sandbox sessions open at once, all executors together (default 4 x
    /// --max-concurrent).
    pub max: Option<usize>,
    /// Longest a block waits for a free sandbox before it fails (default 120 s).
    pub wait_secs: Option<u64>,
    /// Most sessions of one executor open at once, by name.
    #[serde(default)]
    pub executors: BTreeMap<String, usize>,
    /// Most sandboxes open at once that no task holds (HTTP sessions, /v1/exec, MCP
    /// execute_code), idle or not (default: max less --max-concurrent, at least 1).
    pub without_task: Option<usize>,
    /// Seconds an HTTP session goes unused before it is paused: saved as a snapshot, its
    /// sandbox closed, and resumed by its next block (default: never; idle ones close).
    pub pause_after_secs: Option<u64>,
    /// Seconds a paused session is kept unused before it is closed (default 7 days).
    pub paused_keep_secs: Option<u64>,
}

/// `[server]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    /// Seconds a TCP connection may take to send a request's headers or sit idle (default 30).
    pub header_timeout_secs: Option<u64>,
    /// Most TCP connections at once (default 512).
    pub max_connections: Option<usize>,
    /// Most TCP connections at once that have not sent the token yet (default 64).
    pub max_unauthenticated: Option<usize>,
}

/// `[policy]`: what API clients of a daemon may ask for.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySection {
    /// Executors clients may use (default: every available one but `local`).
    pub executors: Option<Vec<String>>,
    /// Longest task timeout a client may ask for, seconds.
    pub max_timeout_secs: Option<u64>,
    /// Longest block timeout a client may ask for, seconds.
    pub max_block_timeout_secs: Option<u64>,
    /// Most turns a client may ask for.
    pub max_turns: Option<u32>,
    /// Most replies to choose among a client may ask for (`candidates`).
    pub max_candidates: Option<u32>,
    /// Most of each budget a client may ask for; a task that asks for none gets the cap.
    pub max_input_tokens: Option<u64>,
    pub max_output_tokens: Option<u64>,
    pub max_cost: Option<f64>,
    /// Model servers a task may name besides the configured one.
    #[serde(default)]
    pub model_endpoints: Vec<EndpointSection>,
    /// Hosts a client may ask for in a task's `network` (default: within `[network] allow`).
    pub network_allow: Option<Vec<String>>,
}

/// One `[[policy.model_endpoints]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSection {
    pub base_url: String,
    /// The key sent to this endpoint only.
    pub api_key: Option<String>,
    /// Read the key from this environment variable instead.
    pub api_key_env: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub base_url: Option<String>,
    pub model: Option<String>,
    pub api_key: Option<String>,
    pub stream: Option<bool>,
    pub max_retries: Option<u32>,
    pub temperature: Option<f32>,
    pub max_tokens: Option<u32>,
    /// Most bytes of one reply kept; a server streaming past it is cut off.
    pub max_reply_bytes: Option<usize>,
    /// Where the embedded model's files are (default `$XDG_CACHE_HOME/tandem/models`).
    pub models_dir: Option<PathBuf>,
    /// `embedded` or `openai`; unset: a server when one is named, else the embedded model.
    pub provider: Option<String>,
    /// Sampling seed.
    pub seed: Option<u32>,
    /// Strings that end a reply.
    pub stop: Option<Vec<String>>,
    /// The embedded model's context window in tokens.
    pub context_tokens: Option<u32>,
    /// Tokens the embedded model's cache holds over every conversation.
    pub cache_tokens: Option<u32>,
    /// Most replies the embedded model generates at once.
    pub parallel: Option<u32>,
    /// A smaller pulled model of the same family that guesses tokens for the embedded one
    /// (a catalog name or a `.gguf` path).
    pub draft: Option<String>,
    /// How the model's code reaches the executor: `blocks`, `tool` or `auto`.
    pub code_via: Option<tandem_protocol::CodeVia>,
    /// `auto` (the model may call a tool) or `required` (every reply is a call).
    pub tool_choice: Option<String>,
    /// `[model.prices."NAME"]`: what a million input and output tokens of a model cost, for
    /// tasks' cost and `max_cost`.
    #[serde(default)]
    pub prices: BTreeMap<String, tandem_agent::budget::Price>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSection {
    pub executor: Option<String>,
    pub max_turns: Option<u32>,
    /// Budgets for a task that sets none (`max_input_tokens`, ...).
    pub max_input_tokens: Option<u64>,
    pub max_output_tokens: Option<u64>,
    pub max_cost: Option<f64>,
    pub timeout_secs: Option<u64>,
    pub termination: Option<String>,
    pub system_prompt_file: Option<PathBuf>,
}

/// `[executors]`: the built-ins' settings, and every other `[executors.NAME]` is a plugin.
#[derive(Debug, Default, Deserialize)]
pub struct ExecutorsSection {
    #[serde(default)]
    pub local: LocalSection,
    #[serde(default)]
    pub docker: DockerSection,
    /// Absent: the daemon offers no kubernetes executor.
    pub kubernetes: Option<KubernetesSection>,
    #[serde(default)]
    pub wasm: WasmSection,
    /// Executor plugins by name (serde cannot deny unknown keys beside a flatten: a table
    /// that is not a plugin fails on its own keys instead).
    #[serde(flatten)]
    pub plugins: BTreeMap<String, PluginSection>,
}

/// `[executors.NAME]` for a name that is not a built-in: an out-of-process executor.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSection {
    /// The program and its arguments.
    pub command: Vec<String>,
    /// Variables for the plugin, on top of PATH, HOME, LANG, USER and TMPDIR.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Its working directory (default: Tandem's).
    pub cwd: Option<PathBuf>,
    /// Its languages, if it does not say them itself (saying them here also saves starting
    /// it to ask).
    pub languages: Option<Vec<String>>,
    /// How long it may take to start and answer `initialize` (default 10 s).
    pub start_timeout_secs: Option<f64>,
}

/// `[executors.wasm]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WasmSection {
    /// Where python.wasm and quickjs.wasm are (default: `TANDEM_WASM_DIR`, else
    /// `$XDG_DATA_HOME/tandem/wasm`).
    pub runtimes_dir: Option<PathBuf>,
    /// Where compiled modules are cached (default `$XDG_CACHE_HOME/tandem/wasm`).
    pub cache_dir: Option<PathBuf>,
    /// Linear memory cap per block (default 256 MiB).
    pub memory_bytes: Option<u64>,
    /// CPU budget per block in wasmtime fuel (default: none).
    pub fuel: Option<u64>,
    /// Which CPython runs python: `auto` (the snapshot when built), `snapshot` or `stock`.
    pub python: Option<String>,
}

/// `[executors.docker]`: every hardened default can be changed here.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerSection {
    pub image: Option<String>,
    pub pull: Option<bool>,
    /// Started containers the daemon keeps ready (default 2); one-shot commands keep none.
    pub pool_size: Option<usize>,
    /// Most containers the pool grows to while sessions find it empty (default 16, and no
    /// more than a host's `capacity`).
    pub pool_max: Option<usize>,
    /// Seconds without a session finding the pool empty before it shrinks back to
    /// `pool_size` (default 60).
    pub pool_idle_secs: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub cpus: Option<f64>,
    pub pids: Option<i64>,
    pub tmpfs_bytes: Option<u64>,
    pub user: Option<String>,
    /// `false` never any network, `true` Docker's open bridge (unguarded), `"policy"` (the
    /// default) behind the egress proxy when `[network]` or a task names hosts.
    pub network: Option<NetworkSwitch>,
    pub read_only: Option<bool>,
    pub languages: Option<Vec<String>>,
    pub workspace_dir: Option<PathBuf>,
    /// Extra variables passed to code; nothing from the daemon's environment is.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The engine's address (default: `DOCKER_HOST`, then the docker CLI's current context,
    /// then the local socket).
    pub host: Option<String>,
    /// TLS client files for a `tcp://` engine.
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// `bind` (a host directory; local socket only) or `volume` (default for a remote one).
    pub workspace: Option<String>,
    /// Several engines: each session goes to one of them (docs/docker-hosts.md).
    #[serde(default)]
    pub hosts: Vec<DockerHostSection>,
    /// How often the hosts are probed, in seconds (default 2).
    pub probe_secs: Option<f64>,
}

/// `[executors.kubernetes]`: sessions as agent-sandbox claims on a cluster
/// (docs/kubernetes.md).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSection {
    /// The API server (default: the kubeconfig's, or the in-cluster service account).
    pub url: Option<String>,
    /// A kubeconfig file (default: `KUBECONFIG`, then `~/.kube/config`).
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context (default: its current one).
    pub context: Option<String>,
    /// Where the claims are made (default `tandem`).
    pub namespace: Option<String>,
    /// The `SandboxWarmPool` sessions are claimed from (default `tandem`).
    pub warm_pool: Option<String>,
    /// The pod's container the runner is exec'd in (default: its first).
    pub container: Option<String>,
    /// The `uid:gid` blocks run as when the pod runs as root (default 65534:65534).
    pub user: Option<String>,
    pub languages: Option<Vec<String>>,
    /// Extra variables passed to code.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// How long a claim may wait for a ready sandbox, in seconds (default 120).
    pub ready_timeout_secs: Option<f64>,
    pub workspace_dir: Option<PathBuf>,
    /// The access mode of the claims made for volumes (default `ReadWriteOnce`).
    pub volume_access_mode: Option<String>,
    /// The storage class of those claims (default: the cluster's default).
    pub volume_storage_class: Option<String>,
}

/// `[[executors.docker.hosts]]`: one engine of several.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerHostSection {
    /// The name it goes by in events, `doctor` and metrics (default: its url).
    pub name: Option<String>,
    /// `unix://...`, `tcp://HOST:PORT` (with `ca`, `cert` and `key` for TLS) or `ssh://...`.
    pub url: String,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Most sessions it runs at once (default 8).
    pub capacity: Option<usize>,
    /// What it offers; a task's `placement` labels must all be among them.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// `bind` or `volume` (default: bind for a local socket, volume otherwise).
    pub workspace: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalSection {
    pub python: Option<PathBuf>,
    pub node: Option<PathBuf>,
    /// Run python blocks as forks of a warm interpreter (default true).
    pub fork_server: Option<bool>,
    /// Extra variables passed to code; nothing from the daemon's environment is.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Kernel confinement of blocks: auto (default), off or required.
    pub confine: Option<String>,
    /// `false` never any network, `true` the host's network (unguarded), `"policy"` (the
    /// default) behind the egress proxy when `[network]` or a task names hosts.
    pub network: Option<NetworkSwitch>,
    /// Paths confined blocks may read besides the system's and the interpreters'.
    #[serde(default)]
    pub read_paths: Vec<PathBuf>,
}

/// Loads the config file: `--config` (or `TANDEM_CONFIG`), else
/// `$XDG_CONFIG_HOME/tandem/tandem.toml` when it exists.
pub fn load(explicit: Option<&Path>) -> Result<FileConfig> {
    let path = match explicit.filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => Some(p.to_owned()),
        None => default_path().filter(|p| p.exists()),
    };
    let Some(path) = path else {
        return Ok(FileConfig::default());
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    let file: FileConfig =
        toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))?;
    tandem_agent::ApprovalGate::new(&file.approval, None)
        .with_context(|| format!("invalid config file {}: [approval]", path.display()))?;
    Ok(file)
}

fn default_path() -> Option<PathBuf> {
    Some(xdg_dir("XDG_CONFIG_HOME", ".config")?.join("tandem.toml"))
}
