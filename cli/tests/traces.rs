//! Traces, as a collector sees them: a real OTLP receiver (HTTP/protobuf and gRPC, decoded
//! with the official protobuf definitions) is sent each task as one tree (task, turns, model
//! calls, tool calls, blocks, approvals) in the GenAI semantic conventions' names, on the
//! daemon, through MCP and in process, under the caller's span when it names one; a
//! collector that is away never holds a task up.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use tandem_protocol::{EventMsg, StopReason, TaskState};
use tandem_tests::otlp::{Collector, Received, tree};
use tandem_tests::{DaemonHarness as Daemon, McpHttp as Mcp, Reply, ScriptedOpenAi, call, script};

use crate::e2e::tandem;

/// A caller's span: trace `trace`, span `00f067aa0ba902b7`, sampled.
fn caller(trace: &str) -> String {
    format!("00-{trace}-00f067aa0ba902b7-01")
}

/// The span named `name` (the first, in start order).
fn named<'a>(spans: &'a [Received], name: &str) -> &'a Received {
    let mut found: Vec<&Received> = spans.iter().filter(|s| s.name == name).collect();
    found.sort_by_key(|s| s.start_ns);
    found
        .first()
        .copied()
        .unwrap_or_else(|| panic!("no span `{name}` in:\n{}", tree(spans)))
}

/// The children of `parent`, in start order.
fn children<'a>(spans: &'a [Received], parent: &Received) -> Vec<&'a Received> {
    let mut found: Vec<&Received> = spans
        .iter()
        .filter(|s| s.parent.as_deref() == Some(parent.span_id.as_str()))
        .collect();
    found.sort_by_key(|s| s.start_ns);
    found
}

/// Whether the task's own span (the last to end) has arrived.
fn whole(root: &'static str) -> impl Fn(&[Received]) -> bool {
    move |spans| spans.iter().any(|s| s.name == root)
}

const ROOT: &str = "invoke_agent tandem";

