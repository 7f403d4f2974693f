//! The proxy itself: each connection is one request (a `CONNECT` tunnel or a plain HTTP
//! request), decided by its sandbox's grant, carried with its bytes counted, and recorded.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tandem_protocol::net::{NetEvent, NetVerdict};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::broker::{Broker, Scrub};
use crate::packages::Packages;
use crate::policy::{Denial, Policy, Route};
use crate::rule::{HostAsked, normalize_host};
use crate::sni::{self, Hello};
use crate::splice::Socket;

pub(crate) use tandem_executor::BoxFuture;

/// The longest request head the proxy reads.
const MAX_HEAD: usize = 64 * 1024;
/// Headers a request head may have.
const MAX_HEADERS: usize = 100;
/// Connections a sandbox holds at once when its policy sets no `max_connections`.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 64;

/// Where the proxy's records go: the task's events, in the daemon.
pub trait NetSink: Send + Sync {
    /// One connection is over (or was refused).
    fn record(&self, event: NetEvent);

    /// A connection was accepted; [`NetSink::finished`] follows once it is over, after its
    /// record when it has one.
    fn started(&self) {}

    /// A connection [`NetSink::started`] told of is over.
    fn finished(&self) {}
}

/// Tells the sink a connection is over however it ends.
struct Live<'a>(&'a dyn NetSink);

impl Drop for Live<'_> {
    fn drop(&mut self) {
        self.0.finished();
    }
}

/// The proxy's own bounds, the same for every sandbox.
#[derive(Clone, Debug)]
pub struct ProxyLimits {
    /// Time a client has to send its whole request head (or a tunnel its ClientHello).
    pub head_timeout: Duration,
    /// Time to resolve a name and connect to it.
    pub connect_timeout: Duration,
    /// A connection that carries nothing either way for this long is closed.
    pub idle_timeout: Duration,
    /// Connections the proxy holds at once, from every sandbox together.
    pub max_open: usize,
}

impl Default for ProxyLimits {
    fn default() -> Self {
        ProxyLimits {
            head_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_open: 4096,
        }
    }
}

/// Bytes carried for one task, over all its sandboxes and connections.
#[derive(Debug, Default)]
pub struct Carried(AtomicU64);

impl Carried {
    /// Bytes carried so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What one sandbox may do through the proxy.
pub struct Grant {
    policy: Arc<Policy>,
    open: Arc<Semaphore>,
    /// Connections the running block has made.
    block: std::sync::atomic::AtomicU32,
    carried: Arc<Carried>,
    sink: Arc<dyn NetSink>,
    stop: CancellationToken,
    /// Stops the catcher of the sandbox's network now watched, when a later one (its
    /// network made again) takes its place.
    catcher: std::sync::Mutex<Option<CancellationToken>>,
}

impl Grant {
    /// A grant of `policy`, counting bytes into `carried` and recording into `sink`.
    pub fn new(policy: Arc<Policy>, carried: Arc<Carried>, sink: Arc<dyn NetSink>) -> Grant {
        let max = policy.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS);
        Grant {
            open: Arc::new(Semaphore::new(usize::try_from(max).unwrap_or(usize::MAX))),
            block: std::sync::atomic::AtomicU32::new(0),
            policy,
            carried,
            sink,
            stop: CancellationToken::new(),
            catcher: std::sync::Mutex::new(None),
        }
    }

    /// A stop for a new catcher of this grant's sandbox, which stops the one before.
    pub(crate) fn new_catcher(&self) -> CancellationToken {
        let stop = CancellationToken::new();
        let mut slot = self
            .catcher
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(old) = slot.replace(stop.clone()) {
            old.cancel();
        }
        stop
    }

    /// The policy this grant carries out.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// A new block starts: its connections are counted from none.
    pub fn new_block(&self) {
        self.block.store(0, Ordering::Relaxed);
    }
}

/// The egress proxy: one per daemon, listening where sandboxes can reach it.
#[derive(Clone)]
pub struct Egress {
    inner: Arc<Inner>,
}

struct Inner {
    by_peer: Mutex<HashMap<IpAddr, Arc<Grant>>>,
    /// Where each sandbox's own socket gets a directory.
    sockets: std::path::PathBuf,
    own: Vec<IpAddr>,
    limits: ProxyLimits,
    open: Arc<Semaphore>,
    stop: CancellationToken,
    packages: Vec<Arc<Packages>>,
    broker: Option<Arc<Broker>>,
}

/// What a proxy serves beyond carrying connections.
#[derive(Default, Clone)]
pub struct Extras {
    /// The operator's package indexes (Python's, npm's), each read through a cache.
    pub packages: Vec<Arc<Packages>>,
    /// Headers added for hosts, and the CA that brokered HTTPS needs.
    pub broker: Option<Arc<Broker>>,
}

/// While held, connections from one peer address are served under its grant; dropped, they
/// are refused and the peer's open connections end.
pub struct PeerGrant {
    inner: Arc<Inner>,
    peer: IpAddr,
    grant: Arc<Grant>,
}

impl PeerGrant {
    /// A new block starts in the sandbox: its connections are counted from none.
    pub fn new_block(&self) {
        self.grant.new_block();
    }
}

impl Drop for PeerGrant {
    fn drop(&mut self) {
        let mut map = self
            .inner
            .by_peer
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if map
            .get(&self.peer)
            .is_some_and(|g| Arc::ptr_eq(g, &self.grant))
        {
            map.remove(&self.peer);
        }
        self.grant.stop.cancel();
    }
}

