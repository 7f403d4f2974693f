//! A stand-in internet for network tests: a network namespace these tests make, joined to the
//! host by a veth pair, at an address outside every range the egress proxy keeps inside.
//! Servers listen in it; nothing reaches past this machine.

use std::net::{IpAddr, SocketAddr, TcpListener as StdListener};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A network namespace standing in for the internet; removed when dropped.
pub struct Internet {
    name: String,
    /// The address its servers listen on, routed from the host.
    pub addr: IpAddr,
}

static NEXT: AtomicU32 = AtomicU32::new(1);

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("network tests need `ip` (iproute2) and root: {e}"));
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Internet {
    /// Makes the namespace and its link; panics (a failure, not a skip) without root.
    pub fn new() -> Internet {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}y{n}", std::process::id() % 100_000);
        let name = format!("tnd-net-{tag}");
        let (host_if, ns_if) = (format!("tnh{tag}"), format!("tnn{tag}"));
        // 203.0.113.0/24 is documentation space: no real host answers there.
        let base = 4 * (n % 60 + 1);
        let host_addr = format!("203.0.113.{}", base + 1);
        let ns_addr = format!("203.0.113.{}", base + 2);
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
            addr: ns_addr.parse().unwrap_or(IpAddr::from([203, 0, 113, 2])),
        }
    }

    /// A listener inside the namespace, made by a thread that enters it for the call.
    pub fn listen(&self, port: u16) -> TcpListener {
        let path = format!("/run/netns/{}", self.name);
        let addr = SocketAddr::new(self.addr, port);
        let listener = std::thread::spawn(move || -> std::io::Result<StdListener> {
            let ns = std::fs::File::open(&path)?;
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(std::io::Error::from)?;
            let listener = StdListener::bind(addr)?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        })
        .join()
        .unwrap_or_else(|_| panic!("the namespace thread panicked"))
        .unwrap_or_else(|e| panic!("listening in {}: {e}", self.name));
        TcpListener::from_std(listener).unwrap_or_else(|e| panic!("tokio listener: {e}"))
    }

    /// An HTTP server on `port` that answers every request with `seen: <request line>` and
    /// the head it was sent (a path `/redirect-to/HOST` answers 302 to `http://HOST/`);
    /// answers the heads it was sent, in order.
    pub fn http_server(&self, port: u16) -> Seen {
        let seen = Seen::default();
        let listener = self.listen(port);
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(echo_http(s, log.clone()));
            }
        });
        seen
    }

    /// The same server over TLS, its certificate for `names` signed by a CA made here:
    /// answers the CA's PEM (for the daemon's `upstream_ca`) and the heads it was sent.
    pub fn https_server(&self, port: u16, names: &[&str]) -> (String, Seen) {
        let (ca, acceptor) = tls_for(names);
        let seen = Seen::default();
        let listener = self.listen(port);
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let log = log.clone();
                tokio::spawn(async move {
                    if let Ok(s) = acceptor.accept(s).await {
                        echo_http(s, log).await;
                    }
                });
            }
        });
        (ca, seen)
    }

    /// A static file server on `port` for the files under `root` (a directory's
    /// `index.html` for a path ending in `/`); answers the request lines it was sent, in
    /// order.
    pub fn file_server(
        &self,
        port: u16,
        root: std::path::PathBuf,
    ) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let listener = self.listen(port);
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(serve_file(s, root.clone(), log.clone()));
            }
        });
        seen
    }

    /// The same file server over TLS, its certificate for `names` from a CA made here:
    /// answers the CA's PEM and the request lines.
    pub fn https_file_server(
        &self,
        port: u16,
        root: std::path::PathBuf,
        names: &[&str],
    ) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        let (ca, acceptor) = tls_for(names);
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let listener = self.listen(port);
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let (root, log) = (root.clone(), log.clone());
                tokio::spawn(async move {
                    if let Ok(s) = acceptor.accept(s).await {
                        serve_file(s, root, log).await;
                    }
                });
            }
        });
        (ca, seen)
    }

    /// A TCP server on `port` that sends back what it reads.
    pub fn echo_server(&self, port: u16) {
        let listener = self.listen(port);
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
    }
}

/// A TLS acceptor with a certificate for `names`, signed by a CA made here: answers the
/// CA's PEM and the acceptor.
fn tls_for(names: &[&str]) -> (String, tokio_rustls::TlsAcceptor) {
    let tls = |e: &dyn std::fmt::Display| -> ! { panic!("the test server's TLS: {e}") };
    let ca_key = rcgen::KeyPair::generate().unwrap_or_else(|e| tls(&e));
    let mut ca = rcgen::CertificateParams::default();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "stand-in internet CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap_or_else(|e| tls(&e));
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap_or_else(|e| tls(&e));
    let leaf =
        rcgen::CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .unwrap_or_else(|e| tls(&e))
            .signed_by(&key, &issuer)
            .unwrap_or_else(|e| tls(&e));
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap_or_else(|e| tls(&e))
    .with_no_client_auth()
    .with_single_cert(
        vec![leaf.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
    .unwrap_or_else(|e| tls(&e));
    (
        ca_cert.pem(),
        tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)),
    )
}

/// The request heads a server was sent, in order.
#[derive(Clone, Default)]
pub struct Seen(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Seen {
    /// Every head so far.
    pub fn heads(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Answers one request for a file under `root`, logging its request line.
async fn serve_file<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
    root: std::path::PathBuf,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    let mut buf = vec![0u8; 8192];
    let mut got = Vec::new();
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&got).to_string();
    let line = head.lines().next().unwrap_or_default().to_owned();
    log.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(line.clone());
    let path = line.split(' ').nth(1).unwrap_or("/");
    let path = path.split(['?', '#']).next().unwrap_or("/");
    let mut file = root.join(path.trim_start_matches('/'));
    if path.ends_with('/') {
        file = file.join("index.html");
    }
    let (status, body) = if path.contains("..") {
        ("404 Not Found", Vec::new())
    } else {
        match std::fs::read(&file) {
            Ok(body) => ("200 OK", body),
            Err(_) => ("404 Not Found", Vec::new()),
        }
    };
    let kind = if file.extension().is_some_and(|e| e == "html") {
        "text/html"
    } else {
        "application/octet-stream"
    };
    let _ = s
        .write_all(
            format!(
                "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        )
        .await;
    let _ = s.write_all(&body).await;
    let _ = s.shutdown().await;
}

/// Reads one request head and answers it with itself (or a redirect it asks for).
async fn echo_http<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut s: S, log: Seen) {
    let mut buf = vec![0u8; 8192];
    let mut got = Vec::new();
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&got).to_string();
    log.0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(head.clone());
    let line = head.lines().next().unwrap_or_default().to_owned();
    let path = line.split(' ').nth(1).unwrap_or("/");
    let answer = match path.strip_prefix("/redirect-to/") {
        Some(host) => format!(
            "HTTP/1.1 302 Found\r\nLocation: http://{host}/\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
        None => {
            let body = format!("seen: {line}\n{head}");
            format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
        }
    };
    let _ = s.write_all(answer.as_bytes()).await;
    let _ = s.shutdown().await;
}

impl Default for Internet {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
