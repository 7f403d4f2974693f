//! `tandem model`: the embedded model's files (pull, list).

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::{Context, Result};
use tandem_model_files::{ModelDir, Progress, Sources, catalog, megabytes};

use crate::config::{self, FileConfig};
use crate::exit;

/// `tandem model` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum ModelAction {
    /// Download a model (GGUF) for the embedded provider: resumable, sha256-checked
    Pull {
        /// Which model [default: qwen2.5-coder-1.5b; qwen2.5-coder-0.5b for small machines]
        name: Option<String>,
    },
    /// Show the model files present and the ones that can be pulled
    List,
}

/// Runs a `tandem model` subcommand.
pub async fn model(action: ModelAction, file: &FileConfig) -> Result<u8> {
    let dir = ModelDir::new(config::models_dir(file)?);
    match action {
        ModelAction::Pull { name } => pull(&dir, name.as_deref()).await,
        ModelAction::List => list(&dir),
    }
}

async fn pull(dir: &ModelDir, name: Option<&str>) -> Result<u8> {
    let spec = tandem_model_files::find(name.unwrap_or(tandem_model_files::DEFAULT_MODEL))?;
    let tls = tandem_agent::chat::tls_config(true)?;
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(Duration::from_secs(60))
        .tls_backend_preconfigured(tls)
        .build()
        .context("cannot build the HTTP client")?;
    let sources = Sources {
        http,
        hub_endpoint: config::hub_endpoint(),
        python: which::which("python3").ok(),
        attempts: 5,
    };
    eprintln!(
        "pulling {} ({}, {}) into {}",
        spec.name,
        spec.summary,
        megabytes(spec.size),
        dir.path().display()
    );
    let bar = std::io::stderr()
        .is_terminal()
        .then(|| indicatif::ProgressBar::new(spec.size));
    if let Some(bar) = &bar {
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "  {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
    }
    let mut on_progress = |p: Progress| match p {
        Progress::Trying {
            source, resumed_at, ..
        } => {
            let line = if resumed_at > 0 {
                format!("  from {source}, resuming at {}", megabytes(resumed_at))
            } else {
                format!("  from {source}")
            };
            match &bar {
                Some(bar) => {
                    bar.println(line);
                    bar.set_position(resumed_at);
                }
                None => eprintln!("{line}"),
            }
        }
        Progress::Downloaded(done) => {
            if let Some(bar) = &bar {
                bar.set_position(done);
            }
        }
        Progress::Verifying => match &bar {
            Some(bar) => bar.println("  checking sha256"),
            None => eprintln!("  checking sha256"),
        },
        Progress::Failed { source, reason } => {
            let line = format!("  {source} failed: {reason}");
            match &bar {
                Some(bar) => bar.println(line),
                None => eprintln!("{line}"),
            }
        }
    };
    let pulled = tandem_model_files::pull(dir, &spec, &sources, &mut on_progress).await;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let pulled = pulled?;
    match pulled.source {
        Some(source) => println!(
            "pulled {} from {source}: {}",
            spec.name,
            pulled.path.display()
        ),
        None => println!("{} is already pulled: {}", spec.name, pulled.path.display()),
    }
    Ok(exit::DONE)
}

fn list(dir: &ModelDir) -> Result<u8> {
    let found = dir.list()?;
    if found.is_empty() {
        println!("no model files in {}", dir.path().display());
    } else {
        println!("{:<20} {:>9}  PATH", "NAME", "SIZE");
        for f in &found {
            println!(
                "{:<20} {:>9}  {}",
                f.name.as_deref().unwrap_or("-"),
                megabytes(f.size),
                f.path.display()
            );
        }
    }
    let missing: Vec<String> = catalog()
        .into_iter()
        .filter(|m| dir.installed(m).is_none())
        .map(|m| format!("{} ({})", m.name, megabytes(m.size)))
        .collect();
    if !missing.is_empty() {
        println!(
            "can be pulled (`tandem model pull NAME`): {}",
            missing.join(", ")
        );
    }
    Ok(exit::DONE)
}