impl Egress {
    /// A proxy with `limits`, refusing every address of this machine (`own`) to names.
    pub fn new(limits: ProxyLimits, own: Vec<IpAddr>) -> Egress {
        Egress::with(limits, own, Extras::default())
    }

    /// A proxy as [`Egress::new`] makes one, that also serves `extras`.
    pub fn with(limits: ProxyLimits, own: Vec<IpAddr>, extras: Extras) -> Egress {
        if let Some(broker) = &extras.broker {
            for packages in &extras.packages {
                packages.set_tls(broker.upstream());
            }
        }
        Egress {
            inner: Arc::new(Inner {
                by_peer: Mutex::new(HashMap::new()),
                sockets: std::env::temp_dir().join(format!("tandem-egress-{}", std::process::id())),
                open: Arc::new(Semaphore::new(limits.max_open)),
                own,
                limits,
                stop: CancellationToken::new(),
                packages: extras.packages,
                broker: extras.broker,
            }),
        }
    }

    /// The package caches, one for each index the operator named.
    pub fn packages(&self) -> &[Arc<Packages>] {
        &self.inner.packages
    }

    /// The broker of secrets, when the operator set any.
    pub fn broker(&self) -> Option<&Arc<Broker>> {
        self.inner.broker.as_ref()
    }

    /// What a sandbox behind this proxy is given in its environment beyond the proxy's
    /// address (its package index).
    pub fn sandbox_env(&self) -> Vec<(String, String)> {
        self.inner.packages.iter().flat_map(|p| p.env()).collect()
    }

    /// Serves connections from sandboxes known by their address on `listener`, until stopped.
    pub fn serve(&self, listener: TcpListener) -> tokio::task::JoinHandle<()> {
        let inner = self.inner.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = inner.stop.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let (stream, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(error) => {
                        // Out of descriptors: wait instead of spinning on the error.
                        tracing::warn!(%error, "egress proxy: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let grant = inner
                    .by_peer
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&crate::rule::canonical(peer.ip()))
                    .cloned();
                let Some(grant) = grant else {
                    tracing::debug!(%peer, "egress proxy: a peer with no grant");
                    continue;
                };
                let inner = inner.clone();
                tokio::spawn(async move { inner.connection(stream, grant).await });
            }
        })
    }

    /// Serves connections from the peer at `peer` under `grant` while the guard lives.
    pub fn grant_peer(&self, peer: IpAddr, grant: Grant) -> PeerGrant {
        let grant = Arc::new(grant);
        let peer = crate::rule::canonical(peer);
        self.inner
            .by_peer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(peer, grant.clone());
        PeerGrant {
            inner: self.inner.clone(),
            peer,
            grant,
        }
    }

    /// The directory under which each sandbox's socket gets a directory of its own.
    pub fn socket_dir(&self) -> &std::path::Path {
        &self.inner.sockets
    }

    /// Ends every connection and stops every listener.
    pub fn stop(&self) {
        self.inner.stop.cancel();
    }
}

/// How one connection went, for its record.
struct Outcome {
    host: String,
    port: u16,
    result: Result<String, Denial>,
    bytes_out: u64,
    bytes_in: u64,
    /// The client was already answered (a tunnel's 200): a refusal is a close, not a 403.
    answered: bool,
    /// A secret's header was added.
    brokered: bool,
}

impl Inner {
    async fn connection<S>(&self, mut client: S, grant: Arc<Grant>)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + Socket,
    {
        let started = Instant::now();
        grant.sink.started();
        let _live = Live(&*grant.sink);
        let Ok(_all) = self.open.clone().try_acquire_owned() else {
            let _ = client
                .write_all(&refusal(503, "the egress proxy is full"))
                .await;
            grant.sink.record(unread(
                Denial::check(
                    "max_open",
                    format!(
                        "the egress proxy already carries {} connections for all sandboxes",
                        self.limits.max_open
                    ),
                ),
                started,
            ));
            return;
        };
        let Ok(_mine) = grant.open.clone().try_acquire_owned() else {
            let denial = Denial::check(
                "max_connections",
                format!(
                    "this sandbox already holds {} connections",
                    grant
                        .policy
                        .max_connections
                        .unwrap_or(DEFAULT_MAX_CONNECTIONS)
                ),
            );
            refuse_unasked(&mut client, &grant, denial, started).await;
            return;
        };
        if let Some(max) = grant.policy.max_block_connections
            && grant.block.fetch_add(1, Ordering::Relaxed) >= max
        {
            let denial = Denial::check(
                "max_block_connections",
                format!("this block already made {max} connections, as many as one block may"),
            );
            refuse_unasked(&mut client, &grant, denial, started).await;
            return;
        }
        let outcome = tokio::select! {
            () = grant.stop.cancelled() => return,
            () = self.stop.cancelled() => return,
            outcome = self.request(&mut client, &grant) => outcome,
        };
        let Some(outcome) = outcome else { return };
        if let Err(denial) = &outcome.result
            && !outcome.answered
            && outcome.bytes_out == 0
            && outcome.bytes_in == 0
        {
            let _ = client.write_all(&denied(denial)).await;
        }
        grant.sink.record(event(outcome, started));
    }

