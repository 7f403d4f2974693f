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
    let mut model = settings.model.get()?.clone();
    let local_model = local.map(|(loaded, name)| {
        model.model = name;
        loaded
    });
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
    })
}
