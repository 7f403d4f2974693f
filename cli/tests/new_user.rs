//! What a new user meets, through the real binary: the whole of a long output, the reason a
//! block was refused, one daemon per state dir, prompts that name what runs. What a person
//! sees is pinned by snapshots (`cli/tests/snapshots`), with timings and ports masked.

use std::path::Path;

use crate::e2e::{fence, settings, tandem};
use tandem_protocol::{EventMsg, TaskState};
use tandem_tests::{Reply, ScriptedOpenAi, script};

/// A config whose output cap is small enough to read a cut output whole.
fn small_output_config(dir: &Path) -> String {
    let path = dir.join("tandem.toml");
    std::fs::write(&path, "[limits]\noutput_bytes = 64\n").unwrap();
    path.display().to_string()
}

const LONG: &str = "for i in range(40):\n    print('line', i)";

#[tokio::test(flavor = "multi_thread")]
async fn exec_shows_the_head_the_cut_the_tail_and_why_a_block_was_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_output_config(dir.path());
    let markdown = [
        fence("python", LONG),
        fence("python", "print('second block')"),
        fence("python", "# filename: ../escape.py\nprint('never')"),
    ]
    .join("\n\n");
    let out = tandem(&["exec", "--config", &config], &[], Some(&markdown)).await;
    assert_eq!(out.code, 1);
    settings().bind(|| {
        insta::assert_snapshot!(
            "exec_long_output_and_refusal",
            format!("stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr)
        )
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn run_shows_the_head_the_cut_and_the_tail() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_output_config(dir.path());
    let task = "new user: long output";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", LONG)),
            Reply::Text(fence("python", "# filename: ../escape.py\nprint(1)")),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let url = server.base_url();
    let out = tandem(
        &[
            "run",
            "--config",
            &config,
            "--base-url",
            &url,
            "--model",
            "m",
            task,
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    settings().bind(|| insta::assert_snapshot!("run_long_output_and_refusal", out.stdout));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_daemon_on_the_same_state_dir_is_refused_and_names_the_first() {
    let task = "new user: keep running";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![Reply::Text(fence("python", "import time\ntime.sleep(30)"))],
    )]))
    .await
    .unwrap();
    let d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
    )
    .await;
    let id = d.submit(serde_json::json!({"task": task})).await;
    let started = std::time::Instant::now();
    while d.task(&id).await.record.state != TaskState::Running {
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let other = tempfile::tempdir().unwrap();
    let state = d.state_dir().display().to_string();
    let socket = other.path().join("other.sock").display().to_string();
    let out = tandem(
        &["serve", "--state-dir", &state, "--socket", &socket],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert_eq!(
        out.stderr,
        format!(
            "tandem: the state dir {state} is in use by another tandem daemon (pid {}); stop it first, or give this one another --state-dir\n",
            d.pid()
        )
    );
    assert_eq!(d.task(&id).await.record.state, TaskState::Running);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_prompt_names_only_what_the_executor_runs_and_exec_says_which_would() {
    let task = "new user: wasm prompt";
    let server = ScriptedOpenAi::start(script([(task, vec![Reply::from("TERMINATE")])]))
        .await
        .unwrap();
    let url = server.base_url();
    let out = tandem(
        &[
            "run",
            "--executor",
            "wasm",
            "--base-url",
            &url,
            "--model",
            "m",
            task,
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let request = &server.requests_for(task)[0];
    let system = request.body["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("complete code in ```python blocks (preferred) or ```javascript blocks."),
        "{system}"
    );
    assert!(!system.contains("```sh"), "{system}");

    let out = tandem(
        &["exec", "--executor", "wasm", "--lang", "sh"],
        &[],
        Some("echo hi"),
    )
    .await;
    assert_eq!(out.code, 1);
    assert_eq!(
        out.stderr,
        "language `sh` is not supported by the wasm executor; supported: python, javascript\ntandem: block 1: not run: unsupported language\ntandem: `sh` runs on the docker or local executor: pass --executor docker\n"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_offline_image_stands_in_and_a_missing_one_is_refused_up_front() {
    // Nobody chose an image: the locally built one stands in for an absent default.
    let out = tandem(&["doctor"], &[("TANDEM_DOCKER_IMAGE", "")], None).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let default_present = std::process::Command::new("docker")
        .args(["image", "inspect", "python:3.12-slim"])
        .output()
        .unwrap()
        .status
        .success();
    // Either way something is checked: the stand-in when the default is absent (as with no
    // registry), the default itself when it is there.
    let expected = if default_present {
        "image `python:3.12-slim` present\n"
    } else {
        "image `tandem-sandbox:latest` present (`python:3.12-slim` is not present; the locally built image stands in)"
    };
    assert!(out.stdout.contains(expected), "{}", out.stdout);
    assert!(out.stdout.contains("auto:      docker ("), "{}", out.stdout);

    // A daemon whose image is not there says so, and refuses docker tasks before any turn.
    let server = ScriptedOpenAi::start(script([("docker task", vec![Reply::from("TERMINATE")])]))
        .await
        .unwrap();
    let d = tandem_tests::DaemonHarness::start_with_env(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some("[executors.docker]\nimage = \"tandem-no-such-image:1\"\n"),
        &[("TANDEM_DOCKER_IMAGE", "")],
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
    assert_eq!(docker["health"], "unavailable", "{docker}");
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(serde_json::json!({"task": "docker task", "executor": "docker"}).to_string()),
        )
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "executor_unavailable");
    assert_eq!(
        body["error"]["message"],
        "the docker executor cannot run tasks now: image `tandem-no-such-image:1` is not present; pull it (`docker pull tandem-no-such-image:1`), or build one offline with scripts/build-sandbox-image.sh"
    );
    assert!(server.requests().is_empty(), "a model turn was spent");
}

#[tokio::test(flavor = "multi_thread")]
async fn during_the_grace_reads_and_streams_go_on_and_new_work_is_refused() {
    let task = "new user: finish during the grace";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence(
                "python",
                "import time\nprint('started', flush=True)\ntime.sleep(3)\nprint('finished')",
            )),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let mut d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--grace", "30"],
        None,
    )
    .await;
    let id = d.submit(serde_json::json!({"task": task})).await;
    // A follower, as `tandem logs -f` is, from before the signal.
    let stream = d
        .http()
        .get(format!("http://tandem/v1/tasks/{id}/events"))
        .send()
        .await
        .unwrap();
    let follower = tokio::spawn(async move {
        use futures::StreamExt;
        let mut body = stream.bytes_stream();
        let mut seen = String::new();
        while let Some(Ok(chunk)) = body.next().await {
            seen.push_str(&String::from_utf8_lossy(&chunk));
            if seen.contains("\"task_finished\"") {
                break;
            }
        }
        seen
    });
    let started = std::time::Instant::now();
    while !d
        .events(&id, 0)
        .await
        .iter()
        .any(|e| matches!(e.msg, EventMsg::ExecOutput { .. }))
    {
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    d.sigterm();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let (status, health) = d.send(reqwest::Method::GET, "/healthz", None).await;
    assert_eq!((status, health["status"].as_str()), (503, Some("stopping")));
    let (status, _) = d
        .send(reqwest::Method::GET, &format!("/v1/tasks/{id}"), None)
        .await;
    assert_eq!(status, 200);
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(serde_json::json!({"task": "too late"}).to_string()),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("shutting_down"))
    );
    let seen = tokio::time::timeout(std::time::Duration::from_secs(30), follower)
        .await
        .expect("the follower saw no end")
        .unwrap();
    assert!(seen.contains("finished\\n"), "{seen}");
    assert!(seen.contains("\"stop_reason\":\"terminated\""), "{seen}");
    assert_eq!(d.wait_exit().await, Some(0), "{}", d.log());
}

#[tokio::test(flavor = "multi_thread")]
async fn run_says_where_it_runs_and_why_it_left_the_daemon() {
    let task = "new user: where";
    let server = ScriptedOpenAi::start(script([(task, vec![Reply::from("TERMINATE")])]))
        .await
        .unwrap();
    let d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        None,
    )
    .await;
    let url = server.base_url();
    let workdir = tempfile::tempdir().unwrap();
    let workdir = workdir.path().display().to_string();
    let host = d.host();
    let socket = d.socket().display().to_string();
    // Through the daemon, named by its socket's plain path.
    let out = tandem(&["run", "--host", &socket, task], &[], None).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let header = out.stdout.lines().next().unwrap_or_default().to_owned();
    assert!(
        header.ends_with(&format!(" · on the daemon at {host} ──")),
        "{header}"
    );
    // A directory of this machine: here, and said so.
    let out = tandem(
        &[
            "run",
            "--host",
            &host,
            "--workdir",
            &workdir,
            "--base-url",
            &url,
            task,
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .lines()
            .next()
            .unwrap_or_default()
            .ends_with(" · in this process ──"),
        "{}",
        out.stdout
    );
    assert_eq!(
        out.stderr,
        format!(
            "tandem: running in this process, not on the daemon at {host}: the daemon cannot honour --workdir (a directory or image of this machine); the model settings are this shell's\n"
        )
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn no_noise_one_line_per_retry_no_colour_in_pipes_no_retry_of_a_bad_name() {
    let task = "new user: retry once";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Error(500, "busy".to_owned()),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    // The scripted server answers by turn, so a retry of turn 1 gets the next reply.
    let url = server.base_url();
    let out = tandem(
        &["run", "--base-url", &url, "--model", "m", task],
        &[("TANDEM_MAX_RETRIES", "1"), ("RUST_LOG", "debug")],
        None,
    )
    .await;
    let both = format!("{}{}", out.stdout, out.stderr);
    assert_eq!(both.matches("retry 1").count(), 1, "{both}");
    assert!(
        !out.stderr.contains('\u{1b}'),
        "colour codes in a pipe: {}",
        out.stderr
    );
    assert!(
        out.stderr.contains("DEBUG"),
        "no debug log to check: {}",
        out.stderr
    );

    // A host name that does not resolve is not retried.
    let started = std::time::Instant::now();
    let out = tandem(
        &[
            "run",
            "--json",
            "--base-url",
            "http://tandem-no-such-host.invalid/v1",
            "t",
        ],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(!out.stdout.contains("model_retry"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("cannot resolve the model server's host"),
        "{}",
        out.stdout
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_are_all_json_and_one_turn_is_one_turn() {
    let task = "new user: one turn";
    let server = ScriptedOpenAi::start(script([(task, vec![Reply::from("TERMINATE")])]))
        .await
        .unwrap();
    let mut d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--log-format", "json", "--listen", "127.0.0.1:0"],
        None,
    )
    .await;
    let id = d.submit(serde_json::json!({"task": task})).await;
    d.wait_finished(&id, std::time::Duration::from_secs(30))
        .await;
    let host = d.host();
    let out = tandem(&["show", "--host", &host, &id], &[], None).await;
    assert!(
        out.stdout
            .starts_with(&format!("task {id} · finished (terminated) · 1 turn · ")),
        "{}",
        out.stdout
    );
    assert_eq!(d.terminate().await, Some(0));
    let log = d.log();
    for line in log.lines() {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "not JSON: {line}"
        );
    }
    assert!(log.contains("generated a TCP token"), "{log}");
    assert!(log.contains("shutting down"), "{log}");
}

/// A daemon whose stderr is gone (the shell that started it closed) still starts, serves and
/// stops on SIGTERM: a line it cannot print is dropped, not a panic.
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_with_no_stderr_still_serves_and_stops() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "serve",
            "--executor",
            "local",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
        ])
        .arg(dir.path())
        .arg("--socket")
        .arg(&socket)
        .env("XDG_CONFIG_HOME", dir.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    let started = std::time::Instant::now();
    while !socket.exists() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the daemon did not start: {:?}",
            child.try_wait()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        matches!(child.try_wait(), Ok(None)),
        "the daemon died: {:?}",
        child.try_wait()
    );
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(15), child.wait())
        .await
        .expect("SIGTERM went unanswered")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}
