//! Out-of-process executors: the Python example plugin against the conformance kit, and
//! plugins that break the protocol in each way a plugin can, against Tandem's supervision.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_executor::{
    CancellationToken, ExecContext, ExecError, ExecRequest, Executor, ExitStatus, Language, Limits,
    SessionSpec,
};
use tandem_executor_plugin::{PluginConfig, PluginExecutor};
use tandem_tests::conformance;

fn repo(path: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .to_string_lossy()
        .into_owned()
}

fn python_example() -> PluginConfig {
    let mut config = PluginConfig::new(
        "pyplug",
        vec![
            "python3".to_owned(),
            repo("examples/executor-plugin-python/tandem_plugin.py"),
        ],
    );
    config.env = vec![("PATH".to_owned(), "/usr/local/bin:/usr/bin:/bin".to_owned())];
    config
}

/// The misbehaving test plugin in `mode`, answering within short timeouts.
fn misbehaving(mode: &str, extra: &[&str]) -> PluginConfig {
    let mut command = vec![
        "python3".to_owned(),
        repo("tests/plugins/misbehaving.py"),
        mode.to_owned(),
    ];
    command.extend(extra.iter().map(|s| (*s).to_owned()));
    let mut config = PluginConfig::new(format!("bad-{mode}"), command);
    config.env = vec![("PATH".to_owned(), "/usr/local/bin:/usr/bin:/bin".to_owned())];
    config.start_timeout = Duration::from_secs(2);
    config.session_timeout = Duration::from_secs(2);
    config
}

