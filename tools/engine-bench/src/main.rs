//! Chooses the embedded model's engine by measuring: llama.cpp through `llama-cpp-2` and
//! candle's quantized Qwen2, each in a process of its own, beside llama.cpp's own server (the
//! reference), on one GGUF, one prompt, greedy, 2 threads. Every engine is run `ROUNDS` times,
//! alternating, and the medians are printed with their ratio to the server.
//!
//!   engine-bench MODEL.gguf SERVER_PYTHON     (a Python that has `xllamacpp` installed)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

const ROUNDS: usize = 3;
const GENERATE: usize = 128;
const THREADS: i32 = 2;
const CTX: u32 = 4096;

/// A coding task in Qwen's ChatML, long enough (~300 tokens) that prompt processing shows.
fn prompt() -> String {
    let system = "You are a helpful AI assistant. Solve tasks using your coding and language skills. \
        Suggest python code (in a python coding block) or shell script (in a sh coding block) for the user to execute. \
        When you need to collect info, use the code to output the info you need, for example, browse or search the web, \
        download/read a file, print the content of a webpage or a file, get the current date/time, check the operating system. \
        After sufficient info is printed and the task is ready to be solved based on your language skill, you can solve the task by yourself. \
        Solve the task step by step if you need to. If a plan is not provided, explain your plan first. \
        Be clear which step uses code, and which step uses your language skill. When using code, you must indicate the script type \
        in the code block. The user cannot provide any other feedback or perform any other action beyond executing the code you suggest. \
        The user can't modify your code. So do not suggest incomplete code which requires users to modify. \
        Reply TERMINATE in the end when everything is done.";
    let user = "Write a Python function that returns the n-th prime number, test it on the first 20 primes, \
        and print the 1000th prime.";
    format!(
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
}

/// One engine's figures for one run.
#[derive(Clone, Copy, Debug, Default)]
struct Figures {
    load_ms: f64,
    prompt_tokens: usize,
    prompt_tps: f64,
    ttft_ms: f64,
    gen_tps: f64,
    rss_mb: f64,
    peak_mb: f64,
}

impl Figures {
    fn to_line(self) -> String {
        format!(
            "{} {} {} {} {} {} {}",
            self.load_ms,
            self.prompt_tokens,
            self.prompt_tps,
            self.ttft_ms,
            self.gen_tps,
            self.rss_mb,
            self.peak_mb
        )
    }

    fn from_line(line: &str) -> Result<Self> {
        let v: Vec<f64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("bad figures line {line:?}"))?;
        if v.len() != 7 {
            bail!("bad figures line {line:?}");
        }
        Ok(Self {
            load_ms: v[0],
            prompt_tokens: v[1] as usize,
            prompt_tps: v[2],
            ttft_ms: v[3],
            gen_tps: v[4],
            rss_mb: v[5],
            peak_mb: v[6],
        })
    }
}

