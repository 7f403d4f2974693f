//! `tandem volume`: a daemon's volumes, named storage that outlives tasks and is mounted by
//! `--volume NAME:PATH[:ro]` (docs/volumes.md).

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::client::{Client, HostFlag};
use crate::exit;

/// What `tandem volume` does.
#[derive(Debug, Subcommand)]
pub enum VolumeAction {
    /// Make a volume; with --max-mb, a filesystem of that size of its own
    Create(CreateArgs),
    /// List the daemon's volumes
    Ls(ListArgs),
    /// Show one volume
    Show(NameArgs),
    /// Remove a volume and its files (refused while a sandbox has it mounted)
    Rm(NameArgs),
}

/// `tandem volume create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Its name: a-z, 0-9, `_` and `-`
    name: String,
    /// Its quota in MiB: a write past it fails as on a full disk
    #[arg(long)]
    max_mb: Option<u64>,
    /// Print its record as JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

/// `tandem volume ls`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

/// `tandem volume show|rm`.
#[derive(Debug, Args)]
pub struct NameArgs {
    /// The volume's name
    name: String,
    /// Print JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

/// Runs `action`.
pub async fn run(action: VolumeAction) -> Result<u8> {
    let (value, json, said) = match action {
        VolumeAction::Create(args) => {
            let client = Client::new(&args.host)?;
            let mut body = json!({ "name": args.name });
            if let Some(mb) = args.max_mb {
                body["max_mb"] = json!(mb);
            }
            let made = client.post_json("/v1/volumes", &body).await?;
            let said = line(&made);
            (made, args.json, said)
        }
        VolumeAction::Ls(args) => {
            let client = Client::new(&args.host)?;
            let value = client.get("/v1/volumes").await?;
            let list = value["volumes"].as_array().cloned().unwrap_or_default();
            let said = if list.is_empty() {
                "no volumes".to_owned()
            } else {
                list.iter().map(line).collect::<Vec<_>>().join("\n")
            };
            (value, args.json, said)
        }
        VolumeAction::Show(args) => {
            let client = Client::new(&args.host)?;
            let value = client.get(&format!("/v1/volumes/{}", args.name)).await?;
            let said = line(&value);
            (value, args.json, said)
        }
        VolumeAction::Rm(args) => {
            let client = Client::new(&args.host)?;
            let value = client.delete(&format!("/v1/volumes/{}", args.name)).await?;
            (value, args.json, format!("{} removed", args.name))
        }
    };
    if json {
        println!("{value}");
    } else {
        println!("{said}");
    }
    Ok(exit::DONE)
}

/// One line for a volume: name, quota and use, when made, how many sandboxes mount it.
pub fn line(v: &Value) -> String {
    let quota = match (v["max_mb"].as_u64(), v["used_bytes"].as_u64()) {
        (Some(max), Some(used)) => format!("{:.1} of {max} MiB used", used as f64 / 1048576.0),
        (Some(max), None) => format!("quota {max} MiB"),
        _ => "no quota".to_owned(),
    };
    format!(
        "{}  {quota}  made {}  mounted by {}",
        v["name"].as_str().unwrap_or(""),
        v["created"].as_str().unwrap_or(""),
        v["mounted_by"].as_u64().unwrap_or(0),
    )
}
