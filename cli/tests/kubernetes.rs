//! The Kubernetes executor through the binary, against the stand-in API server with
//! docs/deploy/kubernetes/ applied: `exec` in-process, `doctor` (pinned), and a daemon task
//! over the API; a missing section and a cluster that does not answer are told by name.

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tandem_protocol::StopReason;
use tandem_tests::kubernetes::FakeCluster;
use tandem_tests::{DaemonHarness as Daemon, ScriptedOpenAi, script, texts};

use crate::e2e::tandem;

async fn cluster() -> FakeCluster {
    FakeCluster::deployed().await
}

fn config(url: &str) -> String {
    format!("[executors.kubernetes]\nurl = \"{url}\"\nready_timeout_secs = 60\n")
}

/// A daemon (and its model server, kept alive with it) offering local and `cluster`'s
/// kubernetes executor to API clients.
async fn daemon_offering_kubernetes(cluster: &FakeCluster) -> (ScriptedOpenAi, Daemon) {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "local"],
        Some(&format!(
            "{}[policy]\nexecutors = [\"local\", \"kubernetes\"]\n",
            config(&cluster.url)
        )),
    )
    .await;
    (server, d)
}

/// Opens a session on `d` from `spec`, which must succeed; its id.
async fn open(d: &Daemon, spec: serde_json::Value) -> String {
    let (status, s) = d.open_session(spec).await;
    assert_eq!(status, 201, "{s}");
    s["id"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_and_doctor_use_the_configured_cluster() {
    let cluster = cluster().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tandem.toml");
    std::fs::write(&path, config(&cluster.url)).unwrap();
    let path = path.to_str().unwrap();
    let out = tandem(
        &[
            "exec",
            "--config",
            path,
            "--executor",
            "kubernetes",
            "--lang",
            "python",
            "-",
        ],
        &[],
        Some("import os\nprint('uid', os.getuid())"),
    )
    .await;
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "uid 65534\n"),
        "{}",
        out.stderr
    );
    cluster.wait_released().await;

    let out = tandem(&["doctor", "--config", path], &[], None).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("executor:  kubernetes"))
        .unwrap_or_else(|| panic!("no kubernetes line:\n{}", out.stdout))
        .replace(&cluster.url, "http://API");
    insta::assert_snapshot!("doctor_kubernetes", line);
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemon_offers_kubernetes_and_runs_a_task_in_a_pod() {
    let cluster = cluster().await;
    let task = "kubernetes: where am I";
    let server = ScriptedOpenAi::start(script([(
        task,
        texts(&[
            "```python\nprint(open('/proc/1/cmdline').read().split(chr(0))[0])\n```",
            "TERMINATE",
        ]),
    )]))
    .await
    .unwrap();
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "local"],
        Some(&config(&cluster.url)),
    )
    .await;
    let executors = d.get("/v1/executors").await;
    let kubernetes = executors["executors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "kubernetes")
        .unwrap_or_else(|| panic!("no kubernetes executor: {executors}"))
        .clone();
    assert_eq!(kubernetes["health"], "ok", "{kubernetes}");
    let id = d
        .submit(json!({"task": task, "executor": "kubernetes"}))
        .await;
    let done = d.wait_finished(&id, Duration::from_secs(120)).await;
    assert_eq!(
        done.record.stop_reason,
        Some(StopReason::Terminated),
        "{done:?}"
    );
    let events = d.text(&format!("/v1/tasks/{id}/events?follow=false")).await;
    // The pod's main process: the block ran in the claimed pod, not on this machine.
    assert!(events.contains(r#""stdout":"sleep\n""#), "{events}");
    cluster.wait_released().await;
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_taken_on_the_local_executor_resumes_in_a_pod() {
    let cluster = cluster().await;
    let (_server, d) = daemon_offering_kubernetes(&cluster).await;
    let here = open(&d, json!({"executor": "local"})).await;
    d.exec_python(
        &here,
        "import os\nos.makedirs('data/deep', exist_ok=True)\nopen('data/deep/x.csv', 'w').write('1,2\\n')\nopen('run.sh', 'w').write('echo ran')\nos.chmod('run.sh', 0o755)",
    )
    .await;
    let (status, record) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{here}/snapshot"),
            None,
        )
        .await;
    assert_eq!(status, 201, "{record}");
    let snap = record["id"].as_str().unwrap();
    let pod = open(&d, json!({"executor": "kubernetes", "from_snapshot": snap})).await;
    assert_eq!(
        d.exec_python(
            &pod,
            "import os\nprint(open('data/deep/x.csv').read().strip(), os.access('run.sh', os.X_OK), open('/proc/1/cmdline').read().split(chr(0))[0])"
        )
        .await["stdout"],
        "1,2 True sleep\n"
    );
    // What a block in a pod used, from the pod's cgroup: its peak since the pod started,
    // which the daemon cannot reset from outside.
    let used = d
        .exec_python(
            &pod,
            "b = bytearray(50_000_000)\nfor i in range(0, len(b), 4096):\n    b[i] = 1",
        )
        .await;
    let r = &used["resources"];
    assert!(r["cpu_secs"].as_f64().is_some(), "{used}");
    assert!(
        r["peak_memory_bytes"].as_f64().unwrap_or(0.0) >= 50e6,
        "{used}"
    );
    assert_eq!(r["peak_memory_scope"], "session", "{used}");
    d.send(
        reqwest::Method::DELETE,
        &format!("/v1/sessions/{pod}"),
        None,
    )
    .await;
    cluster.wait_released().await;
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_of_clients_that_hang_up_mid_open_and_of_open_sessions_end_with_the_daemon() {
    let cluster = cluster().await;
    // A loaded API server: each claim is made at once and answered a second later, so a
    // client that hangs up meanwhile leaves the daemon a claim it has not heard of yet.
    cluster.answer_claims_after(Duration::from_secs(1));
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let mut d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "local"],
        Some(&format!("{}[sessions]\nmax = 64\n", config(&cluster.url))),
    )
    .await;
    // Half of them with a volume: a sandbox of their own rather than a claim on the pool.
    let (code, _, err) = d.cli(&["volume", "create", "held"]).await;
    assert_eq!(code, 0, "{err}");
    let session = json!({"executor": "kubernetes", "idle_timeout_secs": 1});
    let with_volume = json!({"executor": "kubernetes", "idle_timeout_secs": 1,
        "volumes": [{"name": "held", "path": "/data"}]});
    let mut opens = tokio::task::JoinSet::new();
    for i in 0..6 {
        opens.spawn(crate::daemon::hang_up(
            d.socket(),
            "/v1/sessions",
            if i % 2 == 0 {
                session.clone()
            } else {
                with_volume.clone()
            },
            Duration::from_millis(300),
        ));
    }
    // And a session a client holds open when the daemon stops: one with a volume, whose
    // sandbox the daemon made itself.
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(
                json!({"executor": "kubernetes", "volumes": [{"name": "held", "path": "/data"}]})
                    .to_string(),
            ),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    while let Some(done) = opens.join_next().await {
        done.unwrap();
    }
    // Claims were made for the clients that hung up (whether the daemon has deleted them
    // yet depends on the machine's load: either way none may outlive it), and the held
    // session's own sandbox is there.
    let requests = cluster.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.starts_with("POST ") && r.ends_with("/sandboxclaims"))
            && cluster
                .objects("sandboxes")
                .iter()
                .any(|s| s["metadata"]["labels"]["tandem.dev/made"] == "session"),
        "{requests:?}"
    );
    d.sigterm();
    assert_eq!(d.wait_exit().await, Some(0), "{}", d.log());
    cluster.wait_released().await;
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_section_and_a_silent_cluster_are_told_by_name() {
    let out = tandem(
        &["exec", "--executor", "kubernetes", "--lang", "python", "-"],
        &[],
        Some("print(1)"),
    )
    .await;
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.contains(
            "the kubernetes executor is not configured; add an [executors.kubernetes] section"
        ),
        "{}",
        out.stderr
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tandem.toml");
    std::fs::write(&path, config("http://127.0.0.1:1")).unwrap();
    let out = tandem(
        &[
            "exec",
            "--config",
            path.to_str().unwrap(),
            "--executor",
            "kubernetes",
            "--lang",
            "python",
            "-",
        ],
        &[],
        Some("print(1)"),
    )
    .await;
    assert_ne!(out.code, 0);
    assert!(
        out.stderr
            .contains("cannot reach the Kubernetes API at http://127.0.0.1:1/"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_volume_made_on_the_daemon_is_mounted_in_pods_through_the_api() {
    let cluster = cluster().await;
    let (_server, d) = daemon_offering_kubernetes(&cluster).await;
    let (code, _, err) = d.cli(&["volume", "create", "shared"]).await;
    assert_eq!(code, 0, "{err}");
    let id = open(
        &d,
        json!({"executor": "kubernetes", "volumes": [{"name": "shared", "path": "/data"}]}),
    )
    .await;
    let wrote = d
        .exec_python(
            &id,
            "open('/data/kept.txt', 'w').write('from a pod')\nprint(open('/data/kept.txt').read())",
        )
        .await;
    assert_eq!(wrote["stdout"], "from a pod\n", "{wrote}");
    // Mounted: the daemon will not remove it.
    let (code, _, err) = d.cli(&["volume", "rm", "shared"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("mounted by 1"), "{err}");
    d.send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await;
    cluster.wait_released().await;
    let id = open(
        &d,
        json!({"executor": "kubernetes", "volumes": [{"name": "shared", "path": "/in", "read_only": true}]}),
    )
    .await;
    let read = d
        .exec_python(&id, "import errno\nprint(open('/in/kept.txt').read())\ntry:\n    open('/in/x', 'w')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])")
        .await;
    assert_eq!(read["stdout"], "from a pod\nEROFS\n", "{read}");
    // Inside the workspace, which a pod's mirror copies out: refused, naming the fix.
    let (status, body) = d
        .open_session(
            json!({"executor": "kubernetes", "volumes": [{"name": "shared", "path": "data"}]}),
        )
        .await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.to_string().contains("absolute path such as /data"),
        "{body}"
    );
    d.send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await;
    cluster.wait_released().await;
    assert_eq!(cluster.objects("persistentvolumeclaims").len(), 1);
    cluster.stop().await;
}