    /// Reads and carries out one request; `None` when the client went away before asking.
    async fn request<S>(&self, client: &mut S, grant: &Grant) -> Option<Outcome>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + Socket,
    {
        // A request the proxy cannot read is refused as one it would not allow: it is a
        // denied connection in the record, with no host.
        let unreadable = |why: String| Outcome {
            answered: true,
            ..Outcome::unread(Denial::check("default", why))
        };
        let (buf, head_len) =
            match tokio::time::timeout(self.limits.head_timeout, read_head(client)).await {
                Ok(Ok(Some(read))) => read,
                Ok(Ok(None)) => return None,
                Ok(Err(e)) => {
                    let why = format!("its request could not be read: {e}");
                    let _ = client.write_all(&refusal(400, &why)).await;
                    return Some(unreadable(why));
                }
                Err(_) => {
                    let why = "no whole request in time";
                    let _ = client.write_all(&refusal(408, why)).await;
                    return Some(unreadable(why.to_owned()));
                }
            };
        let asked = match Asked::parse(&buf[..head_len]) {
            Ok(asked) => asked,
            Err(why) => {
                let _ = client.write_all(&refusal(400, &why)).await;
                return Some(unreadable(why));
            }
        };
        let early = &buf[head_len..];
        let mut outcome = Outcome {
            host: asked.host_text.clone(),
            port: asked.port,
            result: Err(Denial::check("default", "")),
            bytes_out: 0,
            bytes_in: 0,
            answered: false,
            brokered: false,
        };
        if let Some(denial) = asked.denial.clone() {
            outcome.result = Err(denial);
            return Some(outcome);
        }
        let host = match normalize_host(&asked.host_text) {
            Ok(host) => host,
            Err(why) => {
                outcome.result = Err(Denial::check("default", why));
                return Some(outcome);
            }
        };
        outcome.host = host.to_string();
        // The package index needs no allow entry, but a deny entry still wins over it.
        if let Err(denial) = grant.policy.denied(&host, asked.port) {
            outcome.result = Err(denial);
            return Some(outcome);
        }
        if let Some(packages) = self
            .packages
            .iter()
            .find(|p| p.takes(&asked.method, &outcome.host, asked.port, &asked.path))
            && !asked.connect
        {
            let host = outcome.host.clone();
            self.serve_package(
                client,
                grant,
                packages,
                &host,
                asked.port,
                &asked.path,
                &asked.headers,
                &mut outcome,
            )
            .await;
            return Some(outcome);
        }
        // An https:// index's host (and the hosts its pages linked) is answered inside TLS,
        // by the cache alone: no policy entry is needed for it.
        let cached_tunnel = asked.connect
            && self.broker.is_some()
            && self
                .packages
                .iter()
                .any(|p| p.takes_tunnel(&outcome.host, asked.port));
        if cached_tunnel {
            self.tunnel(client, grant, &host, asked.port, early, &mut outcome)
                .await;
            return Some(outcome);
        }
        if let Err(denial) = grant.policy.by_name(&host, asked.port) {
            outcome.result = Err(denial);
            return Some(outcome);
        }
        if asked.connect {
            self.tunnel(client, grant, &host, asked.port, early, &mut outcome)
                .await;
        } else {
            self.forward(client, grant, &host, &asked, early, &mut outcome)
                .await;
        }
        Some(outcome)
    }

    /// Answers one request for the package index's pages or files from the cache.
    #[allow(clippy::too_many_arguments)]
    async fn serve_package<S>(
        &self,
        client: &mut S,
        grant: &Grant,
        packages: &Packages,
        host: &str,
        port: u16,
        path: &str,
        headers: &[(String, String)],
        outcome: &mut Outcome,
    ) where
        S: AsyncWrite + Unpin + Send,
    {
        let room = grant
            .policy
            .max_bytes
            .map_or(u64::MAX, |max| max.saturating_sub(grant.carried.get()));
        let served = packages
            .serve(client, host, port, path, headers, room)
            .await;
        grant
            .carried
            .0
            .fetch_add(served.bytes_in + served.bytes_out, Ordering::Relaxed);
        outcome.bytes_in = served.bytes_in;
        outcome.bytes_out = served.bytes_out;
        outcome.answered = true;
        outcome.result = match served.result {
            Ok(()) => Ok("packages".to_owned()),
            Err(why) => Err(Denial::check("packages", why)),
        };
    }

