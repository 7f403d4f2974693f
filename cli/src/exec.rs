//! `tandem exec`: run code in an executor directly, with no model.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use tandem_agent::blocks::{self, RunOptions, SessionSlot};
use tandem_agent::{CodeBlock, extract_code_blocks};
use tandem_executor::{CancellationToken, Language, SessionSpec};
use tandem_protocol::{BlockStatus, EventMsg, OutputStream};

/// Where `exec` shows a block: its output on this process's stdout and stderr, as if the
/// program ran in this terminal, then what the live output did not carry (the cut and the
/// tail of a long stream, a refusal), then a status line on a fresh line.
#[derive(Default)]
struct Terminal {
    shown: Shown,
    /// Whether the last byte written to either stream ended a line.
    mid_line: bool,
}

impl Terminal {
    fn write(&mut self, stream: OutputStream, text: &str) -> std::io::Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        self.mid_line = !text.ends_with('\n');
        match stream {
            OutputStream::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes())?;
                out.flush()
            }
            OutputStream::Stderr => std::io::stderr().lock().write_all(text.as_bytes()),
        }
    }

    fn event(&mut self, msg: &EventMsg, many: bool) -> std::io::Result<()> {
        match msg {
            EventMsg::CodeBlock { .. } => self.shown.clear(),
            EventMsg::ExecOutput { stream, text, .. } => {
                self.shown.push(*stream, text);
                self.write(*stream, text)?;
            }
            EventMsg::ExecResult { index, result, .. } => {
                for stream in [OutputStream::Stdout, OutputStream::Stderr] {
                    let rest = self.shown.rest(stream, result);
                    self.write(stream, rest)?;
                }
                if many || !result.succeeded() || result.truncated {
                    let fresh = if self.mid_line { "\n" } else { "" };
                    self.write(
                        OutputStream::Stderr,
                        &format!("{fresh}tandem: block {index}: {}\n", result_line(result)),
                    )?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

use crate::config::{self, FileConfig};
use crate::render::{Shown, result_line};

#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    /// A code file (its extension picks the language), a markdown file (all its blocks run in
    /// order), or `-`/nothing for stdin (markdown unless --lang is given)
    input: Option<PathBuf>,
    /// Executor that runs the code: auto, docker, kubernetes, wasm, local or an [executors.NAME] plugin [env: TANDEM_EXECUTOR; default: auto]
    #[arg(long, short = 'e')]
    executor: Option<String>,
    /// Docker image for the docker executor [env: TANDEM_DOCKER_IMAGE; default: python:3.12-slim]
    #[arg(long)]
    image: Option<String>,
    /// The input is code in this language (python, sh, javascript, ...)
    #[arg(long)]
    lang: Option<String>,
    /// Wall-clock limit per block, in seconds [default: 60]
    #[arg(long)]
    timeout: Option<f64>,
    /// Use this directory as the workspace and keep it
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Print one JSON object per block
    #[arg(long)]
    json: bool,
    /// A host (or *.domain, host:port, CIDR[:port]) the code may reach through Tandem's
    /// egress proxy; repeatable (docs/network.md)
    #[arg(long = "allow-host", value_name = "HOST[:PORT]", value_parser = crate::run::flags::allow_entry)]
    allow_hosts: Vec<String>,
}

fn blocks_of(args: &ExecArgs, source: String) -> Result<Vec<CodeBlock>> {
    let code_block = |language: Language| CodeBlock {
        language: Some(language.to_string()),
        info: language.to_string(),
        code: source.clone(),
        unterminated: false,
    };
    if let Some(lang) = &args.lang {
        return Ok(vec![code_block(Language::new(lang))]);
    }
    let ext = args
        .input
        .as_ref()
        .filter(|p| p.as_os_str() != "-")
        .map(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .unwrap_or("")
                .to_ascii_lowercase()
        });
    match ext.as_deref() {
        None | Some("md" | "markdown") => {
            let blocks = extract_code_blocks(&source);
            if blocks.is_empty() {
                bail!(
                    "no fenced code blocks found in the markdown input; pass --lang to run it as code"
                );
            }
            Ok(blocks)
        }
        Some(ext) => match Language::from_extension(ext) {
            Some(lang) => Ok(vec![code_block(lang)]),
            None => bail!(
                "cannot tell the language of `{}` from its extension; pass --lang (python, sh, javascript)",
                args.input
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            ),
        },
    }
}

/// Each connection a block made through the egress proxy, one line on stderr.
struct NetLines;

impl tandem_egress::NetSink for NetLines {
    fn record(&self, event: tandem_protocol::net::NetEvent) {
        eprintln!("tandem: {}", event.line());
    }
}

pub async fn exec(args: ExecArgs, file: FileConfig) -> Result<u8> {
    let source = crate::read_input(args.input.as_ref())?;
    let blocks = blocks_of(&args, source)?;
    let executors =
        config::ExecutorSettings::resolve(&file, args.executor.as_deref(), args.image.as_deref());
    let name = &executors.default;
    let executor = crate::executors::resolve(name, &executors).await?;
    let executor_name = executor.name().to_owned();
    if executor_name == "local"
        && let Err(unconfined) = tandem_executor_local::confinement(executors.local.get()?)
    {
        eprintln!("tandem: local blocks run {unconfined}");
    }
    let limits = config::limits(&file, args.timeout, "--timeout")?;
    // This process is the operator's own road: `--allow-host` needs no bound here.
    let network = crate::planner::network(&file, true)?;
    let asked = (!args.allow_hosts.is_empty()).then(|| tandem_protocol::net::NetworkRequest {
        allow: args.allow_hosts.clone(),
    });
    let executor = match network
        .for_block(asked.as_ref(), &*executor)
        .map_err(|r| anyhow::anyhow!("{}", r.message))?
    {
        Some((egress, policy)) => Arc::new(tandem_egress::Behind::new(
            executor,
            egress,
            Arc::new(policy),
            Arc::new(NetLines),
        )) as Arc<dyn tandem_executor::Executor>,
        None => executor,
    };
    let mut slot = SessionSlot::new(
        executor,
        SessionSpec {
            workdir: args.workdir.clone(),
            limits,
            labels: Vec::new(),
            inputs: None,
            keep_state: false,
            placement: Vec::new(),
            egress: None,
            volumes: Vec::new(),
        },
    );
    let cancel = CancellationToken::new();
    crate::run::spawn_ctrl_c(cancel.clone());
    let json = args.json;
    let many = blocks.len() > 1;
    let terminal = std::sync::Mutex::new(Terminal::default());
    let events = Arc::new(move |msg: EventMsg| {
        if json {
            return;
        }
        if let Ok(mut t) = terminal.lock() {
            // A closed stdout (`| head`) is not this command's failure.
            let _ = t.event(&msg, many);
        }
    });
    let opts = RunOptions {
        turn: 0,
        timeout: None,
        cancel,
        events,
        // The person typing the code is the one who would approve it.
        approval: None,
        code_tools: None,
    };
    let runs = blocks::run_blocks(&mut slot, &blocks, &opts).await;
    let closed = slot.close().await;
    let runs = runs.with_context(|| format!("the {name} executor failed"))?;
    closed.with_context(|| format!("closing the {name} session failed"))?;
    let ran: Vec<_> = runs
        .iter()
        .filter(|r| r.result.status != BlockStatus::NotRun)
        .collect();
    if json {
        let mut out = std::io::stdout().lock();
        for run in &ran {
            serde_json::to_writer(&mut out, &run.result)?;
            out.write_all(b"\n")?;
        }
        out.flush()?;
    }
    if !json {
        let unsupported = ran
            .iter()
            .filter(|r| r.result.status == BlockStatus::Unsupported)
            .filter_map(|r| r.result.language.as_deref());
        for language in unsupported {
            let others: Vec<String> =
                crate::executors::executors_for(&Language::new(language), &executors)
                    .into_iter()
                    .filter(|e| *e != executor_name)
                    .collect();
            if !others.is_empty() {
                eprintln!(
                    "tandem: `{language}` runs on the {} executor: pass --executor {}",
                    others.join(" or "),
                    others[0]
                );
            }
        }
    }
    let code = ran.last().map_or(0, |r| blocks::exit_code_of(&r.result));
    Ok(u8::try_from(code).unwrap_or(1))
}
