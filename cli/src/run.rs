//! `tandem run`: one task, in this process.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tandem_daemon::plan::Start;
use tandem_daemon::{Planner, Policy};
use tandem_executor::{CancellationToken, Registry};
use tandem_protocol::team::{Kind, TeamBounds};
use tandem_protocol::{ApprovalMode, ApprovalPolicy, EventMsg, TaskSpec};
use tracing::Instrument;

use crate::config::{FileConfig, ModelFlags, Overrides, Road, Settings};
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
            candidates: self.candidates,
            placement: self.placement.iter().cloned().collect(),
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

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub(crate) flags: TaskFlags,
    /// Docker image for the docker executor [env: TANDEM_DOCKER_IMAGE; default: python:3.12-slim]
    #[arg(long)]
    pub(crate) image: Option<String>,
    #[command(flatten)]
    pub(crate) model: ModelFlags,
    /// Use this directory as the workspace and keep it (then nothing is copied to --out)
    #[arg(long)]
    pub(crate) workdir: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) out: crate::keep::OutFlags,
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
    let settings = Settings::resolve(
        file,
        &Overrides {
            executor: args.flags.executor.as_deref(),
            image: args.image.as_deref(),
            model: &args.model,
            road: Road::InProcess {
                timeout: args.flags.timeout,
                block_timeout: args.flags.block_timeout,
            },
        },
    );
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
            match through_daemon(&client, &args, &settings.file).await {
                Err(e) if local_refused(&e, &settings) => {
                    eprintln!(
                        "tandem: the daemon does not offer the local executor to clients; running the task in this process instead"
                    );
                }
                other => return other,
            }
        }
    }
    run_here(&args, &settings).await
}