    async fn tunnel<S>(
        &self,
        client: &mut S,
        grant: &Grant,
        host: &HostAsked,
        port: u16,
        early: &[u8],
        outcome: &mut Outcome,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + Socket,
    {
        if client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_err()
        {
            outcome.result = Err(Denial::check("default", "the client went away"));
            return;
        }
        outcome.answered = true;
        let hello = match tokio::time::timeout(self.limits.head_timeout, read_record(client, early))
            .await
        {
            Ok(Ok(record)) => record,
            _ => {
                outcome.result = Err(Denial::check(
                    "sni",
                    "the tunnel sent no TLS ClientHello in time",
                ));
                return;
            }
        };
        let named = sni::server_name(&hello);
        let sni_ok = match (&named, host) {
            (Hello::Named(name), HostAsked::Name(asked)) => name == asked,
            (Hello::Unnamed, HostAsked::Addr(_)) => true,
            (Hello::Named(name), HostAsked::Addr(addr)) => name == &addr.to_string(),
            _ => false,
        };
        if !sni_ok {
            let said = match named {
                Hello::Named(name) => format!("its TLS names {name}"),
                Hello::Unnamed => "its TLS names no server".to_owned(),
                Hello::NotTls(why) => format!("it is not TLS ({why})"),
            };
            outcome.result = Err(Denial::check(
                "sni",
                format!(
                    "CONNECT asked for {host} but {said}; a tunnel carries TLS to the host it names"
                ),
            ));
            return;
        }
        if let Some(broker) = &self.broker {
            let secret = broker.for_host(host);
            let cached = self
                .packages
                .iter()
                .any(|p| p.takes_tunnel(&host.to_string(), port));
            if secret.is_some() || cached {
                self.intercept(client, grant, host, port, hello, broker, secret, outcome)
                    .await;
                return;
            }
        }
        let upstream = match self.route(grant, host, port).await {
            Ok((route, stream)) => {
                outcome.result = Ok(route.rule);
                stream
            }
            Err(denial) => {
                outcome.result = Err(denial);
                return;
            }
        };
        let (out, inn, cut) = carry(client, upstream, &hello, grant, &self.limits, None).await;
        outcome.bytes_out = out;
        outcome.bytes_in = inn;
        if let Some(cut) = cut {
            outcome.result = Err(cut);
        }
    }

    async fn forward<S>(
        &self,
        client: &mut S,
        grant: &Grant,
        host: &HostAsked,
        asked: &Asked,
        early: &[u8],
        outcome: &mut Outcome,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + Socket,
    {
        let upstream = match self.route(grant, host, asked.port).await {
            Ok((route, stream)) => {
                outcome.result = Ok(route.rule);
                stream
            }
            Err(denial) => {
                outcome.result = Err(denial);
                return;
            }
        };
        let secret = self.broker.as_ref().and_then(|b| b.for_host(host));
        let mut first = match secret {
            Some(secret) => {
                outcome.brokered = true;
                crate::broker::with_header(&asked.origin_head, secret.header(), secret.value())
            }
            None => asked.origin_head.clone(),
        };
        first.extend_from_slice(early);
        let scrub = secret.map(|s| Scrub::new(s.value()));
        let (out, inn, cut) = carry(client, upstream, &first, grant, &self.limits, scrub).await;
        outcome.bytes_out = out;
        outcome.bytes_in = inn;
        if let Some(cut) = cut {
            outcome.result = Err(cut);
        }
    }

    /// Speaks TLS to the sandbox as `host` (with a certificate from the daemon's CA) and
    /// to `host` itself, adding `secret`'s header to the one request carried.
    #[allow(clippy::too_many_arguments)]
    async fn intercept<S>(
        &self,
        client: &mut S,
        grant: &Grant,
        host: &HostAsked,
        port: u16,
        hello: Vec<u8>,
        broker: &Broker,
        secret: Option<&crate::broker::Secret>,
        outcome: &mut Outcome,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send,
    {
        outcome.brokered = secret.is_some();
        let name = host.to_string();
        let config = match broker.server_for(&name) {
            Ok(config) => config,
            Err(e) => {
                outcome.result = Err(Denial::check("broker", e.to_string()));
                return;
            }
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let accepted = tokio::time::timeout(
            self.limits.head_timeout,
            acceptor.accept(Prefixed {
                prefix: hello,
                at: 0,
                inner: client,
            }),
        )
        .await;
        let mut tls = match accepted {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                outcome.result = Err(Denial::check(
                    "broker",
                    format!(
                        "the sandbox's TLS to {name} failed ({e}); a brokered host is answered with Tandem's CA, which the sandbox trusts through SSL_CERT_FILE"
                    ),
                ));
                return;
            }
            Err(_) => {
                outcome.result = Err(Denial::check("broker", "no TLS handshake in time"));
                return;
            }
        };
        let (buf, head_len) =
            match tokio::time::timeout(self.limits.head_timeout, read_head(&mut tls)).await {
                Ok(Ok(Some(read))) => read,
                _ => {
                    outcome.result = Err(Denial::check("broker", "no request inside TLS in time"));
                    return;
                }
            };
        let head = match inner_request(&buf[..head_len], &name, port) {
            Ok(head) => head,
            Err(denial) => {
                let _ = tls.write_all(&denied(&denial)).await;
                let _ = tls.shutdown().await;
                outcome.result = Err(denial);
                return;
            }
        };
        if let Some((method, path, headers)) = request_parts(&buf[..head_len])
            && let Some(packages) = self
                .packages
                .iter()
                .find(|p| p.takes(&method, &name, port, &path))
        {
            self.serve_package(
                &mut tls, grant, packages, &name, port, &path, &headers, outcome,
            )
            .await;
            return;
        }
        let Some(secret) = secret else {
            let denial = Denial::check(
                "packages",
                format!(
                    "only the package index's pages and the files they link are answered for {name}"
                ),
            );
            let _ = tls.write_all(&denied(&denial)).await;
            let _ = tls.shutdown().await;
            outcome.result = Err(denial);
            return;
        };
        let mut first = crate::broker::with_header(&head, secret.header(), secret.value());
        first.extend_from_slice(&buf[head_len..]);
        let tcp = match self.route(grant, host, port).await {
            Ok((route, stream)) => {
                outcome.result = Ok(route.rule);
                stream
            }
            Err(denial) => {
                let _ = tls.write_all(&denied(&denial)).await;
                let _ = tls.shutdown().await;
                outcome.result = Err(denial);
                return;
            }
        };
        let Some(server_name) = Broker::server_name(&name) else {
            outcome.result = Err(Denial::check("broker", format!("{name} is not a TLS name")));
            return;
        };
        let connector = tokio_rustls::TlsConnector::from(broker.upstream());
        let upstream = match tokio::time::timeout(
            self.limits.connect_timeout,
            connector.connect(server_name, tcp),
        )
        .await
        {
            Ok(Ok(upstream)) => upstream,
            Ok(Err(e)) => {
                let denial = Denial::check(
                    "broker",
                    format!(
                        "{name} did not prove who it is over TLS ({e}); the secret was not sent"
                    ),
                );
                let _ = tls.write_all(&refusal(502, &denial.reason)).await;
                let _ = tls.shutdown().await;
                outcome.result = Err(denial);
                return;
            }
            Err(_) => {
                outcome.result = Err(Denial::check(
                    "broker",
                    format!("{name} did not finish its TLS handshake in time"),
                ));
                return;
            }
        };
        let scrub = Some(Scrub::new(secret.value()));
        let (out, inn, cut) = pump(&mut tls, upstream, &first, grant, &self.limits, scrub).await;
        outcome.bytes_out = out;
        outcome.bytes_in = inn;
        if let Some(cut) = cut {
            outcome.result = Err(cut);
        }
    }

    /// Resolves `host` (unless it is an address), checks every address it gives, and
    /// connects to the first one allowed: the address checked is the address connected to.
    async fn route(
        &self,
        grant: &Grant,
        host: &HostAsked,
        port: u16,
    ) -> Result<(Route, TcpStream), Denial> {
        let addrs: Vec<IpAddr> = match host {
            HostAsked::Addr(addr) => vec![*addr],
            HostAsked::Name(name) => match grant.policy.resolve.get(name) {
                Some(pinned) => pinned.clone(),
                None => {
                    let looked = tokio::time::timeout(self.limits.connect_timeout, async {
                        tokio::net::lookup_host((name.as_str(), port)).await
                    })
                    .await;
                    match looked {
                        Ok(Ok(found)) => found.map(|a| a.ip()).collect(),
                        Ok(Err(error)) => {
                            return Err(Denial::check(
                                "resolve",
                                format!("{name} did not resolve: {error}"),
                            ));
                        }
                        Err(_) => {
                            return Err(Denial::check(
                                "resolve",
                                format!("{name} did not resolve in time"),
                            ));
                        }
                    }
                }
            },
        };
        let mut first_denial = None;
        let mut failed = None;
        for addr in addrs {
            match grant.policy.at_address(host, addr, port, &self.own) {
                Ok(rule) => {
                    let to = SocketAddr::new(addr, port);
                    match tokio::time::timeout(self.limits.connect_timeout, TcpStream::connect(to))
                        .await
                    {
                        Ok(Ok(stream)) => {
                            let _ = stream.set_nodelay(true);
                            return Ok((
                                Route {
                                    to,
                                    rule: rule.text.clone(),
                                },
                                stream,
                            ));
                        }
                        Ok(Err(error)) => failed = Some(format!("{to}: {error}")),
                        Err(_) => failed = Some(format!("{to}: no answer in time")),
                    }
                }
                Err(denial) => {
                    first_denial.get_or_insert(denial);
                }
            }
        }
        match (failed, first_denial) {
            (Some(why), _) => Err(Denial::check(
                "unreachable",
                format!("{host} could not be reached ({why})"),
            )),
            (None, Some(denial)) => Err(denial),
            (None, None) => Err(Denial::check(
                "resolve",
                format!("{host} resolved to no address"),
            )),
        }
    }
}

/// A request head, understood.
struct Asked {
    connect: bool,
    method: String,
    /// The target's path and query, for a plain request.
    path: String,
    /// The request's headers, for a plain request.
    headers: Vec<(String, String)>,
    host_text: String,
    port: u16,
    /// For a plain request: the head to send on, in origin form, with `Connection: close`.
    origin_head: Vec<u8>,
    /// A check that refused it before any policy was asked.
    denial: Option<Denial>,
}

impl Asked {
    fn parse(head: &[u8]) -> Result<Asked, String> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(head) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => return Err("a request head cut short".to_owned()),
            Err(error) => return Err(format!("not an HTTP request: {error}")),
        }
        let method = req.method.unwrap_or_default();
        let target = req.path.unwrap_or_default();
        if method.eq_ignore_ascii_case("CONNECT") {
            let (host, port) = split_authority(target, None)?;
            return Ok(Asked {
                connect: true,
                method: method.to_owned(),
                path: String::new(),
                headers: Vec::new(),
                host_text: host,
                port,
                origin_head: Vec::new(),
                denial: None,
            });
        }
        let Some(rest) = target.strip_prefix("http://") else {
            return Err(if target.starts_with('/') {
                "this is an HTTP proxy: ask it with an absolute URL (http://host/path), or CONNECT host:port for HTTPS".to_owned()
            } else {
                format!(
                    "only http:// URLs are carried in plain requests, not {target:?}; HTTPS goes through CONNECT"
                )
            });
        };
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let path = if path.starts_with('?') {
            format!("/{path}")
        } else {
            path.to_owned()
        };
        if authority.contains('@') {
            return Err("a URL with credentials in it is not carried".to_owned());
        }
        let (host, port) = split_authority(authority, Some(80))?;
        let mut denial = None;
        let host_headers: Vec<&httparse::Header<'_>> = req
            .headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("host"))
            .collect();
        match host_headers.as_slice() {
            [] => {}
            [one] => {
                let said = String::from_utf8_lossy(one.value);
                let same = split_authority(said.trim(), Some(80))
                    .is_ok_and(|(h, p)| p == port && same_host(&h, &host));
                if !same {
                    denial = Some(Denial::check(
                        "host_header",
                        format!("the request is for {host}:{port} but its Host header says {said}"),
                    ));
                }
            }
            _ => {
                denial = Some(Denial::check("host_header", "more than one Host header"));
            }
        }
        let version = if req.version == Some(0) { "1.0" } else { "1.1" };
        let mut out = format!("{method} {path} HTTP/{version}\r\n").into_bytes();
        let mut has_host = false;
        for h in req.headers.iter() {
            let name = h.name.to_ascii_lowercase();
            if name.starts_with("proxy-") || name == "connection" || name == "keep-alive" {
                continue;
            }
            has_host |= name == "host";
            out.extend_from_slice(h.name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(h.value);
            out.extend_from_slice(b"\r\n");
        }
        if !has_host {
            out.extend_from_slice(format!("Host: {authority}\r\n").as_bytes());
        }
        // One request per connection: each is checked on its own.
        out.extend_from_slice(b"Connection: close\r\n\r\n");
        Ok(Asked {
            connect: false,
            method: method.to_owned(),
            headers: req
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_owned(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect(),
            path,
            host_text: host,
            port,
            origin_head: out,
            denial,
        })
    }
}

/// The request read inside a brokered host's TLS, in origin form, checked to be for that
/// host, as it goes on: one request, `Connection: close`.
fn inner_request(head: &[u8], host: &str, port: u16) -> Result<Vec<u8>, Denial> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => {
            return Err(Denial::check(
                "broker",
                "not an HTTP/1.1 request inside TLS",
            ));
        }
    }
    let method = req.method.unwrap_or_default();
    let path = req.path.unwrap_or_default();
    if !path.starts_with('/') {
        return Err(Denial::check(
            "broker",
            format!("a request inside TLS to {host} must be in origin form (/path), not {path:?}"),
        ));
    }
    let hosts: Vec<&httparse::Header<'_>> = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("host"))
        .collect();
    let ok = match hosts.as_slice() {
        [one] => {
            let said = String::from_utf8_lossy(one.value);
            split_authority(said.trim(), Some(443))
                .is_ok_and(|(h, p)| p == port && same_host(&h, host))
        }
        _ => false,
    };
    if !ok {
        return Err(Denial::check(
            "host_header",
            format!("a request inside TLS to {host}:{port} must carry one Host header naming it"),
        ));
    }
    let mut out = format!("{method} {path} HTTP/1.1\r\n").into_bytes();
    for h in req.headers.iter() {
        let name = h.name.to_ascii_lowercase();
        if name.starts_with("proxy-") || name == "connection" || name == "keep-alive" {
            continue;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok(out)
}

/// A request's headers, by name and value.
type Headers = Vec<(String, String)>;

/// A request head's method, origin-form path and headers.
fn request_parts(head: &[u8]) -> Option<(String, String, Headers)> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    if !matches!(req.parse(head), Ok(httparse::Status::Complete(_))) {
        return None;
    }
    let pairs = req
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_owned(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect();
    Some((req.method?.to_owned(), req.path?.to_owned(), pairs))
}

/// A stream whose first bytes were already read (a ClientHello checked for its name).
struct Prefixed<S> {
    prefix: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.prefix[at..at + n]);
            self.at += n;
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn same_host(a: &str, b: &str) -> bool {
    match (normalize_host(a), normalize_host(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// `host:port` or `[v6]:port`; `default` when the port may be left out.
fn split_authority(text: &str, default: Option<u16>) -> Result<(String, u16), String> {
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (inside, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("{text:?}: an opening [ with no closing ]"))?;
        (inside, after.strip_prefix(':'))
    } else {
        match text.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (text, None),
        }
    };
    let port = match (port, default) {
        (Some(p), _) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("{text:?}: {p:?} is not a port"))?,
        (None, Some(d)) => d,
        (None, None) => return Err(format!("{text:?}: CONNECT needs host:port")),
    };
    if host.is_empty() {
        return Err(format!("{text:?}: no host"));
    }
    Ok((host.to_owned(), port))
}

/// Reads up to the end of a request head; `None` when the client closed first.
async fn read_head<S: AsyncRead + Unpin>(
    client: &mut S,
) -> std::io::Result<Option<(Vec<u8>, usize)>> {
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(Some((buf, from + i + 4)));
        }
        if buf.len() > MAX_HEAD {
            return Err(std::io::Error::other("request head over 64 KiB"));
        }
    }
}

