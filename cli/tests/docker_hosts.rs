//! Several Docker hosts through the binary: `doctor` shows each one's health (pinned), the
//! daemon's API, metrics and placement refusals name them, a task placed by label runs,
//! and configuration mistakes are told by name. The hosts are the system engine and an
//! address nothing answers at; a real second engine is in tests/tests/docker_hosts.rs.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use tandem_protocol::StopReason;
use tandem_tests::{DaemonHarness as Daemon, ScriptedOpenAi, script, texts};

use crate::e2e::tandem;

/// Two hosts: the system engine, and one nothing listens at.
fn config() -> String {
    let image =
        std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned());
    format!(
        r#"
[executors.docker]
image = "{image}"
pull = false
pool_size = 0

[[executors.docker.hosts]]
name = "a"
url = "unix:///var/run/docker.sock"
capacity = 3
labels = {{ zone = "a" }}

[[executors.docker.hosts]]
name = "b"
url = "tcp://127.0.0.1:1"
capacity = 2
labels = {{ zone = "b", gpu = "yes" }}
"#
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_shows_each_docker_host_and_why_one_is_down() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tandem.toml");
    std::fs::write(&path, config()).unwrap();
    let out = tandem(&["doctor", "--config", path.to_str().unwrap()], &[], None).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let docker: Vec<&str> = out
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with("executor:  docker"))
        .take_while(|l| l.starts_with("executor:  docker") || l.starts_with("           host "))
        .collect();
    insta::assert_snapshot!("doctor_docker_hosts", docker.join("\n"));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_shows_each_host_and_places_a_task_by_label() {
    let task = "hosts: placed on a";
    let server = ScriptedOpenAi::start(script([(
        task,
        texts(&["```python\nprint('placed')\n```", "TERMINATE"]),
    )]))
    .await
    .unwrap();
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "docker"],
        Some(&config()),
    )
    .await;
    let executors = d.get("/v1/executors").await;
    let docker = executors["executors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "docker")
        .unwrap()
        .clone();
    assert_eq!(docker["health"], "ok", "{docker}");
    let hosts = docker["hosts"].as_array().unwrap();
    assert_eq!(
        (&hosts[0]["name"], &hosts[0]["up"], &hosts[0]["capacity"]),
        (&json!("a"), &json!(true), &json!(3))
    );
    assert_eq!(
        (&hosts[1]["name"], &hosts[1]["up"]),
        (&json!("b"), &json!(false))
    );
    assert!(
        hosts[1]["reason"]
            .as_str()
            .unwrap()
            .contains("Connection refused"),
        "{}",
        hosts[1]
    );
    let metrics = d.text("/metrics").await;
    for line in [
        "tandem_host_up{executor=\"docker\",host=\"a\"} 1",
        "tandem_host_up{executor=\"docker\",host=\"b\"} 0",
        "tandem_host_capacity{executor=\"docker\",host=\"b\"} 2",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in:\n{metrics}"
        );
    }

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
    assert_eq!(
        refused(json!({"task": "x", "placement": {"gpu": "no"}})).await,
        (
            400,
            "placement: no host of the docker executor carries gpu=no; its hosts: a (zone=a); b (gpu=yes, zone=b)".to_owned()
        )
    );
    let (status, message) =
        refused(json!({"task": "x", "executor": "wasm", "placement": {"zone": "a"}})).await;
    assert_eq!(status, 400);
    assert!(
        message.starts_with("placement: the wasm executor runs every session in one place"),
        "{message}"
    );

    let id = d
        .submit(json!({"task": task, "placement": {"zone": "a"}}))
        .await;
    let done = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(
        done.record.stop_reason,
        Some(StopReason::Terminated),
        "{done:?}"
    );
    let events = d.text(&format!("/v1/tasks/{id}/events?follow=false")).await;
    assert!(events.contains(r#""stdout":"placed\n""#), "{events}");
}

#[tokio::test(flavor = "multi_thread")]
async fn mistakes_in_the_hosts_are_told_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tandem.toml");
    for (config, says) in [
        (
            "[[executors.docker.hosts]]\nurl = \"tcp://10.0.0.2:2376\"\nworkspace = \"bind\"\n",
            "[[executors.docker.hosts]] #1 workspace = \"bind\" needs an engine on this machine (a unix:// socket); tcp://10.0.0.2:2376 is another machine's, so use \"volume\"",
        ),
        (
            "[[executors.docker.hosts]]\nurl = \"tcp://10.0.0.2:2376\"\nca = \"/ca.pem\"\n",
            "[[executors.docker.hosts]] #1 needs all of ca, cert and key for TLS, or none of them",
        ),
        (
            "[[executors.docker.hosts]]\nname = \"x\"\nurl = \"unix:///a.sock\"\n[[executors.docker.hosts]]\nname = \"x\"\nurl = \"unix:///b.sock\"\n",
            "[[executors.docker.hosts]] #2: two hosts are named `x`; give each its own name",
        ),
    ] {
        std::fs::write(&path, config).unwrap();
        let out = tandem(
            &[
                "exec",
                "--config",
                path.to_str().unwrap(),
                "--executor",
                "docker",
                "--lang",
                "python",
                "-",
            ],
            &[],
            Some("print(1)"),
        )
        .await;
        assert_ne!(out.code, 0);
        assert!(out.stderr.contains(says), "{}", out.stderr);
    }
}

