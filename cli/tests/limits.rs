//! Limits that hold on every road (issue 28): each attack as a hostile client tries it against
//! the real daemon, judged where the harm would land (the daemon's process, its descriptors,
//! its memory, the store file on disk, the sandboxes it holds), with a control where the same
//! request within the bound must still work.

use std::io::Read;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_protocol::{EventMsg, StopReason, TaskState};
use tandem_tests::{DaemonHarness as Daemon, McpHttp as Mcp, Reply, ScriptedOpenAi, script, texts};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tandem");

async fn daemon(server: &ScriptedOpenAi, args: &[&str], config: Option<&str>) -> Daemon {
    Daemon::start(Path::new(BIN), &server.base_url(), args, config).await
}

fn python(code: &str) -> Reply {
    Reply::from(format!("```python\n{code}\n```").as_str())
}

fn alive(pid: u32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_ok()
}

/// A line of `/proc/PID/status`, in KiB.
fn status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// A team of `levels` teams, each the only member of the one above it, around one assistant
/// (which is nested `levels` deep); as JSON and as a team file.
fn chain(levels: usize) -> (Value, String) {
    let mut agents = serde_json::Map::new();
    let mut toml = String::from("[team]\nkind = \"sequence\"\nagents = [\"a1\"]\n");
    for i in 1..levels {
        agents.insert(
            format!("a{i}"),
            json!({"kind": "sequence", "agents": [format!("a{}", i + 1)]}),
        );
        toml.push_str(&format!(
            "[agents.a{i}]\nkind = \"sequence\"\nagents = [\"a{}\"]\n",
            i + 1
        ));
    }
    agents.insert(format!("a{levels}"), json!({"instructions": "Answer."}));
    toml.push_str(&format!("[agents.a{levels}]\ninstructions = \"Answer.\"\n"));
    (
        json!({"team": {"kind": "sequence", "agents": ["a1"]}, "agents": agents}),
        toml,
    )
}

/// Submits `spec` and checks that it is a 400 whose message holds `bound`.
async fn refused(d: &Daemon, spec: Value, bound: &str) {
    let (status, body) = d
        .send(reqwest::Method::POST, "/v1/tasks", Some(spec.to_string()))
        .await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(bound), "{message}");
}

/// What `tandem serve` says on stderr when it refuses to start with `config`; it must exit 2.
fn serve_refuses(config: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("tandem")).unwrap();
    std::fs::write(dir.path().join("tandem/tandem.toml"), config).unwrap();
    let out = std::process::Command::new(BIN)
        .args(["serve", "--executor", "local", "--socket"])
        .arg(dir.path().join("s.sock"))
        .arg("--state-dir")
        .arg(dir.path())
        .env("XDG_CONFIG_HOME", dir.path())
        .env("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    stderr
}

#[test]
fn a_session_cap_for_an_executor_the_daemon_lacks_is_refused() {
    let stderr = serve_refuses("[sessions.executors]\ndokcer = 4\n");
    assert!(
        stderr.contains("[sessions.executors] names `dokcer`, which this daemon does not have"),
        "{stderr}"
    );
}