/// Reads one whole TLS record (bytes already read first), bounded by the largest record.
async fn read_record<S: AsyncRead + Unpin>(
    client: &mut S,
    early: &[u8],
) -> std::io::Result<Vec<u8>> {
    let mut buf = early.to_vec();
    let mut chunk = [0u8; 4096];
    loop {
        if buf.len() >= sni::RECORD_HEADER {
            let Some(want) = sni::record_len(&buf) else {
                return Ok(buf);
            };
            if want > sni::MAX_RECORD {
                return Ok(buf);
            }
            if buf.len() >= want {
                return Ok(buf);
            }
        }
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Ok(buf);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > sni::MAX_RECORD + 4096 {
            return Ok(buf);
        }
    }
}

/// Carries bytes both ways until both sides are done, one is cut, or nothing moves for the
/// idle timeout; `first` goes upstream before anything else. Answers bytes out, bytes in,
/// and why it was cut short.
async fn pump<S, U>(
    client: &mut S,
    upstream: U,
    first: &[u8],
    grant: &Grant,
    limits: &ProxyLimits,
    scrub: Option<Scrub>,
) -> (u64, u64, Option<Denial>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
    U: AsyncRead + AsyncWrite + Unpin + Send,
{
    let out = AtomicU64::new(0);
    let inn = AtomicU64::new(0);
    let (mut up_r, mut up_w) = tokio::io::split(upstream);
    let (mut cl_r, mut cl_w) = tokio::io::split(client);
    let budget = Budget::of(grant);
    let result = async {
        budget.take(first.len())?;
        out.fetch_add(first.len() as u64, Ordering::Relaxed);
        up_w.write_all(first).await.map_err(|_| Cut::Closed)?;
        let up = one_way(
            &mut cl_r,
            &mut up_w,
            &out,
            &budget,
            limits.idle_timeout,
            None,
        );
        let down = one_way(
            &mut up_r,
            &mut cl_w,
            &inn,
            &budget,
            limits.idle_timeout,
            scrub,
        );
        tokio::try_join!(up, down).map(|_| ())
    };
    let denial = until_stopped(grant, result).await;
    (out.into_inner(), inn.into_inner(), denial)
}

/// Carries a connection to `upstream`: through the kernel's pipes, never copied into the
/// proxy, unless a secret is to be scrubbed from what comes back (or no pipe can be made),
/// then by [`pump`].
async fn carry<S>(
    client: &mut S,
    upstream: TcpStream,
    first: &[u8],
    grant: &Grant,
    limits: &ProxyLimits,
    scrub: Option<Scrub>,
) -> (u64, u64, Option<Denial>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + Socket,
{
    if scrub.is_none()
        && let Some(carried) = spliced(&*client, &upstream, first, grant, limits).await
    {
        return carried;
    }
    pump(client, upstream, first, grant, limits, scrub).await
}

/// Carries a connection through two pipes; `None`, with nothing sent, when the pipes
/// cannot be made.
async fn spliced<A: Socket, B: Socket>(
    client: &A,
    upstream: &B,
    first: &[u8],
    grant: &Grant,
    limits: &ProxyLimits,
) -> Option<(u64, u64, Option<Denial>)> {
    use crate::splice::{Stop, one_way, pipe, write_all};
    let (up_pipe, down_pipe) = (pipe().ok()?, pipe().ok()?);
    let out = AtomicU64::new(0);
    let inn = AtomicU64::new(0);
    let budget = Budget::of(grant);
    let cut_of = |stop: Stop| match stop {
        Stop::Idle => Cut::Idle,
        Stop::Budget => Cut::Bytes(budget.max.unwrap_or(0)),
        Stop::Failed => Cut::Closed,
    };
    let take = |n: usize| budget.take(n).is_ok();
    let result = async {
        budget.take(first.len())?;
        out.fetch_add(first.len() as u64, Ordering::Relaxed);
        write_all(upstream, first).await.map_err(|_| Cut::Closed)?;
        let up = async {
            one_way(client, upstream, up_pipe, &out, limits.idle_timeout, take)
                .await
                .map_err(cut_of)
        };
        let down = async {
            one_way(upstream, client, down_pipe, &inn, limits.idle_timeout, take)
                .await
                .map_err(cut_of)
        };
        tokio::try_join!(up, down).map(|_| ())
    };
    let denial = until_stopped(grant, result).await;
    Some((out.into_inner(), inn.into_inner(), denial))
}

/// Runs a connection's carrying until it ends or `grant` stops; what its end says in its
/// `net` event.
async fn until_stopped(
    grant: &Grant,
    carrying: impl std::future::Future<Output = Result<(), Cut>>,
) -> Option<Denial> {
    let cut = tokio::select! {
        r = carrying => r.err(),
        () = grant.stop.cancelled() => Some(Cut::Stopped),
    };
    match cut {
        Some(Cut::Bytes(max)) => Some(Denial::check(
            "max_bytes",
            format!("the task's network budget of {max} bytes is spent"),
        )),
        Some(Cut::Idle) | Some(Cut::Closed) | None => None,
        Some(Cut::Stopped) => None,
    }
}

#[derive(Debug)]
enum Cut {
    Bytes(u64),
    Idle,
    Closed,
    Stopped,
}

struct Budget<'a> {
    carried: &'a Carried,
    max: Option<u64>,
}

impl Budget<'_> {
    /// `grant`'s budget.
    fn of(grant: &Grant) -> Budget<'_> {
        Budget {
            carried: &grant.carried,
            max: grant.policy.max_bytes,
        }
    }

    fn take(&self, n: usize) -> Result<(), Cut> {
        let n = n as u64;
        let before = self.carried.0.fetch_add(n, Ordering::Relaxed);
        match self.max {
            Some(max) if before.saturating_add(n) > max => Err(Cut::Bytes(max)),
            _ => Ok(()),
        }
    }
}

