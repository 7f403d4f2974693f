//! `tandem serve` as a real process on a temporary socket and state dir, driven over real
//! HTTP by the CLI and by raw requests, with the scripted model server behind it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_protocol::{ApprovalMode, BlockStatus, Event, EventMsg, StopReason, TaskState};
use tandem_tests::daemon::{block_results, kinds};
use tandem_tests::{DaemonHarness as Daemon, Reply, Script, ScriptedOpenAi};

async fn start(server: &ScriptedOpenAi, args: &[&str]) -> Daemon {
    Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        args,
        None,
    )
    .await
}

fn fence(code: &str) -> String {
    format!("```python\n{code}\n```")
}

fn two_turns(tasks: impl IntoIterator<Item = (String, String)>) -> Script {
    tasks
        .into_iter()
        .map(|(task, code)| {
            (
                task,
                vec![
                    Reply::from(fence(&code).as_str()),
                    Reply::from("Done.\nTERMINATE"),
                ],
            )
        })
        .collect()
}

/// The pid a running block printed first (`pid N`), from its live output. Confined blocks
/// cannot write outside their workspace, so they say it rather than leave a file.
/// The host's pid of the block that [`sleeper`]`(tag)` runs, once it prints that it started: a
/// confined block has a PID namespace of its own, so the pid it would print is not the host's.
fn printed_pid(events: &[Event]) -> Option<u32> {
    let text: String = tandem_tests::daemon::block_output(events).concat();
    let tag = text
        .lines()
        .find_map(|l| l.strip_prefix("sleeping "))?
        .trim();
    let wanted = format!("sleep\0{tag}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        (cmdline == wanted.as_bytes()).then_some(pid)
    })
}

/// A block that sleeps a minute in a `sleep` whose argument is unique to it (`60.<digits>`),
/// telling when it started.
fn sleeper() -> String {
    let tag = format!("60.{}", uuid::Uuid::new_v4().as_u128() % 1_000_000_000);
    format!(
        "import subprocess\nprint('sleeping {tag}', flush=True)\nsubprocess.run(['sleep', '{tag}'])"
    )
}