/// `text` written to a file in a new temporary directory (kept as long as the first value).
fn file_dir(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("team.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

async fn parse_team(d: &Daemon, toml: String) -> (u16, Value) {
    let resp = d
        .http()
        .post("http://tandem/v1/teams/parse")
        .body(toml)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_team_nested_by_names_past_the_bound_is_refused_and_the_daemon_lives() {
    let server = ScriptedOpenAi::start(script([
        (
            "a task running meanwhile",
            vec![
                python("import time\ntime.sleep(2)\nprint('still here')"),
                Reply::from("TERMINATE"),
            ],
        ),
        ("within the bound", texts(&["Answered."])),
    ]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let running = d.submit(json!({"task": "a task running meanwhile"})).await;
    // 1500 levels in a 70 KB body overflowed a worker's stack and aborted the daemon; so
    // many agents are past one bound, and nine levels past the other.
    for (levels, bound) in [
        (
            1500,
            "the team has 1501 agents (the top one counted); at most 64 are allowed ([teams] max_agents",
        ),
        (
            9,
            "nested more than 8 teams deep; at most 8 levels are allowed ([teams] max_depth",
        ),
    ] {
        let (deep, deep_file) = chain(levels);
        let (status, body) = parse_team(&d, deep_file).await;
        assert_eq!(status, 400, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(bound), "{message}");
        refused(&d, json!({"task": "too deep", "team": deep}), bound).await;
    }
    // MCP's run_task takes the same road.
    let mcp = Mcp::connect(&d).await.unwrap();
    let answer = mcp
        .call_tool("run_task", json!({"task": "too deep", "team": chain(9).0}))
        .await;
    assert!(answer.to_string().contains("max_depth"), "{answer}");
    assert!(alive(d.pid()), "the daemon died:\n{}", d.log());
    let done = d.wait_finished(&running, Duration::from_secs(60)).await;
    assert_eq!(
        done.record.stop_reason,
        Some(StopReason::Terminated),
        "{done:?}"
    );
    // The control: the deepest team the bound allows runs.
    let (within, within_file) = chain(8);
    assert_eq!(parse_team(&d, within_file).await.0, 200);
    let id = d
        .submit(json!({"task": "within the bound", "team": within}))
        .await;
    let done = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert!(done.record.error.is_none(), "{done:?}");
    assert_eq!(done.record.turns, 1, "{done:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_team_at_the_highest_depth_an_operator_may_set_runs_without_overflowing() {
    let server = ScriptedOpenAi::start(script([("deepest", texts(&["Answered."]))]))
        .await
        .unwrap();
    // Past the ceiling is a configuration error...
    let stderr = serve_refuses("[teams]\nmax_depth = 65\n");
    assert!(
        stderr.contains("[teams] max_depth is 65; give a number from 1 to 64"),
        "{stderr}"
    );
    // ...and at it, a team that deep is checked and run on the daemon's worker threads.
    let d = daemon(
        &server,
        &[],
        Some("[teams]\nmax_depth = 64\nmax_agents = 128\n"),
    )
    .await;
    let (team, file) = chain(64);
    let id = d.submit(json!({"task": "deepest", "team": team})).await;
    let done = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert!(done.record.error.is_none(), "{done:?}");
    assert!(alive(d.pid()));
    // `tandem run --team` leaves the bounds to the daemon: past the defaults, within its own.
    let path = file_dir(&file);
    let (code, stdout, stderr) = d
        .cli(&["run", "--team", &path.1.display().to_string(), "deepest"])
        .await;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("on the daemon at"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread")]
async fn tandem_team_check_refuses_a_deep_file_instead_of_crashing() {
    let dir = tempfile::tempdir().unwrap();
    let check = |levels: usize| {
        let path = dir.path().join(format!("chain-{levels}.toml"));
        std::fs::write(&path, chain(levels).1).unwrap();
        let config = dir.path().to_owned();
        async move {
            let out = tokio::process::Command::new(BIN)
                .args(["team", "check"])
                .arg(&path)
                .env("XDG_CONFIG_HOME", config)
                .output()
                .await
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let (code, stderr) = check(5000).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("max_agents"), "{stderr}");
    let (code, stderr) = check(9).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("nested more than 8 teams deep"), "{stderr}");
    // The operator's [teams] holds in this process too.
    std::fs::create_dir_all(dir.path().join("tandem")).unwrap();
    std::fs::write(
        dir.path().join("tandem/tandem.toml"),
        "[teams]\nmax_depth = 16\n",
    )
    .unwrap();
    let (code, stderr) = check(9).await;
    assert_eq!(code, Some(0), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parallel_wider_than_the_bound_is_refused_and_one_within_it_runs() {
    let server = ScriptedOpenAi::start(script([("wide", texts(&["Mine."]))]))
        .await
        .unwrap();
    let d = daemon(&server, &[], None).await;
    let wide = |n: usize| {
        let names: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
        let agents: serde_json::Map<String, Value> = names
            .iter()
            .map(|n| (n.clone(), json!({"instructions": "Answer."})))
            .collect();
        json!({"team": {"kind": "parallel", "agents": names}, "agents": agents})
    };
    refused(
        &d,
        json!({"task": "wide", "team": wide(40)}),
        "a parallel runs its 40 members at once; at most 8 are allowed ([teams] max_parallel",
    )
    .await;
    refused(
        &d,
        json!({"task": "wide", "team": wide(100)}),
        "the team has 101 agents (the top one counted); at most 64 are allowed ([teams] max_agents",
    )
    .await;
    let id = d.submit(json!({"task": "wide", "team": wide(8)})).await;
    let done = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert!(done.record.error.is_none(), "{done:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn max_concurrent_holds_with_no_approval_policy() {
    let tasks: Vec<String> = (0..3).map(|i| format!("one at a time {i}")).collect();
    let server = ScriptedOpenAi::start(
        tasks
            .iter()
            .map(|t| {
                (
                    t.clone(),
                    vec![
                        python("import time\ntime.sleep(1)\nprint('slept')"),
                        Reply::from("TERMINATE"),
                    ],
                )
            })
            .collect(),
    )
    .await
    .unwrap();
    // No [approval] section: the configuration in which the slot used to be given back at
    // once.
    let d = daemon(&server, &["--max-concurrent", "1"], None).await;
    let mut ids = Vec::new();
    for t in &tasks {
        ids.push(d.submit(json!({ "task": t })).await);
    }
    let mut spans = Vec::new();
    for id in &ids {
        let done = d.wait_finished(id, Duration::from_secs(60)).await;
        assert_eq!(
            done.record.stop_reason,
            Some(StopReason::Terminated),
            "{done:?}"
        );
        spans.push((
            done.record.started_ms.unwrap(),
            done.record.finished_ms.unwrap(),
        ));
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        assert!(
            pair[1].0 >= pair[0].1,
            "two tasks ran at once under --max-concurrent 1: {spans:?}"
        );
    }
}

/// The text of a tool result.
fn tool_text(result: &Value) -> String {
    result["content"][0]["text"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| result.to_string())
}

const DENY_FORBIDDEN: &str = "[approval]\nmode = \"never\"\n[[approval.deny]]\nname = \"no-forbidden\"\npattern = \"forbidden-word\"\n";

#[tokio::test(flavor = "multi_thread")]
async fn mcp_execute_code_passes_the_operators_approval_policy() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = daemon(&server, &[], Some(DENY_FORBIDDEN)).await;
    let mcp = Mcp::connect(&d).await.unwrap();
    let denied = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "print('forbidden-word ran')"}),
        )
        .await;
    assert_eq!(denied["isError"], true, "{denied}");
    let text = tool_text(&denied);
    assert!(text.contains("deny rule `no-forbidden`"), "{text}");
    assert!(!text.contains("ran"), "the code ran: {text}");
    // The control: code the rule does not name runs on the same connection.
    let allowed = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "print('allowed ' + 'ran')"}),
        )
        .await;
    assert_eq!(
        allowed["structuredContent"]["stdout"], "allowed ran\n",
        "{allowed}"
    );
    let executed = d.text("/metrics").await;
    assert!(
        executed
            .lines()
            .all(|l| !l.starts_with("tandem_sessions_open ") || l.ends_with(" 0")),
        "{executed}"
    );

    // Under mode "always" no one can be asked in a tool call: it is refused, with the way.
    let d = daemon(&server, &[], Some("[approval]\nmode = \"always\"\n")).await;
    let mcp = Mcp::connect(&d).await.unwrap();
    let asked = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "print(1)"}),
        )
        .await;
    assert_eq!(asked["isError"], true, "{asked}");
    let text = tool_text(&asked);
    assert!(
        text.contains("needs a person's approval") && text.contains("run_task"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tandem_mcp_over_stdio_passes_the_operators_approval_policy() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("tandem")).unwrap();
    std::fs::write(dir.path().join("tandem/tandem.toml"), DENY_FORBIDDEN).unwrap();
    let mut child = tokio::process::Command::new(BIN)
        .args(["mcp", "--executor", "local"])
        .env("XDG_CONFIG_HOME", dir.path())
        .env("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut send = async |message: Value| {
        stdin
            .write_all(format!("{message}\n").as_bytes())
            .await
            .unwrap();
    };
    send(
        json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "limits-test", "version": "1"}}}),
    )
    .await;
    send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
    for (id, code) in [
        (1, "print('forbidden-word ran')"),
        (2, "print('allowed ' + 'ran')"),
    ] {
        send(
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "execute_code", "arguments": {"language": "python", "code": code}}}),
        )
        .await;
    }
    let mut results = std::collections::HashMap::new();
    while results.len() < 2 {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("tandem mcp did not answer")
            .unwrap()
            .expect("tandem mcp closed its output");
        let message: Value = serde_json::from_str(&line).unwrap();
        if let Some(id) = message["id"].as_u64().filter(|id| *id > 0) {
            results.insert(id, message["result"].clone());
        }
    }
    let denied = tool_text(&results[&1]);
    assert!(denied.contains("deny rule `no-forbidden`"), "{denied}");
    assert_eq!(results[&2]["structuredContent"]["stdout"], "allowed ran\n");
}

