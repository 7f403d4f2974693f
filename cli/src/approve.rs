//! A person in the loop: `tandem run --approve` asks on the terminal before each block runs,
//! in this process or on the daemon; `tandem approve` and `tandem deny` decide a block a
//! daemon's task waits on.

use std::collections::HashSet;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::future::BoxFuture;
use serde_json::{Value, json};
use tandem_agent::{Approver, Ask, EventSink, Ruling};
use tandem_executor::CancellationToken;
use tandem_protocol::{Decision, DecisionBody, TaskView};

use crate::client::{Client, HostFlag};
use crate::exit;

/// `--approve` needs someone at a terminal to answer; the error says why, and what instead.
pub fn need_terminal() -> Result<()> {
    if std::io::stdin().is_terminal() && std::io::stderr().is_terminal() {
        return Ok(());
    }
    bail!(
        "--approve asks at the terminal before each block runs, but stdin or stderr is not a terminal; run it in a terminal, or submit the task to a daemon (`tandem submit` with an [approval] policy) and decide with `tandem approve ID` / `tandem deny ID`"
    )
}

/// What the person at the terminal chose, and the languages they approved for good.
#[derive(Default)]
pub struct Prompter {
    always: Mutex<HashSet<String>>,
}

impl Prompter {
    /// Asks about one block on the terminal (stderr and stdin); blocks the thread.
    pub fn ask(&self, n: u32, language: &str, code: &str, why: &str) -> Ruling {
        let approve = |code: Option<String>| Ruling {
            decision: Decision::Approve,
            code,
            reason: None,
            by: "user".to_owned(),
        };
        if self.always.lock().is_ok_and(|a| a.contains(language)) {
            eprintln!("tandem: approval {n}: {language} is approved for this run");
            return approve(None);
        }
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "{}", asked(n, language, code, why));
        let shown_language = crate::inert::line(language);
        loop {
            let _ = write!(
                err,
                "Run this block? [y]es / [n]o / [e]dit / [a]lways for {shown_language}: "
            );
            let _ = err.flush();
            let Some(answer) = read_line() else {
                return deny(Some("no answer: the terminal closed".to_owned()));
            };
            match answer.trim().to_lowercase().as_str() {
                "y" | "yes" => return approve(None),
                "a" | "always" => {
                    if let Ok(mut always) = self.always.lock() {
                        always.insert(language.to_owned());
                    }
                    return approve(None);
                }
                "n" | "no" => {
                    let _ = write!(err, "Why not? (told to the model; Enter to skip): ");
                    let _ = err.flush();
                    let reason = read_line().map(|r| r.trim().to_owned());
                    return deny(reason.filter(|r| !r.is_empty()));
                }
                "e" | "edit" => match edit(code, language) {
                    Ok(edited) if edited.trim().is_empty() => {
                        let _ = writeln!(err, "The edited block is empty; choose again.");
                    }
                    Ok(edited) => {
                        let edited_shown = crate::inert::text(edited.trim_end());
                        let _ = writeln!(err, "── edited ──\n{edited_shown}\n──");
                        return approve(Some(edited));
                    }
                    Err(e) => {
                        let _ = writeln!(err, "tandem: {e:#}");
                    }
                },
                _ => {
                    let _ = writeln!(err, "Answer y, n, e or a.");
                }
            }
        }
    }
}

/// The block asked about, as the person deciding sees it: the model chose its code and its
/// language, so neither may move the cursor to hide a line or rewrite what is shown.
fn asked(n: u32, language: &str, code: &str, why: &str) -> String {
    format!(
        "\n── approval {n} · {} · {} ──\n{}\n──\n",
        crate::inert::line(language),
        crate::inert::line(why),
        crate::inert::text(code.trim_end())
    )
}

fn deny(reason: Option<String>) -> Ruling {
    Ruling {
        decision: Decision::Deny,
        code: None,
        reason,
        by: "user".to_owned(),
    }
}

fn read_line() -> Option<String> {
    let mut line = String::new();
    match std::io::stdin().lock().read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(line),
    }
}

/// Opens `code` in `$VISUAL`, else `$EDITOR`, else `vi`; the file as saved.
fn edit(code: &str, language: &str) -> Result<String> {
    let extension = match language {
        "python" => "py",
        "javascript" => "js",
        "sh" => "sh",
        other => other,
    };
    let file = tempfile::Builder::new()
        .prefix("tandem-block-")
        .suffix(&format!(".{extension}"))
        .tempfile()
        .context("cannot make a file to edit the block in")?;
    std::fs::write(file.path(), code).context("cannot write the block to edit")?;
    let editor = crate::config::editor();
    // Through the shell, as git does: EDITOR may carry arguments (`code --wait`).
    let status = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg(&editor)
        .arg(file.path())
        .status()
        .with_context(|| format!("cannot start the editor `{editor}`"))?;
    if !status.success() {
        bail!("the editor `{editor}` failed ({status}); the block is unchanged, choose again");
    }
    std::fs::read_to_string(file.path()).context("cannot read the edited block back")
}

/// Asks at this terminal for a task run in this process, and tells the transcript.
pub struct TerminalApprover {
    prompter: Arc<Prompter>,
    events: EventSink,
    next: AtomicU32,
}

impl TerminalApprover {
    pub fn new(events: EventSink) -> Self {
        Self {
            prompter: Arc::new(Prompter::default()),
            events,
            next: AtomicU32::new(1),
        }
    }
}