/// The standard output of every block in `events` (`exec_result`), in order.
pub(crate) fn block_output(events: &[Event]) -> Vec<String> {
    block_results(events)
        .into_iter()
        .map(|r| r.stdout.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn cli_commands_go_through_the_daemon() {
    let server = ScriptedOpenAi::start(two_turns([
        (
            "daemon hello".to_owned(),
            "print('hello from the daemon')".to_owned(),
        ),
        ("daemon run".to_owned(), "print(6 * 7)".to_owned()),
    ]))
    .await
    .unwrap();
    let d = start(&server, &[]).await;
    // The socket is the user's alone.
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&d.socket()), 0o600);
    assert_eq!(mode(d.socket().parent().unwrap()), 0o700);

    let (code, out, err) = d.cli(&["submit", "--json", "daemon hello"]).await;
    assert_eq!(code, 0, "{err}");
    let id = serde_json::from_str::<Value>(&out).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let task = d.wait_finished(&id, Duration::from_secs(30)).await;
    assert_eq!(task.record.stop_reason, Some(StopReason::Terminated));
    assert_eq!(
        block_output(&d.events(&id, 0).await),
        ["hello from the daemon\n"]
    );

    let (code, out, _) = d.cli(&["tasks"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains(&id) && out.contains("finished") && out.contains("terminated"),
        "{out}"
    );
    let (code, out, _) = d.cli(&["show", &id]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("── assistant ──") && out.contains("hello from the daemon"),
        "{out}"
    );
    let (code, out, _) = d.cli(&["logs", &id]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("hello from the daemon") && out.contains("── done"),
        "{out}"
    );

    // `tandem run` uses the daemon when one answers; the task shows up in its list.
    let (code, out, err) = d.cli(&["run", "--json", "daemon run"]).await;
    assert_eq!(code, 0, "{err}");
    let events: Vec<Event> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(block_output(&events), ["42\n"]);
    let listed = d.tasks("/v1/tasks").await;
    assert_eq!(listed.tasks.len(), 2);

    // Cancelling a finished task is a conflict, said plainly.
    let (code, _, err) = d.cli(&["cancel", &id]).await;
    assert_eq!(code, 2);
    assert!(err.contains("already finished (terminated)"), "{err}");
}

/// The client's own model settings, broken, stop only a task run in its own process: a task
/// the daemon runs takes the daemon's.
#[tokio::test(flavor = "multi_thread")]
async fn a_broken_model_setting_of_the_client_stops_only_a_task_run_here() {
    let server = ScriptedOpenAi::start(two_turns([(
        "broken here".to_owned(),
        "print(7)".to_owned(),
    )]))
    .await
    .unwrap();
    let d = start(&server, &[]).await;
    // The client's tandem.toml (the daemon read its own at start, and not this).
    let dir = d.state_dir().join("tandem");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("tandem.toml"),
        "[model]\ntool_choice = \"sometimes\"\n",
    )
    .unwrap();
    let (code, out, err) = d.cli(&["run", "--json", "broken here"]).await;
    assert_eq!(code, 0, "{err}");
    let events: Vec<Event> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(block_output(&events), ["7\n"]);
    let (code, _, err) = d
        .cli(&["run", "--local", "-e", "local", "broken here"])
        .await;
    assert_ne!(code, 0);
    assert!(
        err.contains("[model] tool_choice must be auto or required, got `sometimes`"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_tasks_at_once() {
    let tasks: Vec<(String, String)> = (0..100)
        .map(|i| (format!("many {i}"), format!("print({i} * 2)")))
        .collect();
    let server = ScriptedOpenAi::start(two_turns(tasks.clone()))
        .await
        .unwrap();
    let d = start(&server, &["--max-concurrent", "8"]).await;
    let mut ids = Vec::new();
    let submits: Vec<_> = tasks
        .iter()
        .map(|(task, _)| d.submit(json!({"task": task})))
        .collect();
    for id in futures::future::join_all(submits).await {
        ids.push(id);
    }
    for (i, id) in ids.iter().enumerate() {
        let t = d.wait_finished(id, Duration::from_secs(120)).await;
        assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
        assert_eq!(
            block_output(&d.events(id, 0).await),
            [format!("{}\n", i * 2)]
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_clear_4xx_and_the_daemon_keeps_serving() {
    let server = ScriptedOpenAi::start(two_turns([("fine".to_owned(), "print(1)".to_owned())]))
        .await
        .unwrap();
    let d = start(&server, &[]).await;
    let post = |body: String| d.send(reqwest::Method::POST, "/v1/tasks", Some(body));
    let cases = [
        (
            "{not json".to_owned(),
            400,
            "the body is not a valid task: key must be a string",
        ),
        (
            json!({"task": "x", "colour": "red"}).to_string(),
            400,
            "unknown field `colour`",
        ),
        (json!({"task": "  "}).to_string(), 400, "the task is empty"),
        (
            json!({"task": "x", "executor": "dockr"}).to_string(),
            400,
            "executor `dockr` is not registered; available: ",
        ),
        (
            json!({"task": "x", "languages": ["cobol"]}).to_string(),
            400,
            "language `cobol` is not supported by the local executor; supported: ",
        ),
        (
            json!({"task": "x", "languages": []}).to_string(),
            400,
            "languages is empty",
        ),
        (
            json!({"task": "x", "languages": ["json"]}).to_string(),
            400,
            "language `json` is a data format that is shown, never run",
        ),
        (
            json!({"task": "x", "limits": {"memory_bytes": 1u64 << 40}}).to_string(),
            400,
            "limits.memory_bytes 1099511627776 is above this daemon's limit of 4294967296",
        ),
        (
            json!({"task": "x", "limits": {"cpu_secs": 0}}).to_string(),
            400,
            "limits.cpu_secs must be at least 1",
        ),
        (
            json!({"task": "x", "limits": {"network": true}}).to_string(),
            400,
            "unknown field `network`",
        ),
        (
            json!({"task": "x".repeat(2 << 20)}).to_string(),
            413,
            "the request body is over the 1048576 byte limit",
        ),
    ];
    for (body, status, message) in cases {
        let (got, answer) = post(body).await;
        assert_eq!(got, status, "{answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .unwrap()
                .contains(message),
            "{answer}"
        );
        assert!(answer["error"]["code"].is_string());
    }
    let (status, answer) = d.send(reqwest::Method::GET, "/v1/tasks/nope", None).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let (status, _) = d
        .send(reqwest::Method::GET, "/v1/tasks?state=sleeping", None)
        .await;
    assert_eq!(status, 400);
    let id = d.submit(json!({"task": "fine"})).await;
    d.wait_finished(&id, Duration::from_secs(30)).await;
    let (status, answer) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{id}/cancel"),
            None,
        )
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("conflict"))
    );
    let (status, _) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{id}/resume"),
            None,
        )
        .await;
    assert_eq!(status, 409);
    assert_eq!(d.get("/healthz").await["status"], "ok");
    let metrics = d.text("/metrics").await;
    assert!(
        metrics.contains("tandem_tasks{state=\"finished\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tandem_executions_total{executor=\"local\",status=\"exited\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_runs_only_its_languages_within_its_own_tighter_limits() {
    let server = ScriptedOpenAi::start(
        [(
            "langs".to_owned(),
            vec![
                Reply::from("```sh\necho from-sh\n```"),
                Reply::from(fence("print('x' * 5000)").as_str()),
                Reply::from("Done.\nTERMINATE"),
            ],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let d = start(&server, &[]).await;
    let id = d
        .submit(json!({"task": "langs", "languages": ["py"], "limits": {"output_bytes": 1000}}))
        .await;
    let task = d.wait_finished(&id, Duration::from_secs(30)).await;
    assert_eq!(
        task.record.stop_reason,
        Some(StopReason::Terminated),
        "{task:?}"
    );
    assert_eq!(
        task.record.spec.languages,
        Some(vec!["py".to_owned()]),
        "{task:?}"
    );
    let events = d.events(&id, 0).await;
    let results = block_results(&events);
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(results[0].status, BlockStatus::Unsupported);
    assert_eq!(
        results[0].stderr,
        "language `sh` is not allowed in this task; allowed: python"
    );
    assert_eq!(results[1].status, BlockStatus::Exited);
    assert!(results[1].truncated, "{:?}", results[1]);
    let kept = results[1].stdout.matches('x').count();
    assert!((500..=1000).contains(&kept), "{kept} of 5000 bytes kept");
    let asked = server.requests_for("langs");
    let system = asked[0].body["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.ends_with(
            "Only code in these languages is run: python. Blocks in other languages are not run."
        ),
        "{system}"
    );
    assert!(
        asked[1]
            .last_message()
            .unwrap()
            .contains("not allowed in this task"),
        "{:?}",
        asked[1].last_message()
    );
    let (code, _, stderr) = d.cli(&["submit", "--language", "cobol", "x"]).await;
    assert_ne!(code, 0);
    assert!(
        stderr.contains("language `cobol` is not supported by the local executor"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn submit_sends_what_run_sends_a_daemon() {
    let code = "print(1)".to_owned();
    let server = ScriptedOpenAi::start(two_turns([("asked".to_owned(), code)]))
        .await
        .unwrap();
    let d = start(&server, &[]).await;
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "You are terse. Languages: {languages}").unwrap();
    let prompt = prompt.to_str().unwrap();
    let flags = [
        "--max-turns",
        "3",
        "--timeout",
        "90.5",
        "--block-timeout",
        "7",
        "--termination",
        "FIN",
        "--system-prompt",
        prompt,
        "-l",
        "python",
        "--approve",
        "asked",
    ];
    let (code, out, err) = d.cli(&[&["submit"][..], &flags].concat()).await;
    assert_eq!(code, 0, "{err}");
    let id = out.trim();
    let task = d.task(id).await;
    let spec = &task.record.spec;
    assert_eq!(spec.max_turns, Some(3), "{spec:?}");
    assert_eq!(spec.timeout_secs, Some(90), "{spec:?}");
    assert_eq!(spec.block_timeout_secs, Some(7), "{spec:?}");
    assert_eq!(spec.termination.as_deref(), Some("FIN"), "{spec:?}");
    assert_eq!(
        spec.system_prompt.as_deref(),
        Some("You are terse. Languages: {languages}"),
        "{spec:?}"
    );
    assert_eq!(spec.languages, Some(vec!["python".to_owned()]), "{spec:?}");
    assert_eq!(
        spec.approval.as_ref().map(|a| a.mode),
        Some(ApprovalMode::Always),
        "{spec:?}"
    );
    let (code, _, err) = d.cli(&["cancel", id]).await;
    assert_eq!(code, 0, "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_reply_is_stored_in_a_few_rows_not_one_per_piece() {
    // 13 pieces of 24 characters, 10 ms apart: a model streaming its tokens.
    let text = format!("{}\nTERMINATE", "The answer is forty-two. ".repeat(12));
    let server = ScriptedOpenAi::start(
        [(
            "stream".to_owned(),
            vec![Reply::Trickle(Duration::from_millis(10), text.clone())],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let d = start(&server, &[]).await;
    let id = d.submit(json!({"task": "stream"})).await;
    let task = d.wait_finished(&id, Duration::from_secs(30)).await;
    assert_eq!(
        task.record.stop_reason,
        Some(StopReason::Terminated),
        "{task:?}"
    );
    let events = d.events(&id, 0).await;
    let deltas: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::AssistantDelta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(deltas.concat(), text);
    // Each piece in its own row would be 13.
    assert!(
        (1..=6).contains(&deltas.len()),
        "{} rows: {deltas:?}",
        deltas.len()
    );
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread")]
async fn events_resume_after_last_event_id_with_no_gap_or_duplicate() {
    let server = ScriptedOpenAi::start(two_turns([("sse".to_owned(), "print('x')".to_owned())]))
        .await
        .unwrap();
    let d = start(&server, &[]).await;
    let id = d.submit(json!({"task": "sse"})).await;
    d.wait_finished(&id, Duration::from_secs(30)).await;
    let all = d.events(&id, 0).await;
    let seqs: Vec<u64> = all.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    for cut in 1..seqs.len() as u64 {
        let rest = d.events(&id, cut).await;
        assert_eq!(rest, all[cut as usize..].to_vec(), "after {cut}");
    }
    // Following a finished task ends after its last event.
    let (code, out, _) = d.cli(&["logs", "-f", "--json", &id]).await;
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), all.len());
}

#[tokio::test(flavor = "multi_thread")]
async fn tcp_needs_the_token() {
    let server = ScriptedOpenAi::start(Script::new()).await.unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let d = start(&server, &["--listen", &addr]).await;
    let token = std::fs::read_to_string(d.state_dir().join("token")).unwrap();
    let mode = std::fs::metadata(d.state_dir().join("token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/v1/tasks");
    for auth in [None, Some("Bearer wrong"), Some("Basic x")] {
        let mut req = http.get(&url);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 401);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "unauthorized");
    }
    let resp = http
        .get(&url)
        .bearer_auth(token.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_daemon_on_the_same_socket_is_refused_and_a_stale_socket_replaced() {
    let server = ScriptedOpenAi::start(Script::new()).await.unwrap();
    let mut d = start(&server, &[]).await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("serve")
        .arg("--socket")
        .arg(d.socket())
        .arg("--state-dir")
        .arg(tempfile::tempdir().unwrap().path())
        .args(["--executor", "local"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("a Tandem daemon is already serving"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.kill9();
    assert!(d.socket().exists(), "kill -9 leaves the socket file behind");
    d.spawn().await;
    assert_eq!(d.get("/healthz").await["status"], "ok");
}

#[tokio::test(flavor = "multi_thread")]
async fn unreachable_daemon_says_where_it_looked() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["tasks"])
        .env("TANDEM_HOST", "unix:///nonexistent/tandem.sock")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("tandem: no Tandem daemon answers at unix:///nonexistent/tandem.sock (")
            && err.contains("start one with `tandem serve`"),
        "{err}"
    );
}

/// Tasks whose one block sleeps, so a daemon dies while they run.
fn slow_tasks(n: usize, prefix: &str) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            (
                format!("{prefix} {i}"),
                format!("import time\ntime.sleep(1.5)\nprint('slow {i} done')"),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_then_restart_keeps_every_task_and_resumes_the_interrupted() {
    let tasks = slow_tasks(30, "crash");
    let server = ScriptedOpenAi::start(two_turns(tasks.clone()))
        .await
        .unwrap();
    let mut d = start(&server, &["--max-concurrent", "6"]).await;
    let mut ids = Vec::new();
    for (task, _) in &tasks {
        ids.push(d.submit(json!({"task": task})).await);
    }
    // Wait until some run, then kill the daemon mid-flight.
    let started = Instant::now();
    while d.tasks("/v1/tasks?state=running").await.tasks.len() < 6 {
        assert!(started.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.kill9();
    d.spawn().await;
    let listed = d.tasks("/v1/tasks").await;
    assert_eq!(listed.tasks.len(), 30);
    let interrupted: Vec<String> = d
        .tasks("/v1/tasks?state=interrupted")
        .await
        .tasks
        .into_iter()
        .map(|t| t.id)
        .collect();
    // On its own store the restart leaves them interrupted for `tandem resume`; on a shared
    // one the daemon ends its old leases and resumes them itself.
    assert_eq!(
        interrupted.is_empty(),
        d.store_is_shared(),
        "{interrupted:?}"
    );
    for id in &interrupted {
        d.resume_after_restart(id).await;
    }
    // A block the kill cut off is not run again (it may have done its work): the model is
    // told so. One that had not started runs after the resume.
    let mut cut_off = 0;
    for (i, id) in ids.iter().enumerate() {
        let t = d.wait_finished(id, Duration::from_secs(120)).await;
        assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
        let events = d.events(id, 0).await;
        let started = events
            .iter()
            .filter(|e| matches!(e.msg, EventMsg::CodeBlock { .. }))
            .count();
        assert_eq!(started, 1, "{id}: its block ran again after the resume");
        let told = events.iter().any(|e| {
            matches!(&e.msg, EventMsg::ExecutorMessage { text, .. }
                if text.contains("was cut off while the code of your last reply ran"))
        });
        let out = block_output(&events);
        assert!(
            told || out.last().map(String::as_str) == Some(format!("slow {i} done\n").as_str()),
            "{id}: {events:#?}"
        );
        cut_off += usize::from(told);
    }
    assert!(cut_off > 0, "the kill cut no block off");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_short_tasks_finish_and_interrupts_long_ones() {
    let mut script = two_turns([("quick".to_owned(), "print('quick done')".to_owned())]);
    script.extend(two_turns([("long".to_owned(), sleeper())]));
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let mut d = start(&server, &["--grace", "1"]).await;
    let quick = d.submit(json!({"task": "quick"})).await;
    let long = d.submit(json!({"task": "long"})).await;
    d.wait_finished(&quick, Duration::from_secs(30)).await;
    let started = Instant::now();
    let pid = loop {
        let events = d.events(&long, 0).await;
        if let (true, Some(pid)) = (block_output(&events).is_empty(), printed_pid(&events)) {
            break pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the long task never started its block"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let stopping = Instant::now();
    let code = d.terminate().await;
    assert_eq!(code, Some(0), "{}", d.log());
    assert!(
        stopping.elapsed() < Duration::from_secs(10),
        "took {:?}",
        stopping.elapsed()
    );
    assert!(!d.socket().exists(), "the socket outlived the daemon");
    // Nothing of the long block survives, and the task can go on after a restart.
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the long block (pid {pid}) outlived the daemon"
    );
    d.spawn().await;
    let t = d.task(&long).await;
    assert_eq!(t.record.state, TaskState::Interrupted, "{t:?}");
    let q = d.task(&quick).await;
    assert_eq!(q.record.stop_reason, Some(StopReason::Terminated));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_does_not_wait_for_the_first_wasm_compile() {
    // An empty compile cache: the daemon starts compiling the WASM runtimes (seconds of
    // work) in the background, and SIGTERM lands in the middle of it.
    let cache = tempfile::tempdir().unwrap();
    let config = format!(
        "[executors.wasm]\ncache_dir = \"{}\"\n",
        cache.path().display()
    );
    let server = ScriptedOpenAi::start(Script::new()).await.unwrap();
    let mut d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some(&config),
    )
    .await;
    let stopping = Instant::now();
    assert_eq!(d.terminate().await, Some(0), "{}", d.log());
    assert!(
        stopping.elapsed() < Duration::from_secs(2),
        "SIGTERM took {:?}:\n{}",
        stopping.elapsed(),
        d.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_reaps_the_sandboxes_a_killed_daemon_left() {
    let code = sleeper();
    let server = ScriptedOpenAi::start(two_turns([("orphan".to_owned(), code)]))
        .await
        .unwrap();
    // Its own TMPDIR: every daemon that starts reaps the workspaces dead daemons left in its
    // TMPDIR, and other tests start daemons while this one waits for its restart.
    let tmp = tempfile::tempdir().unwrap();
    let tmp_path = tmp.path().to_str().unwrap().to_owned();
    let mut d = Daemon::start_with_env(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
        &[("TMPDIR", &tmp_path)],
    )
    .await;
    let daemon_pid = d.pid();
    let id = d.submit(json!({"task": "orphan"})).await;
    let started = Instant::now();
    let block = loop {
        if let Some(pid) = printed_pid(&d.events(&id, 0).await) {
            break pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the block never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let workspaces = || -> Vec<String> {
        std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("tandem-local-{daemon_pid}-")))
            .collect()
    };
    d.kill9();
    // The killed daemon stays a zombie until the restart, so no daemon another test starts
    // meanwhile can take it for dead and reap this orphan first.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let alive = |pid: u32| std::path::Path::new(&format!("/proc/{pid}")).exists();
    assert!(
        alive(block),
        "the block should outlive a SIGKILLed daemon until the next start"
    );
    assert_eq!(workspaces().len(), 1);
    d.spawn().await;
    let started = Instant::now();
    while alive(block) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the restarted daemon left the orphan running"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(workspaces(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn logs_follow_reconnects_across_a_daemon_restart() {
    let tasks = slow_tasks(1, "followed");
    let server = ScriptedOpenAi::start(two_turns(tasks)).await.unwrap();
    let mut d = start(&server, &[]).await;
    let id = d.submit(json!({"task": "followed 0"})).await;
    let follower = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["logs", "-f", "--json", &id])
        .env("TANDEM_HOST", d.host())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let started = Instant::now();
    while d.task(&id).await.record.state != TaskState::Running {
        assert!(started.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.kill9();
    d.spawn().await;
    d.resume_after_restart(&id).await;
    let out = tokio::time::timeout(Duration::from_secs(60), follower.wait_with_output())
        .await
        .expect("logs -f did not finish")
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events: Vec<Event> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Every stored event exactly once, in order, through the restart, ending with the end.
    let stored = d.events(&id, 0).await;
    assert_eq!(kinds(&events), kinds(&stored));
    assert!(
        matches!(events.last().unwrap().msg, EventMsg::TaskFinished { .. }),
        "{:?}",
        events.last()
    );
    // The block the kill cut off was not run again.
    assert_eq!(
        stored
            .iter()
            .filter(|e| matches!(e.msg, EventMsg::CodeBlock { .. }))
            .count(),
        1
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tasks_can_run_in_the_wasm_sandbox() {
    let server = ScriptedOpenAi::start(two_turns([(
        "wasm task".to_owned(),
        "import os, json\nprint(os.getcwd(), json.dumps(sorted(os.environ).count('OPENAI_BASE_URL')))"
            .to_owned(),
    )]))
    .await
    .unwrap();
    let d = start(&server, &[]).await;
    let executors = d.get("/v1/executors").await;
    let wasm = executors["executors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "wasm")
        .unwrap_or_else(|| panic!("no wasm executor: {executors}"));
    assert_eq!(wasm["languages"], json!(["python", "javascript"]));
    assert_eq!(wasm["health"], "ok", "{executors}");
    let id = d
        .submit(json!({"task": "wasm task", "executor": "wasm"}))
        .await;
    let task = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(task.record.state, TaskState::Finished, "{task:?}");
    let events = d.events(&id, 0).await;
    assert_eq!(block_output(&events), ["/workspace 0\n"]);
    let metrics = d.text("/metrics").await;
    assert!(
        metrics.contains("tandem_executions_total{executor=\"wasm\",status=\"exited\"} 1"),
        "{metrics}"
    );
}

/// `id` of every container the Tandem with process id `pid` owns.
fn containers_of(pid: u32) -> Vec<String> {
    let mine = format!("/{pid}:");
    crate::e2e::tandem_containers()
        .into_iter()
        .filter(|(_, owner)| owner.contains(&mine))
        .map(|(id, _)| id)
        .collect()
}

/// A daemon on the Docker executor that has run one task, once its warm pool holds the two
/// containers it keeps by default.
async fn daemon_with_a_full_pool(server: &ScriptedOpenAi) -> Daemon {
    let image = crate::e2e::sandbox_image();
    let d = start(server, &["--image", &image]).await;
    let id = d
        .submit(json!({"task": "docker task", "executor": "docker"}))
        .await;
    let task = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(
        task.record.stop_reason,
        Some(StopReason::Terminated),
        "{task:?}"
    );
    assert_eq!(block_output(&d.events(&id, 0).await), ["in a container\n"]);
    // The session refills the warm pool (2 by default) in the background.
    let pid = d.pid();
    let started = Instant::now();
    while containers_of(pid).len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the pool did not fill: {:?}\n{}",
            containers_of(pid),
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    d
}

fn docker_task() -> Script {
    two_turns([(
        "docker task".to_owned(),
        "print('in a container')".to_owned(),
    )])
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_removes_the_warm_docker_pool() {
    let server = ScriptedOpenAi::start(docker_task()).await.unwrap();
    let mut d = daemon_with_a_full_pool(&server).await;
    let pid = d.pid();
    assert_eq!(d.terminate().await, Some(0));
    assert_eq!(containers_of(pid), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_removes_the_warm_pool_a_killed_daemon_left() {
    let server = ScriptedOpenAi::start(docker_task()).await.unwrap();
    let mut d = daemon_with_a_full_pool(&server).await;
    let killed = d.pid();
    let left = containers_of(killed);
    d.kill9();
    // SIGKILL leaves no chance to clean up: the pool's containers outlive their daemon...
    assert!(
        left.len() >= 2 && left.iter().all(|c| containers_of(killed).contains(c)),
        "{left:?}"
    );
    // ...until the next daemon starts, which removes what a dead one left.
    d.spawn().await;
    let started = Instant::now();
    while !containers_of(killed).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the killed daemon's pool is still there: {}\n{}",
            container_states(killed),
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let restarted = d.pid();
    assert_eq!(d.terminate().await, Some(0));
    assert_eq!(containers_of(restarted), Vec::<String>::new());
}

/// Sends `POST path` with `body` on a connection of its own and hangs up after `after`,
/// whatever the daemon is doing with it by then.
pub(crate) async fn hang_up(
    socket: std::path::PathBuf,
    path: &'static str,
    body: Value,
    after: Duration,
) {
    use tokio::io::AsyncWriteExt;
    let body = body.to_string();
    let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    tokio::time::sleep(after).await;
    drop(stream);
}

/// 12 `POST /v1/exec` and 6 `POST /v1/sessions` asking for docker sandboxes, all at once,
/// each hung up after its own delay, spread evenly up to `spread`: some land before the
/// open, some while the engine makes the container, some after.
fn opens_hung_up(d: &Daemon, spread: Duration) -> tokio::task::JoinSet<()> {
    let exec = json!({"executor": "docker", "language": "python", "code": "print(1)"});
    // A session whose open ends is held by the daemon until its idle timeout: a short one.
    let session = json!({"executor": "docker", "idle_timeout_secs": 1});
    let mut opens = tokio::task::JoinSet::new();
    for i in 0..18u32 {
        let (path, body) = if i % 3 == 2 {
            ("/v1/sessions", session.clone())
        } else {
            ("/v1/exec", exec.clone())
        };
        opens.spawn(hang_up(d.socket(), path, body, spread * i / 17));
    }
    opens
}

/// `id state` of each container the Tandem with process id `pid` owns, for messages.
fn container_states(pid: u32) -> String {
    let ids = containers_of(pid);
    if ids.is_empty() {
        return String::new();
    }
    let out = std::process::Command::new("docker")
        .args(["inspect", "--format", "{{.Id}} {{.State.Status}}"])
        .args(&ids)
        .output()
        .expect("the docker CLI");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits for `opens` while counting the containers `pid` owns; the most seen at once.
async fn peak_while(pid: u32, mut opens: tokio::task::JoinSet<()>) -> usize {
    let mut peak = 0;
    loop {
        peak = peak.max(containers_of(pid).len());
        if opens.is_empty() {
            return peak;
        }
        if let Ok(Some(done)) =
            tokio::time::timeout(Duration::from_millis(50), opens.join_next()).await
        {
            done.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_that_hang_up_mid_open_leave_no_container() {
    let image = crate::e2e::sandbox_image();
    let server = ScriptedOpenAi::start(two_turns([])).await.unwrap();
    // No warm pool, so every open makes its container while its client waits; room for
    // every open at once.
    let config = "[executors.docker]\npool_size = 0\n[sessions]\nmax = 64\n";
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--image", &image],
        Some(config),
    )
    .await;
    let pid = d.pid();
    let mut peak = 0;
    for spread in [400, 1000, 2500] {
        let opens = opens_hung_up(&d, Duration::from_millis(spread));
        peak = peak.max(peak_while(pid, opens).await);
    }
    assert!(
        peak > 0,
        "no open reached the engine, so none was cut off in the middle:\n{}",
        d.log()
    );
    // What a client left is closed by the daemon; nothing stays behind for the next start.
    let started = Instant::now();
    while !containers_of(pid).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "containers left by clients that hung up mid-open (of {peak} at most at once):\n{}\n{}",
            container_states(pid),
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // And the daemon still opens sandboxes for the clients that stay.
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/exec",
            Some(
                json!({"executor": "docker", "language": "python", "code": "print(6 * 7)"})
                    .to_string(),
            ),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_while_sandboxes_open_leaves_no_container() {
    let image = crate::e2e::sandbox_image();
    let server = ScriptedOpenAi::start(two_turns([])).await.unwrap();
    // The warm pool stays (2): its containers must go too.
    let mut d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--image", &image],
        Some("[sessions]\nmax = 64\n"),
    )
    .await;
    let pid = d.pid();
    // A session a client holds open.
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"executor": "docker"}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let before = containers_of(pid).len();
    assert!(before >= 1, "{}", d.log());
    // Opens under way when the signal comes, their clients going as the daemon stops.
    let opens = opens_hung_up(&d, Duration::from_millis(1500));
    let started = Instant::now();
    while containers_of(pid).len() <= before && started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    d.sigterm();
    peak_while(pid, opens).await;
    let code = d.wait_exit().await;
    assert_eq!(code, Some(0), "{}", d.log());
    assert_eq!(
        container_states(pid),
        "",
        "containers outlived the daemon that made them:\n{}",
        d.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn executors_report_their_health() {
    let server = ScriptedOpenAi::start(two_turns([])).await.unwrap();
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some("[executors.wasm]\nruntimes_dir = \"/nonexistent/wasm\"\n"),
    )
    .await;
    let executors = d.get("/v1/executors").await;
    let by_name = |name: &str| {
        executors["executors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} executor: {executors}"))
    };
    assert_eq!(by_name("local")["health"], "ok");
    let wasm = by_name("wasm");
    assert_eq!(wasm["health"], "unavailable");
    let problem = wasm["problem"].as_str().unwrap();
    assert!(
        problem.starts_with("no Python runtime (/nonexistent/wasm/python.wasm")
            && problem.ends_with("run scripts/fetch-wasm-runtimes.sh"),
        "{problem}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_task_with_a_kept_interpreter_tells_the_model_its_variables_are_gone() {
    let task = "kept across a crash";
    let server = ScriptedOpenAi::start(
        [(
            task.to_owned(),
            vec![
                Reply::from(fence("x = 41").as_str()),
                // Asked again after the resume: the workspace remembers it slept once.
                Reply::from(fence(&sleeper()).as_str()),
                // Written after the resume, told that the block above was cut off.
                Reply::from(fence("print('x' in globals())").as_str()),
                Reply::from("TERMINATE"),
            ],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let mut d = start(&server, &[]).await;
    let id = d.submit(json!({"task": task, "keep_state": true})).await;
    let started = Instant::now();
    while printed_pid(&d.events(&id, 0).await).is_none() {
        assert!(started.elapsed() < Duration::from_secs(60), "never slept");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    d.kill9();
    d.spawn().await;
    d.resume_after_restart(&id).await;
    let t = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    // The block after the restart ran in a new interpreter...
    let out = block_output(&d.events(&id, 0).await);
    assert_eq!(out.last().map(String::as_str), Some("False\n"), "{out:?}");
    // ...and the model was told so before it wrote it, with the cut-off block not run again.
    let asked = &server.requests_for(task)[2];
    let last = asked.body["messages"].as_array().unwrap().last().unwrap()["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        last.contains("its Python interpreter is new: variables, imports and open files of earlier blocks are gone")
            && last.contains("That code is not run again"),
        "{last}"
    );
}
