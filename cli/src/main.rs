//! `tandem`: run coding tasks with an LLM that writes code and a sandbox that runs it.
// The doc comments of clap's argument types are the `--help` text a person reads, not
// rustdoc: `[y]es` and a bare URL there are meant as they are.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::bare_urls)]

mod approve;
mod client;
mod config;
mod eval;
mod exec;
mod executors;
mod exit;
mod files;
mod follow;
mod inert;
mod keep;
mod kit;
mod model;
mod picture;
mod planner;
mod provider;
mod render;
mod run;
mod serve;
mod snapshot;
mod store;
mod tasks;
mod team;
mod volume;

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tandem",
    version,
    about = "An LLM that solves coding tasks by running real code in a sandbox"
)]
struct Cli {
    /// Config file [default: ~/.config/tandem/tandem.toml if present]
    // An empty TANDEM_CONFIG means none, as an unset one does.
    #[arg(
        long,
        global = true,
        env = "TANDEM_CONFIG",
        value_parser = clap::builder::TypedValueParser::map(
            clap::builder::OsStringValueParser::new(),
            PathBuf::from
        )
    )]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Solve a task: the assistant writes code, the executor runs it, until done
    Run(run::RunArgs),
    /// Run code directly in an executor, with no model
    Exec(exec::ExecArgs),
    /// Run a suite of tasks, each decided by its own check: solve rate, turns, tokens, time
    Eval(eval::EvalArgs),
    /// Run the daemon in the foreground: tasks from many clients, stored durably
    Serve(serve::ServeArgs),
    /// Serve Tandem's executors and tasks to an agent over MCP on stdin and stdout
    Mcp(serve::McpArgs),
    /// Queue a task on the daemon and print its id
    Submit(tasks::SubmitArgs),
    /// List the daemon's tasks
    Tasks(tasks::ListArgs),
    /// Show a task's state and whole transcript
    Show(tasks::IdArgs),
    /// Show a task's events (-f: follow it live)
    Logs(tasks::LogsArgs),
    /// Cancel a queued, running or interrupted task
    Cancel(tasks::IdArgs),
    /// Continue an interrupted task from its transcript
    Resume(tasks::IdArgs),
    /// Run a block a daemon's task waits on (as written, or as edited with --code-file)
    Approve(approve::ApproveArgs),
    /// Decline a block a daemon's task waits on; the model is told the reason
    Deny(approve::DenyArgs),
    /// List a daemon's task's files, or download one (--get) or all of them (--tar)
    Files(files::FilesArgs),
    /// The embedded model's files: pull one, list them
    Model {
        #[command(subcommand)]
        action: model::ModelAction,
    },
    /// Check an executor, built-in or plugin, against the conformance suite
    Executor {
        #[command(subcommand)]
        action: kit::ExecutorAction,
    },
    /// Snapshots of a daemon's sessions and tasks: create, ls, show, rm
    Snapshot {
        #[command(subcommand)]
        action: snapshot::SnapshotAction,
    },
    /// Volumes of a daemon, named storage that outlives tasks: create, ls, show, rm
    Volume {
        #[command(subcommand)]
        action: volume::VolumeAction,
    },
    /// The daemon's task store: move a daemon's tasks from its SQLite file to PostgreSQL
    Store {
        #[command(subcommand)]
        action: store::StoreAction,
    },
    /// Work with team files (several agents): check one
    Team {
        #[command(subcommand)]
        action: TeamAction,
    },
    /// Print the fenced code blocks of a markdown file (stdin when no FILE) as JSON
    Extract {
        /// Markdown file; stdin when absent or `-`
        file: Option<PathBuf>,
    },
    /// Show the executors, their languages, which one `auto` picks, and the model settings
    Doctor {
        #[command(flatten)]
        model: config::ModelFlags,
        /// Docker image to check [default: python:3.12-slim]
        #[arg(long, env = "TANDEM_DOCKER_IMAGE")]
        image: Option<String>,
        /// Load the WASM runtimes now, compiling and caching them on first use, so that no
        /// task pays for it
        #[arg(long)]
        precompile: bool,
    },
}