fn status_mb(pid: u32, key: &str) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--llama") => return one_run(|| llama(&args[2])),
        #[cfg(feature = "candle")]
        Some("--candle") => return one_run(|| candle(&args[2])),
        #[cfg(feature = "tandem")]
        Some("--tandem") => return one_run(|| tandem(&args[2])),
        _ => {}
    }
    let (Some(model), Some(python)) = (args.get(1), args.get(2)) else {
        bail!("usage: engine-bench MODEL.gguf SERVER_PYTHON");
    };
    let me = std::env::current_exe()?;
    let mut rows: Vec<(&str, Vec<Figures>)> = vec![
        ("llama.cpp server (xllamacpp)", vec![]),
        ("llama-cpp-2", vec![]),
        ("candle", vec![]),
        ("tandem-model-embedded", vec![]),
    ];
    // More rounds narrow a median on a noisy machine: ENGINE_BENCH_ROUNDS=5.
    let rounds = std::env::var("ENGINE_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(ROUNDS);
    for round in 0..rounds {
        eprintln!("round {}", round + 1);
        rows[0].1.push(server(model, python)?);
        let mut engines = vec![(1, "--llama")];
        if cfg!(feature = "candle") {
            engines.push((2, "--candle"));
        }
        if cfg!(feature = "tandem") {
            engines.push((3, "--tandem"));
        }
        for &(i, flag) in &engines {
            let out = Command::new(&me)
                .args([flag, model])
                .stderr(Stdio::inherit())
                .output()?;
            if !out.status.success() {
                bail!("{flag} failed: {}", out.status);
            }
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text.lines().last().unwrap_or_default();
            rows[i].1.push(Figures::from_line(line)?);
        }
    }
    let med = |v: &[Figures], f: fn(&Figures) -> f64| {
        let mut xs: Vec<f64> = v.iter().map(f).collect();
        xs.sort_by(|a, b| a.total_cmp(b));
        xs[xs.len() / 2]
    };
    let reference: Vec<Figures> = rows[0].1.clone();
    println!(
        "| engine | load ms | prompt tok/s | first token ms | generation tok/s | gen vs server | first token vs server | RSS after run MB | peak RSS MB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (name, runs) in rows.iter().filter(|(_, runs)| !runs.is_empty()) {
        let generation = med(runs, |f| f.gen_tps);
        let ttft = med(runs, |f| f.ttft_ms);
        println!(
            "| {name} | {:.0} | {:.1} | {:.0} | {:.2} | {:.2}x | {:.2}x | {:.0} | {:.0} |",
            med(runs, |f| f.load_ms),
            med(runs, |f| f.prompt_tps),
            ttft,
            generation,
            generation / med(&reference, |f| f.gen_tps),
            ttft / med(&reference, |f| f.ttft_ms),
            med(runs, |f| f.rss_mb),
            med(runs, |f| f.peak_mb),
        );
    }
    println!(
        "\n(medians of {rounds} alternated rounds; prompt {} tokens, {GENERATE} generated, greedy, {THREADS} threads)",
        rows[1].1.first().map_or(0, |f| f.prompt_tokens)
    );
    Ok(())
}

fn one_run(run: impl FnOnce() -> Result<Figures>) -> Result<()> {
    let mut f = run()?;
    let me = std::process::id();
    f.rss_mb = status_mb(me, "VmRSS:");
    f.peak_mb = status_mb(me, "VmHWM:");
    println!("{}", f.to_line());
    Ok(())
}

fn llama(model_path: &str) -> Result<Figures> {
    use llama_cpp_2::context::params::LlamaContextParams;
    use llama_cpp_2::llama_backend::LlamaBackend;
    use llama_cpp_2::llama_batch::LlamaBatch;
    use llama_cpp_2::model::LlamaModel;
    use llama_cpp_2::model::params::LlamaModelParams;
    use llama_cpp_2::sampling::LlamaSampler;

    llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default().with_logs_enabled(false));
    let started = Instant::now();
    let backend = LlamaBackend::init()?;
    let model = LlamaModel::load_from_file(&backend, model_path, &LlamaModelParams::default())?;
    let params = LlamaContextParams::default()
        .with_n_ctx(std::num::NonZeroU32::new(CTX))
        .with_n_batch(512)
        .with_n_ubatch(512)
        .with_n_threads(THREADS)
        .with_n_threads_batch(THREADS);
    let mut ctx = model.new_context(&backend, params)?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;

    let vocab = model.vocab();
    let tokens = vocab.tokenize(prompt().as_bytes(), true, true);
    let n = tokens.len();
    let t0 = Instant::now();
    let mut batch = LlamaBatch::new(512, 1);
    for (i, t) in tokens.iter().enumerate() {
        batch.add(*t, i as i32, &[0], i == n - 1)?;
    }
    ctx.decode(&mut batch)?;
    let prompt_s = t0.elapsed().as_secs_f64();
    let mut sampler = LlamaSampler::greedy();
    let mut text = Vec::new();
    let mut pos = n as i32;
    let mut first = None;
    let gen_start = Instant::now();
    for _ in 0..GENERATE {
        let t = sampler.sample(&ctx, batch.n_tokens() - 1);
        if first.is_none() {
            first = Some(t0.elapsed().as_secs_f64());
        }
        vocab.token_to_piece_into(t, &mut text, true, None);
        batch.clear();
        batch.add(t, pos, &[0], true)?;
        pos += 1;
        ctx.decode(&mut batch)?;
    }
    let gen_s = gen_start.elapsed().as_secs_f64();
    eprintln!(
        "llama-cpp-2 wrote: {:?}",
        String::from_utf8_lossy(&text)
            .chars()
            .take(80)
            .collect::<String>()
    );
    Ok(Figures {
        load_ms,
        prompt_tokens: n,
        prompt_tps: n as f64 / prompt_s,
        ttft_ms: first.unwrap_or_default() * 1e3,
        gen_tps: GENERATE as f64 / gen_s,
        ..Figures::default()
    })
}

