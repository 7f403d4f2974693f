//! The planner's configuration, built one way for both roads: a task in `tandem run`'s own
//! process and a daemon's tasks. What differs between them is decided here, by the caller's
//! arguments, and nowhere else: the executors offered, which one is the default (`auto`
//! decided or not), the policy (a person's own process may use every executor it started;
//! a daemon's clients what the operator allows), and the task defaults of the road
//! ([`crate::config::Road`]: a daemon's task gets a wall-clock limit when nothing sets one).

use std::sync::Arc;

use anyhow::{Context, Result};
use tandem_agent::chat::LocalModel;
use tandem_daemon::{PlannerConfig, Policy};
use tandem_executor::Registry;

use crate::config::Settings;

/// The planner's configuration: `executors` offered, `default` the executor a task gets
/// when it names none, `local` the embedded model when it answers, with its name.
pub async fn config(
    settings: &Settings,
    executors: Registry,
    default: String,
    policy: Policy,
    local: Option<(Arc<dyn LocalModel>, String)>,
) -> Result<PlannerConfig> {
    let policy_own = policy.any_endpoint;
    let mut model = settings.model.get()?.clone();
    let local_model = local.map(|(loaded, name)| {
        model.model = name;
        loaded
    });
    let prices = crate::config::prices(&settings.file)?;
    if !prices.is_empty() && local_model.is_none() {
        check_prices(&prices, &model).await?;
    }
    Ok(PlannerConfig {
        model,
        local_model,
        executors,
        defaults: tandem_daemon::TaskDefaults {
            executor: default,
            ..settings.defaults.get()?.clone()
        },
        policy,
        approval: settings.file.approval.clone(),
        teams: *settings.teams.get()?,
        tools: tandem_agent::tools::Offered::start(settings.file.tools.clone())
            .await
            .context("in [tools] of tandem.toml")?,
        prices,
        network: network(&settings.file, policy_own)?,
        volumes: None,
    })
}