#[derive(Debug, Subcommand)]
enum TeamAction {
    /// Check a team file: print its tree of agents and strategies, or every problem in it
    Check {
        /// The team file (TOML; see docs/teams.md)
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    // reqwest is built without a default TLS provider (so that plain-HTTP model servers skip
    // the CA bundle); every client in the process shares ring. Installing twice is a no-op.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let file = config::load(cli.config.as_deref());
    // Only the commands that run tasks export their spans.
    let traced = matches!(
        cli.command,
        Command::Run(_) | Command::Serve(_) | Command::Mcp(_) | Command::Eval(_)
    );
    let telemetry = match &file {
        Ok(file) if traced => tandem_telemetry::Telemetry::start(&file.telemetry),
        _ => Ok(None),
    };
    let exported = telemetry.as_ref().ok().and_then(Option::as_ref);
    init_logging(&cli.command, exported);
    let ran = file.and_then(|file| {
        telemetry.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
        dispatch(cli, file)
    });
    if let Some(telemetry) = exported {
        telemetry.shutdown();
    }
    match ran {
        Ok(code) => ExitCode::from(code),
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem: {e:#}");
            ExitCode::from(exit::USAGE)
        }
    }
}

/// Logs go to stderr; the daemon logs at info (JSON with `--log-format json`), commands at
/// warn. `RUST_LOG` overrides both. Tandem's spans stay out of the logs: they go to the
/// trace exporter, when there is one.
fn init_logging(command: &Command, telemetry: Option<&tandem_telemetry::Telemetry>) {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let (default, json) = match command {
        Command::Serve(args) => ("info", args.json_logs()),
        _ => ("warn", false),
    };
    // The database driver's debug lines carry every statement's parameters, tasks' events
    // among them: whatever RUST_LOG asks, it speaks at info at most.
    let quiet_driver = |f: tracing_subscriber::EnvFilter| match "tokio_postgres=info".parse() {
        Ok(directive) => f.add_directive(directive),
        Err(_) => f,
    };
    let no_spans =
        |f: tracing_subscriber::EnvFilter| match format!("{}=off", tandem_agent::trace::TARGET)
            .parse()
        {
            Ok(directive) => f.add_directive(directive),
            Err(_) => f,
        };
    let filter = no_spans(quiet_driver(
        tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
    ));
    let logs = tracing_subscriber::fmt::layer()
        // Colour codes only for a person at a terminal, never into a file or a pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // A log line that cannot be written (stderr closed) is dropped: reporting it would
        // panic, and in a daemon that leaves SIGTERM unanswered.
        .log_internal_errors(false)
        .with_writer(std::io::stderr);
    let logs = if json {
        logs.json().with_filter(filter).boxed()
    } else {
        logs.with_filter(filter).boxed()
    };
    let registry = tracing_subscriber::registry().with(logs);
    match telemetry {
        Some(t) => registry.with(t.layer()).init(),
        None => registry.init(),
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn dispatch(cli: Cli, file: config::FileConfig) -> Result<u8> {
    match cli.command {
        Command::Extract { file: path } => extract(path),
        Command::Team {
            action: TeamAction::Check { file: path },
        } => {
            let team = team::load(&path, &config::teams(&file)?)?;
            print!("{}", team.render());
            Ok(exit::DONE)
        }
        Command::Doctor {
            model,
            image,
            precompile,
        } => runtime()?.block_on(doctor(&model, image, precompile, file)),
        Command::Model { action } => runtime()?.block_on(model::model(action, &file)),
        Command::Store { action } => store::store(action),
        Command::Executor { action } => runtime()?.block_on(kit::executor(action, &file)),
        Command::Run(args) => runtime()?.block_on(run::run(args, file)),
        Command::Exec(args) => runtime()?.block_on(exec::exec(args, file)),
        Command::Eval(args) => runtime()?.block_on(eval::eval(args, file)),
        Command::Serve(args) => {
            let rt = runtime()?;
            let result = rt.block_on(serve::serve(args, file));
            // `serve` has already waited for what must finish (tasks, the store, sandboxes);
            // a WASM precompile still running on the blocking pool, or waiting on another
            // process's compile lock, must not hold the exit for seconds after SIGTERM.
            rt.shutdown_background();
            result
        }
        Command::Mcp(args) => {
            let rt = runtime()?;
            let result = rt.block_on(serve::mcp(args, file));
            rt.shutdown_background();
            result
        }
        Command::Submit(args) => runtime()?.block_on(tasks::submit(args, &file)),
        Command::Tasks(args) => runtime()?.block_on(tasks::list(args)),
        Command::Show(args) => runtime()?.block_on(tasks::show(args)),
        Command::Logs(args) => runtime()?.block_on(tasks::logs(args)),
        Command::Cancel(args) => runtime()?.block_on(tasks::cancel(args)),
        Command::Snapshot { action } => runtime()?.block_on(snapshot::run(action)),
        Command::Volume { action } => runtime()?.block_on(volume::run(action)),
        Command::Resume(args) => runtime()?.block_on(tasks::resume(args)),
        Command::Approve(args) => runtime()?.block_on(approve::approve(args)),
        Command::Deny(args) => runtime()?.block_on(approve::deny_cmd(args)),
        Command::Files(args) => runtime()?.block_on(files::files(args)),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Reads a file, or stdin for `None` and `-`.
pub fn read_input(path: Option<&PathBuf>) -> Result<String> {
    match path {
        Some(p) if p.as_os_str() != "-" => {
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
        }
        _ => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("cannot read standard input")?;
            Ok(text)
        }
    }
}

fn extract(path: Option<PathBuf>) -> Result<u8> {
    let markdown = read_input(path.as_ref())?;
    let blocks = tandem_agent::extract_code_blocks(&markdown);
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, &blocks)?;
    std::io::Write::write_all(&mut out, b"\n")?;
    Ok(exit::DONE)
}

async fn doctor(
    flags: &config::ModelFlags,
    image: Option<String>,
    precompile: bool,
    file: config::FileConfig,
) -> Result<u8> {
    let settings = config::Settings::resolve(
        file,
        &config::Overrides {
            executor: None,
            image: image.as_deref(),
            model: flags,
            road: config::Road::InProcess {
                timeout: None,
                block_timeout: None,
            },
        },
    );
    let (model, file) = (settings.model.get()?, &settings.file);
    match provider::choose(&settings.provider) {
        Ok(provider::Provider::Embedded { name, path }) => {
            let size = std::fs::metadata(&path).map_or(0, |m| m.len());
            println!(
                "model:     {name}, embedded: runs in Tandem's process, no server or key ({}, {})",
                path.display(),
                tandem_model_files::megabytes(size)
            );
            match provider::draft(&settings.provider) {
                Ok(Some(draft)) => println!(
                    "draft:     {}: guesses tokens that {name} checks (speculative decoding)",
                    draft.display()
                ),
                Ok(None) => {}
                Err(e) => println!("draft:     none: {e:#}"),
            }
        }
        Ok(provider::Provider::Server) => {
            println!("model:     {} at {}", model.model, model.base_url);
            println!(
                "api key:   {}",
                if model.api_key.is_some() {
                    "set"
                } else {
                    "not set"
                }
            );
        }
        Err(e) => println!("model:     none: {e:#}"),
    }
    println!(
        "code via:  {}",
        file.model.code_via.unwrap_or_default().as_str()
    );
    println!("tools:     {}", tools_report(file).await);
    println!("network:   {}", network_report(file));
    if file.network.is_some() {
        match planner::network(file, false) {
            Ok(tandem_daemon::NetworkConfig {
                egress_down: Some(why),
                ..
            }) => println!(
                "           the egress proxy cannot start: {why}; every sandbox that would go behind it is refused with this reason"
            ),
            Ok(_) => {}
            Err(e) => println!("           error: {e:#}"),
        }
    }
    println!("           {}", switches_report(file));
    for line in executors::report(&settings, precompile).await? {
        println!("{line}");
    }
    Ok(exit::DONE)
}

/// What each built-in executor's `network` setting gives its tasks, and why.
fn switches_report(file: &config::FileConfig) -> String {
    use config::NetworkSwitch;
    [
        ("docker", file.executors.docker.network),
        ("local", file.executors.local.network),
    ]
    .into_iter()
    .map(|(name, set)| {
        let why = match set {
            Some(_) => format!("network set in [executors.{name}]"),
            None => "the default".to_owned(),
        };
        let gives = match NetworkSwitch::resolve(set) {
            NetworkSwitch::Off => "never any network",
            NetworkSwitch::Open => "the open network, unguarded (no proxy, no policy)",
            NetworkSwitch::Policy => "behind the egress proxy when [network] or a task names hosts",
        };
        format!("{name}: {gives} ({why})")
    })
    .chain(file.executors.kubernetes.is_some().then(|| {
        "kubernetes: behind the egress proxy when [network] or a task names hosts (no switch: its pods' NetworkPolicy lets them reach only the proxy)".to_owned()
    }))
    .chain(std::iter::once(
        "wasm: never any network (no switch: a task with a network is refused on it)".to_owned(),
    ))
    .chain(file.executors.plugins.keys().map(|name| {
        format!("{name}: never any network (a plugin; a task with a network is refused on it)")
    }))
    .collect::<Vec<_>>()
    .join("; ")
}

/// What a sandbox may reach: `[network]` through the egress proxy, and where it applies.
fn network_report(file: &config::FileConfig) -> String {
    let Some(section) = &file.network else {
        return "none: sandboxes have no network (`--allow-host HOST` or [network] allow in tandem.toml puts a task's behind Tandem's egress proxy, docs/network.md)".to_owned();
    };
    match tandem_egress::Policy::parse(&section.allow, &section.deny) {
        Err(e) => format!("error in [network]: {e}"),
        Ok(policy) => {
            let allowed = policy.allowed_hosts();
            format!(
                "{} through Tandem's egress proxy, for sandboxes on docker, kubernetes and local (confined); wasm and plugins refuse a task with a network{}",
                if allowed.is_empty() {
                    "nothing allowed unless a task asks (--allow-host)".to_owned()
                } else {
                    format!("[network] allows {}", allowed.join(", "))
                },
                if section.deny.is_empty() {
                    String::new()
                } else {
                    format!("; deny: {}", section.deny.join(", "))
                }
            ) + &extras_report(section)
        }
    }
}

/// The package index and the brokered secrets `[network]` names (never a secret's value).
fn extras_report(section: &config::NetworkSection) -> String {
    let mut out = String::new();
    if let Some(python) = section.packages.as_ref().and_then(|p| p.python.as_ref()) {
        out.push_str(&format!(
            "; pip installs from {python} through a shared cache"
        ));
    }
    if let Some(npm) = section.packages.as_ref().and_then(|p| p.npm.as_ref()) {
        out.push_str(&format!("; npm installs from {npm} through a shared cache"));
    }
    if !section.secrets.is_empty() {
        let named: Vec<String> = section
            .secrets
            .iter()
            .map(|(name, s)| {
                let from = match (&s.value_env, &s.value_file) {
                    (Some(var), _) if std::env::var_os(var).is_some() => format!("${var}"),
                    (Some(var), _) => format!("${var}, which is not set"),
                    (None, Some(path)) if path.is_file() => path.display().to_string(),
                    (None, Some(path)) => format!("{}, which cannot be read", path.display()),
                    (None, None) => "no value_env or value_file".to_owned(),
                };
                format!("{} on {} ({name}, from {from})", s.header, s.host)
            })
            .collect();
        out.push_str(&format!(
            "; headers added at the egress: {}",
            named.join(", ")
        ));
    }
    out
}

/// The configured tools, each with what runs it; MCP servers are started and list theirs.
async fn tools_report(file: &config::FileConfig) -> String {
    use tandem_agent::tools::{Offered, Runs, resolve};
    if file.tools.is_empty() {
        return "none ([tools.NAME] in tandem.toml, docs/tools.md)".to_owned();
    }
    let offered = match Offered::start(file.tools.clone()).await {
        Ok(offered) => offered,
        Err(e) => return format!("error: {e}"),
    };
    match resolve(None, &offered) {
        Ok(tools) => tools
            .iter()
            .map(|t| {
                let runs = match &t.runs {
                    Runs::Command(_) => "a command in the sandbox".to_owned(),
                    Runs::Http(url) => format!("HTTP {url}"),
                    Runs::Mcp(..) => "an MCP server's tool".to_owned(),
                    Runs::Code => "the executor".to_owned(),
                };
                format!("{} ({runs})", t.name)
            })
            .collect::<Vec<_>>()
            .join(", "),
        Err(e) => format!("error: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    const README: &str = include_str!("../../README.md");

    /// Words of a shell command line up to a redirection or pipe: spaces split, double and
    /// single quotes group.
    fn words(line: &str) -> Vec<String> {
        let (mut words, mut word, mut quote) = (Vec::new(), String::new(), None);
        for c in line.chars() {
            match (quote, c) {
                (None, '<' | '>' | '|' | ';') => break,
                (None, '"' | '\'') => quote = Some(c),
                (Some(q), c) if c == q => quote = None,
                (None, ' ') => {
                    if !word.is_empty() {
                        words.push(std::mem::take(&mut word));
                    }
                }
                _ => word.push(c),
            }
        }
        if !word.is_empty() {
            words.push(word);
        }
        words
    }

    /// Every `tandem ...` command in the README's shell blocks parses as written.
    #[test]
    fn the_readmes_commands_parse_as_written() {
        let mut checked = 0;
        for block in tandem_agent::extract_code_blocks(README)
            .iter()
            .filter(|b| b.language.as_deref() == Some("sh"))
        {
            for line in block.code.lines() {
                let line = line.split(" #").next().unwrap_or_default();
                for command in line.split("&&").map(|c| c.trim().trim_end_matches('&')) {
                    // Environment assignments before the command are the shell's.
                    let command = command
                        .split_whitespace()
                        .skip_while(|w| w.contains('=') && !w.starts_with('-'))
                        .collect::<Vec<_>>()
                        .join(" ");
                    if !command.starts_with("tandem ") {
                        continue;
                    }
                    if let Err(e) = Cli::try_parse_from(words(&command)) {
                        panic!("README command `{command}` does not parse:\n{e}");
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked >= 10, "only {checked} commands found");
    }

    /// The command table names every flag of every command.
    #[test]
    fn the_readmes_command_table_names_every_flag() {
        for sub in Cli::command().get_subcommands() {
            let name = sub.get_name();
            let rows: Vec<&str> = README
                .lines()
                .filter(|l| l.starts_with("| `tandem ") && l.contains(&format!("`tandem {name} ")))
                .collect();
            assert!(!rows.is_empty(), "no README row for `tandem {name}`");
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                // --config is global and said once, under the table.
                if long == "config" {
                    continue;
                }
                assert!(
                    rows.iter().any(|r| r.contains(&format!("--{long}"))),
                    "the README's row for `tandem {name}` leaves out --{long}"
                );
            }
        }
    }
}