async fn sh(
    executor: &PluginExecutor,
    wall: Duration,
) -> Result<tandem_executor::ExecOutcome, ExecError> {
    let mut s = executor
        .open(SessionSpec {
            limits: Limits {
                wall,
                ..Limits::default()
            },
            ..SessionSpec::default()
        })
        .await?;
    let out = s
        .run(
            ExecRequest::new(Language::sh(), "echo hi"),
            ExecContext::new(CancellationToken::new()),
        )
        .await;
    let _ = s.close().await;
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_python_example_plugin_passes_the_conformance_kit() {
    let plugin = Arc::new(PluginExecutor::new(python_example()).await.unwrap());
    assert_eq!(plugin.languages(), [Language::python(), Language::sh()]);
    // The plugin protocol has no way in to a session's ports.
    conformance::all(plugin.clone(), &["published_servers_keep_serving"]).await;
    // Every session and block went through one plugin process.
    assert_eq!(plugin.starts(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_that_never_answers_initialize_is_named_and_killed() {
    let started = Instant::now();
    let err = PluginExecutor::new(misbehaving("silent", &[]))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.starts_with("executor plugin `bad-silent` (`python3 ")
            && err.contains(
                "it did not answer initialize within 2 s; is it a Tandem executor plugin?"
            ),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_that_prints_garbage_is_told_apart_from_a_slow_one() {
    let err = PluginExecutor::new(misbehaving("garbage", &[]))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("did not answer initialize within 2 s; it sent a line that is not JSON"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_of_another_protocol_version_is_refused() {
    let err = PluginExecutor::new(misbehaving("wrong-version", &[]))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.ends_with("it speaks executor protocol version 99, and this Tandem speaks 1"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_program_says_which_and_where_to_fix_it() {
    let mut config = misbehaving("well", &[]);
    config.command = vec!["/nonexistent/plugin".to_owned()];
    let err = PluginExecutor::new(config).await.err().unwrap().to_string();
    assert!(
        err.contains("starting it failed: No such file or directory")
            && err.ends_with("check `command` in [executors.bad-well]"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_answer_with_the_wrong_id_fails_the_block_clearly_and_the_next_start_works() {
    let plugin = PluginExecutor::new(misbehaving("wrong-id", &[]))
        .await
        .unwrap();
    let started = Instant::now();
    let err = sh(&plugin, Duration::from_secs(1))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("executor plugin `bad-wrong-id` never answered the block: it answered id ")
            && err.contains("which Tandem never sent or no longer waits for"),
        "{err}"
    );
    // The block's timeout, then the grace after $/cancel.
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(plugin.starts(), 1);
    let _ = sh(&plugin, Duration::from_secs(1)).await;
    assert_eq!(
        plugin.starts(),
        2,
        "the killed plugin was not started again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_that_crashes_mid_block_reports_it_and_the_next_block_works() {
    let state = tempfile::tempdir().unwrap();
    let flag = state.path().join("crashed").to_string_lossy().into_owned();
    let plugin = PluginExecutor::new(misbehaving("crash-once", &[&flag]))
        .await
        .unwrap();
    let mut s = plugin.open(SessionSpec::default()).await.unwrap();
    let ws = s.workspace().unwrap().to_owned();
    std::fs::write(ws.join("kept.txt"), "still here").unwrap();
    let hi = || {
        (
            ExecRequest::new(Language::sh(), "echo hi"),
            ExecContext::new(CancellationToken::new()),
        )
    };
    let (req, ctx) = hi();
    let err = s.run(req, ctx).await.unwrap_err().to_string();
    assert_eq!(
        err,
        "executor plugin `bad-crash-once` exited with status 3 (its last stderr line: misbehaving plugin: crashing on purpose) while running the block; it starts again for the next block"
    );
    // Same session, a new plugin process: the session is reopened on the same workspace.
    let (req, ctx) = hi();
    let out = s.run(req, ctx).await.unwrap();
    assert_eq!(
        (out.status, out.stdout.to_text()),
        (ExitStatus::Exited(0), "ok\n".to_owned())
    );
    assert_eq!(plugin.starts(), 2);
    assert!(ws.join("kept.txt").exists());
    s.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_output_is_bounded_on_tandems_side() {
    let plugin = PluginExecutor::new(misbehaving("flood", &[]))
        .await
        .unwrap();
    let out = sh(&plugin, Duration::from_secs(30)).await.unwrap();
    assert_eq!(out.status, ExitStatus::Exited(0));
    assert_eq!(out.stdout.total(), 800 * 65536 + 5);
    assert!(out.stdout.truncated());
    assert!(out.stdout.to_text().len() < (64 << 10) + 100);
    assert!(out.stdout.to_text().ends_with("\nEND\n"));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_message_is_dropped_and_the_rest_read() {
    let plugin = PluginExecutor::new(misbehaving("oversized", &[]))
        .await
        .unwrap();
    let out = sh(&plugin, Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        (out.status, out.stdout.to_text()),
        (ExitStatus::Exited(0), "small\n".to_owned())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_that_ignores_cancel_is_killed_and_tandem_keeps_its_timeout() {
    let plugin = PluginExecutor::new(misbehaving("ignore-cancel", &[]))
        .await
        .unwrap();
    let pid = plugin.pid().await.unwrap();
    let started = Instant::now();
    let out = sh(&plugin, Duration::from_millis(500)).await.unwrap();
    assert_eq!(out.status, ExitStatus::TimedOut);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let child: u32 = out
        .stdout
        .to_text()
        .trim()
        .strip_prefix("child ")
        .unwrap()
        .parse()
        .unwrap();
    // The plugin and what it started (its process group) are killed.
    let gone = Instant::now();
    for pid in [pid, child] {
        while std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| !s.contains(") Z "))
        {
            assert!(
                gone.elapsed() < Duration::from_secs(2),
                "{pid} outlived the plugin's kill"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Cancel works the same way.
    let mut s = plugin.open(SessionSpec::default()).await.unwrap();
    let cancel = CancellationToken::new();
    let trigger = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        trigger.cancel();
    });
    let out = s
        .run(
            ExecRequest::new(Language::sh(), "echo hi"),
            ExecContext::new(cancel),
        )
        .await
        .unwrap();
    assert_eq!(out.status, ExitStatus::Cancelled);
    assert_eq!(plugin.starts(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_that_hangs_on_close_is_reported_and_the_workspace_still_removed() {
    let plugin = PluginExecutor::new(misbehaving("hang-close", &[]))
        .await
        .unwrap();
    let s = plugin.open(SessionSpec::default()).await.unwrap();
    let ws = s.workspace().unwrap().to_owned();
    let err = s.close().await.unwrap_err().to_string();
    assert_eq!(
        err,
        "executor plugin `bad-hang-close` did not answer session/close within 2 s"
    );
    assert!(!ws.exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn dropping_the_executor_ends_the_plugin_process() {
    let plugin = PluginExecutor::new(misbehaving("well", &[])).await.unwrap();
    let pid = plugin.pid().await.unwrap();
    drop(plugin);
    let started = Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        // It exits on EOF of its stdin; the group kill after the grace is the backstop.
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "the plugin outlived Tandem's executor"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_gets_only_the_environment_it_is_given() {
    // Tandem's own variables (the test runner's CARGO_* stand for keys and tokens) stay out.
    assert!(std::env::vars().any(|(k, _)| k.starts_with("CARGO")));
    let mut config = misbehaving("env", &[]);
    config
        .env
        .push(("PLUGIN_SETTING".to_owned(), "1".to_owned()));
    let plugin = PluginExecutor::new(config).await.unwrap();
    let out = sh(&plugin, Duration::from_secs(5)).await.unwrap();
    // Python itself may add LC_CTYPE when it coerces the C locale.
    let names: Vec<String> = out
        .stdout
        .to_text()
        .split_whitespace()
        .filter(|n| *n != "LC_CTYPE")
        .map(str::to_owned)
        .collect();
    assert_eq!(names, ["PATH", "PLUGIN_SETTING"]);
}
