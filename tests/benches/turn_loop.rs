//! Benchmarks for Tandem's hot paths, each against a baseline measured in the same run.
//!
//! `cargo build --release -p tandem-cli && cargo bench -p tandem-tests`
//!
//! 1. Local executor: per-block cost of `print(1)` vs a bare `python3 -c 'print(1)'` spawn.
//! 2. Turn loop: 200 two-turn tasks against ScriptedOpenAi, concurrency 8, in tasks/s.
//! 3. Cold start: `tandem run` process start to the model server seeing its first request.
//! 5. Daemon: 200 two-turn tasks over HTTP vs in-process, submit-to-first-event latency,
//!    and RSS idle and with 1000 queued tasks (the release `tandem` binary).
//! 4. Docker executor: per-block `print(1)` through Tandem's runner vs `docker exec` (the CLI)
//!    and bollard's exec API, in the same container (image: `TANDEM_DOCKER_IMAGE`, else
//!    `tandem-sandbox:latest`).
//! 6. Plugins: `print(1)` through the Python example plugin vs the built-in local executor,
//!    and the protocol's own round trip (a plugin that answers each block at once).
//! 7. MCP: `execute_code` of `print(1)` over `tandem mcp`'s stdio in a warm session vs
//!    `tandem exec` of the same block, and vs the same session run in-process.
//! 8. Session budget: the turn loop's tasks with the executor under the daemon's budget (every
//!    session holding a permit) vs the same executor unwrapped, alternated rounds.
//! 9. Kept state (local): a `print` block and a block that needs a 200 MB value, in a kept
//!    interpreter vs a fresh process per block (which must load the value again each time).
//! 10. Files: 100 MB uploaded to the daemon and downloaded from a task's workspace vs `cat`
//!     of the same bytes to a file and from a file (the release `tandem` binary).
//! 11. Tools: a two-turn task whose `print(1)` comes as an `execute_code` tool call vs the
//!     same block fenced, alternated; and a call of an HTTP tool from inside a local block vs
//!     the same request made straight from this process.
//! 12. Docker hosts: `print(1)` per block on the local socket (bind and volume workspaces)
//!     and on a second engine over TLS, alternated; sessions opened and tasks run per second
//!     by a fleet of one host against two (the system engine and the second one).
//! 14. Traces: the turn loop's tasks with the task's spans exported over OTLP/HTTP to a
//!     collector on loopback vs the same tasks with export off (alternated rounds); and a
//!     daemon's tasks per second with `[telemetry]` against one without, alternated.
//! 13. Kubernetes: a session's open (claim, pod, runner ready) and close, and `print(1)` and
//!     a 1 KiB write per block, through the stand-in API server (exec over its WebSocket),
//!     against the Docker executor with a volume workspace on the local socket, alternated.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

use tandem_agent::{ChatModel, ModelConfig, TaskSettings, run_task};
use tandem_executor::{
    CancellationToken, ExecContext, ExecRequest, Executor, Language, SessionSpec,
};
use tandem_executor_local::{Confine, LocalConfig, LocalExecutor};
use tandem_executor_plugin::{PluginConfig, PluginExecutor};
use tandem_protocol::StopReason;
use tandem_tests::{DaemonHarness, Reply, Script, ScriptedOpenAi};

fn stats(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    (mean, samples[samples.len() / 2])
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// The interpreter for every measurement: `TANDEM_BENCH_PYTHON`, else the system python
/// (version-manager pythons can spend 30+ ms in `site` alone, which is not Tandem's cost).
fn bench_python() -> Option<PathBuf> {
    std::env::var_os("TANDEM_BENCH_PYTHON")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from("/usr/bin/python3")).filter(|p| p.exists()))
}

fn local_executor(fork_server: bool) -> LocalExecutor {
    // `TANDEM_BENCH_CONFINE=off` measures the unconfined executor beside the default.
    let confine = match std::env::var("TANDEM_BENCH_CONFINE").as_deref() {
        Ok("off") => Confine::Off,
        _ => Confine::Auto,
    };
    confined_executor(fork_server, confine)
}

fn confined_executor(fork_server: bool, confine: Confine) -> LocalExecutor {
    LocalExecutor::new(LocalConfig {
        python: bench_python(),
        python_fork_server: fork_server,
        confine,
        ..LocalConfig::default()
    })
}

/// Per-block cost of confinement: python (fork server) and sh blocks in a confined and an
/// unconfined session, interleaved.
async fn confinement_overhead(n: usize) {
    let mut sessions = Vec::new();
    for confine in [Confine::Off, Confine::Auto] {
        sessions.push(
            confined_executor(true, confine)
                .open(SessionSpec::default())
                .await
                .unwrap(),
        );
    }
    let blocks = [(Language::python(), "print(1)"), (Language::sh(), "echo 1")];
    // samples[block][session]
    let mut samples = vec![vec![Vec::new(); sessions.len()]; blocks.len()];
    for i in 0..=n {
        for ((language, code), per_session) in blocks.iter().zip(&mut samples) {
            for (session, times) in sessions.iter_mut().zip(per_session.iter_mut()) {
                let t = Instant::now();
                let ctx = ExecContext::new(CancellationToken::new());
                let out = session
                    .run(ExecRequest::new(language.clone(), *code), ctx)
                    .await
                    .unwrap();
                assert_eq!(out.stdout.to_text(), "1\n");
                if i > 0 {
                    times.push(t.elapsed());
                }
            }
        }
    }
    for session in sessions {
        session.close().await.unwrap();
    }
    // What a session costs to open and close, with no block run in it.
    let executors = [
        confined_executor(true, Confine::Off),
        confined_executor(true, Confine::Auto),
    ];
    let mut opens = vec![Vec::new(); executors.len()];
    for i in 0..=n {
        for (executor, times) in executors.iter().zip(&mut opens) {
            let t = Instant::now();
            let s = executor.open(SessionSpec::default()).await.unwrap();
            s.close().await.unwrap();
            if i > 0 {
                times.push(t.elapsed());
            }
        }
    }
    println!("\n## Confinement: one block, {n} runs each, fork server, interleaved");
    println!("| block | unconfined mean | confined mean | confined median | ratio (mean) |");
    println!("|---|---|---|---|---|");
    for ((language, code), mut per_session) in blocks.iter().zip(samples) {
        let (cm, cp) = stats(per_session.pop().unwrap_or_default());
        let (um, _) = stats(per_session.pop().unwrap_or_default());
        println!(
            "| {language} `{code}` | {} | {} | {} | {:.2}x |",
            ms(um),
            ms(cm),
            ms(cp),
            cm.as_secs_f64() / um.as_secs_f64()
        );
    }
    let (cm, cp) = stats(opens.pop().unwrap_or_default());
    let (um, _) = stats(opens.pop().unwrap_or_default());
    println!(
        "| open and close a session, no block | {} | {} | {} | {:.2}x |",
        ms(um),
        ms(cm),
        ms(cp),
        cm.as_secs_f64() / um.as_secs_f64()
    );
}

/// Blocks through executor plugins beside the built-in local executor, interleaved: the
/// Python example plugin's `print(1)` against local's, and the protocol's own cost per block:
/// a plugin that answers each run at once (one output notification and the result).
async fn plugin_overhead(n: usize) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let plugin = |name: &str, args: Vec<String>| {
        let mut config = PluginConfig::new(name, args);
        config.env = vec![("PATH".to_owned(), "/usr/local/bin:/usr/bin:/bin".to_owned())];
        config
    };
    let python = bench_python().unwrap_or_else(|| PathBuf::from("python3"));
    let python = python.display().to_string();
    let example = plugin(
        "pyplug",
        vec![
            python.clone(),
            root.join("examples/executor-plugin-python/tandem_plugin.py")
                .display()
                .to_string(),
        ],
    );
    let noop = plugin(
        "noop",
        vec![
            python,
            root.join("tests/plugins/misbehaving.py")
                .display()
                .to_string(),
            "well".to_owned(),
        ],
    );
    let executors: Vec<(&str, Arc<dyn Executor>, Language)> = vec![
        (
            "built-in local (fork server)",
            Arc::new(local_executor(true)),
            Language::python(),
        ),
        (
            "Python example plugin",
            Arc::new(PluginExecutor::new(example).await.unwrap()),
            Language::python(),
        ),
        (
            "no-op plugin: the protocol's round trip",
            Arc::new(PluginExecutor::new(noop).await.unwrap()),
            Language::sh(),
        ),
    ];
    let mut sessions = Vec::new();
    for (_, executor, _) in &executors {
        sessions.push(executor.open(SessionSpec::default()).await.unwrap());
    }
    let mut samples = vec![Vec::new(); executors.len()];
    for i in 0..=n {
        for ((session, (_, _, language)), times) in
            sessions.iter_mut().zip(&executors).zip(&mut samples)
        {
            let t = Instant::now();
            let out = session
                .run(
                    ExecRequest::new(language.clone(), "print(1)"),
                    ExecContext::new(CancellationToken::new()),
                )
                .await
                .unwrap();
            assert!(
                ["1\n", "ok\n"].contains(&out.stdout.to_text().as_str()),
                "{out:?}"
            );
            if i > 0 {
                times.push(t.elapsed());
            }
        }
    }
    for session in sessions {
        session.close().await.unwrap();
    }
    println!("\n## Executor plugins: one `print(1)` block, {n} runs each, interleaved");
    println!("| executor | mean | median | mean vs built-in local |");
    println!("|---|---|---|---|");
    let (local_mean, _) = stats(samples[0].clone());
    for ((label, _, _), times) in executors.iter().zip(samples) {
        let (mean, median) = stats(times);
        println!(
            "| {label} | {} | {} | {:.2}x |",
            ms(mean),
            ms(median),
            mean.as_secs_f64() / local_mean.as_secs_f64()
        );
    }
}

