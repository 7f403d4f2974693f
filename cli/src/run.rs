//! `tandem run`: one task, in this process.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tandem_agent::{ApprovalGate, TaskSettings, allowed_languages, run_task};
use tandem_executor::{CancellationToken, SessionSpec};
use tandem_protocol::team::TeamBounds;
use tandem_protocol::{ApprovalMode, ApprovalPolicy, EventMsg};

use crate::config::{self, FileConfig, ModelFlags};
use crate::exit;
use crate::render::{Mode, Renderer};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The task, in words
    pub(crate) task: String,
    /// Executor that runs the code: auto, docker, wasm, local or an [executors.NAME] plugin [env: TANDEM_EXECUTOR; default: auto]
    #[arg(long, short = 'e')]
    pub(crate) executor: Option<String>,
    /// Docker image for the docker executor [env: TANDEM_DOCKER_IMAGE; default: python:3.12-slim]
    #[arg(long)]
    pub(crate) image: Option<String>,
    #[command(flatten)]
    pub(crate) model: ModelFlags,
    /// Most assistant turns [default: 10]
    #[arg(long)]
    pub(crate) max_turns: Option<u32>,
    /// Wall-clock limit for the whole task, in seconds
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
    /// Solve the task with this team of agents (a team file: docs/teams.md) instead of the
    /// assistant and executor pair
    #[arg(long)]
    pub(crate) team: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) host: crate::client::HostFlag,
}

pub async fn run(args: RunArgs, file: FileConfig) -> Result<u8> {
    if args.task.trim().is_empty() {
        anyhow::bail!(
            "the task is empty; say what to do, for example: tandem run \"print the 10th prime\""
        );
    }
    if args.approve {
        crate::approve::need_terminal()?;
    }
    // A daemon that answers runs the task, a team's as well (it owns sandboxes and history);
    // a kept --workdir or --image is this machine's business, so those run here, and say so.
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
    if let Some(team) = args.team.clone() {
        return run_team_here(&args, &team, file).await;
    }
    let executor_name = config::executor_name(args.executor.as_deref(), &file);
    let executor = crate::executors::resolve(&executor_name, &file, args.image.as_deref()).await?;
    let mut settings = TaskSettings::new(args.task.clone());
    if let Some(path) = args
        .system_prompt
        .as_ref()
        .or(file.task.system_prompt_file.as_ref())
    {
        settings.system_prompt = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the system prompt file {}", path.display()))?;
    }
    if let Some(word) = args
        .termination
        .clone()
        .or_else(|| file.task.termination.clone())
    {
        anyhow::ensure!(
            !word.trim().is_empty(),
            "the termination string must not be empty"
        );
        settings.termination = word;
    }
    if let Some(n) = args.max_turns.or(file.task.max_turns) {
        anyhow::ensure!(n > 0, "--max-turns must be at least 1");
        settings.max_turns = n;
    }
    settings.timeout = task_timeout(&args, &file)?;
    if !args.languages.is_empty() {
        settings.languages = Some(allowed_languages(&args.languages, executor.as_ref())?);
    }
    settings.session = SessionSpec {
        workdir: args.workdir.clone(),
        limits: config::limits(&file, args.block_timeout)?,
        labels: Vec::new(),
    };
    // Last of the checks: loading the embedded model takes a moment.
    let model = crate::provider::chat_model(&args.model, &file).await?;

    let cancel = CancellationToken::new();
    spawn_ctrl_c(cancel.clone());
    let (renderer, events) = transcript(args.json, &cancel);
    settings.approval = gate(&args, &file, &events)?;
    let outcome = run_task(settings, &model, executor, events, cancel).await;
    if renderer.lock().is_ok_and(|r| r.reader_gone()) {
        return Ok(exit::DONE);
    }
    Ok(exit::for_stop(outcome.stop_reason))
}

