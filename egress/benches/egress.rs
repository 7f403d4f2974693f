//! The egress proxy's cost, each figure against a baseline measured in the same run:
//!
//! 1. A 100 MB download through the proxy (a sandbox's Unix socket, as a sandbox reaches it)
//!    vs the same download straight from the server over loopback: throughput and the ratio.
//! 2. Connection setup: time to the first byte of a tiny answer through the proxy vs direct,
//!    p50 and p95 over 400 connections each, alternated.
//! 3. CPU seconds of this process per GB carried, through the proxy minus direct: the
//!    proxy's own share.
//! 4. `pip download` of a 5 MB wheel through the package cache, cold (empty cache) vs
//!    cached, from an index on loopback and from one that answers as a distant one would
//!    (40 ms before each answer, 20 MB/s).
//! 5. From inside a Docker container (`tandem exec -e docker`, the binary at `TANDEM_BIN`):
//!    a 100 MB download and 200 small requests from this process's server, over Docker's
//!    open bridge (`network = true`) vs behind the proxy (`--allow-host`, the runner's relay
//!    included), alternated.
//!
//! `cargo bench -p tandem-egress --bench egress` (section 5 needs `TANDEM_BIN` and Docker)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_egress::{
    Carried, Egress, Extras, Grant, IndexUrl, NetSink, Packages, Policy, ProxyLimits,
};
use tandem_protocol::net::NetEvent;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};

struct Quiet;
impl NetSink for Quiet {
    fn record(&self, _: NetEvent) {}
}

const BIG: u64 = 100 * 1024 * 1024;

/// A server answering `GET /big` with BIG bytes and anything else with 2 bytes.
async fn server() -> SocketAddr {
    server_on("127.0.0.1:0").await
}

async fn server_on(at: &str) -> SocketAddr {
    let listener = TcpListener::bind(at).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = s.set_nodelay(true);
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let big = got.starts_with(b"GET /big") || got.windows(5).any(|w| w == b"/big ");
                let len = if big { BIG } else { 2 };
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
                        )
                        .as_bytes(),
                    )
                    .await;
                let chunk = vec![7u8; 256 * 1024];
                let mut left = len;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if s.write_all(&chunk[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            });
        }
    });
    addr
}

/// Sends `head` and reads the whole answer: answers bytes read and the time to the first.
async fn fetch<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
    head: &[u8],
    started: Instant,
) -> (u64, Duration) {
    s.write_all(head).await.unwrap();
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    let mut first = None;
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        first.get_or_insert_with(|| started.elapsed());
        total += n as u64;
    }
    (total, first.unwrap_or_default())
}

fn cpu() -> Duration {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).unwrap();
    let tv = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    tv(usage.user_time()) + tv(usage.system_time())
}

