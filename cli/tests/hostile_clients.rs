//! The hostile-client kit (`tandem_tests::hostile_clients`) run against the real daemon: every
//! hostile input on every road, hang-ups mid-request, half-open connections, a client that
//! hoards sandboxes, many clients at once; after each, the daemon must be alive and another
//! client served. And the holes round 5 found in the doors wave 4 opened, each attacked as it
//! was found.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_protocol::StopReason;
use tandem_tests::hostile_clients::{
    self, CHAT_ROADS, Hostile, ROADS, Road, TASK, Via, alternatives_bomb, ref_chain,
};
use tandem_tests::{DaemonHarness as Daemon, McpHttp as Mcp, Reply, ScriptedOpenAi, script, texts};
use tokio::io::AsyncWriteExt;

const BIN: &str = env!("CARGO_BIN_EXE_tandem");
const CONTROL: &str = "control: print the answer";

fn python(code: &str) -> Reply {
    Reply::from(format!("```python\n{code}\n```").as_str())
}

fn kit_script() -> tandem_tests::Script {
    script([
        (TASK, texts(&["TERMINATE"])),
        (
            CONTROL,
            vec![python("print(6 * 7)"), Reply::from("42 TERMINATE")],
        ),
    ])
}

fn alive(d: &Daemon) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(d.pid() as i32), None).is_ok()
}

/// The daemon lives and answers.
async fn assert_alive(d: &Daemon, after: &str) {
    assert!(alive(d), "the daemon died after {after}\n{}", d.log());
    let health = tokio::time::timeout(Duration::from_secs(30), d.try_get("/healthz")).await;
    match health {
        Ok(Ok(h)) if h["status"] == "ok" => {}
        other => panic!("/healthz after {after}: {other:?}\n{}", d.log()),
    }
}

/// Another client's task runs a block and ends with its answer.
async fn assert_served(d: &Daemon, after: &str) {
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": CONTROL}).to_string()),
        )
        .await;
    assert_eq!(
        status, 201,
        "another client was refused after {after}: {body}"
    );
    let id = body["id"].as_str().unwrap();
    let t = d.wait_finished(id, Duration::from_secs(120)).await;
    assert_eq!(
        t.record.stop_reason,
        Some(StopReason::Terminated),
        "another client's task after {after}: {:?}",
        t.record.error
    );
    assert!(
        d.block_stdouts(id).await.iter().any(|o| o.contains("42")),
        "another client's block did not run after {after}"
    );
}

