//! The flags of a task, the same for `run` and `submit`, and the task spec they make.

use std::path::PathBuf;

use anyhow::{Context, Result};
use tandem_protocol::team::TeamBounds;
use tandem_protocol::{ApprovalMode, ApprovalPolicy, TaskSpec};

use crate::config::{FileConfig, ModelFlags};

/// What a task asks for, the same for `run` and `submit`.
#[derive(Debug, clap::Args)]
pub struct TaskFlags {
    /// The task, in words
    pub(crate) task: String,
    /// Executor that runs the code: auto, docker, kubernetes, wasm, local or an [executors.NAME] plugin [env: TANDEM_EXECUTOR; default: auto, or the daemon's]
    #[arg(long, short = 'e')]
    pub(crate) executor: Option<String>,
    /// Most assistant turns [default: 10, 50 for a team]
    #[arg(long)]
    pub(crate) max_turns: Option<u32>,
    /// Most prompt tokens the task's model calls may send, all together; reached, the task
    /// stops with stop reason `budget`, its work kept [default: [task] max_input_tokens]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_input_tokens: Option<u64>,
    /// Most tokens the task's model may write, all together [default: [task]
    /// max_output_tokens]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_output_tokens: Option<u64>,
    /// Most the task's model calls may cost, at the [model.prices] of its model [default:
    /// [task] max_cost]
    #[arg(long, value_parser = cost)]
    pub(crate) max_cost: Option<f64>,
    /// A JSON Schema file: the task's final answer must end with a JSON value matching it,
    /// asked again when it does not; the value is the record's `result` (`--json`: in the
    /// last event)
    #[arg(long, value_name = "FILE")]
    pub(crate) output_schema: Option<PathBuf>,
    /// Wall-clock limit for the whole task, in seconds (a daemon takes whole seconds)
    #[arg(long, value_parser = seconds)]
    pub(crate) timeout: Option<f64>,
    /// Wall-clock limit per code block, in seconds [default: 60]
    #[arg(long, value_parser = seconds)]
    pub(crate) block_timeout: Option<f64>,
    /// File whose text replaces the default system prompt
    #[arg(long)]
    system_prompt: Option<PathBuf>,
    /// Word that ends the task when the assistant says it [default: TERMINATE]
    #[arg(long)]
    pub(crate) termination: Option<String>,
    /// Run only blocks in this language (repeat for more) [default: all the executor runs]
    #[arg(long = "language", short = 'l', value_name = "LANGUAGE")]
    languages: Vec<String>,
    /// Solve the task with this team of agents (a team file: docs/teams.md) instead of the
    /// assistant and executor pair
    #[arg(long)]
    pub(crate) team: Option<PathBuf>,
    /// Give the task this file, or this directory whole (repeat for more): it is in the
    /// working directory of every block, and the model is told its name, size and first lines
    #[arg(long = "file", value_name = "PATH")]
    pub(crate) files: Vec<PathBuf>,
    /// Run the task's Python blocks in one interpreter whose variables survive from block to
    /// block, as in a notebook (local and docker) [default: a fresh process per block]
    #[arg(long)]
    pub(crate) keep_state: bool,
    /// How the model's code reaches the executor: fenced blocks, the execute_code tool, or
    /// the tool where the model server takes tools [default: [model] code_via, else blocks]
    #[arg(long, value_name = "blocks|tool|auto")]
    pub(crate) code_via: Option<tandem_protocol::CodeVia>,
    /// After the first run that failed, draw this many replies at once and keep the one whose code
    /// holds the most of the examples the task states (1 to 8) [default: 4]
    #[arg(long, value_name = "K")]
    pub(crate) candidates: Option<u32>,
    /// Offer the model this one of the configured [tools.NAME] (repeat for more)
    /// [default: every configured tool]
    #[arg(long = "tool", value_name = "NAME")]
    pub(crate) tools: Vec<String>,
    /// Run the task's sandbox on a Docker host carrying this label (repeat for more):
    /// [[executors.docker.hosts]] labels
    #[arg(long = "placement", value_name = "KEY=VALUE", value_parser = placement_label)]
    pub(crate) placement: Vec<(String, String)>,
    /// Let the task's sandboxes reach this host through Tandem's egress proxy (repeat for
    /// more): HOST, *.DOMAIN, HOST:PORT or CIDR[:PORT], port 80 and 443 when none is given;
    /// a daemon allows only what its operator does [default: [network] allow, else no
    /// network]
    #[arg(long = "allow-host", value_name = "HOST[:PORT]", value_parser = allow_entry)]
    pub(crate) allow_hosts: Vec<String>,
    /// Start the task's workspace as this snapshot's (`tandem snapshot ls`); on a daemon
    #[arg(long = "from", value_name = "SNAPSHOT")]
    pub(crate) from_snapshot: Option<String>,
    /// Mount a volume (`tandem volume create`) into the task's sandboxes (repeat for more):
    /// PATH inside the workspace (`data`), or absolute (`/data`) on docker; `:ro` for read-only
    #[arg(long = "volume", value_name = "NAME:PATH[:ro]", value_parser = tandem_protocol::volume::VolumeMount::parse)]
    pub(crate) volumes: Vec<tandem_protocol::volume::VolumeMount>,
}

