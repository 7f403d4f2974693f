//! What API clients may ask of a shared daemon: which executors, which model endpoints, and
//! how long and how much. The operator sets it once (`[policy]` in `tandem.toml`); a task can
//! only stay within it, and asking for more is a 400 that names the setting.

use std::time::Duration;

use tandem_executor::{Limits, Registry};
use tandem_protocol::{TaskLimits, TaskSpec};

/// The executor that is no boundary: offered to clients only when the operator lists it.
pub const LOCAL: &str = "local";

/// A model endpoint tasks may name, and the key sent there (never another endpoint's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Base URL, as tasks name it (a trailing `/` is ignored).
    pub base_url: String,
    /// Bearer token for this endpoint only.
    pub api_key: Option<String>,
}

/// The operator's policy for API clients.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Executors tasks may use; `None` offers every registered executor but `local`.
    pub executors: Option<Vec<String>>,
    /// Endpoints a task may name besides the configured model server.
    pub endpoints: Vec<Endpoint>,
    /// Longest `timeout_secs` a task may ask for.
    pub max_timeout: Duration,
    /// Longest `block_timeout_secs` a task may ask for.
    pub max_block_timeout: Duration,
    /// Most `max_turns` a task may ask for.
    pub max_turns: u32,
    /// Most `candidates` a task may ask for; a task that asks for none gets the default within
    /// it. Each is a whole generation of the model's.
    pub max_candidates: u32,
    /// Whether a task may name any model server (a run in the user's own process); one that
    /// is neither the configured server nor listed gets no key.
    pub any_endpoint: bool,
    /// Most `max_input_tokens`, `max_output_tokens` and `max_cost` a task may ask for; a task
    /// that asks for none gets the cap as its budget.
    pub budget: tandem_agent::budget::Budget,
}

/// Defaults for a daemon whose operator set nothing.
pub const DEFAULT_MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// See [`Policy::max_block_timeout`].
pub const DEFAULT_MAX_BLOCK_TIMEOUT: Duration = Duration::from_secs(3600);
/// See [`Policy::max_turns`].
pub const DEFAULT_MAX_TURNS: u32 = 100;

impl Default for Policy {
    fn default() -> Self {
        Self {
            executors: None,
            endpoints: Vec::new(),
            max_timeout: DEFAULT_MAX_TIMEOUT,
            max_block_timeout: DEFAULT_MAX_BLOCK_TIMEOUT,
            max_turns: DEFAULT_MAX_TURNS,
            max_candidates: tandem_agent::team::MOST_CANDIDATES,
            any_endpoint: false,
            budget: tandem_agent::budget::Budget::default(),
        }
    }
}

/// A request the policy refuses; the message names the setting that would allow it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

impl Policy {
    /// The policy of a task run in the user's own process: every executor in `executors`,
    /// any model server, and no caps (the user is the operator).
    pub fn own(executors: Vec<String>) -> Self {
        Self {
            executors: Some(executors),
            endpoints: Vec::new(),
            max_timeout: Duration::MAX,
            max_block_timeout: Duration::MAX,
            max_turns: u32::MAX,
            max_candidates: tandem_agent::team::MOST_CANDIDATES,
            any_endpoint: true,
            budget: tandem_agent::budget::Budget::default(),
        }
    }

    /// Whether API clients may use executor `name`.
    pub fn offers(&self, name: &str) -> bool {
        match &self.executors {
            Some(list) => list.iter().any(|e| e == name),
            None => name != LOCAL,
        }
    }

    /// The registered executors clients may use, in the registry's order.
    pub fn offered(&self, registry: &Registry) -> Vec<String> {
        registry
            .names()
            .into_iter()
            .filter(|n| self.offers(n))
            .map(str::to_owned)
            .collect()
    }

    /// Why `name` is not offered, for errors and `/v1/executors`.
    pub fn not_offered(&self, name: &str, registry: &Registry) -> String {
        let offered = self.offered(registry);
        let offered = if offered.is_empty() {
            "none".to_owned()
        } else {
            offered.join(", ")
        };
        if name == LOCAL {
            format!(
                "executor `local` is not offered to API clients: it runs code as the daemon's user, with no boundary around the daemon's files; offered: {offered}. An operator who accepts that lists it under [policy] executors in tandem.toml; on your own machine `tandem run --local --executor local` runs it in your process"
            )
        } else {
            format!(
                "executor `{name}` is not offered to API clients; offered: {offered} (an operator lists executors under [policy] executors in tandem.toml)"
            )
        }
    }

