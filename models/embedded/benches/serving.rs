//! The embedded engine serving several tasks at once, beside llama.cpp's own server on the
//! same GGUF, the same chats and the same threads, in one run. Each scenario runs in a
//! process of its own, so its peak memory is its own.
//!
//!   cargo build --release -p tandem-cli   # for the daemon scenarios (or set SERVING_TANDEM)
//!   cargo bench -p tandem-model-embedded --bench serving -- MODEL.gguf PYTHON [DRAFT.gguf]
//!
//! PYTHON is a Python with `xllamacpp` installed (llama.cpp's server as a library). With
//! DRAFT, the scenarios with a draft model run too, on both engines (4 tokens a step). A task is
//! three turns of Tandem's default system prompt, a coding question, and two outcomes of a
//! run fed back; replies are greedy and at most `TURN_TOKENS` tokens. The daemon scenarios run
//! the same four questions as real tasks on a `tandem serve` (three turns at most, the local
//! executor running what the model writes), its model embedded or the server.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_model_embedded::{Embedded, EmbeddedConfig, Event, Generate};

const THREADS: i32 = 2;
const WINDOW: u32 = 8192;
const CACHE: u32 = 16384;
const TURN_TOKENS: u32 = 96;
/// Tokens a draft guesses per step, on both engines.
const DRAFT_TOKENS: u32 = 4;

const TASKS: [&str; 4] = [
    "Write a Python function that returns the n-th prime number and print the 100th prime.",
    "Read the CSV text 'a,b\\n1,2\\n3,4' with the csv module and print the sum of column b.",
    "Write a shell command that counts the lines of every .txt file in the current directory.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces, and test it on three examples.",
];

const OUTCOMES: [&str; 2] = [
    "exitcode: 0 (execution succeeded)\nYour code printed:\n541\n",
    "exitcode: 1 (execution failed)\nYour code printed:\nTraceback (most recent call last):\n  File \"main.py\", line 3, in <module>\nNameError: name 'result' is not defined\n",
];

/// The chat of `task` after `replies` (one per turn before this one).
fn chat(task: usize, replies: &[String]) -> Vec<Value> {
    let mut messages = vec![
        json!({"role": "system", "content": tandem_agent::DEFAULT_SYSTEM_PROMPT}),
        json!({"role": "user", "content": TASKS[task]}),
    ];
    for (turn, reply) in replies.iter().enumerate() {
        messages.push(json!({"role": "assistant", "content": reply}));
        messages.push(json!({"role": "user", "content": OUTCOMES[turn % OUTCOMES.len()]}));
    }
    messages
}

