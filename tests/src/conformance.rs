//! Behaviour every executor must share, as one suite each backend's tests call with their
//! own executor: `conformance::all(executor).await`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_executor::{
    CancellationToken, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, ExitStatus,
    Language, Limits, Session, SessionSpec, Stream,
};

/// Opens a session with default limits and a temporary workspace.
pub async fn open(executor: &dyn Executor, limits: Limits) -> Box<dyn Session> {
    executor
        .open(SessionSpec {
            limits,
            ..Default::default()
        })
        .await
        .expect("open a session")
}

/// Opens a session whose blocks may run for `secs` seconds.
pub async fn open_with_wall(executor: &dyn Executor, secs: u64) -> Box<dyn Session> {
    open(
        executor,
        Limits {
            wall: Duration::from_secs(secs),
            ..Limits::default()
        },
    )
    .await
}

/// Runs one block with no timeout override and a fresh cancel token.
pub async fn run(session: &mut dyn Session, lang: &str, code: &str) -> ExecOutcome {
    session
        .run(
            ExecRequest::new(Language::new(lang), code),
            ExecContext::new(CancellationToken::new()),
        )
        .await
        .unwrap_or_else(|e| panic!("running {lang} block failed: {e}\n{code}"))
}

fn no_process_matches(marker: &str) {
    let ps = std::process::Command::new("ps")
        .args(["-eo", "pid,args"])
        .output()
        .unwrap();
    let ps = String::from_utf8_lossy(&ps.stdout);
    let left: Vec<&str> = ps.lines().filter(|l| l.contains(marker)).collect();
    assert!(left.is_empty(), "processes survived their block: {left:?}");
}

/// A module saved with `# filename:` imports from a later python block (it leaves
/// `helper.py` in the workspace).
pub async fn saved_module_imports(s: &mut dyn Session) {
    run(
        s,
        "python",
        "# filename: helper.py\ndef double(x):\n    return 2 * x",
    )
    .await;
    let out = run(s, "python", "from helper import double\nprint(double(21))").await;
    assert_eq!(out.stdout.to_text(), "42\n", "{}", out.stderr.to_text());
}

/// The sorted names of the entries of a directory.
pub fn dir_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Every case below, in order.
pub async fn all(executor: Arc<dyn Executor>) {
    exit_codes_and_streams(&*executor).await;
    files_persist_but_variables_do_not(&*executor).await;
    filename_directive(&*executor).await;
    environment_is_isolated(&*executor).await;
    stdin_is_closed(&*executor).await;
    signals_are_as_in_a_fresh_process(&*executor).await;
    timeout_kills_the_whole_tree(&*executor).await;
    python_daemons_do_not_outlive_their_block(&*executor).await;
    cancel_stops_a_block_at_once(&*executor).await;
    big_output_is_capped_without_deadlock(&*executor).await;
    invalid_utf8_is_decoded_lossily(&*executor).await;
    unsupported_language_is_an_error(&*executor).await;
    concurrent_sessions(executor.clone()).await;
}

/// Exit codes, separate stdout and stderr.
pub async fn exit_codes_and_streams(executor: &dyn Executor) {
    let mut s = open(executor, Limits::default()).await;
    let out = run(
        &mut *s,
        "python",
        "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)",
    )
    .await;
    assert_eq!(out.status, ExitStatus::Exited(3));
    assert_eq!(out.stdout.to_text(), "out\n");
    assert_eq!(out.stderr.to_text(), "err\n");
    let out = run(&mut *s, "sh", "echo shell; echo oops >&2; exit 7").await;
    assert_eq!(
        (out.status, out.stdout.to_text(), out.stderr.to_text()),
        (ExitStatus::Exited(7), "shell\n".into(), "oops\n".into())
    );
    let out = run(&mut *s, "python", "def f(:\n  pass").await;
    assert_eq!(out.status, ExitStatus::Exited(1));
    assert!(
        out.stderr.to_text().contains("SyntaxError"),
        "{}",
        out.stderr.to_text()
    );
    s.close().await.unwrap();
}