/// An entry of `--allow-host`, checked as `[network] allow` checks its own.
pub(crate) fn allow_entry(text: &str) -> Result<String, String> {
    tandem_egress::Rule::parse(text)
        .map(|r| r.text)
        .map_err(|e| e.why)
}

/// A positive number of seconds that a [`std::time::Duration`] holds.
fn seconds(text: &str) -> Result<f64, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number of seconds"))?;
    crate::config::positive_secs(secs).map(|_| secs)
}

/// The JSON in `--output-schema FILE`; whether it is a schema is the planner's to say.
fn read_schema(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the output schema file {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "--output-schema {}: not JSON (a JSON Schema is a JSON object)",
            path.display()
        )
    })
}

/// A cost above 0, as `--max-cost` takes it.
fn cost(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(c) if c.is_finite() && c > 0.0 => Ok(c),
        _ => Err(format!(
            "`{text}` is not a cost above 0 (in the currency of [model.prices], such as 0.50)"
        )),
    }
}

/// `KEY=VALUE`, as `--placement` takes it.
fn placement_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
        _ => Err(format!(
            "`{text}` is not KEY=VALUE (a host label, such as gpu=yes)"
        )),
    }
}

impl TaskFlags {
    /// The task they ask for, as a daemon is sent it: with the system prompt read and a team
    /// file read and checked within `bounds` (a mistake in either is told with its path);
    /// `approve` has every block asked about.
    pub(crate) fn spec(
        &self,
        model: &ModelFlags,
        approve: bool,
        file: &FileConfig,
        bounds: &TeamBounds,
    ) -> Result<TaskSpec> {
        let system_prompt = match self
            .system_prompt
            .as_ref()
            .or(file.task.system_prompt_file.as_ref())
        {
            Some(path) => Some(std::fs::read_to_string(path).with_context(|| {
                format!("cannot read the system prompt file {}", path.display())
            })?),
            None => None,
        };
        Ok(TaskSpec {
            task: self.task.clone(),
            executor: self.executor.clone(),
            model: model.model.clone(),
            base_url: model.base_url.clone(),
            system_prompt,
            termination: self.termination.clone(),
            languages: (!self.languages.is_empty()).then(|| self.languages.clone()),
            team: self
                .team
                .as_deref()
                .map(|path| crate::team::load_spec(path, bounds))
                .transpose()?,
            approval: approve.then(always),
            keep_state: self.keep_state,
            code_via: self.code_via,
            candidates: self.candidates,
            placement: self.placement.iter().cloned().collect(),
            network: (!self.allow_hosts.is_empty()).then(|| tandem_protocol::net::NetworkRequest {
                allow: self.allow_hosts.clone(),
            }),
            from_snapshot: self.from_snapshot.clone(),
            volumes: self.volumes.clone(),
            max_input_tokens: self.max_input_tokens,
            max_output_tokens: self.max_output_tokens,
            max_cost: self.max_cost,
            output_schema: self.output_schema.as_deref().map(read_schema).transpose()?,
            tools: (!self.tools.is_empty()).then(|| {
                self.tools
                    .iter()
                    .map(|t| tandem_protocol::ToolRef::Name(t.clone()))
                    .collect()
            }),
            ..TaskSpec::default()
        })
    }

    /// The task for a daemon, which checks a team within its own bounds and takes limits in
    /// whole seconds.
    pub(crate) fn daemon_spec(
        &self,
        model: &ModelFlags,
        approve: bool,
        file: &FileConfig,
    ) -> Result<TaskSpec> {
        // Checked by clap as positive and within a Duration.
        let whole_secs = |secs: f64| (secs as u64).max(1);
        let mut spec = self.spec(model, approve, file, &TeamBounds::CEILINGS)?;
        spec.max_turns = self.max_turns;
        spec.timeout_secs = self.timeout.map(whole_secs);
        spec.block_timeout_secs = self.block_timeout.map(whole_secs);
        Ok(spec)
    }
}

/// `--approve`: every block is asked about.
fn always() -> ApprovalPolicy {
    ApprovalPolicy {
        mode: ApprovalMode::Always,
        ..ApprovalPolicy::default()
    }
}
