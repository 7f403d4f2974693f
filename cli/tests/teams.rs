//! Team files through the real binary: the examples check, a bad file names every problem.

use crate::e2e::tandem;

fn example(name: &str) -> String {
    format!(
        "{}/../examples/teams/{name}.toml",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_example_teams_check_and_print_their_tree() {
    let mut trees = String::new();
    for name in ["review", "refine", "nested"] {
        let out = tandem(&["team", "check", &example(name)], &[], None).await;
        assert_eq!(out.code, 0, "{name}: {}", out.stderr);
        trees.push_str(&format!("# {name}\n{}", out.stdout));
    }
    insta::with_settings!({prepend_module_to_snapshot => false}, {
        insta::assert_snapshot!("team_check_examples", trees);
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_team_file_names_each_problem_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        "[team]\nkind = \"chat\"\nagents = [\"coder\", \"ghost\"]\ninitial = \"nobody\"\n\n[agents.coder]\nkind = \"assistant\"\nescalate = \"STOP\"\nmax_iterations = 3\n\n[agents.lonely]\nkind = \"assistant\"\n",
    )
    .unwrap();
    let path = file.display().to_string();
    let out = tandem(&["team", "check", &path], &[], None).await;
    assert_eq!(out.code, 2);
    assert_eq!(out.stdout, "");
    let stderr = out.stderr.replace(&path, "bad.toml");
    insta::with_settings!({prepend_module_to_snapshot => false}, {
        insta::assert_snapshot!("team_check_bad_file", stderr);
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn every_team_in_the_docs_checks() {
    let doc = std::fs::read_to_string(format!("{}/../docs/teams.md", env!("CARGO_MANIFEST_DIR")))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let blocks: Vec<_> = tandem_agent::extract_code_blocks(&doc)
        .into_iter()
        .filter(|b| b.language.as_deref() == Some("toml"))
        .collect();
    assert!(blocks.len() >= 4, "{} team examples", blocks.len());
    for (i, block) in blocks.iter().enumerate() {
        let file = dir.path().join(format!("{i}.toml"));
        std::fs::write(&file, &block.code).unwrap();
        let out = tandem(&["team", "check", &file.display().to_string()], &[], None).await;
        assert_eq!(
            out.code, 0,
            "docs/teams.md example {i}:\n{}\n{}",
            block.code, out.stderr
        );
    }
}

use std::time::{Duration, Instant};

use tandem_protocol::{Event, EventMsg, StopReason};
use tandem_tests::{Reply, Script, ScriptedOpenAi};

/// The requests of `task` made for the agent whose instructions are `agent`.
fn asked(server: &ScriptedOpenAi, task: &str, agent: &str) -> Vec<tandem_tests::Recorded> {
    server
        .requests_for(task)
        .into_iter()
        .filter(|r| r.body["messages"][0]["content"] == agent)
        .collect()
}

/// Writes `toml` as a team file in `dir`.
fn team_file(dir: &tempfile::TempDir, toml: &str) -> String {
    let path = dir.path().join("team.toml");
    std::fs::write(&path, toml).unwrap();
    path.display().to_string()
}

/// A scripted server whose agents of `task` say their replies ([`per_agent`]).
async fn scripted(task: &str, agents: Vec<(&str, Vec<Reply>)>) -> ScriptedOpenAi {
    ScriptedOpenAi::start(per_agent(task, agents))
        .await
        .unwrap()
}

/// The events of a `--json` run's output (lines that are not JSON are passed over).
fn events_of(out: &crate::e2e::Output) -> Vec<Event> {
    out.stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("not an Event ({e}): {v}"))
        })
        .collect()
}

/// Replies per agent of `task` (keyed by the first line of each agent's instructions).
fn per_agent(task: &str, agents: Vec<(&str, Vec<Reply>)>) -> Script {
    agents
        .into_iter()
        .map(|(agent, replies)| (format!("{task}#{agent}"), replies))
        .collect()
}

async fn run_team(
    server: &ScriptedOpenAi,
    file: &str,
    task: &str,
    json: bool,
) -> crate::e2e::Output {
    let url = server.base_url();
    let mut args = vec!["run", "--team", file, "--base-url", &url, "--model", "m"];
    if json {
        args.push("--json");
    }
    args.push(task);
    tandem(&args, &[("TANDEM_MAX_RETRIES", "0")], None).await
}

const REVIEW: &str = r#"
[team]
kind = "chat"
agents = ["coder", "runner", "reviewer"]
termination = { any = [{ mention = "APPROVED", agents = ["reviewer"] }, { max_turns = 12 }] }

[agents.coder]
kind = "assistant"
instructions = "coder"

[agents.runner]
kind = "executor"

[agents.reviewer]
kind = "assistant"
instructions = "reviewer"
"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_chat_runs_code_after_code_names_its_speakers_and_ends_on_a_mention() {
    let task = "team: review";
    let server = scripted(
        task,
        vec![
            ("coder", vec![Reply::from("```python\nprint(6 * 7)\n```")]),
            ("reviewer", vec![Reply::from("The output is 42. APPROVED")]),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = run_team(&server, &team_file(&dir, REVIEW), task, false).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // The reviewer saw the task, the coder's code and the runner's report, by name.
    let reviewer = &server.requests_for(task)[1];
    let messages = reviewer.body["messages"].as_array().unwrap();
    let seen: Vec<(String, String)> = messages
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_owned(),
                m["name"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    let pairs: Vec<(&str, &str)> = seen.iter().map(|(r, n)| (r.as_str(), n.as_str())).collect();
    assert_eq!(
        pairs,
        [
            ("system", ""),
            ("user", ""),
            ("user", "coder"),
            ("user", "runner")
        ]
    );
    assert!(messages[3]["content"].as_str().unwrap().contains("42"));
    let settings = {
        let mut s = insta::Settings::clone_current();
        s.add_filter(r"cpu \d+\.\d+ s", "cpu [N] s");
        s.add_filter(r"(peak|disk) \d+(\.\d)? [kMGT]?B", "$1 [BYTES]");
        s.add_filter(r"\d+ ms", "[N] ms");
        s.add_filter(r"\d+\.\d s", "[N] s");
        s.add_filter(r"\d+ in / \d+ out tokens", "[N] in / [N] out tokens");
        s.add_filter(r"127\.0\.0\.1:\d+", "127.0.0.1:[PORT]");
        s.add_filter(r"team /\S+/team\.toml", "team [FILE]");
        s.set_prepend_module_to_snapshot(false);
        s
    };
    settings.bind(|| insta::assert_snapshot!("team_review_transcript", out.stdout));
}

const REFINE: &str = r#"
[team]
kind = "sequence"
agents = ["refine", "summariser"]

[agents.refine]
kind = "loop"
agents = ["writer", "critic"]
max_iterations = 5

[agents.writer]
kind = "assistant"
instructions = "writer"

[agents.critic]
kind = "assistant"
instructions = "critic"
escalate = "STOP"

[agents.summariser]
kind = "assistant"
instructions = "summariser"
"#;

#[tokio::test(flavor = "multi_thread")]
async fn an_escalation_ends_only_the_innermost_loop() {
    let task = "team: refine";
    let server = scripted(
        task,
        vec![
            (
                "writer",
                vec![Reply::from("draft 1"), Reply::from("draft 2")],
            ),
            (
                "critic",
                vec![Reply::from("too short"), Reply::from("Good now. STOP")],
            ),
            ("summariser", vec![Reply::from("Final: draft 2")]),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = run_team(&server, &team_file(&dir, REFINE), task, true).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let events = events_of(&out);
    let speakers: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::TurnStarted { agent, .. } => Some(agent.clone().unwrap()),
            _ => None,
        })
        .collect();
    // The loop ended at the critic's STOP; the sequence went on to the summariser.
    assert_eq!(
        speakers,
        [
            "team/refine/writer",
            "team/refine/critic",
            "team/refine/writer",
            "team/refine/critic",
            "team/summariser"
        ]
    );
    assert!(
        out.stdout
            .contains("\"agent\":\"team/refine\",\"by\":\"critic escalated\""),
        "{}",
        out.stdout
    );
    // Every event of an agent's turn names the agent by its path.
    let said: Vec<(String, String)> = events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::AssistantMessage { text, .. } => {
                let path = e.path.as_deref().unwrap_or("none").to_owned();
                Some((path, text.clone()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        said,
        [
            ("team/refine/writer", "draft 1"),
            ("team/refine/critic", "too short"),
            ("team/refine/writer", "draft 2"),
            ("team/refine/critic", "Good now. STOP"),
            ("team/summariser", "Final: draft 2"),
        ]
        .map(|(p, t)| (p.to_owned(), t.to_owned()))
    );
    assert!(
        out.stdout.contains("\"summary\":\"Final: draft 2\""),
        "{}",
        out.stdout
    );
}

const NESTED: &str = r#"
[team]
kind = "chat"
agents = ["solve", "reviewer"]
termination = { any = [{ mention = "APPROVED", agents = ["reviewer"] }, { max_turns = 4 }] }

[agents.solve]
kind = "chat"
agents = ["coder", "executor"]
termination = { mention = "DONE", agents = ["coder"] }
aggregate = "nested"

[agents.coder]
kind = "assistant"
instructions = "coder"

[agents.executor]
kind = "executor"

[agents.reviewer]
kind = "assistant"
instructions = "reviewer"
"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_nested_chat_answers_its_team_with_its_last_message_only() {
    let task = "team: nested";
    let server = scripted(
        task,
        vec![
            (
                "coder",
                vec![
                    Reply::from("```python\nprint(2 ** 10)\n```"),
                    Reply::from("It is 1024. DONE"),
                ],
            ),
            ("reviewer", vec![Reply::from("APPROVED")]),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = run_team(&server, &team_file(&dir, NESTED), task, false).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let reviewer = asked(&server, task, "reviewer").remove(0);
    let outer: Vec<(String, String)> = reviewer.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .map(|m| {
            (
                m["name"].as_str().unwrap_or("").to_owned(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        outer,
        [
            (String::new(), task.to_owned()),
            ("solve".to_owned(), "It is 1024. DONE".to_owned())
        ]
    );
    // Nested agents are indented under their team in the transcript.
    assert!(
        out.stdout.contains("\n  ── coder · turn 1 ──\n"),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn parallel_members_run_at_once_and_a_turn_limit_stops_a_team() {
    let task = "team: parallel";
    let slow = |text: &str| Reply::Delayed(Duration::from_secs(1), Box::new(Reply::from(text)));
    let server = scripted(
        task,
        vec![
            ("a", vec![slow("from a")]),
            ("b", vec![slow("from b")]),
            ("c", vec![slow("from c")]),
            ("editor", vec![Reply::from("merged")]),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let file = team_file(
        &dir,
        "[team]\nkind = \"sequence\"\nagents = [\"reviews\", \"editor\"]\n[agents.reviews]\nkind = \"parallel\"\nagents = [\"a\", \"b\", \"c\"]\n[agents.a]\ninstructions = \"a\"\n[agents.b]\ninstructions = \"b\"\n[agents.c]\ninstructions = \"c\"\n[agents.editor]\ninstructions = \"editor\"\n",
    );
    let started = Instant::now();
    let out = run_team(&server, &file, task, false).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "three 1 s members took {:?}",
        started.elapsed()
    );
    // Their transcripts are told one after another, in member order, not interleaved.
    let at = |text: &str| out.stdout.find(text).unwrap_or(usize::MAX);
    assert!(
        at("── a · turn") < at("from a")
            && at("from a") < at("── b · turn")
            && at("── b · turn") < at("from b")
            && at("from b") < at("── c · turn")
            && at("── c · turn") < at("from c"),
        "{}",
        out.stdout
    );
    // The editor saw the three answers in member order.
    let editor = asked(&server, task, "editor").remove(0);
    let names: Vec<&str> = editor.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!(names, ["a", "b", "c"]);

    // A chat that never mentions its word stops at its max_turns, with that exit code.
    let task = "team: endless chat";
    server.set(
        &format!("{task}#a"),
        (0..10)
            .map(|i| Reply::from(format!("a{i}").as_str()))
            .collect(),
    );
    server.set(
        &format!("{task}#b"),
        (0..10)
            .map(|i| Reply::from(format!("b{i}").as_str()))
            .collect(),
    );
    let file = team_file(
        &dir,
        "[team]\nkind = \"chat\"\nagents = [\"a\", \"b\"]\ntermination = { any = [{ mention = \"NEVER\" }, { max_turns = 3 }] }\n[agents.a]\ninstructions = \"a\"\n[agents.b]\ninstructions = \"b\"\n",
    );
    let out = run_team(&server, &file, task, false).await;
    assert_eq!(out.code, 3, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("── b · turn 2 ──"), "{}", out.stdout);
    assert!(out.stdout.contains("── a · turn 3 ──"), "{}", out.stdout);
    assert!(!out.stdout.contains("turn 4"), "{}", out.stdout);
}

const SELECTOR: &str = "You choose who speaks next in a team's conversation. Answer with the name of one member and nothing else.";

const JUDGE: &str = "You judge a team's conversation. Answer yes or no.";

#[tokio::test(flavor = "multi_thread")]
async fn llm_selection_hooks_and_an_llm_judge() {
    let task = "team: selection";
    let server = scripted(
        task,
        vec![
            (
                "planner",
                vec![Reply::from("plan: the key is sk-secret-123")],
            ),
            ("checker", vec![Reply::from("checked")]),
            (SELECTOR, vec![Reply::from("checker, please")]),
            (JUDGE, vec![Reply::from("Yes, it is planned.")]),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let team = |termination: &str| {
        format!(
            r#"
[team]
kind = "chat"
agents = ["planner", "checker"]
selection = "llm"
termination = {termination}

[agents.planner]
instructions = "planner"
description = "plans"

[agents.checker]
instructions = "checker"
description = "checks the plan"
redact = ["sk-[a-z0-9-]+"]
keep_last = 1
"#
        )
    };
    let file = team_file(
        &dir,
        &team("{ max_turns = 2 }").replace(
            "selection = \"llm\"",
            "selection = { kind = \"llm\", model = \"selector-model\" }",
        ),
    );
    let out = run_team(&server, &file, task, false).await;
    assert_eq!(out.code, 3, "{}\n{}", out.stdout, out.stderr);
    // The selection's own model chose; the agents kept the task's.
    let models: Vec<(String, String)> = server
        .requests_for(task)
        .iter()
        .map(|r| {
            (
                r.body["messages"][0]["content"]
                    .as_str()
                    .unwrap()
                    .chars()
                    .take(10)
                    .collect(),
                r.body["model"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert!(
        models.contains(&("You choose".to_owned(), "selector-model".to_owned())),
        "{models:?}"
    );
    assert!(
        models.contains(&("planner".to_owned(), "m".to_owned())),
        "{models:?}"
    );
    assert!(
        out.stdout.contains("── selector · turn 1 ──"),
        "{}",
        out.stdout
    );
    // The selector named the checker; it saw the key redacted, and only the last message
    // besides the task.
    let checker = asked(&server, task, "checker")
        .into_iter()
        .next()
        .expect("the selector picked the checker");
    let contents: Vec<&str> = checker.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["checker", task, "plan: the key is [redacted]"]);

    // A model judges the chat done after the planner's message.
    let file = team_file(&dir, &team("{ llm = \"Is there a plan?\" }"));
    let out = run_team(&server, &file, task, false).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout
            .contains("── termination · turn 1 ──\nYes, it is planned."),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains("checker ·"), "{}", out.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_team_on_the_daemon_resumes_after_kill_9_where_it_was() {
    let task = "team: resume the loop";
    let server = scripted(
        task,
        vec![
            (
                "writer",
                vec![Reply::from("draft 1"), Reply::from("draft 2")],
            ),
            (
                "critic",
                vec![
                    Reply::from("again"),
                    Reply::Delayed(Duration::from_secs(3), Box::new(Reply::from("Good. STOP"))),
                ],
            ),
            ("summariser", vec![Reply::from("Final")]),
        ],
    )
    .await;
    let mut d = tandem_tests::DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
    )
    .await;
    let team = serde_json::json!({
        "team": {"kind": "sequence", "agents": ["refine", "summariser"]},
        "agents": {
            "refine": {"kind": "loop", "agents": ["writer", "critic"], "max_iterations": 3},
            "writer": {"instructions": "writer"},
            "critic": {"instructions": "critic", "escalate": "STOP"},
            "summariser": {"instructions": "summariser"}
        }
    });
    let id = d
        .submit(serde_json::json!({"task": task, "team": team}))
        .await;
    // Killed while the critic's second answer is on its way.
    let started = Instant::now();
    while asked(&server, task, "critic").len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the critic was not asked twice"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.kill9();
    d.spawn().await;
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{id}/resume"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let t = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let asked = |agent: &str| asked(&server, task, agent).len();
    // The loop went on at the critic's second turn: no draft was asked for again.
    assert_eq!(
        (asked("writer"), asked("critic"), asked("summariser")),
        (2, 3, 1)
    );
    let events = d.events(&id, 0).await;
    let last = events.last().unwrap();
    let summary = match &last.msg {
        EventMsg::TaskFinished { summary, .. } => summary.as_deref(),
        _ => None,
    };
    assert_eq!(summary, Some("Final"), "{last:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_team_over_the_api_is_a_400_naming_the_field() {
    let server = ScriptedOpenAi::start(Script::new()).await.unwrap();
    let d = tandem_tests::DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
    )
    .await;
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(
                serde_json::json!({"task": "t", "team": {"team": {"kind": "loop", "agents": ["a"]}, "agents": {"a": {"escalte": "X"}}}})
                    .to_string(),
            ),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "the body is not a valid task: team.agents.a.escalte: unknown field `escalte`"
        ),
        "{message}"
    );
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(
                serde_json::json!({"task": "t", "team": {"team": {"kind": "loop", "agents": ["a"]}, "agents": {"a": {}}}})
                    .to_string(),
            ),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        body["error"]["message"],
        "the team does not check: team: a loop needs a way to stop: max_iterations, or a member with escalate"
    );
}

/// The first line of an example agent's instructions: what the scripted server keys it by.
fn first_line(file: &str, agent: &str) -> String {
    let text = std::fs::read_to_string(example(file)).unwrap();
    let section = text
        .split(&format!("[agents.{agent}]"))
        .nth(1)
        .unwrap_or_else(|| panic!("no {agent} in {file}"));
    let start = section.find("instructions = ").unwrap() + "instructions = ".len();
    let value = section[start..]
        .trim_start_matches("\"\"\"\n")
        .trim_start_matches('"');
    value
        .lines()
        .next()
        .unwrap()
        .trim_end_matches('"')
        .to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_example_teams_run_to_their_end() {
    let key = |task: &str, file: &str, agent: &str| format!("{task}#{}", first_line(file, agent));
    let review = "example: review";
    let refine = "example: refine";
    let nested = "example: nested";
    let script: Script = [
        (
            key(review, "review", "coder"),
            vec![Reply::from("```python\nprint(sum(range(10)))\n```")],
        ),
        (
            key(review, "review", "reviewer"),
            vec![Reply::from("45 is right. APPROVED")],
        ),
        (
            format!("{review}#{SELECTOR}"),
            vec![Reply::from("reviewer")],
        ),
        (key(refine, "refine", "writer"), vec![Reply::from("draft")]),
        (
            key(refine, "refine", "critic"),
            vec![Reply::from("Good. STOP")],
        ),
        (
            key(refine, "refine", "summariser"),
            vec![Reply::from("the answer")],
        ),
        (
            key(nested, "nested", "coder"),
            vec![
                Reply::from("```python\nprint(2 + 2)\n```"),
                Reply::from("It is 4. TERMINATE"),
            ],
        ),
        (
            key(nested, "nested", "reviewer"),
            vec![Reply::from("APPROVED")],
        ),
    ]
    .into_iter()
    .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    for (task, file) in [(review, "review"), (refine, "refine"), (nested, "nested")] {
        let out = run_team(&server, &example(file), task, false).await;
        assert_eq!(out.code, 0, "{file}:\n{}\n{}", out.stdout, out.stderr);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flat_chat_shares_every_message_and_limits_stop_with_their_codes() {
    let task = "team: flat";
    let server = scripted(
        task,
        vec![
            (
                "coder",
                vec![
                    Reply::from("```python\nprint(3 * 3)\n```"),
                    Reply::from("9. DONE"),
                ],
            ),
            ("reviewer", vec![Reply::from("APPROVED")]),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let flat = NESTED.replace("aggregate = \"nested\"", "aggregate = \"flat\"");
    let out = run_team(&server, &team_file(&dir, &flat), task, false).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let reviewer = asked(&server, task, "reviewer").remove(0);
    let names: Vec<&str> = reviewer.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!(names, ["coder", "executor", "coder"]);

    // A chat stopped by its timeout exits 4; by its token budget, 3.
    let slow = "team: slow";
    server.set(
        &format!("{slow}#a"),
        vec![Reply::Delayed(
            Duration::from_millis(1200),
            Box::new(Reply::from("late")),
        )],
    );
    server.set(&format!("{slow}#b"), vec![Reply::from("b")]);
    let chat = |termination: &str| {
        format!(
            "[team]\nkind = \"chat\"\nagents = [\"a\", \"b\"]\ntermination = {termination}\n[agents.a]\ninstructions = \"a\"\n[agents.b]\ninstructions = \"b\"\n"
        )
    };
    let out = run_team(
        &server,
        &team_file(&dir, &chat("{ timeout = 1 }")),
        slow,
        false,
    )
    .await;
    assert_eq!(out.code, 4, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("── team ended: timeout 1 s ──"),
        "{}",
        out.stdout
    );
    let out = run_team(
        &server,
        &team_file(&dir, &chat("{ token_budget = 1 }")),
        slow,
        false,
    )
    .await;
    assert_eq!(out.code, 3, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("── team ended: token_budget 1 ──"),
        "{}",
        out.stdout
    );
}

const ENDS_WITH: &str = r#"
[team]
kind = "chat"
agents = ["coder", "runner"]
termination = { ends_with = "DONE", agents = ["coder"] }

[agents.coder]
instructions = "coder"

[agents.runner]
kind = "executor"
no_code_reply = "Send code, or say DONE."
"#;

#[tokio::test(flavor = "multi_thread")]
async fn ends_with_runs_the_last_code_first_and_a_fenced_word_is_said_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let file = team_file(&dir, ENDS_WITH);
    // Prose first: the runner answers with its no_code_reply; DONE mid-prose does not end
    // it; then code and DONE in one message: the code runs, then the chat ends.
    let task = "team: ends_with";
    let server = scripted(
        task,
        vec![(
            "coder",
            vec![
                Reply::from("Once DONE is said, we stop. Let me think first."),
                Reply::from("```python\nprint(6 * 7)\n```\nDONE"),
            ],
        )],
    )
    .await;
    let out = run_team(&server, &file, task, true).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let events = events_of(&out);
    let reports: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::ExecutorMessage { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(reports.len(), 2, "{}", out.stdout);
    assert_eq!(reports[0], "Send code, or say DONE.");
    assert!(reports[1].contains("42"), "{}", reports[1]);
    let ended = events
        .iter()
        .find_map(|e| match &e.msg {
            EventMsg::TeamEnded { by, .. } => Some(by.as_str()),
            _ => None,
        })
        .unwrap();
    assert_eq!(ended, "ends_with DONE by coder");
    let last = events.last().unwrap();
    let stop_reason = match &last.msg {
        EventMsg::TaskFinished { stop_reason, .. } => Some(*stop_reason),
        _ => None,
    };
    assert_eq!(stop_reason, Some(StopReason::Terminated), "{last:?}");

    // A block that holds only the word says it: the chat ends and nothing runs.
    let task = "team: fenced word";
    let server = scripted(task, vec![("coder", vec![Reply::from("```\nDONE\n```")])]).await;
    let out = run_team(&server, &file, task, true).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(!out.stdout.contains("\"code_block\""), "{}", out.stdout);
    assert!(!out.stdout.contains("executor_message"), "{}", out.stdout);
    assert!(out.stdout.contains("\"stop_reason\":\"terminated\""));
}

#[tokio::test(flavor = "multi_thread")]
async fn run_with_a_team_goes_to_the_daemon_when_one_answers() {
    let task = "team: review on the daemon";
    let server = scripted(
        task,
        vec![
            ("coder", vec![Reply::from("```python\nprint(6 * 7)\n```")]),
            ("reviewer", vec![Reply::from("The output is 42. APPROVED")]),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let d = tandem_tests::DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
    )
    .await;
    let (code, stdout, stderr) = d
        .cli(&["run", "--team", &team_file(&dir, REVIEW), task])
        .await;
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(
        stdout
            .lines()
            .next()
            .unwrap_or("")
            .contains("on the daemon at"),
        "{stdout}"
    );
    assert!(stdout.contains("APPROVED"), "{stdout}");
    // The daemon holds it, as a team task like one submitted.
    let tasks = d.get("/v1/tasks").await;
    let stored = &tasks["tasks"][0];
    assert_eq!(stored["spec"]["task"], task);
    assert_eq!(stored["spec"]["team"]["team"]["kind"], "chat", "{stored}");
    assert_eq!(stored["stop_reason"], "terminated", "{stored}");
    // A team's model calls are timed as a pair's are.
    let metrics = d.text("/metrics").await;
    let calls = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tandem_model_seconds_count "))
        .and_then(|n| n.trim().parse::<f64>().ok());
    assert!(calls.is_some_and(|n| n >= 2.0), "{metrics}");
    // A file that does not check is refused before anything is sent, naming the field.
    let bad = team_file(&dir, "[team]\nkind = \"chat\"\nagents = [\"nobody\"]\n");
    let (code, _, stderr) = d.cli(&["run", "--team", &bad, task]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("team.agents: `nobody` is not defined"),
        "{stderr}"
    );
    assert_eq!(
        d.get("/v1/tasks").await["tasks"].as_array().unwrap().len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_executor_agent_keeps_its_interpreter_when_its_team_file_says_so() {
    let task = "team: keep";
    let kept = |keep: &str| {
        format!(
            "[team]\nkind = \"chat\"\nagents = [\"coder\", \"runner\"]\ntermination = {{ max_turns = 4 }}\n\n\
             [agents.coder]\nkind = \"assistant\"\ninstructions = \"coder\"\n\n\
             [agents.runner]\nkind = \"executor\"\n{keep}"
        )
    };
    let server = scripted(
        task,
        vec![(
            "coder",
            vec![
                Reply::from("```python\nx = 6 * 7\n```"),
                Reply::from("```python\nprint(x)\n```"),
            ],
        )],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = run_team(
        &server,
        &team_file(&dir, &kept("keep_state = true\n")),
        task,
        true,
    )
    .await;
    // The chat ends at its turn bound, after the second block read the first one's `x`.
    assert!(
        out.stdout.contains(r#""stop_reason":"max_turns""#),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    assert!(out.stdout.contains(r#""stdout":"42\n""#), "{}", out.stdout);
    // On an executor that cannot keep one, the agent's field is named before anything runs.
    let url = server.base_url();
    let file = team_file(&dir, &kept("executor = \"wasm\"\nkeep_state = true\n"));
    let out = tandem(
        &[
            "run",
            "--team",
            &file,
            "--base-url",
            &url,
            "--model",
            "m",
            task,
        ],
        &[("TANDEM_MAX_RETRIES", "0")],
        None,
    )
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("team: team.runner.executor: keep_state: the wasm executor cannot keep"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_teams_executors_go_behind_the_proxy_with_the_tasks_hosts() {
    let net = tandem_tests::internet::Internet::new();
    net.http_server(80);
    let task = "team: fetch through the proxy";
    let fetch = "```python\nimport urllib.request, urllib.error\n\
                 print(urllib.request.urlopen('http://files.test/hello', timeout=30).read().decode().splitlines()[0])\n\
                 try:\n    urllib.request.urlopen('http://other.test/', timeout=30)\n\
                 except urllib.error.HTTPError as e:\n    print('other:', e.code)\n```";
    let server = scripted(
        task,
        vec![
            ("coder", vec![Reply::Text(fetch.to_owned())]),
            ("reviewer", vec![Reply::from("It fetched. APPROVED")]),
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let file = team_file(&dir, REVIEW);
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"files.test\" = [\"{}\"] }}\n",
            net.addr
        ),
    )
    .unwrap();
    let url = server.base_url();
    for executor in ["docker", "local"] {
        let out = tandem(
            &[
                "run",
                "--json",
                "--config",
                config.to_str().unwrap(),
                "--team",
                &file,
                "--base-url",
                &url,
                "--model",
                "m",
                "-e",
                executor,
                "--allow-host",
                "files.test",
                task,
            ],
            &[("TANDEM_MAX_RETRIES", "0")],
            None,
        )
        .await;
        assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
        let events = events_of(&out);
        let printed: String = events
            .iter()
            .filter_map(|e| match &e.msg {
                EventMsg::ExecResult { result, .. } => Some(result.stdout.clone()),
                _ => None,
            })
            .collect();
        assert!(
            printed.contains("seen: GET /hello") && printed.contains("other: 403"),
            "{executor}: {printed}"
        );
        let mut nets: Vec<(String, String)> = events
            .iter()
            .filter_map(|e| match &e.msg {
                EventMsg::Net(n) => Some((n.host.clone(), n.rule.clone())),
                _ => None,
            })
            .collect();
        nets.sort();
        assert_eq!(
            nets,
            [
                ("files.test".to_owned(), "files.test".to_owned()),
                ("other.test".to_owned(), "default".to_owned())
            ],
            "{executor}"
        );
    }
    // Every assistant was told which hosts its code can reach.
    for agent in ["coder", "reviewer"] {
        let told: Vec<_> = server
            .requests_for(task)
            .into_iter()
            .filter(|r| {
                r.body["messages"][0]["content"]
                    .as_str()
                    .is_some_and(|c| c.starts_with(&format!("{agent}\n")))
            })
            .collect();
        assert!(
            !told.is_empty()
                && told.iter().all(|r| r.body["messages"][0]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("nothing else on the network: files.test")),
            "{agent}"
        );
    }
}
