//! `tandem run`: one task, on a daemon that answers or in this process. The flags make the
//! task ([`flags`]); [`run`] chooses the road; a driver runs it there ([`here`], in its own
//! [`workspace`], or [`daemon`]); both end the same way ([`end`]).

mod daemon;
mod end;
pub(crate) mod flags;
mod here;
mod workspace;

use std::path::PathBuf;

use anyhow::Result;

use crate::config::{FileConfig, ModelFlags, Overrides, Road, Settings};
pub use end::spawn_ctrl_c;
#[cfg(test)]
pub(crate) use end::workspace_pictures;
pub use flags::TaskFlags;

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
            match daemon::through_daemon(&client, &args, &settings.file).await {
                Err(e) if local_refused(&e, &settings) => {
                    eprintln!(
                        "tandem: the daemon does not offer the local executor to clients; running the task in this process instead"
                    );
                }
                other => return other,
            }
        }
    }
    if let Some(snap) = &args.flags.from_snapshot {
        anyhow::bail!(
            "--from {snap}: snapshots are kept by a daemon, and none answers here{}; start one with `tandem serve` (or name it with --host)",
            if args.local {
                " (--local runs in this process)"
            } else {
                ""
            }
        );
    }
    here::run_here(&args, &settings).await
}

/// Whether the daemon refused a task only because it does not offer `local`, which this
/// process can run on the user's own behalf.
fn local_refused(e: &anyhow::Error, settings: &Settings) -> bool {
    settings.executors.default == "local"
        && e.downcast_ref::<crate::client::Refused>()
            .is_some_and(|r| r.code == tandem_protocol::ApiErrorCode::NotAllowed)
}
