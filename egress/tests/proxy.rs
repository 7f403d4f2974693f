//! The egress proxy against a stand-in internet: servers in a network namespace these tests
//! make, joined to the host by a veth pair, and clients that try what hostile code tries.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr, TcpListener as StdListener};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_egress::{Carried, Egress, Grant, NetSink, Policy, ProxyLimits};
use tandem_protocol::net::{NetEvent, NetVerdict};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// A network namespace standing in for the internet, at one address the host routes to.
struct Internet {
    name: String,
    addr: IpAddr,
}

static NEXT: AtomicU32 = AtomicU32::new(1);

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Internet {
    fn new() -> Internet {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}x{n}", std::process::id() % 100_000);
        let name = format!("tnd-eg-{tag}");
        let (host_if, ns_if) = (format!("teh{tag}"), format!("ten{tag}"));
        // 198.51.100.0/24 is documentation space: outside every range the proxy keeps inside.
        let base = 4 * (n % 60 + 1);
        let host_addr = format!("198.51.100.{}", base + 1);
        let ns_addr = format!("198.51.100.{}", base + 2);
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if, "netns", &name,
        ]);
        ip(&["addr", "add", &format!("{host_addr}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&[
            "-n",
            &name,
            "addr",
            "add",
            &format!("{ns_addr}/30"),
            "dev",
            &ns_if,
        ]);
        ip(&["-n", &name, "link", "set", &ns_if, "up"]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        Internet {
            name,
            addr: ns_addr.parse().expect("address"),
        }
    }

    /// A listener inside the namespace, made by a thread that enters it for the call.
    fn listen(&self, port: u16) -> TcpListener {
        let path = format!("/run/netns/{}", self.name);
        let addr = SocketAddr::new(self.addr, port);
        let std = std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).expect("open the namespace");
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            StdListener::bind(addr).expect("bind in the namespace")
        })
        .join()
        .expect("the namespace thread");
        std.set_nonblocking(true).expect("nonblocking");
        TcpListener::from_std(std).expect("tokio listener")
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// An HTTP server answering every request with the Host it was sent and the path asked.
fn http_server(listener: TcpListener) {
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    let Ok(n) = s.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                let head = String::from_utf8_lossy(&got).to_string();
                let line = head.lines().next().unwrap_or_default().to_owned();
                let body = format!("seen: {line}\n{head}");
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
}

/// A server that sends back what it reads (a tunnel's far end).
fn echo_server(listener: TcpListener) {
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
}

/// A server that sends `n` bytes to whoever connects.
fn flood_server(listener: TcpListener, n: usize) {
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let chunk = vec![b'x'; 64 * 1024];
                let mut left = n;
                while left > 0 {
                    let k = left.min(chunk.len());
                    if s.write_all(&chunk[..k]).await.is_err() {
                        return;
                    }
                    left -= k;
                }
            });
        }
    });
}

#[derive(Default)]
struct Events(Mutex<Vec<NetEvent>>);

impl NetSink for Events {
    fn record(&self, event: NetEvent) {
        self.0.lock().expect("events").push(event);
    }
}

impl Events {
    async fn wait_for(&self, n: usize) -> Vec<NetEvent> {
        for _ in 0..600 {
            let got = self.0.lock().expect("events").clone();
            if got.len() >= n {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "fewer than {n} net events: {:?}",
            self.0.lock().expect("events")
        );
    }
}

struct Proxy {
    egress: Egress,
    addr: SocketAddr,
}

async fn proxy(limits: ProxyLimits) -> Proxy {
    let egress = Egress::new(limits, tandem_egress::own_addresses());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    egress.serve(listener);
    Proxy { egress, addr }
}

impl Proxy {
    /// Grants `policy` to the sandbox at `peer` (a loopback address of its own).
    fn grant(&self, peer: &str, policy: Policy) -> (tandem_egress::PeerGrant, Arc<Events>) {
        let events = Arc::new(Events::default());
        let grant = Grant::new(
            Arc::new(policy),
            Arc::new(Carried::default()),
            events.clone(),
        );
        (
            self.egress.grant_peer(peer.parse().expect("peer"), grant),
            events,
        )
    }

    async fn connect_from(&self, peer: &str) -> TcpStream {
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new(peer.parse().expect("peer"), 0))
            .expect("bind the peer");
        socket
            .connect(self.addr)
            .await
            .expect("connect to the proxy")
    }