/// `execute_code` over MCP stdio (the release `tandem mcp`, a session kept warm by its id)
/// beside `tandem exec` of the same block and the block run in-process; local executor.
async fn mcp_overhead(n: usize) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let Some(bin) = tandem_binary() else {
        println!(
            "\n## MCP: not measured: build the binary first with `cargo build --release -p tandem-cli`"
        );
        return;
    };
    let models = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(&bin)
        .args(["mcp", "--executor", "local"])
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .env("TANDEM_MODELS_DIR", models.path())
        .env("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut id = 0u64;
    let mut call = async |method: &str, params: serde_json::Value| {
        id += 1;
        let line =
            serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        loop {
            let answer: serde_json::Value =
                serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
            if answer["id"] == id {
                return answer;
            }
        }
    };
    call(
        "initialize",
        serde_json::json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}),
    )
    .await;
    let block = serde_json::json!({"name": "execute_code", "arguments": {"language": "python", "code": "print(1)", "session_id": "bench"}});
    let executor = local_executor(true);
    let mut session = executor.open(SessionSpec::default()).await.unwrap();
    let (mut over_mcp, mut exec, mut in_process) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..=n {
        let t = Instant::now();
        let answer = call("tools/call", block.clone()).await;
        assert_eq!(
            answer["result"]["structuredContent"]["stdout"], "1\n",
            "{answer}"
        );
        let mcp = t.elapsed();
        let t = Instant::now();
        let mut cli = tokio::process::Command::new(&bin)
            .args(["exec", "--executor", "local", "--lang", "python", "-"])
            .env("XDG_CONFIG_HOME", "/nonexistent")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut input = cli.stdin.take().unwrap();
        input.write_all(b"print(1)").await.unwrap();
        drop(input);
        let out = cli.wait_with_output().await.unwrap();
        assert_eq!(out.stdout, b"1\n");
        let cli = t.elapsed();
        let t = Instant::now();
        session
            .run(
                ExecRequest::new(Language::python(), "print(1)"),
                ExecContext::new(CancellationToken::new()),
            )
            .await
            .unwrap();
        if i > 0 {
            over_mcp.push(mcp);
            exec.push(cli);
            in_process.push(t.elapsed());
        }
    }
    session.close().await.unwrap();
    drop(stdin);
    let _ = child.wait().await;
    let (mm, md) = stats(over_mcp);
    let (em, ed) = stats(exec);
    let (im, id_) = stats(in_process);
    println!("\n## MCP: `execute_code` of `print(1)`, local executor, {n} runs each, interleaved");
    println!("| path | mean | median | mean vs `tandem exec` |");
    println!("|---|---|---|---|");
    for (label, mean, median) in [
        ("`tandem exec` (a process per block)", em, ed),
        (
            "`execute_code` over `tandem mcp` stdio, warm session",
            mm,
            md,
        ),
        ("the same block in-process, warm session (floor)", im, id_),
    ] {
        println!(
            "| {label} | {} | {} | {:.2}x |",
            ms(mean),
            ms(median),
            mean.as_secs_f64() / em.as_secs_f64()
        );
    }
}

/// The two ways the local executor starts a python block.
const MODES: [(bool, &str); 2] = [
    (false, "fresh `python3` per block"),
    (true, "fork of the warm interpreter (default)"),
];

async fn executor_overhead(n: usize) {
    let python = local_executor(false)
        .interpreters()
        .python
        .clone()
        .expect("python3 on PATH");
    let mut sessions = Vec::new();
    for (fork, _) in MODES {
        sessions.push(
            local_executor(fork)
                .open(SessionSpec::default())
                .await
                .unwrap(),
        );
    }
    let mut base = Vec::new();
    let mut ours = vec![Vec::new(); MODES.len()];
    // sh blocks: a bare `sh` spawn against the default session.
    let (mut sh_base, mut sh_ours) = (Vec::new(), Vec::new());
    // Interleaved so that machine noise hits every path alike; one warm-up each.
    for i in 0..=n {
        let t = Instant::now();
        let out = tokio::process::Command::new("sh")
            .args(["-c", "echo 1"])
            .output()
            .await
            .unwrap();
        assert_eq!(out.stdout, b"1\n");
        if i > 0 {
            sh_base.push(t.elapsed());
        }
        let t = Instant::now();
        let ctx = ExecContext::new(CancellationToken::new());
        let out = sessions[MODES.len() - 1]
            .run(ExecRequest::new(Language::sh(), "echo 1"), ctx)
            .await
            .unwrap();
        assert_eq!(out.stdout.to_text(), "1\n");
        if i > 0 {
            sh_ours.push(t.elapsed());
        }
        let t = Instant::now();
        let out = tokio::process::Command::new(&python)
            .args(["-c", "print(1)"])
            .output()
            .await
            .unwrap();
        assert_eq!(out.stdout, b"1\n");
        if i > 0 {
            base.push(t.elapsed());
        }
        for (session, samples) in sessions.iter_mut().zip(&mut ours) {
            let t = Instant::now();
            let ctx = ExecContext::new(CancellationToken::new());
            let out = session
                .run(ExecRequest::new(Language::python(), "print(1)"), ctx)
                .await
                .unwrap();
            assert_eq!(out.stdout.to_text(), "1\n");
            if i > 0 {
                samples.push(t.elapsed());
            }
        }
    }
    for session in sessions {
        session.close().await.unwrap();
    }
    let (bm, bp) = stats(base);
    println!(
        "\n## Local executor: print(1), {n} runs each (interpreter {})",
        python.display()
    );
    println!("| path | mean | median | ratio (mean) |");
    println!("|---|---|---|---|");
    println!(
        "| bare `python3 -c 'print(1)'` spawn | {} | {} | 1.00x |",
        ms(bm),
        ms(bp)
    );
    for ((_, label), samples) in MODES.iter().zip(ours) {
        let (om, op) = stats(samples);
        println!(
            "| tandem local session.run, {label} | {} | {} | {:.2}x |",
            ms(om),
            ms(op),
            om.as_secs_f64() / bm.as_secs_f64()
        );
    }
    let ((sbm, sbp), (som, sop)) = (stats(sh_base), stats(sh_ours));
    println!(
        "| bare `sh -c 'echo 1'` spawn | {} | {} | 1.00x (sh) |",
        ms(sbm),
        ms(sbp)
    );
    println!(
        "| tandem local session.run, sh `echo 1` (default session) | {} | {} | {:.2}x (sh) |",
        ms(som),
        ms(sop),
        som.as_secs_f64() / sbm.as_secs_f64()
    );
}

/// A scripted model for [`tasks_at`]'s `tasks`: each replies with a python `print(1)` block,
/// then ends; the server lives as long as the first value.
async fn print_one_model(tasks: usize) -> (ScriptedOpenAi, ChatModel) {
    let code = "```python\nprint(1)\n```";
    let script: Script = (0..tasks)
        .map(|i| {
            (
                format!("bench task {i}"),
                vec![Reply::from(code), Reply::from("Done.\nTERMINATE")],
            )
        })
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let model = ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        ..ModelConfig::default()
    })
    .unwrap();
    (server, model)
}

