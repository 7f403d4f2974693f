//! A task's network through the egress proxy, on the CLI in process and on the daemon's API,
//! against servers in a network namespace the test makes (tandem_tests::internet).

use std::time::Duration;

use serde_json::{Value, json};
use tandem_tests::daemon::DaemonHarness;
use tandem_tests::internet::Internet;
use tandem_tests::{Reply, ScriptedOpenAi, script};

use crate::e2e::{fence, tandem};

const FETCH: &str = r#"import urllib.request, urllib.error
print(urllib.request.urlopen("http://files.test/hello", timeout=30).read().decode().splitlines()[0])
try:
    urllib.request.urlopen("http://other.test/", timeout=30)
except urllib.error.HTTPError as e:
    print("other:", e.code)"#;

fn replies() -> Vec<Reply> {
    vec![
        Reply::Text(fence("python", FETCH)),
        Reply::from("Fetched.\n\nTERMINATE"),
    ]
}

fn events_of(stdout: &str, kind: &str) -> Vec<Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["type"] == kind)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_in_process_reaches_an_allowed_host_from_docker_and_local_and_records_each_connection()
{
    let net = Internet::new();
    net.http_server(80);
    let task = "network: fetch files.test";
    let server = ScriptedOpenAi::start(script([(task, replies())]))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
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
        let results = events_of(&out.stdout, "exec_result");
        let printed = results[0]["result"]["stdout"].as_str().unwrap_or_default();
        assert!(
            printed.contains("seen: GET /hello HTTP/1.1") && printed.contains("other: 403"),
            "{printed}"
        );
        let net_events = events_of(&out.stdout, "net");
        assert_eq!(net_events.len(), 2, "{net_events:?}");
        assert_eq!(
            (
                &net_events[0]["host"],
                &net_events[0]["verdict"],
                &net_events[0]["rule"]
            ),
            (
                &json!("files.test"),
                &json!("allowed"),
                &json!("files.test")
            )
        );
        assert_eq!(
            (
                &net_events[1]["host"],
                &net_events[1]["verdict"],
                &net_events[1]["rule"]
            ),
            (&json!("other.test"), &json!("denied"), &json!("default"))
        );
        // The model was told which hosts it may reach.
        let asked = server.requests();
        assert!(
            asked.iter().any(|r| r.body.to_string().contains(
                "reach these hosts over HTTP and HTTPS, and nothing else on the network: files.test"
            )),
            "the system prompt does not name the allowed hosts"
        );
    }

    // doctor says what applies.
    let doctor = tandem(&["doctor", "--config", config.to_str().unwrap()], &[], None).await;
    assert!(
        doctor.stdout.contains("network:   nothing allowed unless a task asks (--allow-host) through Tandem's egress proxy"),
        "{}",
        doctor.stdout
    );

    // A bad entry is refused before anything runs, naming it.
    let out = tandem(
        &["run", "--base-url", &url, "--allow-host", "*.", task],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("no domain after *."), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_gives_a_client_only_what_its_operator_allows() {
    let net = Internet::new();
    net.http_server(80);
    let task = "network: fetch files.test";
    let server = ScriptedOpenAi::start(script([(task, replies())]))
        .await
        .unwrap();
    let config = format!(
        "[network]\nallow = [\"files.test\", \"*.example.com\"]\nresolve = {{ \"files.test\" = [\"{}\"] }}\n",
        net.addr
    );
    let daemon = DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "docker"],
        Some(&config),
    )
    .await;
    // Outside [network] allow: refused with 400, naming the host and the setting.
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": task, "network": {"allow": ["evil.test"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    let said = body.to_string();
    assert!(
        said.contains("evil.test") && said.contains("[network] allow"),
        "{said}"
    );
    // An entry that does not parse: 400, named.
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": task, "network": {"allow": ["a.test:70000"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("over 65535"), "{body}");
    // Within it: the task's sandbox reaches the host, and the events say so.
    let id = daemon
        .submit(json!({"task": task, "network": {"allow": ["files.test"]}}))
        .await;
    daemon.wait_finished(&id, Duration::from_secs(300)).await;
    let events = daemon.raw_events(&id, 0).await;
    let nets: Vec<&Value> = events.iter().filter(|e| e["type"] == "net").collect();
    assert_eq!(nets.len(), 2, "{events:?}");
    assert_eq!(
        (&nets[0]["verdict"], &nets[0]["host"]),
        (&json!("allowed"), &json!("files.test"))
    );
    assert_eq!(
        (&nets[1]["verdict"], &nets[1]["rule"]),
        (&json!("denied"), &json!("default"))
    );
    let printed = daemon.block_stdouts(&id).await.join("");
    assert!(printed.contains("seen: GET /hello"), "{printed}");

    // A session without a task: the same bound, and each connection streamed as a line.
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/exec",
            Some(json!({"language": "python", "code": "print(1)", "network": {"allow": ["evil.test"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("evil.test"), "{body}");
    let (status, session) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"network": {"allow": ["files.test"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{session}");
    let sid = session["id"].as_str().unwrap();
    let streamed = daemon
        .http()
        .post(format!("http://tandem/v1/sessions/{sid}/exec"))
        .header("accept", "application/x-ndjson")
        .json(&json!({"language": "python", "code": FETCH}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let lines: Vec<Value> = streamed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let nets: Vec<&Value> = lines.iter().filter(|l| l["type"] == "net").collect();
    assert_eq!(nets.len(), 2, "{streamed}");
    assert_eq!(
        (&nets[0]["verdict"], &nets[0]["host"]),
        (&json!("allowed"), &json!("files.test"))
    );
    assert_eq!(
        (&nets[1]["verdict"], &nets[1]["host"]),
        (&json!("denied"), &json!("other.test"))
    );
    let last = lines.last().unwrap();
    assert_eq!(last["type"], "result", "{streamed}");
    assert!(
        last["result"]["stdout"]
            .as_str()
            .unwrap()
            .contains("seen: GET /hello"),
        "{streamed}"
    );
}
