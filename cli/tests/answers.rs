//! A task's answer on every road: `tandem run` in this process (its last line, `--json` and its
//! exit code), the daemon's record and `task_finished`, and MCP's `run_task`. The page and the
//! Python client are held to it in web.rs and python/tests.

use serde_json::{Value, json};
use tandem_tests::{Reply, ScriptedOpenAi, script};

use crate::e2e::tandem;

/// The model guesses its code's output, is told what it printed, and answers in words.
fn guessing() -> Vec<Reply> {
    vec![
        Reply::from(
            "```python\nprint(12 + 7)\n```\n```output\n20\n```\nThere are 20 apples.\nTERMINATE",
        ),
        Reply::from("There are 19 apples."),
    ]
}

/// The model's code prints, and it never states an answer before the turn limit.
fn unstated() -> Vec<Reply> {
    vec![Reply::from("```python\nprint('total:', 6 * 7)\n```")]
}

#[tokio::test(flavor = "multi_thread")]
async fn the_answer_is_the_last_line_of_tandem_run_and_in_its_json() {
    let (told, silent, silent_json) = (
        "answers: apples, here",
        "answers: silent, here",
        "answers: silent, here, json",
    );
    let server = ScriptedOpenAi::start(script([
        (told, guessing()),
        (silent, unstated()),
        (silent_json, unstated()),
    ]))
    .await
    .unwrap();
    let url = server.base_url();
    let run = |task: &'static str, json: bool| {
        let url = url.clone();
        // The silent tasks stop at their turn limit, before asking the model again.
        let turns = if task == told { "3" } else { "1" };
        async move {
            let mut args = vec![
                "run",
                "-e",
                "local",
                "--base-url",
                &url,
                "--model",
                "scripted-model",
                "--max-turns",
                turns,
            ];
            if json {
                args.push("--json");
            }
            args.push(task);
            tandem(&args, &[("TANDEM_MAX_RETRIES", "0")], None).await
        }
    };
    let out = run(told, false).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        out.stdout.lines().last(),
        Some("There are 19 apples."),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("done: answered"), "{}", out.stdout);
    // The turn limit: exit 3, and the answer is what the code printed, marked as such.
    let out = run(silent, false).await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    let tail: Vec<&str> = out.stdout.lines().rev().take(2).collect();
    assert_eq!(tail[0], "total: 42", "{}", out.stdout);
    assert!(
        tail[1].contains("answer: what the code printed"),
        "{}",
        out.stdout
    );
    let out = run(silent_json, true).await;
    let last: Value = serde_json::from_str(out.stdout.lines().last().unwrap()).unwrap();
    assert_eq!(last["type"], "task_finished", "{last}");
    assert_eq!(
        (&last["answer"], &last["answer_from"], &last["stop_reason"]),
        (&json!("total: 42"), &json!("output"), &json!("max_turns")),
        "{last}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemon_keeps_the_answer_on_the_record_and_mcp_returns_it() {
    let (told, silent, mcp_task) = (
        "answers: apples, daemon",
        "answers: silent, daemon",
        "answers: apples, mcp",
    );
    let server = ScriptedOpenAi::start(script([
        (told, guessing()),
        (silent, unstated()),
        (mcp_task, guessing()),
    ]))
    .await
    .unwrap();
    let d = tandem_tests::DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
    )
    .await;
    let id = d
        .submit(json!({"task": told, "executor": "local", "max_turns": 3}))
        .await;
    let view = d
        .wait_finished(&id, std::time::Duration::from_secs(120))
        .await;
    let record = &view.record;
    assert_eq!(
        (
            record.stop_reason,
            record.answer.as_deref(),
            record.answer_from
        ),
        (
            Some(tandem_protocol::StopReason::Answered),
            Some("There are 19 apples."),
            Some(tandem_protocol::AnswerFrom::Model)
        )
    );
    let events = d.raw_events(&id, 0).await;
    let finished = events.last().unwrap();
    assert_eq!(finished["answer"], "There are 19 apples.", "{finished}");
    // Over HTTP as any client reads it, and after a restart from the store.
    let id = d
        .submit(json!({"task": silent, "executor": "local", "max_turns": 1}))
        .await;
    d.wait_finished(&id, std::time::Duration::from_secs(120))
        .await;
    let raw = d.get(&format!("/v1/tasks/{id}")).await;
    assert_eq!(
        (&raw["answer"], &raw["answer_from"], &raw["stop_reason"]),
        (&json!("total: 42"), &json!("output"), &json!("max_turns")),
        "{raw}"
    );
    // `tandem show` ends with it, as `tandem run` does.
    let (code, shown, _) = d.cli(&["show", &id]).await;
    assert_eq!(code, 0);
    assert!(
        shown.ends_with("── answer: what the code printed ──\ntotal: 42\n"),
        "{shown}"
    );
    let listed = d.get("/v1/tasks").await;
    let row = listed["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] == id.as_str())
        .unwrap();
    assert_eq!(row["answer"], "total: 42", "{row}");

    let mcp = tandem_tests::McpHttp::connect(&d).await.unwrap();
    let result = mcp
        .call_tool(
            "run_task",
            json!({"task": mcp_task, "executor": "local", "max_turns": 3}),
        )
        .await;
    assert_eq!(result["isError"], false, "{result}");
    let structured = &result["structuredContent"];
    assert_eq!(
        (
            &structured["answer"],
            &structured["answer_from"],
            &structured["stop_reason"]
        ),
        (
            &json!("There are 19 apples."),
            &json!("model"),
            &json!("answered")
        ),
        "{result}"
    );
    let text = result["content"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("There are 19 apples.\n\n(task ")
            && text.contains("answered after 2 turns"),
        "{text}"
    );
}
