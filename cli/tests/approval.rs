//! Approval before execution, on the real daemon over HTTP and in a real terminal (tmux):
//! a block waits, a person approves, edits or denies it, the model hears why, rules fire by
//! name, the wait holds no slot, times out, and survives a restart.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_protocol::{
    ApprovalRequest, BlockStatus, Decision, Event, EventMsg, StopReason, TaskState, TaskView,
};
use tandem_tests::daemon::block_results;
use tandem_tests::{DaemonHarness as Daemon, Reply, Script, ScriptedOpenAi, script, texts};

use crate::e2e::settings;

async fn start(server: &ScriptedOpenAi, args: &[&str], config: &str) -> Daemon {
    Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        args,
        Some(config),
    )
    .await
}

fn fence(code: &str) -> String {
    format!("```python\n{code}\n```")
}

/// A reply with one python block, then `last` (what the model says once it ran).
fn block_then(code: &str, last: &str) -> Vec<Reply> {
    vec![Reply::from(fence(code).as_str()), Reply::from(last)]
}

/// Polls until task `id` is in `state`; returns its record.
async fn wait_state(d: &Daemon, id: &str, state: TaskState) -> TaskView {
    d.wait_state(id, state, Duration::from_secs(30)).await
}

async fn decide(d: &Daemon, id: &str, n: u64, body: Value) -> (u16, Value) {
    d.send(
        reqwest::Method::POST,
        &format!("/v1/tasks/{id}/approvals/{n}"),
        Some(body.to_string()),
    )
    .await
}

/// How many approvals `events` asked for (`approval_requested`).
fn requested(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e.msg, EventMsg::ApprovalRequested { .. }))
        .count()
}

/// What an `approval_decided` event says.
struct Decided<'a> {
    decision: Decision,
    by: &'a str,
    code: Option<&'a str>,
    rule: Option<&'a str>,
}

/// Every approval decision in `events` (`approval_decided`), in order.
fn decisions(events: &[Event]) -> Vec<Decided<'_>> {
    events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::ApprovalDecided {
                decision,
                by,
                code,
                rule,
                ..
            } => Some(Decided {
                decision: *decision,
                by,
                code: code.as_deref(),
                rule: rule.as_deref(),
            }),
            _ => None,
        })
        .collect()
}

/// What the model was sent as the executor's report in its second request.
fn report_seen(server: &ScriptedOpenAi, task: &str) -> String {
    let requests = server.requests_for(task);
    assert!(
        requests.len() >= 2,
        "the model was asked {} times",
        requests.len()
    );
    requests[1].last_message().unwrap_or_default().to_owned()
}

const ALWAYS: &str = "[approval]\nmode = \"always\"\n";

