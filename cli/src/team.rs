//! Team files: read, parsed with the path of a bad field, and checked.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use tandem_agent::team::{Node, check, path_error};
use tandem_protocol::team::TeamSpec;

/// Reads and checks a team file, for a daemon to run.
pub fn load_spec(path: &Path) -> Result<TeamSpec> {
    let (spec, _) = read(path)?;
    Ok(spec)
}

/// Reads and checks a team file; the error lists every problem, each with its field's path.
pub fn load(path: &Path) -> Result<Node> {
    let (_, root) = read(path)?;
    Ok(root)
}

fn read(path: &Path) -> Result<(TeamSpec, Node)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the team file {}", path.display()))?;
    let problems = |lines: Vec<String>| {
        anyhow!(
            "the team file {} does not check:\n  {}",
            path.display(),
            lines.join("\n  ")
        )
    };
    let de = toml::Deserializer::parse(&text).map_err(|e| problems(vec![e.to_string()]))?;
    let spec: TeamSpec =
        serde_path_to_error::deserialize(de).map_err(|e| problems(vec![path_error(&e)]))?;
    let root = check(&spec).map_err(|e| problems(e.0))?;
    Ok((spec, root))
}

/// `tandem run --team FILE TASK`: the team in this process, with the run's model, executor
/// and limits as every agent's defaults.
pub async fn run(
    args: &crate::run::RunArgs,
    path: &Path,
    file: crate::config::FileConfig,
) -> Result<u8> {
    use std::collections::HashMap;

    use tandem_agent::ChatModel;
    use tandem_agent::team::{TaskLabel, Team, executor_slot, run_team_task};
    use tandem_executor::{CancellationToken, SessionSpec};
    use tandem_protocol::team::Kind;
    use tandem_protocol::{ErrorCode, ErrorInfo};

    use crate::config;

    let root = load(path)?;
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
        .unwrap_or(DEFAULT_TEAM_TURNS);
    let label = TaskLabel {
        model: selector.config().model.clone(),
        base_url: selector.location(),
        executor: format!("team {}", path.display()),
    };
    let team = Team::new(root, selector.clone(), model, slot, max_turns, &limits)
        .map_err(|e| anyhow!("{}", e.message))?;

    let cancel = CancellationToken::new();
    crate::run::spawn_ctrl_c(cancel.clone());
    let timeout = crate::run::task_timeout(args, &file)?;
    let (renderer, events) = crate::run::transcript(args.json, &cancel);
    let team = team.with_approval(crate::run::gate(args, &file, &events)?);
    let stop_reason =
        run_team_task(team, &args.task, label, events, cancel, timeout, Vec::new()).await;
    if renderer.lock().is_ok_and(|r| r.reader_gone()) {
        return Ok(crate::exit::DONE);
    }
    Ok(crate::exit::for_stop(stop_reason))
}

/// Most turns of a team's agents together when neither `--max-turns` nor the config says.
const DEFAULT_TEAM_TURNS: u32 = 50;
