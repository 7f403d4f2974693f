//! `tandem eval`: run a suite of tasks, each decided by its own check, and tell the solve
//! rate, turns, tokens and time; or put two runs side by side.

mod report;
mod suite;

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use futures::StreamExt as _;
use tandem_daemon::plan::Start;
use tandem_daemon::{Planner, Policy};
use tandem_executor::CancellationToken;
use tandem_protocol::{EventMsg, StopReason, TaskSpec};
use tracing::Instrument as _;

use crate::config::{FileConfig, ModelFlags, Overrides, Road, Settings};
use crate::exit;
use report::{Line, TaskResult, Totals};
use suite::{Suite, SuiteTask};

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// The suite: a TOML file of [[tasks]], or JSON lines, each task with its check
    /// (docs/eval.md)
    #[arg(required_unless_present = "compare")]
    suite: Option<PathBuf>,
    /// Print one JSON line per task as it ends, and the totals last (save it to compare)
    #[arg(long)]
    json: bool,
    /// Show two saved runs (`--json` output) side by side, task by task, instead of running
    #[arg(long, num_args = 2, value_names = ["A", "B"], conflicts_with = "suite")]
    compare: Vec<PathBuf>,
    /// Tasks run at once
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    parallel: u32,
    /// Run only the task with this id (repeat for more)
    #[arg(long = "only", value_name = "ID")]
    only: Vec<String>,
    /// Run only the tasks of this split of the suite (`tune`, `test`, ...)
    #[arg(long)]
    split: Option<String>,
    /// Executor for tasks that name none [default: the suite's, else auto or the daemon's]
    #[arg(long, short = 'e')]
    executor: Option<String>,
    /// Most assistant turns for tasks that give none [default: the suite's, else 10]
    #[arg(long)]
    max_turns: Option<u32>,
    /// File whose text replaces the default system prompt, for every task
    #[arg(long)]
    system_prompt: Option<PathBuf>,
    /// How the model's code reaches the executor: blocks, tool or auto
    #[arg(long, value_name = "blocks|tool|auto")]
    code_via: Option<tandem_protocol::CodeVia>,
    /// After the first run that failed, draw this many replies at once and keep the one whose code
    /// holds the most of the examples the task states (1 to 8) [default: 4]
    #[arg(long, value_name = "K")]
    candidates: Option<u32>,
    #[command(flatten)]
    model: ModelFlags,
    /// Write each task's events, one JSON line each, to DIR/ID.jsonl (in this process; a
    /// daemon keeps its tasks' transcripts itself)
    #[arg(long, value_name = "DIR")]
    transcripts: Option<PathBuf>,
    /// Run in this process even when a daemon is reachable
    #[arg(long)]
    local: bool,
    #[command(flatten)]
    host: crate::client::HostFlag,
}

pub async fn eval(args: EvalArgs, file: FileConfig) -> Result<u8> {
    if let [a, b] = args.compare.as_slice() {
        let (ra, rb) = (report::read_run(a)?, report::read_run(b)?);
        print!(
            "{}",
            report::compare(
                &ra,
                &rb,
                (&a.display().to_string(), &b.display().to_string())
            )
        );
        return Ok(exit::DONE);
    }
    let Some(path) = &args.suite else {
        bail!("give a suite to run, or --compare A B");
    };
    if let Some(dir) = &args.transcripts {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot make the directory {}", dir.display()))?;
    }
    let suite = Suite::load(path)?;
    let chosen: Vec<&SuiteTask> = suite
        .tasks
        .iter()
        .filter(|t| args.only.is_empty() || args.only.contains(&t.id))
        .filter(|t| args.split.is_none() || t.split == args.split)
        .collect();
    if let Some(missing) = args
        .only
        .iter()
        .find(|id| !suite.tasks.iter().any(|t| &t.id == *id))
    {
        bail!("--only {missing}: the suite has no task with that id");
    }
    if chosen.is_empty() {
        bail!(
            "no task of {} is chosen by --only and --split",
            path.display()
        );
    }
    let system_prompt = args
        .system_prompt
        .as_ref()
        .map(|p| {
            std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the system prompt file {}", p.display()))
        })
        .transpose()?;
    let specs: Vec<(TaskSpec, Vec<PathBuf>, SuiteTask)> = chosen
        .iter()
        .map(|t| {
            (
                spec(t, &suite, &args, system_prompt.clone()),
                suite.files_of(t),
                (*t).clone(),
            )
        })
        .collect();
    let cancel = CancellationToken::new();
    crate::run::spawn_ctrl_c(cancel.clone());
    let out = Arc::new(Mutex::new(Output::new(args.json)));
    if let Ok(mut o) = out.lock() {
        o.start();
    }
    let client = crate::client::Client::new(&args.host)?;
    let results = if !args.local && client.reachable().await {
        eprintln!(
            "tandem: running {} tasks on the daemon at {}",
            specs.len(),
            client.host
        );
        on_daemon(&client, specs, &args, &out, &cancel).await?
    } else {
        in_process(specs, &args, file, &out, &cancel).await?
    };
    let totals = Totals::of(&results);
    if let Ok(mut o) = out.lock() {
        o.totals(&totals)?;
    }
    Ok(if cancel.is_cancelled() {
        exit::CANCELLED
    } else {
        exit::DONE
    })
}