#[tokio::test]
async fn a_block_waits_and_runs_as_the_person_edited_it() {
    let task = "approval: edit";
    let server = ScriptedOpenAi::start(script([(
        task,
        block_then("print(41)", "Done.\nTERMINATE"),
    )]))
    .await
    .unwrap();
    let d = start(&server, &[], ALWAYS).await;
    let id = d.submit(json!({ "task": task })).await;
    let waiting = wait_state(&d, &id, TaskState::AwaitingApproval).await;
    assert_eq!(
        waiting.pending_approval,
        Some(ApprovalRequest {
            n: 1,
            turn: 1,
            index: 1,
            language: "python".to_owned(),
            code: "print(41)\n".to_owned(),
            rule: None,
            reason: "every block is asked about (mode = \"always\")".to_owned(),
        })
    );
    let (_, shown, _) = d.cli(&["show", &id]).await;
    assert!(
        shown.contains(&format!(
            "block 1 of turn 1 waits for approval 1 (every block is asked about (mode = \"always\")): `tandem approve {id} 1` runs it"
        )),
        "{shown}"
    );
    // Nothing ran yet.
    let events = d.events(&id, 0).await;
    assert!(block_results(&events).is_empty(), "{events:?}");
    assert_eq!(requested(&events), 1);

    let (status, body) = decide(
        &d,
        &id,
        1,
        json!({"decision": "approve", "code": "print(42)"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    d.wait_finished(&id, Duration::from_secs(30)).await;
    let events = d.events(&id, 0).await;
    let decided = decisions(&events);
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0].by, "user");
    assert_eq!(decided[0].code, Some("print(42)"));
    let result = block_results(&events)[0];
    assert_eq!(
        result.stdout, "42\n",
        "the edited code ran, not the model's"
    );
    assert!(report_seen(&server, task).contains("42"));
    // What a person reads afterwards, pinned.
    let (code, logs, err) = d.cli(&["logs", &id]).await;
    assert_eq!(code, 0, "{err}");
    settings().bind(|| insta::assert_snapshot!("approval_edited_transcript", logs));

    // Deciding again is a conflict, naming the first decision; an unknown number is 404.
    let (status, body) = decide(&d, &id, 1, json!({"decision": "deny"})).await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = decide(&d, &id, 7, json!({"decision": "approve"})).await;
    assert_eq!(
        status, 409,
        "a finished task has nothing to approve: {body}"
    );
}

#[tokio::test]
async fn a_denial_reaches_the_model_with_the_reason_typed() {
    let task = "approval: deny";
    let server = ScriptedOpenAi::start(script([(
        task,
        block_then("import os; print('deleting')", "Understood.\nTERMINATE"),
    )]))
    .await
    .unwrap();
    let d = start(&server, &[], ALWAYS).await;
    let id = d.submit(json!({ "task": task })).await;
    wait_state(&d, &id, TaskState::AwaitingApproval).await;
    // Bad bodies are refused with what to send, and decide nothing.
    for bad in [
        json!({"decision": "maybe"}),
        json!({"decision": "deny", "code": "x"}),
        json!({"decision": "approve", "code": "  "}),
        json!({"decision": "approve", "extra": 1}),
    ] {
        let (status, body) = decide(&d, &id, 1, bad.clone()).await;
        assert_eq!(status, 400, "{bad} → {body}");
        assert_eq!(body["error"]["code"], "invalid_request");
    }
    let (status, body) = decide(&d, &id, 2, json!({"decision": "approve"})).await;
    assert_eq!(status, 404);
    assert_eq!(
        body["error"]["message"],
        format!("task `{id}` never asked for approval 2; waiting for a decision: 1")
    );
    let (status, body) = decide(
        &d,
        &id,
        1,
        json!({"decision": "deny", "reason": "do not touch files"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let done = d.wait_finished(&id, Duration::from_secs(30)).await;
    assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));
    let events = d.events(&id, 0).await;
    let result = block_results(&events)[0];
    assert_eq!(result.status, BlockStatus::Declined);
    assert!(result.stdout.is_empty(), "it never ran");
    let report = report_seen(&server, task);
    assert!(
        report.contains("the user declined to run this block: do not touch files"),
        "{report}"
    );
}

#[tokio::test]
async fn rules_ask_deny_and_approve_by_name_and_a_task_only_tightens() {
    let config = r#"
[approval]
mode = "policy"
auto_approve = { languages = ["python"] }
[[approval.ask]]
name = "pip install"
pattern = "pip install"
[[approval.deny]]
name = "rm at the root"
pattern = 'rm\s+-rf\s+/'
"#;
    let (free, denied, asked, tightened) = (
        "approval: auto",
        "approval: rule denies",
        "approval: rule asks",
        "approval: task tightens",
    );
    let server = ScriptedOpenAi::start(script([
        (free, block_then("print('ok')", "TERMINATE")),
        (
            denied,
            block_then("import os; os.system('rm -rf /tmp/x')", "TERMINATE"),
        ),
        (
            asked,
            block_then("# pip install requests\nprint(1)", "TERMINATE"),
        ),
        (tightened, block_then("print(2)", "TERMINATE")),
    ]))
    .await
    .unwrap();
    let d = start(&server, &[], config).await;

    let id = d.submit(json!({ "task": free })).await;
    d.wait_finished(&id, Duration::from_secs(30)).await;
    let events = d.events(&id, 0).await;
    assert_eq!(requested(&events), 0);
    assert_eq!(block_results(&events)[0].stdout, "ok\n");

    let id = d.submit(json!({ "task": denied })).await;
    d.wait_finished(&id, Duration::from_secs(30)).await;
    let events = d.events(&id, 0).await;
    let decided = decisions(&events);
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0].rule, Some("rm at the root"));
    assert_eq!(decided[0].decision, Decision::Deny);
    assert_eq!(block_results(&events)[0].status, BlockStatus::Declined);
    assert!(report_seen(&server, denied).contains("deny rule `rm at the root`"));

    let id = d.submit(json!({ "task": asked })).await;
    let waiting = wait_state(&d, &id, TaskState::AwaitingApproval).await;
    assert_eq!(
        waiting
            .pending_approval
            .as_ref()
            .and_then(|a| a.rule.as_deref()),
        Some("pip install")
    );
    let (status, _) = decide(&d, &id, 1, json!({"decision": "approve"})).await;
    assert_eq!(status, 200);
    d.wait_finished(&id, Duration::from_secs(30)).await;

    // A task that says "never" cannot loosen the operator's policy; one that says
    // "always" tightens it: python, auto-approved above, now waits.
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": denied, "approval": {"mode": "never"}}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let loosen = body["id"].as_str().unwrap().to_owned();
    d.wait_finished(&loosen, Duration::from_secs(30)).await;
    let events = d.events(&loosen, 0).await;
    assert_eq!(decisions(&events)[0].rule, Some("rm at the root"));
    let id = d
        .submit(json!({"task": tightened, "approval": {"mode": "always"}}))
        .await;
    wait_state(&d, &id, TaskState::AwaitingApproval).await;
    let (status, _) = decide(&d, &id, 1, json!({"decision": "approve"})).await;
    assert_eq!(status, 200);
    d.wait_finished(&id, Duration::from_secs(30)).await;

    // A pattern that is not a regex is refused at submit, naming the rule.
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(
                json!({"task": "x", "approval": {"mode": "policy", "deny": [{"name": "broken", "pattern": "("}]}})
                    .to_string(),
            ),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("approval rule `broken` (deny)"),
        "{message}"
    );
}

