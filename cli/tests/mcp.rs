//! Tandem as an MCP server, driven by the official Python MCP SDK (a real client from outside
//! the project): `tandem mcp` over stdio, and the daemon's `/mcp` over streamable HTTP
//! behind its bearer token. `scripts/fetch-mcp-client.sh` installs the SDK.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tandem_tests::{DaemonHarness, Reply, ScriptedOpenAi, script};

/// The Python of the SDK's virtual environment; its absence fails the test with the fix.
fn client_python() -> PathBuf {
    let venv = std::env::var_os("TANDEM_MCP_CLIENT_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/tandem/mcp-client")
        });
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "no MCP client SDK at {}: run scripts/fetch-mcp-client.sh",
        venv.display()
    );
    python
}

fn client_script() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/mcp/client.py")
        .display()
        .to_string()
}

async fn model() -> ScriptedOpenAi {
    let again = "```python\nprint('the same')\n```";
    ScriptedOpenAi::start(script([
        (
            "mcp task: print 6 * 7",
            vec![
                Reply::from("```python\nprint(6 * 7)\n```"),
                Reply::from("The answer is 42.\nTERMINATE"),
            ],
        ),
        (
            "mcp task: send the same code again",
            vec![
                Reply::from(again),
                Reply::from(again),
                Reply::from("not asked: the same code ran the same"),
            ],
        ),
    ]))
    .await
    .unwrap()
}

