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
    conformance::all(local(), &[]).await;
}

fn without_fork_server() -> Arc<LocalExecutor> {
    Arc::new(LocalExecutor::new(LocalConfig {
        python_fork_server: false,
        ..LocalConfig::default()
    }))
}

#[tokio::test(flavor = "multi_thread")]
async fn local_executor_without_fork_server_passes_the_conformance_suite() {
    // Without the fork server there is no holder: its ports are not published.
    conformance::all(without_fork_server(), &["published_servers_keep_serving"]).await;
}

const PARENT: &str =
    "import os\nprint(open('/proc/%d/cmdline' % os.getppid()).read().split('\\0')[2][:30])";

#[tokio::test(flavor = "multi_thread")]
async fn python_blocks_fork_from_the_warm_interpreter_which_restarts_if_killed() {
    let executor = local();
    let mut s = conformance::open(&*executor, Limits::default()).await;
    let out = conformance::run(&mut *s, "python", PARENT).await;
    assert_eq!(out.stdout.to_text(), "# Tandem's Python fork server:\n");
    // The block's parent is the init of its own PID namespace (a fork of the server, so its
    // command line is the server's), and the server is outside that namespace: the block
    // cannot name it, let alone signal it.
    let out = conformance::run(&mut *s, "python", "import os\nwaiter = os.getppid()\nserver = int(open('/proc/%d/stat' % waiter).read().split(')')[1].split()[1])\nprint(waiter, server)").await;
    assert_eq!(out.stdout.to_text(), "1 0\n", "{:?}", out.stderr.to_text());
    // The host finds the server above a `sleep` the block starts: the ancestor whose parent
    // is this test. The block waits for the word that it was found.
    let ws = s.workspace().unwrap().to_owned();
    let tag = format!("60.{}", std::process::id());
    let code = format!(
        "import os, subprocess, time\np = subprocess.Popen(['sleep', '{tag}'])\nfor _ in range(600):\n    if os.path.exists('found'):\n        break\n    time.sleep(0.1)\np.kill()"
    );
    let find = async {
        let wanted = format!("sleep\0{tag}\0");
        for _ in 0..600 {
            let sleeper = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
                let pid: u32 = e.file_name().to_str()?.parse().ok()?;
                (std::fs::read(e.path().join("cmdline")).ok()? == wanted.as_bytes()).then_some(pid)
            });
            if let Some(mut pid) = sleeper {
                while let Some(up) = tandem_tests::parent_of(pid) {
                    if up == std::process::id() {
                        std::fs::write(ws.join("found"), "").unwrap();
                        return pid;
                    }
                    pid = up;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the block's sleep never showed up on the host");
    };
    let (out, server) = tokio::join!(conformance::run(&mut *s, "python", &code), find);
    assert_eq!(
        out.status,
        ExitStatus::Exited(0),
        "{:?}",
        out.stderr.to_text()
    );
    let server = server.to_string();
    let server = server.as_str();
    let out = conformance::run(&mut *s, "python", "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\n    print('killed the waiter')\nexcept PermissionError:\n    print('refused')").await;
    assert_eq!(out.stdout.to_text(), "refused\n", "{:?}", out.status);
    // An sh block too, spawned by a thread of the waiter that entered such a domain first;
    // that thread is gone before the block runs, so no thread of the waiter can be killed.
    let out = conformance::run(
        &mut *s,
        "sh",
        "for t in /proc/$PPID/task/*; do kill -9 ${t##*/} 2>/dev/null && echo killed the waiter; done; echo refused",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "refused\n", "{:?}", out.status);
    let killed = std::process::Command::new("kill")
        .args(["-9", server])
        .status()
        .unwrap();
    assert!(killed.success());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let out = conformance::run(&mut *s, "python", "print('after restart')").await;
    assert_eq!(
        (out.status, out.stdout.to_text()),
        (ExitStatus::Exited(0), "after restart\n".to_owned())
    );
    s.close().await.unwrap();
    // Turned off, python starts fresh: its parent is Tandem itself.
    let mut s = conformance::open(&*without_fork_server(), Limits::default()).await;
    let out = conformance::run(&mut *s, "python", PARENT).await;
    assert_ne!(out.stdout.to_text(), "# Tandem's Python fork server:\n");
    s.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn forked_blocks_report_like_a_fresh_interpreter() {
    for executor in [local(), without_fork_server()] {
        let mut s = conformance::open(&*executor, Limits::default()).await;
        let ws = s.workspace().unwrap().to_owned();
        let out = conformance::run(
            &mut *s,
            "python",
            "# filename: app.py\ndef f():\n    raise KeyError('k')\nf()",
        )
        .await;
        let app = ws.join("app.py");
        assert_eq!(
            out.stderr.to_text(),
            format!(
                "Traceback (most recent call last):\n  File \"{0}\", line 4, in <module>\n    f()\n  File \"{0}\", line 3, in f\n    raise KeyError('k')\nKeyError: 'k'\n",
                app.display()
            )
        );
        let out = conformance::run(&mut *s, "python", "import sys, atexit\natexit.register(lambda: print('atexit ran'))\nprint(__name__, sys.argv == [__file__])\nsys.exit(4)").await;
        assert_eq!(
            (out.status, out.stdout.to_text()),
            (
                ExitStatus::Exited(4),
                "__main__ True\natexit ran\n".to_owned()
            )
        );
        let out = conformance::run(&mut *s, "python", "import threading, time\ndef late():\n    time.sleep(0.2)\n    print('thread done')\nthreading.Thread(target=late).start()").await;
        assert_eq!(out.stdout.to_text(), "thread done\n");
        s.close().await.unwrap();
    }
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

/// Blocks of other languages are started by the Python fork server, which ignores SIGPIPE;
/// they must not inherit that (`yes` would then complain of a broken pipe instead of ending).
#[tokio::test(flavor = "multi_thread")]
async fn sh_blocks_start_with_default_signal_dispositions() {
    let executor = local();
    let mut s = conformance::open(&*executor, Limits::default()).await;
    let out = conformance::run(&mut *s, "sh", "yes | head -n 1").await;
    assert_eq!(
        (out.status, out.stdout.to_text(), out.stderr.to_text()),
        (ExitStatus::Exited(0), "y\n".to_owned(), String::new())
    );
    s.close().await.unwrap();
}

/// Blocks that end at once, as fast as they come, on a machine kept busy: the init of each
/// block's PID namespace is what the status pipe names first, before the block can end (a
/// wait status of 0 read as the pid once made Tandem kill its own process group).
#[tokio::test(flavor = "multi_thread")]
async fn instant_blocks_each_report_their_init_before_they_end() {
    let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let burners: Vec<_> = (0..4)
        .map(|_| {
            let busy = busy.clone();
            std::thread::spawn(move || {
                while busy.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let sessions = (0..3).map(|_| async {
        let executor = local();
        let mut s = conformance::open(&*executor, Limits::default()).await;
        for i in 0..100 {
            let (lang, code) = if i % 2 == 0 {
                ("sh", "true")
            } else {
                ("python", "pass")
            };
            let out = conformance::run(&mut *s, lang, code).await;
            assert_eq!(
                out.status,
                ExitStatus::Exited(0),
                "block {i}: {:?}",
                out.stderr.to_text()
            );
        }
        s.close().await.unwrap();
    });
    futures::future::join_all(sessions).await;
    busy.store(false, std::sync::atomic::Ordering::Relaxed);
    for b in burners {
        b.join().unwrap();
    }
}