#[tokio::test]
async fn a_waiting_task_holds_no_slot_and_an_unanswered_one_is_denied_in_time() {
    let config = "[approval]\nmode = \"policy\"\ntimeout_secs = 2\n[[approval.ask]]\nname = \"slow\"\npattern = \"SLOW\"\n";
    let (waits, passes) = ("approval: waits", "approval: passes meanwhile");
    let server = ScriptedOpenAi::start(script([
        (waits, block_then("print('SLOW')", "TERMINATE")),
        (passes, texts(&["Nothing to run.\nTERMINATE"])),
    ]))
    .await
    .unwrap();
    // One slot: the second task can only run if the waiting one gave its slot up.
    let d = start(&server, &["--max-concurrent", "1"], config).await;
    let first = d.submit(json!({ "task": waits })).await;
    wait_state(&d, &first, TaskState::AwaitingApproval).await;
    let second = d.submit(json!({ "task": passes })).await;
    let done = d.wait_finished(&second, Duration::from_secs(10)).await;
    assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));
    assert_eq!(
        d.task(&first).await.record.state,
        TaskState::AwaitingApproval
    );
    // No one answers: the timeout denies it, and the model is told.
    d.wait_finished(&first, Duration::from_secs(30)).await;
    let events = d.events(&first, 0).await;
    let decided = decisions(&events);
    assert_eq!(decided[0].by, "timeout");
    assert!(report_seen(&server, waits).contains("no one approved it within 2 s"));
}

