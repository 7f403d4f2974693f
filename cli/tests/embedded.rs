//! The embedded model through the real binary: a task solved with no server and no key, on
//! the 0.5B model that `scripts/fetch-test-model.sh` pulls (a missing model fails the test
//! and says how to get it), and what a new user meets with no model at all.

use std::path::PathBuf;

use tandem_protocol::{BlockStatus, EventMsg, StopReason};

use crate::e2e::tandem;

/// The directory holding the pulled test model.
pub(crate) fn models_dir() -> String {
    let dir = std::env::var_os("TANDEM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/tandem/models")
        });
    assert!(
        dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
            .is_file(),
        "the test model is not in {}: run scripts/fetch-test-model.sh",
        dir.display()
    );
    dir.display().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_is_solved_by_the_embedded_model_with_no_server_and_no_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        "[model]\nprovider = \"embedded\"\nmodel = \"qwen2.5-coder-0.5b\"\ntemperature = 0.0\nseed = 1\ncontext_tokens = 4096\n",
    )
    .unwrap();
    let models = models_dir();
    let out = tandem(
        &[
            "run",
            "--json",
            "--config",
            config.to_str().unwrap(),
            "--max-turns",
            "4",
            "Print the sum of 2 and 3 with python.",
        ],
        &[("TANDEM_MODELS_DIR", models.as_str())],
        None,
    )
    .await;
    let started = out.of_type("task_started");
    let EventMsg::TaskStarted {
        model, base_url, ..
    } = &started[0]
    else {
        unreachable!("of_type(\"task_started\") gave {:?}", started[0])
    };
    assert_eq!(model, "qwen2.5-coder-0.5b", "{}", out.stderr);
    assert!(
        base_url.starts_with("the embedded engine ("),
        "{:?}",
        started[0]
    );
    let ran = out.results();
    assert!(
        ran.iter()
            .any(|r| r.stdout.contains("5\n") || r.stderr.contains("5\n")),
        "no block printed 5: {}\n{}",
        out.stdout,
        out.stderr
    );
    assert_eq!(
        out.finished().stop_reason,
        StopReason::Terminated,
        "{}",
        out.stdout
    );
    assert_eq!(out.code, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_no_model_and_no_server_the_error_names_both_ways_out() {
    let out = tandem(&["run", "Print 1"], &[], None).await;
    assert_eq!(out.code, 2);
    assert_eq!(
        out.stderr,
        "tandem: no model to talk to: set OPENAI_API_KEY (for OpenAI) or OPENAI_BASE_URL (for any OpenAI-compatible server), or run `tandem model pull` once for a model that runs inside Tandem with no key and no network\n"
    );
    let doctor = tandem(&["doctor"], &[], None).await;
    assert!(
        doctor
            .stdout
            .starts_with("model:     none: no model to talk to: "),
        "{}",
        doctor.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_and_model_list_show_the_pulled_model() {
    // Only the 0.5B, whatever else the machine has pulled: the draft lines below name the
    // 1.5B as not pulled.
    let only = tempfile::tempdir().unwrap();
    let file = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
    std::os::unix::fs::symlink(
        std::path::Path::new(&models_dir()).join(file),
        only.path().join(file),
    )
    .unwrap();
    let models = only.path().display().to_string();
    let out = tandem(
        &["doctor", "--model", "qwen2.5-coder-0.5b"],
        &[("TANDEM_MODELS_DIR", models.as_str())],
        None,
    )
    .await;
    let first = out.stdout.lines().next().unwrap_or_default();
    assert!(
        first.starts_with(
            "model:     qwen2.5-coder-0.5b, embedded: runs in Tandem's process, no server or key ("
        ) && first.ends_with("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf, 491 MB)"),
        "{first}"
    );
    // A draft named in [model]: said when it is there, and how to get it when it is not.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    for (draft, line) in [
        (
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf: guesses tokens that qwen2.5-coder-0.5b checks (speculative decoding)",
        ),
        (
            "qwen2.5-coder-1.5b",
            "draft:     none: [model] draft `qwen2.5-coder-1.5b` is not pulled: run `tandem model pull qwen2.5-coder-1.5b`",
        ),
    ] {
        std::fs::write(
            &config,
            format!("[model]\nprovider = \"embedded\"\nmodel = \"qwen2.5-coder-0.5b\"\ndraft = \"{draft}\"\n"),
        )
        .unwrap();
        let out = tandem(
            &["doctor", "--config", config.to_str().unwrap()],
            &[("TANDEM_MODELS_DIR", models.as_str())],
            None,
        )
        .await;
        let second = out.stdout.lines().nth(1).unwrap_or_default();
        assert!(
            second.starts_with("draft:     ") && second.ends_with(line),
            "{}",
            out.stdout
        );
    }
    let empty = tempfile::tempdir().unwrap();
    let list = tandem(
        &["model", "list"],
        &[("TANDEM_MODELS_DIR", empty.path().to_str().unwrap())],
        None,
    )
    .await;
    assert_eq!(
        list.stdout,
        format!(
            "no model files in {}\ncan be pulled (`tandem model pull NAME`): qwen2.5-coder-1.5b (1117 MB), qwen2.5-coder-0.5b (491 MB)\n",
            empty.path().display()
        )
    );
    let unknown = tandem(&["model", "pull", "gpt-9"], &[], None).await;
    assert_eq!(unknown.code, 2);
    assert_eq!(
        unknown.stderr,
        "tandem: no model named `gpt-9`; known models: qwen2.5-coder-1.5b, qwen2.5-coder-0.5b\n"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemon_loads_the_model_once_and_tasks_share_it() {
    let models = models_dir();
    let config = "[model]\nprovider = \"embedded\"\nmodel = \"qwen2.5-coder-0.5b\"\ntemperature = 0.0\nseed = 1\ncontext_tokens = 4096\n\n[policy]\nexecutors = [\"local\"]\n";
    // The server URL the harness sets leads nowhere: only the embedded model can answer.
    let mut d = tandem_tests::DaemonHarness::start_with_env(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        "http://127.0.0.1:9/v1",
        &[],
        Some(config),
        &[("TANDEM_MODELS_DIR", models.as_str())],
    )
    .await;
    let spec = serde_json::json!({
        "task": "Print the sum of 2 and 3 with python.",
        "executor": "local",
        "max_turns": 4,
    });
    let ids = [d.submit(spec.clone()).await, d.submit(spec).await];
    for id in &ids {
        let task = d
            .wait_finished(id, std::time::Duration::from_secs(180))
            .await;
        assert_eq!(
            task.record.stop_reason,
            Some(StopReason::Terminated),
            "{task:?}\n{}",
            d.log()
        );
    }
    let log = d.log();
    assert_eq!(log.matches("embedded model loaded").count(), 1, "{log}");
    d.terminate().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn asked_with_the_tool_required_the_embedded_model_calls_execute_code_and_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        "[model]\nprovider = \"embedded\"\nmodel = \"qwen2.5-coder-0.5b\"\ntemperature = 0.0\nseed = 1\ncontext_tokens = 4096\ncode_via = \"tool\"\ntool_choice = \"required\"\n",
    )
    .unwrap();
    let models = models_dir();
    let out = tandem(
        &[
            "run",
            "--json",
            "--config",
            config.to_str().unwrap(),
            "--max-turns",
            "1",
            "Print the sum of 2 and 3 with python.",
        ],
        &[("TANDEM_MODELS_DIR", models.as_str())],
        None,
    )
    .await;
    // Every reply must be a call: the one turn is one, constrained by the tool's grammar.
    let calls = out.of_type("tool_call");
    assert_eq!(calls.len(), 1, "{}\n{}", out.stdout, out.stderr);
    let EventMsg::ToolCall {
        id: call_id,
        name,
        arguments,
        ..
    } = &calls[0]
    else {
        unreachable!("of_type(\"tool_call\") gave {:?}", calls[0])
    };
    assert_eq!(name, "execute_code");
    let arguments: serde_json::Value = serde_json::from_str(arguments).unwrap();
    assert!(arguments["code"].is_string(), "{arguments}");
    // It ran as a block, and its answer went back as the call's.
    let ran = out.results();
    assert_eq!(ran.len(), 1, "{}", out.stdout);
    assert_eq!(ran[0].status, BlockStatus::Exited, "{:?}", ran[0]);
    let answered = out.of_type("tool_result");
    let EventMsg::ToolResult { id: answer_id, .. } = &answered[0] else {
        unreachable!("of_type(\"tool_result\") gave {:?}", answered[0])
    };
    assert_eq!(answer_id, call_id);
    assert_eq!(
        out.finished().stop_reason,
        StopReason::MaxTurns,
        "{}",
        out.stdout
    );
}

/// A daemon with the embedded model that also listens on a free loopback port: it, the
/// address and its token.
async fn tcp_daemon_with_model(models: &str) -> (tandem_tests::DaemonHarness, String, String) {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let config = "[model]\nprovider = \"embedded\"\nmodel = \"qwen2.5-coder-0.5b\"\ntemperature = 0.0\nseed = 1\ncontext_tokens = 2048\n\n[policy]\nexecutors = [\"local\"]\n";
    let d = tandem_tests::DaemonHarness::start_with_env(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        "http://127.0.0.1:9/v1",
        &["--listen", &addr],
        Some(config),
        &[("TANDEM_MODELS_DIR", models)],
    )
    .await;
    let token = std::fs::read_to_string(d.state_dir().join("token")).unwrap();
    (d, addr, token.trim().to_owned())
}

fn execute_code_tool() -> serde_json::Value {
    serde_json::json!({"type": "function", "function": {
        "name": "execute_code",
        "description": "Run code and get its output.",
        "parameters": {"type": "object", "properties": {
            "language": {"type": "string", "enum": ["python", "sh"]},
            "code": {"type": "string"}
        }, "required": ["language", "code"], "additionalProperties": false}
    }})
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemon_serves_its_model_to_openai_clients_under_its_token() {
    let models = models_dir();
    let (mut a, addr, token) = tcp_daemon_with_model(&models).await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/v1/chat/completions");
    let hello = serde_json::json!({
        "model": "anything",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
    });
    // The same token as the rest of the API.
    let resp = http.post(&url).json(&hello).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 401);

    // A plain reply, its usage, the served model's name.
    let resp = http
        .post(&url)
        .bearer_auth(&token)
        .json(&hello)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion", "{body}");
    assert_eq!(body["model"], "qwen2.5-coder-0.5b", "{body}");
    assert!(
        !body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty(),
        "{body}"
    );
    assert!(
        body["usage"]["prompt_tokens"].as_u64().unwrap() > 5,
        "{body}"
    );
    assert!(
        body["usage"]["completion_tokens"].as_u64().unwrap() <= 8,
        "{body}"
    );

    // A call, constrained by the tool's grammar, as tool_calls and never as text.
    let resp = http
        .post(&url)
        .bearer_auth(&token)
        .json(&serde_json::json!({
            "messages": [{"role": "user", "content": "Print the sum of 2 and 3."}],
            "tools": [execute_code_tool()],
            "tool_choice": "required",
            "max_tokens": 120,
        }))
        .send()
        .await
        .unwrap();
    let body: serde_json::Value = resp.json().await.unwrap();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "execute_code", "{body}");
    let arguments: serde_json::Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(arguments["code"].is_string(), "{body}");
    assert!(
        !choice["message"]["content"]
            .as_str()
            .unwrap_or("")
            .contains("<tool_call>"),
        "{body}"
    );

    // Streamed: chunks of text, the finish, the usage, then [DONE].
    let resp = http
        .post(&url)
        .bearer_auth(&token)
        .json(&serde_json::json!({
            "messages": [{"role": "user", "content": "Count from 1 to 5."}],
            "max_tokens": 16,
            "stream": true,
            "stream_options": {"include_usage": true},
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await.unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(streamed.contains('1'), "{text}");
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"].is_string()),
        "{text}"
    );
    assert!(
        chunks.iter().any(|c| c["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n > 0)),
        "{text}"
    );

    // Bad input: a body that is not a request, a prompt over the window.
    let resp = http
        .post(&url)
        .bearer_auth(&token)
        .json(&serde_json::json!({"messages": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not a chat completion request"),
        "{body}"
    );
    let resp = http
        .post(&url)
        .bearer_auth(&token)
        .json(&serde_json::json!({
            "messages": [{"role": "user", "content": "word ".repeat(3000)}],
        }))
        .send()
        .await
        .unwrap();
    let body: serde_json::Value = resp.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("over the model's context window of 2048"),
        "{body}"
    );

    // Eight streams held open are all it serves at once: a ninth request is refused, not
    // queued in front of the daemon's tasks; once they go, it is served again.
    let long = serde_json::json!({
        "messages": [{"role": "user", "content": "Count from 1 to 1000."}],
        "max_tokens": 1000,
        "stream": true,
    });
    let mut held = Vec::new();
    for _ in 0..8 {
        let resp = http
            .post(&url)
            .bearer_auth(&token)
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        held.push(resp);
    }
    let resp = http
        .post(&url)
        .bearer_auth(&token)
        .json(&hello)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many", "{body}");
    drop(held);
    let started = std::time::Instant::now();
    loop {
        let resp = http
            .post(&url)
            .bearer_auth(&token)
            .json(&hello)
            .send()
            .await
            .unwrap();
        if resp.status().as_u16() == 200 {
            break;
        }
        assert_eq!(resp.status().as_u16(), 429);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the dropped streams were never let go"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }

    // A second daemon with no model of its own runs a task on this one's, through its
    // OpenAI client.
    let config = format!(
        "[model]\nprovider = \"openai\"\nbase_url = \"http://{addr}/v1\"\napi_key = \"{token}\"\nmodel = \"qwen2.5-coder-0.5b\"\ntemperature = 0.0\nseed = 1\n\n[policy]\nexecutors = [\"local\"]\n"
    );
    let mut b = tandem_tests::DaemonHarness::start_with_env(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &format!("http://{addr}/v1"),
        &[],
        Some(&config),
        &[("TANDEM_MODELS_DIR", "/nonexistent")],
    )
    .await;
    let before = a.get("/v1/engine").await["engine"]["tokens_generated"]
        .as_u64()
        .unwrap();
    let id = b
        .submit(serde_json::json!({
            "task": "Print the sum of 2 and 3 with python.",
            "executor": "local",
            "max_turns": 4,
        }))
        .await;
    let task = b
        .wait_finished(&id, std::time::Duration::from_secs(180))
        .await;
    assert_eq!(
        task.record.stop_reason,
        Some(StopReason::Terminated),
        "{task:?}\n{}",
        b.log()
    );
    let engine = a.get("/v1/engine").await["engine"].clone();
    assert!(
        engine["tokens_generated"].as_u64().unwrap() > before,
        "{engine}"
    );
    assert!(!b.log().contains("embedded model loaded"), "{}", b.log());
    assert_eq!(a.log().matches("embedded model loaded").count(), 1);
    b.terminate().await;
    a.terminate().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_model_file_fails_its_tasks_with_the_reason_and_the_daemon_stays_up() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.gguf");
    std::fs::write(&broken, b"GGUF but not really a model").unwrap();
    let gone = dir.path().join("gone.gguf");
    // A file that is not a model, and one that is not there at all.
    for (model, why) in [
        (&broken, "cannot load the model".to_owned()),
        (&gone, format!("no model file at {}", gone.display())),
    ] {
        let config = format!(
            "[model]\nprovider = \"embedded\"\nmodel = \"{}\"\n\n[policy]\nexecutors = [\"local\"]\n",
            model.display()
        );
        let mut d = tandem_tests::DaemonHarness::start(
            std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
            "http://127.0.0.1:9/v1",
            &[],
            Some(&config),
        )
        .await;
        let id = d
            .submit(serde_json::json!({"task": "Print 1.", "executor": "local"}))
            .await;
        let task = d
            .wait_finished(&id, std::time::Duration::from_secs(60))
            .await;
        assert_eq!(task.record.stop_reason, Some(StopReason::Error), "{task:?}");
        let error = task.record.error.clone().expect("an error");
        assert!(
            error.message.contains(&format!(
                "the embedded model {} could not be loaded",
                if model == &broken {
                    "broken".to_owned()
                } else {
                    gone.display().to_string()
                }
            )) && error.message.contains(&why),
            "{error:?}"
        );
        // Still up: it answers, and says so in its log.
        assert_eq!(d.get("/healthz").await["status"], "ok");
        assert!(
            d.log().contains("fail until the model is fixed"),
            "{}",
            d.log()
        );
        d.terminate().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_transcripts_first_line_says_when_a_draft_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        "[model]\nprovider = \"embedded\"\nmodel = \"qwen2.5-coder-0.5b\"\ndraft = \"qwen2.5-coder-0.5b\"\ntemperature = 0.0\nseed = 1\ncontext_tokens = 2048\nmax_tokens = 32\n",
    )
    .unwrap();
    let models = models_dir();
    let out = tandem(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--max-turns",
            "1",
            "Say hi.",
        ],
        &[("TANDEM_MODELS_DIR", models.as_str())],
        None,
    )
    .await;
    let first = out.stdout.lines().next().unwrap_or_default();
    assert!(
        first.contains("tandem · model qwen2.5-coder-0.5b at the embedded engine (")
            && first.contains(", drafting with ")
            && first.contains("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf)"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
}
