use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_protocol::{
    BlockResult, BlockStatus, ErrorCode, ErrorInfo, Event, EventMsg, StopReason, Usage,
};
use tandem_tests::daemon::{block_output, block_results, kinds};
use tandem_tests::{Reply, ScriptedOpenAi, script, texts};

pub(crate) struct Output {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// What a task's `task_finished` event says.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) stop_reason: StopReason,
    pub(crate) turns: u32,
    pub(crate) usage: Usage,
    pub(crate) error: Option<ErrorInfo>,
    pub(crate) summary: Option<String>,
}

impl Output {
    /// The events of a `--json` transcript (`tandem run`, `submit --wait`, `logs`): one per line.
    pub(crate) fn events(&self) -> Vec<Event> {
        self.stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not an Event ({e}): {l}")))
            .collect()
    }

    /// What `tandem exec --json` printed: one block's result per line (not events).
    fn exec_results(&self) -> Vec<BlockResult> {
        self.stdout
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not a BlockResult ({e}): {l}"))
            })
            .collect()
    }

    /// The events whose wire `type` is `kind`.
    pub(crate) fn of_type(&self, kind: &str) -> Vec<EventMsg> {
        let events = self.events();
        let names = kinds(&events);
        events
            .into_iter()
            .zip(names)
            .filter(|(_, k)| k == kind)
            .map(|(e, _)| e.msg)
            .collect()
    }

    /// The result of every block (`exec_result`), in order.
    pub(crate) fn results(&self) -> Vec<BlockResult> {
        block_results(&self.events()).into_iter().cloned().collect()
    }

    /// The total length of the blocks' live output (`exec_output`).
    fn live_bytes(&self) -> usize {
        block_output(&self.events()).iter().map(|t| t.len()).sum()
    }

    /// The executor's reports to the model (`executor_message`), in order.
    fn reports(&self) -> Vec<String> {
        self.events()
            .into_iter()
            .filter_map(|e| match e.msg {
                EventMsg::ExecutorMessage { text, .. } => Some(text),
                _ => None,
            })
            .collect()
    }

    /// The task's last event, `task_finished`; only the files kept after it may follow.
    pub(crate) fn finished(&self) -> Finished {
        let events = self.events();
        let last = events
            .iter()
            .rev()
            .find(|e| !matches!(e.msg, EventMsg::FileSaved { .. }))
            .expect("no events");
        match &last.msg {
            EventMsg::TaskFinished {
                stop_reason,
                turns,
                usage,
                error,
                summary,
                ..
            } => Finished {
                stop_reason: *stop_reason,
                turns: *turns,
                usage: *usage,
                error: error.clone(),
                summary: summary.clone(),
            },
            _ => panic!("the last event is not task_finished; last event: {last:?}"),
        }
    }
}

/// Runs the binary with a clean environment (no user config, no inherited model settings).
/// Snapshot settings for transcripts: times, token counts and ports, which change run to run,
/// are masked.
pub(crate) fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.add_filter(r"cpu \d+\.\d+ s", "cpu [N] s");
    s.add_filter(r"(peak|disk) \d+(\.\d)? [kMGT]?B", "$1 [BYTES]");
    s.add_filter(r"\d+ ms", "[N] ms");
    s.add_filter(r"\d+\.\d s", "[N] s");
    s.add_filter(r"\d+ in / \d+ out tokens", "[N] in / [N] out tokens");
    s.add_filter(r"127\.0\.0\.1:\d+", "127.0.0.1:[PORT]");
    s.set_prepend_module_to_snapshot(false);
    s
}