fn pct(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let origin = server().await;
    let policy =
        Policy::parse::<String, &str>(&[format!("127.0.0.1/32:{}", origin.port())], &[]).unwrap();
    let egress = Egress::new(ProxyLimits::default(), tandem_egress::own_addresses());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("proxy.sock");
    let _grant = egress
        .listen_unix(
            &socket,
            Grant::new(
                Arc::new(policy),
                Arc::new(Carried::default()),
                Arc::new(Quiet),
            ),
        )
        .unwrap();
    let big_direct = b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    let big_proxied = format!(
        "GET http://127.0.0.1:{}/big HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n\r\n",
        origin.port(),
        origin.port()
    )
    .into_bytes();
    let small_direct = b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    let small_proxied = format!(
        "GET http://127.0.0.1:{}/s HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n\r\n",
        origin.port(),
        origin.port()
    )
    .into_bytes();

    // 1 and 3: throughput, and CPU per GB.
    let rounds = 5;
    let (mut direct_t, mut proxied_t) = (Duration::ZERO, Duration::ZERO);
    let (mut direct_cpu, mut proxied_cpu) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let (c0, t0) = (cpu(), Instant::now());
        let (n, _) = fetch(TcpStream::connect(origin).await.unwrap(), &big_direct, t0).await;
        assert!(n > BIG);
        direct_t += t0.elapsed();
        direct_cpu += cpu() - c0;
        let (c0, t0) = (cpu(), Instant::now());
        let (n, _) = fetch(
            UnixStream::connect(&socket).await.unwrap(),
            &big_proxied,
            t0,
        )
        .await;
        assert!(n > BIG, "the proxy carried {n} bytes");
        proxied_t += t0.elapsed();
        proxied_cpu += cpu() - c0;
    }
    let gb = (BIG * rounds) as f64 / 1e9;
    let mbs = |t: Duration| (BIG * rounds) as f64 / 1e6 / t.as_secs_f64();
    println!("| figure | direct (loopback) | through the proxy | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| 100 MB download, throughput ({rounds} rounds) | {:.0} MB/s | {:.0} MB/s | {:.2} |",
        mbs(direct_t),
        mbs(proxied_t),
        mbs(proxied_t) / mbs(direct_t)
    );
    println!(
        "| CPU of this process per GB | {:.3} s | {:.3} s | proxy's share {:.3} s/GB |",
        direct_cpu.as_secs_f64() / gb,
        proxied_cpu.as_secs_f64() / gb,
        (proxied_cpu.as_secs_f64() - direct_cpu.as_secs_f64()).max(0.0) / gb
    );

    // 2: connection setup, alternated.
    let (mut d, mut p) = (Vec::new(), Vec::new());
    for _ in 0..400 {
        let t0 = Instant::now();
        let (_, first) = fetch(TcpStream::connect(origin).await.unwrap(), &small_direct, t0).await;
        d.push(first);
        let t0 = Instant::now();
        let (_, first) = fetch(
            UnixStream::connect(&socket).await.unwrap(),
            &small_proxied,
            t0,
        )
        .await;
        p.push(first);
    }
    for (name, q) in [("p50", 0.5), ("p95", 0.95)] {
        let (a, b) = (pct(d.clone(), q), pct(p.clone(), q));
        println!(
            "| connection to first byte, {name} (400 each) | {:.3} ms | {:.3} ms | +{:.3} ms |",
            ms(a),
            ms(b),
            ms(b) - ms(a)
        );
    }

    // 4: pip through the cache.
    if std::process::Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
    {
        let index = tempfile::tempdir().unwrap();
        build_wheel(index.path());
        for (label, delay, rate) in [
            ("loopback index", Duration::ZERO, None),
            (
                "distant index (40 ms, 20 MB/s)",
                Duration::from_millis(40),
                Some(20_000_000u64),
            ),
        ] {
            let addr = file_server(index.path().to_owned(), delay, rate).await;
            let (cold, cached) = pip_rounds(addr).await;
            println!(
                "| pip download of a 5 MB wheel, {label}, median of 5 | cold {:.0} ms | cached {:.0} ms | {:.2}x faster cached |",
                ms(cold),
                ms(cached),
                cold.as_secs_f64() / cached.as_secs_f64()
            );
        }
    } else {
        println!("| pip download | not measured: this machine has no `python3 -m pip` | | |");
    }

    docker_rounds().await;
}

