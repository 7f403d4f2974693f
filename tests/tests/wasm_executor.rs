//! The WASM executor under real wasmtime, with the runtimes `scripts/fetch-wasm-runtimes.sh`
//! installs (or `TANDEM_WASM_DIR`). Missing runtimes fail these tests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_executor::{
    CancellationToken, ExecContext, ExecError, ExecRequest, ExitStatus, Language, Limits,
};
use tandem_executor_wasm::{ModuleSource, PythonProfile, Runtime, WasmConfig, WasmExecutor};
use tandem_tests::conformance::{self, open, open_with_wall, run};

/// An executor with both runtimes loaded, so that timings in the tests exclude loading.
async fn wasm_with(config: WasmConfig) -> Arc<WasmExecutor> {
    let executor = WasmExecutor::new(config).expect("wasmtime starts");
    for status in executor.runtimes() {
        assert!(
            status.present,
            "these tests need {} (run scripts/fetch-wasm-runtimes.sh)",
            status.path.display()
        );
    }
    for (runtime, result) in executor.warm().await {
        result.unwrap_or_else(|e| panic!("{}: {e}", runtime.file_name()));
    }
    Arc::new(executor)
}

async fn wasm() -> Arc<WasmExecutor> {
    wasm_with(WasmConfig::from_env(&|k| std::env::var_os(k))).await
}

/// One executor per Python profile: the snapshot (the default) and the stock interpreter.
async fn both_pythons() -> Vec<(PythonProfile, Arc<WasmExecutor>)> {
    let mut executors = Vec::new();
    for profile in [PythonProfile::Snapshot, PythonProfile::Stock] {
        let executor = wasm_with(WasmConfig {
            python: profile,
            ..WasmConfig::from_env(&|k| std::env::var_os(k))
        })
        .await;
        executors.push((profile, executor));
    }
    executors
}

#[tokio::test]
async fn shared_behaviour() {
    // WASM runs no sh, so the cases about shells and host processes do not apply.
    conformance::all(
        wasm().await,
        &[
            "exit_codes_and_streams",
            "files_persist_but_variables_do_not",
            "filename_directive",
            "environment_is_isolated",
            "signals_are_as_in_a_fresh_process",
            "timeout_kills_the_whole_tree",
            "python_daemons_do_not_outlive_their_block",
            "published_servers_keep_serving",
            "concurrent_sessions",
        ],
    )
    .await;
}

#[tokio::test]
async fn hello_stderr_and_exit_codes_in_both_languages() {
    let executor = wasm().await;
    let mut s = open(&*executor, Limits::default()).await;
    let out = run(&mut *s, "python", "print('hello from', 'python')").await;
    assert_eq!(
        (out.status, out.stdout.to_text()),
        (ExitStatus::Exited(0), "hello from python\n".to_owned())
    );
    let out = run(&mut *s, "js", "console.log('hello from', 'js')").await;
    assert_eq!(
        (out.status, out.stdout.to_text()),
        (ExitStatus::Exited(0), "hello from js\n".to_owned()),
        "{}",
        out.stderr.to_text()
    );
    let out = run(
        &mut *s,
        "javascript",
        "std.err.puts('to stderr\\n'); std.exit(4)",
    )
    .await;
    assert_eq!(out.status, ExitStatus::Exited(4));
    assert_eq!(out.stderr.to_text(), "to stderr\n");
    let out = run(&mut *s, "python", "raise ValueError('bad value')").await;
    assert_eq!(out.status, ExitStatus::Exited(1));
    assert!(out.stderr.to_text().contains("ValueError: bad value"));
    let out = run(&mut *s, "javascript", "throw new TypeError('bad type')").await;
    assert_eq!(out.status, ExitStatus::Exited(1));
    assert!(out.stderr.to_text().contains("TypeError: bad type"));
    s.close().await.unwrap();
}

#[tokio::test]
async fn syntax_errors_are_program_failures() {
    let executor = wasm().await;
    let mut s = open(&*executor, Limits::default()).await;
    let out = run(&mut *s, "python", "def f(:\n    pass").await;
    assert_eq!(out.status, ExitStatus::Exited(1));
    assert!(out.stderr.to_text().contains("SyntaxError"));
    let out = run(&mut *s, "javascript", "let = ;").await;
    assert_eq!(out.status, ExitStatus::Exited(1));
    assert!(out.stderr.to_text().contains("SyntaxError"));
    s.close().await.unwrap();
}