/// What one scenario measured.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
struct Figures {
    tokens: u64,
    seconds: f64,
    ttft_ms: f64,
    peak_mb: f64,
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if let [flag, scenario, model, rest @ ..] = args.as_slice()
        && flag == "--child"
    {
        let figures = child(
            scenario,
            model,
            rest.first().map(String::as_str),
            rest.get(1).map(String::as_str).filter(|d| !d.is_empty()),
        );
        match figures {
            Ok(f) => println!("{}", serde_json::to_string(&f).unwrap_or_default()),
            Err(e) => {
                eprintln!("{scenario}: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    let [model, python, more @ ..] = args.as_slice() else {
        eprintln!("usage: serving MODEL.gguf PYTHON  (a Python with xllamacpp installed)");
        std::process::exit(2);
    };
    let run = |scenario: &str| -> Figures {
        let exe = std::env::current_exe().unwrap_or_default();
        let draft = if scenario.contains("draft") {
            more.first().map_or("", String::as_str)
        } else {
            ""
        };
        let out = Command::new(exe)
            .args(["--child", scenario, model, python, draft])
            .stderr(Stdio::inherit())
            .output();
        match out {
            Ok(out) if out.status.success() => {
                serde_json::from_slice(&out.stdout).unwrap_or_default()
            }
            _ => {
                eprintln!("{scenario} failed");
                Figures::default()
            }
        }
    };
    let rows = [
        ("engine: one task alone", "alone"),
        ("engine: four tasks at once", "four"),
        ("server, 4 slots: one task alone", "server-alone"),
        ("server, 4 slots: four tasks at once", "server-four"),
        ("engine: turn 2 alone", "ttft-alone"),
        ("engine: turn 2 beside three replies", "ttft-busy"),
        ("server, 4 slots: turn 2 alone", "server-ttft-alone"),
        (
            "server, 4 slots: turn 2 beside three replies",
            "server-ttft-busy",
        ),
        ("engine: forty one-turn tasks queued", "forty"),
        ("engine: one long count alone", "count-1"),
        ("engine: four long counts at once", "count-4"),
        ("server, 4 slots: one long count alone", "server-count-1"),
        (
            "server, 4 slots: four long counts at once",
            "server-count-4",
        ),
        ("daemon, embedded: one task alone", "daemon-alone"),
        ("daemon, embedded: four tasks at once", "daemon-four"),
        (
            "daemon on the server: one task alone",
            "server-daemon-alone",
        ),
        (
            "daemon on the server: four tasks at once",
            "server-daemon-four",
        ),
        ("engine with draft: one task alone", "draft-alone"),
        ("server with draft: one task alone", "server-draft-alone"),
        ("engine with draft: one long count alone", "draft-count-1"),
        (
            "server with draft: one long count alone",
            "server-draft-count-1",
        ),
    ];
    let mut figures = std::collections::BTreeMap::new();
    println!(
        "{:<46} {:>7} {:>8} {:>8} {:>9} {:>8}",
        "scenario", "tokens", "seconds", "tok/s", "TTFT ms", "peak MB"
    );
    // `SERVING_ONLY=count-1,count-4` runs those alone.
    let only = std::env::var("SERVING_ONLY").ok();
    for (label, scenario) in rows {
        if only
            .as_deref()
            .is_some_and(|o| !o.split(',').any(|s| s == scenario))
            || (scenario.contains("draft") && more.is_empty())
        {
            continue;
        }
        let f = run(scenario);
        println!(
            "{label:<46} {:>7} {:>8.1} {:>8.2} {:>9.0} {:>8.0}",
            f.tokens,
            f.seconds,
            rate(f),
            f.ttft_ms,
            f.peak_mb
        );
        figures.insert(scenario, f);
    }
    let ratio = |a: &str, b: &str, f: fn(Figures) -> f64| {
        let get = |k: &str| figures.get(k).copied().unwrap_or_default();
        let (x, y) = (f(get(a)), f(get(b)));
        if y > 0.0 { x / y } else { f64::NAN }
    };
    println!();
    println!(
        "four at once / one alone, tokens per second (goal >= 1.6): {:.2}",
        ratio("four", "alone", rate)
    );
    println!(
        "four at once, engine / server (goal >= 1.0): {:.2}",
        ratio("four", "server-four", rate)
    );
    println!(
        "four long counts / one, tokens per second (decoding alone): {:.2}  (server: {:.2})",
        ratio("count-4", "count-1", rate),
        ratio("server-count-4", "server-count-1", rate)
    );
    println!(
        "through the daemon, four at once / one alone (goal >= 1.6): {:.2}  (on the server: {:.2})",
        ratio("daemon-four", "daemon-alone", rate),
        ratio("server-daemon-four", "server-daemon-alone", rate)
    );
    println!(
        "through the daemon, four at once, embedded / on the server (goal >= 1.0): {:.2}",
        ratio("daemon-four", "server-daemon-four", rate)
    );
    println!(
        "one task, with draft / without (goal >= 1.3): {:.2}  (long count: {:.2}; server: {:.2})",
        ratio("draft-alone", "alone", rate),
        ratio("draft-count-1", "count-1", rate),
        ratio("server-draft-alone", "server-alone", rate)
    );
    println!(
        "one task with draft, engine / server with draft (goal >= 1.0): {:.2}  (long count: {:.2})",
        ratio("draft-alone", "server-draft-alone", rate),
        ratio("draft-count-1", "server-draft-count-1", rate)
    );
    println!(
        "turn 2 TTFT, beside three / alone (goal <= 1.2): {:.2}  (server: {:.2})",
        ratio("ttft-busy", "ttft-alone", |f| f.ttft_ms),
        ratio("server-ttft-busy", "server-ttft-alone", |f| f.ttft_ms)
    );
}

fn rate(f: Figures) -> f64 {
    if f.seconds > 0.0 {
        f.tokens as f64 / f.seconds
    } else {
        0.0
    }
}

/// Peak resident memory of process `pid`, in MB.
fn peak_mb(pid: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

type Result<T> = std::result::Result<T, String>;

fn child(
    scenario: &str,
    model: &str,
    python: Option<&str>,
    draft: Option<&str>,
) -> Result<Figures> {
    if let Some(server) = scenario.strip_prefix("server-") {
        let python = python.ok_or("no PYTHON given")?;
        return with_server(model, python, server.trim_start_matches("draft-"), draft);
    }
    let scenario = scenario.trim_start_matches("draft-");
    if let Some(n) = daemon_tasks_of(scenario) {
        return daemon_tasks(
            &format!(
                "provider = \"embedded\"\nmodel = \"{model}\"\ncontext_tokens = {WINDOW}\ncache_tokens = {CACHE}\n"
            ),
            n,
        );
    }
    let engine = Embedded::load(
        std::path::Path::new(model),
        EmbeddedConfig {
            threads: THREADS,
            context_tokens: WINDOW,
            cache_tokens: CACHE,
            draft: draft.map(std::path::PathBuf::from),
            draft_tokens: DRAFT_TOKENS,
            ..EmbeddedConfig::for_cores(2)
        },
    )
    .map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut f = rt.block_on(engine_scenario(&engine, scenario))?;
    f.peak_mb = peak_mb("self");
    Ok(f)
}

/// One reply from the engine: its text, tokens and time to its first text.
async fn ask(
    engine: &Embedded,
    messages: Vec<Value>,
    max_tokens: u32,
) -> Result<(String, u64, f64)> {
    let started = Instant::now();
    let mut reply = engine
        .generate(Generate {
            messages,
            tools: Vec::new(),
            grammar: None,
            max_tokens,
            temperature: 0.0,
            seed: 1,
            stop: Vec::new(),
        })
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    let mut first = None;
    while let Some(event) = reply.events.recv().await {
        match event {
            Event::Text(t) => {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64() * 1e3);
                text.push_str(&t);
            }
            Event::Done {
                completion_tokens, ..
            } => {
                return Ok((text, completion_tokens.into(), first.unwrap_or_default()));
            }
            Event::Failed(why) => return Err(why),
        }
    }
    Err("the reply ended without Done".to_owned())
}

/// A short question whose reply is all generation: counting on from `n`.
fn count(n: usize) -> Vec<Value> {
    vec![
        json!({"role": "user", "content": format!("Count from {} to 100000, one number per line, with nothing else.", n * 1000 + 1)}),
    ]
}

/// Replies of `COUNT_TOKENS` tokens each, so the figure is decoding's.
const COUNT_TOKENS: u32 = 128;

/// A three-turn task; its generated tokens.
async fn task(engine: &Embedded, n: usize) -> Result<u64> {
    let mut replies = Vec::new();
    let mut tokens = 0;
    for _ in 0..3 {
        let (text, t, _) = ask(engine, chat(n, &replies), TURN_TOKENS).await?;
        tokens += t;
        replies.push(text);
    }
    Ok(tokens)
}

async fn engine_scenario(engine: &Embedded, scenario: &str) -> Result<Figures> {
    let started = Instant::now();
    let mut f = Figures::default();
    match scenario {
        "alone" => f.tokens = task(engine, 0).await?,
        "four" => {
            let all = futures::future::join_all((0..4).map(|n| task(engine, n))).await;
            for t in all {
                f.tokens += t?;
            }
        }
        "ttft-alone" | "ttft-busy" => {
            let (reply, _, _) = ask(engine, chat(0, &[]), TURN_TOKENS).await?;
            let mut others = Vec::new();
            if scenario == "ttft-busy" {
                for n in 1..4 {
                    let mut r = engine
                        .generate(Generate {
                            messages: chat(n, &[]),
                            tools: Vec::new(),
                            grammar: None,
                            max_tokens: 400,
                            temperature: 0.0,
                            seed: 1,
                            stop: Vec::new(),
                        })
                        .map_err(|e| e.to_string())?;
                    // Wait until it generates: its prompt is read.
                    r.events.recv().await;
                    others.push(r);
                }
            }
            let turn = Instant::now();
            let (_, t, ttft) = ask(engine, chat(0, &[reply]), TURN_TOKENS).await?;
            f.tokens = t;
            f.ttft_ms = ttft;
            f.seconds = turn.elapsed().as_secs_f64();
            return Ok(f);
        }
        "count-1" | "count-4" => {
            let n = if scenario == "count-1" { 1 } else { 4 };
            let all =
                futures::future::join_all((0..n).map(|i| ask(engine, count(i), COUNT_TOKENS)))
                    .await;
            for r in all {
                f.tokens += r?.1;
            }
        }
        "forty" => {
            let all = futures::future::join_all((0..40).map(|n| {
                let mut messages = chat(n % 4, &[]);
                messages[1]["content"] = json!(format!("{} (variant {n})", TASKS[n % 4]));
                ask(engine, messages, 16)
            }))
            .await;
            for r in all {
                f.tokens += r?.1;
            }
        }
        other => return Err(format!("no scenario {other}")),
    }
    f.seconds = started.elapsed().as_secs_f64();
    Ok(f)
}

const SERVER: &str = r#"
import signal, sys, threading
import xllamacpp as xlc
p = xlc.CommonParams()
p.model.path = sys.argv[1]
p.hostnames = ["127.0.0.1"]
p.port = int(sys.argv[2])
p.n_ctx = int(sys.argv[3])
p.n_parallel = 4
p.kv_unified = True
p.n_batch = 512
p.n_ubatch = 512
p.cpuparams.n_threads = int(sys.argv[4])
p.cpuparams_batch.n_threads = int(sys.argv[4])
p.cache_prompt = True
p.ui = False
p.offline = True
if len(sys.argv) > 5 and sys.argv[5]:
    p.speculative.types = [xlc.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
    p.speculative.draft.mparams.path = sys.argv[5]
    p.speculative.draft.n_max = int(sys.argv[6])
    p.speculative.draft.n_min = 0
    p.speculative.draft.cpuparams.n_threads = int(sys.argv[4])
    p.speculative.draft.cpuparams_batch.n_threads = int(sys.argv[4])
server = xlc.Server(p)
print("ready", flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
done.wait()
"#;

/// Runs `scenario` against llama.cpp's server, started here with four slots and one unified
/// cache of `CACHE` tokens.
fn with_server(model: &str, python: &str, scenario: &str, draft: Option<&str>) -> Result<Figures> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let mut server = Command::new(python)
        .args([
            "-c",
            SERVER,
            model,
            &port.to_string(),
            &CACHE.to_string(),
            &THREADS.to_string(),
            draft.unwrap_or(""),
            &DRAFT_TOKENS.to_string(),
        ])
        .env("OMP_WAIT_POLICY", "PASSIVE")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {python}: {e}"))?;
    let pid = server.id().to_string();
    let result = (|| {
        let started = Instant::now();
        while !health(port) {
            if started.elapsed() > Duration::from_secs(180) {
                return Err("the server did not answer in 180 s".to_owned());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut f = server_scenario(port, scenario)?;
        f.peak_mb = peak_mb(&pid);
        Ok(f)
    })();
    let _ = server.kill();
    let _ = server.wait();
    result
}

fn health(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    if s.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_err() {
        return false;
    }
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).is_ok() && line.contains(" 200")
}

/// One streamed chat completion: its text, tokens and time to its first text.
fn server_ask(port: u16, messages: Vec<Value>, max_tokens: u32) -> Result<(String, u64, f64)> {
    let body = json!({
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "cache_prompt": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let started = Instant::now();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut text = String::new();
    let mut first = None;
    let mut tokens = 0;
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
        if let Some(piece) = v["choices"][0]["delta"]["content"].as_str()
            && !piece.is_empty()
        {
            first.get_or_insert_with(|| started.elapsed().as_secs_f64() * 1e3);
            text.push_str(piece);
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
    }
    Ok((text, tokens, first.unwrap_or_default()))
}

fn server_task(port: u16, n: usize) -> Result<u64> {
    let mut replies = Vec::new();
    let mut tokens = 0;
    for _ in 0..3 {
        let (text, t, _) = server_ask(port, chat(n, &replies), TURN_TOKENS)?;
        tokens += t;
        replies.push(text);
    }
    Ok(tokens)
}

/// How many tasks a daemon scenario runs.
fn daemon_tasks_of(scenario: &str) -> Option<usize> {
    match scenario {
        "daemon-alone" => Some(1),
        "daemon-four" => Some(4),
        _ => None,
    }
}

fn server_scenario(port: u16, scenario: &str) -> Result<Figures> {
    if let Some(n) = daemon_tasks_of(scenario) {
        return daemon_tasks(
            &format!(
                "provider = \"openai\"\nbase_url = \"http://127.0.0.1:{port}/v1\"\nmodel = \"served\"\n"
            ),
            n,
        );
    }
    let started = Instant::now();
    let mut f = Figures::default();
    match scenario {
        "alone" => f.tokens = server_task(port, 0)?,
        "four" => {
            let handles: Vec<_> = (0..4)
                .map(|n| std::thread::spawn(move || server_task(port, n)))
                .collect();
            for h in handles {
                f.tokens += h.join().map_err(|_| "a task panicked")??;
            }
        }
        "ttft-alone" | "ttft-busy" => {
            let (reply, _, _) = server_ask(port, chat(0, &[]), TURN_TOKENS)?;
            let mut others = Vec::new();
            if scenario == "ttft-busy" {
                let (tx, rx) = std::sync::mpsc::channel();
                for n in 1..4 {
                    let tx = tx.clone();
                    others.push(std::thread::spawn(move || {
                        let _ = tx.send(());
                        server_ask(port, chat(n, &[]), 400)
                    }));
                }
                for _ in 1..4 {
                    let _ = rx.recv();
                }
                // The three have been sent; give the server time to read their prompts.
                wait_generating(port, 3)?;
            }
            let turn = Instant::now();
            let (_, t, ttft) = server_ask(port, chat(0, &[reply]), TURN_TOKENS)?;
            f.tokens = t;
            f.ttft_ms = ttft;
            f.seconds = turn.elapsed().as_secs_f64();
            for h in others {
                let _ = h.join();
            }
            return Ok(f);
        }
        "count-1" | "count-4" => {
            let n = if scenario == "count-1" { 1 } else { 4 };
            let handles: Vec<_> = (0..n)
                .map(|i| std::thread::spawn(move || server_ask(port, count(i), COUNT_TOKENS)))
                .collect();
            for h in handles {
                f.tokens += h.join().map_err(|_| "a request panicked")??.1;
            }
        }
        other => return Err(format!("no server scenario {other}")),
    }
    f.seconds = started.elapsed().as_secs_f64();
    Ok(f)
}

/// Waits until `n` of the server's slots are generating (its `/slots` says so).
fn wait_generating(port: u16, n: usize) -> Result<()> {
    let started = Instant::now();
    loop {
        let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
        s.write_all(b"GET /slots HTTP/1.0\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let mut body = String::new();
        std::io::Read::read_to_string(&mut s, &mut body).map_err(|e| e.to_string())?;
        let json = body.split("\r\n\r\n").nth(1).unwrap_or("[]");
        let slots: Value = serde_json::from_str(json).unwrap_or(Value::Null);
        let generating = slots.as_array().map_or(0, |a| {
            a.iter()
                .filter(|s| s["next_token"][0]["n_decoded"].as_u64().unwrap_or(0) > 0)
                .count()
        });
        if generating >= n {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(300) {
            return Err(format!("only {generating} slots generate after 300 s"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `tandem` binary for the daemon scenarios: `SERVING_TANDEM`, else a release build
/// beside this bench.
fn tandem_bin() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("SERVING_TANDEM") {
        return Some(p.into());
    }
    let exe = std::env::current_exe().ok()?;
    let release = exe.parent()?.parent()?.join("tandem");
    release.is_file().then_some(release)
}

/// `n` three-turn tasks at once through a `tandem serve` whose model is `model_toml` (a
/// `[model]` table's lines): generated tokens from the tasks' records, wall time from the
/// first submit to the last finish, and the daemon's peak memory.
fn daemon_tasks(model_toml: &str, n: usize) -> Result<Figures> {
    let bin = tandem_bin().ok_or("no tandem binary: build it with `cargo build --release -p tandem-cli` or set SERVING_TANDEM")?;
    let state = std::env::temp_dir().join(format!("serving-daemon-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(state.join("tandem")).map_err(|e| e.to_string())?;
    std::fs::write(
        state.join("tandem/tandem.toml"),
        format!("[model]\n{model_toml}temperature = 0.0\nseed = 1\nmax_tokens = {TURN_TOKENS}\n\n[policy]\nexecutors = [\"local\"]\n"),
    )
    .map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let mut daemon = Command::new(&bin)
        .args(["serve", "--executor", "local", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--socket")
        .arg(state.join("sock"))
        .env("XDG_CONFIG_HOME", &state)
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let pid = daemon.id().to_string();
    let result = (|| {
        let started = Instant::now();
        let token = loop {
            if let Ok(t) = std::fs::read_to_string(state.join("token"))
                && request(port, t.trim(), "GET", "/healthz", "").is_ok_and(|(code, _)| code == 200)
            {
                break t.trim().to_owned();
            }
            if started.elapsed() > Duration::from_secs(120) {
                return Err("the daemon did not answer in 120 s".to_owned());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let begun = Instant::now();
        let mut ids = Vec::new();
        for task in TASKS.iter().take(n) {
            let body = json!({"task": task, "executor": "local", "max_turns": 3}).to_string();
            let (_, reply) = request(port, &token, "POST", "/v1/tasks", &body)?;
            let v: Value = serde_json::from_str(&reply).map_err(|e| format!("{e}: {reply}"))?;
            ids.push(
                v["id"]
                    .as_str()
                    .ok_or(format!("no id in {reply}"))?
                    .to_owned(),
            );
        }
        let mut f = Figures::default();
        for id in ids {
            loop {
                let (_, reply) = request(port, &token, "GET", &format!("/v1/tasks/{id}"), "")?;
                let v: Value = serde_json::from_str(&reply).map_err(|e| format!("{e}: {reply}"))?;
                if v["state"] == "finished" {
                    f.tokens += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                    break;
                }
                if begun.elapsed() > Duration::from_secs(900) {
                    return Err(format!("task {id} did not finish in 900 s"));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        f.seconds = begun.elapsed().as_secs_f64();
        f.peak_mb = peak_mb(&pid);
        Ok(f)
    })();
    let _ = daemon.kill();
    let _ = daemon.wait();
    let _ = std::fs::remove_dir_all(&state);
    result
}

/// One HTTP/1.0 request with the daemon's token: the status and the body.
fn request(port: u16, token: &str, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut s, &mut text).map_err(|e| e.to_string())?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    Ok((status, body))
}