async fn one_way<R, W>(
    r: &mut R,
    w: &mut W,
    count: &AtomicU64,
    budget: &Budget<'_>,
    idle: Duration,
    mut scrub: Option<Scrub>,
) -> Result<(), Cut>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Grows while reads fill it, so a bulk transfer pays fewer wake-ups per byte and an idle
    // connection (of up to 4,096) holds little.
    let mut buf = vec![0u8; PUMP_BUFFER_START];
    loop {
        let n = match tokio::time::timeout(idle, r.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                if let Some(scrub) = &mut scrub {
                    let _ = w.write_all(&scrub.finish()).await;
                }
                let _ = w.shutdown().await;
                return Ok(());
            }
            Ok(Ok(n)) => n,
            Err(_) => return Err(Cut::Idle),
        };
        let full = n == buf.len();
        budget.take(n)?;
        count.fetch_add(n as u64, Ordering::Relaxed);
        let sent = match &mut scrub {
            Some(scrub) => w.write_all(&scrub.push(&buf[..n])).await,
            None => w.write_all(&buf[..n]).await,
        };
        sent.map_err(|_| Cut::Closed)?;
        if full && buf.len() < PUMP_BUFFER_MOST {
            buf.resize(buf.len() * 2, 0);
        }
    }
}

/// A connection's buffer each way at first, and at most.
const PUMP_BUFFER_START: usize = 16 << 10;
const PUMP_BUFFER_MOST: usize = 256 << 10;