#[tokio::test]
async fn endless_loops_and_sleeps_stop_at_the_timeout() {
    let executor = wasm().await;
    let mut s = open_with_wall(&*executor, 1).await;
    for (lang, code) in [
        (
            "python",
            "print('started', flush=True)\nwhile True:\n    pass",
        ),
        (
            "python",
            "import time\nprint('started', flush=True)\ntime.sleep(300)",
        ),
        ("javascript", "console.log('started'); for (;;) {}"),
    ] {
        let started = Instant::now();
        let out = run(&mut *s, lang, code).await;
        let took = started.elapsed();
        assert_eq!(out.status, ExitStatus::TimedOut, "{lang}: {code}");
        assert_eq!(out.stdout.to_text(), "started\n");
        assert!(
            took < Duration::from_millis(1500),
            "{lang} returned after {took:?}"
        );
    }
    let out = run(&mut *s, "python", "print('still usable')").await;
    assert_eq!(out.stdout.to_text(), "still usable\n");
    s.close().await.unwrap();
}

#[tokio::test]
async fn a_huge_allocation_is_refused_cleanly() {
    let executor = wasm().await;
    let mut s = open(&*executor, Limits::default()).await;
    let out = run(&mut *s, "python", "b = bytearray(2**31 - 1)\nprint(len(b))").await;
    assert_eq!(
        out.status,
        ExitStatus::Exited(1),
        "{}",
        out.stderr.to_text()
    );
    assert!(
        out.stderr.to_text().contains("MemoryError"),
        "{}",
        out.stderr.to_text()
    );
    // Growing past the cap a little at a time fails the same way, at the cap.
    let out = run(
        &mut *s,
        "python",
        "chunks = []\ntry:\n    while True:\n        chunks.append(bytearray(16 << 20))\nexcept MemoryError:\n    print('refused after', len(chunks) * 16, 'MiB')",
    )
    .await;
    assert_eq!(
        out.status,
        ExitStatus::Exited(0),
        "{}",
        out.stderr.to_text()
    );
    let mib: u64 = out
        .stdout
        .to_text()
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{}", out.stdout.to_text()));
    assert!(
        (160..=256).contains(&mib),
        "the 256 MiB cap let {mib} MiB through"
    );
    let out = run(
        &mut *s,
        "javascript",
        "const a = new ArrayBuffer(2 * 1024 ** 3); console.log(a.byteLength)",
    )
    .await;
    assert_ne!(
        out.status,
        ExitStatus::Exited(0),
        "{}",
        out.stdout.to_text()
    );
    let out = run(&mut *s, "python", "print('still usable')").await;
    assert_eq!(out.stdout.to_text(), "still usable\n");
    s.close().await.unwrap();
}

#[tokio::test]
async fn files_persist_across_blocks_in_the_workspace_only() {
    let executor = wasm().await;
    let mut s = open(&*executor, Limits::default()).await;
    let ws = s.workspace().unwrap().to_owned();
    let out = run(
        &mut *s,
        "python",
        "x = 1\nopen('note.txt', 'w').write('kept')\nimport os\nos.makedirs('sub', exist_ok=True)\nopen('/workspace/sub/abs.txt', 'w').write('abs')",
    )
    .await;
    assert_eq!(
        out.status,
        ExitStatus::Exited(0),
        "{}",
        out.stderr.to_text()
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("note.txt")).unwrap(),
        "kept"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("sub/abs.txt")).unwrap(),
        "abs"
    );
    let out = run(
        &mut *s,
        "python",
        "import os\nprint(open('note.txt').read(), open('sub/abs.txt').read(), os.getcwd())\nprint(x)",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "kept abs /workspace\n");
    assert!(
        out.stderr.to_text().contains("NameError"),
        "{}",
        out.stderr.to_text()
    );
    let out = run(
        &mut *s,
        "javascript",
        "console.log(std.loadFile('note.txt'))",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "kept\n", "{}", out.stderr.to_text());
    // `# filename:` saves a module that later blocks import.
    conformance::saved_module_imports(&mut *s).await;
    let out = run(&mut *s, "python", "# filename: ../up.py\nprint(1)").await;
    assert_eq!(out.status, ExitStatus::Exited(1));
    assert!(
        out.stderr
            .to_text()
            .contains("must stay inside the workspace")
    );
    assert_eq!(
        conformance::dir_names(&ws),
        ["helper.py", "note.txt", "sub"]
    );
    s.close().await.unwrap();
    assert!(!ws.exists(), "the temporary workspace outlived its session");
}

