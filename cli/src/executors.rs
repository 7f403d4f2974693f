//! Picking the executor a command runs on: by name, or `auto` (docker when it is usable, else
//! wasm when its CPython runtime is installed, else local with a warning).

use std::sync::Arc;

use anyhow::{Result, bail};
use tandem_executor::{Executor, Language};
use tandem_executor_docker::{DockerError, DockerExecutor, DockerFleet};
use tandem_executor_kubernetes::KubernetesExecutor;
use tandem_executor_local::LocalExecutor;
use tandem_executor_plugin::PluginExecutor;
use tandem_executor_wasm::{FETCH_SCRIPT, ModuleSource, Runtime, WasmExecutor};

use crate::config::{self, DockerSettings, ExecutorSettings, Settings};

/// The Docker executor as configured: one engine, or several (`[[executors.docker.hosts]]`).
#[derive(Clone)]
pub enum Docker {
    /// One engine.
    One(DockerExecutor),
    /// Several, each session placed on one.
    Fleet(DockerFleet),
}

impl Docker {
    /// Connects as the settings say; `pool` overrides the warm pool's size (one-shot
    /// commands keep none).
    pub async fn connect(
        settings: &DockerSettings,
        pool: Option<usize>,
    ) -> Result<Self, DockerError> {
        let mut hosts = settings.hosts.clone();
        // No pool, no growth: a one-shot command keeps none.
        let grown = |size: usize, max: usize| if size == 0 { 0 } else { max };
        if hosts.is_empty() {
            let mut one = settings.one.clone();
            if let Some(pool) = pool {
                one.pool_size = pool;
                one.pool_max = grown(pool, settings.pool_max);
                one.pool_idle_secs = settings.pool_idle_secs;
            }
            return DockerExecutor::connect(one).await.map(Self::One);
        }
        if let Some(pool) = pool {
            for h in &mut hosts {
                h.config.pool_size = pool;
                h.config.pool_max = grown(pool, h.config.pool_max);
            }
        }
        DockerFleet::connect(hosts, settings.probe)
            .await
            .map(Self::Fleet)
    }

    /// It, as an executor.
    pub fn executor(&self) -> Arc<dyn Executor> {
        match self {
            Self::One(d) => Arc::new(d.clone()),
            Self::Fleet(f) => Arc::new(f.clone()),
        }
    }

    /// Starts filling the warm pools.
    pub fn warm_up(&self) {
        if let Self::One(d) = self {
            d.warm_up();
        }
        // A fleet fills each host's pool as the host comes up.
    }

    /// Empties the warm pools (and stops probing hosts).
    pub async fn shutdown(&self) {
        match self {
            Self::One(d) => d.shutdown().await,
            Self::Fleet(f) => f.shutdown().await,
        }
    }
}