/// Refuses a connection before its request was read (a bound it met on arrival): a 403 to
/// the client and a record with no host.
async fn refuse_unasked<S>(client: &mut S, grant: &Grant, denial: Denial, started: Instant)
where
    S: AsyncWrite + Unpin,
{
    let _ = client.write_all(&denied(&denial)).await;
    grant.sink.record(unread(denial, started));
}

impl Outcome {
    /// A connection refused with no request read: no host, no port, nothing carried.
    fn unread(denial: Denial) -> Outcome {
        Outcome {
            host: String::new(),
            port: 0,
            result: Err(denial),
            bytes_out: 0,
            bytes_in: 0,
            answered: false,
            brokered: false,
        }
    }
}

/// The record of a connection refused before its request was read.
fn unread(denial: Denial, started: Instant) -> NetEvent {
    event(Outcome::unread(denial), started)
}

fn event(outcome: Outcome, started: Instant) -> NetEvent {
    let (verdict, rule, reason) = match outcome.result {
        Ok(rule) => (NetVerdict::Allowed, rule, None),
        Err(denial) => (NetVerdict::Denied, denial.rule, Some(denial.reason)),
    };
    NetEvent {
        host: outcome.host,
        port: outcome.port,
        verdict,
        rule,
        reason,
        bytes_out: outcome.bytes_out,
        bytes_in: outcome.bytes_in,
        ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        brokered: outcome.brokered,
    }
}