pub(crate) async fn tandem(args: &[&str], env: &[(&str, &str)], stdin: Option<&str>) -> Output {
    let config_home = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"));
    // What a run keeps goes to ./tandem-out: here, not into the source tree.
    cmd.args(args)
        .current_dir(config_home.path())
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("TANDEM_MODEL")
        .env_remove("TANDEM_CONFIG")
        .env("XDG_CONFIG_HOME", config_home.path())
        // No embedded model unless a test names one: the machine's pulled models would
        // otherwise answer every task that names no server.
        .env("TANDEM_MODELS_DIR", config_home.path().join("no-models"))
        .env("NO_COLOR", "1")
        // The default is `auto`, which depends on the machine; the docker tests say so.
        .env("TANDEM_EXECUTOR", "local")
        // In-process unless a test starts a daemon: a developer's own daemon must not serve these.
        .env("TANDEM_HOST", "unix:///nonexistent/tandem.sock")
        .envs(env.iter().copied())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    if let Some(input) = stdin {
        use tokio::io::AsyncWriteExt;
        let mut pipe = child.stdin.take().unwrap();
        pipe.write_all(input.as_bytes()).await.unwrap();
    }
    let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("tandem hung for 120 s")
        .unwrap();
    Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn run_task(server: &ScriptedOpenAi, task: &str, extra: &[&str]) -> Output {
    let url = server.base_url();
    let mut args = vec![
        "run",
        "--json",
        "--base-url",
        &url,
        "--model",
        "scripted-model",
    ];
    args.extend_from_slice(extra);
    args.push(task);
    tandem(&args, &[("TANDEM_MAX_RETRIES", "0")], None).await
}

/// What the pair asks after a clean run that printed something.
pub(crate) const ASK: &str = "If this answers the task, write the answer as `Answer: ...` in one line, then TERMINATE; if not, send the next code.";

pub(crate) fn fence(lang: &str, code: &str) -> String {
    format!("```{lang}\n{code}\n```")
}

#[tokio::test(flavor = "multi_thread")]
async fn happy_path_runs_code_and_terminates() {
    let task = "happy: what is 6*7?";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(format!(
                "Let me compute.\n{}",
                fence("python", "print(6*7)")
            )),
            Reply::from("The answer is 42.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let out = run_task(&server, task, &[]).await;
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let finished = out.finished();
    assert_eq!(finished.stop_reason, StopReason::Terminated);
    assert_eq!(finished.turns, 2);
    assert_eq!(finished.summary.as_deref(), Some("The answer is 42."));
    assert!(finished.usage.completion_tokens > 0);
    let results = out.results();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].stdout, "42\n");
    assert_eq!(results[0].status, BlockStatus::Exited);
    assert_eq!(results[0].exit_code, Some(0));
    // Streaming was used and the text arrived in pieces.
    assert!(out.of_type("assistant_delta").len() > 1);
    let reqs = server.requests_for(task);
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].body["model"], "scripted-model");
    assert_eq!(reqs[0].body["stream"], true);
    assert_eq!(
        reqs[1].last_message(),
        Some(format!("exitcode: 0 (execution succeeded)\nYour code printed: 42\n{ASK}").as_str())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn non_streaming_mode_works_too() {
    let task = "nostream: print hi";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("sh", "echo hi")),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let out = run_task(&server, task, &["--no-stream"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.of_type("assistant_delta").len(), 0);
    assert_eq!(server.requests_for(task)[0].body["stream"], false);
    assert_eq!(out.results()[0].stdout, "hi\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn failing_block_then_fixed_one() {
    let task = "fix: divide";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", "print(1/0)")),
            Reply::Text(fence("python", "print(1/1)")),
            Reply::from("Fixed. TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let out = run_task(&server, task, &[]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let reqs = server.requests_for(task);
    let report = reqs[1].last_message().unwrap();
    assert!(
        report.starts_with("exitcode: 1 (execution failed)\nYour code printed: "),
        "{report}"
    );
    assert!(
        report.contains("ZeroDivisionError: division by zero"),
        "{report}"
    );
    assert_eq!(
        reqs[2].last_message(),
        Some(format!("exitcode: 0 (execution succeeded)\nYour code printed: 1.0\n{ASK}").as_str())
    );
    assert_eq!(out.finished().turns, 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn max_turns_stops_with_its_own_exit_code() {
    let task = "loop: never done";
    // Other code each turn: the same code sent again would end the task sooner (`repeated`).
    let code = |n: u32| fence("python", &format!("print('again {n}')"));
    let server = ScriptedOpenAi::start(script([(task, texts(&[&code(1), &code(2), &code(3)]))]))
        .await
        .unwrap();
    let out = run_task(&server, task, &["--max-turns", "2"]).await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    let finished = out.finished();
    assert_eq!(finished.stop_reason, StopReason::MaxTurns);
    assert_eq!(finished.turns, 2);
    assert_eq!(server.requests_for(task).len(), 2);
    assert_eq!(out.results().len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_code_sent_again_stops_with_its_own_exit_code_here_and_on_the_daemon() {
    let here = "round: here";
    let there = "round: on the daemon";
    let said = "round: said to people";
    let code = fence("python", "print(undefined_name)");
    let again = format!("Running it again.\n{code}");
    let replies = |t: &'static str| {
        (
            t,
            texts(&[
                &code,
                &again,
                "not asked: the same failure twice ends the task",
            ]),
        )
    };
    let server = ScriptedOpenAi::start(script([replies(here), replies(there), replies(said)]))
        .await
        .unwrap();
    let out = run_task(&server, here, &[]).await;
    assert_eq!(out.code, 7, "{}", out.stderr);
    let finished = out.finished();
    assert_eq!(finished.stop_reason, StopReason::Repeated);
    assert_eq!(finished.turns, 2);
    assert_eq!(server.requests_for(here).len(), 2);
    // People read why it stopped.
    let url = server.base_url();
    let human = tandem(
        &["run", "--base-url", &url, "--model", "m", said],
        &[("TANDEM_MAX_RETRIES", "0")],
        None,
    )
    .await;
    assert_eq!(human.code, 7, "{}", human.stderr);
    assert!(
        human.stdout.contains("stopped: the same code sent again"),
        "{}",
        human.stdout
    );
    // The daemon stores the reason, and `tandem run` through it exits the same.
    let d = tandem_tests::DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &url,
        &[],
        None,
    )
    .await;
    let (code, _, stderr) = d.cli(&["run", there]).await;
    assert_eq!(code, 7, "{stderr}");
    let listed = d.tasks("/v1/tasks").await;
    assert_eq!(listed.tasks.len(), 1);
    assert_eq!(listed.tasks[0].stop_reason, Some(StopReason::Repeated));
    assert_eq!(server.requests_for(there).len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn reply_without_code_gets_a_nudge() {
    let task = "nudge: think";
    let server = ScriptedOpenAi::start(script([(
        task,
        texts(&["I believe the answer is 4.", "Checked it. TERMINATE"]),
    )]))
    .await
    .unwrap();
    // The nudge names the languages that run here: the task's own list, in its order.
    let out = run_task(&server, task, &["-e", "local", "-l", "sh", "-l", "py"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        server.requests_for(task)[1].last_message(),
        Some(
            "No code to run was found in your reply. If the task is done, reply with TERMINATE. Otherwise, send the complete code in a ```sh or ```python block."
        )
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_language_is_reported_to_the_model() {
    let task = "lang: rust please";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("rust", "fn main() {}")),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let out = run_task(&server, task, &[]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let result = &out.results()[0];
    assert_eq!(result.status, BlockStatus::Unsupported);
    let report = server.requests_for(task)[1]
        .last_message()
        .unwrap()
        .to_owned();
    assert!(
        report.starts_with("exitcode: 1 (execution failed)\nYour code printed: "),
        "{report}"
    );
    assert!(
        report.contains(
            "language `rust` is not supported by the local executor; supported: python, sh"
        ),
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn model_server_down_is_a_one_line_error() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}/v1");
    let started = Instant::now();
    let out = tandem(
        &["run", "--base-url", &url, "--model", "m1", "down: anything"],
        &[("TANDEM_MAX_RETRIES", "1")],
        None,
    )
    .await;
    assert_eq!(
        out.code, 1,
        "stdout: {}\nstderr: {}",
        out.stdout, out.stderr
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    let error_line = out
        .stdout
        .lines()
        .find(|l| l.contains("error:"))
        .expect(&out.stdout);
    assert!(error_line.contains(&url), "{error_line}");
    assert!(
        error_line.contains("cannot connect to the model server"),
        "{error_line}"
    );
    assert!(error_line.contains("OPENAI_BASE_URL"), "{error_line}");
    // Said on stderr as well, for a transcript that goes to a file.
    assert!(
        out.stderr
            .contains("tandem: the task failed: cannot connect to the model server"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("panicked") && !out.stdout.contains("panicked"));
    // One retry was announced, then it gave up.
    assert_eq!(
        out.stdout.matches("retry 1 in").count(),
        1,
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_model_and_bad_key_are_not_retried() {
    let server = ScriptedOpenAi::start(script([
        (
            "model: missing",
            vec![Reply::Error(404, "The model `nope` does not exist".into())],
        ),
        (
            "key: bad",
            vec![Reply::Error(401, "Incorrect API key provided".into())],
        ),
    ]))
    .await
    .unwrap();
    let out = run_task(&server, "model: missing", &[]).await;
    assert_eq!(out.code, 1);
    let err = out.finished().error.expect("task_finished has no error");
    assert_eq!(err.code, ErrorCode::ModelNotFound);
    assert!(err.message.contains("model `scripted-model`"), "{err:?}");
    let out = run_task(&server, "key: bad", &[]).await;
    assert_eq!(
        out.finished().error.map(|e| e.code),
        Some(ErrorCode::ModelAuth)
    );
    assert_eq!(
        server.requests().len(),
        2,
        "errors that retrying cannot fix are not retried"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn server_errors_are_retried() {
    let task = "retry: flaky";
    // A retry repeats the same conversation, so it gets the same scripted 503.
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![Reply::Error(503, "overloaded".into())],
    )]))
    .await
    .unwrap();
    let url = server.base_url();
    let out = tandem(
        &["run", "--json", "--base-url", &url, task],
        &[("TANDEM_MAX_RETRIES", "2")],
        None,
    )
    .await;
    assert_eq!(out.code, 1);
    assert_eq!(
        server.requests_for(task).len(),
        3,
        "one call and two retries"
    );
    assert_eq!(out.of_type("model_retry").len(), 2);
    assert_eq!(
        out.finished().error.map(|e| e.code),
        Some(ErrorCode::ModelUnavailable)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn grandchild_that_outlives_its_timeout_is_killed() {
    let task = "timeout: sleeper";
    let marker = format!("tandem-e2e-sleeper-{}", std::process::id());
    let code = format!(
        "import subprocess, time\nsubprocess.Popen(['sh', '-c', 'exec -a {marker} sleep 300'], start_new_session=True)\nprint('started', flush=True)\ntime.sleep(300)"
    );
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", &code)),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let started = Instant::now();
    let out = run_task(&server, task, &["--block-timeout", "1"]).await;
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let result = &out.results()[0];
    assert_eq!(result.status, BlockStatus::TimedOut);
    assert_eq!(result.stdout, "started\n");
    let report = server.requests_for(task)[1]
        .last_message()
        .unwrap()
        .to_owned();
    assert!(
        report.starts_with("exitcode: 124 (execution failed)\nYour code printed: started\n"),
        "{report}"
    );
    assert!(
        report.contains("Timeout: block 1 ran longer than 1 s"),
        "{report}"
    );
    let ps = std::process::Command::new("ps")
        .args(["-eo", "args"])
        .output()
        .unwrap();
    let ps = String::from_utf8_lossy(&ps.stdout);
    assert!(
        !ps.contains(&marker),
        "a detached grandchild survived:\n{ps}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn daemon_api_key_is_invisible_to_code() {
    let task = "secret: show env";
    let code = "import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ','rb').read().count(b'sk-e2e'))";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![Reply::Text(fence("python", code)), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let url = server.base_url();
    let out = tandem(
        &["run", "--json", "--base-url", &url, task],
        &[
            ("OPENAI_API_KEY", "sk-e2e-secret-value"),
            ("AWS_SECRET_ACCESS_KEY", "aws-e2e"),
        ],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let stdout = out.results()[0].stdout.clone();
    assert_eq!(
        stdout,
        "['GIT_CONFIG_NOSYSTEM', 'HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'PYTHONUNBUFFERED', 'TANDEM_EXEC_ID', 'TANDEM_OWNER', 'TMPDIR', 'XDG_CACHE_HOME']\n0\n"
    );
    // The key did reach the model server.
    assert_eq!(
        server.requests_for(task)[0].authorization.as_deref(),
        Some("Bearer sk-e2e-secret-value")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_megabytes_of_output_is_capped() {
    let task = "big: print a lot";
    let code = "import sys\nsys.stdout.write('x' * 10_000_000)\nsys.stdout.write('\\nEND\\n')";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![Reply::Text(fence("python", code)), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let out = run_task(&server, task, &[]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let result = &out.results()[0];
    assert!(result.truncated);
    let stdout = result.stdout.as_str();
    assert!(stdout.len() < 70_000, "{}", stdout.len());
    assert!(stdout.ends_with("\nEND\n"));
    let report = server.requests_for(task)[1]
        .last_message()
        .unwrap()
        .to_owned();
    assert!(
        report.contains("[... 9934469 bytes truncated ...]"),
        "{}",
        &report[..200]
    );
    assert!(report.contains("Note: the output of block 1 was longer than 64 KiB per stream"));
    // Live output is the kept head: the cap's first half.
    let live = out.live_bytes();
    assert_eq!(live, 32768);
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_utf8_and_stdin_reads() {
    let task = "bytes: odd output";
    let code = "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\n')\nsys.stdout.flush()\ntry:\n    input()\nexcept EOFError:\n    print('stdin is closed')";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![Reply::Text(fence("python", code)), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let out = run_task(&server, task, &["--block-timeout", "20"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let result = &out.results()[0];
    assert_eq!(result.stdout, "ok \u{fffd}\u{fffd}\nstdin is closed\n");
    assert!(result.duration_ms < 5000);
}

#[tokio::test(flavor = "multi_thread")]
async fn terminate_printed_by_code_does_not_stop() {
    let task = "print-terminate";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", "print('TERMINATE')")),
            Reply::from("Done.\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let out = run_task(&server, task, &[]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.finished().turns, 2);
    assert_eq!(server.requests_for(task).len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn code_and_terminate_in_one_reply_runs_the_code_first() {
    let task = "write-and-finish";
    let work = tempfile::tempdir().unwrap();
    let reply = format!(
        "{}\nThe file is written.\n\nTERMINATE",
        fence(
            "python",
            "open('result.txt', 'w').write('42')\nprint('written')"
        )
    );
    let server = ScriptedOpenAi::start(script([(task, vec![Reply::Text(reply)])]))
        .await
        .unwrap();
    let out = run_task(&server, task, &["--workdir", work.path().to_str().unwrap()]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let finished = out.finished();
    assert_eq!(finished.stop_reason, StopReason::Terminated);
    assert_eq!(finished.turns, 1);
    assert_eq!(out.results()[0].stdout, "written\n");
    assert_eq!(
        out.reports()[0],
        format!("exitcode: 0 (execution succeeded)\nYour code printed: written\n{ASK}")
    );
    assert_eq!(
        std::fs::read_to_string(work.path().join("result.txt")).unwrap(),
        "42"
    );
    assert_eq!(server.requests_for(task).len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn human_transcript_shows_the_run() {
    let task = "human: hello";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", "print('hello from code')")),
            Reply::from("Said hello.\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let url = server.base_url();
    let out = tandem(
        &["run", "--base-url", &url, "--model", "m", task],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines[0],
        format!("── tandem · model m at {url} · executor local · in this process ──")
    );
    assert_eq!(lines[1], "── assistant · turn 1 ──");
    assert_eq!(lines[2], "```python");
    assert!(
        out.stdout
            .contains("── block 1 · python ──\nhello from code\n── exit 0 · "),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("── assistant · turn 2 ──\nSaid hello.\nTERMINATE\n── done · 2 turns · ")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn empty_task_and_unknown_executor_are_usage_errors() {
    let out = tandem(&["run", "  "], &[], None).await;
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("the task is empty"), "{}", out.stderr);
    let out = tandem(&["run", "--executor", "dockr", "x"], &[], None).await;
    assert_eq!(out.code, 2);
    assert_eq!(
        out.stderr.trim(),
        "tandem: executor `dockr` is not registered; available: auto, docker, kubernetes, local, wasm"
    );
    let out = tandem(
        &["run", "--local", "-e", "local", "--language", "cobol", "x"],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.starts_with(
            "tandem: language `cobol` is not supported by the local executor; supported: python, sh"
        ),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_character_split_across_reads_streams_whole() {
    // The first byte of `é` is flushed alone; the rest comes 200 ms later, in another read.
    let code = "import sys, time\nout = sys.stdout.buffer\nout.write(b'caf\\xc3'); out.flush(); time.sleep(0.2); out.write(b'\\xa9\\n'); out.flush()\nsys.stderr.buffer.write(b'bad \\xc3')\n";
    let out = tandem(
        &["exec", "-e", "local", "--lang", "python", "-"],
        &[],
        Some(code),
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "café\n");
    // A character the program never finished is shown as such at the end.
    assert_eq!(out.stderr, "bad \u{fffd}");
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_runs_markdown_blocks_in_one_session() {
    let work = tempfile::tempdir().unwrap();
    let md = "Steps:\n\n```python\n# filename: pkg/data.py\nVALUE = 7\nprint('saved')\n```\n\n- then\n  ```sh\n  python3 -c 'import sys; sys.path.insert(0, \"pkg\"); import data; print(data.VALUE * 6)'\n  ```\n\n```python\nraise SystemExit(5)\n```\n\n```sh\necho never\n```\n";
    let dir = work.path().to_str().unwrap();
    let out = tandem(&["exec", "--json", "--workdir", dir], &[], Some(md)).await;
    assert_eq!(out.code, 5, "{}", out.stderr);
    let results: Vec<BlockResult> = out.exec_results();
    assert_eq!(results.len(), 3, "the block after the failure is not run");
    assert_eq!(results[0].stdout, "saved\n");
    // Importing the saved module runs it again.
    assert_eq!(results[1].stdout, "saved\n42\n");
    assert_eq!(results[1].language.as_deref(), Some("sh"));
    assert_eq!(results[2].exit_code, Some(5));
    assert!(work.path().join("pkg/data.py").exists());
    // A one-shot leaves nothing behind in $TMPDIR (scratch dirs, transient workspaces).
    let tmp = tempfile::tempdir().unwrap();
    let tmp_dir = tmp.path().to_str().unwrap();
    let out = tandem(
        &["exec", "--lang", "python"],
        &[("TMPDIR", tmp_dir)],
        Some("print('ok')"),
    )
    .await;
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "ok\n"),
        "{}",
        out.stderr
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_refuses_paths_outside_the_workspace_and_times_out_with_124() {
    let out = tandem(
        &["exec", "--lang", "py", "--json"],
        &[],
        Some("# filename: ../escape.py\nprint(1)\n"),
    )
    .await;
    assert_eq!(out.code, 1);
    let r = &out.exec_results()[0];
    assert_eq!(r.status, BlockStatus::Exited);
    assert_eq!(
        r.stderr,
        "refused to write `../escape.py`: the path must stay inside the workspace (a relative path without `..` above it)"
    );
    let out = tandem(
        &["exec", "--lang", "sh", "--timeout", "0.5"],
        &[],
        Some("echo before; sleep 30"),
    )
    .await;
    assert_eq!(out.code, 124);
    assert_eq!(out.stdout, "before\n");
    assert!(out.stderr.contains("timed out after"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn extract_prints_json_blocks() {
    let md = "```Python title=\"a.py\"\nprint(1)\n```\n\n    indented\n\n~~~\nuntagged\n~~~\n```js\ncut off";
    let out = tandem(&["extract"], &[], Some(md)).await;
    assert_eq!(out.code, 0);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(
        v,
        serde_json::json!([
            {"language": "python", "info": "Python title=\"a.py\"", "code": "print(1)\n", "unterminated": false},
            {"language": null, "info": "", "code": "untagged\n", "unterminated": false},
            {"language": "javascript", "info": "js", "code": "cut off", "unterminated": true},
        ])
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ctrl_c_cancels_cleanly_and_kills_the_block() {
    let task = "ctrl-c: long block";
    let marker = format!("tandem-e2e-ctrlc-{}", std::process::id());
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![Reply::Text(fence(
            "sh",
            &format!("echo running; sh -c 'sleep 300; : {marker}'"),
        ))],
    )]))
    .await
    .unwrap();
    let url = server.base_url();
    // The local executor, whatever `auto` would pick here: the marker check reads host
    // processes, and the 3 s bound is Tandem's, not a container engine's removal time.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["run", "--json", "--out", "-", "--base-url", &url, task])
        .env("TANDEM_EXECUTOR", "local")
        .env_remove("OPENAI_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap().to_string();
    // Wait for the block to start, by its output.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !seen.contains("running") && Instant::now() < deadline {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(30), stdout.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let started = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap();
    assert!(status.success());
    let mut rest = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read_to_end(&mut stdout, &mut rest),
    )
    .await
    .unwrap()
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(status.code(), Some(130));
    seen.push_str(&String::from_utf8_lossy(&rest));
    let last: Event = serde_json::from_str(seen.lines().last().unwrap()).unwrap();
    let EventMsg::TaskFinished { stop_reason, .. } = &last.msg else {
        panic!("the last event is not task_finished: {last:?}")
    };
    assert_eq!(*stop_reason, StopReason::Cancelled);
    let ps = std::process::Command::new("ps")
        .args(["-eo", "args"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&ps.stdout).contains(&marker),
        "the block survived Ctrl-C"
    );
}

pub(crate) fn sandbox_image() -> String {
    std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned())
}

/// `id owner` of every container Tandem labelled.
pub(crate) fn tandem_containers() -> Vec<(String, String)> {
    let out = std::process::Command::new("docker")
        .args([
            "ps",
            "-a",
            "--filter",
            "label=tandem.owner",
            "--format",
            "{{.ID}} {{.Label \"tandem.owner\"}}",
        ])
        .output()
        .expect("the docker CLI");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(id, owner)| (id.to_owned(), owner.to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_one_shots_leave_nothing_and_a_killed_tandems_container_is_reaped() {
    let image = sandbox_image();
    let docker = ["exec", "--executor", "docker", "--image", &image];
    // Other Tandems may share the engine; only containers this test's commands made count.
    let before = tandem_containers();
    let out = tandem(
        &[&docker[..], &["--lang", "python"]].concat(),
        &[],
        Some("import os\nprint(os.getuid(), sorted(os.environ))"),
    )
    .await;
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (
            0,
            "65534 ['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'PYTHONUNBUFFERED', 'TMPDIR', 'XDG_CACHE_HOME']\n"
        ),
        "{}",
        out.stderr
    );
    // A container whose owner still runs (a daemon of another test, say) is not left behind.
    let new_since = |before: &[(String, String)]| -> Vec<(String, String)> {
        tandem_containers()
            .into_iter()
            .filter(|c| !before.contains(c) && !tandem_executor_kit::owner::owner_alive(&c.1))
            .collect()
    };
    assert_eq!(new_since(&before), Vec::<(String, String)>::new());
    // A Tandem killed with SIGKILL cannot clean up; the next one reaps what it left.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(docker)
        .args(["--lang", "sh", "--timeout", "300", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"sleep 300").await.unwrap();
    }
    let pid = child.id().unwrap();
    let mine = format!("/{pid}:");
    let started = Instant::now();
    let orphan = loop {
        if let Some((id, _)) = tandem_containers()
            .into_iter()
            .find(|(_, o)| o.contains(&mine))
        {
            break id;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no container appeared"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    assert!(
        tandem_containers().iter().any(|(id, _)| *id == orphan),
        "the container should outlive a SIGKILLed Tandem until the next one starts"
    );
    let out = tandem(
        &[&docker[..], &["--lang", "sh"]].concat(),
        &[],
        Some("echo next"),
    )
    .await;
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "next\n"),
        "{}",
        out.stderr
    );
    assert_eq!(new_since(&before), Vec::<(String, String)>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_engine_down_or_image_missing_says_what_to_do() {
    let nowhere = [("DOCKER_HOST", "unix:///nonexistent/docker.sock")];
    let out = tandem(
        &["exec", "--executor", "docker", "--lang", "sh"],
        &nowhere,
        Some("echo x"),
    )
    .await;
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.starts_with(
            "tandem: cannot reach the Docker engine at unix:///nonexistent/docker.sock: "
        ) && out.stderr.contains("start Docker"),
        "{}",
        out.stderr
    );
    // auto falls back to wasm when its CPython runtime is installed...
    let out = tandem(
        &["exec", "--lang", "python"],
        &[nowhere[0], ("TANDEM_EXECUTOR", "auto")],
        Some("import os\nprint(os.getcwd())"),
    )
    .await;
    assert_eq!(
        (out.code, out.stdout.as_str(), out.stderr.as_str()),
        (0, "/workspace\n", "")
    );
    // ...and then to local, saying whether its blocks are confined.
    let out = tandem(
        &["exec", "--lang", "sh"],
        &[
            nowhere[0],
            ("TANDEM_EXECUTOR", "auto"),
            ("TANDEM_WASM_DIR", "/nonexistent/wasm"),
        ],
        Some("echo ran"),
    )
    .await;
    assert_eq!((out.code, out.stdout.as_str()), (0, "ran\n"));
    // Told truly: a note when `tandem doctor` finds the blocks confined, else a warning.
    let doctor = tandem(&["doctor"], &[nowhere[0]], None).await;
    let local = doctor
        .stdout
        .lines()
        .find(|l| l.starts_with("executor:  local"))
        .unwrap_or_else(|| panic!("no local line in doctor:\n{}", doctor.stdout))
        .to_owned();
    if local.contains(" - confined (") {
        insta::assert_snapshot!("auto_falls_back_to_local_confined", out.stderr);
    } else {
        insta::assert_snapshot!("auto_falls_back_to_local_unconfined_here", out.stderr);
    }
    // Unconfined by the user's own config: warned, with why.
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), "[executors.local]\nconfine = \"off\"\n").unwrap();
    let out = tandem(
        &["exec", "--lang", "sh"],
        &[
            nowhere[0],
            ("TANDEM_EXECUTOR", "auto"),
            ("TANDEM_WASM_DIR", "/nonexistent/wasm"),
            ("TANDEM_CONFIG", &config.path().display().to_string()),
        ],
        Some("echo ran"),
    )
    .await;
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "ran\n"),
        "{}",
        out.stderr
    );
    insta::assert_snapshot!("auto_falls_back_to_local_unconfined", out.stderr);
    let out = tandem(
        &[
            "exec",
            "--executor",
            "docker",
            "--image",
            "tandem-no-such-image:1",
            "--lang",
            "sh",
        ],
        &[],
        Some("echo x"),
    )
    .await;
    assert_eq!(out.code, 2);
    assert!(
        out.stderr
            .contains("docker image `tandem-no-such-image:1` is not present and pulling it failed")
            && out.stderr.contains("scripts/build-sandbox-image.sh"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_says_when_local_blocks_run_unconfined_and_doctor_says_which() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    // A server on the machine's loopback: a confined block's loopback is its session's own.
    let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let code = format!(
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {}), timeout=1)\n    print('reached the machine')\nexcept OSError as e:\n    print(type(e).__name__)",
        host.local_addr().unwrap().port()
    );
    let code = code.as_str();
    // Confined (this machine's kernel can): no line, and the network is out of reach.
    std::fs::write(&config, "").unwrap();
    let cfg = config.to_str().unwrap();
    let args = [
        "exec",
        "--config",
        cfg,
        "--executor",
        "local",
        "--lang",
        "python",
        "-",
    ];
    let out = tandem(&args, &[], Some(code)).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!out.stderr.contains("unconfined"), "{}", out.stderr);
    assert_eq!(out.stdout, "ConnectionRefusedError\n");
    let doctor = tandem(&["doctor", "--config", cfg], &[], None).await;
    assert!(
        doctor.stdout.contains("local (python, sh") && doctor.stdout.contains("- confined ("),
        "{}",
        doctor.stdout
    );
    // Off: one line says so.
    std::fs::write(&config, "[executors.local]\nconfine = \"off\"\n").unwrap();
    let out = tandem(&args, &[], Some("print('ran')")).await;
    assert_eq!(out.stdout, "ran\n");
    assert_eq!(
        out.stderr,
        "tandem: local blocks run unconfined: confine = \"off\"\n"
    );
    // A bad value names the setting.
    std::fs::write(&config, "[executors.local]\nconfine = \"sometimes\"\n").unwrap();
    let out = tandem(&args, &[], Some("print(1)")).await;
    assert_eq!(out.code, 2);
    assert!(
        out.stderr
            .contains("[executors.local] confine must be auto, off or required, got `sometimes`"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_task_says_why_on_stderr_on_every_road() {
    let url = "http://127.0.0.1:9/v1";
    let dir = tempfile::tempdir().unwrap();
    let team = dir.path().join("team.toml");
    std::fs::write(
        &team,
        "[team]\nkind = \"sequence\"\nagents = [\"solo\"]\n[agents.solo]\ninstructions = \"Answer.\"\n",
    )
    .unwrap();
    let said =
        "tandem: the task failed: cannot connect to the model server at http://127.0.0.1:9/v1";
    let env = [("TANDEM_MAX_RETRIES", "0")];
    // In this process: the pair, and a team.
    let pair = tandem(&["run", "--base-url", url, "pair"], &env, None).await;
    let team_path = team.display().to_string();
    let team_run = tandem(
        &["run", "--base-url", url, "--team", &team_path, "team"],
        &env,
        None,
    )
    .await;
    for out in [&pair, &team_run] {
        assert_eq!(out.code, 1, "{}", out.stderr);
        assert!(out.stderr.contains(said), "stderr: {}", out.stderr);
    }
    // Through a daemon whose model server is down.
    let d = tandem_tests::DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        url,
        &[],
        None,
    )
    .await;
    let (code, _, stderr) = d.cli(&["run", "on the daemon"]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains(said), "stderr: {stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn characters_split_between_reads_or_by_the_cap_stay_whole_on_every_road() {
    // 40 000 bytes (more than a pipe's buffer, under the cap), and 80 000 (past the 64 KiB
    // cap, so Tandem cuts the middle out: its cuts must fall between characters).
    let cases = [
        ("print('ñ' * 20000)", "split: under the cap"),
        ("print('✓' * 20000)", "split: at the head's edge"),
        ("print('ñ' * 40000)", "split: past the cap"),
        ("print('✓' * 40000)", "split: past the cap, three bytes"),
    ];
    let server = ScriptedOpenAi::start(script(cases.map(|(code, task)| {
        (
            task,
            vec![
                Reply::from(format!("```python\n{code}\n```").as_str()),
                Reply::from("TERMINATE"),
            ],
        )
    })))
    .await
    .unwrap();
    let url = server.base_url();
    let dir = tempfile::tempdir().unwrap();
    let d = tandem_tests::DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &url,
        &[],
        None,
    )
    .await;
    for (code, task) in cases {
        let file = dir.path().join("split.py");
        std::fs::write(&file, code).unwrap();
        let exec = tandem(&["exec", &file.display().to_string()], &[], None).await;
        let run = tandem(&["run", "--base-url", &url, task], &[], None).await;
        let (_, followed, _) = d.cli(&["run", task]).await;
        for (road, text) in [
            ("exec", &exec.stdout),
            ("run", &run.stdout),
            ("run through the daemon", &followed),
        ] {
            let char = if code.contains('ñ') { "ñ" } else { "✓" };
            assert!(
                text.contains(&char.repeat(1000)),
                "{task}, {road}: {}",
                &text[..text.len().min(500)]
            );
            assert!(
                !text.contains('\u{FFFD}'),
                "{task}, {road} shows a broken character"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn files_given_to_a_task_are_in_its_workspace_and_the_model_is_told_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("sales.csv");
    std::fs::write(&csv, "month,revenue\n1,10\n2,32\n").unwrap();
    let notes = dir.path().join("notes");
    std::fs::create_dir(&notes).unwrap();
    std::fs::write(notes.join("a.txt"), "alpha\n").unwrap();
    std::fs::write(notes.join("blob.bin"), [0u8, 159, 146, 150]).unwrap();
    let task = "sum the revenue";
    // Exactly what the model reads: the task, then each file with its size, and the first
    // lines of the text ones.
    let told = format!(
        "{task}\n\nFiles in your working directory (the current directory):\n\
         - sales.csv (24 bytes)\n    month,revenue\n    1,10\n    2,32\n\
         - notes/a.txt (6 bytes)\n    alpha\n\
         - notes/blob.bin (4 bytes)"
    );
    let code = "import csv\nrows = list(csv.DictReader(open('sales.csv')))\nprint(sum(int(r['revenue']) for r in rows), open('notes/a.txt').read().strip())";
    let server = ScriptedOpenAi::start(script([(
        told.as_str(),
        vec![Reply::Text(fence("python", code)), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let (csv, notes) = (csv.to_str().unwrap(), notes.to_str().unwrap());
    // On the local executor and in a Docker container alike.
    for executor in ["local", "docker"] {
        let out = run_task(
            &server,
            task,
            &["-e", executor, "--file", csv, "--file", notes],
        )
        .await;
        assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
        let result = &out.results()[0];
        assert_eq!(result.stdout, "42 alpha\n", "{executor}: {}", out.stdout);
    }
    // The user's own files are where they were.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("sales.csv")).unwrap(),
        "month,revenue\n1,10\n2,32\n"
    );
    // A link inside a directory given is not followed out (here, to the root): refused.
    let linked = dir.path().join("linked");
    std::fs::create_dir(&linked).unwrap();
    std::os::unix::fs::symlink("/", linked.join("root")).unwrap();
    let out = run_task(&server, task, &["--file", linked.to_str().unwrap()]).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains(
            "--file: `linked/root` is a symbolic link; only regular files and directories"
        ),
        "{}",
        out.stderr
    );
    let missing = run_task(&server, task, &["--file", "/nonexistent/data.csv"]).await;
    assert_eq!(missing.code, 2);
    assert!(
        missing.stderr.contains("--file /nonexistent/data.csv"),
        "{}",
        missing.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_interpreter_keeps_variables_survives_an_interrupt_and_says_when_it_is_lost() {
    let py = |code: &str| fence("python", code);
    let server = ScriptedOpenAi::start(script([(
        "keep it",
        vec![
            // Turn 1: block 1 sets, block 2 is a shell block, block 3 reads.
            Reply::Text(format!(
                "{}\n{}\n{}",
                py("import os\nx = 41\npid = os.getpid()"),
                fence("sh", "echo between"),
                py("print(x + 1, os.getpid() == pid)")
            )),
            // Turn 2: the next turn still has them; then a block past its time.
            Reply::Text(py("print(x)\ny = 'kept'\nimport time\ntime.sleep(60)")),
            // Turn 3: interrupted, and the variables are still there.
            Reply::Text(py("print(y, x)")),
            // Turn 4: a block that kills the interpreter.
            Reply::Text(py("import os\nos._exit(3)")),
            // Turn 5: a fresh interpreter, with nothing of before.
            Reply::Text(py("print('x' in globals())")),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    for executor in ["local", "docker"] {
        let out = run_task(
            &server,
            "keep it",
            &["-e", executor, "--keep-state", "--block-timeout", "2"],
        )
        .await;
        assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
        let results: Vec<BlockResult> = out.results();
        let stdout: Vec<&str> = results.iter().map(|r| r.stdout.as_str()).collect();
        assert_eq!(
            stdout,
            vec![
                "",
                "between\n",
                "42 True\n",
                "41\n",
                "kept 41\n",
                "",
                "False\n"
            ],
            "{executor}: {results:#?}"
        );
        // The interrupted block: timed out, told that the interpreter lives on.
        assert_eq!(
            results[3].status,
            BlockStatus::TimedOut,
            "{executor}: {:#?}",
            results[3]
        );
        let told = results[3].stderr.as_str();
        assert!(told.contains("KeyboardInterrupt"), "{executor}: {told}");
        assert!(
            told.contains("the interpreter and its variables live on"),
            "{executor}: {told}"
        );
        // The block that ended the interpreter: its code, and that the state is gone.
        assert_eq!(
            results[5].exit_code,
            Some(3),
            "{executor}: {:#?}",
            results[5]
        );
        let told = results[5].stderr.as_str();
        assert!(
            told.contains("the interpreter exited with code 3 during this block; the variables of earlier blocks are gone"),
            "{executor}: {told}"
        );
        // The model read it too.
        let reports: Vec<String> = out.reports();
        assert!(
            reports
                .iter()
                .any(|r| r.contains("the variables of earlier blocks are gone")),
            "{executor}: {reports:#?}"
        );
    }
    // An executor that cannot keep an interpreter says so before anything runs.
    let out = run_task(&server, "keep it", &["-e", "wasm", "--keep-state"]).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains(
            "keep_state: the wasm executor cannot keep a Python interpreter between blocks"
        ),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_interpreter_streams_only_the_head_of_a_huge_output() {
    let server = ScriptedOpenAi::start(script([(
        "flood",
        vec![
            Reply::Text(fence("python", "print('x' * 3_000_000)")),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let out = run_task(&server, "flood", &["-e", "local", "--keep-state"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let live = out.live_bytes();
    // Half of the 64 KiB kept per stream goes live, as with a fresh process.
    assert!(live <= 32 << 10, "{live} bytes streamed live");
    let result = &out.results()[0];
    assert!(result.truncated, "{result:?}");
}