/// The most sessions `/metrics` said were open, and the most processes whose command line
/// holds `marker` the host had at once (when one is given), sampled until `done`.
async fn peaks(d: &Daemon, marker: Option<&str>, done: &AtomicBool) -> (u64, usize) {
    let (mut sessions, mut processes) = (0, 0);
    while !done.load(Ordering::SeqCst) {
        let text = d.text("/metrics").await;
        let open = text
            .lines()
            .find_map(|l| l.strip_prefix("tandem_sessions_open "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        sessions = sessions.max(open);
        if let Some(marker) = marker {
            processes = processes.max(processes_with(marker));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (sessions, processes)
}

/// Processes on the host whose command line holds `marker`.
fn processes_with(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .filter(|cmdline| {
            cmdline
                .split(|b| *b == 0)
                .any(|arg| arg == marker.as_bytes())
        })
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_calls_on_many_connections_share_the_daemons_sandbox_budget() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = daemon(
        &server,
        &["--max-concurrent", "8"],
        Some("[sessions]\nmax = 2\n"),
    )
    .await;
    let connections = [
        Mcp::connect(&d).await.unwrap(),
        Mcp::connect(&d).await.unwrap(),
        Mcp::connect(&d).await.unwrap(),
    ];
    // Each block runs a `sleep` the host can see, marked by its odd argument.
    let marker = "1.4142";
    let code = format!("import subprocess\nsubprocess.run(['sleep', '{marker}'])\nprint('ok')");
    let done = AtomicBool::new(false);
    let calls = async {
        let calls = connections.iter().flat_map(|mcp| {
            (0..3)
                .map(|_| mcp.call_tool("execute_code", json!({"language": "python", "code": code})))
        });
        let results = futures::future::join_all(calls).await;
        done.store(true, Ordering::SeqCst);
        results
    };
    let (results, (sessions, running)) = tokio::join!(calls, peaks(&d, Some(marker), &done));
    // Every call waited for a sandbox and ran; never more than two ran at once.
    for r in &results {
        assert_eq!(r["structuredContent"]["stdout"], "ok\n", "{r}");
    }
    assert!(
        (1..=2).contains(&running),
        "{running} blocks ran at once on the host"
    );
    assert!(
        (1..=2).contains(&sessions),
        "{sessions} sessions were open at once"
    );
    // One connection cannot run more than four calls at once.
    let mcp = &connections[0];
    let slow = json!({"language": "python", "code": "import time\ntime.sleep(2)"});
    let five = (0..5).map(|_| mcp.call_tool("execute_code", slow.clone()));
    let results = futures::future::join_all(five).await;
    let refused: Vec<&Value> = results
        .iter()
        .filter(|r| r.to_string().contains("already has 4 tool calls running"))
        .collect();
    assert_eq!(refused.len(), 1, "{results:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_connections_past_the_cap_are_refused() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = daemon(&server, &[], None).await;
    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(Mcp::connect(&d).await.unwrap());
    }
    let refused = Mcp::connect(&d).await.err().expect("a 65th connection");
    assert!(refused.contains("64 MCP connections"), "{refused}");
    // One closed frees its place.
    let gone = held.pop().unwrap();
    let resp = d
        .http()
        .delete("http://tandem/mcp")
        .header("mcp-session-id", &gone.session)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    let started = Instant::now();
    while Mcp::connect(&d).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "a closed connection's place was not freed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn wasm_calls_over_mcp_are_bounded_by_the_executors_session_cap() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = daemon(
        &server,
        &["--executor", "wasm", "--max-concurrent", "16"],
        Some("[sessions.executors]\nwasm = 2\n"),
    )
    .await;
    // The runtime is compiled and loaded before the measure starts.
    let warm = Mcp::connect(&d).await.unwrap();
    let first = warm
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "print(1)"}),
        )
        .await;
    assert_eq!(first["structuredContent"]["stdout"], "1\n", "{first}");
    let before = status_kib(d.pid(), "VmHWM:");
    let connections = [
        warm,
        Mcp::connect(&d).await.unwrap(),
        Mcp::connect(&d).await.unwrap(),
    ];
    // Each block fills 150 MiB of its linear memory.
    let code = "b = b'x' * (150 << 20)\nimport time\ntime.sleep(0.5)\nprint(len(b) >> 20)";
    let done = AtomicBool::new(false);
    let calls = async {
        let calls = connections.iter().enumerate().flat_map(|(c, mcp)| {
            (0..if c == 0 { 4 } else { 3 }).map(move |_| {
                mcp.call_tool("execute_code", json!({"language": "python", "code": code}))
            })
        });
        let results = futures::future::join_all(calls).await;
        done.store(true, Ordering::SeqCst);
        results
    };
    let (results, (peak, _)) = tokio::join!(calls, peaks(&d, None, &done));
    for r in &results {
        assert_eq!(r["structuredContent"]["stdout"], "150\n", "{r}");
    }
    let grew_mib = (status_kib(d.pid(), "VmHWM:").saturating_sub(before)) / 1024;
    eprintln!("ten WASM calls: the daemon grew by {grew_mib} MiB, {peak} sessions at most");
    // Ten at once took the daemon past 2 GiB; two at a time stay near 2 x 150 MiB.
    assert!(grew_mib < 800, "the daemon grew by {grew_mib} MiB");
    assert!((1..=2).contains(&peak), "{peak} WASM sessions at once");
}