/// One session is one workspace; each block is a new process.
pub async fn files_persist_but_variables_do_not(executor: &dyn Executor) {
    let mut s = open(executor, Limits::default()).await;
    let ws = s.workspace().map(ToOwned::to_owned);
    let out = run(
        &mut *s,
        "python",
        "x = 1\nopen('note.txt', 'w').write('kept')",
    )
    .await;
    assert_eq!(out.status, ExitStatus::Exited(0));
    let out = run(&mut *s, "sh", "cat note.txt").await;
    assert_eq!(out.stdout.to_text(), "kept");
    let out = run(&mut *s, "python", "print(x)").await;
    assert_eq!(out.status, ExitStatus::Exited(1));
    assert!(out.stderr.to_text().contains("NameError"));
    s.close().await.unwrap();
    if let Some(ws) = ws {
        assert!(
            !ws.exists(),
            "a temporary workspace outlived its session: {}",
            ws.display()
        );
    }
}

/// `# filename:` writes and runs the file; escaping the workspace is refused with exit 1.
pub async fn filename_directive(executor: &dyn Executor) {
    let mut s = open(executor, Limits::default()).await;
    let out = run(
        &mut *s,
        "python",
        "# filename: pkg/mod.py\nprint(__file__.endswith('pkg/mod.py'))",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "True\n");
    let out = run(&mut *s, "sh", "cat pkg/mod.py | head -1").await;
    assert_eq!(out.stdout.to_text(), "# filename: pkg/mod.py\n");
    for bad in ["../up.py", "/etc/evil.py", "a/../../up.py"] {
        let out = run(&mut *s, "python", &format!("# filename: {bad}\nprint(1)")).await;
        assert_eq!(out.status, ExitStatus::Exited(1), "{bad}");
        assert_eq!(out.stdout.to_text(), "", "{bad} must not run");
        assert!(
            out.stderr
                .to_text()
                .contains("must stay inside the workspace"),
            "{bad}"
        );
    }
    let out = run(&mut *s, "python", "# just a comment\nprint('ran')").await;
    assert_eq!(out.stdout.to_text(), "ran\n");
    // Saved modules import from later blocks, as when running a script in that directory.
    saved_module_imports(&mut *s).await;
    // Unnamed blocks leave nothing behind in the workspace.
    if let Some(ws) = s.workspace() {
        assert_eq!(dir_names(ws), ["helper.py", "pkg"]);
    }
    s.close().await.unwrap();
}

/// None of the host's variables reach code (the test runner's CARGO_* stand for secrets).
pub async fn environment_is_isolated(executor: &dyn Executor) {
    assert!(
        std::env::vars().any(|(k, _)| k.starts_with("CARGO")),
        "run this under cargo"
    );
    let mut s = open(executor, Limits::default()).await;
    let out = run(
        &mut *s,
        "sh",
        "env | cut -d= -f1 | grep -E 'CARGO|OPENAI|KEY|TOKEN|SECRET' || echo none",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "none\n");
    s.close().await.unwrap();
}

/// Code that reads stdin sees EOF at once.
pub async fn stdin_is_closed(executor: &dyn Executor) {
    let mut s = open_with_wall(executor, 20).await;
    let started = Instant::now();
    let out = run(
        &mut *s,
        "python",
        "import sys\nprint(repr(sys.stdin.read()))",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "''\n");
    assert!(started.elapsed() < Duration::from_secs(5));
    s.close().await.unwrap();
}

