//! Tools on every road: `tandem run` in-process (its transcript pinned), the daemon's API (an
//! operator's tools, what a client may and may not name, a resume across `kill -9`), and
//! the tool events a client reads.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_protocol::{EventMsg, StopReason, TaskState};
use tandem_tests::daemon::block_output;
use tandem_tests::{DaemonHarness as Daemon, Reply, ScriptedOpenAi, call, script};

use crate::e2e::{settings, tandem};

/// An operator's `tandem.toml` with one command tool, `wc`, which counts words.
const CONFIG: &str = r#"
[tools.wc]
description = "Count the words of a text."
parameters = { type = "object", properties = { text = { type = "string" } }, required = ["text"] }
command = ["python3", "-c", "import json, sys; print(len(json.load(sys.stdin)['text'].split()))"]
"#;

fn execute(id: &str, code: &str) -> (String, String, String) {
    call(
        id,
        "execute_code",
        &json!({"language": "python", "code": code}).to_string(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn run_with_code_via_tool_shows_each_call_and_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let task = "tools: run transcript";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Calls(
                "Counting first.".to_owned(),
                vec![
                    call("c1", "wc", r#"{"text": "one two three"}"#),
                    execute("c2", "print(6 * 7)"),
                ],
            ),
            Reply::from("3 words, and 42. TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let base_url = server.base_url();
    let run = |extra: &'static [&'static str]| {
        let mut args = vec![
            "run",
            "--config",
            config.to_str().unwrap(),
            "--base-url",
            &base_url,
        ];
        args.extend(extra);
        args.push(task);
        async move { tandem(&args, &[], None).await }
    };
    let out = run(&["--code-via", "tool", "--tool", "wc"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    settings().bind(|| insta::assert_snapshot!("run_code_via_tool_transcript", out.stdout));
    // --tool names one of the configured tools; any other is refused by name.
    let out = run(&["--tool", "shell"]).await;
    assert_eq!(out.code, 2);
    assert!(
        out.stderr
            .contains("tools: tool `shell` is not offered here; the operator's tools are: wc"),
        "{}",
        out.stderr
    );
}

async fn daemon(server: &ScriptedOpenAi) -> Daemon {
    daemon_with(server, &[], "").await
}

/// A daemon with the `wc` tool, `args` and `more` config after it.
async fn daemon_with(server: &ScriptedOpenAi, args: &[&str], more: &str) -> Daemon {
    Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        args,
        Some(&format!("{CONFIG}{more}")),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_names_only_the_operators_tools_and_defines_only_commands() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = daemon(&server).await;
    let refused = |spec: Value| {
        let d = &d;
        async move {
            let (status, body) = d
                .send(reqwest::Method::POST, "/v1/tasks", Some(spec.to_string()))
                .await;
            (
                status,
                body["error"]["message"].as_str().unwrap_or("").to_owned(),
            )
        }
    };
    let (status, message) = refused(json!({"task": "x", "tools": ["shell"]})).await;
    assert_eq!(
        (status, message.as_str()),
        (
            400,
            "tools: tool `shell` is not offered here; the operator's tools are: wc"
        )
    );
    let (status, message) = refused(json!({"task": "x", "tools": [
        {"name": "metadata", "url": "http://169.254.169.254/latest/meta-data/"}
    ]}))
    .await;
    assert_eq!(status, 400);
    assert!(
        message.starts_with(
            "tools: tool `metadata`: an HTTP tool can be configured only by the operator"
        ),
        "{message}"
    );
    // Nor an MCP server, which would run on the daemon's host.
    let (status, message) = refused(json!({"task": "x", "tools": [
        {"name": "host", "mcp": ["sh", "-c", "id"]}
    ]}))
    .await;
    assert_eq!(status, 400);
    assert!(message.contains("unknown field `mcp`"), "{message}");
    let (status, message) = refused(json!({"task": "x", "code_via": "sometimes"})).await;
    assert_eq!(status, 400, "{message}");
    assert!(message.contains("code_via"), "{message}");
    // A command the task defines runs in its own sandbox: that is allowed.
    let (status, _) = refused(json!({"task": "x", "tools": [
        "wc", {"name": "upper", "command": ["tr", "a-z", "A-Z"]}
    ]}))
    .await;
    assert_eq!(status, 201);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_with_tool_calls_resumes_after_kill_9_with_its_calls_answered() {
    let task = "tools: across a crash";
    // The second call sleeps the first time it runs, long enough to kill the daemon.
    let slow = "import os, time\nif not os.path.exists('slept'):\n    open('slept', 'w').close()\n    print('sleeping', flush=True)\n    time.sleep(60)\nprint('awake')";
    let calls = vec![
        call("w", "wc", r#"{"text": "a b c d"}"#),
        execute("s", slow),
    ];
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Calls(String::new(), calls),
            Reply::from("4 words. TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let mut d = daemon(&server).await;
    let id = d
        .submit(json!({"task": task, "code_via": "tool", "tools": ["wc"]}))
        .await;
    let started = Instant::now();
    loop {
        let events = d.events(&id, 0).await;
        if events
            .iter()
            .any(|e| matches!(&e.msg, EventMsg::ExecOutput { text, .. } if text == "sleeping\n"))
        {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "never slept");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    d.kill9();
    d.spawn().await;
    let (code, _, err) = d.cli(&["resume", &id]).await;
    assert_eq!(code, 0, "{err}");
    let t = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    // After the resume each call was answered once, in order: the one that ended with what
    // it said, the one the crash cut off with why it is not run again.
    let asked = server.requests_for(task);
    let last = asked.last().unwrap().body["messages"]
        .as_array()
        .unwrap()
        .clone();
    let tail: Vec<&Value> = last.iter().skip(2).collect();
    assert_eq!(tail.len(), 3, "{tail:#?}");
    assert_eq!(tail[0]["tool_calls"].as_array().unwrap().len(), 2);
    assert_eq!(
        (&tail[1]["tool_call_id"], &tail[1]["content"]),
        (&json!("w"), &json!("4\n"))
    );
    assert_eq!(tail[2]["tool_call_id"], "s");
    let cut = tail[2]["content"].as_str().unwrap();
    assert!(
        cut.contains("was cut off while the code of your last reply ran")
            && cut.contains("may have run in part or in full"),
        "{cut}"
    );
    // The stored events carry the calls and their answers.
    let events = d.events(&id, 0).await;
    let answered: Vec<(&str, &str)> = events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::ToolResult { id, name, .. } => Some((id.as_str(), name.as_str())),
            _ => None,
        })
        .collect();
    // The crash cut the reply's second call off; nothing ran twice.
    assert_eq!(answered, [("w", "wc")]);
    let (text, tool_results) = events
        .iter()
        .rev()
        .find_map(|e| match &e.msg {
            EventMsg::ExecutorMessage {
                text, tool_results, ..
            } => Some((text, tool_results)),
            _ => None,
        })
        .unwrap();
    assert_eq!(tool_results.first().map(|r| r.id.as_str()), Some("w"));
    assert_eq!(tool_results.get(1).map(|r| r.id.as_str()), Some("s"));
    assert_eq!(text, "");
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_run_task_takes_code_via_and_tools_and_reports_the_calls() {
    use tandem_tests::McpHttp;
    let task = "tools: over mcp";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Calls(
                String::new(),
                vec![
                    call("m1", "wc", r#"{"text": "a b"}"#),
                    call("m2", "upper", r#"{}"#),
                ],
            ),
            Reply::from("2 TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server).await;
    let mcp = McpHttp::connect(&d).await.unwrap();
    let result = mcp
        .call_tool(
            "run_task",
            json!({"task": task, "code_via": "tool", "tools": [
                "wc", {"name": "upper", "command": ["python3", "-c", "print('UP')"]}
            ]}),
        )
        .await;
    assert_eq!(result["isError"], false, "{result}");
    let structured = &result["structuredContent"];
    assert_eq!(structured["stop_reason"], "terminated", "{result}");
    let calls: Vec<(&str, bool)> = structured["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap(),
                c["is_error"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(calls, [("wc", false), ("upper", false)]);
    // What the model read back: both answers.
    let asked = &server.requests_for(task)[1].body["messages"];
    assert_eq!(asked[3]["content"], "2\n");
    assert_eq!(asked[4]["content"], "UP\n");
    // A tool the operator does not offer is refused before anything runs.
    let result = mcp
        .call_tool("run_task", json!({"task": task, "tools": ["shell"]}))
        .await;
    let text = result.to_string();
    assert!(text.contains("tool `shell` is not offered here"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_teams_agents_hold_different_tools_and_each_calls_only_its_own() {
    let task = "tools: a team";
    let server = ScriptedOpenAi::start(
        [
            (
                format!("{task}#coder"),
                vec![Reply::Calls(
                    String::new(),
                    vec![call("k1", "wc", r#"{"text": "x y"}"#)],
                )],
            ),
            (
                format!("{task}#reviewer"),
                vec![
                    Reply::Calls(
                        String::new(),
                        vec![
                            call("r1", "wc", r#"{"text": "x"}"#),
                            call("r2", "shout", "{}"),
                        ],
                    ),
                    Reply::from("DONE"),
                ],
            ),
        ]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let d = daemon(&server).await;
    let team = json!({
        "team": {"kind": "chat", "agents": ["coder", "runner", "reviewer"],
                 "termination": {"ends_with": "DONE"}},
        "agents": {
            "coder": {"instructions": "coder", "tools": ["wc"], "code_via": "tool"},
            "runner": {"kind": "executor"},
            "reviewer": {"instructions": "reviewer", "tools": [
                {"name": "shout", "command": ["python3", "-c", "print('SHOUT')"]}
            ]}
        }
    });
    let id = d.submit(json!({"task": task, "team": team})).await;
    let t = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let offered = |agent: &str| -> Vec<String> {
        let asked = server.requests_for(task);
        let request = asked
            .iter()
            .find(|r| {
                r.body["messages"][0]["content"]
                    .as_str()
                    .unwrap()
                    .starts_with(agent)
            })
            .unwrap();
        request.body["tools"]
            .as_array()
            .map(|tools| {
                tools
                    .iter()
                    .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(offered("coder"), ["execute_code", "wc"]);
    assert_eq!(offered("reviewer"), ["shout"]);
    // The reviewer's call of the coder's tool is answered as an unknown tool; its own runs.
    let last = server.requests_for(task).last().unwrap().body["messages"]
        .as_array()
        .unwrap()
        .clone();
    let answers: Vec<(&str, &str)> = last
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap(),
                m["content"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        answers,
        [
            ("r1", "error: there is no tool `wc`; the tools are: shout."),
            ("r2", "SHOUT\n")
        ]
    );
    // The coder's own call, which the reviewer did not make, reached it as words.
    assert!(
        last.iter().any(|m| m["content"]
            .as_str()
            .is_some_and(|c| c.contains("[called tool `wc` with {\"text\": \"x y\"}]"))),
        "{last:#?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_lists_the_tools_and_names_a_broken_one() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!("{CONFIG}\n[model]\ncode_via = \"auto\"\n\n[tools.weather]\nurl = \"http://127.0.0.1:9/weather\"\n"),
    )
    .unwrap();
    let out = tandem(&["doctor", "--config", config.to_str().unwrap()], &[], None).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("code via:  auto\n"), "{}", out.stdout);
    assert!(
        out.stdout.contains(
            "tools:     wc (a command in the sandbox), weather (HTTP http://127.0.0.1:9/weather)\n"
        ),
        "{}",
        out.stdout
    );
    std::fs::write(&config, "[tools.gone]\nmcp = [\"/nonexistent/server\"]\n").unwrap();
    let out = tandem(&["doctor", "--config", config.to_str().unwrap()], &[], None).await;
    assert!(
        out.stdout.contains(
            "tools:     error: tool `gone`: cannot start the MCP server `/nonexistent/server`:"
        ),
        "{}",
        out.stdout
    );
}

/// Calls from code are bounded as a block's output is: past `[limits] code_calls_per_block`
/// or `code_calls_per_task` each call fails at once with a message naming the limit, only
/// the first refusal of each is stored, and a stored call's arguments are cut (marked)
/// however large the code made them.
#[tokio::test(flavor = "multi_thread")]
async fn calls_from_code_stop_at_the_cap_and_their_stored_arguments_are_cut() {
    let task = "tools: a flood of calls";
    let flood = |calls: u32| {
        format!(
            "```python\nimport tandem_tools\nbig = 'w ' * (1 << 19)\nok, refused, said = 0, 0, ''\nfor i in range({calls}):\n    try:\n        tandem_tools.call('wc', text=big)\n        ok += 1\n    except tandem_tools.ToolError as e:\n        refused += 1\n        said = str(e)\nprint(ok, refused)\nprint(said)\n```"
        )
    };
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from(flood(40).as_str()),
            Reply::from(flood(5).as_str()),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon_with(
        &server,
        &[],
        "\n[limits]\ncode_calls_per_block = 5\ncode_calls_per_task = 7\n",
    )
    .await;
    let id = d.submit(json!({"task": task, "tools": ["wc"]})).await;
    let t = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let outs = d.block_stdouts(&id).await;
    assert!(outs[0].starts_with("5 35\n"), "{outs:?}");
    assert!(
        outs[0].contains("[limits] code_calls_per_block"),
        "{outs:?}"
    );
    // The second block may make the two calls the task has left.
    assert!(outs[1].starts_with("2 3\n"), "{outs:?}");
    assert!(outs[1].contains("[limits] code_calls_per_task"), "{outs:?}");
    let events = d.events(&id, 0).await;
    let calls: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::ToolCall { arguments, .. } => Some(arguments.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        calls.len(),
        9,
        "5 + 2 run, and one refusal of each cap stored"
    );
    for arguments in calls {
        assert!(
            arguments.len() < 70 << 10,
            "{} bytes stored",
            arguments.len()
        );
        assert!(
            arguments.contains(" bytes truncated ...]"),
            "{arguments:.200}"
        );
    }
}

/// The tools module of a local block is Tandem's, not the block's: a block that swaps its
/// files (or its directory) for links to a private host file changes nothing Tandem writes,
/// and the next block's calls still work; the host file keeps its bytes and mode.
#[tokio::test(flavor = "multi_thread")]
async fn a_local_block_cannot_turn_the_tools_module_into_a_write_on_the_host() {
    use std::os::unix::fs::PermissionsExt;
    let outside = tempfile::tempdir().unwrap();
    let host = outside.path().join("host-secret");
    std::fs::write(&host, b"the host's own").unwrap();
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o600)).unwrap();
    let task = "tools: plant links in the module";
    let plant = format!(
        "import os, tandem_tools\nHOST = {:?}\nd = os.path.dirname(tandem_tools.__file__)\nfor name in sorted(os.listdir(d)):\n    try:\n        os.unlink(os.path.join(d, name))\n        os.symlink(HOST, os.path.join(d, name))\n        print('planted', name)\n    except OSError as e:\n        print('refused', name)\ntry:\n    os.rename(d, d + '.old')\n    os.symlink(os.path.dirname(HOST), d)\n    print('planted the directory')\nexcept OSError:\n    print('refused the directory')\n",
        host.display().to_string()
    );
    let call = "import tandem_tools\nprint(tandem_tools.call('wc', text='one two'))\n";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from(format!("```python\n{plant}```").as_str()),
            Reply::from(format!("```python\n{call}```").as_str()),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon_with(&server, &["--executor", "local"], "").await;
    let id = d.submit(json!({"task": task, "tools": ["wc"]})).await;
    let t = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let outs = d.block_stdouts(&id).await;
    assert!(!outs[0].contains("planted"), "{}", outs[0]);
    assert_eq!(outs[1].trim(), "2", "{outs:?}");
    assert_eq!(std::fs::read(&host).unwrap(), b"the host's own");
    assert_eq!(
        std::fs::metadata(&host).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 1);
}

/// The flood that once grew a daemon to 2.7 GiB and outlived its grace: Docker blocks that
/// call a tool as fast as they can with 4 MiB of arguments each, then print without end.
/// Calls stop at the caps, stored arguments are cut, the writer's backlog is bounded, and
/// SIGTERM ends it all within the grace and the cancel that follows it.
#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_calls_and_output_keeps_the_daemon_small_and_sigterm_prompt() {
    let flood = "```python\nimport tandem_tools\nbig = 'w ' * 2000000\nfor i in range(300):\n    try:\n        tandem_tools.call('wc', text=big)\n    except tandem_tools.ToolError as e:\n        print('refused:', e, flush=True)\n        break\nprint('calls done', i, flush=True)\nline = 'x' * 65536\nwhile True:\n    print(line, flush=True)\n```";
    let tasks: Vec<String> = (0..3).map(|i| format!("tools: flood {i}")).collect();
    let server = ScriptedOpenAi::start(script([
        (tasks[0].as_str(), vec![Reply::from(flood)]),
        (tasks[1].as_str(), vec![Reply::from(flood)]),
        (tasks[2].as_str(), vec![Reply::from(flood)]),
    ]))
    .await
    .unwrap();
    let mut d = daemon_with(&server, &["--grace", "2"], "").await;
    let ids: Vec<String> = futures::future::join_all(tasks.iter().map(|t| {
        d.submit(
            json!({"task": t, "tools": ["wc"], "executor": "docker", "block_timeout_secs": 600}),
        )
    }))
    .await;
    // Every block is through its calls and printing.
    let started = Instant::now();
    for id in &ids {
        loop {
            let events = d.events(id, 0).await;
            let printed: String = block_output(&events).concat();
            if printed.contains("calls done") {
                break;
            }
            assert!(
                // Generous: three Docker blocks pushing 4 MiB calls share two cores with
                // the rest of the suite.
                started.elapsed() < Duration::from_secs(900),
                "{id} never finished its calls"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap();
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    let stopping = Instant::now();
    assert_eq!(d.terminate().await, Some(0), "{}", d.log());
    let took = stopping.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "SIGTERM took {took:?}:\n{}",
        d.log()
    );
    eprintln!("flood: the daemon peaked at {peak_kib} KiB; SIGTERM took {took:?}");
    assert!(peak_kib < 768 << 10, "the daemon peaked at {peak_kib} KiB");
    // Each block made as many calls as the per-block cap let it, and they were stored cut.
    d.spawn().await;
    for id in &ids {
        let events = d.events(id, 0).await;
        let calls = events
            .iter()
            .filter(|e| matches!(e.msg, EventMsg::ToolCall { .. }))
            .count();
        let printed: String = block_output(&events).into_iter().take(3).collect();
        assert_eq!(calls, 101, "{id}: 100 run and one refusal: {printed:.2000}");
        let t = d.task(id).await;
        assert_eq!(t.record.state, TaskState::Interrupted, "{t:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn deny_rules_judge_a_command_tools_program_and_each_calls_arguments() {
    let task = "tools: deny rules judge commands";
    // A program with nothing denied in it, which writes the file its arguments name.
    let write = json!({
        "name": "write",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        "command": ["python3", "-c", "import json, sys; open(json.load(sys.stdin)['path'], 'w').write('x')"]
    });
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Calls(
                String::new(),
                vec![
                    call("w1", "write", r#"{"path": "pwned.txt"}"#),
                    // The denied text behind a JSON escape is the same text to the program.
                    call("w2", "write", r#"{"path": "pw\u006eed-escaped.txt"}"#),
                    call("w3", "write", r#"{"path": "fine.txt"}"#),
                ],
            ),
            Reply::from("Written. TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let deny = "\n[approval]\nmode = \"never\"\n[[approval.deny]]\nname = \"pwned file\"\npattern = \"pwned\"\n";
    let d = daemon_with(&server, &[], deny).await;

    // A command whose own program holds the denied text is refused at submit, naming the rule
    // and the tool: on the API, for a team's agent, and over MCP.
    let marker = json!({"name": "mark", "command": ["sh", "-c", "touch pwned"]});
    let refused = |spec: Value| {
        let d = &d;
        async move {
            let (status, body) = d
                .send(reqwest::Method::POST, "/v1/tasks", Some(spec.to_string()))
                .await;
            (
                status,
                body["error"]["message"].as_str().unwrap_or("").to_owned(),
            )
        }
    };
    let (status, message) = refused(json!({"task": task, "tools": [marker]})).await;
    assert_eq!(status, 400, "{message}");
    assert!(
        message.starts_with("tools: tool `mark`: ") && message.contains("deny rule `pwned file`"),
        "{message}"
    );
    let team = json!({
        "team": {"kind": "chat", "agents": ["coder", "runner"], "termination": {"max_turns": 2}},
        "agents": {
            "coder": {"instructions": "coder", "tools": [marker]},
            "runner": {"kind": "executor"}
        }
    });
    let (status, message) = refused(json!({"task": task, "team": team})).await;
    assert_eq!(status, 400, "{message}");
    assert!(
        message.contains("coder.tools") && message.contains("deny rule `pwned file`"),
        "{message}"
    );
    let mcp = tandem_tests::McpHttp::connect(&d).await.unwrap();
    let result = mcp
        .call_tool("run_task", json!({"task": task, "tools": [marker]}))
        .await;
    let text = result.to_string();
    assert!(
        text.contains("tool `mark`") && text.contains("deny rule `pwned file`"),
        "{text}"
    );
    assert!(server.requests_for(task).is_empty(), "a refused task ran");

    // A program the rules allow is taken; each call is judged with its arguments before it
    // runs: the two that would write the denied name are declined, the model told, and the
    // file is never written; the third runs.
    let id = d.submit(json!({"task": task, "tools": [write]})).await;
    let done = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(
        done.record.stop_reason,
        Some(StopReason::Terminated),
        "{done:?}"
    );
    let events = d.events(&id, 0).await;
    let results: Vec<(&str, bool, &str)> = events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::ToolResult {
                id,
                is_error,
                result,
                ..
            } => Some((id.as_str(), *is_error, result.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 3, "{results:?}");
    for (id, is_error, result) in &results[..2] {
        assert!(
            *is_error && result.contains("deny rule `pwned file`"),
            "{id}: {result}"
        );
    }
    assert_eq!((results[2].0, results[2].1), ("w3", false), "{results:?}");
    let by_rule = events
        .iter()
        .filter(|e| {
            matches!(&e.msg, EventMsg::ApprovalDecided { by, rule: Some(rule), .. }
                if by == "rule" && rule == "pwned file")
        })
        .count();
    assert_eq!(by_rule, 2);
    let told = &server.requests_for(task)[1].body["messages"];
    let answers: Vec<&str> = told
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert!(
        answers.len() == 3
            && answers[..2]
                .iter()
                .all(|a| a.starts_with("error: not run:")),
        "{answers:?}"
    );
    // From outside: the workspace holds what the allowed call wrote and nothing denied.
    let files = d.get(&format!("/v1/tasks/{id}/files")).await;
    let paths: Vec<&str> = files["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert!(paths.contains(&"fine.txt"), "{files}");
    assert!(!paths.iter().any(|p| p.contains("pwned")), "{files}");
}

#[tokio::test(flavor = "multi_thread")]
async fn tandem_run_refuses_a_team_file_tool_whose_command_a_deny_rule_names() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        "[approval]\nmode = \"never\"\n[[approval.deny]]\nname = \"pwned file\"\npattern = \"pwned\"\n",
    )
    .unwrap();
    let team = dir.path().join("team.toml");
    std::fs::write(
        &team,
        r#"[team]
kind = "chat"
agents = ["coder", "runner"]
termination = { max_turns = 2 }

[agents.coder]
kind = "assistant"
instructions = "coder"
tools = [{ name = "mark", command = ["sh", "-c", "touch pwned"] }]

[agents.runner]
kind = "executor"
"#,
    )
    .unwrap();
    let task = "tools: deny in process";
    let server = ScriptedOpenAi::start(script([(task, vec![Reply::from("TERMINATE")])]))
        .await
        .unwrap();
    let url = server.base_url();
    let out = tandem(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--base-url",
            &url,
            "--team",
            team.to_str().unwrap(),
            task,
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("tool `mark`") && out.stderr.contains("deny rule `pwned file`"),
        "{}",
        out.stderr
    );
    assert!(server.requests_for(task).is_empty(), "a refused task ran");
}
