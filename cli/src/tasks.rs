//! Client commands: `submit`, `tasks`, `show`, `logs`, `cancel`, `resume`.

use anyhow::Result;
use serde_json::Value;
use tandem_protocol::{EventMsg, StopReason, TaskList, TaskRecord, TaskView};

use crate::client::{Client, HostFlag, typed};
use crate::config::{FileConfig, ModelFlags};
use crate::exit;
use crate::follow::follow;
use crate::render::{Mode, Renderer};
use crate::run::TaskFlags;

#[derive(Debug, clap::Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    flags: TaskFlags,
    /// Model name (the daemon's when absent)
    #[arg(long)]
    model: Option<String>,
    /// OpenAI-compatible API base URL (the daemon's when absent)
    #[arg(long)]
    base_url: Option<String>,
    /// Every code block waits for `tandem approve` (or `deny`) before it runs
    #[arg(long)]
    approve: bool,
    /// Wait for the task and show it as it runs; exit as `tandem run` does
    #[arg(long)]
    wait: bool,
    /// Print `{"id": ...}` (with --wait: one JSON event per line)
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

pub async fn submit(args: SubmitArgs, file: &FileConfig) -> Result<u8> {
    let client = Client::new(&args.host)?;
    let model = ModelFlags {
        model: args.model,
        base_url: args.base_url,
        no_stream: false,
    };
    let mut spec = args.flags.daemon_spec(&model, args.approve, file)?;
    spec.files = crate::files::upload(&client, &args.flags.files).await?;
    let id = client.submit(&spec).await?;
    if args.wait {
        return follow(&client, &id, Mode::json(args.json)).await;
    }
    if args.json {
        println!("{}", serde_json::json!({ "id": id }));
    } else {
        println!("{id}");
    }
    Ok(exit::DONE)
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Only tasks in this state: queued, running, awaiting_approval, interrupted or finished
    #[arg(long)]
    state: Option<String>,
    /// Print the daemon's JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

pub async fn list(args: ListArgs) -> Result<u8> {
    let client = Client::new(&args.host)?;
    let path = match &args.state {
        Some(s) => format!("/v1/tasks?state={s}"),
        None => "/v1/tasks".to_owned(),
    };
    let value = client.get(&path).await?;
    if args.json {
        println!("{value}");
        return Ok(exit::DONE);
    }
    println!(
        "{:<32}  {:<17}  {:<10}  {:>5}  TASK",
        "ID", "STATE", "STOP", "TURNS"
    );
    let list: TaskList = typed(value, "a task list")?;
    for t in &list.tasks {
        let task: String = t.spec.task.replace('\n', " ").chars().take(60).collect();
        println!(
            "{:<32}  {:<17}  {:<10}  {:>5}  {task}",
            t.id,
            t.state.as_str(),
            t.stop_reason.map_or("-", StopReason::as_str),
            t.turns,
        );
    }
    Ok(exit::DONE)
}

#[derive(Debug, clap::Args)]
pub struct IdArgs {
    /// Task id
    id: String,
    /// Print JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

pub async fn show(args: IdArgs) -> Result<u8> {
    let client = Client::new(&args.host)?;
    let value = client.get(&format!("/v1/tasks/{}", args.id)).await?;
    if args.json {
        println!("{value}");
        return Ok(exit::DONE);
    }
    let view: TaskView = typed(value, "a task")?;
    let task = &view.record;
    let turns = task.turns;
    println!(
        "task {} · {}{} · {turns} turn{} · {} in / {} out tokens{}",
        task.id,
        task.state.as_str(),
        task.stop_reason
            .map(|s| format!(" ({})", s.as_str()))
            .unwrap_or_default(),
        if turns == 1 { "" } else { "s" },
        task.usage.prompt_tokens,
        task.usage.completion_tokens,
        task.cost
            .filter(|c| *c > 0.0)
            .map(|c| format!(" · cost {c:.4}"))
            .unwrap_or_default(),
    );
    if let Some(error) = &task.error {
        println!("error: {}", error.message);
    }
    if let Some(budget) = &task.budget {
        println!("budget: {}", budget.message());
    }
    if let Some(trace) = &task.trace_id {
        println!("trace {trace}");
    }
    if let Some(waiting) = &view.pending_approval {
        let (id, n) = (&task.id, waiting.n);
        println!(
            "block {} of turn {} waits for approval {n} ({}): `tandem approve {id} {n}` runs it, `tandem deny {id} {n} --reason WHY` declines it",
            waiting.index, waiting.turn, waiting.reason,
        );
    }
    for m in &view.transcript {
        println!("── {} ──", m.role.as_str());
        println!("{}", m.content.trim_end());
    }
    // How each block ended and what it used, which the messages do not say.
    let mut blocks = Vec::new();
    client
        .events(&task.id, 0, false, &mut |e| {
            if let EventMsg::ExecResult {
                turn,
                index,
                result,
            } = &e.msg
            {
                blocks.push((*turn, *index, result.clone()));
            }
        })
        .await?;
    if !blocks.is_empty() {
        println!("── blocks ──");
        let mut total = tandem_protocol::Resources::default();
        for (turn, index, result) in &blocks {
            if let Some(used) = &result.resources {
                total.add(used);
            }
            let line = crate::render::result_and_usage(result);
            println!("turn {turn} block {index}: {line}");
        }
        let total = total.summary();
        if !total.is_empty() && blocks.len() > 1 {
            println!("all blocks: {total}");
        }
    }
    // The answer last, as `tandem run` ends.
    match (&task.answer, task.answer_from, &task.no_answer) {
        (Some(answer), from, _) => {
            let label = match from {
                Some(tandem_protocol::AnswerFrom::Output) => "answer: what the code printed",
                _ => "answer",
            };
            println!("── {label} ──");
            println!("{}", answer.trim_end());
        }
        (None, _, Some(why)) => println!("── no answer: {why} ──"),
        (None, _, None) => {}
    }
    Ok(exit::DONE)
}

#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    /// Task id
    id: String,
    /// Keep following until the task ends (reconnects if the connection breaks)
    #[arg(long, short = 'f')]
    follow: bool,
    /// One JSON event per line
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

pub async fn logs(args: LogsArgs) -> Result<u8> {
    let client = Client::new(&args.host)?;
    if args.follow {
        follow(&client, &args.id, Mode::json(args.json)).await?;
        return Ok(exit::DONE);
    }
    let mut renderer = Renderer::stdout(Mode::json(args.json));
    client
        .events(&args.id, 0, false, &mut |e| renderer.event(&e.msg))
        .await?;
    Ok(exit::DONE)
}

pub async fn cancel(args: IdArgs) -> Result<u8> {
    let client = Client::new(&args.host)?;
    let value = client.cancel(&args.id).await?;
    print_state(value, args.json, "cancelling")?;
    Ok(exit::DONE)
}

pub async fn resume(args: IdArgs) -> Result<u8> {
    let client = Client::new(&args.host)?;
    let value = client
        .post(&format!("/v1/tasks/{}/resume", args.id))
        .await?;
    print_state(value, args.json, "resumed")?;
    Ok(exit::DONE)
}

fn print_state(value: Value, json: bool, what: &str) -> Result<()> {
    if json {
        println!("{value}");
    } else {
        let task: TaskRecord = typed(value, "a task")?;
        println!("{} {what}", task.id);
    }
    Ok(())
}
