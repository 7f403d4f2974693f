//! `tandem run`: one task, in this process.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tandem_daemon::plan::Start;
use tandem_daemon::{Planner, PlannerConfig, Policy, TaskDefaults};
use tandem_executor::{CancellationToken, Registry};
use tandem_protocol::team::{Kind, TeamBounds};
use tandem_protocol::{ApprovalMode, ApprovalPolicy, EventMsg, TaskSpec};

use crate::config::{self, FileConfig, ModelFlags};
use crate::exit;
use crate::render::{Mode, Renderer};

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
    /// Wall-clock limit for the whole task, in seconds (a daemon takes whole seconds)
    #[arg(long)]
    pub(crate) timeout: Option<f64>,
    /// Wall-clock limit per code block, in seconds [default: 60]
    #[arg(long)]
    pub(crate) block_timeout: Option<f64>,
    /// File whose text replaces the default system prompt
    #[arg(long)]
    system_prompt: Option<PathBuf>,
    /// Word that ends the task when the assistant says it [default: TERMINATE]
    #[arg(long)]
    termination: Option<String>,
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
    /// Offer the model this one of the configured [tools.NAME] (repeat for more)
    /// [default: every configured tool]
    #[arg(long = "tool", value_name = "NAME")]
    pub(crate) tools: Vec<String>,
    /// Run the task's sandbox on a Docker host carrying this label (repeat for more):
    /// [[executors.docker.hosts]] labels
    #[arg(long = "placement", value_name = "KEY=VALUE", value_parser = placement_label)]
    pub(crate) placement: Vec<(String, String)>,
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
    fn spec(
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
            placement: self.placement.iter().cloned().collect(),
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
        let whole_secs = |secs: f64, flag: &str| -> Result<u64> {
            let d = config::secs_to_duration(secs, flag)?;
            Ok(d.as_secs().max(1))
        };
        let mut spec = self.spec(model, approve, file, &TeamBounds::CEILINGS)?;
        spec.max_turns = self.max_turns;
        spec.timeout_secs = self
            .timeout
            .map(|s| whole_secs(s, "--timeout"))
            .transpose()?;
        spec.block_timeout_secs = self
            .block_timeout
            .map(|s| whole_secs(s, "--block-timeout"))
            .transpose()?;
        Ok(spec)
    }
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub(crate) flags: TaskFlags,
    /// Docker image for the docker executor [env: TANDEM_DOCKER_IMAGE; default: python:3.12-slim]
    #[arg(long)]
    pub(crate) image: Option<String>,
    #[command(flatten)]
    pub(crate) model: ModelFlags,
    /// Use this directory as the workspace and keep it
    #[arg(long)]
    pub(crate) workdir: Option<PathBuf>,
    /// Print one JSON event per line
    #[arg(long)]
    pub(crate) json: bool,
    /// Run in this process even when a daemon is reachable
    #[arg(long)]
    pub(crate) local: bool,
    /// Ask at the terminal before each code block runs: [y]es / [n]o / [e]dit / [a]lways
    #[arg(long)]
    pub(crate) approve: bool,
    #[command(flatten)]
    pub(crate) host: crate::client::HostFlag,
}