/// What came of one request: its status and body, or the transport's error.
async fn request(
    d: &Daemon,
    method: &str,
    path: &str,
    body: String,
) -> Result<(u16, Value), String> {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let resp = d
        .http()
        .request(method, format!("http://tandem{path}"))
        .header("content-type", "application/json")
        .body(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(|e| format!("{e:?}"))?;
    Ok((
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

/// Whether `input` on `road` must be refused with a 400: a client schema past a bound.
fn must_refuse(road: &Road, input: &Hostile) -> bool {
    let schema_road = road.name.contains("output_schema") || road.name.contains("parameters");
    let bomb = ["$ref chain", "$ref cycle", "anyOf"]
        .iter()
        .any(|k| input.name.contains(k));
    schema_road && bomb
}

/// Sends `input` on `road` and sees what it made through to its end: a refusal, or a task
/// that ends, a session that is closed, a block whose run is read.
async fn attack(d: &Daemon, mcp: &Mcp<'_>, road: &Road, input: &Hostile) {
    let what = format!("{} on {}", input.name, road.name);
    match road.via {
        Via::Http(method, path) => {
            let (status, body) = request(d, method, path, road.body(input))
                .await
                .unwrap_or_else(|e| panic!("{what}: the daemon did not answer: {e}\n{}", d.log()));
            assert!(status < 500 || status == 503, "{what}: {status} {body}");
            if must_refuse(road, input) {
                assert_eq!(status, 400, "{what} was not refused: {body}");
                let message = body["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    message.contains("schema")
                        || message.contains("parameters")
                        || message.contains("$ref"),
                    "{what}: the refusal does not name the bound: {message}"
                );
            }
            if (200..300).contains(&status) {
                match path {
                    "/v1/tasks" => {
                        let id = body["id"].as_str().unwrap();
                        d.wait_finished(id, Duration::from_secs(120)).await;
                    }
                    "/v1/sessions" => {
                        let id = body["id"].as_str().unwrap();
                        let (closed, _) = d
                            .send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
                            .await;
                        assert_eq!(closed, 200, "{what}: the session was not closed");
                    }
                    // A volume made with a quota is a mounted filesystem: never left behind.
                    "/v1/volumes" => {
                        let name = body["name"].as_str().unwrap();
                        let (removed, _) = d
                            .send(
                                reqwest::Method::DELETE,
                                &format!("/v1/volumes/{name}"),
                                None,
                            )
                            .await;
                        assert_eq!(removed, 200, "{what}: the volume was not removed");
                    }
                    _ => {}
                }
            }
        }
        Via::Mcp(tool) => {
            let Ok(arguments) = serde_json::from_str::<Value>(&road.body(input)) else {
                // Not JSON the client could send as arguments (deeper than its parser
                // takes): sent raw, as a hostile client would.
                let raw = format!(
                    r#"{{"jsonrpc": "2.0", "id": 99, "method": "tools/call", "params": {{"name": "{tool}", "arguments": {}}}}}"#,
                    road.body(input)
                );
                let resp = d
                    .http()
                    .post("http://tandem/mcp")
                    .header("accept", "application/json, text/event-stream")
                    .header("content-type", "application/json")
                    .header("mcp-session-id", &mcp.session)
                    .body(raw)
                    .send()
                    .await
                    .unwrap_or_else(|e| panic!("{what}: the daemon did not answer: {e}"));
                assert!(resp.status().as_u16() < 500, "{what}: {}", resp.status());
                assert_alive(d, &what).await;
                return;
            };
            let result = mcp.call_tool(tool, arguments).await;
            if must_refuse(road, input) {
                let text = result.to_string();
                assert!(
                    text.contains("schema") || text.contains("parameters"),
                    "{what} was not refused naming the bound: {text}"
                );
                assert!(
                    result["error"].is_object() || result["isError"] == true,
                    "{what} was not refused: {text}"
                );
            }
            if let Some(id) = result["structuredContent"]["id"].as_str() {
                d.wait_finished(id, Duration::from_secs(120)).await;
            }
        }
    }
    assert_alive(d, &what).await;
}

async fn kit_daemon(server: &ScriptedOpenAi) -> Daemon {
    Daemon::start(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", "local", "--max-concurrent", "2"],
        Some("[sessions]\nwait_secs = 5\n"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn every_hostile_input_on_every_road_leaves_the_daemon_serving_others() {
    let server = ScriptedOpenAi::start(kit_script()).await.unwrap();
    let d = kit_daemon(&server).await;
    let mcp = Mcp::connect(&d).await.unwrap();
    let inputs = hostile_clients::inputs();
    for road in ROADS {
        for input in &inputs {
            attack(&d, &mcp, road, input).await;
        }
        assert_served(&d, road.name).await;
    }
    // The daemon grew by what it holds, not by what it was sent.
    assert!(d.rss_mib() < 1024.0, "the daemon holds {} MiB", d.rss_mib());
}

/// A request's head and part of its body, then nothing: the client hangs up, or holds the
/// connection open.
async fn half_request(d: &Daemon, path: &str, body: &str) -> tokio::net::UnixStream {
    let mut stream = tokio::net::UnixStream::connect(d.socket()).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
        .write_all(&body.as_bytes()[..body.len() / 2])
        .await
        .unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread")]
async fn hang_ups_half_open_connections_and_many_clients_at_once_leave_the_daemon_serving() {
    let server = ScriptedOpenAi::start(kit_script()).await.unwrap();
    let d = kit_daemon(&server).await;
    let inputs = hostile_clients::inputs();
    let http_roads: Vec<&Road> = ROADS
        .iter()
        .filter(|r| matches!(r.via, Via::Http(..)))
        .collect();

    // Hang-ups mid-body, on every road, with every input.
    for road in &http_roads {
        let Via::Http(_, path) = road.via else {
            unreachable!()
        };
        for input in &inputs {
            drop(half_request(&d, path, &road.body(input)).await);
        }
        assert_alive(&d, &format!("hang-ups on {}", road.name)).await;
    }
    // Half-open connections held while another client is served.
    let mut held = Vec::new();
    for road in &http_roads {
        let Via::Http(_, path) = road.via else {
            unreachable!()
        };
        for _ in 0..4 {
            held.push(half_request(&d, path, &road.body(&inputs[2])).await);
        }
    }
    assert_served(&d, "half-open connections held").await;
    drop(held);

    // Every road at once, each with every input: the daemon answers each and lives.
    let started = Instant::now();
    let dr = &d;
    let all = http_roads.iter().flat_map(|road| {
        let Via::Http(method, path) = road.via else {
            unreachable!()
        };
        inputs
            .iter()
            .map(move |input| request(dr, method, path, road.body(input)))
    });
    let answers = futures::future::join_all(all).await;
    for a in &answers {
        let (status, body) = a
            .as_ref()
            .unwrap_or_else(|e| panic!("a request at once: {e}"));
        assert!(*status < 500 || *status == 503, "{status} {body}");
    }
    assert_alive(&d, "every road at once").await;
    assert_served(&d, "every road at once").await;
    // Accepted tasks end; no sandbox is left open.
    let deadline = started + Duration::from_secs(240);
    while d.count("running").await + d.count("queued").await > 0 {
        assert!(
            Instant::now() < deadline,
            "tasks from the burst never ended"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for id in d.get("/v1/sessions").await["sessions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|s| s["id"].as_str().map(str::to_owned))
    {
        d.send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_clients_idle_sessions_cannot_take_the_sandboxes_tasks_need() {
    let server = ScriptedOpenAi::start(kit_script()).await.unwrap();
    // max 6, two tasks at once: clients' sessions without a task may hold 4.
    let d = Daemon::start(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", "local", "--max-concurrent", "2"],
        Some("[sessions]\nmax = 6\nwait_secs = 3\n"),
    )
    .await;
    let mut opened = Vec::new();
    let mut refusal = None;
    for _ in 0..8 {
        let (status, body) = d
            .send(reqwest::Method::POST, "/v1/sessions", Some("{}".to_owned()))
            .await;
        if status == 201 || status == 200 {
            opened.push(body["id"].as_str().unwrap().to_owned());
        } else {
            refusal = Some((status, body));
            break;
        }
    }
    assert_eq!(opened.len(), 4, "sessions one client holds: {refusal:?}");
    let (status, body) = refusal.unwrap();
    assert!(status == 429 || status == 503, "{status} {body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("[sessions] without_task") && message.contains("4 by clients"),
        "{message}"
    );
    // /v1/exec and MCP take from the same share: refused too, while it is full.
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/exec",
            Some(json!({"language": "python", "code": "print(1)"}).to_string()),
        )
        .await;
    assert!(status >= 400, "{status} {body}");
    // The idle sessions hold their share; tasks still get theirs, two at once.
    let (a, b) = tokio::join!(
        assert_served(&d, "four idle sessions"),
        assert_served(&d, "four idle sessions")
    );
    let _ = (a, b);
    // Closing one gives clients a place again.
    d.send(
        reqwest::Method::DELETE,
        &format!("/v1/sessions/{}", opened[0]),
        None,
    )
    .await;
    let (status, body) = d
        .send(reqwest::Method::POST, "/v1/sessions", Some("{}".to_owned()))
        .await;
    assert!(status == 201 || status == 200, "{status} {body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn schemas_past_the_bounds_are_refused_at_submit_on_every_road_and_answers_within_them_are_checked()
 {
    let chained_answer = "```json\n{\"a\": 7}\n```\nTERMINATE";
    let server = ScriptedOpenAi::start(script([
        ("chain past the bound", texts(&[chained_answer])),
        ("chain within the bound", texts(&[chained_answer])),
    ]))
    .await
    .unwrap();
    let d = kit_daemon(&server).await;
    // An output_schema of 24,000 links: accepted before, it took the daemon down when the
    // answer was validated.
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(
                json!({"task": "chain past the bound", "output_schema": ref_chain(24_000)})
                    .to_string(),
            ),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "invalid_request", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("output_schema: has more than 1000 `$ref`s"),
        "{message}"
    );
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(
                json!({"task": "chain past the bound", "output_schema": ref_chain(100)})
                    .to_string(),
            ),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("nests deeper than 64 levels"),
        "{body}"
    );
    // A command tool's parameters, on the API and over MCP.
    for schema in [ref_chain(24_000), alternatives_bomb(30)] {
        let spec = json!({"task": "chain past the bound", "tools": [
            {"name": "t", "command": ["true"], "parameters": schema}]});
        let (status, body) = d
            .send(reqwest::Method::POST, "/v1/tasks", Some(spec.to_string()))
            .await;
        assert_eq!(status, 400, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("parameters "),
            "{body}"
        );
        let mcp = Mcp::connect(&d).await.unwrap();
        let result = mcp.call_tool("run_task", spec).await;
        assert!(result.to_string().contains("parameters "), "{result}");
    }
    assert_alive(&d, "schemas past the bounds").await;
    // Within the bounds, the answer is checked against the whole chain.
    let id = d
        .submit(json!({"task": "chain within the bound", "output_schema": ref_chain(40)}))
        .await;
    let t = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(t.record.result, Some(json!({"a": 7})), "{t:?}");
    assert_alive(&d, "an answer checked against a chain of 40").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_served_model_refuses_schema_bombs_and_serves_the_next_client() {
    let models = crate::embedded::models_dir();
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let config = "[model]\nprovider = \"embedded\"\nmodel = \"qwen2.5-coder-0.5b\"\ntemperature = 0.0\nseed = 1\ncontext_tokens = 2048\n\n[policy]\nexecutors = [\"local\"]\n";
    let d = Daemon::start_with_env(
        Path::new(BIN),
        "http://127.0.0.1:9/v1",
        &["--listen", &addr],
        Some(config),
        &[("TANDEM_MODELS_DIR", models.as_str())],
    )
    .await;
    let hello = || {
        request(
            &d,
            "POST",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4})
                .to_string(),
        )
    };
    let (status, body) = hello().await.unwrap();
    assert_eq!(status, 200, "{body}");
    // A chain of references took the daemon down as the grammar was made; 30 levels of
    // alternatives stalled the engine for every client.
    for road in CHAT_ROADS {
        for input in hostile_clients::inputs() {
            let what = format!("{} on {}", input.name, road.name);
            let Via::Http(method, path) = road.via else {
                unreachable!()
            };
            let answered = tokio::time::timeout(
                Duration::from_secs(120),
                request(&d, method, path, road.body(&input)),
            )
            .await
            .unwrap_or_else(|_| panic!("{what}: no answer in 120 s"));
            let (status, body) = answered.unwrap_or_else(|e| panic!("{what}: {e}\n{}", d.log()));
            if must_refuse(road, &input) {
                assert_eq!(status, 400, "{what}: {body}");
                let message = body["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    message.contains("tools[0].function.parameters "),
                    "{what}: {message}"
                );
            }
            assert_alive(&d, &what).await;
        }
        let (status, body) = tokio::time::timeout(Duration::from_secs(120), hello())
            .await
            .unwrap_or_else(|_| panic!("the next client waited past 120 s after {}", road.name))
            .unwrap();
        assert_eq!(status, 200, "the next client after {}: {body}", road.name);
    }
}
