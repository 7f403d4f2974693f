//! `tandem snapshot`: copies of a daemon's sessions' and tasks' workspaces, kept to start
//! new sessions from (docs/snapshots.md).

use anyhow::{Result, anyhow};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use tandem_protocol::ApiErrorCode;

use crate::client::{Client, HostFlag, Refused};
use crate::exit;

/// What `tandem snapshot` does.
#[derive(Debug, Subcommand)]
pub enum SnapshotAction {
    /// Take a snapshot of a session's or a finished task's workspace; prints its id
    Create(CreateArgs),
    /// List the daemon's snapshots
    Ls(ListArgs),
    /// Show a snapshot's record
    Show(IdArgs),
    /// Remove a snapshot (the content no other snapshot holds goes with it)
    Rm(IdArgs),
}

/// `tandem snapshot create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// The session's or task's id
    id: String,
    /// A name to find it by
    #[arg(long)]
    name: Option<String>,
    /// Print its record as JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

/// `tandem snapshot ls`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

/// `tandem snapshot show|rm`.
#[derive(Debug, Args)]
pub struct IdArgs {
    /// The snapshot's id
    id: String,
    /// Print JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

/// Runs `action`.
pub async fn run(action: SnapshotAction) -> Result<u8> {
    match action {
        SnapshotAction::Create(args) => create(args).await,
        SnapshotAction::Ls(args) => {
            let client = Client::new(&args.host)?;
            let value = client.get("/v1/snapshots").await?;
            if args.json {
                println!("{value}");
            } else {
                let list = value["snapshots"].as_array().cloned().unwrap_or_default();
                if list.is_empty() {
                    println!("no snapshots");
                }
                for snap in &list {
                    println!("{}", line(snap));
                }
            }
            Ok(exit::DONE)
        }
        SnapshotAction::Show(args) => {
            let client = Client::new(&args.host)?;
            let value = client.get(&format!("/v1/snapshots/{}", args.id)).await?;
            if args.json {
                println!("{value}");
            } else {
                println!("{}", line(&value));
                for skipped in value["not_saved"].as_array().into_iter().flatten() {
                    println!(
                        "  not saved: {} ({})",
                        skipped["name"].as_str().unwrap_or(""),
                        skipped["why"].as_str().unwrap_or("")
                    );
                }
            }
            Ok(exit::DONE)
        }
        SnapshotAction::Rm(args) => {
            let client = Client::new(&args.host)?;
            let value = client.delete(&format!("/v1/snapshots/{}", args.id)).await?;
            if args.json {
                println!("{value}");
            } else {
                println!("{} removed", args.id);
            }
            Ok(exit::DONE)
        }
    }
}

async fn create(args: CreateArgs) -> Result<u8> {
    let client = Client::new(&args.host)?;
    let body = match &args.name {
        Some(name) => json!({ "name": name }),
        None => json!({}),
    };
    // A session's id first; a task's when no session has it.
    let taken = match client
        .post_json(&format!("/v1/sessions/{}/snapshot", args.id), &body)
        .await
    {
        Err(e) if is_not_found(&e) => {
            client
                .post_json(&format!("/v1/tasks/{}/snapshot", args.id), &body)
                .await
                .map_err(|e| {
                    if is_not_found(&e) {
                        anyhow!(
                            "no open session and no task `{}` on this daemon: name one from `tandem tasks` or GET /v1/sessions",
                            args.id
                        )
                    } else {
                        e
                    }
                })?
        }
        other => other?,
    };
    if args.json {
        println!("{taken}");
    } else {
        println!("{}", taken["id"].as_str().unwrap_or(""));
    }
    Ok(exit::DONE)
}

fn is_not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Refused>()
        .is_some_and(|r| r.code == ApiErrorCode::NotFound)
}

/// One line for a snapshot: id, name, size, files, when, from what.
fn line(snap: &Value) -> String {
    let name = snap["name"]
        .as_str()
        .map(|n| format!(" {n:?}"))
        .unwrap_or_default();
    format!(
        "{}{name}  {} bytes in {} files  {}  from {} {}",
        snap["id"].as_str().unwrap_or(""),
        snap["bytes"].as_u64().unwrap_or(0),
        snap["files"].as_u64().unwrap_or(0),
        snap["created"].as_str().unwrap_or(""),
        snap["source"]["kind"].as_str().unwrap_or(""),
        snap["source"]["id"].as_str().unwrap_or(""),
    )
}