#[cfg(feature = "candle")]
fn candle(model_path: &str) -> Result<Figures> {
    use candle_core::quantized::gguf_file;
    use candle_core::quantized::tokenizer::TokenizerFromGguf;
    use candle_core::{D, Device, Tensor};
    use candle_transformers::models::quantized_qwen2::ModelWeights;

    let started = Instant::now();
    let device = Device::Cpu;
    let mut file = std::fs::File::open(model_path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let tokenizer = tokenizers::Tokenizer::from_gguf(&content)?;
    let mut model = ModelWeights::from_gguf(content, &mut file, &device)?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;

    let tokens = tokenizer
        .encode(prompt(), false)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .get_ids()
        .to_vec();
    let n = tokens.len();
    let t0 = Instant::now();
    let input = Tensor::new(tokens.as_slice(), &device)?.unsqueeze(0)?;
    let logits = model.forward(&input, 0)?;
    let prompt_s = t0.elapsed().as_secs_f64();
    let mut next = logits.squeeze(0)?.argmax(D::Minus1)?.to_scalar::<u32>()?;
    let first = t0.elapsed().as_secs_f64();
    let mut out = vec![next];
    let gen_start = Instant::now();
    for i in 0..GENERATE {
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        let logits = model.forward(&input, n + i)?;
        next = logits.squeeze(0)?.argmax(D::Minus1)?.to_scalar::<u32>()?;
        out.push(next);
    }
    let gen_s = gen_start.elapsed().as_secs_f64();
    eprintln!(
        "candle wrote: {:?}",
        tokenizer
            .decode(&out, false)
            .unwrap_or_default()
            .chars()
            .take(80)
            .collect::<String>()
    );
    Ok(Figures {
        load_ms,
        prompt_tokens: n,
        prompt_tps: n as f64 / prompt_s,
        ttft_ms: first * 1e3,
        gen_tps: GENERATE as f64 / gen_s,
        ..Figures::default()
    })
}

/// Tandem's engine through its own API: the same chat (system and user message) rendered by
/// the model's template, greedy; the first token is the first text it streams.
#[cfg(feature = "tandem")]
fn tandem(model_path: &str) -> Result<Figures> {
    use tandem_model_embedded::{Embedded, EmbeddedConfig, Event, Generate};
    let text = prompt();
    let system = text
        .split("<|im_start|>system\n")
        .nth(1)
        .and_then(|s| s.split("<|im_end|>").next())
        .unwrap_or_default()
        .to_owned();
    let user = text
        .split("<|im_start|>user\n")
        .nth(1)
        .and_then(|s| s.split("<|im_end|>").next())
        .unwrap_or_default()
        .to_owned();
    let started = Instant::now();
    let engine = Embedded::load(
        std::path::Path::new(model_path),
        EmbeddedConfig {
            threads: THREADS,
            context_tokens: CTX,
            batch_tokens: 512,
        },
    )?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    rt.block_on(async {
        let t0 = Instant::now();
        let mut reply = engine.generate(Generate {
            messages: vec![("system".into(), system), ("user".into(), user)],
            max_tokens: GENERATE as u32,
            temperature: 0.0,
            seed: 1,
            stop: vec![],
        })?;
        let mut first = None;
        while let Some(event) = reply.events.recv().await {
            match event {
                Event::Text(_) => {
                    first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                }
                Event::Done {
                    prompt_tokens,
                    completion_tokens,
                    ..
                } => {
                    let first = first.unwrap_or_default();
                    let total = t0.elapsed().as_secs_f64();
                    if completion_tokens as usize != GENERATE {
                        bail!("the reply ended after {completion_tokens} tokens, not {GENERATE}");
                    }
                    return Ok(Figures {
                        load_ms,
                        prompt_tokens: prompt_tokens as usize,
                        // The first token's time is prompt reading plus one token.
                        prompt_tps: f64::from(prompt_tokens) / first,
                        ttft_ms: first * 1e3,
                        gen_tps: (completion_tokens - 1) as f64 / (total - first),
                        ..Figures::default()
                    });
                }
                Event::Failed(why) => bail!("{why}"),
            }
        }
        bail!("no reply")
    })
}

const SERVER: &str = r#"
import signal, sys, threading
import xllamacpp as xlc
p = xlc.CommonParams()
p.model.path = sys.argv[1]
p.hostnames = ["127.0.0.1"]
p.port = int(sys.argv[2])
p.n_ctx = int(sys.argv[3])
p.n_parallel = 1
p.n_batch = 512
p.n_ubatch = 512
p.cpuparams.n_threads = int(sys.argv[4])
p.cpuparams_batch.n_threads = int(sys.argv[4])
p.cache_prompt = False
p.ui = False
p.offline = True
server = xlc.Server(p)
print("ready", flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
done.wait()
"#;

/// llama.cpp's own server: load is the time to its first answer; the prompt and generation
/// rates are its own `timings`; the first token is timed here, over a streamed completion.
fn server(model: &str, python: &str) -> Result<Figures> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let started = Instant::now();
    let mut child = Command::new(python)
        .args([
            "-c",
            SERVER,
            model,
            &port.to_string(),
            &CTX.to_string(),
            &THREADS.to_string(),
        ])
        .env("OMP_WAIT_POLICY", "PASSIVE")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let pid = child.id();
    let result = (|| -> Result<Figures> {
        loop {
            if started.elapsed() > Duration::from_secs(120) {
                bail!("the server did not answer in 120 s");
            }
            if let Ok((200, _)) = http(port, "GET", "/health", "") {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let load_ms = started.elapsed().as_secs_f64() * 1e3;
        let body = serde_json::json!({
            "prompt": prompt(),
            "n_predict": GENERATE,
            "temperature": 0.0,
            "ignore_eos": true,
            "cache_prompt": false,
            "stream": true,
        })
        .to_string();
        let t0 = Instant::now();
        let mut stream = TcpStream::connect(("127.0.0.1", port))?;
        write!(
            stream,
            "POST /completion HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut first = None;
        let mut timings = None;
        for line in BufReader::new(stream).lines() {
            let line = line?;
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            let v: serde_json::Value = serde_json::from_str(data)?;
            if first.is_none() && v["content"].as_str().is_some_and(|c| !c.is_empty()) {
                first = Some(t0.elapsed().as_secs_f64());
            }
            if v["stop"].as_bool() == Some(true) {
                timings = Some(v["timings"].clone());
            }
        }
        let t = timings.context("no timings in the server's last event")?;
        Ok(Figures {
            load_ms,
            prompt_tokens: t["prompt_n"].as_u64().unwrap_or(0) as usize,
            prompt_tps: t["prompt_per_second"].as_f64().unwrap_or(0.0),
            ttft_ms: first.unwrap_or_default() * 1e3,
            gen_tps: t["predicted_per_second"].as_f64().unwrap_or(0.0),
            rss_mb: status_mb(pid, "VmRSS:"),
            peak_mb: status_mb(pid, "VmHWM:"),
        })
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

fn http(port: u16, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, text))
}
