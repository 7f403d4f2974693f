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
    /// the head it was sent.
    pub fn http_server(&self, port: u16) {
        let listener = self.listen(port);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
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
                    let line = head.lines().next().unwrap_or_default().to_owned();
                    let body = format!("seen: {line}\n{head}");
                    let _ = s
                        .write_all(
                            format!(
                                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                                body.len()
                            )
                            .as_bytes(),
                        )
                        .await;
                });
            }
        });
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
