//! Budgets end a task at the first model call it cannot afford, on every road: `tandem run` in
//! process, the daemon's API and MCP; the scripted server reports known usage (a token per
//! four characters, plus one), so where a task stops is known before it runs.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use tandem_protocol::{BudgetReached, EventMsg, StopReason, Usage};
use tandem_tests::{DaemonHarness as Daemon, McpHttp as Mcp, Reply, ScriptedOpenAi, script};

use crate::e2e::tandem;

/// A reply of 22 characters (6 completion tokens) whose block prints, never ending the task.
/// Replies of one length (so of one token count), each with other code than the last: the
/// same code sent again would end the task as `repeated` before any budget.
fn endless() -> Vec<Reply> {
    (0..12)
        .map(|i| Reply::from(format!("```python\nprint({})\n```", i % 9 + 1).as_str()))
        .collect()
}

/// What `--json` printed as the task's end: stop reason, usage, the budget reached.
fn ended(stdout: &str) -> (StopReason, Usage, Option<BudgetReached>, Option<f64>) {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<tandem_protocol::Event>(l).ok())
        .find_map(|e| match e.msg {
            EventMsg::TaskFinished {
                stop_reason,
                usage,
                budget,
                cost,
                ..
            } => Some((stop_reason, usage, budget.map(|b| *b), cost)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no task_finished in:\n{stdout}"))
}

/// The prompt tokens of each model call, as the events said.
fn calls(stdout: &str) -> Vec<Usage> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<tandem_protocol::Event>(l).ok())
        .filter_map(|e| match e.msg {
            EventMsg::AssistantMessage { usage, .. } => usage,
            _ => None,
        })
        .collect()
}