/// The task a suite task asks for, with the suite's and the command line's defaults.
fn spec(t: &SuiteTask, suite: &Suite, args: &EvalArgs, system_prompt: Option<String>) -> TaskSpec {
    let d = &suite.defaults;
    TaskSpec {
        task: t.task.clone(),
        executor: t
            .executor
            .clone()
            .or_else(|| args.executor.clone())
            .or_else(|| d.executor.clone()),
        model: args.model.model.clone(),
        base_url: args.model.base_url.clone(),
        max_turns: t.max_turns.or(args.max_turns).or(d.max_turns),
        timeout_secs: d.timeout_secs,
        block_timeout_secs: d.block_timeout_secs,
        system_prompt,
        languages: t.languages.clone(),
        code_via: args.code_via,
        candidates: args.candidates,
        check: Some(t.check.clone()),
        ..TaskSpec::default()
    }
}

/// Where results go as tasks end: a table for people, or JSON lines.
struct Output {
    json: bool,
    results: Vec<TaskResult>,
}

impl Output {
    fn new(json: bool) -> Self {
        Self {
            json,
            results: Vec::new(),
        }
    }

    fn start(&mut self) {
        if !self.json {
            println!("{}", report::header());
        }
    }

    /// Tells a task's result at once, so that an interrupted run keeps what finished.
    fn task(&mut self, r: TaskResult) -> Result<()> {
        let mut stdout = std::io::stdout().lock();
        if self.json {
            writeln!(stdout, "{}", serde_json::to_string(&Line::Task(r.clone()))?)?;
        } else {
            writeln!(stdout, "{}", report::row(&r))?;
        }
        stdout.flush()?;
        self.results.push(r);
        Ok(())
    }

    fn totals(&mut self, totals: &Totals) -> Result<()> {
        let mut stdout = std::io::stdout().lock();
        if self.json {
            let line = Line::Totals {
                totals: totals.clone(),
            };
            writeln!(stdout, "{}", serde_json::to_string(&line)?)?;
        } else {
            writeln!(stdout, "{}", totals.line())?;
        }
        Ok(())
    }
}

/// What a task's last event says of it, as a result.
fn result_of(t: &SuiteTask, finished: Option<&EventMsg>, seconds: f64) -> TaskResult {
    let mut r = TaskResult {
        id: t.id.clone(),
        verdict: None,
        stop_reason: None,
        turns: 0,
        input_tokens: 0,
        output_tokens: 0,
        seconds,
        detail: String::new(),
        split: t.split.clone(),
        tags: t.tags.clone(),
        answer: None,
        answer_from: None,
        printed: None,
    };
    if let Some(EventMsg::TaskFinished {
        stop_reason,
        turns,
        usage,
        error,
        check,
        answer,
        answer_from,
        ..
    }) = finished
    {
        r.answer = answer
            .as_deref()
            .map(|a| tandem_agent::grounding::clip(a, 500));
        r.answer_from = *answer_from;
        r.stop_reason = Some(*stop_reason);
        r.turns = *turns;
        r.input_tokens = usage.prompt_tokens;
        r.output_tokens = usage.completion_tokens;
        if let Some(check) = check {
            r.verdict = Some(check.verdict);
            r.detail.clone_from(&check.detail);
            r.printed = check.printed;
        }
        if let Some(e) = error {
            r.detail = format!("the task failed: {}", e.message);
        }
    }
    r
}

