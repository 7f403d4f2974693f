use std::sync::Arc;
use std::time::Duration;

use tandem_executor::{ExitStatus, Limits};
use tandem_executor_local::{LocalConfig, LocalExecutor};
use tandem_tests::conformance;

fn local() -> Arc<LocalExecutor> {
    Arc::new(LocalExecutor::new(LocalConfig::default()))
}

#[tokio::test(flavor = "multi_thread")]
async fn local_executor_passes_the_conformance_suite() {
    conformance::all(local()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn languages_on_this_machine() {
    use tandem_executor::Executor;
    let names: Vec<String> = local()
        .languages()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        names,
        ["python", "sh", "javascript"],
        "CI installs python3 and node"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_limit_gives_python_a_memory_error() {
    let limits = Limits {
        memory_bytes: Some(1 << 30),
        ..Limits::default()
    };
    let mut s = conformance::open(&*local(), limits).await;
    let out = conformance::run(
        &mut *s,
        "python",
        "try:\n    b = bytearray(2 << 30)\nexcept MemoryError:\n    print('MemoryError')",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "MemoryError\n");
    s.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn cpu_and_file_size_limits_kill_with_a_reason() {
    let limits = Limits {
        cpu_secs: Some(1),
        file_size_bytes: Some(1 << 20),
        wall: Duration::from_secs(20),
        ..Limits::default()
    };
    let mut s = conformance::open(&*local(), limits).await;
    let out = conformance::run(&mut *s, "sh", "while :; do :; done").await;
    assert!(
        matches!(out.status, ExitStatus::Signaled(24 | 9)),
        "{:?}",
        out.status
    );
    let out = conformance::run(
        &mut *s,
        "python",
        "open('big', 'wb').write(b'x' * (2 << 20))",
    )
    .await;
    assert!(
        matches!(out.status, ExitStatus::Signaled(25) | ExitStatus::Exited(1)),
        "{:?}",
        out.status
    );
    s.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn javascript_runs_under_node() {
    let mut s = conformance::open(&*local(), Limits::default()).await;
    let out = conformance::run(
        &mut *s,
        "js",
        "console.log([1, 2, 3].map(x => x * 2).join(','))",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "2,4,6\n");
    s.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn kept_workdir_survives_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let spec = tandem_executor::SessionSpec {
        workdir: Some(dir.path().to_owned()),
        ..Default::default()
    };
    let mut s = tandem_executor::Executor::open(&*local(), spec)
        .await
        .unwrap();
    conformance::run(&mut *s, "sh", "echo hi > kept.txt").await;
    s.close().await.unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("kept.txt")).unwrap(),
        "hi\n"
    );
}
