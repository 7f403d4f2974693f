//! `tandem eval`: a suite's tasks decided by their checks, in process and on the daemon, and
//! the repository's own suite held to checks that cannot pass by accident.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tandem_tests::{Reply, Script, ScriptedOpenAi};

use crate::e2e::{fence, settings, tandem};

/// A suite of five tasks, one of each outcome, and the model's script for it.
fn suite(dir: &Path) -> (std::path::PathBuf, Script) {
    std::fs::write(dir.join("data.csv"), "a\nb\nc\n").unwrap();
    let tasks = [
        serde_json::json!({"id": "answer-in-words", "task": "What is six times seven?",
            "check": {"expect": "42"}}),
        serde_json::json!({"id": "file-made", "task": "Write hello to out.txt",
            "check": {"file": "out.txt", "contents": "hello",
                      "program": "assert open('out.txt').read().strip() == 'hello'"}}),
        serde_json::json!({"id": "given-file", "task": "Count the lines of data.csv",
            "files": ["data.csv"],
            "check": {"expect": "3", "program": "assert open('data.csv').read() == 'a\\nb\\nc\\n'"}}),
        serde_json::json!({"id": "gave-up", "task": "Find the secret number",
            "check": {"expect": "check-secret-7731"}}),
        serde_json::json!({"id": "broken-check", "task": "Do nothing",
            "check": {"program": "assert undefined_name == 1"}}),
    ];
    let path = dir.join("suite.jsonl");
    let lines: Vec<String> = tasks.iter().map(Value::to_string).collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    let script: Script = [
        (
            "What is six times seven?",
            // No termination word: an answer in words after a clean run ends the task.
            vec![
                Reply::Text(fence("python", "print(6 * 7)")),
                Reply::from("The answer is 42."),
            ],
        ),
        (
            "Write hello to out.txt",
            vec![
                Reply::Text(fence("sh", "echo hello > out.txt")),
                Reply::from("Done.\n\nTERMINATE"),
            ],
        ),
        (
            // The task the model reads has the listing of its files after it; `*` scripts
            // every task not named here.
            "*",
            vec![
                Reply::Text(fence("python", "print(len(open('data.csv').readlines()))")),
                Reply::from("It has 3 lines. TERMINATE"),
            ],
        ),
        (
            "Find the secret number",
            vec![Reply::from("I cannot. TERMINATE")],
        ),
        ("Do nothing", vec![Reply::from("TERMINATE")]),
    ]
    .into_iter()
    .map(|(task, replies)| (task.to_owned(), replies))
    .collect();
    (path, script)
}

/// The task lines and the totals line of `tandem eval --json`.
fn lines(stdout: &str) -> (Vec<Value>, Value) {
    let all: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let (totals, tasks): (Vec<Value>, Vec<Value>) =
        all.into_iter().partition(|v| v.get("totals").is_some());
    assert_eq!(totals.len(), 1, "{stdout}");
    (tasks, totals[0]["totals"].clone())
}

fn verdicts(tasks: &[Value]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = tasks
        .iter()
        .map(|t| {
            (
                t["id"].as_str().unwrap().to_owned(),
                t["verdict"].as_str().unwrap_or("none").to_owned(),
            )
        })
        .collect();
    v.sort();
    v
}