#[tokio::test]
async fn a_waiting_block_survives_a_crash_and_is_decided_after_it() {
    let task = "approval: restart";
    let server = ScriptedOpenAi::start(script([(
        task,
        block_then("print('after restart')", "TERMINATE"),
    )]))
    .await
    .unwrap();
    let mut d = start(&server, &[], ALWAYS).await;
    let id = d.submit(json!({ "task": task })).await;
    wait_state(&d, &id, TaskState::AwaitingApproval).await;
    d.kill9();
    d.spawn().await;
    // Back to waiting for the same block, under the same number, without asking the model
    // again.
    let waiting = wait_state(&d, &id, TaskState::AwaitingApproval).await;
    assert_eq!(waiting.pending_approval.as_ref().map(|a| a.n), Some(1));
    assert_eq!(
        waiting.pending_approval.as_ref().map(|a| a.code.as_str()),
        Some("print('after restart')\n")
    );
    assert_eq!(server.requests_for(task).len(), 1);
    // Decided over the CLI, which finds the waiting approval itself.
    let (code, out, err) = d.cli(&["approve", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, format!("{id} approval 1 approved\n"));
    d.wait_finished(&id, Duration::from_secs(30)).await;
    let events = d.events(&id, 0).await;
    assert_eq!(requested(&events), 1);
    let results = block_results(&events);
    assert_eq!(results.last().unwrap().stdout, "after restart\n");

    // A decision made while the daemon is down is made after it is up again: SIGTERM
    // interrupts the waiting task, and the next start waits again.
    let task2 = "approval: deny after shutdown";
    server.set(task2, block_then("print(3)", "TERMINATE"));
    let id = d.submit(json!({ "task": task2 })).await;
    wait_state(&d, &id, TaskState::AwaitingApproval).await;
    // A task waiting for a person does not hold the shutdown for its grace (10 s).
    let stopping = Instant::now();
    d.terminate().await;
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "the shutdown waited {:?}",
        stopping.elapsed()
    );
    d.spawn().await;
    wait_state(&d, &id, TaskState::AwaitingApproval).await;
    let (code, _, err) = d.cli(&["deny", &id, "--reason", "not today"]).await;
    assert_eq!(code, 0, "{err}");
    d.wait_finished(&id, Duration::from_secs(30)).await;
    assert!(report_seen(&server, task2).contains("not today"));
}

/// A decision stored just before a crash is not lost: the task, back after the restart, runs
/// the block as decided without asking again.
#[tokio::test(flavor = "multi_thread")]
async fn a_decision_made_before_a_crash_is_acted_on_after_it() {
    let (waits, holds) = ("approval: decided then crash", "approval: holds the slot");
    let config = "[approval]\nmode = \"policy\"\nauto_approve = { languages = [\"python\"] }\n[[approval.ask]]\nname = \"gated\"\npattern = \"GATED\"\n";
    let server = ScriptedOpenAi::start(script([
        (waits, block_then("print('GATED, then run')", "TERMINATE")),
        (
            holds,
            block_then("import time; time.sleep(60)", "TERMINATE"),
        ),
    ]))
    .await
    .unwrap();
    let mut d = start(&server, &["--max-concurrent", "1"], config).await;
    let id = d.submit(json!({ "task": waits })).await;
    wait_state(&d, &id, TaskState::AwaitingApproval).await;
    // The other task takes the only slot while this one waits...
    let holder = d.submit(json!({ "task": holds })).await;
    let started = Instant::now();
    while !d
        .events(&holder, 0)
        .await
        .iter()
        .any(|e| matches!(e.msg, EventMsg::CodeBlock { .. }))
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the holder never ran"
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    // ...so the decision is stored, but the block cannot run before the crash.
    let (status, body) = decide(&d, &id, 1, json!({"decision": "approve"})).await;
    assert_eq!(status, 200, "{body}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(block_results(&d.events(&id, 0).await).is_empty());
    d.kill9();
    d.spawn().await;
    let done = d.wait_finished(&id, Duration::from_secs(30)).await;
    assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));
    let events = d.events(&id, 0).await;
    assert_eq!(requested(&events), 1, "asked again");
    assert_eq!(decisions(&events).len(), 1);
    assert_eq!(
        block_results(&events).last().unwrap().stdout,
        "GATED, then run\n"
    );
    assert_eq!(
        server.requests_for(waits).len(),
        2,
        "the reply was not asked for again"
    );
}

#[tokio::test]
async fn run_approve_without_a_terminal_is_an_error_that_says_why() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["run", "--local", "--approve", "print 1"])
        .env("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--approve asks at the terminal before each block runs, but stdin or stderr is not a terminal"),
        "{err}"
    );
}

/// A real terminal: tmux runs a command in a pane of its own; keys are typed into it and its
/// screen is read back. Its stdout goes to a file, with `EXIT=<code>` at the end.
struct Terminal {
    session: String,
    transcript: std::path::PathBuf,
}