#[tokio::test]
async fn the_host_is_out_of_reach() {
    for (profile, executor) in both_pythons().await {
        host_out_of_reach(&executor, profile).await;
    }
}

async fn host_out_of_reach(executor: &WasmExecutor, profile: PythonProfile) {
    let mut s = open(executor, Limits::default()).await;
    let probe = r#"
import os
def attempt(what, f):
    try:
        f()
        print(what, 'ALLOWED')
    except Exception as e:
        print(what, 'denied', type(e).__name__)
attempt('passwd', lambda: open('/etc/passwd').read())
attempt('dotdot', lambda: open('../../../../etc/passwd').read())
attempt('write-outside', lambda: open('/tmp/escape.txt', 'w').write('x'))
attempt('listdir-root', lambda: os.listdir('/etc'))
import socket
attempt('socket', lambda: socket.create_connection(('127.0.0.1', 22), timeout=1))
print(sorted(os.environ))
"#;
    let out = run(&mut *s, "python", probe).await;
    let text = out.stdout.to_text();
    assert!(
        !text.contains("ALLOWED"),
        "{profile:?}: {text}\n{}",
        out.stderr.to_text()
    );
    for what in [
        "passwd",
        "dotdot",
        "write-outside",
        "listdir-root",
        "socket",
    ] {
        assert!(
            text.contains(&format!("{what} denied")),
            "{profile:?} {what}: {text}\n{}",
            out.stderr.to_text()
        );
    }
    let env_line = text.lines().last().unwrap();
    assert!(
        !env_line.contains("CARGO"),
        "host environment leaked: {env_line}"
    );
    let out = run(
        &mut *s,
        "javascript",
        "console.log(std.loadFile('/etc/passwd'))",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "null\n");
    s.close().await.unwrap();
}

#[tokio::test]
async fn ten_megabytes_of_output_are_capped() {
    let executor = wasm().await;
    let cap = 4096;
    let mut s = open(
        &*executor,
        Limits {
            output_bytes: cap,
            ..Limits::default()
        },
    )
    .await;
    let out = run(
        &mut *s,
        "javascript",
        "const line = 'x'.repeat(1023); for (let i = 0; i < 10240; i++) console.log(line); console.log('END')",
    )
    .await;
    assert_eq!(out.status, ExitStatus::Exited(0));
    assert_eq!(out.stdout.total(), 10 * 1024 * 1024 + 4);
    assert!(out.stdout.truncated());
    assert!(out.stdout.to_text().ends_with("END\n"));
    s.close().await.unwrap();
}

