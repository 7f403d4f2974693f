//! What each block uses: CPU time, the peak of memory and bytes written, measured in the
//! sandbox, on every road a block's result takes.

use std::path::Path;

use serde_json::{Value, json};
use tandem_tests::daemon::DaemonHarness;
use tandem_tests::{Reply, ScriptedOpenAi, script};

/// Touches every page of 200 MB, so that it is resident, not only reserved.
const ALLOCATE: &str =
    "b = bytearray(200_000_000)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint(len(b))";
/// One second of CPU, by the process's own clock: the same on a loaded machine.
const SPIN: &str = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\nprint('spun')";
/// 5 MB made durable in the workspace.
const WRITE: &str = "import os\nwith open('five.bin', 'wb') as f:\n    f.write(os.urandom(5_000_000))\n    f.flush()\n    os.fsync(f.fileno())\nprint('written')";

const LIMIT: u64 = 768 << 20;

/// A daemon started with `args` whose model answers `task` with one Python block per turn,
/// `blocks` in order, then ends.
async fn serve_blocks(
    task: &str,
    blocks: &[&str],
    args: &[&str],
) -> (ScriptedOpenAi, DaemonHarness) {
    let mut replies: Vec<Reply> = blocks
        .iter()
        .map(|code| Reply::Text(crate::e2e::fence("python", code)))
        .collect();
    replies.push(Reply::from("Done.\n\nTERMINATE"));
    let server = ScriptedOpenAi::start(script([(task, replies)]))
        .await
        .unwrap();
    let d = DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        args,
        None,
    )
    .await;
    (server, d)
}