fn blocks_run(stdout: &str) -> usize {
    stdout
        .lines()
        .filter(|l| l.contains("\"type\":\"exec_result\""))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn token_budgets_stop_a_task_in_process_at_the_call_that_reaches_them() {
    let (input, output) = ("budget: input tokens", "budget: output tokens");
    let server = ScriptedOpenAi::start(script([(input, endless()), (output, endless())]))
        .await
        .unwrap();
    let url = server.base_url();
    let run = |task: &'static str, flag: &'static str, n: String| {
        let url = url.clone();
        async move {
            tandem(
                &[
                    "run",
                    "--json",
                    "--base-url",
                    &url,
                    flag,
                    &n,
                    "--max-turns",
                    "10",
                    task,
                ],
                &[],
                None,
            )
            .await
        }
    };
    // A budget one token above the first call's prompt lets exactly two calls be made.
    let once = run(input, "--max-input-tokens", "1".into()).await;
    assert_eq!(once.code, 6, "{}\n{}", once.stdout, once.stderr);
    let first = calls(&once.stdout);
    assert_eq!(first.len(), 1, "{}", once.stdout);
    let allowed = first[0].prompt_tokens + 1;
    let out = run(input, "--max-input-tokens", allowed.to_string()).await;
    assert_eq!(out.code, 6, "{}\n{}", out.stdout, out.stderr);
    let (stop, usage, budget, _) = ended(&out.stdout);
    assert_eq!(stop, StopReason::Budget);
    let made = calls(&out.stdout);
    assert_eq!(made.len(), 2, "{}", out.stdout);
    let budget = budget.expect("the budget reached");
    assert_eq!(budget.budget, "max_input_tokens");
    assert_eq!(budget.limit, allowed as f64);
    assert_eq!(budget.spent, usage.prompt_tokens as f64);
    assert_eq!(
        usage.prompt_tokens,
        made.iter().map(|u| u.prompt_tokens).sum::<u64>()
    );
    // The work is kept: both replies' blocks ran, and the model was asked no third time.
    assert_eq!(blocks_run(&out.stdout), 2, "{}", out.stdout);
    assert_eq!(server.requests_for(input).len(), 1 + 2);

    // What is left of the output budget caps each reply: 10, then 10 - 6.
    let out = run(output, "--max-output-tokens", "10".into()).await;
    assert_eq!(out.code, 6, "{}\n{}", out.stdout, out.stderr);
    let (stop, _, budget, _) = ended(&out.stdout);
    assert_eq!(stop, StopReason::Budget);
    let budget = budget.expect("the budget reached");
    assert_eq!(
        (budget.budget.as_str(), budget.limit, budget.spent),
        ("max_output_tokens", 10.0, 12.0)
    );
    let caps: Vec<Value> = server
        .requests_for(output)
        .iter()
        .map(|r| r.body["max_tokens"].clone())
        .collect();
    assert_eq!(caps, vec![json!(10), json!(4)]);

    // People see which budget, and what was spent.
    let human = tandem(
        &[
            "run",
            "--base-url",
            &url,
            "--max-output-tokens",
            "10",
            output,
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(human.code, 6, "{}", human.stderr);
    assert!(
        human
            .stdout
            .contains("budget: the task reached its max_output_tokens of 10 (12 spent)"),
        "{}",
        human.stdout
    );
    assert!(
        human.stdout.contains("stopped: budget reached"),
        "{}",
        human.stdout
    );

    // Budgets that no task could stay within are refused before anything runs.
    for (flag, value) in [
        ("--max-input-tokens", "0"),
        ("--max-cost", "0"),
        ("--max-cost", "-1"),
        ("--max-cost", "NaN"),
    ] {
        let arg = format!("{flag}={value}");
        let out = tandem(&["run", "--base-url", &url, &arg, input], &[], None).await;
        assert_eq!(out.code, 2, "{flag} {value}: {}", out.stderr);
        assert!(out.stderr.contains(flag), "{flag} {value}: {}", out.stderr);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cost_budget_is_counted_at_the_operators_prices_on_the_daemon_and_over_mcp() {
    let (task, mcp_task) = ("budget: cost", "budget: cost over mcp");
    let server = ScriptedOpenAi::start(script([(task, endless()), (mcp_task, endless())]))
        .await
        .unwrap();
    // A million prompt tokens cost 1000: a prompt token costs 0.001, a completion token 0.002.
    let config = "[model.prices.\"gpt-4o-mini\"]\ninput = 1000.0\noutput = 2000.0\n\n[policy]\nexecutors = [\"local\"]\nmax_output_tokens = 500\n";
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some(config),
    )
    .await;
    let id = d
        .submit(json!({"task": task, "max_cost": 0.000001, "max_turns": 10}))
        .await;
    let done = d.wait_finished(&id, Duration::from_secs(120)).await;
    let r = &done.record;
    assert_eq!(r.stop_reason, Some(StopReason::Budget), "{done:?}");
    assert_eq!(r.turns, 1, "{done:?}");
    let expected = r.usage.prompt_tokens as f64 * 0.001 + r.usage.completion_tokens as f64 * 0.002;
    let cost = r.cost.expect("the cost");
    assert!((cost - expected).abs() < 1e-9, "{cost} != {expected}");
    let budget = r.budget.clone().expect("the budget reached");
    assert_eq!(budget.budget, "max_cost");
    assert!((budget.spent - expected).abs() < 1e-9, "{budget:?}");
    // The operator's cap is the budget of a task that sets none: it capped the reply.
    let asked = server.requests_for(task);
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].body["max_tokens"], 500);
    // The CLI shows it; /metrics counts it by model and executor.
    let (code, shown, _) = d.cli(&["show", &id]).await;
    assert_eq!(code, 0);
    assert!(
        shown.contains("(budget)") && shown.contains("· cost 0."),
        "{shown}"
    );
    assert!(
        shown.contains("budget: the task reached its max_cost"),
        "{shown}"
    );
    let metrics = d.text("/metrics").await;
    assert!(
        metrics.contains("tandem_budget_stops_total{budget=\"max_cost\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("tandem_cost_total{model=\"gpt-4o-mini\",executor=\"local\"}")),
        "{metrics}"
    );

    // Refused with the field and the fix named: no price, zero, above the cap.
    for (spec, status, words) in [
        (
            json!({"task": task, "model": "unpriced", "max_cost": 1.0}),
            400,
            "`unpriced` has no price",
        ),
        (
            json!({"task": task, "max_input_tokens": 0}),
            400,
            "max_input_tokens must be at least 1",
        ),
        // A team's selector with a model of its own is counted too.
        (
            json!({"task": task, "max_cost": 1.0, "team": {
                "team": {"kind": "chat", "agents": ["a", "b"],
                         "termination": {"max_turns": 4},
                         "selection": {"kind": "llm", "model": "unpriced-selector"}},
                "agents": {"a": {"instructions": "a", "description": "writes"},
                           "b": {"instructions": "b", "description": "checks"}}}}),
            400,
            "`unpriced-selector` has no price",
        ),
        (
            json!({"task": task, "max_cost": -2.0}),
            400,
            "max_cost must be a number above 0",
        ),
        (
            json!({"task": task, "max_output_tokens": 501}),
            400,
            "max_output_tokens 501 is above this daemon's cap of 500",
        ),
        (
            json!({"task": task, "output_schema": {"type": 7}}),
            400,
            "output_schema: not a JSON Schema",
        ),
    ] {
        let (got, body) = d
            .send(reqwest::Method::POST, "/v1/tasks", Some(spec.to_string()))
            .await;
        assert_eq!(got, status, "{spec}: {body}");
        assert!(body.to_string().contains(words), "{spec}: {body}");
    }

    // MCP's run_task takes the budgets and says which one ended the task.
    let mcp = Mcp::connect(&d).await.unwrap();
    let answer = mcp
        .call_tool(
            "run_task",
            json!({"task": mcp_task, "max_output_tokens": 6, "max_turns": 10}),
        )
        .await;
    let result = &answer["structuredContent"];
    assert_eq!(result["stop_reason"], "budget", "{answer}");
    assert_eq!(result["budget"]["budget"], "max_output_tokens", "{answer}");
    assert!(
        answer
            .to_string()
            .contains("the task reached its max_output_tokens of 6"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_price_for_a_model_the_server_does_not_serve_is_refused_at_start() {
    let server = ScriptedOpenAi::start(script([("priced", vec![Reply::from("TERMINATE")])]))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        "[model.prices.\"gpt-4o-maxi\"]\ninput = 0.15\noutput = 0.6\n",
    )
    .unwrap();
    let config = config.to_string_lossy().into_owned();
    let url = server.base_url();
    let out = tandem(
        &["run", "--config", &config, "--base-url", &url, "priced"],
        &[],
        None,
    )
    .await;
    assert_ne!(out.code, 0, "{}", out.stdout);
    assert!(
        out.stderr.contains("[model.prices.\"gpt-4o-maxi\"]")
            && out.stderr.contains("gpt-4o-mini, scripted-large"),
        "{}",
        out.stderr
    );
    // The control: a price for a model it serves is taken.
    std::fs::write(
        &config,
        "[model.prices.\"scripted-large\"]\ninput = 0.15\noutput = 0.6\n",
    )
    .unwrap();
    let out = tandem(
        &["run", "--config", &config, "--base-url", &url, "priced"],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_output_schema_is_asked_again_until_the_answer_matches_and_is_the_result() {
    let task = "schema: how many primes below 10000";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from("```python\nprint(1229)\n```"),
            // Words, no value: asked again.
            Reply::from("There are 1229 primes below 10000.\nTERMINATE"),
            // A value of the wrong type: asked again, with the path and the problem.
            Reply::from("```json\n{\"primes\": \"1229\"}\n```"),
            Reply::from("```json\n{\"primes\": 1229}\n```\nTERMINATE"),
            Reply::from("never asked"),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "required": ["primes"], "properties": {"primes": {"type": "integer"}}}"#,
    )
    .unwrap();
    let schema = schema.to_string_lossy().into_owned();
    let url = server.base_url();
    let out = tandem(
        &[
            "run",
            "--json",
            "--base-url",
            &url,
            "--output-schema",
            &schema,
            task,
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let last: Value = serde_json::from_str(out.stdout.lines().last().unwrap()).unwrap();
    assert_eq!(last["type"], "task_finished", "{last}");
    assert_eq!(last["result"], json!({"primes": 1229}), "{last}");
    assert_eq!(last["turns"], 4, "{last}");
    let asked = server.requests_for(task);
    assert_eq!(asked.len(), 4);
    // The model was told the schema, then why each answer was not the result.
    let first = asked[0].body["messages"][0]["content"].as_str().unwrap();
    assert!(
        first.contains("\"primes\"") && first.contains("```json"),
        "{first}"
    );
    let told = |i: usize| asked[i].last_message().unwrap_or_default().to_owned();
    assert!(told(2).contains("No JSON value was found"), "{}", told(2));
    assert!(
        told(3).contains("at /primes") && told(3).contains("integer"),
        "{}",
        told(3)
    );

    // A schema that does not compile is refused before anything runs, naming the problem.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"type": "no-such-type"}"#).unwrap();
    let bad = bad.to_string_lossy().into_owned();
    let out = tandem(
        &["run", "--base-url", &url, "--output-schema", &bad, task],
        &[],
        None,
    )
    .await;
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.contains("output_schema: not a JSON Schema"),
        "{}",
        out.stderr
    );
    assert_eq!(server.requests_for(task).len(), 4, "a model call was made");
}

/// Replies of about 400 bytes (so about 100 tokens at four bytes a token), each with other
/// code, never ending the task, from a server that sends no `usage` with any of them.
fn silent(n: usize) -> Vec<Reply> {
    (0..n)
        .map(|i| {
            let text = format!(
                "```python\n# {}\nprint({i})\n```",
                "a comment to make the reply long ".repeat(11)
            );
            Reply::NoUsage(Box::new(Reply::from(text.as_str())))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn budgets_hold_against_a_server_that_reports_no_usage() {
    let (tokens, cost) = ("budget: no usage, tokens", "budget: no usage, cost");
    let server = ScriptedOpenAi::start(script([(tokens, silent(12)), (cost, silent(12))]))
        .await
        .unwrap();
    let url = server.base_url();

    // In process: the first reply's ~100 estimated tokens pass max_output_tokens = 50, so the
    // task stops there, not at its 8th turn.
    let out = tandem(
        &[
            "run",
            "--json",
            "--base-url",
            &url,
            "--max-output-tokens",
            "50",
            "--max-turns",
            "8",
            tokens,
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 6, "{}\n{}", out.stdout, out.stderr);
    let (stop, usage, budget, _) = ended(&out.stdout);
    assert_eq!(stop, StopReason::Budget);
    let budget = budget.expect("the budget reached");
    assert_eq!(budget.budget, "max_output_tokens");
    let made = calls(&out.stdout);
    assert!(
        (1..=2).contains(&made.len()),
        "stopped after {} calls:\n{}",
        made.len(),
        out.stdout
    );
    assert_eq!(server.requests_for(tokens).len(), made.len());
    // Each call's usage, and the task's, say they are estimates; a reply's ~400 bytes are
    // about 100 tokens, never 0.
    for u in &made {
        assert!(u.estimated && u.prompt_tokens > 0, "{u:?}");
        assert!((90..=110).contains(&u.completion_tokens), "{u:?}");
    }
    assert!(usage.estimated, "{usage:?}");
    assert_eq!(budget.spent, usage.completion_tokens as f64);
    assert!(
        out.stdout.contains("\"estimated\":true"),
        "the wire says so:\n{}",
        out.stdout
    );

    // On the daemon, with a priced model: max_cost stops the task at its first call.
    let config = "[model.prices.\"gpt-4o-mini\"]\ninput = 1000.0\noutput = 2000.0\n\n[policy]\nexecutors = [\"local\"]\n";
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &url,
        &[],
        Some(config),
    )
    .await;
    let id = d
        .submit(json!({"task": cost, "max_cost": 0.01, "max_turns": 8}))
        .await;
    let done = d.wait_finished(&id, Duration::from_secs(120)).await;
    let r = &done.record;
    assert_eq!(r.stop_reason, Some(StopReason::Budget), "{done:?}");
    assert!((1..=2).contains(&r.turns), "{done:?}");
    let budget = r.budget.clone().expect("the budget reached");
    assert_eq!(budget.budget, "max_cost");
    let spent = r.cost.expect("the cost");
    assert!(spent >= 0.01, "{spent}");
    let expected = r.usage.prompt_tokens as f64 * 0.001 + r.usage.completion_tokens as f64 * 0.002;
    assert!((spent - expected).abs() < 1e-9, "{spent} != {expected}");
    let events = d.events(&id, 0).await;
    let estimated: Vec<bool> = events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::AssistantMessage { usage, .. } => Some(usage.is_some_and(|u| u.estimated)),
            EventMsg::TaskFinished { usage, .. } => Some(usage.estimated),
            _ => None,
        })
        .collect();
    assert!(
        estimated.len() >= 2 && estimated.iter().all(|e| *e),
        "{estimated:?}"
    );
    assert_eq!(server.requests_for(cost).len() as u32, r.turns);
}
