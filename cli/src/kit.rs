//! `tandem executor test`: the conformance kit run against one executor, built-in or plugin.

use std::io::Write as _;

use anyhow::Result;
use tandem_executor_conformance::{Report, Verdict};

use crate::config::FileConfig;

/// `tandem executor` commands.
#[derive(Debug, clap::Subcommand)]
pub enum ExecutorAction {
    /// Run the executor conformance suite against one executor and print each case's result
    Test(TestArgs),
}

/// Arguments of `tandem executor test`.
#[derive(Debug, clap::Args)]
pub struct TestArgs {
    /// The executor: a built-in (local, docker, wasm, auto) or an [executors.NAME] plugin
    pub name: String,
    /// Only the cases whose name contains this
    #[arg(long)]
    pub case: Option<String>,
    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,
    /// Docker image for the docker executor
    #[arg(long, env = "TANDEM_DOCKER_IMAGE")]
    pub image: Option<String>,
}

/// Runs the kit; exits 1 when a case fails.
pub async fn executor(action: ExecutorAction, file: &FileConfig) -> Result<u8> {
    let ExecutorAction::Test(args) = action;
    let executors = crate::config::ExecutorSettings::resolve(file, None, args.image.as_deref());
    let executor = crate::executors::resolve(&args.name, &executors).await?;
    let reports = tandem_executor_conformance::run(executor.clone(), args.case.as_deref()).await;
    let failed = reports
        .iter()
        .filter(|r| matches!(r.verdict, Verdict::Fail(_)))
        .count();
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer(
            &mut out,
            &serde_json::json!({"executor": executor.name(), "cases": reports}),
        )?;
        out.write_all(b"\n")?;
    } else {
        out.write_all(table(executor.name(), &reports).as_bytes())?;
    }
    out.flush()?;
    Ok(if failed > 0 {
        crate::exit::FAILED
    } else if reports.is_empty() {
        crate::exit::USAGE
    } else {
        crate::exit::DONE
    })
}

/// The table a person reads: one line per case, the reason under a case that did not pass,
/// and a summary line.
pub fn table(executor: &str, reports: &[Report]) -> String {
    let width = reports.iter().map(|r| r.case.len()).max().unwrap_or(0);
    let mut text = String::new();
    let (mut pass, mut fail, mut na) = (0, 0, 0);
    for r in reports {
        let (word, why) = match &r.verdict {
            Verdict::Pass => {
                pass += 1;
                ("pass", None)
            }
            Verdict::Fail(why) => {
                fail += 1;
                ("FAIL", Some(why))
            }
            Verdict::NotApplicable(why) => {
                na += 1;
                ("n/a", Some(why))
            }
        };
        text.push_str(&format!(
            "{:<width$}  {word:<4}  {:>6.2} s\n",
            r.case, r.seconds
        ));
        if let Some(why) = why {
            for line in why.lines() {
                text.push_str(&format!("    {line}\n"));
            }
        }
    }
    if reports.is_empty() {
        text.push_str("no case matches --case\n");
    }
    text.push_str(&format!(
        "executor `{executor}`: {pass} passed, {fail} failed, {na} not applicable\n"
    ));
    text
}