/// The egress proxy and the rules a task's `network` meets: `[network]` as every task's
/// default and bound, `[policy] network_allow` as a client's, checked here at start.
pub fn network(
    file: &crate::config::FileConfig,
    own: bool,
) -> Result<tandem_daemon::NetworkConfig> {
    let base = match &file.network {
        Some(section) => {
            let mut policy = tandem_egress::Policy::parse(&section.allow, &section.deny)
                .context("in [network] of tandem.toml")?;
            policy.max_bytes = section.max_bytes;
            policy.max_connections = section.max_connections;
            policy.max_block_connections = section.max_block_connections;
            policy.resolve = section
                .resolve
                .iter()
                .map(|(name, addrs)| {
                    (
                        name.trim_end_matches('.').to_ascii_lowercase(),
                        addrs.clone(),
                    )
                })
                .collect();
            Some(policy)
        }
        None => None,
    };
    let bound = file
        .policy
        .network_allow
        .as_ref()
        .map(|entries| {
            entries
                .iter()
                .map(|e| tandem_egress::Rule::parse(e))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()
        .context("in [policy] network_allow of tandem.toml")?;
    // A mistake in the file stops the start, named (`?`). What the proxy needs of the
    // machine (its CA, its caches' directories) failing leaves the daemon serving tasks
    // without a network, each task that asks for one told why.
    let packages_section = file.network.as_ref().and_then(|n| n.packages.as_ref());
    let made = match packages_section {
        Some(section) => packages(section, file.network.as_ref())?,
        None => Ok(Vec::new()),
    };
    // Brokered headers, and an https:// index the cache answers inside TLS, each need the
    // proxy's own CA. The secrets are read (and a mistake named) whether or not the
    // caches could be made.
    let https_index = packages_section.is_some_and(|p| {
        [&p.python, &p.npm]
            .into_iter()
            .flatten()
            .any(|url| url.starts_with("https://"))
    });
    let broker = match &file.network {
        Some(section) if !section.secrets.is_empty() || https_index => match broker(section) {
            Ok(broker) => Ok(Some(broker)),
            Err(Down::Config(e)) => return Err(e),
            Err(machine) => Err(machine),
        },
        _ => Ok(None),
    };
    let made = made.and_then(|packages| Ok((packages, broker?)));
    let (egress, egress_down) = match made {
        Ok((packages, broker)) => (
            Some(tandem_egress::Egress::with(
                tandem_egress::ProxyLimits::default(),
                tandem_egress::own_addresses(),
                tandem_egress::Extras { packages, broker },
            )),
            None,
        ),
        Err(Down::Config(e)) => return Err(e),
        Err(Down::Machine(e)) => {
            let why = format!("{e:#}");
            tracing::error!(reason = %why, "the egress proxy cannot start: no task gets a network");
            (None, Some(why))
        }
    };
    Ok(tandem_daemon::NetworkConfig {
        egress,
        egress_down,
        rules: tandem_egress::Network { base, bound, own },
        switches: switches(file),
    })
}

/// Why the egress proxy's parts could not be made.
enum Down {
    /// A mistake in tandem.toml: the start stops, naming it.
    Config(anyhow::Error),
    /// The machine would not give what the proxy needs: the daemon runs without it.
    Machine(anyhow::Error),
}

impl From<anyhow::Error> for Down {
    fn from(e: anyhow::Error) -> Self {
        Down::Config(e)
    }
}

/// What each built-in executor's `network` setting gives its tasks: the one set, else
/// `policy`.
pub fn switches(
    file: &crate::config::FileConfig,
) -> std::collections::HashMap<String, tandem_egress::Switch> {
    use crate::config::NetworkSwitch;
    [
        ("docker", file.executors.docker.network),
        ("local", file.executors.local.network),
    ]
    .into_iter()
    .map(|(name, set)| {
        let switch = match NetworkSwitch::resolve(set) {
            NetworkSwitch::Off => tandem_egress::Switch::Off,
            NetworkSwitch::Open => tandem_egress::Switch::Open,
            NetworkSwitch::Policy => tandem_egress::Switch::Policy,
        };
        (name.to_owned(), switch)
    })
    .collect()
}

/// The secrets `[network.secrets]` names, each value read now (a missing one is named), and
/// the CA brokered HTTPS needs.
fn broker(
    section: &crate::config::NetworkSection,
) -> std::result::Result<Arc<tandem_egress::Broker>, Down> {
    let mut secrets = Vec::new();
    for (name, secret) in &section.secrets {
        let value = match (&secret.value_env, &secret.value_file) {
            (Some(var), None) => std::env::var(var).map_err(|_| {
                anyhow::anyhow!(
                    "in [network.secrets.{name}] of tandem.toml: value_env = {var:?}, but the daemon's environment has no {var}; set it where Tandem starts"
                )
            })?,
            (None, Some(path)) => std::fs::read_to_string(path)
                .map_err(|e| {
                    anyhow::anyhow!(
                        "in [network.secrets.{name}] of tandem.toml: value_file {}: {e}",
                        path.display()
                    )
                })?
                .trim_end_matches(['\n', '\r'])
                .to_owned(),
            _ => {
                return Err(Down::Config(anyhow::anyhow!(
                    "in [network.secrets.{name}] of tandem.toml: give the header's value as exactly one of value_env (a variable of the daemon's environment) or value_file (a file); a value is never written in the file itself"
                )));
            }
        };
        if value.is_empty() {
            return Err(Down::Config(anyhow::anyhow!(
                "in [network.secrets.{name}] of tandem.toml: its value is empty"
            )));
        }
        secrets.push(
            tandem_egress::Secret::new(name, &secret.host, &secret.header, value)
                .map_err(|e| Down::Config(e.into()))?,
        );
    }
    let dir = match &section.ca_dir {
        Some(dir) => dir.clone(),
        None => crate::config::default_state_dir().join("egress-ca"),
    };
    let ca = tandem_egress::Ca::load_or_make(&dir).map_err(|e| {
        Down::Machine(anyhow::anyhow!(
            "{e}; set [network] ca_dir to a directory the daemon can write"
        ))
    })?;
    Ok(Arc::new(
        tandem_egress::Broker::new(secrets, ca, &section.upstream_ca)
            .map_err(|e| Down::Config(e.into()))?,
    ))
}

/// The package caches `[network.packages]` asks for (Python's, npm's), checked at start.
/// A mistake in the section is the outer error; a cache the machine would not make, the
/// inner one.
fn packages(
    section: &crate::config::PackagesSection,
    network: Option<&crate::config::NetworkSection>,
) -> Result<std::result::Result<Vec<Arc<tandem_egress::Packages>>, Down>> {
    let dir = match &section.cache_dir {
        Some(dir) => dir.clone(),
        None => crate::config::xdg_dir("XDG_CACHE_HOME", ".cache")
            .map(|d| d.join("packages"))
            .unwrap_or_else(|| std::env::temp_dir().join("tandem-packages")),
    };
    let max_bytes = section
        .max_cache_mb
        .unwrap_or(2048)
        .saturating_mul(1024 * 1024);
    let mut caches = Vec::new();
    // Each index has a cache of its own, within the bound; Python's keeps the directory
    // itself, as before npm had one.
    for (index, kind, dir) in [
        (
            "python",
            &section.python,
            tandem_egress::packages::Kind::Python,
            dir.clone(),
        ),
        (
            "npm",
            &section.npm,
            tandem_egress::packages::Kind::Npm,
            dir.join("npm"),
        ),
    ]
    .into_iter()
    // Every index is checked before any cache is made: a mistake in the file is named even
    // when the machine would refuse a cache.
    .filter_map(|(key, url, kind, dir)| Some((key, url.as_ref()?, kind, dir)))
    .map(|(key, url, kind, dir)| {
        tandem_egress::IndexUrl::parse(url)
            .with_context(|| format!("in [network.packages] {key} of tandem.toml"))
            .map(|index| (index, kind, dir))
    })
    .collect::<Result<Vec<_>>>()?
    {
        let resolve = network
            .and_then(|n| {
                n.resolve
                    .iter()
                    .find(|(name, _)| name.trim_end_matches('.').eq_ignore_ascii_case(&index.host))
                    .map(|(_, addrs)| addrs.clone())
            })
            .unwrap_or_default();
        let cache = match tandem_egress::Packages::new(index, dir.clone(), max_bytes, resolve)
            .with_context(|| {
                format!(
                    "the package cache in {} (set [network.packages] cache_dir to a directory the daemon can write)",
                    dir.display()
                )
            }) {
            Ok(cache) => cache.of_kind(kind),
            Err(e) => return Ok(Err(Down::Machine(e))),
        };
        caches.push(Arc::new(cache));
    }
    Ok(Ok(caches))
}

/// A price for a model the server does not serve is a mistake (a typo, a renamed model) that
/// would leave `max_cost` uncounted: refused at start, naming it. The configured model is
/// always known; others must be in the server's `GET /models` list. A server that cannot be
/// asked cannot refuse a name: that is logged, not fatal, since tasks may run without it.
async fn check_prices(
    prices: &std::collections::BTreeMap<String, tandem_agent::budget::Price>,
    model: &tandem_agent::ModelConfig,
) -> Result<()> {
    let others: Vec<&String> = prices.keys().filter(|n| **n != model.model).collect();
    if others.is_empty() {
        return Ok(());
    }
    let url = format!("{}/models", model.base_url.trim_end_matches('/'));
    let listed = match list_models(&url, model.api_key.as_deref()).await {
        Ok(listed) => listed,
        Err(e) => {
            tracing::warn!(%url, error = %e, "could not list the model server's models to check [model.prices]");
            return Ok(());
        }
    };
    if let Some(unknown) = others.iter().find(|n| !listed.contains(**n)) {
        let served = if listed.is_empty() {
            "none".to_owned()
        } else {
            listed.join(", ")
        };
        anyhow::bail!(
            "[model.prices.\"{unknown}\"]: the model server at {} serves no model of that name (it serves: {served}); correct the name or remove its price",
            model.base_url
        );
    }
    Ok(())
}

/// The ids an OpenAI-compatible `GET /models` lists.
async fn list_models(url: &str, key: Option<&str>) -> Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Listed {
        data: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        id: String,
    }
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()?;
    let mut request = client.get(url);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let body = request.send().await?.error_for_status()?.bytes().await?;
    let listed: Listed = serde_json::from_slice(&body)?;
    Ok(listed.data.into_iter().map(|e| e.id).collect())
}