fn denied(denial: &Denial) -> Vec<u8> {
    let body = format!(
        "Tandem's egress proxy refused this connection (rule: {}): {}\n",
        denial.rule, denial.reason
    );
    format!(
        "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nX-Tandem-Rule: {}\r\nConnection: close\r\n\r\n{body}",
        body.len(),
        denial.rule.replace(['\r', '\n'], " "),
    )
    .into_bytes()
}

fn refusal(code: u16, why: &str) -> Vec<u8> {
    let reason = match code {
        400 => "Bad Request",
        408 => "Request Timeout",
        _ => "Service Unavailable",
    };
    let body = format!("Tandem's egress proxy: {why}\n");
    format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A sandbox's own socket, served under its grant until dropped.
pub struct SocketGrant {
    path: std::path::PathBuf,
    grant: Arc<Grant>,
    inner: Arc<Inner>,
}

impl SocketGrant {
    /// Where the socket is.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// A new block starts in the sandbox: its connections are counted from none.
    pub fn new_block(&self) {
        self.grant.new_block();
    }

    /// What serves a TCP listener under this grant, for as long as the socket is served:
    /// a listener opened inside the sandbox's own network namespace, so that its
    /// connections need no relay.
    pub fn adopter(&self) -> tandem_executor::EgressAdopt {
        let inner = self.inner.clone();
        let grant = self.grant.clone();
        let listen = move |listener: std::net::TcpListener| {
            listener.set_nonblocking(true)?;
            let listener = tokio::net::TcpListener::from_std(listener)?;
            inner
                .clone()
                .accept_all(listener, grant.clone(), "in a sandbox's network");
            Ok(())
        };
        let grant = self.grant.clone();
        let runtime = tokio::runtime::Handle::try_current();
        let catch = move |netns: std::os::fd::OwnedFd| {
            let runtime = runtime
                .as_ref()
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            let tun = crate::catch::make_in(netns)?;
            let stops = [grant.new_catcher(), grant.stop.clone()];
            let sink = grant.sink.clone();
            runtime.spawn(crate::catch::watch(tun, move |e| sink.record(e), stops));
            Ok(())
        };
        tandem_executor::EgressAdopt::new(listen, catch)
    }
}

impl Drop for SocketGrant {
    fn drop(&mut self) {
        self.grant.stop.cancel();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Egress {
    /// Serves `grant` on a new Unix socket at `path` (in a directory only this sandbox is
    /// given), until the returned guard is dropped.
    pub fn listen_unix(
        &self,
        path: &std::path::Path,
        grant: Grant,
    ) -> std::io::Result<SocketGrant> {
        use std::os::unix::fs::PermissionsExt;
        let listener = tokio::net::UnixListener::bind(path)?;
        // The sandbox's user is not the daemon's: it must be able to connect.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
        let grant = Arc::new(grant);
        self.inner
            .clone()
            .accept_all(listener, grant.clone(), "on a sandbox's socket");
        Ok(SocketGrant {
            path: path.to_owned(),
            grant,
            inner: self.inner.clone(),
        })
    }
}

/// A listener a sandbox's connections arrive on.
trait Accepts: Send + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + Socket + 'static;
    fn take(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;
}

impl Accepts for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn take(&self) -> std::io::Result<Self::Stream> {
        self.accept().await.map(|(stream, _)| stream)
    }
}

impl Accepts for TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn take(&self) -> std::io::Result<Self::Stream> {
        let (stream, _) = self.accept().await?;
        // Small writes are the clients' to coalesce; the proxy adds no delay of its own.
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

impl Inner {
    /// Serves every connection `listener` takes under `grant` until the grant or the proxy
    /// stops.
    fn accept_all<L: Accepts>(self: Arc<Self>, listener: L, grant: Arc<Grant>, on: &'static str) {
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = grant.stop.cancelled() => return,
                    () = self.stop.cancelled() => return,
                    accepted = listener.take() => accepted,
                };
                match accepted {
                    Ok(stream) => {
                        let inner = self.clone();
                        let grant = grant.clone();
                        tokio::spawn(async move { inner.connection(stream, grant).await });
                    }
                    Err(error) => {
                        tracing::warn!(%error, "egress proxy: accept {on} failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
    }
}