fn figure(result: &Value, key: &str) -> f64 {
    result["resources"][key]
        .as_f64()
        .unwrap_or_else(|| panic!("no {key} in {result}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_block_says_what_it_used_on_docker_and_local_and_a_session_sums_it() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "docker"],
        Some("[policy]\nexecutors = [\"docker\", \"local\"]\n"),
    )
    .await;
    // A session that keeps its interpreter runs every Python block in one process, which
    // measures each block itself.
    for (executor, keep_state) in [("docker", false), ("local", false), ("local", true)] {
        let (status, opened) = d
            .open_session(json!({
                "executor": executor,
                "keep_state": keep_state,
                "limits": {"memory_bytes": LIMIT},
            }))
            .await;
        assert_eq!(status, 201, "{opened}");
        let id = opened["id"].as_str().unwrap().to_owned();
        let executor = if keep_state { "local, kept" } else { executor };

        let big = d.exec_python(&id, ALLOCATE).await;
        assert_eq!(big["stdout"], "200000000\n", "{executor}: {big}");
        let peak = figure(&big, "peak_memory_bytes");
        assert!(
            (200e6..=LIMIT as f64).contains(&peak),
            "{executor}: a 200 MB block's peak is {peak}: {big}"
        );
        if !keep_state {
            assert_eq!(
                big["resources"]["peak_memory_scope"], "block",
                "{executor}: {big}"
            );
            // The peak is the block's own: the next, small block does not inherit it. (A
            // kept interpreter still holds the 200 MB in its globals.)
            let small = d.exec_python(&id, "print(1)").await;
            let after = figure(&small, "peak_memory_bytes");
            assert!(
                after < 150e6,
                "{executor}: print(1) after it peaked at {after}: {small}"
            );
        }

        let spun = d.exec_python(&id, SPIN).await;
        assert_eq!(spun["stdout"], "spun\n", "{executor}: {spun}");
        let cpu = figure(&spun, "cpu_secs");
        assert!(
            (0.9..=2.5).contains(&cpu),
            "{executor}: one second of CPU reported as {cpu}: {spun}"
        );

        let wrote = d.exec_python(&id, WRITE).await;
        assert_eq!(wrote["stdout"], "written\n", "{executor}: {wrote}");
        let disk = figure(&wrote, "disk_written_bytes");
        assert!(
            disk >= 5e6,
            "{executor}: 5 MB written counted as {disk}: {wrote}"
        );

        // The session's answer sums its blocks, and keeps the largest peak.
        let info = d.get(&format!("/v1/sessions/{id}")).await;
        let total = &info["resources"];
        assert!(
            total["cpu_secs"].as_f64().unwrap() >= cpu,
            "{executor}: {info}"
        );
        assert!(
            total["peak_memory_bytes"].as_f64().unwrap() >= peak,
            "{executor}: {info}"
        );
        assert!(
            total["disk_written_bytes"].as_f64().unwrap() >= disk,
            "{executor}: {info}"
        );
        let (status, _) = d
            .send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
            .await;
        assert!(status < 300, "{executor}: closing answered {status}");
    }

    let metrics = d.text("/metrics").await;
    for executor in ["docker", "local"] {
        for family in [
            "tandem_block_cpu_seconds_total",
            "tandem_block_disk_written_bytes_total",
            "tandem_block_peak_memory_bytes_count",
        ] {
            let line = format!("{family}{{executor=\"{executor}\"}}");
            assert!(metrics.contains(&line), "no {line} in /metrics:\n{metrics}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_blocks_carry_their_usage_into_events_the_transcript_and_a_memory_kill() {
    let task = "resources: allocate";
    let (_server, d) = serve_blocks(
        task,
        &[
            ALLOCATE,
            "b = bytearray(2_000_000_000)\nfor i in range(0, len(b), 4096):\n    b[i] = 1",
        ],
        &["--executor", "docker"],
    )
    .await;
    let id = d
        .submit(json!({"task": task, "limits": {"memory_bytes": LIMIT}}))
        .await;
    d.wait_finished(&id, std::time::Duration::from_secs(180))
        .await;
    let events = d.events(&id, 0).await;
    let results = tandem_tests::daemon::block_results(&events);
    assert_eq!(results.len(), 2, "{events:?}");
    let peak = results[0]
        .resources
        .as_ref()
        .and_then(|r| r.peak_memory_bytes)
        .unwrap_or_else(|| panic!("{:?}", results[0]));
    assert!(peak >= 200_000_000, "{:?}", results[0]);
    assert_eq!(
        results[1].status,
        tandem_protocol::BlockStatus::OutOfMemory,
        "{:?}",
        results[1]
    );
    assert!(
        results[1]
            .stderr
            .contains("over the sandbox's memory limit (limits.memory_bytes); its peak was"),
        "{}",
        results[1].stderr
    );

    // `tandem show` lists each block with what it used, and the sum; `tandem logs` puts
    // it in each block's footer.
    let (code, shown, err) = d.cli(&["show", &id]).await;
    assert_eq!(code, 0, "{err}");
    let blocks: Vec<&str> = shown
        .lines()
        .skip_while(|l| *l != "── blocks ──")
        .skip(1)
        .take(3)
        .collect();
    assert!(
        blocks[0].starts_with("turn 1 block 1: exit 0 · ") && blocks[0].contains(" · cpu "),
        "{shown}"
    );
    assert!(
        blocks[1].starts_with("turn 2 block 1: out of memory; killed · cpu "),
        "{shown}"
    );
    assert!(blocks[2].starts_with("all blocks: cpu "), "{shown}");
    let (code, logged, err) = d.cli(&["logs", &id]).await;
    assert_eq!(code, 0, "{err}");
    let footers = logged.lines().filter(|l| l.contains(" · cpu ")).count();
    assert_eq!(footers, 2, "{logged}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_block_past_its_memory_limit_says_which_limit_and_its_peak() {
    let task = "resources: past the limit on local";
    let (_server, d) =
        serve_blocks(task, &["b = bytearray(2_000_000_000)\nprint(len(b))"], &[]).await;
    let id = d
        .submit(json!({"task": task, "executor": "local", "limits": {"memory_bytes": LIMIT}}))
        .await;
    d.wait_finished(&id, std::time::Duration::from_secs(180))
        .await;
    let events = d.events(&id, 0).await;
    let results = tandem_tests::daemon::block_results(&events);
    assert_eq!(results.len(), 1, "{events:?}");
    assert!(
        results[0].stderr.contains(
            "out of memory: an allocation failed at the sandbox's memory limit (limits.memory_bytes); its peak was"
        ),
        "{}",
        results[0].stderr
    );
}