    /// Checks what a task asks for against the caps and endpoints; `configured` is the
    /// daemon's own model server.
    pub fn check(&self, spec: &TaskSpec, configured: &str) -> Result<(), Refused> {
        let over = |what: &str, asked: u64, cap: u64, key: &str| {
            Refused(format!(
                "{what} {asked} is above this daemon's cap of {cap}; ask for less, or raise {key} under [policy] in the daemon's config"
            ))
        };
        if let Some(asked) = spec.timeout_secs {
            let cap = self.max_timeout.as_secs();
            if asked > cap {
                return Err(over("timeout_secs", asked, cap, "max_timeout_secs"));
            }
        }
        if let Some(asked) = spec.block_timeout_secs {
            let cap = self.max_block_timeout.as_secs();
            if asked > cap {
                return Err(over(
                    "block_timeout_secs",
                    asked,
                    cap,
                    "max_block_timeout_secs",
                ));
            }
        }
        if let Some(asked) = spec.max_turns
            && asked > self.max_turns
        {
            return Err(over(
                "max_turns",
                asked.into(),
                self.max_turns.into(),
                "max_turns",
            ));
        }
        if let Some(asked) = spec.candidates
            && asked > self.max_candidates
        {
            return Err(over(
                "candidates",
                asked.into(),
                self.max_candidates.into(),
                "max_candidates",
            ));
        }
        let caps = &self.budget;
        for (key, asked, cap) in [
            (
                "max_input_tokens",
                spec.max_input_tokens,
                caps.max_input_tokens,
            ),
            (
                "max_output_tokens",
                spec.max_output_tokens,
                caps.max_output_tokens,
            ),
        ] {
            if let (Some(asked), Some(cap)) = (asked, cap)
                && asked > cap
            {
                return Err(over(key, asked, cap, key));
            }
        }
        if let (Some(asked), Some(cap)) = (spec.max_cost, caps.max_cost)
            && asked > cap
        {
            return Err(Refused(format!(
                "max_cost {asked} is above this daemon's cap of {cap}; ask for less, or raise max_cost under [policy] in the daemon's config"
            )));
        }
        if let Some(url) = &spec.base_url {
            self.endpoint(url, configured)?;
        }
        Ok(())
    }

    /// The endpoint a task's `base_url` names: `None` for the configured server (which keeps
    /// its own key), else the listed endpoint; anything else is refused.
    pub fn endpoint(&self, url: &str, configured: &str) -> Result<Option<Endpoint>, Refused> {
        let url = normalise(url);
        if url == normalise(configured) {
            return Ok(None);
        }
        if let Some(e) = self
            .endpoints
            .iter()
            .find(|e| normalise(&e.base_url) == url)
        {
            return Ok(Some(e.clone()));
        }
        if self.any_endpoint {
            return Ok(Some(Endpoint {
                base_url: url.to_owned(),
                api_key: None,
            }));
        }
        let mut allowed = vec![normalise(configured)];
        allowed.extend(self.endpoints.iter().map(|e| normalise(&e.base_url)));
        Err(Refused(format!(
            "base_url `{url}` is not a model endpoint this daemon allows; allowed: {}. An operator adds endpoints under [[policy.model_endpoints]] in tandem.toml",
            allowed.join(", ")
        )))
    }
}

fn normalise(url: &str) -> &str {
    url.trim().trim_end_matches('/')
}

