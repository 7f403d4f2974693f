//! Which model answers: an OpenAI-compatible server, or the embedded model run in this
//! process. Decided once per command from `[model] provider`, or, when that is not set, by
//! whether a server is named at all.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use tandem_agent::ChatModel;
use tandem_agent::chat::LocalModel;
use tandem_model_embedded::{Embedded, EmbeddedChat, EmbeddedConfig};
use tandem_model_files::ModelDir;

use crate::config::{ProviderSettings, Settings};

/// The file of `[model] draft`, when one is set: a `.gguf` path, or a pulled catalog model.
pub fn draft(settings: &ProviderSettings) -> Result<Option<PathBuf>> {
    let Some(name) = settings.draft.as_deref() else {
        return Ok(None);
    };
    if name.ends_with(".gguf") {
        let path = PathBuf::from(name);
        anyhow::ensure!(path.is_file(), "[model] draft: no model file at {name}");
        return Ok(Some(path));
    }
    let spec = tandem_model_files::find(name).map_err(|e| anyhow::anyhow!("[model] draft: {e}"))?;
    let dir = ModelDir::new(settings.models_dir.get()?.clone());
    match dir.installed(&spec) {
        Some(path) => Ok(Some(path)),
        None => bail!("[model] draft `{name}` is not pulled: run `tandem model pull {name}`"),
    }
}

/// The embedded model that could not be loaded: every request fails with the reason.
pub struct Unloadable {
    reason: String,
}

impl Unloadable {
    /// Stands for the model `name`, which failed to load because of `reason`.
    pub fn new(name: &str, reason: &str) -> Self {
        Self {
            reason: format!(
                "the embedded model {name} could not be loaded when the daemon started: {reason}"
            ),
        }
    }
}

impl LocalModel for Unloadable {
    fn complete<'a>(
        &'a self,
        _: &'a [tandem_protocol::Message],
        _: Option<&'a tandem_agent::chat::ToolOffer>,
        _: &'a tandem_agent::ModelConfig,
        _: &'a mut (dyn FnMut(tandem_agent::chat::ModelProgress<'_>) + Send),
    ) -> futures::future::BoxFuture<
        'a,
        Result<tandem_agent::chat::Completion, tandem_agent::chat::ModelError>,
    > {
        let error = tandem_agent::chat::ModelError::new(
            tandem_protocol::ErrorCode::ModelUnavailable,
            self.reason.clone(),
        );
        Box::pin(async move { Err(error) })
    }

    fn describe(&self) -> String {
        "the embedded engine (not loaded)".to_owned()
    }
}

/// The choice, before anything is loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Provider {
    /// An OpenAI-compatible server.
    Server,
    /// A GGUF file run in this process, under this name.
    Embedded {
        /// The catalog name, or the file's name.
        name: String,
        /// The file.
        path: PathBuf,
    },
}

/// What to say when there is no model at all.
pub const NO_MODEL: &str = "no model to talk to: set OPENAI_API_KEY (for OpenAI) or OPENAI_BASE_URL (for any OpenAI-compatible server), or run `tandem model pull` once for a model that runs inside Tandem with no key and no network";

/// Decides the provider from the settings.
pub fn choose(settings: &ProviderSettings) -> Result<Provider> {
    let named = settings.named.as_deref();
    match settings.asked.as_deref() {
        Some("openai") => Ok(Provider::Server),
        Some("embedded") => embedded(named, settings)?.context(
            "[model] provider is embedded but no model file is there: run `tandem model pull`",
        ),
        Some(other) => bail!("[model] provider must be embedded or openai, got `{other}`"),
        None => {
            if settings.server_named {
                return Ok(Provider::Server);
            }
            match embedded(named, settings)? {
                Some(found) => Ok(found),
                None => bail!("{NO_MODEL}"),
            }
        }
    }
}

/// The embedded model `name` names (a catalog name or a `.gguf` path), or the first pulled
/// one; `None` when there is none.
fn embedded(name: Option<&str>, settings: &ProviderSettings) -> Result<Option<Provider>> {
    let dir = ModelDir::new(settings.models_dir.get()?.clone());
    if let Some(name) = name {
        if name.ends_with(".gguf") {
            let path = PathBuf::from(name);
            anyhow::ensure!(path.is_file(), "no model file at {name}");
            return Ok(Some(Provider::Embedded {
                name: path
                    .file_stem()
                    .map_or_else(|| name.to_owned(), |s| s.to_string_lossy().into_owned()),
                path,
            }));
        }
        if let Ok(spec) = tandem_model_files::find(name) {
            return Ok(dir.installed(&spec).map(|path| Provider::Embedded {
                name: spec.name,
                path,
            }));
        }
    }
    Ok(dir
        .first_installed()
        .map(|(spec, path)| Provider::Embedded {
            name: spec.name,
            path,
        }))
}

/// Loads the embedded model off the async runtime.
pub async fn load(
    name: &str,
    path: PathBuf,
    settings: &ProviderSettings,
) -> Result<Arc<dyn LocalModel>> {
    let mut config = EmbeddedConfig::for_cores(
        std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get),
    );
    if let Some(n) = settings.context_tokens {
        config.context_tokens = n;
    }
    if let Some(n) = settings.cache_tokens {
        config.cache_tokens = n;
    }
    if let Some(n) = settings.parallel {
        config.parallel = n;
    }
    // The cache holds at least one whole conversation.
    config.cache_tokens = config.cache_tokens.max(config.context_tokens);
    config.draft = draft(settings)?;
    let engine = tokio::task::spawn_blocking(move || Embedded::load(&path, config))
        .await
        .context("loading the embedded model stopped")??;
    tracing::info!(
        model = name,
        load_ms = engine.load_time().as_millis() as u64,
        "embedded model loaded"
    );
    Ok(Arc::new(EmbeddedChat::new(engine, name)))
}

/// The embedded model of a command run in this process, loaded, with its name, when that is
/// the one that answers; `None` when a server does (checked now, so a bad setting is told
/// before any sandbox starts).
pub async fn local_model(settings: &Settings) -> Result<Option<(Arc<dyn LocalModel>, String)>> {
    match choose(&settings.provider)? {
        Provider::Server => {
            ChatModel::check(settings.model.get()?)?;
            Ok(None)
        }
        Provider::Embedded { name, path } => {
            Ok(Some((load(&name, path, &settings.provider).await?, name)))
        }
    }
}