/// Runs `print(...)` after a pause with `env`, and checks that a Tandem container showed up on
/// the second engine meanwhile: the conventions led `tandem exec` there.
async fn exec_lands_on_the_second_engine(env: &[(&str, &str)]) {
    let engine = tandem_tests::second_engine::shared().await;
    let _held = tandem_tests::second_engine::EXCLUSIVE.read().await;
    let image = tandem_tests::second_engine::image();
    let running = {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .chain([("TANDEM_DOCKER_IMAGE".to_owned(), image)])
            .collect();
        tokio::spawn(async move {
            let env: Vec<(&str, &str)> =
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            tandem(
                &["exec", "--executor", "docker", "--lang", "python", "-"],
                &env,
                Some("import time\ntime.sleep(4)\nprint('on b')"),
            )
            .await
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while engine
        .cli(&["ps", "-q", "--filter", "label=tandem.owner"])
        .is_empty()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no Tandem container appeared on the second engine"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = running.await.unwrap();
    assert_eq!((out.code, out.stdout.trim()), (0, "on b"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_host_and_its_tls_variables_lead_to_a_remote_engine() {
    let engine = tandem_tests::second_engine::shared().await;
    // DOCKER_CERT_PATH holds the files under the docker CLI's names.
    let certs = tempfile::tempdir().unwrap();
    for (from, to) in [
        (&engine.tls.ca, "ca.pem"),
        (&engine.tls.cert, "cert.pem"),
        (&engine.tls.key, "key.pem"),
    ] {
        std::fs::copy(from, certs.path().join(to)).unwrap();
    }
    exec_lands_on_the_second_engine(&[
        ("DOCKER_HOST", &engine.url),
        ("DOCKER_TLS_VERIFY", "1"),
        ("DOCKER_CERT_PATH", certs.path().to_str().unwrap()),
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_docker_clis_current_context_leads_to_a_remote_engine() {
    use sha2::Digest;
    let engine = tandem_tests::second_engine::shared().await;
    let config = tempfile::tempdir().unwrap();
    let d = config.path();
    std::fs::write(d.join("config.json"), r#"{"currentContext": "engine-b"}"#).unwrap();
    let id = hex::encode(sha2::Sha256::digest(b"engine-b"));
    let meta = d.join("contexts/meta").join(&id);
    std::fs::create_dir_all(&meta).unwrap();
    std::fs::write(
        meta.join("meta.json"),
        json!({"Name": "engine-b", "Endpoints": {"docker": {"Host": engine.url, "SkipTLSVerify": false}}})
            .to_string(),
    )
    .unwrap();
    let tls = d.join("contexts/tls").join(&id).join("docker");
    std::fs::create_dir_all(&tls).unwrap();
    for (from, to) in [
        (&engine.tls.ca, "ca.pem"),
        (&engine.tls.cert, "cert.pem"),
        (&engine.tls.key, "key.pem"),
    ] {
        std::fs::copy(from, tls.join(to)).unwrap();
    }
    exec_lands_on_the_second_engine(&[("DOCKER_HOST", ""), ("DOCKER_CONFIG", d.to_str().unwrap())])
        .await;
}