fn expected() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = [
        ("answer-in-words", "solved"),
        ("broken-check", "error"),
        ("file-made", "solved"),
        ("gave-up", "unsolved"),
        ("given-file", "solved"),
    ]
    .iter()
    .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
    .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn each_task_is_decided_by_its_check_in_process_and_on_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let (path, script) = suite(dir.path());
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let url = server.base_url();
    let path = path.to_str().unwrap();
    let model = ["--base-url", &url, "--model", "scripted-model"];

    let mut args = vec!["eval", path, "--json", "--local", "--parallel", "3"];
    args.extend(model);
    let out = tandem(&args, &[("TANDEM_MAX_RETRIES", "0")], None).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let (tasks, totals) = lines(&out.stdout);
    assert_eq!(verdicts(&tasks), expected(), "{}", out.stdout);
    let broken = tasks.iter().find(|t| t["id"] == "broken-check").unwrap();
    let detail = broken["detail"].as_str().unwrap();
    assert!(detail.contains("NameError"), "{detail}");
    let words = tasks.iter().find(|t| t["id"] == "answer-in-words").unwrap();
    assert_eq!(words["turns"], 2, "{words}");
    assert_eq!(words["stop_reason"], "answered", "{words}");
    assert_eq!(
        (
            totals["judged"].as_u64(),
            totals["solved"].as_u64(),
            totals["check_errors"].as_u64()
        ),
        (Some(4), Some(3), Some(1)),
        "{totals}"
    );
    // The model never reads a check.
    for r in server.requests() {
        let body = r.body.to_string();
        assert!(!body.contains("check-secret-7731"), "{body}");
        assert!(!body.contains("undefined_name"), "{body}");
    }

    // The same suite on a daemon: the same verdicts, each in its task's record with the
    // final answer.
    let d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &url,
        &[],
        None,
    )
    .await;
    let mut args = vec!["eval", path, "--json"];
    args.extend(model);
    let (code, stdout, stderr) = d.cli(&args).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("on the daemon"), "{stderr}");
    let (tasks, _) = lines(&stdout);
    assert_eq!(verdicts(&tasks), expected(), "{stdout}");
    let list = d.get("/v1/tasks").await;
    let records = list["tasks"].as_array().unwrap();
    let words = records
        .iter()
        .find(|t| t["spec"]["task"] == "What is six times seven?")
        .unwrap();
    assert_eq!(words["check"]["verdict"], "solved", "{words}");
    assert_eq!(words["result"], "The answer is 42.", "{words}");
    let gave_up = records
        .iter()
        .find(|t| t["spec"]["task"] == "Find the secret number")
        .unwrap();
    assert_eq!(gave_up["check"]["verdict"], "unsolved", "{gave_up}");
    assert_eq!(gave_up["result"], "I cannot.", "{gave_up}");

    // A check that cannot decide, or one on a team's task, is refused before anything runs.
    for (body, says) in [
        (
            serde_json::json!({"task": "x", "check": {"expect": "2", "contents": "1"}}),
            "check.contents: needs check.file",
        ),
        (
            serde_json::json!({"task": "x", "check": {}}),
            "check: give at least one of expect, value, file or program",
        ),
        (
            serde_json::json!({"task": "x", "check": {"expect": "1"}, "team": {
                "team": {"kind": "chat", "agents": ["a", "e"], "termination": {"max_turns": 4}},
                "agents": {"a": {"kind": "assistant"}, "e": {"kind": "executor"}}}}),
            "a team's task cannot have one",
        ),
        (
            serde_json::json!({"task": "x", "check": {"expect": "1", "nope": 2}}),
            "nope",
        ),
        (
            serde_json::json!({"task": "x", "approval": {"mode": "always"},
                "check": {"program": "assert True"}}),
            "blocks wait for approval",
        ),
    ] {
        let (status, answer) = d
            .send(reqwest::Method::POST, "/v1/tasks", Some(body.to_string()))
            .await;
        assert_eq!(status, 400, "{answer}");
        assert!(answer.to_string().contains(says), "{answer}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn people_read_a_table_and_two_runs_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let (path, script) = suite(dir.path());
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let url = server.base_url();
    let path = path.to_str().unwrap();
    let out = tandem(
        &[
            "eval",
            path,
            "--local",
            "--parallel",
            "1",
            "--base-url",
            &url,
            "--model",
            "m",
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut s = settings();
    s.add_filter(r" +\d+/\d+ +\d+\.\d  ", "  [tokens] [seconds]  ");
    s.add_filter(r"\d+\.\d s", "[N] s");
    s.add_filter(r"\d+ in / \d+ out", "[N] in / [N] out");
    s.bind(|| insta::assert_snapshot!("eval_table", out.stdout));

    // Two saved runs: what changed, task by task.
    let run = |verdicts: [&str; 2]| {
        let [a, b] = verdicts;
        format!(
            "{}\n{}\n",
            serde_json::json!({"id": "x", "verdict": a, "stop_reason": "terminated", "turns": 1,
                "input_tokens": 10, "output_tokens": 2, "seconds": 1.0}),
            serde_json::json!({"id": "y", "verdict": b, "stop_reason": "max_turns", "turns": 6,
                "input_tokens": 60, "output_tokens": 12, "seconds": 9.0}),
        )
    };
    std::fs::write(dir.path().join("a.json"), run(["solved", "unsolved"])).unwrap();
    std::fs::write(dir.path().join("b.json"), run(["unsolved", "solved"])).unwrap();
    let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
    let out = tandem(
        &[
            "eval",
            "--compare",
            a.to_str().unwrap(),
            b.to_str().unwrap(),
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut s = settings();
    s.add_filter(r"\(/[^)]*/(a|b)\.json\)", "($1.json)");
    s.bind(|| insta::assert_snapshot!("eval_compare", out.stdout));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_suite_is_named_by_line_and_an_interrupted_run_keeps_what_finished() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"id\": \"a\", \"task\": \"x\", \"check\": {\"expect\": \"1\"}}\n{\"id\": \"b\", \"task\": \n",
    )
    .unwrap();
    let out = tandem(&["eval", bad.to_str().unwrap(), "--local"], &[], None).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("bad.jsonl line 2: not a suite task"),
        "{}",
        out.stderr
    );

    // The second task never ends; Ctrl-C leaves the first one's line and the totals.
    let suite = dir.path().join("slow.jsonl");
    std::fs::write(
        &suite,
        "{\"id\": \"quick\", \"task\": \"quick\", \"check\": {\"expect\": \"7\"}}\n{\"id\": \"slow\", \"task\": \"slow\", \"check\": {\"expect\": \"7\"}}\n",
    )
    .unwrap();
    let script: Script = [
        ("quick".to_owned(), vec![Reply::from("7. TERMINATE")]),
        (
            "slow".to_owned(),
            vec![Reply::Delayed(
                Duration::from_secs(600),
                Box::new(Reply::from("TERMINATE")),
            )],
        ),
    ]
    .into_iter()
    .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let url = server.base_url();
    let config = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "eval",
            suite.to_str().unwrap(),
            "--json",
            "--local",
            "--parallel",
            "1",
            "--base-url",
            &url,
            "--model",
            "m",
        ])
        .env("XDG_CONFIG_HOME", config.path())
        .env("TANDEM_MODELS_DIR", config.path().join("none"))
        .env("TANDEM_EXECUTOR", "local")
        .env("TANDEM_HOST", "unix:///nonexistent/tandem.sock")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut reader = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let first = tokio::time::timeout(Duration::from_secs(60), reader.next_line())
        .await
        .expect("no task ended within 60 s")
        .unwrap()
        .unwrap();
    assert!(first.contains("\"quick\""), "{first}");
    // The slow task is asking the model now.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !server.requests().iter().any(|r| r.task() == Some("slow")) {
        assert!(
            std::time::Instant::now() < deadline,
            "the slow task never asked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap()),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let mut rest = Vec::new();
    while let Some(line) = tokio::time::timeout(Duration::from_secs(60), reader.next_line())
        .await
        .expect("eval did not end within 60 s of Ctrl-C")
        .unwrap()
    {
        rest.push(line);
    }
    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), Some(130));
    let totals = rest.last().expect("no totals line");
    assert!(totals.contains("\"solved\":1"), "{rest:?}");
    assert!(
        !rest
            .iter()
            .any(|l| l.contains("\"slow\"") && l.contains("\"solved\"")),
        "{rest:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn no_check_of_the_repositorys_suite_passes_by_accident_or_crashes() {
    // A model that does nothing: every task ends at once, so every check judges a workspace
    // holding only the task's own files and an empty answer.
    let script: Script = [("*".to_owned(), vec![Reply::from("TERMINATE")])]
        .into_iter()
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let url = server.base_url();
    for (name, least) in [("suite.toml", 60), ("values.toml", 120)] {
        let suite = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../evals")
            .join(name);
        let out = tandem(
            &[
                "eval",
                suite.to_str().unwrap(),
                "--json",
                "--local",
                "--parallel",
                "2",
                "-e",
                "local",
                "--base-url",
                &url,
                "--model",
                "m",
            ],
            &[],
            None,
        )
        .await;
        assert_eq!(out.code, 0, "{name}: {}", out.stderr);
        let (tasks, totals) = lines(&out.stdout);
        assert!(tasks.len() >= least, "{name}: only {} tasks", tasks.len());
        let wrong: Vec<&Value> = tasks
            .iter()
            .filter(|t| t["verdict"] != "unsolved")
            .collect();
        assert!(
            wrong.is_empty(),
            "{name}: checks that did not say unsolved: {wrong:#?}"
        );
        assert_eq!(totals["solved"], 0, "{name}: {totals}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_whose_code_fails_the_examples_draws_and_the_examples_choose_on_every_road() {
    use tandem_protocol::StopReason;
    let task = "Write a Python function `double(x)`.\n\n>>> double(2)\n4\n";
    let wrong = "```python\ndef double(x):\n    return x + 3\n```\nTERMINATE";
    let right = "```python\ndef double(x):\n    return 2 * x\n```\nTERMINATE";
    // The model's first reply fails the example before it runs, so one more is drawn, from
    // seed 1001: right, and kept.
    let server = ScriptedOpenAi::start(
        [
            (
                task.to_owned(),
                vec![Reply::from(wrong), Reply::from("not asked")],
            ),
            (format!("{task}~1001"), vec![Reply::from(right)]),
        ]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let holds = "The task's examples hold against your code: 1 of 1.";

    // The CLI in process: the streamed reply, why another is run, and the one run.
    let out = tandem(
        &[
            "run",
            "--local",
            "-e",
            "local",
            "--candidates",
            "2",
            "--base-url",
            &server.base_url(),
            "--model",
            "m",
            task,
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    settings().bind(|| insta::assert_snapshot!("run_replies_drawn", out.stdout));
    assert_eq!(
        server.requests_for(task).len(),
        2,
        "its own, then one drawn"
    );

    let d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some("[policy]\nmax_candidates = 2\n"),
    )
    .await;
    // The daemon's API: the draws, and counts it cannot take named.
    let id = d
        .submit(serde_json::json!({"task": task, "executor": "local", "candidates": 2}))
        .await;
    let t = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    assert_eq!((t.record.turns, t.record.spec.candidates), (1, Some(2)));
    assert_eq!(t.transcript[2].content, right);
    assert!(t.transcript[3].content.ends_with(holds), "{t:?}");
    let events = d.events(&id, 0).await;
    assert!(
        events.iter().any(|e| matches!(
            e.msg,
            tandem_protocol::EventMsg::RepliesDrawn {
                turn: 1,
                drawn: 1,
                chosen: 1,
                held: 1,
                examples: 1
            }
        )),
        "{events:?}"
    );
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(serde_json::json!({"task": task, "candidates": 3}).to_string()),
        )
        .await;
    assert_eq!(
        (
            status,
            body["error"]["message"].as_str().unwrap_or_default()
        ),
        (
            400,
            "candidates 3 is above this daemon's cap of 2; ask for less, or raise max_candidates under [policy] in the daemon's config"
        )
    );
    for k in [0, 9] {
        let (status, body) = d
            .send(
                reqwest::Method::POST,
                "/v1/tasks",
                Some(serde_json::json!({"task": task, "candidates": k}).to_string()),
            )
            .await;
        assert_eq!(
            (status, body["error"]["message"].as_str().unwrap_or_default()),
            (
                400,
                format!("candidates: {k} is not from 1 to 8: a turn draws at least its one reply and at most 8").as_str()
            )
        );
    }
    // MCP's run_task, naming no count: the default, 4, within the daemon's cap of 2.
    let mcp = tandem_tests::McpHttp::connect(&d).await.unwrap();
    let result = mcp
        .call_tool(
            "run_task",
            serde_json::json!({"task": task, "executor": "local"}),
        )
        .await;
    assert_eq!(result["isError"], false, "{result}");
    assert_eq!(
        result["structuredContent"]["stop_reason"], "terminated",
        "{result}"
    );
    assert_eq!(d.count("finished").await, 2);
    assert_eq!(
        server.requests_for(task).len(),
        6,
        "two a task, on each road"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_resumed_after_a_restart_does_not_draw_again() {
    use tandem_protocol::{EventMsg, StopReason};
    let task = "Write a Python function `triple(x)`.\n\n>>> triple(2)\n6\n";
    let wrong = "```python\ndef triple(x):\n    return x + 3\n```";
    let worse = "```python\ndef triple(x):\n    return 0\n```";
    // Turn 1 draws one reply, holding no more than the model's own, which is kept and fails;
    // turn 2's reply is still out when the daemon is killed.
    let server = ScriptedOpenAi::start(
        [
            (
                task.to_owned(),
                vec![
                    Reply::from(wrong),
                    Reply::Delayed(Duration::from_secs(600), Box::new(Reply::from(wrong))),
                ],
            ),
            (format!("{task}~1001"), vec![Reply::from(worse)]),
        ]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let mut d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
    )
    .await;
    let id = d
        .submit(serde_json::json!({"task": task, "executor": "local", "candidates": 2}))
        .await;
    let asked = std::time::Instant::now();
    while server.requests_for(task).len() < 3 {
        assert!(
            asked.elapsed() < Duration::from_secs(120),
            "turn 2 was never asked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    d.kill9();
    // After the restart, turn 2 is asked again and fails the example (with other code than
    // turn 1's: the same again would end the task as `repeated`); turn 3 ends.
    let other = "```python\ndef triple(x):\n    return x * 2\n```";
    server.set(
        task,
        vec![
            Reply::from(wrong),
            Reply::from(other),
            Reply::from("TERMINATE"),
        ],
    );
    d.spawn().await;
    d.resume_after_restart(&id).await;
    let t = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let seeds: Vec<u64> = server
        .requests_for(task)
        .iter()
        .filter_map(|r| r.body["seed"].as_u64())
        .collect();
    assert_eq!(seeds, [1001], "a task draws once, across its runs");
    let events = d.events(&id, 0).await;
    let drawn = events
        .iter()
        .filter(|e| matches!(e.msg, EventMsg::RepliesDrawn { .. }))
        .count();
    assert_eq!(drawn, 1, "{events:?}");
}

/// A suite of tasks, each a block the model runs (Python writing files) and the check that
/// judges what it left, with the model's script for it; tasks are named `forge: ID`.
fn forge_suite(dir: &Path, tasks: &[(&str, &str, &str)], executor: &str) -> (String, Script) {
    let lines: Vec<String> = tasks
        .iter()
        .map(|(id, _, check)| {
            serde_json::json!({"id": id, "task": format!("forge: {id}"), "executor": executor,
                "check": {"program": check}})
            .to_string()
        })
        .collect();
    let path = dir.join("forge.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    let script: Script = tasks
        .iter()
        .map(|(id, block, _)| {
            (
                format!("forge: {id}"),
                vec![
                    Reply::Text(fence("python", block)),
                    Reply::from("Done.\n\nTERMINATE"),
                ],
            )
        })
        .collect();
    (path.to_str().unwrap().to_owned(), script)
}

/// `tandem eval --json` of `suite` in process, its verdicts by task id, sorted.
async fn eval_verdicts(suite: &str, url: &str, extra: &[&str]) -> (Vec<(String, String)>, String) {
    let mut args = vec!["eval", suite, "--json", "--local", "--parallel", "3"];
    args.extend(extra);
    args.extend(["--base-url", url, "--model", "m"]);
    let out = tandem(&args, &[("TANDEM_MAX_RETRIES", "0")], None).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let (tasks, _) = lines(&out.stdout);
    (verdicts(&tasks), out.stdout)
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = pairs
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect();
    v.sort();
    v
}

/// Code the task left cannot pass a check it fails: not a module named like one the check's
/// frame imports (traceback.py), nor like one the check imports from the standard library,
/// nor a solution module that ends the process with exit 0 as it is imported or as the check
/// calls it. Checks that hold, by finishing or by their own `sys.exit(0)`, still pass.
#[tokio::test(flavor = "multi_thread")]
async fn code_the_task_left_cannot_pass_a_check_that_does_not_hold() {
    let exits = r#"import os\nos._exit(0)\n"#;
    let write = |file: &str, body: &str| format!("open({file:?}, 'w').write(\"{body}\")");
    let good = write("good.py", r#"def f():\n    return 1\n"#);
    let tasks = [
        (
            "shadows-the-frame",
            write("traceback.py", exits),
            "assert False, 'never holds'",
        ),
        (
            "shadows-the-stdlib",
            write("fractions.py", exits),
            "import fractions\nassert fractions.Fraction(1, 2) == 1",
        ),
        (
            "exits-at-import",
            write("solution.py", &format!("{exits}def f():\\n    return 1\\n")),
            "import solution\nassert solution.f() == 2",
        ),
        (
            "exits-when-called",
            write("quitter.py", r#"def f():\n    raise SystemExit(0)\n"#),
            "from quitter import f\nassert f() == 1",
        ),
        ("holds", good.clone(), "import good\nassert good.f() == 1"),
        (
            "holds-by-its-exit",
            good.clone(),
            "import sys, good\nsys.exit(0 if good.f() == 1 else 1)",
        ),
        (
            "fails-by-its-exit",
            good.clone(),
            "import sys, good\nsys.exit(0 if good.f() == 2 else 1)",
        ),
    ];
    let tasks: Vec<(&str, &str, &str)> = tasks
        .iter()
        .map(|(id, block, check)| (*id, block.as_str(), *check))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let (suite, script) = forge_suite(dir.path(), &tasks, "local");
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let (got, stdout) = eval_verdicts(&suite, &server.base_url(), &[]).await;
    assert_eq!(
        got,
        owned(&[
            ("shadows-the-frame", "unsolved"),
            ("shadows-the-stdlib", "unsolved"),
            ("exits-at-import", "unsolved"),
            ("exits-when-called", "unsolved"),
            ("holds", "solved"),
            ("holds-by-its-exit", "solved"),
            ("fails-by-its-exit", "unsolved"),
        ]),
        "{stdout}"
    );
    let (tasks, _) = lines(&stdout);
    let detail = |id: &str| {
        tasks.iter().find(|t| t["id"] == id).unwrap()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        detail("exits-at-import").contains("ended before the check ran to its end"),
        "{stdout}"
    );
    assert!(
        detail("exits-when-called").contains("SystemExit"),
        "{stdout}"
    );
    assert!(
        detail("shadows-the-frame").contains("never holds"),
        "{stdout}"
    );
    // The verdict line the frame writes is Tandem's, not part of what the check said.
    assert!(!stdout.contains("tandem-check"), "{stdout}");
}

/// A check runs in a fresh interpreter, never in the one a kept-state task's blocks shared:
/// a block that swapped the builtin `exec` there cannot skip the check's code.
#[tokio::test(flavor = "multi_thread")]
async fn a_kept_interpreter_the_task_changed_does_not_run_its_check() {
    use tandem_protocol::Verdict;
    let task = "forge: kept";
    let block = "import builtins\n_run = builtins.exec\ndef skip(code, *a, **k):\n    if getattr(code, 'co_filename', '') == '<check>':\n        return None\n    return _run(code, *a, **k)\nbuiltins.exec = skip\nprint('swapped')";
    let server = ScriptedOpenAi::start(
        [(
            task.to_owned(),
            vec![
                Reply::Text(fence("python", block)),
                Reply::from("Done.\n\nTERMINATE"),
            ],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
    )
    .await;
    let id = d
        .submit(
            serde_json::json!({"task": task, "executor": "local", "keep_state": true,
            "check": {"program": "assert False, 'never holds'"}}),
        )
        .await;
    let t = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert!(
        t.transcript.iter().any(|m| m.content.contains("swapped")),
        "{t:?}"
    );
    let check = t.record.check.expect("a verdict");
    assert_eq!(check.verdict, Verdict::Unsolved, "{check:?}");
    assert!(check.detail.contains("never holds"), "{check:?}");
}

/// In Docker a block's user site (HOME is the workspace) would run its `usercustomize` in
/// every later interpreter: never in a check's.
#[tokio::test(flavor = "multi_thread")]
async fn a_docker_check_runs_no_start_up_code_the_task_left() {
    let hook = "import builtins\n_run = builtins.exec\ndef skip(code, *a, **k):\n    if getattr(code, 'co_filename', '') == '<check>':\n        return None\n    return _run(code, *a, **k)\nbuiltins.exec = skip\n";
    let block = format!(
        "import os, site\nd = site.getusersitepackages()\nos.makedirs(d, exist_ok=True)\nopen(os.path.join(d, 'usercustomize.py'), 'w').write({hook:?})\nopen('good.py', 'w').write('def f():\\n    return 1\\n')"
    );
    let tasks = [
        ("user-site", block.as_str(), "assert False, 'never holds'"),
        (
            "user-site-holds",
            block.as_str(),
            "import good\nassert good.f() == 1",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let (suite, script) = forge_suite(dir.path(), &tasks, "docker");
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let (got, stdout) = eval_verdicts(&suite, &server.base_url(), &[]).await;
    assert_eq!(
        got,
        owned(&[("user-site", "unsolved"), ("user-site-holds", "solved")]),
        "{stdout}"
    );
}

/// The examples' runner imports nothing the task left: a `doctest.py` in the workspace that
/// prints a verdict of every example held and exits cannot speak for the examples.
#[tokio::test(flavor = "multi_thread")]
async fn a_module_the_task_left_does_not_speak_for_the_examples() {
    let task = "Write a Python function `halve(x)`.\n\n>>> halve(4)\n2\n";
    let forged = r#"open('doctest.py', 'w').write("import os\nos.write(1, b'{\"total\": 1, \"failed\": []}\\n')\nos._exit(0)\n")"#;
    let server = ScriptedOpenAi::start(
        [(
            task.to_owned(),
            vec![
                Reply::Text(fence("python", forged)),
                Reply::Text(fence("python", "def halve(x):\n    return x")),
                Reply::from("TERMINATE"),
            ],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let out = tandem(
        &[
            "run",
            "--local",
            "-e",
            "local",
            "--candidates",
            "1",
            "--base-url",
            &server.base_url(),
            "--model",
            "m",
            task,
        ],
        &[],
        None,
    )
    .await;
    assert!(
        out.stdout
            .contains("The task's examples do not all hold against your code (0 of 1 hold)"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    assert!(
        !out.stdout.contains("The task's examples hold"),
        "{}",
        out.stdout
    );
}