/// A block's programs start with the signal dispositions of a fresh process, whatever its
/// supervisor ignores: a write past the file-size limit kills with SIGXFSZ (exit 153 in sh),
/// and a writer into a closed pipe dies of SIGPIPE (141) instead of looping on EPIPE.
pub async fn signals_are_as_in_a_fresh_process(executor: &dyn Executor) {
    let limits = Limits {
        file_size_bytes: Some(1 << 20),
        ..Limits::default()
    };
    let mut s = open(executor, limits).await;
    let out = run(
        &mut *s,
        "sh",
        "head -c 2000000 /dev/zero > big; echo xfsz $?\n(yes; echo yes-ended $? >&2) | head -n 1 > /dev/null; echo pipe done",
    )
    .await;
    // The shell names the signal on stderr ("File size limit exceeded" in dash).
    let err = out.stderr.to_text();
    assert_eq!(out.stdout.to_text(), "xfsz 153\npipe done\n", "{err}");
    assert!(err.ends_with("\nyes-ended 141\n"), "{err}");
    s.close().await.unwrap();
}

/// A timeout kills children, detached grandchildren included, keeps earlier output, returns
/// within timeout + 1 s, and leaves the session usable.
pub async fn timeout_kills_the_whole_tree(executor: &dyn Executor) {
    // Unique per call: suites for several executors run in parallel in one test process.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let marker = format!("tandem-conformance-{}-{call}x", std::process::id());
    let mut s = open_with_wall(executor, 1).await;
    let code = format!(
        "sleep 300 &\nsetsid sh -c 'sleep 300; : {marker}' > /dev/null 2>&1 &\nsetsid sh -c 'sleep 300; : {marker}-holds-stdout' &\necho started\nsleep 300"
    );
    let started = Instant::now();
    let out = run(&mut *s, "sh", &code).await;
    let took = started.elapsed();
    assert_eq!(out.status, ExitStatus::TimedOut);
    assert_eq!(out.stdout.to_text(), "started\n");
    assert!(took < Duration::from_secs(2), "returned after {took:?}");
    no_process_matches(&marker);
    let out = run(&mut *s, "sh", "echo still usable").await;
    assert_eq!(out.stdout.to_text(), "still usable\n");
    // A block that ends normally takes its background processes with it.
    let out = run(
        &mut *s,
        "sh",
        &format!("setsid sh -c 'sleep 300; : {marker}-bg' > /dev/null 2>&1 &\necho done"),
    )
    .await;
    assert_eq!(out.status, ExitStatus::Exited(0));
    no_process_matches(&marker);
    s.close().await.unwrap();
}

/// A pure-Python daemon (double fork, `setsid`, no exec, so no marker in its command line
/// or environment) dies with its block, whether the block ends or times out. It proves it
/// is alive by appending to a file in the workspace, which works the same on every backend.
pub async fn python_daemons_do_not_outlive_their_block(executor: &dyn Executor) {
    let mut s = open_with_wall(executor, 1).await;
    let ws = s.workspace().expect("a host workspace").to_owned();
    for (beat, tail, status) in [
        ("ended", "", ExitStatus::Exited(0)),
        ("timed-out", "time.sleep(300)\n", ExitStatus::TimedOut),
    ] {
        let code = format!(
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True:\n            with open('{beat}', 'a') as f:\n                f.write('.')\n            time.sleep(0.02)\n    os._exit(0)\nwhile not os.path.exists('{beat}'):\n    time.sleep(0.01)\nprint('daemon running')\n{tail}"
        );
        let out = run(&mut *s, "python", &code).await;
        assert_eq!(
            (out.status, out.stdout.to_text()),
            (status, "daemon running\n".to_owned()),
            "{}",
            out.stderr.to_text()
        );
        let size = || {
            std::fs::metadata(ws.join(beat))
                .map(|m| m.len())
                .unwrap_or(0)
        };
        let before = size();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            size(),
            before,
            "a daemon of the {beat} block is still writing"
        );
    }
    s.close().await.unwrap();
}