pub async fn run(args: RunArgs, file: FileConfig) -> Result<u8> {
    if args.flags.task.trim().is_empty() {
        anyhow::bail!(
            "the task is empty; say what to do, for example: tandem run \"print the 10th prime\""
        );
    }
    if args.approve {
        crate::approve::need_terminal()?;
    }
    // A daemon that answers runs the task, a team's as well (it owns sandboxes and history),
    // and is sent its --file files; a kept --workdir or --image is this machine's business,
    // so those run here, and say so.
    if !args.local {
        let client = crate::client::Client::new(&args.host)?;
        let own = [
            ("--workdir", args.workdir.is_some()),
            ("--image", args.image.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect::<Vec<_>>();
        if !own.is_empty() {
            if client.reachable().await {
                eprintln!(
                    "tandem: running in this process, not on the daemon at {}: the daemon cannot honour {} (a directory or image of this machine); the model settings are this shell's",
                    client.host,
                    own.join(" and ")
                );
            }
        } else if client.reachable().await {
            match through_daemon(&client, &args, &file).await {
                Err(e) if local_refused(&e, &args, &file) => {
                    eprintln!(
                        "tandem: the daemon does not offer the local executor to clients; running the task in this process instead"
                    );
                }
                other => return other,
            }
        }
    }
    run_here(&args, file).await
}

/// The task in this process, planned as the daemon plans one: the user's flags and file are
/// the operator's settings, and every executor the task names is offered.
async fn run_here(args: &RunArgs, file: FileConfig) -> Result<u8> {
    let teams = config::teams(&file)?;
    let mut spec = args.flags.spec(&args.model, args.approve, &file, &teams)?;
    if let Some(word) = args
        .flags
        .termination
        .as_ref()
        .or(file.task.termination.as_ref())
    {
        anyhow::ensure!(
            !word.trim().is_empty(),
            "the termination string must not be empty"
        );
    }
    if args.flags.max_turns == Some(0) {
        anyhow::bail!("--max-turns must be at least 1");
    }
    spec.max_turns = args.flags.max_turns;
    let executors = resolve_executors(&mut spec, args, &file).await?;
    let names = executors.names().into_iter().map(str::to_owned).collect();
    let defaults = TaskDefaults {
        executor: config::executor_name(args.flags.executor.as_deref(), &file),
        max_turns: file.task.max_turns,
        timeout: task_timeout(args, &file)?,
        termination: file
            .task
            .termination
            .clone()
            .unwrap_or_else(|| tandem_agent::DEFAULT_TERMINATION.to_owned()),
        system_prompt: tandem_agent::DEFAULT_SYSTEM_PROMPT.to_owned(),
        limits: config::limits(&file, args.flags.block_timeout)?,
        code_via: file.model.code_via.unwrap_or_default(),
    };
    let planner = Planner::new(PlannerConfig {
        model: config::model_config(&args.model, &file)?,
        local_model: None,
        executors,
        defaults,
        policy: Policy::own(names),
        approval: file.approval.clone(),
        teams,
        tools: tandem_agent::tools::Offered::start(file.tools.clone())
            .await
            .context("in [tools] of tandem.toml")?,
    });
    planner.check(&spec)?;
    // Last of the checks: loading the embedded model takes a moment.
    let planner = match crate::provider::local_model(&args.model, &file).await? {
        Some((local, name)) => planner.with_local_model(local, name),
        None => planner,
    };
    // Packed once; every session of the task unpacks it.
    let packed = tempfile::Builder::new()
        .prefix("tandem-files-")
        .tempdir()
        .context("cannot make a directory for the task's files")?;
    let inputs = (!args.flags.files.is_empty())
        .then(|| crate::files::pack(&args.flags.files, packed.path()))
        .transpose()?;
    let start = Start {
        workdir: args.workdir.clone(),
        inputs,
        ..Start::default()
    };
    let mut planned = planner
        .plan(&spec, start)
        .map_err(|info| anyhow::anyhow!("{}", info.message))?;
    if let Some(path) = &args.flags.team {
        planned = planned.team_label(format!("team {}", path.display()));
    }

    let cancel = CancellationToken::new();
    spawn_ctrl_c(cancel.clone());
    let (renderer, events) = transcript(args.json, &cancel);
    // Asked at this terminal when there is one; else a block that needs asking is declined,
    // and the model told why.
    let approver: Option<Arc<dyn tandem_agent::Approver>> = (planned.may_ask()
        && crate::approve::need_terminal().is_ok())
    .then(|| Arc::new(crate::approve::TerminalApprover::new(events.clone())) as _);
    let stop_reason = planned.run(approver, None, events, cancel).await;
    if renderer.lock().is_ok_and(|r| r.reader_gone()) {
        return Ok(exit::DONE);
    }
    Ok(exit::for_stop(stop_reason))
}

/// Starts every executor `spec` names (its own and its team's executor agents'), each once,
/// and names them in `spec` as started (`auto` becomes what it chose).
async fn resolve_executors(
    spec: &mut TaskSpec,
    args: &RunArgs,
    file: &FileConfig,
) -> Result<Registry> {
    let default = config::executor_name(args.flags.executor.as_deref(), file);
    let mut asked = Vec::new();
    if let Some(team) = &spec.team {
        for agent in std::iter::once(&team.team).chain(team.agents.values()) {
            if agent.kind == Kind::Executor {
                asked.push(agent.executor.clone().unwrap_or_else(|| default.clone()));
            }
        }
    }
    // A team whose agents all name their executors runs on theirs: the default would only
    // be started to go unused.
    if asked.is_empty() || asked.contains(&default) {
        asked.push(default.clone());
    }
    asked.sort();
    asked.dedup();
    let mut registry = Registry::new();
    let mut chosen = std::collections::HashMap::new();
    for name in &asked {
        let executor = crate::executors::resolve(name, file, args.image.as_deref()).await?;
        chosen.insert(name.clone(), executor.name().to_owned());
        registry.register(executor);
    }
    let rename = |name: &mut Option<String>| {
        if let Some(n) = name
            && let Some(to) = chosen.get(n.as_str())
        {
            n.clone_from(to);
        }
    };
    spec.executor = Some(
        chosen
            .get(&default)
            .cloned()
            .unwrap_or_else(|| asked[0].clone()),
    );
    if let Some(team) = &mut spec.team {
        for agent in std::iter::once(&mut team.team).chain(team.agents.values_mut()) {
            if agent.kind == Kind::Executor {
                rename(&mut agent.executor);
            }
        }
    }
    Ok(registry)
}

async fn through_daemon(
    client: &crate::client::Client,
    args: &RunArgs,
    file: &FileConfig,
) -> Result<u8> {
    let mut spec = args.flags.daemon_spec(&args.model, args.approve, file)?;
    spec.files = crate::files::upload(client, &args.flags.files).await?;
    let id = client.submit(&spec).await?;
    crate::follow::follow_approving(client, &id, Mode::json(args.json), args.approve).await
}

/// `--approve`: every block is asked about.
fn always() -> ApprovalPolicy {
    ApprovalPolicy {
        mode: ApprovalMode::Always,
        ..ApprovalPolicy::default()
    }
}

/// The whole-task wall-clock limit: `--timeout`, else `[task] timeout_secs`.
pub(crate) fn task_timeout(args: &RunArgs, file: &FileConfig) -> Result<Option<Duration>> {
    Ok(match (args.flags.timeout, file.task.timeout_secs) {
        (Some(secs), _) => Some(config::secs_to_duration(secs, "--timeout")?),
        (None, Some(secs)) => Some(Duration::from_secs(secs)),
        (None, None) => None,
    })
}

/// The transcript of a task run in this process, and the event sink that writes it; when
/// nobody reads it any more (`| head`), the task is cancelled and cleans up.
pub(crate) fn transcript(
    json: bool,
    cancel: &CancellationToken,
) -> (
    Arc<Mutex<Renderer<std::io::Stdout>>>,
    tandem_agent::EventSink,
) {
    let renderer = Arc::new(Mutex::new(
        Renderer::stdout(Mode::json(json)).place("in this process"),
    ));
    let (sink_renderer, cancel) = (renderer.clone(), cancel.clone());
    let events = Arc::new(move |msg: EventMsg| {
        if let Ok(mut r) = sink_renderer.lock() {
            r.event(&msg);
            if r.error.is_some() {
                cancel.cancel();
            }
        }
    });
    (renderer, events)
}

/// Whether the daemon refused a task only because it does not offer `local`, which this
/// process can run on the user's own behalf.
fn local_refused(e: &anyhow::Error, args: &RunArgs, file: &FileConfig) -> bool {
    config::executor_name(args.flags.executor.as_deref(), file) == "local"
        && e.downcast_ref::<crate::client::Refused>()
            .is_some_and(|r| r.code == tandem_protocol::ApiErrorCode::NotAllowed)
}

/// First Ctrl-C cancels cleanly (sandbox closed); a second one exits at once.
pub fn spawn_ctrl_c(cancel: CancellationToken) {
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\ntandem: cancelling (Ctrl-C again to quit at once)");
            cancel.cancel();
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(i32::from(exit::CANCELLED));
            }
        }
    });
}