impl Approver for TerminalApprover {
    fn decide<'a>(
        &'a self,
        ask: Ask,
        timeout: Duration,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Option<Ruling>> {
        Box::pin(async move {
            let n = self.next.fetch_add(1, Ordering::SeqCst);
            (self.events)(ask.requested(n));
            let prompter = self.prompter.clone();
            let (language, code, why) = (
                ask.language.to_string(),
                ask.code.clone(),
                ask.reason.clone(),
            );
            let asked =
                tokio::task::spawn_blocking(move || prompter.ask(n, &language, &code, &why));
            let ruling = tokio::select! {
                r = asked => r.ok()?,
                () = tokio::time::sleep(timeout) => Ruling::timed_out(timeout),
                () = cancel.cancelled() => return None,
            };
            (self.events)(ruling.decided(ask.turn, ask.index, n));
            Some(ruling)
        })
    }
}

/// For a task on the daemon: answers each `approval_requested` at this terminal and posts
/// the decision; returns the sender the event loop feeds.
pub fn answer_on_daemon(
    client: &Client,
    id: &str,
) -> tokio::sync::mpsc::UnboundedSender<(u32, String, String, String)> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u32, String, String, String)>();
    let (client, id) = (client.clone(), id.to_owned());
    let prompter = Arc::new(Prompter::default());
    tokio::spawn(async move {
        while let Some((n, language, code, why)) = rx.recv().await {
            let p = prompter.clone();
            let Ok(ruling) =
                tokio::task::spawn_blocking(move || p.ask(n, &language, &code, &why)).await
            else {
                return;
            };
            if let Err(e) = client
                .post_json(&format!("/v1/tasks/{id}/approvals/{n}"), &body(&ruling))
                .await
            {
                eprintln!("tandem: approval {n}: {e:#}");
            }
        }
    });
    tx
}

fn body(ruling: &Ruling) -> Value {
    json!(DecisionBody {
        decision: ruling.decision,
        code: ruling.code.clone(),
        reason: ruling.reason.clone(),
    })
}

#[derive(Debug, clap::Args)]
pub struct ApproveArgs {
    /// Task id
    id: String,
    /// Which approval (the number in `approval_requested`); the one waiting when absent
    n: Option<u32>,
    /// Run this file's code instead of the block as it was written
    #[arg(long, value_name = "FILE")]
    code_file: Option<std::path::PathBuf>,
    /// Print the daemon's JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

#[derive(Debug, clap::Args)]
pub struct DenyArgs {
    /// Task id
    id: String,
    /// Which approval; the one waiting when absent
    n: Option<u32>,
    /// Why, in words: the model is told, so it can take another way
    #[arg(long)]
    reason: Option<String>,
    /// Print the daemon's JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    host: HostFlag,
}

/// `tandem approve ID [N]`.
pub async fn approve(args: ApproveArgs) -> Result<u8> {
    let code = match &args.code_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the code file {}", path.display()))?,
        ),
        None => None,
    };
    let ruling = Ruling {
        decision: Decision::Approve,
        code,
        reason: None,
        by: "user".to_owned(),
    };
    decide(&args.host, &args.id, args.n, &ruling, args.json).await
}

/// `tandem deny ID [N] --reason R`.
pub async fn deny_cmd(args: DenyArgs) -> Result<u8> {
    decide(&args.host, &args.id, args.n, &deny(args.reason), args.json).await
}

async fn decide(
    host: &HostFlag,
    id: &str,
    n: Option<u32>,
    ruling: &Ruling,
    json: bool,
) -> Result<u8> {
    let client = Client::new(host)?;
    let n = match n {
        Some(n) => n,
        None => {
            let task = client.get(&format!("/v1/tasks/{id}")).await?;
            let task: TaskView = crate::client::typed(task, "a task")?;
            match task.pending_approval {
                Some(waiting) => waiting.n,
                None => bail!(
                    "task `{id}` has no block waiting for approval (it is {})",
                    task.record.state.as_str()
                ),
            }
        }
    };
    let answer = client
        .post_json(&format!("/v1/tasks/{id}/approvals/{n}"), &body(ruling))
        .await?;
    if json {
        println!("{answer}");
    } else {
        let what = match (ruling.decision, ruling.code.is_some()) {
            (Decision::Approve, true) => "approved, edited",
            (Decision::Approve, false) => "approved",
            (Decision::Deny, _) => "denied",
        };
        println!("{id} approval {n} {what}");
    }
    Ok(exit::DONE)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_block_asked_about_cannot_hide_its_lines_from_the_person_deciding() {
        // Up a line, clear it, back to its start: on a terminal the `rm` line would vanish.
        let code = "import os\nos.system('rm -rf ~')\x1b[1A\x1b[2K\rprint('hello')\n";
        let shown = super::asked(1, "python\x1b]0;x\x07", code, "every block \u{9b}2J");
        assert!(
            !shown.chars().any(|c| c.is_control() && c != '\n'),
            "{shown:?}"
        );
        assert_eq!(
            shown,
            "\n── approval 1 · python\\u{1b}]0;x\\u{7} · every block \\u{9b}2J ──\nimport os\nos.system('rm -rf ~')\\u{1b}[1A\\u{1b}[2K\nprint('hello')\n──\n"
        );
    }
}