async fn turn_loop_throughput(tasks: usize, concurrency: usize) {
    let (_server, model) = print_one_model(tasks).await;
    let python = local_executor(false)
        .interpreters()
        .python
        .clone()
        .expect("python3");

    // The floor: the same 200 interpreter runs at the same concurrency, with no model, no
    // HTTP and no sandbox around them.
    let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let (limit, python) = (limit.clone(), python.clone());
        set.spawn(async move {
            let _permit = limit.acquire_owned().await.unwrap();
            let out = tokio::process::Command::new(&python)
                .args(["-c", "print(1)"])
                .output()
                .await
                .unwrap();
            assert_eq!(out.stdout, b"1\n");
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    let floor = started.elapsed();

    let mut runs = Vec::new();
    for (fork, label) in MODES {
        let executor: Arc<dyn Executor> = Arc::new(local_executor(fork));
        runs.push((label, tasks_at(&model, executor, tasks, concurrency).await));
    }
    let rate = |d: Duration| tasks as f64 / d.as_secs_f64();
    println!(
        "\n## Turn loop: {tasks} two-turn tasks (python print(1)), concurrency {concurrency}, {}",
        python.display()
    );
    println!("| run | wall | tasks/s | share of floor |");
    println!("|---|---|---|---|");
    println!(
        "| floor: {tasks} bare interpreter spawns, same concurrency | {:.2} s | {:.1} | 100% |",
        floor.as_secs_f64(),
        rate(floor)
    );
    for (label, took) in runs {
        println!(
            "| tandem, {label}: 2 model calls over HTTP + 1 sandboxed block per task | {:.2} s | {:.1} | {:.0}% |",
            took.as_secs_f64(),
            rate(took),
            100.0 * rate(took) / rate(floor)
        );
    }
    println!("| reference: AutoGen 0.7.5 on this machine (from the issue) | | 55 | |");
}

/// What the session budget (every session taking and giving back a permit) costs the turn
/// loop: the same tasks through the same executor, wrapped and not, in alternated rounds.
async fn budget_overhead(tasks: usize, concurrency: usize) {
    const ROUNDS: usize = 9;
    let (_server, model) = print_one_model(tasks).await;
    let plain: Arc<dyn Executor> = Arc::new(local_executor(true));
    // As the daemon sets it up: four sessions per task slot, an executor cap of its own.
    let mut config =
        tandem_executor_kit::BudgetConfig::new(concurrency * 4, Duration::from_secs(120));
    config
        .per_executor
        .insert("local".to_owned(), concurrency * 4);
    let mut registry = tandem_executor_kit::RegistryBudget::with_budget(
        tandem_executor::Registry::new(),
        tandem_executor_kit::Budget::new(&config),
    );
    registry.register(plain.clone());
    let budgeted = registry.get("local").unwrap();
    let (mut without, mut with, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        // Which goes first alternates, so that neither always meets a warmer machine.
        let (a, b) = if round % 2 == 0 {
            let a = tasks_at(&model, plain.clone(), tasks, concurrency).await;
            (
                a,
                tasks_at(&model, budgeted.clone(), tasks, concurrency).await,
            )
        } else {
            let b = tasks_at(&model, budgeted.clone(), tasks, concurrency).await;
            (tasks_at(&model, plain.clone(), tasks, concurrency).await, b)
        };
        ratios.push(b.as_secs_f64() / a.as_secs_f64());
        without.push(a);
        with.push(b);
    }
    ratios.sort_by(f64::total_cmp);
    let rate = |d: Duration| tasks as f64 / d.as_secs_f64();
    let (a, b) = (stats(without).1, stats(with).1);
    println!(
        "\n## Session budget: {tasks} two-turn tasks (python print(1)), concurrency {concurrency}, {ROUNDS} alternated rounds (medians)"
    );
    println!("| run | wall | tasks/s | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| local executor, unwrapped | {:.2} s | {:.1} | 1.00x |",
        a.as_secs_f64(),
        rate(a)
    );
    println!(
        "| the same under the budget ([sessions] max and a cap of its own) | {:.2} s | {:.1} | {:.3}x (median of per-round ratios; range {:.3}x to {:.3}x) |",
        b.as_secs_f64(),
        rate(b),
        ratios[ROUNDS / 2],
        ratios[0],
        ratios[ROUNDS - 1]
    );
}

/// Runs `tasks` two-turn tasks at `concurrency` and returns the wall time.
async fn tasks_at(
    model: &ChatModel,
    executor: Arc<dyn Executor>,
    tasks: usize,
    concurrency: usize,
) -> Duration {
    let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..tasks {
        let (model, executor, limit) = (model.clone(), executor.clone(), limit.clone());
        set.spawn(async move {
            let _permit = limit.acquire_owned().await.unwrap();
            let outcome = run_task(
                TaskSettings::new(format!("bench task {i}")),
                &model,
                executor,
                Arc::new(|_| {}),
                CancellationToken::new(),
            )
            .await;
            assert_eq!(
                outcome.stop_reason,
                StopReason::Terminated,
                "{:?}",
                outcome.error
            );
            assert_eq!(outcome.turns, 2);
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    started.elapsed()
}

/// A team's orchestration cost per turn, beside the two-agent loop's: both make 12 model
/// calls per task to the same scripted server (plain text, no code), in-process; the
/// difference per turn is what the team machinery adds (views, names, selection, checks).
async fn team_overhead(tasks: usize, concurrency: usize) {
    use tandem_agent::team::{Team, check};
    use tandem_protocol::team::{AgentSpec, Kind, TeamSpec, Termination};

    const TURNS: u32 = 12;
    let mut script = Script::new();
    for i in 0..tasks {
        // The two-agent loop: 12 replies without code (each answered with a nudge).
        script.insert(
            format!("pair {i}"),
            (0..TURNS)
                .map(|t| Reply::from(format!("thinking {t}").as_str()))
                .collect(),
        );
        for agent in ["a", "b", "c"] {
            script.insert(
                format!("team {i}#{agent}"),
                (0..TURNS)
                    .map(|t| Reply::from(format!("{agent} says {t}").as_str()))
                    .collect(),
            );
        }
    }
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let model = ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        ..ModelConfig::default()
    })
    .unwrap();
    let executor: Arc<dyn Executor> = Arc::new(local_executor(true));
    let member = |name: &str| AgentSpec {
        instructions: Some(name.to_owned()),
        ..AgentSpec::default()
    };
    let spec = TeamSpec {
        team: AgentSpec {
            kind: Kind::Chat,
            agents: Some(vec!["a".into(), "b".into(), "c".into()]),
            termination: Some(Termination {
                max_turns: Some(TURNS),
                ..Termination::default()
            }),
            ..AgentSpec::default()
        },
        agents: ["a", "b", "c"]
            .map(|n| (n.to_owned(), member(n)))
            .into_iter()
            .collect(),
    };
    let root = check(&spec).unwrap();

    let mut pair_rounds = Vec::new();
    let mut team_rounds = Vec::new();
    // Alternated rounds, so that machine noise falls on both alike.
    for _ in 0..5 {
        let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
        let started = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..tasks {
            let (model, executor, limit) = (model.clone(), executor.clone(), limit.clone());
            set.spawn(async move {
                let _permit = limit.acquire_owned().await.unwrap();
                let mut settings = TaskSettings::new(format!("pair {i}"));
                settings.max_turns = TURNS;
                let outcome = run_task(
                    settings,
                    &model,
                    executor,
                    Arc::new(|_| {}),
                    CancellationToken::new(),
                )
                .await;
                assert_eq!(outcome.stop_reason, StopReason::MaxTurns);
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        pair_rounds.push(started.elapsed());

        let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
        let started = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..tasks {
            let (model, executor, limit, root) =
                (model.clone(), executor.clone(), limit.clone(), root.clone());
            set.spawn(async move {
                let _permit = limit.acquire_owned().await.unwrap();
                let team = Team::new(
                    root,
                    model.clone(),
                    |_| Ok(model.clone()),
                    |_| {
                        Ok(tandem_agent::SessionSlot::new(
                            executor.clone(),
                            SessionSpec::default(),
                        ))
                    },
                    100,
                    &tandem_executor::Limits::default(),
                )
                .unwrap();
                let tandem_agent::team::Run {
                    ended,
                    history,
                    turns,
                    ..
                } = team
                    .run(
                        &format!("team {i}"),
                        Arc::new(|_| {}),
                        CancellationToken::new(),
                        Vec::new(),
                    )
                    .await;
                assert!(ended.is_ok(), "{ended:?}");
                assert_eq!((turns, history.len()), (TURNS, TURNS as usize + 1));
                team.close().await;
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        team_rounds.push(started.elapsed());
    }
    let per_turn = |d: Duration| d / (tasks as u32 * TURNS);
    let (pair, team) = (stats(pair_rounds).1, stats(team_rounds).1);
    println!(
        "\n## Teams: {tasks} tasks of {TURNS} turns each, concurrency {concurrency}, scripted model, in-process (median of 5 alternated rounds)"
    );
    println!("| run | wall | tasks/s | per turn |");
    println!("|---|---|---|---|");
    for (label, took) in [
        ("two-agent loop (12 model calls, no code)", pair),
        ("3-agent round-robin chat (12 model calls)", team),
    ] {
        println!(
            "| {label} | {:.2} s | {:.1} | {} |",
            took.as_secs_f64(),
            tasks as f64 / took.as_secs_f64(),
            ms(per_turn(took))
        );
    }
    let overhead = per_turn(team).as_secs_f64() - per_turn(pair).as_secs_f64();
    println!(
        "\nteam machinery per turn: {:+.3} ms (team minus two-agent loop)",
        overhead * 1000.0
    );
}

fn tandem_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("tandem");
    bin.exists().then_some(bin)
}

async fn cold_start(runs: usize) {
    let Some(bin) = tandem_binary() else {
        println!(
            "\n## Cold start: not measured: build the binary first with `cargo build --release -p tandem-cli`"
        );
        return;
    };
    let script: Script = (0..runs)
        .map(|i| (format!("cold {i}"), vec![Reply::from("TERMINATE")]))
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let mut samples = Vec::new();
    let mut base = Vec::new();
    for i in 0..runs {
        // Baseline: spawning a process that does nothing (`true`).
        let t = Instant::now();
        tokio::process::Command::new("true").status().await.unwrap();
        base.push(t.elapsed());
        let task = format!("cold {i}");
        let start = Instant::now();
        let status = tokio::process::Command::new(&bin)
            .args(["run", "--base-url", &server.base_url(), &task])
            .env("XDG_CONFIG_HOME", "/nonexistent")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .await
            .unwrap();
        assert!(status.success());
        let first = server.requests_for(&task).first().map(|r| r.at).unwrap();
        samples.push(first.duration_since(start));
    }
    let (m, p) = stats(samples);
    let (bm, bp) = stats(base);
    println!(
        "\n## Cold start: `tandem run` spawn to first model request, {runs} runs ({})",
        bin.display()
    );
    println!("| path | mean | median | ratio (mean) |");
    println!("|---|---|---|---|");
    println!(
        "| spawn of `true` (process floor) | {} | {} | 1.00x |",
        ms(bm),
        ms(bp)
    );
    println!(
        "| tandem run → first request | {} | {} | {:.1}x |",
        ms(m),
        ms(p),
        m.as_secs_f64() / bm.as_secs_f64()
    );
}

async fn docker_block_latency(n: usize) {
    use bollard::exec::{CreateExecOptions, StartExecResults};
    use futures::StreamExt;
    use tandem_executor_docker::{DockerConfig, DockerExecutor};

    let image =
        std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned());
    let executor = match DockerExecutor::connect(DockerConfig {
        image: image.clone(),
        pull: false,
        ..DockerConfig::default()
    })
    .await
    {
        Ok(e) if e.image_present().await.unwrap_or(false) => e,
        Ok(_) => {
            println!(
                "\n## Docker executor: not measured: image `{image}` is missing (scripts/build-sandbox-image.sh)"
            );
            return;
        }
        Err(e) => {
            println!("\n## Docker executor: not measured: {e}");
            return;
        }
    };
    let task = format!("bench-{}", std::process::id());
    let mut session = executor
        .open(SessionSpec {
            labels: vec![("tandem.task".to_owned(), task.clone())],
            ..SessionSpec::default()
        })
        .await
        .unwrap();
    let ps = std::process::Command::new("docker")
        .args(["ps", "-q", "--filter", &format!("label=tandem.task={task}")])
        .output()
        .unwrap();
    let id = String::from_utf8_lossy(&ps.stdout).trim().to_owned();
    let docker = bollard::Docker::connect_with_defaults()
        .unwrap()
        .negotiate_version()
        .await
        .unwrap();
    let (mut cli, mut api, mut ours) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..=n {
        let t = Instant::now();
        let out = tokio::process::Command::new("docker")
            .args(["exec", &id, "python3", "-c", "print(1)"])
            .output()
            .await
            .unwrap();
        assert_eq!(out.stdout, b"1\n");
        let cli_took = t.elapsed();

        let t = Instant::now();
        let exec = docker
            .create_exec(
                &id,
                CreateExecOptions {
                    cmd: Some(vec!["python3", "-c", "print(1)"]),
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let mut text = Vec::new();
        if let StartExecResults::Attached { mut output, .. } =
            docker.start_exec(&exec.id, None).await.unwrap()
        {
            while let Some(Ok(chunk)) = output.next().await {
                text.extend_from_slice(&chunk.into_bytes());
            }
        }
        let code = docker.inspect_exec(&exec.id).await.unwrap().exit_code;
        assert_eq!((text.as_slice(), code), (&b"1\n"[..], Some(0)));
        let api_took = t.elapsed();

        let t = Instant::now();
        let out = session
            .run(
                ExecRequest::new(Language::python(), "print(1)"),
                ExecContext::new(CancellationToken::new()),
            )
            .await
            .unwrap();
        assert_eq!(out.stdout.to_text(), "1\n");
        if i > 0 {
            cli.push(cli_took);
            api.push(api_took);
            ours.push(t.elapsed());
        }
    }
    session.close().await.unwrap();
    let (cm, cp) = stats(cli);
    println!("\n## Docker executor: print(1) per block, {n} runs each, one container ({image})");
    println!("| path | mean | median | ratio (mean) |");
    println!("|---|---|---|---|");
    println!("| `docker exec` (CLI) | {} | {} | 1.00x |", ms(cm), ms(cp));
    for (label, samples) in [
        ("bollard exec API (create, start attached, inspect)", api),
        ("tandem: runner in the container, session.run", ours),
    ] {
        let (m, p) = stats(samples);
        println!(
            "| {label} | {} | {} | {:.2}x |",
            ms(m),
            ms(p),
            m.as_secs_f64() / cm.as_secs_f64()
        );
    }
}

async fn docker_session_open(n: usize) {
    use tandem_executor_docker::{DockerConfig, DockerExecutor};

    let image =
        std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned());
    let mut rows = Vec::new();
    for (pool_size, label) in [
        (0, "cold: create + start + runner ready"),
        (2, "warm pool (2): claim a started container"),
    ] {
        let Ok(executor) = DockerExecutor::connect(DockerConfig {
            image: image.clone(),
            pull: false,
            pool_size,
            ..DockerConfig::default()
        })
        .await
        else {
            println!("\n## Docker session open: not measured: no engine");
            return;
        };
        let mut samples = Vec::new();
        for _ in 0..n {
            executor.warm_up();
            while executor.pooled().len() < pool_size {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let t = Instant::now();
            let mut s = executor.open(SessionSpec::default()).await.unwrap();
            let out = s
                .run(
                    ExecRequest::new(Language::sh(), "echo 1"),
                    ExecContext::new(CancellationToken::new()),
                )
                .await
                .unwrap();
            samples.push(t.elapsed());
            assert_eq!(out.stdout.to_text(), "1\n");
            s.close().await.unwrap();
        }
        executor.shutdown().await;
        rows.push((label, stats(samples)));
    }
    println!("\n## Docker session: open + first `echo 1`, {n} runs each ({image})");
    println!("| path | mean | median | ratio (mean) |");
    println!("|---|---|---|---|");
    let base = (rows[0].1).0;
    for (label, (m, p)) in rows {
        println!(
            "| {label} | {} | {} | {:.2}x |",
            ms(m),
            ms(p),
            m.as_secs_f64() / base.as_secs_f64()
        );
    }
}

/// Rounds of each kind in the daemon throughput comparison, alternated.
const ROUNDS: u64 = 21;
/// Requests in flight at once while the daemon bench submits.
const SUBMITTERS: usize = 16;

/// The whole machine's CPU time (all processes: the bench, the daemon, the sandboxes), from
/// `/proc/stat`, in clock ticks.
#[derive(Clone, Copy, Debug, Default)]
struct CpuTime {
    busy: u64,
    total: u64,
}

impl CpuTime {
    fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        let total: u64 = ticks.iter().take(8).sum();
        // idle and iowait
        let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
        Self {
            busy: total - idle,
            total,
        }
    }

    fn busy_since(self) -> Self {
        let now = Self::now();
        Self {
            busy: now.busy - self.busy,
            total: now.total - self.total,
        }
    }

    fn busy_ms(self) -> f64 {
        // USER_HZ is 100 on Linux.
        self.busy as f64 * 10.0
    }
}

/// CPU time of the daemon's store writer thread.
fn writer_ticks(pid: u32) -> u64 {
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.starts_with("tandem-store") {
            return ticks_at(&t.path().join("stat"));
        }
    }
    0
}

/// CPU time (user + system, clock ticks) of a whole process, all its threads.
fn process_ticks(pid: u32) -> u64 {
    ticks_at(std::path::Path::new(&format!("/proc/{pid}/stat")))
}

fn ticks_at(path: &std::path::Path) -> u64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    fields[11] + fields[12]
}

/// The middle value (the upper one of an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

async fn submit(d: &DaemonHarness, task: String) -> String {
    d.submit(serde_json::json!({ "task": task })).await
}

async fn daemon(tasks: usize, concurrency: usize) {
    let Some(bin) = tandem_binary() else {
        println!(
            "\n## Daemon: not measured: build the binary first with `cargo build --release -p tandem-cli`"
        );
        return;
    };
    let code = "```python\nprint(1)\n```";
    let mut script: Script = (0..tasks)
        .map(|i| {
            (
                format!("bench task {i}"),
                vec![Reply::from(code), Reply::from("Done.\nTERMINATE")],
            )
        })
        .collect();
    script.insert(
        "hold the slot".to_owned(),
        vec![Reply::from("```python\nimport time\ntime.sleep(600)\n```")],
    );
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let model = ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        ..ModelConfig::default()
    })
    .unwrap();

    // In-process and over HTTP, the same tasks and concurrency, alternated ROUNDS times (a
    // round lasts a second or two, too short to trust alone).
    let executor: Arc<dyn Executor> = Arc::new(local_executor(true));
    // The same interpreter as the in-process figure.
    let config =
        bench_python().map(|p| format!("[executors.local]\npython = \"{}\"\n", p.display()));
    let start = |max_concurrent: usize| {
        let (bin, base_url, config) = (bin.clone(), server.base_url(), config.clone());
        async move {
            let n = max_concurrent.to_string();
            DaemonHarness::start(
                &bin,
                &base_url,
                &["--max-concurrent", &n],
                config.as_deref(),
            )
            .await
        }
    };
    let d = start(concurrency).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = d.rss_mib();
    let mut in_process_runs = Vec::new();
    let mut daemon_runs = Vec::new();
    let (mut daemon_ticks, mut writer_ticks_total) = (0u64, 0u64);
    // This process: the scripted model server in both modes, plus the turn loops in-process
    // or the HTTP client with the daemon.
    let me = std::process::id();
    let (mut bench_in_process, mut bench_daemon) = (0u64, 0u64);
    for round in 0..ROUNDS {
        let cpu = CpuTime::now();
        let bench_before = process_ticks(me);
        let took = tasks_at(&model, executor.clone(), tasks, concurrency).await;
        in_process_runs.push((took, cpu.busy_since()));
        bench_in_process += process_ticks(me) - bench_before;
        let cpu = CpuTime::now();
        let bench_before = process_ticks(me);
        let (daemon_before, writer_before) = (process_ticks(d.pid()), writer_ticks(d.pid()));
        let started = Instant::now();
        // A client pool's worth of connections, kept alive, as a busy client would hold.
        futures::stream::iter((0..tasks).map(|i| submit(&d, format!("bench task {i}"))))
            .buffer_unordered(SUBMITTERS)
            .collect::<Vec<_>>()
            .await;
        let want = (round + 1) * tasks as u64;
        while d.count("finished").await < want {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        daemon_runs.push((started.elapsed(), cpu.busy_since()));
        daemon_ticks += process_ticks(d.pid()) - daemon_before;
        bench_daemon += process_ticks(me) - bench_before;
        writer_ticks_total += writer_ticks(d.pid()) - writer_before;
    }
    // Each round's pair ran back to back, so its ratio sees the same machine; the median
    // of the ratios is steadier than a ratio of medians when the machine drifts.
    let mut ratios: Vec<f64> = in_process_runs
        .iter()
        .zip(&daemon_runs)
        .map(|((i, _), (d, _))| i.as_secs_f64() / d.as_secs_f64())
        .collect();
    ratios.sort_by(f64::total_cmp);
    let cpu_per_task = |runs: &[(Duration, CpuTime)]| {
        let busy = runs.iter().map(|(_, c)| c.busy_ms() / tasks as f64);
        let idle = runs
            .iter()
            .map(|(_, c)| 1.0 - c.busy as f64 / c.total.max(1) as f64);
        (median(busy.collect()), median(idle.collect()))
    };
    let (in_cpu, in_idle) = cpu_per_task(&in_process_runs);
    let (d_cpu, d_idle) = cpu_per_task(&daemon_runs);
    let in_process = stats(in_process_runs.iter().map(|r| r.0).collect()).1;
    let over_http = stats(daemon_runs.iter().map(|r| r.0).collect()).1;

    // Submit-to-first-event: POST, then the first SSE event, one task at a time.
    let mut latencies = Vec::new();
    for i in 0..200 {
        let t = Instant::now();
        let id = submit(&d, format!("bench task {}", i % tasks)).await;
        let mut resp = d
            .http()
            .get(format!("http://tandem/v1/tasks/{id}/events"))
            .send()
            .await
            .unwrap();
        let mut seen = String::new();
        while !seen.contains("\n\n") {
            let chunk = resp.chunk().await.unwrap().unwrap();
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
        latencies.push(t.elapsed());
        drop(resp);
    }
    latencies.sort();
    let p50 = latencies[latencies.len() / 2];
    let p99 = latencies[latencies.len() * 99 / 100 - 1];

    // Memory: one task holds the only slot, 1000 wait behind it.
    drop(d);
    let d = start(1).await;
    submit(&d, "hold the slot".to_owned()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = d.rss_mib();
    let submit_ticks = process_ticks(d.pid());
    for i in 0..1000 {
        submit(&d, format!("bench task {}", i % tasks)).await;
    }
    let submit_ms = (process_ticks(d.pid()) - submit_ticks) as f64 * 10.0 / 1000.0;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let queued = d.rss_mib();

    let rate = |took: Duration| tasks as f64 / took.as_secs_f64();
    println!(
        "\n## Daemon: {tasks} two-turn tasks (python print(1)), concurrency {concurrency}, local executor"
    );
    println!("| run | wall | tasks/s | vs in-process | CPU per task | idle CPU |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| in-process `run_task` (same run, median of {ROUNDS}) | {:.2} s | {:.1} | 100% | {in_cpu:.2} ms | {:.0}% |",
        in_process.as_secs_f64(),
        rate(in_process),
        in_idle * 100.0
    );
    println!(
        "| daemon: submitted over HTTP (Unix socket) until all finished (median of {ROUNDS}) | {:.2} s | {:.1} | {:.1}% | {d_cpu:.2} ms | {:.0}% |",
        over_http.as_secs_f64(),
        rate(over_http),
        100.0 * median(ratios.clone()),
        d_idle * 100.0
    );
    let per_task = |ticks: u64| ticks as f64 * 10.0 / (ROUNDS as f64 * tasks as f64);
    println!(
        "\nThe daemon process's own CPU per task: {:.2} ms, of which the store writer thread {:.2} ms.",
        per_task(daemon_ticks),
        per_task(writer_ticks_total)
    );
    println!(
        "The bench process's own CPU per task (the scripted model server, plus the turn loops in-process, or the HTTP client with the daemon): {:.2} ms in-process, {:.2} ms with the daemon.",
        per_task(bench_in_process),
        per_task(bench_daemon)
    );
    println!(
        "The daemon's CPU to take one submitted task (1000 queued one after another): {submit_ms:.2} ms."
    );
    println!(
        "Daemon vs in-process, round by round (sorted): {}",
        ratios
            .iter()
            .map(|r| format!("{:.0}%", r * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("\n| latency, submit → first SSE event (200, one at a time) | p50 | p99 |");
    println!("|---|---|---|");
    println!("| daemon | {} | {} |", ms(p50), ms(p99));
    println!("\n| daemon memory | RSS |");
    println!("|---|---|");
    println!("| idle, after start | {idle:.1} MiB |");
    println!("| 1 task running | {before:.1} MiB |");
    println!(
        "| + 1000 queued tasks | {queued:.1} MiB ({:.1} KiB per queued task) |",
        (queued - before) * 1024.0 / 1000.0
    );
}

/// Per-block time of Python blocks in a kept interpreter vs a fresh process each: a trivial
/// block, and one that needs a 200 MB value (the fresh process reads it from the workspace
/// every time; the kept one read it once, in a first block not counted).
async fn run_block(s: &mut Box<dyn tandem_executor::Session>, code: &str) -> (Duration, String) {
    let req = ExecRequest::new(Language::python(), code);
    let t = Instant::now();
    let out = s
        .run(req, ExecContext::new(CancellationToken::new()))
        .await
        .unwrap();
    assert_eq!(
        out.status,
        tandem_executor::ExitStatus::Exited(0),
        "{out:?}"
    );
    (t.elapsed(), out.stdout.to_text())
}

async fn kept_state(n: usize) {
    let executor: Arc<dyn Executor> = Arc::new(local_executor(true));
    let spec = SessionSpec::default();
    let mut fresh = executor.open(spec.clone()).await.unwrap();
    let mut kept: Box<dyn tandem_executor::Session> =
        Box::new(tandem_executor_kit::kept::KeptSession::new(
            executor.open(spec.clone()).await.unwrap(),
            executor.clone(),
            spec,
        ));
    for s in [&fresh, &kept] {
        let ws = s.workspace().unwrap().to_owned();
        let mut big = vec![0u8; 200 << 20];
        big[(200 << 20) - 1] = 7;
        std::fs::write(ws.join("big.bin"), big).unwrap();
    }
    // The kept one loads the value once, and both start warm.
    run_block(&mut kept, "data = open('big.bin', 'rb').read()").await;
    run_block(&mut fresh, "print(1)").await;
    let (mut print_fresh, mut print_kept, mut big_fresh, mut big_kept) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        print_fresh.push(run_block(&mut fresh, "print(1)").await.0);
        print_kept.push(run_block(&mut kept, "print(1)").await.0);
        let (t, out) = run_block(
            &mut fresh,
            "data = open('big.bin', 'rb').read()\nprint(data[-1])",
        )
        .await;
        assert_eq!(out, "7\n");
        big_fresh.push(t);
        let (t, out) = run_block(&mut kept, "print(data[-1])").await;
        assert_eq!(out, "7\n");
        big_kept.push(t);
    }
    let _ = fresh.close().await;
    let _ = kept.close().await;
    println!("\n## Kept state (local executor, {n} blocks each, alternated)");
    println!(
        "| block | fresh process: mean | median | kept interpreter: mean | median | ratio kept/fresh (median) |"
    );
    println!("|---|---|---|---|---|---|");
    for (what, f, k) in [
        ("`print(1)`", print_fresh, print_kept),
        ("needs a 200 MB value", big_fresh, big_kept),
    ] {
        let ((fm, fp), (km, kp)) = (stats(f), stats(k));
        println!(
            "| {what} | {} | {} | {} | {} | {:.3}x |",
            ms(fm),
            ms(fp),
            ms(km),
            ms(kp),
            kp.as_secs_f64() / fp.as_secs_f64()
        );
    }
}

/// 100 MB into the daemon (`POST /v1/uploads`, stored and synced) and back out of a task's
/// workspace (`GET .../files/{path}`, into a file), against `cat` copying the same bytes from
/// file to file (synced, for the way in).
async fn files_round_trip(rounds: usize) {
    let Some(bin) = tandem_binary() else {
        println!(
            "\n## Files: not measured: build the binary first with `cargo build --release -p tandem-cli`"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..100u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    let archive = dir.path().join("big.tar");
    {
        let mut builder = tar::Builder::new(std::fs::File::create(&archive).unwrap());
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, "big.bin", &data[..])
            .unwrap();
        builder.finish().unwrap();
    }
    // The task as the model reads it: its text, then what it was given.
    let listing = tandem_executor_kit::archive::inspect(
        std::fs::File::open(&archive).unwrap(),
        Default::default(),
    )
    .unwrap()
    .1;
    let script: Script = (0..rounds)
        .map(|i| {
            (
                format!("files {i}\n\n{listing}"),
                vec![Reply::from("```sh\ntrue\n```"), Reply::from("TERMINATE")],
            )
        })
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let d = DaemonHarness::start(&bin, &server.base_url(), &[], None).await;
    let (mut up, mut down, mut cat_in, mut cat_out) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        let copy = dir.path().join("copy.tar");
        let t = Instant::now();
        let status = tokio::process::Command::new("sh")
            .arg("-c")
            .arg("cat \"$0\" > \"$1\" && sync \"$1\"")
            .arg(&archive)
            .arg(&copy)
            .status()
            .await
            .unwrap();
        assert!(status.success());
        cat_in.push(t.elapsed());
        let t = Instant::now();
        let file = tokio::fs::File::open(&archive).await.unwrap();
        let resp = d
            .http()
            .post("http://tandem/v1/uploads")
            .header("content-type", "application/x-tar")
            .body(reqwest::Body::wrap_stream(
                tokio_util::io::ReaderStream::with_capacity(file, 1 << 20),
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
        let upload: serde_json::Value = resp.json().await.unwrap();
        up.push(t.elapsed());
        let id = d
            .submit(serde_json::json!({"task": format!("files {i}"), "files": upload["id"]}))
            .await;
        d.wait_finished(&id, Duration::from_secs(120)).await;
        let out = dir.path().join("out.bin");
        let t = Instant::now();
        let status = tokio::process::Command::new("sh")
            .arg("-c")
            .arg("cat \"$0\" > \"$1\"")
            .arg(&copy)
            .arg(&out)
            .status()
            .await
            .unwrap();
        assert!(status.success());
        cat_out.push(t.elapsed());
        let _ = std::fs::remove_file(&out);
        let t = Instant::now();
        let mut resp = d
            .http()
            .get(format!("http://tandem/v1/tasks/{id}/files/big.bin"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status(),
            200,
            "{}",
            resp.text().await.unwrap_or_default()
        );
        let mut file = std::fs::File::create(&out).unwrap();
        let mut got = 0usize;
        while let Some(chunk) = resp.chunk().await.unwrap() {
            std::io::Write::write_all(&mut file, &chunk).unwrap();
            got += chunk.len();
        }
        drop(file);
        assert_eq!(got, data.len());
        down.push(t.elapsed());
        let _ = std::fs::remove_file(&out);
        let _ = std::fs::remove_file(&copy);
    }
    println!(
        "\n## Files: 100 MB through the daemon vs `cat`, {rounds} rounds ({})",
        bin.display()
    );
    println!("| direction | cat: median | daemon: median | ratio (median) |");
    println!("|---|---|---|---|");
    for (what, base, ours) in [
        (
            "in: `cat > file && sync` vs POST /v1/uploads (stored, synced, checked)",
            cat_in,
            up,
        ),
        (
            "out: `cat file > copy` vs GET /v1/tasks/ID/files/big.bin into a file",
            cat_out,
            down,
        ),
    ] {
        let ((_, bp), (_, op)) = (stats(base), stats(ours));
        println!(
            "| {what} | {} | {} | {:.2}x |",
            ms(bp),
            ms(op),
            op.as_secs_f64() / bp.as_secs_f64()
        );
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // `TANDEM_BENCH_ONLY=daemon` (or local, confine, turn_loop, cold_start, docker, team, plugin, mcp, budget) runs
    // one section.
    let only = std::env::var("TANDEM_BENCH_ONLY").ok();
    let run = |name: &str| only.as_deref().is_none_or(|o| o == name);
    rt.block_on(async {
        if run("local") {
            executor_overhead(100).await;
        }
        if run("confine") {
            confinement_overhead(200).await;
        }
        if run("turn_loop") {
            turn_loop_throughput(200, 8).await;
        }
        if run("cold_start") {
            cold_start(20).await;
        }
        if run("docker") {
            docker_block_latency(30).await;
            docker_session_open(10).await;
        }
        if run("team") {
            team_overhead(100, 8).await;
        }
        if run("daemon") {
            daemon(400, 8).await;
        }
        if run("plugin") {
            plugin_overhead(300).await;
        }
        if run("mcp") {
            mcp_overhead(100).await;
        }
        if run("budget") {
            budget_overhead(1000, 8).await;
        }
        if run("kept") {
            kept_state(30).await;
        }
        if run("files") {
            files_round_trip(5).await;
        }
        if run("tools") {
            tools_overhead(100, 2000).await;
        }
        if run("hosts") {
            docker_hosts(100, 24, 4).await;
        }
        if run("kubernetes") {
            kubernetes(10, 100).await;
        }
        if run("stores") {
            stores(600, 4).await;
        }
        if run("traces") {
            traces_overhead(400, 8).await;
        }
    });
}

/// Tools: per-task time of a `print(1)` sent as an `execute_code` call against the same code
/// fenced (one task at a time, alternated, so both meet the same machine); and what a tool
/// call from inside a local block costs beyond the tool's own work (an HTTP endpoint on
/// loopback that answers at once), against the same request made straight from here.
async fn tools_overhead(tasks: usize, calls: usize) {
    use tandem_agent::tools::{Catalog, resolve};
    use tandem_protocol::{CodeVia, ToolDef};
    let fenced = "```python\nprint(1)\n```";
    let call = (
        "c1".to_owned(),
        "execute_code".to_owned(),
        r#"{"language": "python", "code": "print(1)"}"#.to_owned(),
    );
    let script: Script = (0..tasks)
        .flat_map(|i| {
            [
                (
                    format!("fenced {i}"),
                    vec![Reply::from(fenced), Reply::from("Done.\nTERMINATE")],
                ),
                (
                    format!("tool {i}"),
                    vec![
                        Reply::Calls(String::new(), vec![call.clone()]),
                        Reply::from("Done.\nTERMINATE"),
                    ],
                ),
            ]
        })
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let model = ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        ..ModelConfig::default()
    })
    .unwrap();
    let executor: Arc<dyn Executor> = Arc::new(local_executor(true));
    let one = |task: String, via: CodeVia| {
        let (model, executor) = (model.clone(), executor.clone());
        async move {
            let mut settings = TaskSettings::new(task);
            settings.code_via = via;
            let t = Instant::now();
            let outcome = run_task(
                settings,
                &model,
                executor,
                Arc::new(|_| {}),
                CancellationToken::new(),
            )
            .await;
            assert_eq!(
                outcome.stop_reason,
                StopReason::Terminated,
                "{:?}",
                outcome.error
            );
            t.elapsed()
        }
    };
    // Warm: the fork server and the HTTP connection.
    one("fenced 0".to_owned(), CodeVia::Blocks).await;
    let (mut by_block, mut by_tool) = (Vec::new(), Vec::new());
    for i in 1..tasks {
        by_block.push(one(format!("fenced {i}"), CodeVia::Blocks).await);
        by_tool.push(one(format!("tool {i}"), CodeVia::Tool).await);
    }
    let ((bm, bp), (tm, tp)) = (stats(by_block), stats(by_tool));
    println!(
        "\n## Tools: `print(1)` as an `execute_code` call vs fenced ({} two-turn tasks each, one at a time, alternated; local executor)",
        tasks - 1
    );
    println!("| code comes as | mean | median | ratio to fenced (median) |");
    println!("|---|---|---|---|");
    println!("| a fenced block | {} | {} | 1.000x |", ms(bm), ms(bp));
    println!(
        "| an `execute_code` tool call | {} | {} | {:.3}x |",
        ms(tm),
        ms(tp),
        tp.as_secs_f64() / bp.as_secs_f64()
    );

    // A call from code: an endpoint that answers at once, called `calls` times by one block.
    use axum::routing::post;
    let app = axum::Router::new().route("/echo", post(|body: String| async move { body }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/echo", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mut catalog = Catalog::new();
    catalog.insert(
        "echo".to_owned(),
        ToolDef {
            url: Some(url.clone()),
            ..ToolDef::default()
        },
    );
    let code = format!(
        "```python\nimport time, tandem_tools\ntandem_tools.call('echo', text='x')\nt = time.perf_counter()\nfor _ in range({calls}):\n    tandem_tools.call('echo', text='x')\nprint((time.perf_counter() - t) / {calls} * 1e6)\n```"
    );
    let server = ScriptedOpenAi::start(
        [(
            "call from code".to_owned(),
            vec![Reply::from(code.as_str()), Reply::from("TERMINATE")],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let model = ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        ..ModelConfig::default()
    })
    .unwrap();
    let mut settings = TaskSettings::new("call from code");
    settings.tools = resolve(None, &catalog.into()).unwrap();
    settings.session.limits.wall = Duration::from_secs(600);
    let printed = Arc::new(std::sync::Mutex::new(String::new()));
    let into = printed.clone();
    let outcome = run_task(
        settings,
        &model,
        executor.clone(),
        Arc::new(move |e| {
            if let tandem_protocol::EventMsg::ExecResult { result, .. } = e {
                *into.lock().unwrap() = result.stdout.clone();
            }
        }),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(
        outcome.stop_reason,
        StopReason::Terminated,
        "{:?}",
        outcome.error
    );
    let per_call_us: f64 = printed
        .lock()
        .unwrap()
        .trim()
        .parse()
        .expect("the block's timing");
    // The same request made straight from here, on one kept connection.
    let client = reqwest::Client::new();
    let body = r#"{"text":"x"}"#;
    client
        .post(&url)
        .body(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let t = Instant::now();
    for _ in 0..calls {
        client
            .post(&url)
            .body(body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
    }
    let direct_us = t.elapsed().as_secs_f64() * 1e6 / calls as f64;
    println!(
        "\n## Tools: a call from inside a local block ({calls} calls of an HTTP tool on loopback, one block)"
    );
    println!("| path | per call | Tandem's own cost |");
    println!("|---|---|---|");
    println!(
        "| the endpoint called straight from this process (reqwest, kept connection) | {direct_us:.0} µs | |"
    );
    println!(
        "| `tandem_tools.call` in the block: channel, checks, events, the same request | {per_call_us:.0} µs | {:.0} µs ({:.3} ms) |",
        per_call_us - direct_us,
        (per_call_us - direct_us) / 1000.0
    );
}

/// A session under test, by label, with its samples of a block that changes nothing and of
/// one that writes a 1 KiB file.
type Sampled = (
    &'static str,
    Box<dyn tandem_executor::Session>,
    Vec<Duration>,
    Vec<Duration>,
);

/// Runs both blocks `blocks` times in each session, session after session (after one round
/// that is not counted), so that every path meets the same machine.
async fn alternate_blocks(sessions: &mut [Sampled], blocks: usize) {
    // The write is copied out after the block where the workspace is the sandbox's own.
    let write = "open('out.txt', 'w').write('x' * 1024)\nprint(1)";
    for i in 0..=blocks {
        for (_, session, quiet, wrote) in sessions.iter_mut() {
            for (code, samples) in [("print(1)", &mut *quiet), (write, &mut *wrote)] {
                let t = Instant::now();
                let out = session
                    .run(
                        ExecRequest::new(Language::python(), code),
                        ExecContext::new(CancellationToken::new()),
                    )
                    .await
                    .unwrap();
                assert_eq!(out.stdout.to_text(), "1\n");
                if i > 0 {
                    samples.push(t.elapsed());
                }
            }
        }
    }
}

/// Docker hosts: the per-block cost of each way of reaching an engine, alternated block by
/// block in one run; then a fleet of one host against two, by sessions opened (and closed)
/// per second and by two-turn tasks per second, `concurrency` at a time. Both engines are on
/// this machine, so two hosts share its two cores: this measures what placement and a
/// second engine cost, not a second machine's worth of capacity.
async fn docker_hosts(blocks: usize, sessions: usize, concurrency: usize) {
    use tandem_executor_docker::{
        DockerConfig, DockerExecutor, DockerFleet, HostSpec, WorkspaceMode,
    };
    use tandem_tests::second_engine;

    let image = second_engine::image();
    let engine = second_engine::shared().await;
    let local = |workspace| DockerConfig {
        name: "a".to_owned(),
        image: image.clone(),
        pull: false,
        pool_size: 0,
        workspace,
        ..DockerConfig::default()
    };
    let paths = [
        (
            "local socket, bind-mounted workspace",
            local(WorkspaceMode::Bind),
        ),
        (
            "local socket, volume workspace (tar out)",
            local(WorkspaceMode::Volume),
        ),
        (
            "second engine over TLS, volume workspace",
            engine.config("b"),
        ),
    ];
    let mut open = Vec::new();
    for (label, config) in paths {
        let executor = DockerExecutor::connect(config).await.unwrap();
        let session = executor.open(SessionSpec::default()).await.unwrap();
        open.push((label, session, Vec::new(), Vec::new()));
    }
    alternate_blocks(&mut open, blocks).await;
    println!(
        "\n## Docker hosts: a Python block, {blocks} of each kind per path, alternated ({image})"
    );
    println!("| path | block | mean | median | ratio (mean) |");
    println!("|---|---|---|---|---|");
    let mut base = [None, None];
    for (label, session, quiet, wrote) in open {
        session.close().await.unwrap();
        for (i, (kind, samples)) in [("print(1)", quiet), ("writes 1 KiB to a file", wrote)]
            .into_iter()
            .enumerate()
        {
            let (m, p) = stats(samples);
            let b = *base[i].get_or_insert(m);
            println!(
                "| {label} | {kind} | {} | {} | {:.2}x |",
                ms(m),
                ms(p),
                m.as_secs_f64() / b.as_secs_f64()
            );
        }
    }

    let host = |config: DockerConfig| HostSpec {
        config,
        capacity: concurrency,
        labels: Default::default(),
    };
    let (_server, model) = print_one_model(sessions).await;
    let mut rows = Vec::new();
    for (label, hosts) in [
        (
            "one host (the system engine)",
            vec![host(local(WorkspaceMode::Volume))],
        ),
        (
            "two hosts (the system engine and the TLS one)",
            vec![host(local(WorkspaceMode::Volume)), host(engine.config("b"))],
        ),
    ] {
        let fleet = DockerFleet::connect(hosts, Duration::from_secs(5))
            .await
            .unwrap();
        let fleet: Arc<dyn Executor> = Arc::new(fleet);
        let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
        let started = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..sessions {
            let (fleet, limit) = (fleet.clone(), limit.clone());
            set.spawn(async move {
                let _permit = limit.acquire_owned().await.unwrap();
                let s = fleet.open(SessionSpec::default()).await.unwrap();
                s.close().await.unwrap();
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        let opened = started.elapsed();
        let ran = tasks_at(&model, fleet.clone(), sessions, concurrency).await;
        rows.push((label, opened, ran));
    }
    println!(
        "\n## Docker hosts: a fleet of one host against two, {sessions} sessions and {sessions} two-turn tasks, {concurrency} at a time, capacity {concurrency} per host, no warm pool"
    );
    println!("| fleet | sessions opened and closed /s | tasks/s | tasks/s against one host |");
    println!("|---|---|---|---|");
    let one = rows[0].2;
    for (label, opened, ran) in rows {
        println!(
            "| {label} | {:.1} | {:.1} | {:.2}x |",
            sessions as f64 / opened.as_secs_f64(),
            sessions as f64 / ran.as_secs_f64(),
            one.as_secs_f64() / ran.as_secs_f64()
        );
    }
}

/// Kubernetes through the stand-in API server against Docker on the local socket (both with
/// the workspace in the sandbox, copied out after each block), alternated: what the claim,
/// the exec WebSocket and tar over exec cost beyond an attached container. The stand-in's
/// pods are containers on the same engine, so the difference is the path, not the sandbox.
async fn kubernetes(opens: usize, blocks: usize) {
    use tandem_executor_docker::{DockerConfig, DockerExecutor, WorkspaceMode};

    let image =
        std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned());
    let cluster = tandem_tests::kubernetes::FakeCluster::deployed().await;
    let docker = DockerExecutor::connect(DockerConfig {
        image: image.clone(),
        pull: false,
        pool_size: 0,
        workspace: WorkspaceMode::Volume,
        ..DockerConfig::default()
    })
    .await
    .unwrap();
    let kubernetes = cluster.executor().await;
    let executors: [(&str, &dyn Executor); 2] = [
        ("docker, local socket, volume workspace", &docker),
        ("kubernetes, stand-in API server", &kubernetes),
    ];
    let mut open_samples = [Vec::new(), Vec::new()];
    for i in 0..=opens {
        for (j, (_, executor)) in executors.iter().enumerate() {
            let t = Instant::now();
            let session = executor.open(SessionSpec::default()).await.unwrap();
            session.close().await.unwrap();
            if i > 0 {
                open_samples[j].push(t.elapsed());
            }
        }
    }
    let mut sessions = Vec::new();
    for (label, executor) in executors {
        let session = executor.open(SessionSpec::default()).await.unwrap();
        sessions.push((label, session, Vec::new(), Vec::new()));
    }
    alternate_blocks(&mut sessions, blocks).await;
    println!(
        "\n## Kubernetes (stand-in API server) against Docker: {opens} opens and {blocks} blocks of each kind, alternated ({image})"
    );
    println!("| path | what | mean | median | ratio (mean) |");
    println!("|---|---|---|---|---|");
    let mut base = [None, None, None];
    for (j, (label, session, quiet, wrote)) in sessions.into_iter().enumerate() {
        session.close().await.unwrap();
        let rows = [
            ("session open + close", std::mem::take(&mut open_samples[j])),
            ("`print(1)`", quiet),
            ("writes 1 KiB", wrote),
        ];
        for (k, (what, samples)) in rows.into_iter().enumerate() {
            let (m, p) = stats(samples);
            let b = *base[k].get_or_insert(m);
            println!(
                "| {label} | {what} | {} | {} | {:.2}x |",
                ms(m),
                ms(p),
                m.as_secs_f64() / b.as_secs_f64()
            );
        }
    }
    cluster.stop().await;
}

/// The task store: tasks/s of one, two and three daemons sharing a PostgreSQL database
/// against one daemon on its SQLite file, the same scripted tasks (a `print(1)` block, then
/// TERMINATE) on the local executor, each daemon with the same slots; and how long a queued
/// task waits to be claimed: by its own idle daemon, and by another daemon (the one it was
/// submitted to has no free slot, so the claim follows a NOTIFY).
async fn stores(tasks: usize, slots: usize) {
    let Some(bin) = tandem_binary() else {
        println!(
            "\n## Stores: not measured: build the binary first with `cargo build --release -p tandem-cli`"
        );
        return;
    };
    let code = "```python\nprint(1)\n```";
    let mut script: Script = (0..tasks)
        .map(|i| {
            (
                format!("store task {i}"),
                vec![Reply::from(code), Reply::from("TERMINATE")],
            )
        })
        .collect();
    script.insert(
        "hold the slot".to_owned(),
        vec![Reply::from("```python\nimport time\ntime.sleep(600)\n```")],
    );
    let server = ScriptedOpenAi::start(script).await.unwrap();
    // Durable, as the SQLite file is (synchronous = FULL): every commit is synced.
    let pg = tokio::task::spawn_blocking(|| tandem_tests::Postgres::start(true))
        .await
        .unwrap();
    let python =
        bench_python().map(|p| format!("[executors.local]\npython = \"{}\"\n", p.display()));
    let start = |name: String, url: Option<String>, slots: usize| {
        let (bin, base_url) = (bin.clone(), server.base_url());
        let config = format!(
            "[store]\ndaemon = \"{name}\"\n{}",
            python.clone().unwrap_or_default()
        );
        async move {
            let env: Vec<(&str, &str)> = url
                .as_deref()
                .map(|u| vec![("TANDEM_STORE_URL", u)])
                .unwrap_or_default();
            DaemonHarness::start_with_env(
                &bin,
                &base_url,
                &["--max-concurrent", &slots.to_string()],
                Some(&config),
                &env,
            )
            .await
        }
    };
    println!(
        "\n## Stores: {tasks} tasks (`print(1)`, then TERMINATE), {slots} slots per daemon, local executor"
    );
    println!("\n| store | daemons | seconds | tasks/s | against one daemon on SQLite |");
    println!("|---|---|---|---|---|");
    let mut baseline = None;
    for (store, daemons) in [
        ("SQLite", 1),
        ("PostgreSQL", 1),
        ("PostgreSQL", 2),
        ("PostgreSQL", 3),
    ] {
        let url = (store == "PostgreSQL").then(|| pg.new_database());
        let mut ds = Vec::new();
        for n in 0..daemons {
            ds.push(start(format!("d{n}"), url.clone(), slots).await);
        }
        let started = Instant::now();
        futures::stream::iter(
            (0..tasks).map(|i| submit(&ds[i % daemons], format!("store task {i}"))),
        )
        .buffer_unordered(SUBMITTERS)
        .collect::<Vec<_>>()
        .await;
        while ds[0].count("finished").await < tasks as u64 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = started.elapsed().as_secs_f64();
        let rate = tasks as f64 / took;
        let base = *baseline.get_or_insert(rate);
        println!(
            "| {store} | {daemons} | {took:.2} | {rate:.1} | {:.2}x |",
            rate / base
        );
    }
    // Claim latency: created to started, as the task record says (one clock: one machine).
    let latency = |d: &DaemonHarness, id: String| {
        let d = d.http().clone();
        async move {
            let t: serde_json::Value = d
                .get(format!("http://tandem/v1/tasks/{id}"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            (t["started_ms"].as_u64().unwrap() - t["created_ms"].as_u64().unwrap()) as f64
        }
    };
    const CLAIMS: usize = 50;
    println!("\n| claim of a queued task (created to started) | median ms | p95 ms |");
    println!("|---|---|---|");
    for (label, store, cross) in [
        ("SQLite, the daemon it was submitted to", "SQLite", false),
        (
            "PostgreSQL, the daemon it was submitted to",
            "PostgreSQL",
            false,
        ),
        ("PostgreSQL, another daemon (NOTIFY)", "PostgreSQL", true),
    ] {
        let url = (store == "PostgreSQL").then(|| pg.new_database());
        let submit_to = start("front".to_owned(), url.clone(), 1).await;
        let other = if cross {
            // The daemon it is submitted to has its one slot taken.
            submit(&submit_to, "hold the slot".to_owned()).await;
            while submit_to.count("running").await < 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Some(start("back".to_owned(), url.clone(), slots).await)
        } else {
            None
        };
        let mut waits = Vec::new();
        for i in 0..CLAIMS {
            let id = submit(&submit_to, format!("store task {i}")).await;
            let runner = other.as_ref().unwrap_or(&submit_to);
            runner.wait_finished(&id, Duration::from_secs(60)).await;
            waits.push(latency(runner, id).await);
        }
        waits.sort_by(f64::total_cmp);
        println!(
            "| {label} | {:.1} | {:.1} |",
            median(waits.clone()),
            waits[(waits.len() * 95 / 100).min(waits.len() - 1)]
        );
    }
}

/// What exporting traces costs: the turn loop's tasks with every span made and exported over
/// OTLP/HTTP to a real collector on loopback, against export off (the daemon's logging, with
/// Tandem's spans filtered out), alternated rounds; then a daemon's tasks per second with
/// `[telemetry]` against one without, alternated.
async fn traces_overhead(tasks: usize, concurrency: usize) {
    use tracing::instrument::WithSubscriber as _;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;

    const ROUNDS: usize = 7;
    let collector = tandem_tests::otlp::Collector::start().await;
    // `TANDEM_BENCH_OTLP=sink`: a receiver that takes each export and answers without decoding
    // it, so that the collector's own work (in this process, on the same cores) is not counted.
    let sink = std::env::var("TANDEM_BENCH_OTLP").is_ok_and(|v| v == "sink");
    let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let endpoint = if sink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = received.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let count = count.clone();
                async move {
                    count.fetch_add(body.len(), std::sync::atomic::Ordering::Relaxed);
                    (
                        [("content-type", "application/x-protobuf")],
                        Vec::<u8>::new(),
                    )
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        format!("http://{addr}")
    } else {
        collector.http_endpoint()
    };
    let receiver = if sink {
        "a receiver on loopback that does not decode"
    } else {
        "a collector on loopback"
    };
    let logs = || {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::sink)
            .with_filter(tracing_subscriber::EnvFilter::new("info,tandem_trace=off"))
    };
    let off = tracing::Dispatch::new(tracing_subscriber::registry().with(logs()));
    let telemetry = tandem_telemetry::Telemetry::start(&tandem_telemetry::TelemetryConfig {
        endpoint: Some(endpoint.clone()),
        ..Default::default()
    })
    .unwrap()
    .expect("traces on");
    let on = tracing::Dispatch::new(
        tracing_subscriber::registry()
            .with(logs())
            .with(telemetry.layer()),
    );
    let (_server, model) = print_one_model(tasks * ROUNDS * 2).await;
    let executor: Arc<dyn Executor> = Arc::new(local_executor(true));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let round = |dispatch: tracing::Dispatch| {
        let (model, executor) = (model.clone(), executor.clone());
        let first = next.fetch_add(tasks, std::sync::atomic::Ordering::SeqCst);
        async move {
            let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
            let started = Instant::now();
            let mut set = tokio::task::JoinSet::new();
            for i in first..first + tasks {
                let (model, executor, limit) = (model.clone(), executor.clone(), limit.clone());
                let task = async move {
                    let _permit = limit.acquire_owned().await.unwrap();
                    let span = tandem_agent::trace::task(&i.to_string(), "tandem");
                    let outcome = tracing::Instrument::instrument(
                        run_task(
                            TaskSettings::new(format!("bench task {i}")),
                            &model,
                            executor,
                            Arc::new(|_| {}),
                            CancellationToken::new(),
                        ),
                        span,
                    )
                    .await;
                    assert_eq!(outcome.stop_reason, StopReason::Terminated);
                };
                set.spawn(task.with_subscriber(dispatch.clone()));
            }
            while let Some(r) = set.join_next().await {
                r.unwrap();
            }
            started.elapsed()
        }
    };
    let (mut without, mut with, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..ROUNDS {
        let (a, b) = if r % 2 == 0 {
            let a = round(off.clone()).await;
            (a, round(on.clone()).await)
        } else {
            let b = round(on.clone()).await;
            (round(off.clone()).await, b)
        };
        ratios.push(b.as_secs_f64() / a.as_secs_f64());
        without.push(a);
        with.push(b);
    }
    // Every task's spans reached the collector: what was measured was made and sent.
    let expected = tasks * ROUNDS * 7;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !sink && collector.spans().len() < expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let received = if sink {
        format!(
            "{} KiB received",
            received.load(std::sync::atomic::Ordering::Relaxed) / 1024
        )
    } else {
        format!("{} spans received", collector.spans().len())
    };
    let dropped = tandem_agent::trace::dropped_spans();
    ratios.sort_by(f64::total_cmp);
    let rate = |d: Duration| tasks as f64 / d.as_secs_f64();
    let (a, b) = (stats(without).1, stats(with).1);
    println!(
        "\n## Traces, turn loop: {tasks} two-turn tasks (python print(1)), concurrency {concurrency}, {ROUNDS} alternated rounds (medians)"
    );
    println!("| run | wall | tasks/s | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| export off (logs only, Tandem's spans filtered out) | {:.2} s | {:.1} | 1.00x |",
        a.as_secs_f64(),
        rate(a)
    );
    println!(
        "| every span exported over OTLP/HTTP to {receiver} ({received}, {dropped} dropped) | {:.2} s | {:.1} | {:.3}x (median of per-round ratios; range {:.3}x to {:.3}x) |",
        b.as_secs_f64(),
        rate(b),
        ratios[ROUNDS / 2],
        ratios[0],
        ratios[ROUNDS - 1]
    );

    let Some(bin) = tandem_binary() else {
        println!("\n## Traces, daemon: not measured: build the `tandem` binary first");
        return;
    };
    let code = "```python\nprint(1)\n```";
    let per = tasks / 2;
    let script: Script = (0..per * ROUNDS * 2)
        .map(|i| {
            (
                format!("daemon bench task {i}"),
                vec![Reply::from(code), Reply::from("Done.\nTERMINATE")],
            )
        })
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let python =
        bench_python().map(|p| format!("[executors.local]\npython = \"{}\"\n", p.display()));
    let plain = python.clone().unwrap_or_default();
    let traced = format!("{plain}\n[telemetry]\nendpoint = \"{endpoint}\"\n");
    let n = concurrency.to_string();
    let args = ["--max-concurrent", n.as_str()];
    let d_off = DaemonHarness::start(&bin, &server.base_url(), &args, Some(&plain)).await;
    let d_on = DaemonHarness::start(&bin, &server.base_url(), &args, Some(&traced)).await;
    async fn burst(d: &DaemonHarness, first: usize, per: usize) -> Duration {
        let started = Instant::now();
        let ids = futures::future::join_all(
            (first..first + per).map(|i| submit(d, format!("daemon bench task {i}"))),
        )
        .await;
        for id in ids {
            let done = d.wait_finished(&id, Duration::from_secs(600)).await;
            assert_eq!(done.record.stop_reason, Some(StopReason::Terminated));
        }
        started.elapsed()
    }
    let (mut without, mut with, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..ROUNDS {
        let (one, two) = (2 * r * per, (2 * r + 1) * per);
        let (a, b) = if r % 2 == 0 {
            let a = burst(&d_off, one, per).await;
            (a, burst(&d_on, two, per).await)
        } else {
            let b = burst(&d_on, one, per).await;
            (burst(&d_off, two, per).await, b)
        };
        ratios.push(b.as_secs_f64() / a.as_secs_f64());
        without.push(a);
        with.push(b);
    }
    ratios.sort_by(f64::total_cmp);
    let rate = |d: Duration| per as f64 / d.as_secs_f64();
    let (a, b) = (stats(without).1, stats(with).1);
    println!(
        "\n## Traces, daemon: {per} two-turn tasks submitted at once over HTTP, --max-concurrent {concurrency}, {ROUNDS} alternated rounds (medians), {}",
        bin.display()
    );
    println!("| daemon | wall | tasks/s | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| no [telemetry] | {:.2} s | {:.1} | 1.00x |",
        a.as_secs_f64(),
        rate(a)
    );
    println!(
        "| [telemetry] to {receiver} | {:.2} s | {:.1} | {:.3}x (median of per-round ratios; range {:.3}x to {:.3}x) |",
        b.as_secs_f64(),
        rate(b),
        ratios[ROUNDS / 2],
        ratios[0],
        ratios[ROUNDS - 1]
    );
    telemetry.shutdown();
}