/// The task in this process, planned as the daemon plans one: the user's flags and file are
/// the operator's settings, and every executor the task names is offered.
async fn run_here(args: &RunArgs, settings: &Settings) -> Result<u8> {
    let mut spec = args.flags.spec(
        &args.model,
        args.approve,
        &settings.file,
        settings.teams.get()?,
    )?;
    if let Some(word) = args
        .flags
        .termination
        .as_ref()
        .or(settings.file.task.termination.as_ref())
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
    let executors = resolve_executors(&mut spec, settings).await?;
    let names = executors.names().into_iter().map(str::to_owned).collect();
    let planner = Planner::new(
        crate::planner::config(
            settings,
            executors,
            settings.executors.default.clone(),
            Policy::own(names),
            None,
        )
        .await?,
    );
    // Whether the model has a price is known once it is known whether the embedded model
    // runs: `plan` checks `max_cost` below, after loading it.
    planner.check(&TaskSpec {
        max_cost: None,
        ..spec.clone()
    })?;
    // Last of the checks: loading the embedded model takes a moment.
    let planner = match crate::provider::local_model(settings).await? {
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
    // The task's workspace is this process's own directory, so that what the task made can
    // be copied out once it ends (a session removes a workspace it made itself at close).
    let id = uuid::Uuid::now_v7().simple().to_string();
    let keep_in = args.out.dir().filter(|_| args.workdir.is_none());
    let own = keep_in.as_ref().map(|_| OwnWorkspace::new()).transpose()?;
    let workspace = args
        .workdir
        .clone()
        .or_else(|| own.as_ref().map(|w| w.path.clone()));
    let start = Start {
        workdir: workspace.clone(),
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
    let mode = Mode::json(args.json);
    let pictures = workspace.and_then(|ws| {
        crate::render::Pictures::for_stdout(args.out.no_pictures, mode, workspace_pictures(ws))
    });
    let (renderer, events) = transcript(args.json, &cancel);
    if let Ok(mut r) = renderer.lock() {
        r.set_pictures(pictures);
    }
    // Asked at this terminal when there is one; else a block that needs asking is declined,
    // and the model told why.
    let approver: Option<Arc<dyn tandem_agent::Approver>> = (planned.may_ask()
        && crate::approve::need_terminal().is_ok())
    .then(|| Arc::new(crate::approve::TerminalApprover::new(events.clone())) as _);
    // The task's span; `TRACEPARENT` in the environment makes it a child of the caller's.
    let span = tandem_agent::trace::task(
        &id,
        if spec.team.is_some() {
            "team"
        } else {
            "tandem"
        },
    );
    if let Ok(parent) = std::env::var("TRACEPARENT") {
        tandem_agent::trace::set_parent(&span, &parent);
    }
    let stop_reason = planned
        .run(approver, None, events, cancel)
        .instrument(span)
        .await;
    let code = exit::for_stop(stop_reason);
    let (Some(out), Some(own)) = (keep_in, own) else {
        return Ok(if renderer.lock().is_ok_and(|r| r.reader_gone()) {
            exit::DONE
        } else {
            code
        });
    };
    let inputs = packed.path().join("files.tar");
    let max = args.out.max_bytes();
    let (ws, task) = (own.path.clone(), id.clone());
    let kept = tokio::task::spawn_blocking(move || {
        let given = std::fs::File::open(&inputs)
            .ok()
            .map(|f| tandem_executor::made::Given::of_archive(std::io::BufReader::new(f)))
            .transpose()
            .map_err(|e| format!("cannot read back the files the task was given: {e}"))?
            .unwrap_or_default();
        let made = tandem_executor::made::made(&ws, &given, crate::keep::MADE_SCAN)
            .map_err(|e| format!("cannot list what the task made: {e}"))?;
        let made = made.into_iter().map(crate::keep::Made::from).collect();
        Ok::<_, String>(crate::keep::from_workspace(&ws, made, &out, &task, max))
    })
    .await
    .map_err(|e| format!("keeping the task's files stopped: {e}"))
    .and_then(|k| k)
    .unwrap_or_else(|e| crate::keep::Kept {
        not_kept: Some(e),
        ..Default::default()
    });
    let left = if kept.whole() {
        own.remove();
        None
    } else {
        Some(own.keep(&id))
    };
    let how = match &left {
        Some(dir) => format!(
            "raise it to keep them; the whole workspace stays in {}",
            dir.display()
        ),
        None => "raise it to keep them".to_owned(),
    };
    let code = report_kept(&renderer, &kept, args.out.out_max_mb, &how, code);
    if kept.lost_any()
        && let Some(dir) = &left
    {
        eprintln!(
            "tandem: nothing is lost: the task's whole workspace stays in {}",
            dir.display()
        );
    }
    if renderer.lock().is_ok_and(|r| r.reader_gone()) {
        return Ok(exit::DONE);
    }
    Ok(code)
}

/// Says what was kept of a task's files and what could not be, and gives the run's exit
/// code: the task's own, or [`exit::NOT_KEPT`] when it was done but a file it made was not
/// kept.
fn report_kept(
    renderer: &Mutex<Renderer<std::io::Stdout>>,
    kept: &crate::keep::Kept,
    max_mb: u64,
    how: &str,
    code: u8,
) -> u8 {
    if let Ok(mut r) = renderer.lock() {
        r.kept(kept, max_mb, how);
    }
    if let Some(why) = &kept.not_kept {
        eprintln!("tandem: {why}");
    }
    for (file, why) in &kept.failed {
        eprintln!("tandem: could not keep {}: {why}", file.shown());
    }
    if kept.lost_any() && code == exit::DONE {
        exit::NOT_KEPT
    } else {
        code
    }
}

/// The workspace of a task run in this process, which this process makes and removes (when
/// dropped too): in a root named for this process, so a later Tandem removes it if this one
/// is killed.
struct OwnWorkspace {
    temp: tandem_executor::scratch::TempTree,
    path: PathBuf,
    root: PathBuf,
}

/// Prefix of the roots of [`OwnWorkspace`]s in `$TMPDIR`.
const RUN_ROOT: &str = "tandem-run-";

impl OwnWorkspace {
    fn new() -> Result<Self> {
        tandem_executor::scratch::reap_dead_roots(RUN_ROOT);
        let root = tandem_executor::scratch::process_root(RUN_ROOT);
        let temp = tandem_executor::scratch::temp_in(&root, "ws-")
            .context("cannot make a workspace for the task")?;
        // Canonical, as a session makes a workdir, so paths resolved inside compare equal.
        let path = temp
            .path()
            .canonicalize()
            .context("cannot make a workspace for the task")?;
        Ok(Self { temp, path, root })
    }

    /// Removes it.
    fn remove(self) {
        if let Err(e) = self.temp.close() {
            tracing::warn!(workspace = %self.path.display(), error = %e, "could not remove the task's workspace");
        }
        tandem_executor::scratch::remove_root_if_empty(&self.root);
    }

    /// Moves it where no later Tandem removes it, and says where it is.
    fn keep(self, id: &str) -> PathBuf {
        let to = std::env::temp_dir().join(format!("tandem-workspace-{id}"));
        if std::fs::rename(&self.path, &to).is_err() {
            // Left where it is, and not removed by this process.
            std::mem::forget(self.temp);
            return self.path;
        }
        // What the temporary directory's drop removes is gone already.
        drop(self.temp);
        tandem_executor::scratch::remove_root_if_empty(&self.root);
        to
    }
}

/// Pictures read from `workspace`, a host directory, as a download reads them.
pub(crate) fn workspace_pictures(workspace: PathBuf) -> crate::render::PictureSource {
    Box::new(move |file, _| {
        use std::io::Read as _;
        let (f, size) = tandem_executor::archive::read(&workspace, file).ok()?;
        if size > crate::picture::MAX_BYTES {
            return None;
        }
        let mut data = Vec::new();
        f.take(size).read_to_end(&mut data).ok()?;
        Some(data)
    })
}

/// Pictures downloaded from the daemon, as the transcript comes to them.
fn daemon_pictures(client: crate::client::Client) -> crate::render::PictureSource {
    Box::new(move |_, href| {
        let href = href?.to_owned();
        let client = client.clone();
        // The transcript is written from a synchronous callback; the download waits there,
        // on this worker only.
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async move {
                let mut resp = client.download(&href).await.ok()?;
                let mut data = Vec::new();
                while let Some(chunk) = resp.chunk().await.ok()? {
                    data.extend_from_slice(&chunk);
                    if data.len() as u64 > crate::picture::MAX_BYTES {
                        return None;
                    }
                }
                Some(data)
            })
        })
    })
}