    /// Sends `request` from `peer` and reads the whole answer.
    async fn ask(&self, peer: &str, request: &str) -> String {
        let mut s = self.connect_from(peer).await;
        s.write_all(request.as_bytes()).await.expect("write");
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).to_string()
    }
}

fn policy(allow: &[&str], resolve: &[(&str, IpAddr)]) -> Policy {
    let mut p = Policy::parse(allow, &[] as &[&str]).expect("policy");
    for (name, addr) in resolve {
        p.resolve.insert((*name).to_owned(), vec![*addr]);
    }
    p
}

/// A TLS ClientHello record naming `name`, as a TLS client's first bytes.
fn client_hello(name: &str) -> Vec<u8> {
    let mut list = vec![0u8];
    list.extend_from_slice(&(name.len() as u16).to_be_bytes());
    list.extend_from_slice(name.as_bytes());
    let mut sni = (list.len() as u16).to_be_bytes().to_vec();
    sni.extend_from_slice(&list);
    let mut exts = vec![0, 0];
    exts.extend_from_slice(&(sni.len() as u16).to_be_bytes());
    exts.extend_from_slice(&sni);
    let mut body = vec![3, 3];
    body.extend_from_slice(&[9; 32]);
    body.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(&exts);
    let mut hs = vec![1, 0];
    hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_host_answers_through_the_proxy_and_is_recorded() {
    let net = Internet::new();
    http_server(net.listen(8080));
    let p = proxy(ProxyLimits::default()).await;
    let (_g, events) = p.grant(
        "127.0.0.2",
        policy(&["files.test:8080"], &[("files.test", net.addr)]),
    );
    let answer = p
        .ask(
            "127.0.0.2",
            "GET http://files.test:8080/hello?x=1 HTTP/1.1\r\nHost: files.test:8080\r\nProxy-Connection: keep-alive\r\n\r\n",
        )
        .await;
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.contains("seen: GET /hello?x=1 HTTP/1.1"), "{answer}");
    assert!(answer.contains("Connection: close"), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("proxy-connection"),
        "{answer}"
    );
    let got = events.wait_for(1).await;
    assert_eq!(got[0].verdict, NetVerdict::Allowed);
    assert_eq!(got[0].rule, "files.test:8080");
    assert_eq!((got[0].host.as_str(), got[0].port), ("files.test", 8080));
    assert!(got[0].bytes_out > 0 && got[0].bytes_in > 0, "{:?}", got[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_hostile_code_tries_is_refused_and_named() {
    let net = Internet::new();
    http_server(net.listen(8080));
    http_server(net.listen(9090));
    let p = proxy(ProxyLimits::default()).await;
    let proxy_port = p.addr.port();
    let mut pol = policy(
        &["files.test:8080", "inside.test:8080"],
        &[
            ("files.test", net.addr),
            ("inside.test", "127.0.0.1".parse().unwrap()),
        ],
    );
    pol.resolve
        .insert("own.test".into(), vec!["127.0.0.1".parse().unwrap()]);
    pol.deny = vec![tandem_egress::Rule::parse("files.test:9090").unwrap()];
    let (_g, events) = p.grant("127.0.0.3", pol);
    let addr = net.addr;
    let cases: Vec<(String, &str)> = vec![
        // a host no entry names
        ("GET http://other.test:8080/ HTTP/1.1\r\nHost: other.test:8080\r\n\r\n".into(), "default"),
        // the allowed host on another port (and a deny entry for it)
        ("GET http://files.test:9090/ HTTP/1.1\r\nHost: files.test:9090\r\n\r\n".into(), "files.test:9090"),
        ("GET http://files.test:7070/ HTTP/1.1\r\nHost: files.test:7070\r\n\r\n".into(), "default"),
        // its address, when only the name is allowed
        (format!("GET http://{addr}:8080/ HTTP/1.1\r\nHost: {addr}:8080\r\n\r\n"), "default"),
        // the cloud's metadata address
        ("GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n".into(), "default"),
        // an allowed name that resolves to loopback (rebinding), at the proxy's own port
        (format!("GET http://inside.test:8080/ HTTP/1.1\r\nHost: inside.test:{proxy_port}\r\n\r\n"), "host_header"),
        ("GET http://inside.test:8080/ HTTP/1.1\r\nHost: inside.test:8080\r\n\r\n".into(), "inside_address"),
        // IPv6 loopback
        ("GET http://[::1]:8080/ HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n".into(), "default"),
        // a plain request whose Host is not its target
        ("GET http://files.test:8080/ HTTP/1.1\r\nHost: other.test:8080\r\n\r\n".into(), "host_header"),
        // a CONNECT to a host no entry names
        ("CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n".into(), "default"),
    ];
    for (request, _) in &cases {
        let answer = p.ask("127.0.0.3", request).await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{request}: {answer}");
        assert!(answer.contains("X-Tandem-Rule:"), "{answer}");
    }
    let got = events.wait_for(cases.len()).await;
    for ((request, rule), event) in cases.iter().zip(&got) {
        assert_eq!(event.verdict, NetVerdict::Denied, "{request}");
        assert_eq!(&event.rule, rule, "{request}: {event:?}");
        assert_eq!((event.bytes_in, event.bytes_out), (0, 0), "{request}");
    }
    // A name that resolves to loopback is named as inside even when a CIDR would be needed.
    assert!(
        got[6]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("127.0.0.1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_carries_only_tls_that_names_the_host_it_asked_for() {
    let net = Internet::new();
    echo_server(net.listen(443));
    let p = proxy(ProxyLimits::default()).await;
    let (_g, events) = p.grant(
        "127.0.0.4",
        policy(&["files.test"], &[("files.test", net.addr)]),
    );

    // The named host: the ClientHello reaches the far end, which sends it back.
    let mut s = p.connect_from("127.0.0.4").await;
    s.write_all(b"CONNECT files.test:443 HTTP/1.1\r\nHost: files.test:443\r\n\r\n")
        .await
        .unwrap();
    let mut head = vec![0u8; 39];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200 Connection established\r\n\r\n");
    let hello = client_hello("files.test");
    s.write_all(&hello).await.unwrap();
    let mut back = vec![0u8; hello.len()];
    s.read_exact(&mut back).await.unwrap();
    assert_eq!(back, hello);
    drop(s);
    // A connection is recorded as it ends: this one first, before the next begins.
    events.wait_for(1).await;

    // Another name in the ClientHello, and bytes that are not TLS: the tunnel closes unanswered.
    for first in [
        client_hello("evil.test"),
        b"SSH-2.0-OpenSSH_9.2\r\n".to_vec(),
    ] {
        let mut s = p.connect_from("127.0.0.4").await;
        s.write_all(b"CONNECT files.test:443 HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        s.read_exact(&mut head).await.unwrap();
        s.write_all(&first).await.unwrap();
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut rest)).await;
        assert!(
            !rest
                .windows(first.len().min(8))
                .any(|w| w == &first[..first.len().min(8)])
        );
    }
    let got = events.wait_for(3).await;
    assert_eq!(got[0].verdict, NetVerdict::Allowed);
    assert_eq!(got[0].bytes_in, hello.len() as u64);
    for event in &got[1..] {
        assert_eq!(
            (event.verdict, event.rule.as_str()),
            (NetVerdict::Denied, "sni"),
            "{event:?}"
        );
        assert_eq!(event.bytes_in, 0);
    }
    assert!(
        got[1]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("evil.test")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_bytes_cuts_a_flood_and_max_connections_holds() {
    let net = Internet::new();
    flood_server(net.listen(8080), 50 * 1024 * 1024);
    http_server(net.listen(9090));
    // Held connections must outlast the asking below on a loaded machine.
    let p = proxy(ProxyLimits {
        head_timeout: Duration::from_secs(120),
        ..ProxyLimits::default()
    })
    .await;
    let mut pol = policy(
        &["files.test:8080", "files.test:9090"],
        &[("files.test", net.addr)],
    );
    pol.max_bytes = Some(1024 * 1024);
    let (_g, events) = p.grant("127.0.0.5", pol);
    let answer = p
        .ask(
            "127.0.0.5",
            "GET http://files.test:8080/ HTTP/1.1\r\nHost: files.test:8080\r\n\r\n",
        )
        .await;
    assert!(
        answer.len() < 2 * 1024 * 1024,
        "{} bytes came through",
        answer.len()
    );
    let got = events.wait_for(1).await;
    assert_eq!(
        (got[0].verdict, got[0].rule.as_str()),
        (NetVerdict::Denied, "max_bytes")
    );
    assert!(got[0].bytes_in <= 1024 * 1024);

    // Two connections held open (sending nothing) use a sandbox's two; a third is refused.
    // Another sandbox, whose byte budget the flood above did not spend.
    let mut pol = policy(&["files.test:9090"], &[("files.test", net.addr)]);
    pol.max_connections = Some(2);
    let (_g2, _events) = p.grant("127.0.0.7", pol);
    let mut held = vec![
        p.connect_from("127.0.0.7").await,
        p.connect_from("127.0.0.7").await,
    ];
    // The proxy may run an asking connection's task before a held one's (accepted first,
    // but tasks are not run in the order they were spawned), and then refuses the held one.
    // So a held connection the proxy answered is opened again before the next asking, until
    // both hold their permits and the asking is what is refused.
    let mut answer = String::new();
    for _ in 0..300 {
        for h in &mut held {
            let mut byte = [0u8; 1];
            if !matches!(h.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            {
                *h = p.connect_from("127.0.0.7").await;
            }
        }
        answer = p
            .ask(
                "127.0.0.7",
                "GET http://files.test:9090/ HTTP/1.1\r\nHost: files.test:9090\r\n\r\n",
            )
            .await;
        if answer.contains("max_connections") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("max_connections"), "{answer}");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_makes_at_most_max_block_connections_and_the_next_block_starts_again() {
    let net = Internet::new();
    http_server(net.listen(9090));
    let p = proxy(ProxyLimits::default()).await;
    let mut pol = policy(&["files.test:9090"], &[("files.test", net.addr)]);
    pol.max_block_connections = Some(2);
    let (g, events) = p.grant("127.0.0.6", pol);
    let get = "GET http://files.test:9090/ HTTP/1.1\r\nHost: files.test:9090\r\n\r\n";
    for _ in 0..2 {
        let answer = p.ask("127.0.0.6", get).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let answer = p.ask("127.0.0.6", get).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("max_block_connections"), "{answer}");
    let got = events.wait_for(3).await;
    assert_eq!(
        got.iter()
            .filter(|e| e.verdict == NetVerdict::Denied && e.rule == "max_block_connections")
            .count(),
        1,
        "{got:?}"
    );
    g.new_block();
    let answer = p.ask("127.0.0.6", get).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections_from_one_sandbox_leave_others_served() {
    let net = Internet::new();
    http_server(net.listen(8080));
    let limits = ProxyLimits {
        head_timeout: Duration::from_secs(60),
        ..ProxyLimits::default()
    };
    let p = proxy(limits).await;
    let (_a, _) = p.grant(
        "127.0.0.6",
        policy(&["files.test:8080"], &[("files.test", net.addr)]),
    );
    let (_b, events) = p.grant(
        "127.0.0.7",
        policy(&["files.test:8080"], &[("files.test", net.addr)]),
    );
    let mut held = Vec::new();
    for _ in 0..500 {
        let mut s = p.connect_from("127.0.0.6").await;
        let _ = s.write_all(b"GET http://files.test:8080/ HTT").await;
        held.push(s);
    }
    let answer = p
        .ask(
            "127.0.0.7",
            "GET http://files.test:8080/ok HTTP/1.1\r\nHost: files.test:8080\r\n\r\n",
        )
        .await;
    assert!(answer.contains("seen: GET /ok"), "{answer}");
    assert_eq!(events.wait_for(1).await[0].verdict, NetVerdict::Allowed);
    // A peer with no grant is closed without an answer.
    let answer = p
        .ask("127.0.0.8", "GET http://files.test:8080/ HTTP/1.1\r\n\r\n")
        .await;
    assert_eq!(answer, "");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_grant_ends_its_open_tunnels() {
    let net = Internet::new();
    echo_server(net.listen(443));
    let p = proxy(ProxyLimits::default()).await;
    let (g, _events) = p.grant(
        "127.0.0.9",
        policy(&["files.test"], &[("files.test", net.addr)]),
    );
    let mut s = p.connect_from("127.0.0.9").await;
    s.write_all(b"CONNECT files.test:443 HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let mut head = vec![0u8; 39];
    s.read_exact(&mut head).await.unwrap();
    let hello = client_hello("files.test");
    s.write_all(&hello).await.unwrap();
    let mut back = vec![0u8; hello.len()];
    s.read_exact(&mut back).await.unwrap();
    drop(g);
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut rest)).await;
    assert!(ended.is_ok(), "the tunnel outlived its grant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_it_cannot_read_and_a_full_proxy_are_each_a_denied_connection() {
    let limits = ProxyLimits {
        head_timeout: Duration::from_secs(2),
        max_open: 2,
        ..ProxyLimits::default()
    };
    let p = proxy(limits).await;
    let (_g, events) = p.grant("127.0.0.10", policy(&["files.test:8080"], &[]));
    // Not HTTP: a TLS record sent to the proxy as if it were the server.
    let answer = p.ask("127.0.0.10", "\u{16}\u{3}\u{1} hello\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // A head that never ends, held past the proxy's deadline.
    let mut slow = p.connect_from("127.0.0.10").await;
    slow.write_all(b"GET http://files.test:8080/ HTT")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), slow.read_to_end(&mut out)).await;
    let answer = String::from_utf8_lossy(&out).to_string();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let got = events.wait_for(2).await;
    for e in &got[..2] {
        assert_eq!((e.host.as_str(), e.port), ("", 0), "{got:?}");
        assert_eq!(
            (e.verdict, e.rule.as_str()),
            (NetVerdict::Denied, "default")
        );
        assert!(
            e.line()
                .starts_with("net: a connection denied (rule default)"),
            "{}",
            e.line()
        );
    }

    // A proxy that carries two, with time to wait for a head: of three connections whose
    // heads never end, exactly one (whichever it takes last) is refused at once, and
    // recorded with no host.
    let full = proxy(ProxyLimits {
        head_timeout: Duration::from_secs(120),
        max_open: 2,
        ..ProxyLimits::default()
    })
    .await;
    let (_g2, events) = full.grant("127.0.0.13", policy(&["files.test:8080"], &[]));
    let mut conns = Vec::new();
    for _ in 0..3 {
        let mut s = full.connect_from("127.0.0.13").await;
        s.write_all(b"GET http://files.test:8080/ HTT")
            .await
            .unwrap();
        conns.push(s);
    }
    let got = events.wait_for(1).await;
    assert_eq!(
        (got[0].host.as_str(), got[0].verdict, got[0].rule.as_str()),
        ("", NetVerdict::Denied, "max_open"),
        "{got:?}"
    );
    // Recorded once answered: the refused one has its 503 to read now, the others nothing.
    let mut answered = Vec::new();
    for s in &mut conns {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await;
        answered.push(matches!(read, Ok(Ok(n)) if buf[..n].starts_with(b"HTTP/1.1 503")));
    }
    assert_eq!(answered.iter().filter(|a| **a).count(), 1, "{answered:?}");
    assert_eq!(events.0.lock().expect("events").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deny_entry_wins_over_the_package_index() {
    let net = Internet::new();
    http_server(net.listen(80));
    let cache = tempfile::tempdir().unwrap();
    let index = tandem_egress::Packages::new(
        tandem_egress::IndexUrl::parse("http://pypi.test/simple/").unwrap(),
        cache.path().to_owned(),
        1 << 20,
        vec![net.addr],
    )
    .unwrap();
    let egress = Egress::with(
        ProxyLimits::default(),
        tandem_egress::own_addresses(),
        tandem_egress::Extras {
            packages: vec![Arc::new(index)],
            broker: None,
        },
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    egress.serve(listener);
    let p = Proxy { egress, addr };
    let get = "GET http://pypi.test/simple/tandembig/ HTTP/1.1\r\nHost: pypi.test\r\n\r\n";
    // With no entry at all, the index is reached: the cache asks it.
    let (_open, _) = p.grant("127.0.0.11", policy(&[], &[]));
    let answer = p.ask("127.0.0.11", get).await;
    assert!(!answer.contains("X-Tandem-Rule"), "{answer}");
    // Denied by name, it is not, and the refusal names the entry.
    let denying = Policy::parse(&[] as &[&str], &["pypi.test"]).unwrap();
    let (_denied, events) = p.grant("127.0.0.12", denying);
    let answer = p.ask("127.0.0.12", get).await;
    assert!(
        answer.starts_with("HTTP/1.1 403") && answer.contains("X-Tandem-Rule: pypi.test"),
        "{answer}"
    );
    let got = events.wait_for(1).await;
    assert_eq!(
        (got[0].host.as_str(), got[0].verdict, got[0].rule.as_str()),
        ("pypi.test", NetVerdict::Denied, "pypi.test")
    );
}