/// Runs the suite in this process, planned as `tandem run` plans a task, `--parallel` at a
/// time; the embedded model is loaded once for them all.
async fn in_process(
    specs: Vec<(TaskSpec, Vec<PathBuf>, SuiteTask)>,
    args: &EvalArgs,
    file: FileConfig,
    out: &Mutex<Output>,
    cancel: &CancellationToken,
) -> Result<Vec<TaskResult>> {
    let settings = Settings::resolve(
        file,
        &Overrides {
            executor: args.executor.as_deref(),
            image: None,
            model: &args.model,
            road: Road::InProcess {
                timeout: None,
                block_timeout: None,
            },
        },
    );
    // Every executor any task names is started once.
    let mut names: Vec<String> = specs
        .iter()
        .filter_map(|(s, _, _)| s.executor.clone())
        .collect();
    names.push(settings.executors.default.clone());
    names.sort();
    names.dedup();
    let mut registry = tandem_executor::Registry::new();
    let mut default = settings.executors.default.clone();
    for name in &names {
        let executor = crate::executors::resolve(name, &settings.executors).await?;
        if *name == settings.executors.default {
            default = executor.name().to_owned();
        }
        registry.register(executor);
    }
    let offered = registry.names().into_iter().map(str::to_owned).collect();
    let planner = Planner::new(
        crate::planner::config(&settings, registry, default, Policy::own(offered), None).await?,
    );
    for (spec, _, t) in &specs {
        planner
            .check(spec)
            .with_context(|| format!("task `{}` cannot run here", t.id))?;
    }
    let planner = match crate::provider::local_model(&settings).await? {
        Some((local, name)) => planner.with_local_model(local, name),
        None => planner,
    };
    let planner = &planner;
    let run_one = |(spec, files, t): (TaskSpec, Vec<PathBuf>, SuiteTask)| async move {
        if cancel.is_cancelled() {
            return Ok::<_, anyhow::Error>(None);
        }
        let started = Instant::now();
        let packed = tempfile::Builder::new()
            .prefix("tandem-files-")
            .tempdir()
            .context("cannot make a directory for a task's files")?;
        let inputs = (!files.is_empty())
            .then(|| crate::files::pack(&files, packed.path()))
            .transpose()
            .with_context(|| format!("task `{}`", t.id))?;
        let finished: Arc<Mutex<Option<EventMsg>>> = Arc::default();
        let keep = finished.clone();
        let transcript = args
            .transcripts
            .as_ref()
            .map(|dir| {
                let path = dir.join(format!("{}.jsonl", t.id));
                std::fs::File::create(&path)
                    .map(|f| Mutex::new(std::io::BufWriter::new(f)))
                    .with_context(|| format!("cannot write {}", path.display()))
            })
            .transpose()?;
        let events: tandem_agent::EventSink = Arc::new(move |msg: EventMsg| {
            if let Some(Ok(mut file)) = transcript.as_ref().map(Mutex::lock)
                && let Ok(line) = serde_json::to_string(&msg)
            {
                let _ = writeln!(file, "{line}");
                let _ = file.flush();
            }
            if matches!(msg, EventMsg::TaskFinished { .. })
                && let Ok(mut f) = keep.lock()
            {
                *f = Some(msg);
            }
        });
        let planned = planner.plan(
            &spec,
            Start {
                inputs,
                ..Start::default()
            },
        );
        let last = match planned {
            Ok(planned) => {
                let span = tandem_agent::trace::task(&t.id, "tandem");
                planned
                    .run(None, None, events, cancel.child_token())
                    .instrument(span)
                    .await;
                finished.lock().ok().and_then(|mut f| f.take())
            }
            Err(info) => Some(EventMsg::finished(
                StopReason::Error,
                0,
                tandem_protocol::Usage::default(),
                0,
                Some(info),
            )),
        };
        Ok(Some(result_of(
            &t,
            last.as_ref(),
            started.elapsed().as_secs_f64(),
        )))
    };
    collect(specs, args.parallel, run_one, out).await
}

/// Runs `run_one` over `specs`, `parallel` at a time, telling each result as it ends.
async fn collect<F, Fut>(
    specs: Vec<(TaskSpec, Vec<PathBuf>, SuiteTask)>,
    parallel: u32,
    run_one: F,
    out: &Mutex<Output>,
) -> Result<Vec<TaskResult>>
where
    F: Fn((TaskSpec, Vec<PathBuf>, SuiteTask)) -> Fut,
    Fut: std::future::Future<Output = Result<Option<TaskResult>>>,
{
    let mut running = futures::stream::iter(specs)
        .map(run_one)
        .buffer_unordered(parallel as usize);
    let mut results = Vec::new();
    while let Some(done) = running.next().await {
        if let Some(r) = done? {
            if let Ok(mut o) = out.lock() {
                o.task(r.clone())?;
            }
            results.push(r);
        }
    }
    Ok(results)
}

/// Runs the suite on the daemon: each task is sent with its files and check, `--parallel`
/// at a time (the daemon's own caps hold too), and followed to its end.
async fn on_daemon(
    client: &crate::client::Client,
    specs: Vec<(TaskSpec, Vec<PathBuf>, SuiteTask)>,
    args: &EvalArgs,
    out: &Mutex<Output>,
    cancel: &CancellationToken,
) -> Result<Vec<TaskResult>> {
    let run_one = |(mut spec, files, t): (TaskSpec, Vec<PathBuf>, SuiteTask)| async move {
        if cancel.is_cancelled() {
            return Ok::<_, anyhow::Error>(None);
        }
        let started = Instant::now();
        spec.files = crate::files::upload(client, &files)
            .await
            .with_context(|| format!("task `{}`", t.id))?;
        let id = client
            .submit(&spec)
            .await
            .with_context(|| format!("task `{}` was refused", t.id))?;
        let followed = async {
            let mut ignore = |_: &tandem_protocol::Event| {};
            client.events(&id, 0, true, &mut ignore).await
        };
        let last = tokio::select! {
            last = followed => last?,
            () = cancel.cancelled() => {
                let _ = client.cancel(&id).await;
                let mut r = result_of(&t, None, started.elapsed().as_secs_f64());
                r.stop_reason = Some(StopReason::Cancelled);
                return Ok(Some(r));
            }
        };
        Ok(Some(result_of(
            &t,
            last.as_ref().map(|e| &e.msg),
            started.elapsed().as_secs_f64(),
        )))
    };
    collect(specs, args.parallel, run_one, out).await
}