/// Cancelling the context kills the block at once.
pub async fn cancel_stops_a_block_at_once(executor: &dyn Executor) {
    let mut s = open(executor, Limits::default()).await;
    let cancel = CancellationToken::new();
    let trigger = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        trigger.cancel();
    });
    let started = Instant::now();
    let out = s
        .run(
            // A busy loop: a sandbox must stop code that never waits on anything.
            ExecRequest::new(
                Language::python(),
                "print('going', flush=True)\nwhile True:\n    pass",
            ),
            ExecContext::new(cancel),
        )
        .await
        .unwrap();
    assert_eq!(out.status, ExitStatus::Cancelled);
    assert_eq!(out.stdout.to_text(), "going\n");
    assert!(started.elapsed() < Duration::from_secs(2));
    s.close().await.unwrap();
}

/// Tens of MB on both streams at once: no deadlock, head and tail kept, live output is the head.
pub async fn big_output_is_capped_without_deadlock(executor: &dyn Executor) {
    let cap = 64 << 10;
    let mut s = open(
        executor,
        Limits {
            output_bytes: cap,
            ..Limits::default()
        },
    )
    .await;
    let live = Arc::new(Mutex::new((0usize, 0usize)));
    let seen = live.clone();
    let ctx =
        ExecContext::new(CancellationToken::new()).with_sink(Arc::new(move |stream, bytes| {
            let mut l = seen.lock().unwrap();
            match stream {
                Stream::Stdout => l.0 += bytes.len(),
                Stream::Stderr => l.1 += bytes.len(),
            }
        }));
    let code = "import sys\nfor i in range(200):\n    sys.stdout.write('o' * 100_000)\n    sys.stderr.write('e' * 100_000)\nprint('\\nLAST')";
    let out = s
        .run(ExecRequest::new(Language::python(), code), ctx)
        .await
        .unwrap();
    assert_eq!(out.status, ExitStatus::Exited(0));
    assert_eq!(out.stdout.total(), 20_000_006);
    assert_eq!(out.stderr.total(), 20_000_000);
    assert!(out.stdout.truncated() && out.stderr.truncated());
    let text = out.stdout.to_text();
    assert!(text.ends_with("\nLAST\n"));
    assert!(text.contains(&format!("[... {} bytes truncated ...]", 20_000_006 - cap)));
    // Live output is the kept head: half the cap.
    assert_eq!(*live.lock().unwrap(), (cap / 2, cap / 2));
    s.close().await.unwrap();
}

/// Bytes that are not UTF-8 become U+FFFD.
pub async fn invalid_utf8_is_decoded_lossily(executor: &dyn Executor) {
    let mut s = open(executor, Limits::default()).await;
    let out = run(
        &mut *s,
        "python",
        "import sys\nsys.stdout.buffer.write(b'a\\xffb\\xc3\\n')",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "a\u{fffd}b\u{fffd}\n");
    s.close().await.unwrap();
}

/// A language the executor does not list is an error naming it and what is supported.
pub async fn unsupported_language_is_an_error(executor: &dyn Executor) {
    let mut s = open(executor, Limits::default()).await;
    let err = s
        .run(
            ExecRequest::new(Language::new("cobol"), "DISPLAY 'HI'."),
            ExecContext::new(CancellationToken::new()),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, ExecError::UnsupportedLanguage { .. }),
        "{err}"
    );
    assert!(err.to_string().starts_with(&format!(
        "language `cobol` is not supported by the {} executor; supported: ",
        executor.name()
    )));
    s.close().await.unwrap();
}

/// Twenty sessions at once, each with its own workspace.
pub async fn concurrent_sessions(executor: Arc<dyn Executor>) {
    let mut tasks = Vec::new();
    for i in 0..20 {
        let executor = executor.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = open(&*executor, Limits::default()).await;
            let out = run(
                &mut *s,
                "sh",
                &format!("echo {i} > mine.txt; cat mine.txt; ls | wc -l"),
            )
            .await;
            s.close().await.unwrap();
            out.stdout.to_text()
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), format!("{i}\n1\n"));
    }
}