/// Runs the client script and returns what it saw.
pub(crate) async fn drive(args: &[&str], env: &[(&str, &str)]) -> Value {
    let out = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(client_python())
            .arg(client_script())
            .args(args)
            .envs(env.iter().copied())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the MCP client hung")
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the MCP client failed:\n{stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A block's timeout over the default cap, as every road refuses it.
const OVER_CAP: &str = "timeout_secs 1000000000 is above this daemon's block timeout cap of 3600 s; ask for less, or raise max_block_timeout_secs under [policy] in the daemon's config";

/// What every transport must give the same client.
fn check(seen: &Value) {
    assert_eq!(
        seen["tools"],
        serde_json::json!(["execute_code", "run_task", "snapshot"])
    );
    let once = &seen["once"]["structured"];
    assert_eq!(
        (once["exit_code"].as_i64(), once["stdout"].as_str()),
        (Some(0), Some("42\n")),
        "{seen}"
    );
    // What the block used, measured in its sandbox, is in the structured result.
    assert!(
        once["resources"]["cpu_secs"]
            .as_f64()
            .is_some_and(|c| c > 0.0)
            && once["resources"]["peak_memory_bytes"]
                .as_u64()
                .is_some_and(|p| p > 1 << 20),
        "{seen}"
    );
    assert_eq!(seen["read"]["structured"]["stdout"], "still here", "{seen}");
    // Another session is another workspace.
    assert_eq!(
        seen["other_session"]["structured"]["exit_code"], 1,
        "{seen}"
    );
    assert_eq!(seen["other_session"]["is_error"], true);
    assert_eq!(
        seen["unknown_tool"]["error"],
        "no tool `rm_rf`; the tools are execute_code, snapshot and run_task"
    );
    // Arguments the tool cannot take are tool results with isError, which the client's model
    // reads (SEP-1303); only the unknown tool above is a protocol error.
    let refused = |case: &str| {
        assert_eq!(seen[case]["is_error"], true, "{case}: {seen}");
        seen[case]["text"].as_str().unwrap().to_owned()
    };
    assert_eq!(refused("no_code"), "`code` is required");
    assert_eq!(
        refused("bad_language"),
        "language `cobol` is not supported by the local executor; supported: python, sh, javascript"
    );
    assert!(
        refused("bad_executor").starts_with("executor `nope` is not"),
        "{seen}"
    );
    assert_eq!(
        refused("huge"),
        "code is 2097152 bytes; a block may hold at most 1048576"
    );
    // Refused, never quietly lowered: the one check every road makes.
    assert_eq!(refused("over_cap"), OVER_CAP);
    assert_eq!(refused("over_cap_session"), OVER_CAP);
    let task = &seen["task"]["structured"];
    assert_eq!(task["stop_reason"], "terminated", "{seen}");
    assert_eq!(task["answer"], "The answer is 42.", "{seen}");
    // The check ran in the task's sandbox after it ended.
    assert_eq!(task["check"]["verdict"], "solved", "{seen}");
    let progress: Vec<&str> = seen["progress"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(progress.first(), Some(&"task_started"), "{progress:?}");
    assert_eq!(progress.last(), Some(&"task_finished"), "{progress:?}");
    assert!(progress.contains(&"exec_result"), "{progress:?}");
    let uri = task["transcript"].as_str().unwrap();
    assert!(
        seen["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == uri),
        "{seen}"
    );
    let transcript = seen["transcript"].as_str().unwrap();
    assert!(
        transcript.contains("mcp task: print 6 * 7") && transcript.contains("42"),
        "{transcript}"
    );
    assert_eq!(seen["missing_resource"], "no task nope");
    let repeated = &seen["repeated"]["structured"];
    assert_eq!(
        (repeated["stop_reason"].as_str(), repeated["turns"].as_u64()),
        (Some("repeated"), Some(2)),
        "{seen}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_mcp_client_uses_tandem_mcp_over_stdio() {
    let server = model().await;
    let models = tempfile::tempdir().unwrap();
    let seen = drive(
        &[
            "stdio",
            env!("CARGO_BIN_EXE_tandem"),
            "mcp",
            "--executor",
            "local",
        ],
        &[
            ("OPENAI_BASE_URL", &server.base_url()),
            ("TANDEM_MODELS_DIR", &models.path().display().to_string()),
            ("TANDEM_HOST", "unix:///nonexistent/tandem.sock"),
        ],
    )
    .await;
    check(&seen);
    // No approval policy here: the block runs.
    assert_eq!(
        seen["denied"]["structured"]["stdout"], "DENY_ME\n",
        "{seen}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_mcp_client_uses_the_daemons_mcp_endpoint_with_its_token() {
    let server = model().await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let listen = format!("127.0.0.1:{port}");
    let token = "mcp-test-token-0123456789";
    let mut daemon = DaemonHarness::start_with_env(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "local", "--listen", &listen],
        Some("[[approval.deny]]\nname = \"the marker\"\npattern = 'DENY_ME'\n"),
        &[("TANDEM_TOKEN", token)],
    )
    .await;
    let url = format!("http://{listen}/mcp");
    // The endpoint is behind the API's auth.
    let refused = reqwest::Client::new()
        .post(&url)
        .header("Accept", "application/json, text/event-stream")
        .json(&serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    let seen = drive(&["http", &url, token], &[]).await;
    check(&seen);
    // Declined by the approval policy: a result the client's model reads, and over HTTP the
    // same words as a refusal.
    let denied = &seen["denied"];
    assert_eq!(denied["is_error"], true, "{seen}");
    assert_eq!(denied["structured"]["status"], "declined", "{seen}");
    let told = denied["text"].as_str().unwrap();
    assert!(told.starts_with("declined: "), "{told}");
    assert!(told.contains("the marker"), "{told}");
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/exec",
            Some(r#"{"language": "sh", "code": "echo DENY_ME"}"#.to_owned()),
        )
        .await;
    assert_eq!(
        (
            status,
            body["error"]["code"].as_str(),
            body["error"]["message"].as_str()
        ),
        (400, Some("not_allowed"), Some(told)),
        "{body}"
    );
    // The same block over HTTP meets the same check, in a session and without one.
    let over = serde_json::json!({"language": "python", "code": "print(1)", "timeout_secs": 1e9});
    let (status, body) = daemon
        .send(reqwest::Method::POST, "/v1/exec", Some(over.to_string()))
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "not_allowed", "{body}");
    assert_eq!(body["error"]["message"], OVER_CAP, "{body}");
    let (status, opened) = daemon
        .send(reqwest::Method::POST, "/v1/sessions", Some("{}".to_owned()))
        .await;
    assert_eq!(status, 201, "{opened}");
    let id = opened["id"].as_str().unwrap();
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/exec"),
            Some(over.to_string()),
        )
        .await;
    assert_eq!(
        (status, body["error"]["message"].as_str()),
        (400, Some(OVER_CAP)),
        "{body}"
    );
    // The task is the daemon's like any other: stored, listed by the API.
    let id = seen["task"]["structured"]["task_id"].as_str().unwrap();
    assert_eq!(
        daemon.get(&format!("/v1/tasks/{id}")).await["state"],
        "finished"
    );
    daemon.terminate().await;
}