/// Section 5: a Docker container's downloads over the open bridge and behind the proxy.
async fn docker_rounds() {
    let Some(bin) = std::env::var_os("TANDEM_BIN") else {
        println!(
            "| from a Docker container | not measured: set TANDEM_BIN to a tandem binary | | |"
        );
        return;
    };
    // The bridge's gateway, as the engine says it, else docker0's own address (an engine
    // that leaves the gateway out of its answer).
    let said = |program: &str, args: &[&str]| {
        std::process::Command::new(program)
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .filter(|g| !g.is_empty())
    };
    let gateway = said(
        "docker",
        &[
            "network",
            "inspect",
            "bridge",
            "-f",
            "{{range .IPAM.Config}}{{.Gateway}}{{end}}",
        ],
    )
    .or_else(|| {
        said("ip", &["-4", "-o", "addr", "show", "docker0"]).and_then(|line| {
            let at = line
                .split_whitespace()
                .skip_while(|w| *w != "inet")
                .nth(1)?;
            Some(at.split('/').next()?.to_owned())
        })
    });
    let Some(gateway) = gateway else {
        println!("| from a Docker container | not measured: no Docker bridge network | | |");
        return;
    };
    let origin = server_on("0.0.0.0:0").await;
    let port = origin.port();
    let dir = tempfile::tempdir().unwrap();
    let bridge = dir.path().join("bridge.toml");
    std::fs::write(&bridge, "[executors.docker]\nnetwork = true\n").unwrap();
    let proxied = dir.path().join("proxy.toml");
    std::fs::write(&proxied, "").unwrap();
    let script = |host: &str| {
        format!(
            r#"import os, time, urllib.request
for n in ("NO_PROXY", "no_proxy"):
    os.environ.pop(n, None)
best = 0
for _ in range(3):
    t = time.perf_counter()
    r = urllib.request.urlopen("http://{host}:{port}/big", timeout=120)
    n = 0
    while True:
        b = r.read(1 << 20)
        if not b:
            break
        n += len(b)
    best = max(best, n / 1e6 / (time.perf_counter() - t))
took = []
for _ in range(200):
    t = time.perf_counter()
    urllib.request.urlopen("http://{host}:{port}/s", timeout=30).read()
    took.append((time.perf_counter() - t) * 1000)
took.sort()
print("MBS", best, "P50", took[100], "P95", took[190])
"#
        )
    };
    let run = |executor: &'static str,
               config: std::path::PathBuf,
               code: String,
               allow: Option<String>| {
        let bin = bin.clone();
        async move {
            let file = tempfile::Builder::new().suffix(".py").tempfile().unwrap();
            std::fs::write(file.path(), code).unwrap();
            let mut cmd = tokio::process::Command::new(&bin);
            cmd.args(["exec", "-e", executor, "--timeout", "600", "--config"])
                .arg(&config)
                .arg(file.path());
            if let Some(allow) = allow {
                cmd.args(["--allow-host", &allow]);
            }
            let out = cmd.output().await.unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let nums: Vec<f64> = text
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            assert!(
                nums.len() == 3,
                "tandem exec answered: {text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            (nums[0], nums[1], nums[2])
        }
    };
    // The local executor's own network (unconfined, the machine's loopback) against its
    // confined session behind the proxy.
    let open_local = dir.path().join("local.toml");
    std::fs::write(
        &open_local,
        "[executors.local]\nconfine = \"off\"\nnetwork = true\n",
    )
    .unwrap();
    let (mut open, mut behind) = (Vec::new(), Vec::new());
    let (mut local_open, mut local_behind) = (Vec::new(), Vec::new());
    let allow = Some(format!("127.0.0.1/32:{port}"));
    for _ in 0..2 {
        open.push(run("docker", bridge.clone(), script(&gateway), None).await);
        behind.push(
            run(
                "docker",
                proxied.clone(),
                script("127.0.0.1"),
                allow.clone(),
            )
            .await,
        );
        local_open.push(run("local", open_local.clone(), script("127.0.0.1"), None).await);
        local_behind.push(run("local", proxied.clone(), script("127.0.0.1"), allow.clone()).await);
    }
    side_by_side(
        "from a Docker container (`tandem exec`, best of 2 runs of 3)",
        "open bridge",
        &open,
        &behind,
    );
    side_by_side(
        "from a local block (`tandem exec -e local`, best of 2 runs of 3)",
        "unconfined, the machine's loopback",
        &local_open,
        &local_behind,
    );
}

/// One table of runs (MB/s, p50 ms, p95 ms) without the proxy against runs behind it: the
/// best throughput and the lowest latencies of each.
fn side_by_side(title: &str, without: &str, open: &[(f64, f64, f64)], behind: &[(f64, f64, f64)]) {
    let best = |v: &[(f64, f64, f64)]| v.iter().map(|r| r.0).fold(0.0, f64::max);
    let low = |v: &[(f64, f64, f64)], f: fn(&(f64, f64, f64)) -> f64| {
        v.iter().map(f).fold(f64::MAX, f64::min)
    };
    println!();
    println!("| {title} | {without} | behind the proxy | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| 100 MB download, throughput | {:.0} MB/s | {:.0} MB/s | {:.2} |",
        best(open),
        best(behind),
        best(behind) / best(open)
    );
    for (name, f) in [
        (
            "p50",
            (|r: &(f64, f64, f64)| r.1) as fn(&(f64, f64, f64)) -> f64,
        ),
        ("p95", |r: &(f64, f64, f64)| r.2),
    ] {
        let (a, b) = (low(open, f), low(behind, f));
        println!(
            "| a small request, connection to answer, {name} (200 each) | {a:.2} ms | {b:.2} ms | +{:.2} ms |",
            b - a
        );
    }
}

/// pip downloads through a proxy on TCP (pip speaks to a proxy over TCP), five times with
/// an empty cache and five with it filled: the medians.
async fn pip_rounds(index: SocketAddr) -> (Duration, Duration) {
    let mut cold = Vec::new();
    let mut cached = Vec::new();
    let url = format!("http://{index}/simple/");
    let resolve: Vec<IpAddr> = vec![index.ip()];
    for round in 0..10 {
        let fresh = round < 5;
        let cache = tempfile::tempdir().unwrap();
        let cache_path = if fresh {
            cache.path().to_owned()
        } else {
            std::env::temp_dir().join(format!("tandem-bench-cache-{}", std::process::id()))
        };
        if !fresh && round == 5 {
            let _ = std::fs::remove_dir_all(&cache_path);
        }
        let packages = Arc::new(
            Packages::new(
                IndexUrl::parse(&url).unwrap(),
                cache_path.clone(),
                1 << 30,
                resolve.clone(),
            )
            .unwrap(),
        );
        let egress = Egress::with(
            ProxyLimits::default(),
            Vec::new(),
            Extras {
                packages: vec![packages],
                broker: None,
            },
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = listener.local_addr().unwrap();
        let _served = egress.serve(listener);
        let _peer = egress.grant_peer(
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            Grant::new(
                Arc::new(Policy::parse::<&str, &str>(&[], &[]).unwrap()),
                Arc::new(Carried::default()),
                Arc::new(Quiet),
            ),
        );
        if round == 5 {
            // Fill the cache once; the timed rounds after it read from it.
            pip(proxy, &url).await;
        }
        let t = pip(proxy, &url).await;
        if fresh {
            cold.push(t);
        } else {
            cached.push(t);
        }
        egress.stop();
    }
    (pct(cold, 0.5), pct(cached, 0.5))
}

async fn pip(proxy: SocketAddr, url: &str) -> Duration {
    let out = tempfile::tempdir().unwrap();
    let host = url
        .trim_start_matches("http://")
        .split(['/', ':'])
        .next()
        .unwrap()
        .to_owned();
    let t0 = Instant::now();
    let status = tokio::process::Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(out.path())
        .args(["--index-url", url, "--trusted-host", &host, "tandembig"])
        .env("HTTP_PROXY", format!("http://{proxy}"))
        .env("http_proxy", format!("http://{proxy}"))
        .env("NO_PROXY", "")
        .env("no_proxy", "")
        .status()
        .await
        .unwrap();
    let took = t0.elapsed();
    assert!(status.success(), "pip download through the proxy failed");
    took
}

/// A 5 MB wheel (incompressible bytes) and its index page.
fn build_wheel(root: &Path) {
    const SCRIPT: &str = r#"
import hashlib, os, sys, zipfile
root = sys.argv[1]
name, version = "tandembig", "1.0"
dist = f"{name}-{version}.dist-info"
wheel = f"{name}-{version}-py3-none-any.whl"
os.makedirs(os.path.join(root, "packages"), exist_ok=True)
os.makedirs(os.path.join(root, "simple", name), exist_ok=True)
path = os.path.join(root, "packages", wheel)
with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
    z.writestr(f"{name}/__init__.py", "")
    z.writestr(f"{name}/blob.bin", os.urandom(5 * 1024 * 1024))
    z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{dist}/RECORD", "")
sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
open(os.path.join(root, "simple", name, "index.html"), "w").write(
    f'<a href="../../packages/{wheel}#sha256={sha}">{wheel}</a>\n')
"#;
    let ok = std::process::Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(root)
        .status()
        .unwrap()
        .success();
    assert!(ok, "building the wheel");
}

/// Serves files under `root`, waiting `delay` before each answer and sending at `rate`
/// bytes a second when given.
async fn file_server(root: std::path::PathBuf, delay: Duration, rate: Option<u64>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let root = root.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&got).to_string();
                let path = head.split(' ').nth(1).unwrap_or("/").to_owned();
                let mut file = root.join(path.trim_start_matches('/'));
                if path.ends_with('/') {
                    file = file.join("index.html");
                }
                tokio::time::sleep(delay).await;
                let body = std::fs::read(&file).unwrap_or_default();
                let kind = if path.ends_with('/') {
                    "text/html"
                } else {
                    "application/octet-stream"
                };
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
                let step = 64 * 1024;
                for chunk in body.chunks(step) {
                    if s.write_all(chunk).await.is_err() {
                        return;
                    }
                    if let Some(rate) = rate {
                        tokio::time::sleep(Duration::from_secs_f64(
                            chunk.len() as f64 / rate as f64,
                        ))
                        .await;
                    }
                }
            });
        }
    });
    addr
}