/// The daemon's limits tightened by a task's; a task that asks for more than the daemon
/// allows is refused rather than quietly capped.
pub fn task_limits(daemon: &Limits, asked: &TaskLimits) -> Result<Limits, String> {
    fn tighten(
        name: &str,
        ceiling: Option<u64>,
        asked: Option<u64>,
    ) -> Result<Option<u64>, String> {
        match (ceiling, asked) {
            (_, Some(0)) => Err(format!("limits.{name} must be at least 1")),
            (Some(max), Some(n)) if n > max => Err(format!(
                "limits.{name} {n} is above this daemon's limit of {max}; ask for less, or raise {name} under [limits] in the daemon's config"
            )),
            (_, Some(n)) => Ok(Some(n)),
            (ceiling, None) => Ok(ceiling),
        }
    }
    let mut limits = daemon.clone();
    limits.memory_bytes = tighten("memory_bytes", daemon.memory_bytes, asked.memory_bytes)?;
    limits.cpu_secs = tighten("cpu_secs", daemon.cpu_secs, asked.cpu_secs)?;
    limits.file_size_bytes = tighten(
        "file_size_bytes",
        daemon.file_size_bytes,
        asked.file_size_bytes,
    )?;
    let output_ceiling = u64::try_from(daemon.output_bytes).unwrap_or(u64::MAX);
    if let Some(n) = tighten("output_bytes", Some(output_ceiling), asked.output_bytes)? {
        limits.output_bytes = usize::try_from(n).unwrap_or(daemon.output_bytes);
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(f: impl FnOnce(&mut TaskSpec)) -> TaskSpec {
        let mut s = TaskSpec {
            task: "t".to_owned(),
            ..TaskSpec::default()
        };
        f(&mut s);
        s
    }

    #[test]
    fn local_is_offered_only_when_listed() {
        let default = Policy::default();
        assert!(!default.offers("local"));
        assert!(default.offers("docker") && default.offers("wasm"));
        let listed = Policy {
            executors: Some(vec!["local".to_owned()]),
            ..Policy::default()
        };
        assert!(listed.offers("local"));
        assert!(!listed.offers("docker"));
    }

    #[test]
    fn caps_and_endpoints_are_named_when_refused() {
        let policy = Policy {
            endpoints: vec![Endpoint {
                base_url: "http://127.0.0.1:9/v1/".to_owned(),
                api_key: Some("other".to_owned()),
            }],
            ..Policy::default()
        };
        let configured = "http://127.0.0.1:8/v1";
        let check = |s: TaskSpec| policy.check(&s, configured).map_err(|e| e.0);
        assert_eq!(
            check(spec(|s| s.block_timeout_secs = Some(u64::MAX))),
            Err("block_timeout_secs 18446744073709551615 is above this daemon's cap of 3600; ask for less, or raise max_block_timeout_secs under [policy] in the daemon's config".to_owned())
        );
        assert!(check(spec(|s| s.timeout_secs = Some(86_401))).is_err());
        assert!(check(spec(|s| s.max_turns = Some(101))).is_err());
        assert_eq!(check(spec(|s| s.max_turns = Some(100))), Ok(()));
        let two = Policy {
            max_candidates: 2,
            ..Policy::default()
        };
        assert_eq!(
            two.check(&spec(|s| s.candidates = Some(3)), configured)
                .map_err(|e| e.0),
            Err("candidates 3 is above this daemon's cap of 2; ask for less, or raise max_candidates under [policy] in the daemon's config".to_owned())
        );
        assert_eq!(
            two.check(&spec(|s| s.candidates = Some(2)), configured)
                .map_err(|e| e.0),
            Ok(())
        );
        assert_eq!(
            check(spec(|s| s.base_url = Some("http://127.0.0.1:1234/v1".to_owned()))),
            Err("base_url `http://127.0.0.1:1234/v1` is not a model endpoint this daemon allows; allowed: http://127.0.0.1:8/v1, http://127.0.0.1:9/v1. An operator adds endpoints under [[policy.model_endpoints]] in tandem.toml".to_owned())
        );
        assert_eq!(
            policy.endpoint("http://127.0.0.1:8/v1/", configured),
            Ok(None)
        );
        assert_eq!(
            policy
                .endpoint("http://127.0.0.1:9/v1", configured)
                .map(|e| e.and_then(|e| e.api_key.clone())),
            Ok(Some("other".to_owned()))
        );
    }
}

/// When idle API sessions are paused, and how long a paused one is kept.
#[derive(Clone, Copy, Debug)]
pub struct Pausing {
    /// Pause a session unused this long; `None`: idle sessions are closed, never paused.
    pub after: Option<Duration>,
    /// Close a paused session (and remove what was saved) once unused this long.
    pub keep: Duration,
}

impl Default for Pausing {
    fn default() -> Self {
        Self {
            after: None,
            keep: Duration::from_secs(7 * 24 * 3600),
        }
    }
}
