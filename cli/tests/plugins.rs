//! Executor plugins through the real binary: named in `tandem.toml`, they are executors for
//! `exec`, `doctor` and `tandem executor test`, which runs the conformance kit.

use std::path::Path;

use serde_json::Value;
use tandem_protocol::StopReason;
use tandem_tests::daemon::block_results;

use crate::e2e::tandem;

fn repo(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .display()
        .to_string()
}

/// A config naming the Python example plugin `pyplug` and a plugin that runs no block
/// right, `liar`, which says `ok` to everything.
fn config(dir: &Path) -> String {
    let path = dir.join("tandem.toml");
    std::fs::write(
        &path,
        format!(
            "[executors.pyplug]\ncommand = [\"python3\", \"{}\"]\n\n[executors.liar]\ncommand = [\"python3\", \"{}\", \"well\"]\n",
            repo("examples/executor-plugin-python/tandem_plugin.py"),
            repo("tests/plugins/misbehaving.py"),
        ),
    )
    .unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_named_in_the_config_is_an_executor_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path());
    let out = tandem(
        &[
            "exec",
            "--config",
            &config,
            "--executor",
            "pyplug",
            "--lang",
            "python",
            "-",
        ],
        &[],
        Some("print(6 * 7)"),
    )
    .await;
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (0, "42\n"),
        "{}",
        out.stderr
    );

    let out = tandem(
        &[
            "exec",
            "--config",
            &config,
            "--executor",
            "nope",
            "--lang",
            "sh",
            "-",
        ],
        &[],
        Some("echo hi"),
    )
    .await;
    assert_eq!(out.code, 2);
    assert_eq!(
        out.stderr,
        "tandem: executor `nope` is not registered; available: auto, docker, kubernetes, local, wasm, liar, pyplug\n"
    );

    let out = tandem(&["doctor", "--config", &config], &[], None).await;
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("executor:  pyplug"))
        .unwrap_or_else(|| panic!("no pyplug line:\n{}", out.stdout));
    assert!(
        line.starts_with("executor:  pyplug (python, sh) - plugin `python3 ")
            && line.ends_with(
                "` (python example), protocol 1, enforces wall, memory_bytes, cpu_secs, file_size_bytes, open_files"
            ),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn executor_test_prints_a_case_table_and_fails_a_plugin_that_lies() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path());
    let out = tandem(
        &["executor", "test", "pyplug", "--config", &config],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(r"\d+\.\d\d s", "[T] s");
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| insta::assert_snapshot!("executor_test_python_plugin", out.stdout));

    let out = tandem(
        &["executor", "test", "liar", "--json", "--config", &config],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["executor"], "liar");
    let verdict = |case: &str| {
        report["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["case"] == case)
            .map(|c| (c["result"].as_str().unwrap().to_owned(), c["why"].clone()))
            .unwrap()
    };
    // It runs only sh, and says `ok` to everything.
    assert_eq!(
        verdict("stdin_is_closed"),
        (
            "not_applicable".to_owned(),
            Value::from("needs python, which `liar` does not run")
        )
    );
    let (result, why) = verdict("timeout_kills_the_whole_tree");
    assert_eq!(result, "fail");
    assert!(
        why.as_str()
            .unwrap()
            .starts_with("a 1 s timeout gave Exited(0) with stdout \"ok\\n\""),
        "{why}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemon_offers_a_configured_plugin_and_runs_tasks_on_it() {
    let server = tandem_tests::ScriptedOpenAi::start(tandem_tests::script([(
        "plugin task",
        vec![
            tandem_tests::Reply::from("```python\nprint(6 * 7)\n```"),
            tandem_tests::Reply::from("42\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let config = format!(
        "[executors.pyplug]\ncommand = [\"python3\", \"{}\"]\n",
        repo("examples/executor-plugin-python/tandem_plugin.py")
    );
    let mut d = tandem_tests::DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &[],
        Some(&config),
    )
    .await;
    let executors = d.get("/v1/executors").await;
    let pyplug = executors["executors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "pyplug")
        .cloned()
        .unwrap_or_else(|| panic!("no pyplug: {executors}"));
    assert_eq!(
        (&pyplug["health"], &pyplug["offered"], &pyplug["languages"]),
        (
            &Value::from("ok"),
            &Value::from(true),
            &serde_json::json!(["python", "sh"])
        )
    );
    let id = d
        .submit(serde_json::json!({"task": "plugin task", "executor": "pyplug"}))
        .await;
    let task = d
        .wait_finished(&id, std::time::Duration::from_secs(60))
        .await;
    assert_eq!(
        task.record.stop_reason,
        Some(StopReason::Terminated),
        "{task:?}"
    );
    let events = d.events(&id, 0).await;
    let result = block_results(&events)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no block ran: {events:?}"));
    assert_eq!(result.stdout, "42\n", "{result:?}");
    d.terminate().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn files_given_to_a_task_reach_a_plugins_workspace_and_kept_state_is_refused() {
    use tandem_tests::{Reply, ScriptedOpenAi, script};
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path());
    let data = dir.path().join("data.txt");
    std::fs::write(&data, "from the host\n").unwrap();
    let told = "read it\n\nFiles in your working directory (the current directory):\n\
                - data.txt (14 bytes)\n    from the host";
    let server = ScriptedOpenAi::start(script([(
        told,
        vec![
            Reply::from("```python\nprint(open('data.txt').read().upper())\n```"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let url = server.base_url();
    let base = [
        "run",
        "--config",
        &config,
        "-e",
        "pyplug",
        "--base-url",
        &url,
        "--model",
        "m",
        "--json",
        "--file",
    ];
    let mut args = base.to_vec();
    args.extend([data.to_str().unwrap(), "read it"]);
    let out = tandem(&args, &[("TANDEM_MAX_RETRIES", "0")], None).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains(r#""stdout":"FROM THE HOST\n\n""#),
        "{}",
        out.stdout
    );
    // A plugin keeps no interpreter: said before anything runs.
    let mut args = base.to_vec();
    args.extend([data.to_str().unwrap(), "--keep-state", "read it"]);
    let out = tandem(&args, &[], None).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("keep_state: the pyplug executor cannot keep a Python interpreter"),
        "{}",
        out.stderr
    );
}