/// A daemon that also listens on a free loopback port, with `config`: it, the address and
/// the token.
async fn tcp_daemon(config: &str) -> (Daemon, String, String) {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    // No task here asks a model.
    let d = Daemon::start(
        Path::new(BIN),
        "http://127.0.0.1:9/v1",
        &["--listen", &addr],
        Some(config),
    )
    .await;
    let token = std::fs::read_to_string(d.state_dir().join("token")).unwrap();
    (d, addr, token.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_and_slow_tcp_connections_are_capped_and_closed() {
    let (d, addr, token) = tcp_daemon(
        "[server]\nheader_timeout_secs = 2\nmax_unauthenticated = 8\nmax_connections = 32\n",
    )
    .await;
    let baseline = open_fds(d.pid());
    // 200 connections that never send a token: silent ones, and ones that trickle a header.
    let mut held = Vec::new();
    for i in 0..200 {
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        if i % 2 == 0 {
            use std::io::Write;
            let _ = conn.write_all(b"GET /v1/tasks HTTP/1.1\r\nHost: x\r\n");
        }
        held.push(conn);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = open_fds(d.pid());
    assert!(
        // The cap's eight, and room for what the daemon opens meanwhile on its own.
        during <= baseline + 8 + 16,
        "the daemon holds {during} descriptors (it had {baseline}) for 200 token-less connections"
    );
    // The Unix socket answers meanwhile.
    assert_eq!(d.get("/healthz").await["status"], "ok");
    // Every one of them is closed by the daemon: over the cap at once, within the cap after
    // the header timeout (a read that waits 20 s for it finds one held).
    for conn in &mut held {
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut buf = [0u8; 256];
        let closed = loop {
            match conn.read(&mut buf) {
                Ok(0) => break true,
                // A 408 for the slow header, then the close.
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
                Err(_) => break false,
            }
        };
        assert!(closed, "a token-less connection was held open");
    }
    // Then a client with the token gets in over TCP.
    let client = reqwest::Client::new();
    let resp = client
        .get(format!("http://{addr}/v1/executors"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(alive(d.pid()));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_authenticated_connection_does_not_count_against_the_token_less_cap() {
    let (_daemon, addr, token) = tcp_daemon("[server]\nmax_unauthenticated = 2\n").await;
    // Three clients that each keep one connection and show the token: none is turned away.
    let clients: Vec<reqwest::Client> = (0..3)
        .map(|_| {
            reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .build()
                .unwrap()
        })
        .collect();
    for _ in 0..2 {
        for c in &clients {
            let resp = c
                .get(format!("http://{addr}/healthz"))
                .bearer_auth(&token)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn listing_every_task_holds_a_chunk_not_the_store() {
    // Nothing answers here: each task fails at once, and what matters is what it stored.
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = Daemon::start(Path::new(BIN), "http://127.0.0.1:9/v1", &[], None).await;
    drop(server);
    let big = "x".repeat(900 << 10);
    for i in 0..200 {
        d.submit(json!({"task": format!("{i:03} {big}")})).await;
    }
    let started = Instant::now();
    while d.count("finished").await < 200 {
        assert!(started.elapsed() < Duration::from_secs(120));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = status_kib(d.pid(), "VmHWM:");
    let lists = (0..4).map(|_| async {
        let text = d.text("/v1/tasks").await;
        let v: Value = serde_json::from_str(&text).unwrap();
        v["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["spec"]["task"].as_str().unwrap()[..3].to_owned())
            .collect::<Vec<_>>()
    });
    let listed = futures::future::join_all(lists).await;
    let expected: Vec<String> = (0..200).map(|i| format!("{i:03}")).collect();
    for l in &listed {
        assert_eq!(l, &expected, "every task, oldest first, once");
    }
    let mcp = Mcp::connect(&d).await.unwrap();
    let resources = mcp.request("resources/list", json!({})).await;
    assert_eq!(resources["resources"].as_array().unwrap().len(), 50);
    let grew_mib = (status_kib(d.pid(), "VmHWM:").saturating_sub(before)) / 1024;
    eprintln!("four unpaged listings and resources/list: the daemon grew by {grew_mib} MiB");
    // Four listings of 180 MB took the daemon from 176 MiB to 1.7 GiB; a few chunks at a
    // time (and the allocator's leftovers) are a fraction of one listing.
    assert!(grew_mib < 300, "the daemon grew by {grew_mib} MiB");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_model_servers_error_never_puts_a_key_into_the_store() {
    let key = "sk-daemon-secret-4242-abcdef";
    let server = ScriptedOpenAi::start(script([(
        "echoing server",
        vec![Reply::Error(
            400,
            format!(
                "bad request. You sent: Authorization: Bearer {key} x-api-key: hunter2hunter2 {{\"api_key\": \"other-secret-value\"}}"
            ),
        )],
    )]))
    .await
    .unwrap();
    let d = daemon(
        &server,
        &[],
        Some(&format!("[model]\napi_key = \"{key}\"\n")),
    )
    .await;
    let id = d.submit(json!({"task": "echoing server"})).await;
    let done = d.wait_finished(&id, Duration::from_secs(30)).await;
    let message = done.record.error.as_ref().unwrap().message.as_str();
    assert!(message.contains("[redacted]"), "{message}");
    assert!(message.contains("bad request"), "{message}");
    // On the host: the store's files hold none of it.
    for entry in std::fs::read_dir(d.state_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("tandem.db"))
        {
            let bytes = std::fs::read(&path).unwrap();
            for secret in [key, "hunter2hunter2", "other-secret-value"] {
                assert!(
                    !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                    "{} holds {secret}",
                    path.display()
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_with_thousands_of_blocks_runs_the_first_sixteen_and_says_so() {
    let blocks: String = (0..3000)
        .map(|i| format!("```python\nprint({i})\n```\n"))
        .collect();
    let server = ScriptedOpenAi::start(script([(
        "many blocks",
        vec![Reply::from(blocks.as_str()), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let id = d.submit(json!({"task": "many blocks"})).await;
    let done = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(
        done.record.stop_reason,
        Some(StopReason::Terminated),
        "{done:?}"
    );
    let events = d.events(&id, 0).await;
    let ran = events
        .iter()
        .filter(|e| matches!(e.msg, EventMsg::ExecResult { .. }))
        .count();
    assert_eq!(ran, 16);
    let told = server.requests_for("many blocks")[1]
        .last_message()
        .unwrap()
        .to_owned();
    assert!(
        told.contains("Your reply had 3000 code blocks; at most 16 are taken from one reply, so the last 2984 were not run."),
        "{told}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_approvers_edit_is_checked_against_the_deny_rules() {
    let server = ScriptedOpenAi::start(script([
        (
            "edit me",
            vec![python("print('as written')"), Reply::from("TERMINATE")],
        ),
        (
            "edit me fine",
            vec![python("print('as written')"), Reply::from("TERMINATE")],
        ),
    ]))
    .await
    .unwrap();
    let d = daemon(
        &server,
        &[],
        Some(
            "[approval]\nmode = \"always\"\n[[approval.deny]]\nname = \"no-forbidden\"\npattern = \"forbidden-word\"\n",
        ),
    )
    .await;
    for (task, edit, expect) in [
        (
            "edit me",
            "print('forbidden-word')",
            "does not allow the edited code (deny rule `no-forbidden`)",
        ),
        ("edit me fine", "print('edited ' + 'ok')", "edited ok"),
    ] {
        let id = d.submit(json!({ "task": task })).await;
        let started = Instant::now();
        while d.task(&id).await.record.state != TaskState::AwaitingApproval {
            assert!(started.elapsed() < Duration::from_secs(30));
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        let (status, body) = d
            .send(
                reqwest::Method::POST,
                &format!("/v1/tasks/{id}/approvals/1"),
                Some(json!({"decision": "approve", "code": edit}).to_string()),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        d.wait_finished(&id, Duration::from_secs(30)).await;
        let told = server.requests_for(task)[1]
            .last_message()
            .unwrap()
            .to_owned();
        assert!(told.contains(expect), "{task}: {told}");
    }
}