/// Submits `spec` with a `traceparent` header; the task's id.
async fn submit_traced(d: &Daemon, spec: Value, traceparent: &str) -> String {
    let resp = d
        .http()
        .post("http://tandem/v1/tasks")
        .header("content-type", "application/json")
        .header("traceparent", traceparent)
        .body(spec.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    resp.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Waits until task `id`'s first block waits for a person on `d`, then approves it there.
async fn approve_first_block(d: &Daemon, id: &str) {
    d.wait_state(id, TaskState::AwaitingApproval, Duration::from_secs(60))
        .await;
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{id}/approvals/1"),
            Some(json!({"decision": "approve"}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_task_is_one_trace_under_the_callers_span_and_mcp_joins_its_callers_too() {
    let (task, mcp_task) = ("trace: daemon", "trace: mcp");
    let collector = Collector::start().await;
    let server = ScriptedOpenAi::start(script([
        (
            task,
            vec![
                Reply::Calls(
                    String::new(),
                    vec![call(
                        "call-1",
                        "execute_code",
                        &json!({"language": "python", "code": "print(6 * 7)"}).to_string(),
                    )],
                ),
                Reply::from("The answer is 42.\nTERMINATE"),
            ],
        ),
        (
            mcp_task,
            vec![
                Reply::from("```python\nprint(7)\n```"),
                Reply::from("7\nTERMINATE"),
            ],
        ),
        (
            "trace: unsampled",
            vec![
                Reply::from("```python\nprint(8)\n```"),
                Reply::from("8\nTERMINATE"),
            ],
        ),
        (
            "trace: malformed",
            vec![
                Reply::from("```python\nprint(9)\n```"),
                Reply::from("9\nTERMINATE"),
            ],
        ),
    ]))
    .await
    .unwrap();
    let config = format!(
        "[telemetry]\nendpoint = \"{}\"\n",
        collector.http_endpoint()
    );
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some(&config),
    )
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let id = submit_traced(
        &d,
        json!({"task": task, "code_via": "tool", "approval": {"mode": "always"}}),
        &caller(trace),
    )
    .await;
    // The block waits for a person; approving it is part of the trace.
    approve_first_block(&d, &id).await;
    let done = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));
    assert_eq!(done.record.trace_id.as_deref(), Some(trace), "{done:?}");

    let spans = collector
        .trace(trace, Duration::from_secs(60), whole(ROOT))
        .await;
    assert_eq!(
        tree(&spans),
        "invoke_agent tandem
  queue
  invoke_agent assistant
    chat gpt-4o-mini
  invoke_agent executor
    execute_tool execute_code
      run_block python
        approval block
  invoke_agent assistant
    chat gpt-4o-mini
"
    );
    let root = named(&spans, ROOT);
    assert_eq!(root.parent.as_deref(), Some("00f067aa0ba902b7"));
    assert_eq!(root.via, "http");
    assert_eq!(root.resource["service.name"], "tandem");
    assert_eq!(root.text("gen_ai.operation.name"), Some("invoke_agent"));
    assert_eq!(root.text("gen_ai.agent.name"), Some("tandem"));
    assert_eq!(root.text("gen_ai.conversation.id"), Some(id.as_str()));
    assert_eq!(root.text("tandem.stop_reason"), Some("terminated"));
    assert_eq!(root.int("tandem.turns"), Some(2));
    let usage = done.record.usage;
    assert_eq!(
        root.int("gen_ai.usage.input_tokens"),
        Some(usage.prompt_tokens as i64)
    );
    assert_eq!(
        root.int("gen_ai.usage.output_tokens"),
        Some(usage.completion_tokens as i64)
    );

    // Each model call: the conventions' names, its own usage as its event said.
    let said: Vec<_> = d
        .events(&id, 0)
        .await
        .into_iter()
        .filter_map(|e| match e.msg {
            EventMsg::AssistantMessage { usage, .. } => Some(usage),
            _ => None,
        })
        .collect();
    let chats: Vec<&Received> = {
        let mut c: Vec<&Received> = spans
            .iter()
            .filter(|s| s.name.starts_with("chat "))
            .collect();
        c.sort_by_key(|s| s.start_ns);
        c
    };
    assert_eq!(chats.len(), 2);
    assert_eq!(said.len(), 2);
    for (chat, usage) in chats.iter().zip(&said) {
        assert_eq!(chat.kind, 3, "a model server is a client call");
        assert_eq!(chat.text("gen_ai.operation.name"), Some("chat"));
        assert_eq!(chat.text("gen_ai.provider.name"), Some("openai"));
        assert_eq!(chat.text("gen_ai.request.model"), Some("gpt-4o-mini"));
        assert!(chat.text("gen_ai.response.model").is_some(), "{chat:?}");
        assert_eq!(chat.text("server.address"), Some("127.0.0.1"));
        // What the server said the call used; a call it said nothing of has no usage.
        assert_eq!(
            chat.int("gen_ai.usage.input_tokens"),
            usage.map(|u| u.prompt_tokens as i64),
            "{chat:?} {said:?}"
        );
        assert_eq!(
            chat.int("gen_ai.usage.output_tokens"),
            usage.map(|u| u.completion_tokens as i64)
        );
        assert!(!chat.attributes.contains_key("code.file.path"), "{chat:?}");
        // Content is the operator's to opt into.
        assert!(!chat.attributes.contains_key("gen_ai.input.messages"));
    }
    assert_eq!(
        chats[0].attributes["gen_ai.response.finish_reasons"],
        json!(["tool_calls"])
    );
    let tool = named(&spans, "execute_tool execute_code");
    assert_eq!(tool.text("gen_ai.operation.name"), Some("execute_tool"));
    assert_eq!(tool.text("gen_ai.tool.name"), Some("execute_code"));
    assert_eq!(tool.text("gen_ai.tool.call.id"), Some("call-1"));
    let block = named(&spans, "run_block python");
    assert_eq!(block.text("tandem.executor"), Some("local"));
    assert_eq!(block.text("tandem.block.language"), Some("python"));
    assert_eq!(block.int("process.exit.code"), Some(0));
    assert_eq!(block.int("tandem.block.stdout_bytes"), Some(3));
    assert!(block.int("tandem.block.duration_ms").is_some());
    assert!(!block.attributes.contains_key("tandem.block.stdout"));
    // What the block used, measured in its sandbox.
    let cpu = block
        .attributes
        .get("tandem.block.cpu_secs")
        .and_then(Value::as_f64);
    assert!(cpu.is_some_and(|c| c > 0.0), "{:?}", block.attributes);
    assert!(
        block
            .int("tandem.block.peak_memory_bytes")
            .is_some_and(|p| p > 1 << 20),
        "{:?}",
        block.attributes
    );
    let approval = named(&spans, "approval block");
    assert_eq!(approval.text("tandem.approval.decision"), Some("approve"));
    assert_eq!(approval.text("tandem.approval.by"), Some("user"));
    // The queue span covers the time from the submit to the start.
    let queue = named(&spans, "queue");
    assert!(queue.start_ns <= queue.end_ns && queue.end_ns <= root.end_ns);
    assert_eq!(
        children(&spans, root).first().map(|s| s.name.as_str()),
        Some("queue")
    );

    // MCP: the request's `_meta.traceparent` is the caller's span.
    let mcp_trace = "0af7651916cd43dd8448eb211c80319c";
    let mcp = Mcp::connect(&d).await.unwrap();
    let result = mcp
        .request(
            "tools/call",
            json!({
                "name": "run_task",
                "arguments": {"task": mcp_task},
                "_meta": {"traceparent": caller(mcp_trace)}
            }),
        )
        .await;
    let ran: Value = result["structuredContent"].clone();
    assert_eq!(ran["stop_reason"], "terminated", "{result}");
    let mcp_id = ran["task_id"].as_str().unwrap().to_owned();
    assert_eq!(
        d.task(&mcp_id).await.record.trace_id.as_deref(),
        Some(mcp_trace)
    );
    let spans = collector
        .trace(mcp_trace, Duration::from_secs(60), whole(ROOT))
        .await;
    assert_eq!(
        named(&spans, ROOT).parent.as_deref(),
        Some("00f067aa0ba902b7")
    );
    assert_eq!(
        named(&spans, "run_block python").int("tandem.block.stdout_bytes"),
        Some(2)
    );

    // A caller's span that is not sampled is honoured: the task runs, and nothing of it is
    // sent (checked below, once a later task's spans have come: the export keeps order).
    let unsampled = "7bf92f3577b34da6a3ce929d0e0e4739";
    let quiet = submit_traced(
        &d,
        json!({"task": "trace: unsampled"}),
        &format!("00-{unsampled}-00f067aa0ba902b7-00"),
    )
    .await;
    let done = d.wait_finished(&quiet, Duration::from_secs(120)).await;
    assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));

    // A malformed traceparent is ignored: the task runs, in a trace of its own.
    let own = submit_traced(&d, json!({"task": "trace: malformed"}), "00-not-a-trace-01").await;
    let done = d.wait_finished(&own, Duration::from_secs(120)).await;
    let own_trace = done.record.trace_id.clone().expect("a trace of its own");
    assert!(own_trace != trace && own_trace != mcp_trace);
    let spans = collector
        .trace(&own_trace, Duration::from_secs(60), whole(ROOT))
        .await;
    assert_eq!(named(&spans, ROOT).parent, None);
    assert!(
        collector.spans().iter().all(|s| s.trace_id != unsampled),
        "an unsampled caller's task was exported"
    );

    // People see the trace: `tandem show`, and nothing was dropped.
    let (code, shown, _) = d.cli(&["show", &id]).await;
    assert_eq!(code, 0);
    assert!(shown.contains(&format!("trace {trace}")), "{shown}");
    let metrics = d.text("/metrics").await;
    assert!(
        metrics.contains("tandem_trace_spans_dropped_total 0"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tandem_run_exports_over_grpc_under_the_callers_span_with_content_when_asked() {
    let task = "trace: in process";
    let collector = Collector::start().await;
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from("```python\nprint(6 * 7)\n```"),
            Reply::from("42\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let trace = "5bf92f3577b34da6a3ce929d0e0e4737";
    let parent = caller(trace);
    let endpoint = collector.grpc_endpoint();
    let out = tandem(
        &["run", "--json", "--base-url", &server.base_url(), task],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_SERVICE_NAME", "trace-test"),
            ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true"),
            ("TRACEPARENT", parent.as_str()),
        ],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // The start event names the task's span, in the caller's trace.
    let started = out
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<tandem_protocol::Event>(l).ok())
        .find_map(|e| match e.msg {
            EventMsg::TaskStarted { trace, .. } => trace,
            _ => None,
        })
        .unwrap_or_else(|| panic!("no trace in task_started:\n{}", out.stdout));
    assert!(started.starts_with(&format!("00-{trace}-")), "{started}");
    // `tandem run` sends what is left before it exits: the trace is there, whole.
    let spans = collector
        .trace(trace, Duration::from_secs(10), whole(ROOT))
        .await;
    assert_eq!(
        tree(&spans),
        "invoke_agent tandem
  invoke_agent assistant
    chat gpt-4o-mini
  invoke_agent executor
    run_block python
  invoke_agent assistant
    chat gpt-4o-mini
"
    );
    let root = named(&spans, ROOT);
    assert_eq!(root.via, "grpc");
    assert_eq!(root.parent.as_deref(), Some("00f067aa0ba902b7"));
    assert_eq!(root.resource["service.name"], "trace-test");
    // Opted in: the prompt, the reply, the code and its output are on the spans.
    let chat = named(&spans, "chat gpt-4o-mini");
    // A streamed reply's first text is timed.
    assert!(
        chat.attributes
            .get("tandem.time_to_first_token")
            .and_then(Value::as_f64)
            .is_some_and(|s| s > 0.0 && s < 60.0),
        "{chat:?}"
    );
    let input = chat.text("gen_ai.input.messages").unwrap_or_default();
    let messages: Value = serde_json::from_str(input).expect("JSON messages");
    assert_eq!(messages[1]["role"], "user");
    assert_eq!(messages[1]["parts"][0]["content"], task);
    assert!(
        chat.text("gen_ai.output.messages")
            .is_some_and(|o| o.contains("print(6 * 7)"))
    );
    let block = named(&spans, "run_block python");
    assert_eq!(block.text("tandem.block.stdout"), Some("42\n"));
    assert_eq!(block.text("tandem.block.code"), Some("print(6 * 7)\n"));

    // A person sees the trace id in the transcript's header.
    let human = tandem(
        &["run", "--base-url", &server.base_url(), task],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ],
        None,
    )
    .await;
    assert_eq!(human.code, 0, "{}", human.stderr);
    assert!(human.stdout.contains(" · trace "), "{}", human.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_collector_that_is_away_or_silent_never_holds_a_task_up_and_drops_are_counted() {
    let task = "trace: no collector";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from("```python\nprint(1)\n```"),
            Reply::from("1\nTERMINATE"),
            Reply::from("```python\nprint(1)\n```"),
            Reply::from("1\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    // Takes connections and never answers them.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    let config = format!("[telemetry]\nendpoint = \"{silent_url}\"\nexport_timeout_secs = 1\n");
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some(&config),
    )
    .await;
    let id = d.submit(json!({"task": task})).await;
    let done = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));
    // The spans that could not go are counted, once their export gave up.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = d.text("/metrics").await;
        let dropped = metrics
            .lines()
            .find_map(|l| l.strip_prefix("tandem_trace_spans_dropped_total "))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if dropped >= 6 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{metrics}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // In process, with nothing listening at all: the task ends as it would without traces.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let out = tandem(
        &["run", "--base-url", &server.base_url(), task],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", closed.as_str())],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("done"), "{}", out.stdout);

    // A setting Tandem cannot use is a start-up error naming it and what to set.
    let out = tandem(
        &["run", "--base-url", &server.base_url(), task],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", closed.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ],
        None,
    )
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert_eq!(
        out.stderr.trim(),
        "tandem: OTEL_EXPORTER_OTLP_PROTOCOL: `http/json` is not a protocol Tandem exports with; use `http/protobuf` or `grpc`"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_resumed_after_a_restart_stays_in_its_trace_linked_to_its_first_run() {
    let task = "trace: resumed";
    let collector = Collector::start().await;
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from("```python\nprint(5)\n```"),
            Reply::from("5\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let config = format!(
        "[telemetry]\nendpoint = \"{}\"\n",
        collector.http_endpoint()
    );
    let mut d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some(&config),
    )
    .await;
    let id = d
        .submit(json!({"task": task, "approval": {"mode": "always"}}))
        .await;
    d.wait_state(&id, TaskState::AwaitingApproval, Duration::from_secs(60))
        .await;
    let trace = d
        .task(&id)
        .await
        .record
        .trace_id
        .expect("traced from its start");
    // A stop while it waits for a person interrupts it; the next start resumes it.
    assert_eq!(d.terminate().await, Some(0));
    d.spawn().await;
    approve_first_block(&d, &id).await;
    let done = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));
    assert_eq!(done.record.trace_id.as_deref(), Some(trace.as_str()));
    let spans = collector
        .trace(&trace, Duration::from_secs(60), |spans| {
            spans.iter().filter(|s| s.name == ROOT).count() == 2
        })
        .await;
    let mut runs: Vec<&Received> = spans.iter().filter(|s| s.name == ROOT).collect();
    runs.sort_by_key(|s| s.start_ns);
    let (first, second) = (runs[0], runs[1]);
    assert_eq!(first.parent, None);
    assert_eq!(second.parent.as_deref(), Some(first.span_id.as_str()));
    assert_eq!(
        second.links,
        vec![(trace.clone(), first.span_id.clone())],
        "{}",
        tree(&spans)
    );
    // Each run's own work is under its own span: the first waited, the second ran the block.
    let under = |run: &Received| -> Vec<String> {
        let mut names = Vec::new();
        let mut frontier = vec![run.span_id.clone()];
        while let Some(parent) = frontier.pop() {
            for s in spans
                .iter()
                .filter(|s| s.parent.as_deref() == Some(&parent))
            {
                if s.name != ROOT {
                    names.push(s.name.clone());
                    frontier.push(s.span_id.clone());
                }
            }
        }
        names.sort();
        names
    };
    assert!(
        under(first).contains(&"approval block".to_owned()),
        "{}",
        tree(&spans)
    );
    assert!(
        under(second).contains(&"run_block python".to_owned()),
        "{}",
        tree(&spans)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_team_task_has_a_span_per_agent_turn() {
    let task = "trace: team";
    let collector = Collector::start().await;
    // Replies by task and the first line of each agent's instructions.
    let server = ScriptedOpenAi::start(
        [
            (format!("{task}#a"), vec![Reply::from("a says")]),
            (format!("{task}#b"), vec![Reply::from("b says")]),
        ]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("team.toml");
    std::fs::write(
        &file,
        "[team]\nkind = \"chat\"\nagents = [\"a\", \"b\"]\ntermination = { max_turns = 2 }\n[agents.a]\ninstructions = \"a\"\n[agents.b]\ninstructions = \"b\"\n",
    )
    .unwrap();
    let trace = "6bf92f3577b34da6a3ce929d0e0e4738";
    let parent = caller(trace);
    let endpoint = collector.http_endpoint();
    let url = server.base_url();
    let out = tandem(
        &[
            "run",
            "--team",
            file.to_str().unwrap(),
            "--base-url",
            &url,
            "--model",
            "m",
            task,
        ],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("TRACEPARENT", parent.as_str()),
            ("TANDEM_MAX_RETRIES", "0"),
        ],
        None,
    )
    .await;
    assert!(
        out.stdout.contains("── b · turn 2 ──"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    let spans = collector
        .trace(trace, Duration::from_secs(10), whole("invoke_agent team"))
        .await;
    assert_eq!(
        tree(&spans),
        "invoke_agent team
  invoke_agent a
    chat m
  invoke_agent b
    chat m
"
    );
    let b = named(&spans, "invoke_agent b");
    assert_eq!(b.text("tandem.agent.path"), Some("team/b"));
    assert_eq!(b.int("tandem.turn"), Some(2), "{b:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_another_daemon_of_the_store_takes_over_joins_its_first_runs_trace() {
    let task = "trace: taken over";
    let url = tandem_tests::Postgres::shared().new_database();
    let collector = Collector::start().await;
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from("```python\nprint(3)\n```"),
            Reply::from("3\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let start = |name: &'static str| {
        let config = format!(
            "[store]\ndaemon = \"{name}\"\nlease_secs = 2.0\n\n[telemetry]\nendpoint = \"{}\"\n",
            collector.http_endpoint()
        );
        let (base, url) = (server.base_url(), url.clone());
        async move {
            Daemon::start_with_env(
                Path::new(env!("CARGO_BIN_EXE_tandem")),
                &base,
                &[],
                Some(&config),
                &[("TANDEM_STORE_URL", url.as_str())],
            )
            .await
        }
    };
    let mut a = start("a").await;
    let id = a
        .submit(json!({"task": task, "approval": {"mode": "always"}}))
        .await;
    a.wait_state(&id, TaskState::AwaitingApproval, Duration::from_secs(60))
        .await;
    // The first run's span, as its start event named it.
    let first = a
        .events(&id, 0)
        .await
        .into_iter()
        .find_map(|e| match e.msg {
            EventMsg::TaskStarted { trace, .. } => trace,
            _ => None,
        })
        .expect("a traced start");
    let parts: Vec<&str> = first.split('-').collect();
    let (trace, first_span) = (parts[1].to_owned(), parts[2].to_owned());
    // What of A's run has ended is exported within a batch's wait; then A dies holding the
    // task, B takes it once the lease lapses, and it waits for a person again.
    collector
        .trace(&trace, Duration::from_secs(30), |spans| {
            spans.iter().any(|s| s.name == "invoke_agent assistant")
        })
        .await;
    a.kill9();
    let b = start("b").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let t = b.task(&id).await;
        if t.record.state == TaskState::AwaitingApproval && t.daemon.as_deref() == Some("b") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{t:?}\n{}", b.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    approve_first_block(&b, &id).await;
    let done = b.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));
    assert_eq!(done.record.trace_id.as_deref(), Some(trace.as_str()));
    // B's run is a child of A's and links to it; A's own span never ended (it was killed),
    // but what of its run had ended is there, under it.
    let spans = collector
        .trace(&trace, Duration::from_secs(60), whole(ROOT))
        .await;
    let taken = named(&spans, ROOT);
    assert_eq!(taken.parent.as_deref(), Some(first_span.as_str()));
    assert_eq!(taken.links, vec![(trace.clone(), first_span.clone())]);
    assert!(
        spans.iter().any(|s| s.name == "chat gpt-4o-mini"
            && s.parent.is_some()
            && spans.iter().any(|p| Some(&p.span_id) == s.parent.as_ref()
                && p.name == "invoke_agent assistant"
                && p.parent.as_deref() == Some(first_span.as_str()))),
        "{}",
        tree(&spans)
    );
    assert!(
        children(&spans, taken)
            .iter()
            .any(|s| s.name == "invoke_agent executor"),
        "{}",
        tree(&spans)
    );
}