impl Terminal {
    fn start(dir: &Path, args: &str, env: &[(&str, String)]) -> Self {
        let transcript = dir.join("out.txt");
        let session = format!(
            "tandem-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        );
        let command = format!(
            "{} {args} > {out} ; echo EXIT=$? >> {out}; sleep 60",
            env!("CARGO_BIN_EXE_tandem"),
            out = transcript.display(),
        );
        let mut tmux_args: Vec<String> =
            ["new-session", "-d", "-s", &session, "-x", "150", "-y", "50"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        for (k, v) in env {
            tmux_args.extend(["-e".to_owned(), format!("{k}={v}")]);
        }
        tmux_args.push(command);
        let t = Self {
            session,
            transcript,
        };
        t.tmux(&tmux_args.iter().map(String::as_str).collect::<Vec<_>>());
        t
    }

    fn tmux(&self, args: &[&str]) -> String {
        // A server of its own: tests that start and end tmux servers at once never meet a
        // shared one as it exits.
        let out = std::process::Command::new("tmux")
            .args(["-L", &self.session])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "tmux {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.transcript).unwrap_or_default()
    }

    /// Waits for `needle` on the screen; the screen.
    fn wait_for(&self, needle: &str) -> String {
        let started = Instant::now();
        loop {
            let s = self.tmux(&["capture-pane", "-p", "-t", &self.session]);
            if s.contains(needle) {
                return s;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "`{needle}` never appeared on the terminal:\n{s}\nstdout so far:\n{}",
                self.stdout()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Types `text` and Enter.
    fn answer(&self, text: &str) {
        self.tmux(&["send-keys", "-t", &self.session, text, "Enter"]);
    }

    /// Waits for the command to end; its stdout.
    fn finish(self) -> String {
        let started = Instant::now();
        loop {
            let out = self.stdout();
            if out.contains("EXIT=") {
                return out;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the command never ended:\n{}",
                self.tmux(&["capture-pane", "-p", "-t", &self.session])
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = std::process::Command::new("tmux")
            .args(["-L", &self.session, "kill-server"])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn run_approve_asks_in_a_real_terminal_edits_and_denies() {
    let task = "approval: terminal";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from(fence("print(6 * 7)").as_str()),
            Reply::from(fence("print('second')").as_str()),
            "Done.\nTERMINATE".into(),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The "editor" rewrites the block as a person would, then saves.
    let editor = dir.path().join("editor.sh");
    std::fs::write(&editor, "#!/bin/sh\nsed -i 's/6 \\* 7/6 * 9/' \"$1\"\n").unwrap();
    std::fs::set_permissions(&editor, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let term = Terminal::start(
        dir.path(),
        &format!("run --local --approve -e local '{task}'"),
        &[
            ("OPENAI_BASE_URL", server.base_url()),
            ("EDITOR", editor.display().to_string()),
            ("XDG_CONFIG_HOME", dir.path().display().to_string()),
            ("TANDEM_MAX_RETRIES", "0".to_owned()),
        ],
    );
    let first = term.wait_for("Run this block? [y]es / [n]o / [e]dit / [a]lways for python:");
    assert!(
        first.contains("── approval 1 · python · every block is asked about"),
        "{first}"
    );
    assert!(first.contains("print(6 * 7)"), "{first}");
    let prompt: Vec<&str> = first.lines().filter(|l| !l.trim().is_empty()).collect();
    settings().bind(|| insta::assert_snapshot!("approval_terminal_prompt", prompt.join("\n")));
    term.answer("e");
    term.wait_for("print(6 * 9)");
    term.wait_for("approval 2 · python");
    term.answer("n");
    term.wait_for("Why not?");
    term.answer("not needed");
    let out = term.finish();
    assert!(out.contains("EXIT=0"), "{out}");
    assert!(out.contains("54\n"), "the edited block ran: {out}");
    assert!(
        !out.contains("\n42\n"),
        "the model's own block did not: {out}"
    );
    assert!(
        out.contains("approval 2 denied by user: not needed"),
        "{out}"
    );
    let requests = server.requests_for(task);
    let last = requests[2].last_message().unwrap_or_default().to_owned();
    assert!(
        last.contains("the user declined to run this block: not needed"),
        "{last}"
    );
}

/// `tandem run --approve` on a daemon: the task waits there, and this terminal answers.
#[tokio::test(flavor = "multi_thread")]
async fn run_approve_through_the_daemon_answers_at_the_terminal() {
    let task = "approval: terminal via daemon";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from(fence("print('via the daemon')").as_str()),
            Reply::from(fence("print('again')").as_str()),
            "Done.\nTERMINATE".into(),
        ],
    )]))
    .await
    .unwrap();
    // The daemon's own policy asks nothing: the task's `--approve` tightens it.
    let d = start(&server, &[], "").await;
    let dir = tempfile::tempdir().unwrap();
    let term = Terminal::start(
        dir.path(),
        &format!("run --approve '{task}'"),
        &[
            ("TANDEM_HOST", d.host()),
            ("XDG_CONFIG_HOME", dir.path().display().to_string()),
        ],
    );
    term.wait_for("Run this block? [y]es / [n]o / [e]dit / [a]lways for python:");
    // The event reaches the terminal as it is made; the task's row says so once the store's
    // writer has written it (PostgreSQL takes longer).
    let started = Instant::now();
    let id = loop {
        if let Some(first) = d.tasks("/v1/tasks").await.tasks.first() {
            break first.id.clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no task listed"
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
    };
    wait_state(&d, &id, TaskState::AwaitingApproval).await;
    // [a]lways: this block and every later python block run without asking.
    term.answer("a");
    let out = term.finish();
    assert!(out.contains("on the daemon at"), "{out}");
    assert!(out.contains("EXIT=0"), "{out}");
    assert!(
        out.contains("via the daemon\n") && out.contains("again\n"),
        "{out}"
    );
    let id = d.tasks("/v1/tasks").await.tasks[0].id.clone();
    let events = d.events(&id, 0).await;
    assert_eq!(decisions(&events).len(), 2);
    assert!(decisions(&events).iter().all(|e| e.by == "user"));
}

#[tokio::test]
async fn the_task_list_pages_newest_first() {
    let server = ScriptedOpenAi::start(Script::new()).await.unwrap();
    let d = start(&server, &[], "").await;
    let mut ids = Vec::new();
    for i in 0..5 {
        // No model reply is scripted: each task ends at once, with an error.
        ids.push(d.submit(json!({ "task": format!("page {i}") })).await);
    }
    let mut seen = Vec::new();
    let mut before: Option<String> = None;
    loop {
        let path = match &before {
            None => "/v1/tasks?limit=2".to_owned(),
            Some(b) => format!("/v1/tasks?limit=2&before={b}"),
        };
        let page = d.tasks(&path).await;
        assert!(page.tasks.len() <= 2);
        seen.extend(page.tasks.into_iter().map(|t| t.id));
        match page.next {
            Some(next) => before = Some(next),
            None => break,
        }
    }
    ids.reverse();
    assert_eq!(seen, ids);
    for bad in [
        "limit=0",
        "limit=501",
        "limit=x",
        "before=abc",
        "limt=2",
        "state=waiting",
    ] {
        let (status, body) = d
            .send(reqwest::Method::GET, &format!("/v1/tasks?{bad}"), None)
            .await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let empty = d.get("/v1/tasks?limit=2&before=nosuchtask").await;
    assert_eq!(empty, json!({"tasks": [], "next": null}));
}

#[tokio::test]
async fn a_team_file_parses_to_the_json_a_task_takes() {
    let server = ScriptedOpenAi::start(Script::new()).await.unwrap();
    let d = start(&server, &[], "").await;
    let file = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/teams/review.toml"
    ))
    .unwrap();
    let resp = d
        .http()
        .post("http://tandem/v1/teams/parse")
        .header("content-type", "text/plain")
        .body(file)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert!(body["team"]["team"].is_object(), "{body}");
    let resp = d
        .http()
        .post("http://tandem/v1/teams/parse")
        .body("[team]\nkind = \"chat\"\nagents = [\"nobody\"]\n")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("the team file does not check:"),
        "{message}"
    );
}