async fn through_daemon(
    client: &crate::client::Client,
    args: &RunArgs,
    file: &FileConfig,
) -> Result<u8> {
    let whole_secs = |secs: f64, flag: &str| -> Result<u64> {
        let d = config::secs_to_duration(secs, flag)?;
        Ok(d.as_secs().max(1))
    };
    let system_prompt =
        match args
            .system_prompt
            .as_ref()
            .or(file.task.system_prompt_file.as_ref())
        {
            Some(path) => Some(std::fs::read_to_string(path).with_context(|| {
                format!("cannot read the system prompt file {}", path.display())
            })?),
            None => None,
        };
    let spec = tandem_protocol::TaskSpec {
        task: args.task.clone(),
        executor: args.executor.clone(),
        model: args.model.model.clone(),
        base_url: args.model.base_url.clone(),
        max_turns: args.max_turns,
        timeout_secs: args
            .timeout
            .map(|s| whole_secs(s, "--timeout"))
            .transpose()?,
        block_timeout_secs: args
            .block_timeout
            .map(|s| whole_secs(s, "--block-timeout"))
            .transpose()?,
        system_prompt,
        termination: args.termination.clone(),
        languages: (!args.languages.is_empty()).then(|| args.languages.clone()),
        limits: tandem_protocol::TaskLimits::default(),
        // Checked here first, so a mistake in the file is told with its path, as in-process.
        team: args
            .team
            .as_deref()
            .map(|path| crate::team::load_spec(path, &TeamBounds::CEILINGS))
            .transpose()?,
        approval: args.approve.then(always),
    };
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

/// The approval gate of a run in this process: the config's `[approval]`, made to ask for
/// every block by `--approve`, asking at this terminal when there is one (else a block that
/// needs asking is declined, and the model told why).
pub(crate) fn gate(
    args: &RunArgs,
    file: &FileConfig,
    events: &tandem_agent::EventSink,
) -> Result<Option<Arc<ApprovalGate>>> {
    let task = args.approve.then(always);
    let gate = ApprovalGate::new(&file.approval, task.as_ref())
        .context("the config's [approval] policy cannot be used")?;
    if gate.is_open() {
        return Ok(None);
    }
    let gate = if gate.may_ask() && crate::approve::need_terminal().is_ok() {
        let approver = crate::approve::TerminalApprover::new(events.clone());
        gate.with_approver(Arc::new(approver))
    } else {
        gate
    };
    Ok(Some(Arc::new(gate)))
}

/// The whole-task wall-clock limit: `--timeout`, else `[task] timeout_secs`.
pub(crate) fn task_timeout(args: &RunArgs, file: &FileConfig) -> Result<Option<Duration>> {
    Ok(match (args.timeout, file.task.timeout_secs) {
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
    config::executor_name(args.executor.as_deref(), file) == "local"
        && e.downcast_ref::<crate::client::Refused>()
            .is_some_and(|r| r.code == "not_allowed")
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

/// `tandem run --team FILE TASK`: the team in this process, with the run's model, executor
/// and limits as every agent's defaults.
async fn run_team_here(
    args: &RunArgs,
    path: &std::path::Path,
    file: crate::config::FileConfig,
) -> Result<u8> {
    use std::collections::HashMap;

    use tandem_agent::ChatModel;
    use tandem_agent::team::{TaskLabel, Team, executor_slot, run_team_task};
    use tandem_executor::{CancellationToken, SessionSpec};
    use tandem_protocol::team::Kind;
    use tandem_protocol::{ErrorCode, ErrorInfo};

    use crate::config;

    let root = crate::team::load(path, &config::teams(&file)?)?;
    let model_config = config::model_config(&args.model, &file)?;
    let default_executor = config::executor_name(args.executor.as_deref(), &file);
    // Every executor the team names, resolved once (starting one may take a moment).
    let mut names = vec![];
    let mut stack = vec![&root];
    while let Some(node) = stack.pop() {
        if node.spec.kind == Kind::Executor {
            names.push(
                node.spec
                    .executor
                    .clone()
                    .unwrap_or_else(|| default_executor.clone()),
            );
        }
        stack.extend(&node.members);
    }
    names.sort();
    names.dedup();
    let mut executors = HashMap::new();
    for name in names {
        let executor = crate::executors::resolve(&name, &file, args.image.as_deref()).await?;
        executors.insert(name, executor);
    }
    let limits = config::limits(&file, args.block_timeout)?;
    let session = SessionSpec {
        workdir: args.workdir.clone(),
        limits: limits.clone(),
        labels: Vec::new(),
    };
    let invalid = |message: String| ErrorInfo {
        code: ErrorCode::InvalidRequest,
        message,
    };
    let selector = crate::provider::chat_model(&args.model, &file).await?;
    let model = |node: &tandem_agent::team::Node| {
        if node.spec.model.is_none() && node.spec.base_url.is_none() {
            return Ok(selector.clone());
        }
        let mut c = model_config.clone();
        if let Some(m) = &node.spec.model {
            c.model = m.clone();
        }
        if let Some(url) = &node.spec.base_url {
            c.base_url = url.clone();
        }
        ChatModel::new(c).map_err(ErrorInfo::from)
    };
    let slot = |node: &tandem_agent::team::Node| {
        let name = node.spec.executor.as_ref().unwrap_or(&default_executor);
        let executor = executors
            .get(name)
            .cloned()
            .ok_or_else(|| invalid(format!("{}: executor `{name}` is not available", node.path)))?;
        executor_slot(node, executor, session.clone())
    };
    let max_turns = args
        .max_turns
        .or(file.task.max_turns)
        .unwrap_or(tandem_agent::DEFAULT_TEAM_TURNS);
    let label = TaskLabel {
        model: selector.config().model.clone(),
        base_url: selector.location(),
        executor: format!("team {}", path.display()),
    };
    let team = Team::new(root, selector.clone(), model, slot, max_turns, &limits)
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;

    let cancel = CancellationToken::new();
    spawn_ctrl_c(cancel.clone());
    let timeout = task_timeout(args, &file)?;
    let (renderer, events) = transcript(args.json, &cancel);
    let team = team.with_approval(gate(args, &file, &events)?);
    let stop_reason =
        run_team_task(team, &args.task, label, events, cancel, timeout, Vec::new()).await;
    if renderer.lock().is_ok_and(|r| r.reader_gone()) {
        return Ok(crate::exit::DONE);
    }
    Ok(crate::exit::for_stop(stop_reason))
}