/// Starts every executor `spec` names (its own and its team's executor agents'), each once,
/// and names them in `spec` as started (`auto` becomes what it chose).
async fn resolve_executors(spec: &mut TaskSpec, settings: &Settings) -> Result<Registry> {
    let default = settings.executors.default.clone();
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
        let executor = crate::executors::resolve(name, &settings.executors).await?;
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
    let mode = Mode::json(args.json);
    let pictures = crate::render::Pictures::for_stdout(
        args.out.no_pictures,
        mode,
        daemon_pictures(client.clone()),
    );
    let renderer = Arc::new(Mutex::new(Renderer::stdout(mode).pictures(pictures)));
    let followed = crate::follow::follow_approving(client, &id, &renderer, args.approve).await?;
    let (true, Some(out)) = (followed.finished, args.out.dir()) else {
        return Ok(followed.code);
    };
    let kept = crate::keep::from_daemon(client, &id, &out, args.out.max_bytes()).await;
    let how = format!("`tandem files {id} --tar -o files.tar` fetches them all");
    Ok(report_kept(
        &renderer,
        &kept,
        args.out.out_max_mb,
        &how,
        followed.code,
    ))
}

/// `--approve`: every block is asked about.
fn always() -> ApprovalPolicy {
    ApprovalPolicy {
        mode: ApprovalMode::Always,
        ..ApprovalPolicy::default()
    }
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
fn local_refused(e: &anyhow::Error, settings: &Settings) -> bool {
    settings.executors.default == "local"
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
