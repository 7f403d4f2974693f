//! The Docker executor's warm pool through the daemon: a burst far larger than the pool is
//! served whole, in line, and the pool is seen growing in `/v1/executors` and `/metrics`.

use std::path::Path;

use serde_json::json;
use tandem_tests::daemon::DaemonHarness;
use tandem_tests::{ScriptedOpenAi, script};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_fifty_sessions_on_a_pool_of_two_all_succeed_and_the_pool_is_seen() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "docker"],
        Some("[executors.docker]\npool_size = 2\npool_max = 8\n\n[sessions]\nmax = 80\nwithout_task = 60\n"),
    )
    .await;
    let opens = (0..50).map(|_| async {
        let (status, session) = d
            .send(reqwest::Method::POST, "/v1/sessions", Some("{}".to_owned()))
            .await;
        assert_eq!(status, 201, "{session}");
        let id = session["id"].as_str().unwrap().to_owned();
        let (status, ran) = d
            .send(
                reqwest::Method::POST,
                &format!("/v1/sessions/{id}/exec"),
                Some(json!({"language": "python", "code": "print(1)"}).to_string()),
            )
            .await;
        assert_eq!(
            (status, ran["stdout"].as_str()),
            (200, Some("1\n")),
            "{ran}"
        );
        let waited = session["pool_wait_ms"].as_u64();
        d.send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
            .await;
        waited
    });
    let waits = futures::future::join_all(opens).await;
    // Every one was served by the pool (none started its own beside it), and told its wait.
    assert!(waits.iter().all(Option::is_some), "{waits:?}");
    let executors = d.get("/v1/executors").await;
    let docker = executors["executors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "docker")
        .unwrap()
        .clone();
    let pool = &docker["pools"][0];
    assert_eq!(
        pool["hits"].as_u64().unwrap() + pool["misses"].as_u64().unwrap(),
        50,
        "{docker}"
    );
    // Fifty at once outgrew a pool of two: some waited in line.
    assert!(pool["misses"].as_u64().unwrap() > 0, "{docker}");
    assert!(pool["target"].as_u64().unwrap() <= 8, "{docker}");
    let metrics = d.text("/metrics").await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("tandem_pool_misses_total{executor=\"docker\"")),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("tandem_pool_containers{executor=\"docker\"")),
        "{metrics}"
    );
}