/// Every name `--executor` accepts here: the built-ins and the configured plugins.
pub fn names(settings: &ExecutorSettings) -> String {
    config::BUILT_IN_EXECUTORS
        .iter()
        .map(|n| (*n).to_owned())
        .chain(settings.plugins.keys().cloned())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The plugin `[executors.NAME]`, started if it must be asked for its languages.
pub async fn plugin(name: &str, settings: &ExecutorSettings) -> Result<Option<PluginExecutor>> {
    let Some(section) = settings.plugins.get(name) else {
        return Ok(None);
    };
    Ok(Some(PluginExecutor::new(section.get()?.clone()).await?))
}

/// The executor called `name` (or the one `auto` picks), ready to open sessions.
pub async fn resolve(name: &str, settings: &ExecutorSettings) -> Result<Arc<dyn Executor>> {
    match name {
        "local" => Ok(local(settings)?),
        "wasm" => {
            let wasm = wasm(settings)?;
            if !wasm.runtimes().iter().any(|r| r.present) {
                bail!(
                    "the wasm executor has no runtimes in {}; run {FETCH_SCRIPT} (or set {})",
                    wasm.config().runtimes_dir.display(),
                    tandem_executor_wasm::WASM_DIR_VAR
                );
            }
            Ok(Arc::new(wasm))
        }
        "docker" => match Docker::connect(settings.docker.get()?, None).await? {
            Docker::One(docker) => {
                docker
                    .ensure_image(&|line| eprintln!("tandem: {line}"))
                    .await?;
                Ok(Arc::new(docker))
            }
            fleet @ Docker::Fleet(_) => {
                if let Some(why) = why_not_docker(Ok(&fleet)).await {
                    bail!("{why}");
                }
                Ok(fleet.executor())
            }
        },
        "auto" => {
            let (executor, why) = auto(settings).await?;
            if executor.name() == "local" {
                eprintln!("{}", local_fallback_notice(settings, &why)?);
            }
            Ok(executor)
        }
        "kubernetes" => Ok(Arc::new(kubernetes(settings).await?)),
        other => match plugin(other, settings).await? {
            Some(plugin) => Ok(Arc::new(plugin)),
            None => bail!(
                "executor `{other}` is not registered; available: {}",
                names(settings)
            ),
        },
    }
}

/// The configured Kubernetes executor, its cluster checked and the claims of dead Tandems
/// deleted.
pub async fn kubernetes(settings: &ExecutorSettings) -> Result<KubernetesExecutor> {
    let Some(config) = settings.kubernetes.get()?.clone() else {
        bail!(
            "the kubernetes executor is not configured; add an [executors.kubernetes] section naming the cluster and warm pool (docs/kubernetes.md)"
        );
    };
    let executor = KubernetesExecutor::connect(config).await?;
    executor.check().await?;
    match executor.reap_orphans().await {
        Ok(0) => {}
        Ok(n) => tracing::info!(claims = n, "deleted claims that dead Tandems left"),
        Err(e) => tracing::warn!(error = %e, "could not look for claims that dead Tandems left"),
    }
    Ok(executor)
}

/// The executors that run `language` on this machine's configuration, for a hint when the
/// chosen one cannot.
/// Plugins count when their configuration names the language (they are not started).
pub fn executors_for(language: &Language, settings: &ExecutorSettings) -> Vec<String> {
    let docker = settings
        .docker
        .ok()
        .is_some_and(|d| d.one.languages.contains(language));
    let wasm = [Language::python(), Language::javascript()].contains(language);
    let local = settings
        .local
        .ok()
        .is_some_and(|c| LocalExecutor::new(c.clone()).languages().contains(language));
    let plugins = settings.plugins.iter().map(|(name, p)| {
        let runs = p
            .ok()
            .and_then(|p| p.languages.as_ref())
            .is_some_and(|l| l.contains(language));
        (name.as_str(), runs)
    });
    let kubernetes = settings
        .kubernetes
        .ok()
        .is_some_and(|c| c.as_ref().is_some_and(|c| c.languages.contains(language)));
    [
        ("docker", docker),
        ("kubernetes", kubernetes),
        ("wasm", wasm),
        ("local", local),
    ]
    .into_iter()
    .chain(plugins)
    .filter(|(_, runs)| *runs)
    .map(|(name, _)| name.to_owned())
    .collect()
}

/// What `auto` picks, and why.
pub async fn auto(settings: &ExecutorSettings) -> Result<(Arc<dyn Executor>, String)> {
    let connected = Docker::connect(settings.docker.get()?, None).await;
    let why_not = why_not_docker(connected.as_ref()).await;
    Ok(match (connected, why_not) {
        (Ok(docker), None) => {
            let why = docker_why(&docker);
            (docker.executor(), why)
        }
        (_, why_not) => {
            let wasm = wasm(settings);
            let (name, why) = without_docker(why_not.unwrap_or_default(), wasm.as_ref());
            match (name, wasm) {
                ("wasm", Ok(wasm)) => (Arc::new(wasm), why),
                _ => (local(settings)?, why),
            }
        }
    })
}

/// What `auto` picks when docker cannot run code (`why_not_docker` says why): wasm when its
/// CPython runtime is installed, else local; and why.
pub fn without_docker(
    why_not_docker: String,
    wasm: Result<&WasmExecutor, &anyhow::Error>,
) -> (&'static str, String) {
    match wasm {
        Ok(w) if w.python_present() => (
            "wasm",
            format!("{why_not_docker}; wasm: the CPython runtime is installed"),
        ),
        Ok(w) => (
            "local",
            format!(
                "{why_not_docker}; wasm: no {} in {} (run {FETCH_SCRIPT})",
                Runtime::Python.file_name(),
                w.config().runtimes_dir.display()
            ),
        ),
        Err(e) => ("local", format!("{why_not_docker}; wasm: {e:#}")),
    }
}

/// The WASM executor with the configured runtimes (which may be missing).
pub fn wasm(settings: &ExecutorSettings) -> Result<WasmExecutor> {
    Ok(WasmExecutor::new(settings.wasm.get()?.clone())?)
}

/// Why `auto` picks docker.
pub fn docker_why(docker: &Docker) -> String {
    let docker = match docker {
        Docker::One(d) => d,
        Docker::Fleet(f) => {
            let hosts = Executor::hosts(f);
            let up = hosts.iter().filter(|h| h.up).count();
            return format!(
                "{up} of {} Docker hosts answer, with image `{}`",
                hosts.len(),
                f.image()
            );
        }
    };
    let image = docker.image();
    match docker.replaced_image() {
        None => format!("the Docker engine answers and image `{image}` is present"),
        Some(absent) => format!(
            "the Docker engine answers; `{absent}` is not present, so the locally built `{image}` stands in"
        ),
    }
}

/// Why `auto` cannot pick docker, given a connection the caller made; `None` when it can.
pub async fn why_not_docker(connected: Result<&Docker, &DockerError>) -> Option<String> {
    match connected {
        Ok(Docker::Fleet(fleet)) => fleet.health().await.err().map(|e| format!("docker: {e}")),
        Ok(Docker::One(docker)) => match docker.image_present().await {
            Ok(true) => None,
            Ok(false) => Some(format!(
                "docker: image `{}` is not present; pull it, or build one offline with scripts/build-sandbox-image.sh (used when the default image is absent)",
                docker.image()
            )),
            Err(e) => Some(format!("docker: {e}")),
        },
        Err(DockerError::Unreachable { host, .. }) => {
            Some(format!("docker: no answer from {host}"))
        }
        Err(e) => Some(format!("docker: {e}")),
    }
}

fn local(settings: &ExecutorSettings) -> Result<Arc<dyn Executor>> {
    Ok(Arc::new(LocalExecutor::new(settings.local.get()?.clone())))
}

/// `doctor`'s line for the Kubernetes executor, when it is configured.
async fn kubernetes_line(settings: &ExecutorSettings) -> Option<String> {
    let config = match settings.kubernetes.get() {
        Ok(Some(config)) => config.clone(),
        Ok(None) => return None,
        Err(e) => return Some(format!("executor:  kubernetes - unavailable: {e:#}")),
    };
    let langs = config
        .languages
        .iter()
        .map(Language::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    let place = format!(
        "warm pool `{}` in namespace `{}` at {}",
        config.warm_pool,
        config.namespace,
        config.label()
    );
    let state = match KubernetesExecutor::connect(config).await {
        Ok(k) => match k.check().await {
            Ok(()) => "ready".to_owned(),
            Err(e) => format!("unavailable: {e}"),
        },
        Err(e) => format!("unavailable: {e}"),
    };
    Some(format!(
        "executor:  kubernetes ({langs}) - {place}: {state}"
    ))
}

/// `tandem doctor`'s executor lines; `precompile` loads the WASM runtimes (compiling and
/// caching them if needed) and says how long that took.
pub async fn report(settings: &Settings, precompile: bool) -> Result<Vec<String>> {
    let executors = &settings.executors;
    let langs = |l: &[Language]| {
        l.iter()
            .map(Language::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut lines = Vec::new();
    let local_config = executors.local.get()?.clone();
    let confinement = tandem_executor_local::confinement(&local_config);
    let local = LocalExecutor::new(local_config);
    lines.push(format!(
        "executor:  local ({}) - {}",
        langs(local.languages()),
        match confinement {
            Ok(confined) => confined,
            Err(unconfined) => format!("{unconfined}; not a security boundary"),
        }
    ));
    let connected = Docker::connect(executors.docker.get()?, Some(0)).await;
    match &connected {
        Ok(Docker::Fleet(fleet)) => {
            lines.push(format!(
                "executor:  docker ({}) - {} hosts, image `{}`",
                langs(fleet.languages()),
                Executor::hosts(fleet).len(),
                fleet.image()
            ));
            lines.extend(host_lines(&Executor::hosts(fleet)));
        }
        Ok(Docker::One(docker)) => {
            let version = docker
                .engine_version()
                .await
                .unwrap_or_else(|e| e.to_string());
            let present = match docker.image_present().await {
                Ok(true) => "present".to_owned(),
                Ok(false) => "missing: pull it or run scripts/build-sandbox-image.sh".to_owned(),
                Err(e) => e.to_string(),
            };
            let instead = docker.replaced_image().map_or(String::new(), |absent| {
                format!(" (`{absent}` is not present; the locally built image stands in)")
            });
            lines.push(format!(
                "executor:  docker ({}) - engine {version}, image `{}` {present}{instead}",
                langs(docker.languages()),
                docker.image()
            ));
        }
        Err(e) => lines.push(format!("executor:  docker - unavailable: {e}")),
    }
    if let Some(line) = kubernetes_line(executors).await {
        lines.push(line);
    }
    let wasm = wasm(executors);
    match &wasm {
        Ok(w) => {
            let statuses = w.runtimes();
            let runtimes: Vec<String> = statuses
                .iter()
                .map(|r| {
                    let state = if r.present { "present" } else { "missing" };
                    format!("{} {state}", r.runtime.file_name())
                })
                .collect();
            lines.push(format!(
                "executor:  wasm ({}) - {} in {}{}",
                langs(w.languages()),
                runtimes.join(", "),
                w.config().runtimes_dir.display(),
                if statuses.iter().all(|r| r.present) {
                    String::new()
                } else {
                    format!("; run {FETCH_SCRIPT}")
                }
            ));
            if precompile {
                for (runtime, result) in w.precompile().await {
                    lines.push(match result {
                        Ok(warmed) => format!(
                            "           {} {} in {} ms (cache: {})",
                            runtime.file_name(),
                            match warmed.source {
                                ModuleSource::Cache => "already in the compiled cache",
                                ModuleSource::Compiled => "compiled and cached",
                            },
                            warmed.took.as_millis(),
                            w.config().cache_dir.display()
                        ),
                        Err(e) => format!("           {}: {e}", runtime.file_name()),
                    });
                }
            }
        }
        Err(e) => lines.push(format!("executor:  wasm - unavailable: {e}")),
    }
    for name in executors.plugins.keys() {
        lines.push(plugin_line(name, settings).await);
    }
    let auto = match why_not_docker(connected.as_ref()).await {
        None => format!(
            "docker ({})",
            connected.as_ref().map(docker_why).unwrap_or_default()
        ),
        Some(why) => {
            let (name, why) = without_docker(why, wasm.as_ref());
            format!("{name} ({why})")
        }
    };
    lines.push(format!("auto:      {auto}"));
    Ok(lines)
}

/// `tandem doctor`'s lines for a fleet's hosts: each one's health, load, labels and where its
/// workspaces live.
pub fn host_lines(hosts: &[tandem_executor::HostStatus]) -> Vec<String> {
    hosts
        .iter()
        .map(|h| {
            let labels = if h.labels.is_empty() {
                String::new()
            } else {
                let l: Vec<String> = h.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!(", labels {}", l.join(","))
            };
            let state = if h.up {
                "up".to_owned()
            } else {
                format!("down: {}", h.reason.clone().unwrap_or_default())
            };
            format!(
                "           host {} ({}) - {state}; {} of {} sessions, {} workspaces{labels}",
                h.name, h.url, h.sessions, h.capacity, h.workspace
            )
        })
        .collect()
}

/// `tandem doctor`'s line for a plugin: it is started, asked about itself, and shut down.
async fn plugin_line(name: &str, settings: &Settings) -> String {
    let command = settings
        .file
        .executors
        .plugins
        .get(name)
        .map_or(String::new(), |p| p.command.join(" "));
    let plugin = match plugin(name, &settings.executors).await {
        Ok(Some(p)) => p,
        Ok(None) => return format!("executor:  {name} - not configured"),
        Err(e) => return format!("executor:  {name} (plugin `{command}`) - unavailable: {e:#}"),
    };
    let line = match plugin.info().await {
        Ok(info) => format!(
            "executor:  {name} ({}) - plugin `{command}`{}, protocol {}, enforces {}",
            tandem_executor::join_languages(plugin.languages()),
            info.name.map_or(String::new(), |n| format!(" ({n})")),
            tandem_executor_plugin::PROTOCOL_VERSION,
            if info.enforces.is_empty() {
                "no limits itself (Tandem still bounds time and output)".to_owned()
            } else {
                info.enforces.join(", ")
            }
        ),
        Err(e) => format!("executor:  {name} (plugin `{command}`) - unavailable: {e}"),
    };
    plugin.shutdown().await;
    line
}

/// What `auto` says when it falls back to the local executor: told truly, a note when the
/// blocks are confined and a warning when they are not.
fn local_fallback_notice(settings: &ExecutorSettings, why: &str) -> Result<String> {
    Ok(
        match tandem_executor_local::confinement(settings.local.get()?) {
            Ok(_) => format!(
                "tandem: running code with the local executor, confined (`tandem doctor` says how) ({why})"
            ),
            Err(unconfined) => format!(
                "tandem: warning: running code with the local executor, which is not a security boundary ({unconfined}; {why})"
            ),
        },
    )
}