#[tokio::test]
async fn twenty_concurrent_executions() {
    let executor = wasm().await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..20 {
        let executor = executor.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = open(&*executor, Limits::default()).await;
            let lang = if i % 2 == 0 { "python" } else { "javascript" };
            let code = if i % 2 == 0 {
                format!("import os\nopen('mine.txt', 'w').write('{i}')\nprint(open('mine.txt').read(), len(os.listdir('.')))")
            } else {
                format!("std.writeFile('mine.txt', '{i}'); console.log(std.loadFile('mine.txt'), os.readdir('.')[0].filter(n => !n.startsWith('.')).length)")
            };
            let out = run(&mut *s, lang, &code).await;
            s.close().await.unwrap();
            (out.stdout.to_text(), out.stderr.to_text())
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let (stdout, stderr) = t.await.unwrap();
        let files = if i % 2 == 0 { 2 } else { 1 };
        assert_eq!(stdout, format!("{i} {files}\n"), "{stderr}");
    }
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn traps_and_budgets_are_classified_outcomes() {
    let executor = wasm_with(WasmConfig {
        fuel: Some(2_000_000_000),
        ..WasmConfig::from_env(&|k| std::env::var_os(k))
    })
    .await;
    let mut s = open(&*executor, Limits::default()).await;
    let out = run(&mut *s, "python", "print('fits the budget')").await;
    assert_eq!(
        out.stdout.to_text(),
        "fits the budget\n",
        "{}",
        out.stderr.to_text()
    );
    let out = run(&mut *s, "python", "while True:\n    pass").await;
    assert_eq!(out.status, ExitStatus::TimedOut);
    assert!(
        out.stderr.to_text().contains("CPU budget"),
        "{}",
        out.stderr.to_text()
    );
    s.close().await.unwrap();

    // Endless recursion: the snapshot's CPython overflows the wasm stack (a trap), the stock
    // one stops itself first with an exception; QuickJS corrupts its own stack and traps.
    let recurse = "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)";
    for (profile, executor) in both_pythons().await {
        let mut s = open(&*executor, Limits::default()).await;
        let out = run(&mut *s, "python", recurse).await;
        let stderr = out.stderr.to_text();
        match profile {
            PythonProfile::Stock => {
                assert_eq!(out.status, ExitStatus::Exited(1), "{stderr}");
                assert!(!stderr.contains("[tandem]"), "{stderr}");
            }
            _ => {
                assert_eq!(out.status, ExitStatus::Signaled(11), "{stderr}");
                assert!(
                    stderr.ends_with(
                        "[tandem] the program overflowed its stack (wasm trap: call stack exhausted)\n"
                    ),
                    "{stderr}"
                );
            }
        }
        if profile == PythonProfile::Snapshot {
            let out = run(
                &mut *s,
                "javascript",
                "function f() { return f() + 1 }\nf()",
            )
            .await;
            let stderr = out.stderr.to_text();
            assert_eq!(out.status, ExitStatus::Signaled(11), "{stderr}");
            assert!(
                stderr.contains("[tandem] the program crashed (wasm trap:"),
                "{stderr}"
            );
            assert!(!stderr.contains("backtrace"), "{stderr}");
            let out = run(&mut *s, "python", "print('still usable')").await;
            assert_eq!(out.stdout.to_text(), "still usable\n");
        }
        s.close().await.unwrap();
    }
}

#[tokio::test]
async fn the_compiled_module_cache_survives_damage() {
    let runtimes = WasmConfig::from_env(&|k| std::env::var_os(k)).runtimes_dir;
    let cache = tempfile::tempdir().unwrap();
    let config = WasmConfig {
        runtimes_dir: runtimes,
        cache_dir: cache.path().to_owned(),
        ..WasmConfig::from_env(&|k| std::env::var_os(k))
    };
    let quickjs = |executor: &WasmExecutor| {
        let executor = executor.clone();
        async move {
            let warmed = executor.warm().await;
            let (_, result) = warmed
                .into_iter()
                .find(|(r, _)| *r == Runtime::QuickJs)
                .unwrap();
            result.unwrap().source
        }
    };
    // Only QuickJS: compiling CPython into a fresh cache would take seconds.
    std::fs::create_dir_all(cache.path().join("rt")).unwrap();
    std::fs::copy(
        config.runtimes_dir.join("quickjs.wasm"),
        cache.path().join("rt/quickjs.wasm"),
    )
    .unwrap();
    let config = WasmConfig {
        runtimes_dir: cache.path().join("rt"),
        cache_dir: cache.path().join("compiled"),
        ..config
    };
    let first = WasmExecutor::new(config.clone()).unwrap();
    assert_eq!(quickjs(&first).await, ModuleSource::Compiled);
    let second = WasmExecutor::new(config.clone()).unwrap();
    let precompiled = second.precompile().await;
    let (_, result) = precompiled
        .iter()
        .find(|(r, _)| *r == Runtime::QuickJs)
        .unwrap();
    assert_eq!(result.as_ref().unwrap().source, ModuleSource::Cache);
    assert_eq!(quickjs(&second).await, ModuleSource::Cache);
    let entry = std::fs::read_dir(cache.path().join("compiled"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .expect("a .cwasm entry");
    // Damage the middle of the code, where wasmtime's own header checks would not look.
    let mut bytes = std::fs::read(&entry).unwrap();
    let mid = bytes.len() / 2;
    for b in &mut bytes[mid..mid + 64] {
        *b ^= 0xff;
    }
    std::fs::write(&entry, &bytes).unwrap();
    let third = WasmExecutor::new(config.clone()).unwrap();
    assert_eq!(quickjs(&third).await, ModuleSource::Compiled);
    let mut s = open(&third, Limits::default()).await;
    let out = run(&mut *s, "javascript", "console.log(6 * 7)").await;
    assert_eq!(out.stdout.to_text(), "42\n");
    s.close().await.unwrap();
    // Truncated to nothing, then restored again.
    std::fs::write(&entry, b"").unwrap();
    let fourth = WasmExecutor::new(config.clone()).unwrap();
    assert_eq!(quickjs(&fourth).await, ModuleSource::Compiled);
    let fifth = WasmExecutor::new(config).unwrap();
    assert_eq!(quickjs(&fifth).await, ModuleSource::Cache);
}

#[tokio::test]
async fn a_missing_runtime_names_the_fetch_script() {
    let empty = tempfile::tempdir().unwrap();
    let executor = WasmExecutor::new(WasmConfig {
        runtimes_dir: empty.path().to_owned(),
        ..WasmConfig::from_env(&|k| std::env::var_os(k))
    })
    .unwrap();
    assert!(!executor.python_present());
    let mut s = open(&executor, Limits::default()).await;
    let err = s
        .run(
            ExecRequest::new(Language::python(), "print(1)"),
            ExecContext::new(CancellationToken::new()),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ExecError::Unavailable { .. }), "{err}");
    assert!(
        err.to_string().contains("scripts/fetch-wasm-runtimes.sh"),
        "{err}"
    );
    s.close().await.unwrap();
}

#[tokio::test]
async fn both_pythons_behave_like_python() {
    for (profile, executor) in both_pythons().await {
        assert_eq!(
            executor.runtime_for(&Language::python()),
            Some(match profile {
                PythonProfile::Stock => Runtime::Python,
                _ => Runtime::PythonSnapshot,
            })
        );
        let mut s = open(&*executor, Limits::default()).await;
        let ws = s.workspace().unwrap().to_owned();
        let cases: &[(&str, ExitStatus, &str, &str)] = &[
            (
                "import sys, os\nprint(__name__, sys.argv[0].startswith('/workspace/'), os.getcwd())",
                ExitStatus::Exited(0),
                "__main__ True /workspace\n",
                "",
            ),
            ("import sys\nsys.exit(3)", ExitStatus::Exited(3), "", ""),
            (
                "raise SystemExit('bye')",
                ExitStatus::Exited(1),
                "",
                "bye\n",
            ),
            ("import os\nos._exit(5)", ExitStatus::Exited(5), "", ""),
            (
                "def f():\n    return 1 / 0\nf()",
                ExitStatus::Exited(1),
                "",
                "ZeroDivisionError: division by zero",
            ),
            (
                "import atexit\natexit.register(lambda: print('at exit'))\nprint('body')",
                ExitStatus::Exited(0),
                "body\nat exit\n",
                "",
            ),
            (
                "import json, re, math, collections, datetime, decimal, statistics, sqlite3\nprint(json.dumps({'a': math.comb(5, 2)}), 'ok'.encode('idna'))",
                ExitStatus::Exited(0),
                "{\"a\": 10} b'ok'\n",
                "",
            ),
            (
                "open('state.txt', 'w').write('from block')",
                ExitStatus::Exited(0),
                "",
                "",
            ),
            (
                "print(open('state.txt').read())\nprint(globals().get('leftover', 'fresh'))\nleftover = 1",
                ExitStatus::Exited(0),
                "from block\nfresh\n",
                "",
            ),
            (
                "print(globals().get('leftover', 'fresh'))",
                ExitStatus::Exited(0),
                "fresh\n",
                "",
            ),
        ];
        for (code, status, stdout, stderr) in cases {
            let out = run(&mut *s, "python", code).await;
            assert_eq!(
                (out.status, out.stdout.to_text().as_str()),
                (*status, *stdout),
                "{profile:?}: {code}\n{}",
                out.stderr.to_text()
            );
            assert!(
                out.stderr.to_text().contains(stderr),
                "{profile:?}: {code}\n{}",
                out.stderr.to_text()
            );
        }
        // The traceback is the script's own, with none of the snapshot's frames.
        let out = run(&mut *s, "python", "def f():\n    return 1 / 0\nf()").await;
        let tb = out.stderr.to_text();
        assert!(
            tb.starts_with("Traceback (most recent call last):\n  File \"/workspace/"),
            "{profile:?}: {tb}"
        );
        assert_eq!(conformance::dir_names(&ws), ["state.txt"], "{profile:?}");
        s.close().await.unwrap();
    }
}

#[tokio::test]
async fn a_module_missing_from_the_snapshot_says_so() {
    let executor = wasm_with(WasmConfig {
        python: PythonProfile::Snapshot,
        ..WasmConfig::from_env(&|k| std::env::var_os(k))
    })
    .await;
    let mut s = open(&*executor, Limits::default()).await;
    let out = run(&mut *s, "python", "import plistlib").await;
    assert_eq!(out.status, ExitStatus::Exited(1));
    let stderr = out.stderr.to_text();
    assert!(
        stderr.contains("ModuleNotFoundError: No module named 'plistlib'"),
        "{stderr}"
    );
    assert!(stderr.contains("python = \"stock\""), "{stderr}");
    let out = run(&mut *s, "python", "import no_such_module_anywhere").await;
    assert!(
        !out.stderr.to_text().contains("[tandem]"),
        "{}",
        out.stderr.to_text()
    );
    s.close().await.unwrap();
}
