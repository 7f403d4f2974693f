//! The hostile-input suite against the daemon: what a hostile API client, or a hostile model
//! server, or code turned against its host would try. Each case is judged where the harm would
//! land: the listener that must not see the key, the task that must end, the daemon that
//! must keep serving.

use std::path::Path;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde_json::{Value, json};
use tandem_protocol::{EventMsg, StopReason, TaskState};
use tandem_tests::daemon::block_results;
use tandem_tests::{DaemonHarness as Daemon, Reply, ScriptedOpenAi, script, texts};

const BIN: &str = env!("CARGO_BIN_EXE_tandem");

async fn daemon(server: &ScriptedOpenAi, args: &[&str], config: Option<&str>) -> Daemon {
    Daemon::start(Path::new(BIN), &server.base_url(), args, config).await
}

async fn post_task(d: &Daemon, body: &Value) -> (u16, Value) {
    d.send(reqwest::Method::POST, "/v1/tasks", Some(body.to_string()))
        .await
}

fn python(code: &str) -> Reply {
    Reply::from(format!("```python\n{code}\n```").as_str())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_never_sends_the_daemons_key_where_a_client_says() {
    let server = ScriptedOpenAi::start(script([("own endpoint", texts(&["TERMINATE"]))]))
        .await
        .unwrap();
    let elsewhere = ScriptedOpenAi::start(script([("elsewhere", texts(&["TERMINATE"]))]))
        .await
        .unwrap();
    let d = daemon(
        &server,
        &[],
        Some("[model]\napi_key = \"sk-daemon-secret\"\n"),
    )
    .await;
    let (status, body) = post_task(
        &d,
        &json!({"task": "elsewhere", "base_url": elsewhere.base_url()}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "not_allowed");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("[[policy.model_endpoints]]"), "{message}");
    let id = d.submit(json!({"task": "own endpoint"})).await;
    d.wait_finished(&id, Duration::from_secs(30)).await;
    assert!(
        elsewhere.requests().is_empty(),
        "a request reached the other server"
    );
    let own = server.requests_for("own endpoint");
    assert_eq!(
        own[0].authorization.as_deref(),
        Some("Bearer sk-daemon-secret")
    );

    // An endpoint the operator allows gets its own key, never the daemon's.
    let config = format!(
        "[model]\napi_key = \"sk-daemon-secret\"\n[[policy.model_endpoints]]\nbase_url = \"{}\"\napi_key = \"sk-for-elsewhere\"\n",
        elsewhere.base_url()
    );
    let d = daemon(&server, &[], Some(&config)).await;
    let id = d
        .submit(json!({"task": "elsewhere", "base_url": format!("{}/", elsewhere.base_url())}))
        .await;
    let t = d.wait_finished(&id, Duration::from_secs(30)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let seen: Vec<Option<String>> = elsewhere
        .requests()
        .into_iter()
        .map(|r| r.authorization)
        .collect();
    assert_eq!(seen, [Some("Bearer sk-for-elsewhere".to_owned())]);
}

#[tokio::test(flavor = "multi_thread")]
async fn local_is_offered_to_clients_only_when_the_operator_lists_it() {
    let server = ScriptedOpenAi::start(script([(
        "run here",
        vec![python("print('ran in-process')"), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &["--executor", "wasm"], None).await;
    let (status, body) = post_task(&d, &json!({"task": "x", "executor": "local"})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "not_allowed");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("executor `local` is not offered to API clients"),
        "{body}"
    );
    let executors = d.get("/v1/executors").await;
    let local = executors["executors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "local")
        .unwrap();
    assert_eq!(local["offered"], false, "{executors}");
    // On the user's own machine the CLI runs it itself, and says so.
    let out = tokio::process::Command::new(BIN)
        .args(["run", "--executor", "local", "run here"])
        .current_dir(d.state_dir())
        .env("TANDEM_HOST", d.host())
        .env("XDG_CONFIG_HOME", d.state_dir())
        .env("OPENAI_BASE_URL", server.base_url())
        .env("TANDEM_MAX_RETRIES", "0")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("ran in-process"), "{stdout}");
    assert!(
        stderr.contains("the daemon does not offer the local executor to clients; running the task in this process instead"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_block_never_reads_the_daemons_key_token_or_store() {
    let secret = format!("sk-{}", uuid::Uuid::new_v4().simple());
    // The block is told where to look once the daemon runs: its pid and its state dir.
    let server = ScriptedOpenAi::start(Default::default()).await.unwrap();
    let d = Daemon::start_with_env(
        Path::new(BIN),
        &server.base_url(),
        // The harness names local as the tasks' executor, which offers every executor.
        &["--listen", "127.0.0.1:0"],
        None,
        &[
            ("OPENAI_API_KEY", secret.as_str()),
            ("TANDEM_DOCKER_IMAGE", &docker_image()),
        ],
    )
    .await;
    let state = d.state_dir().to_owned();
    let code = format!(
        "for p in ('/proc/{}/environ', '{}/token', '{}/tandem.db'):\n    try:\n        print(p[-8:], open(p, 'rb').read().decode('latin-1')[:4000])\n    except OSError as e:\n        print(p[-8:], 'denied', type(e).__name__)",
        d.pid(),
        state.display(),
        state.display()
    );
    // Local blocks are the daemon's own user: the next test covers what holds for them.
    for executor in ["docker", "wasm"] {
        let task = format!("read the daemon's secrets with {executor}");
        server.set(&task, vec![python(&code), Reply::from("TERMINATE")]);
        let id = d.submit(json!({"task": task, "executor": executor})).await;
        let t = d.wait_finished(&id, Duration::from_secs(60)).await;
        assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
        let output = d.block_stdouts(&id).await.concat();
        let token = std::fs::read_to_string(state.join("token")).unwrap();
        assert_eq!(output.matches("denied").count(), 3, "{executor}: {output}");
        assert!(!output.contains(&secret), "{executor} read the key");
        assert!(!output.contains(token.trim()), "{executor} read the token");
    }
}

/// A confined local block has a PID namespace and a `/proc` of its own: the daemon (whose
/// argv may carry a store URL) and every other process on the host are not there to read,
/// shell and sh blocks alike; its own children are; and the `/proc` it was given never shows
/// up among the host's mounts.
#[tokio::test(flavor = "multi_thread")]
async fn a_confined_local_block_sees_no_process_but_its_own() {
    let server = ScriptedOpenAi::start(Default::default()).await.unwrap();
    let d = daemon(&server, &[], None).await;
    let proc_mounts = || {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(" - proc "))
            .count()
    };
    let before = proc_mounts();
    let py = format!(
        "import os, subprocess\n\
         child = subprocess.Popen(['sleep', '30'])\n\
         while not open('/proc/%d/cmdline' % child.pid, 'rb').read().startswith(b'sleep'):\n    pass\n\
         pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n\
         names = [open('/proc/%d/cmdline' % p, 'rb').read().split(b'\\0')[0].decode() for p in pids]\n\
         print('seen', len(pids), 'init', 1 in pids, 'sleep', any(n == 'sleep' for n in names))\n\
         try:\n    print('daemon', open('/proc/{pid}/cmdline', 'rb').read())\n\
         except OSError as e:\n    print('daemon hidden', type(e).__name__)\n\
         child.kill()",
        pid = d.pid()
    );
    let sh = format!(
        "ls /proc | grep -c '^[0-9]' | sed 's/^/sh seen /'\n\
         cat /proc/{pid}/cmdline 2>/dev/null && echo 'sh read the daemon' || echo 'sh daemon hidden'",
        pid = d.pid()
    );
    let task = "look at the host's processes";
    server.set(
        task,
        vec![
            Reply::from(format!("```python\n{py}\n```\n```sh\n{sh}\n```").as_str()),
            Reply::from("TERMINATE"),
        ],
    );
    let id = d.submit(json!({"task": task, "executor": "local"})).await;
    let t = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let output = d.block_stdouts(&id).await.concat();
    // Its init (pid 1), the fork server's fork that runs it, its own sleep: a handful, not
    // the host's hundreds.
    let seen: usize = output
        .split_whitespace()
        .skip_while(|w| *w != "seen")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(usize::MAX);
    assert!(seen <= 5, "{output}");
    assert!(output.contains("init True sleep True"), "{output}");
    assert!(
        output.contains("daemon hidden FileNotFoundError"),
        "{output}"
    );
    assert!(output.contains("sh daemon hidden"), "{output}");
    let sh_seen: usize = output
        .split("sh seen ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(usize::MAX);
    assert!(sh_seen <= 5, "{output}");
    assert_eq!(proc_mounts(), before, "a block's /proc reached the host");
}

/// The daemon is non-dumpable, so a process of its own user (which a local block is) cannot
/// read its environment, where the API key is. As root (CI), the daemon and the reader both
/// run as another user, since root reads every process's environment.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_of_the_daemons_own_user_cannot_read_its_environment() {
    const NOBODY: u32 = 65534;
    let dir = tempfile::tempdir().unwrap();
    let root = running_as_root();
    let bin = if root {
        // The build's directory may be closed to other users; a copy is not.
        let bin = dir.path().join("tandem");
        std::fs::copy(BIN, &bin).unwrap();
        std::os::unix::fs::chown(dir.path(), Some(NOBODY), Some(NOBODY)).unwrap();
        bin
    } else {
        Path::new(BIN).to_owned()
    };
    let secret = format!("sk-{}", uuid::Uuid::new_v4().simple());
    let socket = dir.path().join("s.sock");
    let mut serve = tokio::process::Command::new(&bin);
    serve
        .args(["serve", "--executor", "local", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--socket")
        .arg(&socket)
        .env("OPENAI_API_KEY", &secret)
        .env("HOME", dir.path())
        .env("XDG_CONFIG_HOME", dir.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    if root {
        serve.uid(NOBODY).gid(NOBODY);
    }
    let daemon = serve.spawn().unwrap();
    let started = Instant::now();
    while !socket.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the daemon did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut read = tokio::process::Command::new("cat");
    read.arg(format!("/proc/{}/environ", daemon.id().unwrap()));
    if root {
        read.uid(NOBODY).gid(NOBODY);
    }
    let out = read.output().await.unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!stdout.contains(&secret), "the key was read");
    assert!(stderr.contains("Permission denied"), "{stdout}\n{stderr}");
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn docker_image() -> String {
    std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_model_that_never_stops_streaming_is_cut_off() {
    let server = ScriptedOpenAi::start(script([(
        "endless",
        vec![Reply::Endless("all work and no play ".to_owned())],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let started = Instant::now();
    let id = d.submit(json!({"task": "endless", "max_turns": 1})).await;
    let t = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::MaxTurns), "{t:?}");
    let events = d.events(&id, 0).await;
    let reply = events
        .iter()
        .find_map(|e| match &e.msg {
            EventMsg::AssistantMessage { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .unwrap();
    // Cut at the default max_reply_bytes, 1 MiB (the server would send 20 MiB).
    assert!(
        reply.len() <= 1 << 20 && reply.len() > 1_000_000,
        "{} bytes",
        reply.len()
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    // Still serving.
    assert_eq!(d.get("/healthz").await["status"], "ok");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_that_names_no_timeout_gets_the_operators() {
    let server = ScriptedOpenAi::start(script([(
        "never answers",
        vec![Reply::Delayed(
            Duration::from_secs(600),
            Box::new(Reply::from("TERMINATE")),
        )],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], Some("[task]\ntimeout_secs = 1\n")).await;
    let id = d.submit(json!({"task": "never answers"})).await;
    let t = d.wait_finished(&id, Duration::from_secs(30)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Timeout), "{t:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_resumes_run_an_interrupted_task_once() {
    // Many turns make a resume read many events between its check and its change, the window
    // two resumes race in; eight tasks are eight tries.
    const TURNS: usize = 40;
    let mut replies: Vec<Reply> = (0..TURNS).map(|i| python(&format!("print({i})"))).collect();
    replies.push(python("import time\ntime.sleep(60)"));
    // After the resume: the block the kill cut off is not run again, so the model is asked
    // for the next turn, which sleeps until the cancel below.
    replies.push(python("import time\ntime.sleep(60)"));
    let tasks: Vec<String> = (0..8).map(|i| format!("resume me {i}")).collect();
    let server =
        ScriptedOpenAi::start(tasks.iter().map(|t| (t.clone(), replies.clone())).collect())
            .await
            .unwrap();
    let mut d = daemon(&server, &["--max-concurrent", "8"], None).await;
    let mut ids = Vec::new();
    for task in &tasks {
        ids.push(d.submit(json!({"task": task, "max_turns": 50})).await);
    }
    let started = Instant::now();
    for id in &ids {
        while u64::from(d.task(id).await.record.turns) < TURNS as u64 + 1 {
            assert!(started.elapsed() < Duration::from_secs(60));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    d.kill9();
    d.spawn().await;
    // One connection each, all sent at once: the daemon handles them side by side.
    let socket = d.socket();
    let answers = futures::future::join_all(ids.iter().flat_map(|id| {
        let url = format!("http://tandem/v1/tasks/{id}/resume");
        let socket = socket.clone();
        (0..16).map(move |_| {
            let client = reqwest::Client::builder()
                .unix_socket(socket.clone())
                .build()
                .unwrap();
            let (url, id) = (url.clone(), id.clone());
            async move {
                let resp = client.post(url).send().await.unwrap();
                (id, resp.status().as_u16())
            }
        })
    }))
    .await;
    for id in &ids {
        let mut codes: Vec<u16> = answers
            .iter()
            .filter(|(of, _)| of == id)
            .map(|(_, status)| *status)
            .collect();
        codes.sort_unstable();
        assert_eq!(codes, [[200].as_slice(), &[409; 15]].concat(), "{id}");
    }
    // A cancel racing a resume: whichever wins, each task ends once.
    for id in &ids {
        d.send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{id}/cancel"),
            None,
        )
        .await;
    }
    for id in &ids {
        let t = d.wait_finished(id, Duration::from_secs(30)).await;
        assert_eq!(t.record.stop_reason, Some(StopReason::Cancelled), "{t:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_bytes_long_strings_and_huge_numbers_get_a_4xx_and_the_daemon_serves_on() {
    let server = ScriptedOpenAi::start(script([("after", texts(&["TERMINATE"]))]))
        .await
        .unwrap();
    let d = daemon(&server, &[], None).await;
    let raw = |body: Vec<u8>| {
        let d = &d;
        async move {
            let resp = d
                .http()
                .post("http://tandem/v1/tasks")
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let mut bad_utf8 = b"{\"task\": \"".to_vec();
    bad_utf8.extend_from_slice(&[0xff, 0xfe, 0xc3]);
    bad_utf8.extend_from_slice(b"\"}");
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("malformed UTF-8", bad_utf8, 400, "invalid_request"),
        (
            "a 2 MiB task",
            json!({"task": "x".repeat(2 << 20)})
                .to_string()
                .into_bytes(),
            413,
            "payload_too_large",
        ),
        (
            "a number past u64",
            br#"{"task": "t", "timeout_secs": 1e30}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "a negative number",
            br#"{"task": "t", "max_turns": -1}"#.to_vec(),
            400,
            "invalid_request",
        ),
        (
            "the largest block timeout",
            // What panicked a worker on the docker executor and left its task running.
            json!({"task": "t", "executor": "docker", "block_timeout_secs": u64::MAX})
                .to_string()
                .into_bytes(),
            400,
            "not_allowed",
        ),
        (
            "the largest task timeout",
            json!({"task": "t", "timeout_secs": u64::MAX})
                .to_string()
                .into_bytes(),
            400,
            "not_allowed",
        ),
        (
            "the most turns",
            json!({"task": "t", "max_turns": u32::MAX})
                .to_string()
                .into_bytes(),
            400,
            "not_allowed",
        ),
        (
            "the largest limits",
            json!({"task": "t", "limits": {"memory_bytes": u64::MAX}})
                .to_string()
                .into_bytes(),
            400,
            "invalid_request",
        ),
        (
            "a thousand languages",
            json!({"task": "t", "languages": vec!["python"; 1000]})
                .to_string()
                .into_bytes(),
            201,
            "",
        ),
    ];
    for (name, body, status, code) in cases {
        let (got, answer) = raw(body).await;
        assert_eq!(got, status, "{name}: {answer}");
        if status != 201 {
            assert_eq!(answer["error"]["code"], code, "{name}: {answer}");
        }
    }
    let id = d.submit(json!({"task": "after"})).await;
    let t = d.wait_finished(&id, Duration::from_secs(30)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
}

/// Values a daemon accepts, or none.
fn number() -> impl Strategy<Value = Option<u64>> {
    prop_oneof![Just(None), (1..120u64).prop_map(Some)]
}

/// A number at an edge: zero, the largest, or anything at all.
fn edge() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(u64::MAX),
        Just(u64::from(u32::MAX)),
        any::<u64>()
    ]
}

const FIELDS: [&str; 7] = [
    "timeout_secs",
    "block_timeout_secs",
    "max_turns",
    "limits.memory_bytes",
    "limits.cpu_secs",
    "limits.file_size_bytes",
    "limits.output_bytes",
];

/// A spec of acceptable numbers, half the time with one of them replaced by an edge value.
fn task_spec() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("local"), Just("docker"), Just("wasm")],
        proptest::collection::vec(number(), FIELDS.len()),
        proptest::option::of((0..FIELDS.len(), edge())),
    )
        .prop_map(|(executor, mut values, edge)| {
            if let Some((field, value)) = edge {
                values[field] = Some(value);
            }
            let mut spec = json!({"task": "any numbers", "executor": executor, "limits": {}});
            let edge_field = edge.map(|(field, _)| field);
            for (i, (field, value)) in FIELDS.iter().zip(values).enumerate() {
                let Some(mut value) = value else { continue };
                // Accepted specs take few turns, so that they finish quickly.
                if *field == "max_turns" && edge_field != Some(i) {
                    value = value % 3 + 1;
                }
                match field.strip_prefix("limits.") {
                    Some(limit) => spec["limits"][limit] = json!(value),
                    None => spec[*field] = json!(value),
                }
            }
            spec
        })
}

/// No number a client sends panics or overflows anything: every spec is refused with a 400,
/// or accepted and then runs to a terminal state.
#[test]
fn every_accepted_spec_runs_to_an_end_and_every_other_is_refused() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt
        .block_on(ScriptedOpenAi::start(script([(
            "any numbers",
            vec![python("print('ran')"), Reply::from("TERMINATE")],
        )])))
        .unwrap();
    let d = rt.block_on(Daemon::start_with_env(
        Path::new(BIN),
        &server.base_url(),
        &[],
        None,
        &[("TANDEM_DOCKER_IMAGE", &docker_image())],
    ));
    let (accepted, refused) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let result = runner.run(&task_spec(), |spec| {
        rt.block_on(async {
            let (status, body) = post_task(&d, &spec).await;
            match status {
                201 => {
                    accepted.set(accepted.get() + 1);
                    let id = body["id"].as_str().unwrap();
                    let t = d.wait_finished(id, Duration::from_secs(120)).await;
                    prop_assert_eq!(t.record.state, TaskState::Finished);
                }
                400 => {
                    refused.set(refused.get() + 1);
                    let message = body["error"]["message"].as_str().unwrap_or_default();
                    prop_assert!(!message.is_empty(), "{}", body);
                }
                other => prop_assert!(false, "{other} for {spec}: {body}"),
            }
            Ok(())
        })
    });
    let log = d.log();
    let health = rt.block_on(async move {
        let health = d.get("/healthz").await;
        drop((d, server));
        health
    });
    if let Err(e) = result {
        panic!("{e}\n{log}");
    }
    assert_eq!(health["status"], "ok");
    eprintln!("accepted {}, refused {}", accepted.get(), refused.get());
    // Both roads were taken, often enough to mean something.
    assert!(
        accepted.get() >= 4 && refused.get() >= 4,
        "accepted {}, refused {}",
        accepted.get(),
        refused.get()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_or_short_token_is_refused_and_a_generated_one_is_never_printed() {
    for bad in ["", "  \n", "short"] {
        let state = tempfile::tempdir().unwrap();
        std::fs::write(state.path().join("token"), bad).unwrap();
        let out = tokio::process::Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--executor", "local"])
            .arg("--state-dir")
            .arg(state.path())
            .arg("--socket")
            .arg(state.path().join("s.sock"))
            .env("XDG_CONFIG_HOME", state.path())
            .env_remove("TANDEM_TOKEN")
            .stdin(std::process::Stdio::null())
            // A daemon that wrongly starts must not outlive the test.
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(30), out)
            .await
            .expect("serve with a bad token must exit")
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(stderr.contains("use at least 16"), "{stderr}");
    }
    let server = ScriptedOpenAi::start(Default::default()).await.unwrap();
    let d = daemon(&server, &["--listen", "127.0.0.1:0"], None).await;
    let token = std::fs::read_to_string(d.state_dir().join("token")).unwrap();
    assert!(token.len() >= 32);
    let log = d.log();
    assert!(log.contains("generated a TCP token in"), "{log}");
    assert!(!log.contains(token.trim()), "the token was printed: {log}");
}

/// What a block runs to act on the daemon through its Unix socket, as any process of the
/// daemon's user could: it approves every block that waits, in every task.
fn approve_everything(socket: &Path) -> String {
    format!(
        r#"import json, socket
SOCK = {socket:?}
def call(method, path, body=b''):
    s = socket.socket(socket.AF_UNIX)
    s.connect(SOCK)
    s.sendall(f'{{method}} {{path}} HTTP/1.0\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {{len(body)}}\r\n\r\n'.encode() + body)
    data = b''
    while chunk := s.recv(65536):
        data += chunk
    return data.split(b'\r\n\r\n', 1)[1]
try:
    waiting = json.loads(call('GET', '/v1/tasks?state=awaiting_approval'))['tasks']
except OSError as e:
    print('denied', e.errno)
    raise SystemExit(0)
for t in waiting:
    print('forged', call('POST', f"/v1/tasks/{{t['id']}}/approvals/1", b'{{"decision": "approve"}}')[:80])
"#,
        socket = socket.display().to_string()
    )
}

/// The approval a block waits on is a person's to give: a confined local block, running
/// beside it, cannot reach the daemon's socket to give it; unconfined, it can (the control).
#[tokio::test(flavor = "multi_thread")]
async fn a_local_block_cannot_reach_the_daemons_socket_to_approve_a_waiting_block() {
    for confine in ["auto", "off"] {
        let (gated, attacker) = (
            format!("hostile: gated {confine}"),
            format!("hostile: forger {confine}"),
        );
        let server = ScriptedOpenAi::start(tandem_tests::Script::new())
            .await
            .unwrap();
        let config = format!(
            "[executors.local]\nconfine = \"{confine}\"\n[approval]\nmode = \"policy\"\nauto_approve = {{ languages = [\"python\"] }}\n[[approval.ask]]\nname = \"gated\"\npattern = \"GATED\"\n"
        );
        let d = Daemon::start(Path::new(BIN), &server.base_url(), &[], Some(&config)).await;
        server.set(
            &gated,
            vec![python("print('GATED ran')"), "TERMINATE".into()],
        );
        server.set(
            &attacker,
            vec![python(&approve_everything(&d.socket())), "TERMINATE".into()],
        );
        let gated_id = d.submit(json!({ "task": gated })).await;
        let started = Instant::now();
        while d.task(&gated_id).await.record.state != TaskState::AwaitingApproval {
            assert!(started.elapsed() < Duration::from_secs(30), "never waited");
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        let forger = d.submit(json!({ "task": attacker })).await;
        d.wait_finished(&forger, Duration::from_secs(30)).await;
        let events = d.events(&forger, 0).await;
        let out = block_results(&events)
            .first()
            .map(|r| r.stdout.clone())
            .unwrap_or_default();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let state = d.task(&gated_id).await.record.state;
        if confine == "auto" {
            assert!(
                out.starts_with("denied"),
                "the block reached the daemon: {out}"
            );
            assert_eq!(
                state,
                TaskState::AwaitingApproval,
                "a block approved another's code"
            );
        } else {
            assert!(
                out.contains("forged"),
                "the control did not reach the daemon: {out}"
            );
            assert_ne!(state, TaskState::AwaitingApproval);
        }
    }
}
