//! The in-process driver: the task planned as the daemon plans one, its executors started
//! here, run in this process, and what it made kept from its own workspace.

use std::sync::Arc;

use anyhow::{Context, Result};
use tandem_daemon::plan::Start;
use tandem_daemon::{Planner, Policy};
use tandem_executor::{CancellationToken, Registry};
use tandem_protocol::TaskSpec;
use tandem_protocol::team::Kind;
use tracing::Instrument;

use super::RunArgs;
use super::end::{Kept, renderer, spawn_ctrl_c, transcript, workspace_pictures};
use super::workspace::OwnWorkspace;
use crate::config::Settings;
use crate::exit;

/// The task in this process, planned as the daemon plans one: the user's flags and file are
/// the operator's settings, and every executor the task names is offered.
pub(super) async fn run_here(args: &RunArgs, settings: &Settings) -> Result<u8> {
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
    let mut config = crate::planner::config(
        settings,
        executors,
        settings.executors.default.clone(),
        Policy::own(names),
        None,
    )
    .await?;
    if !spec.volumes.is_empty() {
        // The volumes a daemon on this machine keeps, under the default state dir (or
        // [files] dir), made with `tandem volume create`.
        let root = crate::config::files(&settings.file, &crate::config::default_state_dir())?
            .root
            .join("volumes");
        config.volumes = Some(tandem_volumes::Volumes::open(&root)?);
    }
    let planner = Planner::new(config);
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
    let source = workspace.map(workspace_pictures);
    let renderer = renderer(
        args.json,
        args.out.no_pictures,
        source,
        Some("in this process"),
    );
    let events = transcript(&renderer, &cancel);
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
    // A server the task's code leaves listening is served on loopback while the task runs,
    // at a URL printed when its port opens: there is no daemon to serve it.
    let served = CancellationToken::new();
    let stop = served.clone();
    let book = tandem_daemon::ports::PortBook::announcing(Arc::new(move |port, ports| {
        let stop = stop.clone();
        tokio::spawn(async move {
            match tandem_daemon::api::serve_loopback(ports, port, stop).await {
                Ok(url) => {
                    eprintln!("tandem: port {port} is open: {url} (served while the task runs)")
                }
                Err(e) => eprintln!(
                    "tandem: port {port} is open, but this process cannot serve it on loopback: {e}"
                ),
            }
        });
    }));
    let stop_reason = planned
        .publishing(&book, &id)
        .run(approver, None, events, cancel)
        .instrument(span)
        .await;
    served.cancel();
    let code = exit::for_stop(stop_reason);
    let (Some(out), Some(own)) = (keep_in, own) else {
        return Ok(if renderer.lock().is_ok_and(|r| r.reader_gone()) {
            exit::DONE
        } else {
            code
        });
    };
    let kept = Kept {
        packed: packed.path().join("files.tar"),
        out,
        own,
        id,
        max: args.out.max_bytes(),
        max_mb: args.out.out_max_mb,
    };
    let code = super::end::keep_here(kept, &renderer, code).await;
    if renderer.lock().is_ok_and(|r| r.reader_gone()) {
        return Ok(exit::DONE);
    }
    Ok(code)
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
