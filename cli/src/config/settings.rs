//! Every setting a command uses, resolved once from its flags, the environment and the
//! file: commands read fields of [`Settings`] and never resolve a setting themselves.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use tandem_agent::ModelConfig;
use tandem_daemon::TaskDefaults;
use tandem_executor_docker::{DockerConfig, HostSpec};
use tandem_executor_kubernetes::KubernetesConfig;
use tandem_executor_local::LocalConfig;
use tandem_executor_plugin::PluginConfig;
use tandem_executor_wasm::WasmConfig;
use tandem_protocol::team::TeamBounds;

use super::{FileConfig, ModelFlags, Road};

/// What a command's flags say over the environment and the file.
pub struct Overrides<'a> {
    /// `--executor`.
    pub executor: Option<&'a str>,
    /// `--image`.
    pub image: Option<&'a str>,
    /// `--model`, `--base-url`, `--no-stream`.
    pub model: &'a ModelFlags,
    /// The road a task takes, with its flags' limits.
    pub road: Road,
}

/// Every setting of a command. A mistake in a part is told when the command uses that part,
/// so a setting one road does not read (the model's, on the way to a daemon) stops nothing.
pub struct Settings {
    /// The file as read, for the sections passed on whole (`[tools]`, `[approval]`).
    pub file: FileConfig,
    /// The model server's settings.
    pub model: Section<ModelConfig>,
    /// What decides between a model server and the embedded model.
    pub provider: ProviderSettings,
    /// How large a team may be.
    pub teams: Section<TeamBounds>,
    /// What a task that does not say gets, on this command's road.
    pub defaults: Section<TaskDefaults>,
    /// Each executor's settings.
    pub executors: ExecutorSettings,
}

/// What decides between a model server and the embedded model, and how the embedded one
/// is loaded.
pub struct ProviderSettings {
    /// `[model] provider`, when set.
    pub asked: Option<String>,
    /// The model named by a flag, `TANDEM_MODEL` or the file.
    pub named: Option<String>,
    /// Whether a base URL or an API key is given anywhere.
    pub server_named: bool,
    /// Where pulled models are.
    pub models_dir: Section<PathBuf>,
    /// `[model] context_tokens`.
    pub context_tokens: Option<u32>,
    /// `[model] cache_tokens`.
    pub cache_tokens: Option<u32>,
    /// `[model] parallel`.
    pub parallel: Option<u32>,
    /// `[model] draft`.
    pub draft: Option<String>,
}

/// Each executor's settings; a mistake in one section is told when that executor is asked
/// for, so it does not stop a command that uses another.
pub struct ExecutorSettings {
    /// The executor a task gets when it names none: a name, or `auto` (not yet decided).
    pub default: String,
    /// `[executors.local]`.
    pub local: Section<LocalConfig>,
    /// `[executors.wasm]` and `TANDEM_WASM_DIR`.
    pub wasm: Section<WasmConfig>,
    /// `[executors.docker]`, its hosts, and the image from `--image` or the environment.
    pub docker: Section<DockerSettings>,
    /// `[executors.kubernetes]`; `None` when it is absent.
    pub kubernetes: Section<Option<KubernetesConfig>>,
    /// `[executors.NAME]` plugins.
    pub plugins: BTreeMap<String, Section<PluginConfig>>,
}

/// The Docker executor: one engine, or the hosts of a fleet.
#[derive(Clone)]
pub struct DockerSettings {
    /// The one engine (and the settings each host shares).
    pub one: DockerConfig,
    /// `[[executors.docker.hosts]]`; empty for one engine.
    pub hosts: Vec<HostSpec>,
    /// How often a fleet probes its hosts.
    pub probe: Duration,
    /// The warm pool a daemon keeps per engine.
    pub pool_size: usize,
    /// Most the pool grows to under demand, per engine.
    pub pool_max: usize,
    /// Seconds without demand before the pool shrinks back to `pool_size`.
    pub pool_idle_secs: u64,
}

/// Settings, or what is wrong with their section.
#[derive(Debug, Clone)]
pub struct Section<T>(std::result::Result<T, String>);

impl<T> Section<T> {
    fn of(resolved: Result<T>) -> Self {
        Self(resolved.map_err(|e| format!("{e:#}")))
    }

    /// The settings, or the mistake in their section as an error.
    pub fn get(&self) -> Result<&T> {
        self.0.as_ref().map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// The settings, when their section has no mistake.
    pub fn ok(&self) -> Option<&T> {
        self.0.as_ref().ok()
    }
}

impl Settings {
    /// Resolves every setting: flags, then environment, then `file`, then defaults.
    pub fn resolve(file: FileConfig, over: &Overrides<'_>) -> Self {
        let executors = ExecutorSettings::resolve(&file, over.executor, over.image);
        let model = Section::of(super::model_config(over.model, &file));
        let teams = Section::of(super::teams(&file));
        let defaults = Section::of(super::task_defaults(
            &file,
            executors.default.clone(),
            over.road,
        ));
        let provider = ProviderSettings {
            asked: file.model.provider.clone(),
            named: super::model_named(over.model, &file),
            server_named: super::server_named(over.model, &file),
            models_dir: Section::of(super::models_dir(&file)),
            context_tokens: file.model.context_tokens,
            cache_tokens: file.model.cache_tokens,
            parallel: file.model.parallel,
            draft: file.model.draft.clone(),
        };
        Self {
            file,
            model,
            provider,
            teams,
            defaults,
            executors,
        }
    }
}

impl ExecutorSettings {
    /// Resolves the executors' settings alone, for a command that runs code but no task:
    /// `executor` and `image` are its flags.
    pub fn resolve(file: &FileConfig, executor: Option<&str>, image: Option<&str>) -> Self {
        Self {
            default: super::executor_name(executor, file),
            local: Section::of(super::local_config(file)),
            wasm: Section::of(super::wasm_config(file)),
            docker: Section::of(docker(file, image)),
            kubernetes: Section::of(super::kubernetes_config(file)),
            plugins: file
                .executors
                .plugins
                .iter()
                .map(|(name, section)| {
                    (
                        name.clone(),
                        Section::of(super::plugin_config(name, section)),
                    )
                })
                .collect(),
        }
    }
}

fn docker(file: &FileConfig, image: Option<&str>) -> Result<DockerSettings> {
    let hosts = super::docker_hosts(file, image)?;
    // Only a fleet probes, so only a fleet's probe setting can be wrong.
    let probe = if hosts.is_empty() {
        Duration::from_secs(2)
    } else {
        super::docker_probe(file)?
    };
    let (pool_size, pool_max, pool_idle_secs) = super::docker_pool(file, &hosts)?;
    Ok(DockerSettings {
        one: super::docker_config(file, image)?,
        hosts,
        probe,
        pool_size,
        pool_max,
        pool_idle_secs,
    })
}
