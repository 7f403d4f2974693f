//! The package cache: a read-through copy of the operator's Python index (PEP 503 pages and
//! the files they link), shared by every sandbox, each file checked against the hash its
//! index page gives before it is kept or served.
//!
//! Requests for the index's pages, and for files an index page named, need no `allow` entry:
//! the operator named the index. Anything else on the index's host goes to the policy as any
//! request does.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256, Sha512};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The largest index page kept (a project with thousands of releases has pages of megabytes).
const MAX_PAGE: u64 = 32 * 1024 * 1024;
/// File hashes learned from pages, kept at once.
const MAX_LEARNED: usize = 500_000;
/// The largest response head read from the index.
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// A package index URL that Tandem cannot use.
#[derive(Debug, thiserror::Error)]
#[error("{url:?} is not a package index URL Tandem can use: {why}")]
pub struct IndexError {
    url: String,
    why: String,
}

/// Where the index is: `http[s]://host[:port]/path/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexUrl {
    /// Whether it is spoken to over TLS (`https://`).
    pub tls: bool,
    /// The host, lowercased.
    pub host: String,
    /// The port (80 when the URL gives none).
    pub port: u16,
    /// The path of the simple index's root, ending in `/`.
    pub path: String,
}

impl IndexUrl {
    /// Parses an index URL as `[network.packages] python` gives it.
    pub fn parse(url: &str) -> Result<IndexUrl, IndexError> {
        let fail = |why: &str| IndexError {
            url: url.to_owned(),
            why: why.to_owned(),
        };
        let (tls, rest) = if let Some(rest) = url.strip_prefix("http://") {
            (false, rest)
        } else if let Some(rest) = url.strip_prefix("https://") {
            (true, rest)
        } else {
            return Err(fail("it must start with http:// or https://"));
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(fail("it names no host, or carries credentials"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => (
                h,
                p.parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| fail("its port is not a port"))?,
            ),
            _ => (authority, if tls { 443 } else { 80 }),
        };
        let host = crate::rule::normalize_host(host)
            .map_err(|why| fail(&why))?
            .to_string();
        let mut path = path.split(['?', '#']).next().unwrap_or("/").to_owned();
        if !path.ends_with('/') {
            path.push('/');
        }
        Ok(IndexUrl {
            tls,
            host,
            port,
            path,
        })
    }

    /// The URL, as pip is given it.
    pub fn url(&self) -> String {
        let (scheme, default) = if self.tls {
            ("https", 443)
        } else {
            ("http", 80)
        };
        if self.port == default {
            format!("{scheme}://{}{}", self.host, self.path)
        } else {
            format!("{scheme}://{}:{}{}", self.host, self.port, self.path)
        }
    }
}

/// What kind of index a cache reads through, which says how its pages name files and
/// their hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A PEP 503 simple index (or PEP 691 JSON): links with a `sha256`.
    Python,
    /// An npm registry: packuments whose versions name a `dist.tarball` and its `sha512`
    /// `dist.integrity`.
    Npm,
}

/// A file's digest, as its index gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sum {
    Sha256([u8; 32]),
    Sha512([u8; 64]),
}

impl Sum {
    /// The name it is kept under in the cache.
    fn name(&self) -> String {
        match self {
            Sum::Sha256(sha) => hex::encode(sha),
            Sum::Sha512(sha) => format!("sha512-{}", hex::encode(sha)),
        }
    }

    fn shown(&self) -> String {
        match self {
            Sum::Sha256(sha) => format!("sha256={}", hex::encode(sha)),
            Sum::Sha512(sha) => format!("sha512={}", hex::encode(sha)),
        }
    }
}

/// A running digest of the kind a [`Sum`] is.
enum Hasher {
    Sha256(Sha256),
    Sha512(Sha512),
}

impl Hasher {
    fn of(sum: &Sum) -> Self {
        match sum {
            Sum::Sha256(_) => Hasher::Sha256(Sha256::new()),
            Sum::Sha512(_) => Hasher::Sha512(Sha512::new()),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::Sha512(h) => h.update(bytes),
        }
    }

    fn finish(self) -> Sum {
        match self {
            Hasher::Sha256(h) => Sum::Sha256(h.finalize().into()),
            Hasher::Sha512(h) => Sum::Sha512(h.finalize().into()),
        }
    }
}

/// The cache and what it has learned from the index's pages.
pub struct Packages {
    kind: Kind,
    index: IndexUrl,
    dir: PathBuf,
    max_bytes: u64,
    page_ttl: Duration,
    resolve: Vec<IpAddr>,
    connect_timeout: Duration,
    /// File URL (`host:port/path`, no fragment) → the digest its index page gives.
    hashes: Mutex<HashMap<String, Sum>>,
    /// Requests that reached the index (pages and files), for the record and the tests.
    upstream: AtomicU64,
    hits: AtomicU64,
    /// How an `https://` index's certificate is checked (the proxy's upstream roots).
    tls: Mutex<Option<Arc<rustls::ClientConfig>>>,
}

/// What serving one request did.
pub(crate) struct Served {
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub result: Result<(), String>,
}

impl Packages {
    /// A cache of `index` kept in `dir`, at most `max_bytes` of files; `resolve` pins the
    /// index host's addresses (else it is looked up).
    pub fn new(
        index: IndexUrl,
        dir: PathBuf,
        max_bytes: u64,
        resolve: Vec<IpAddr>,
    ) -> std::io::Result<Packages> {
        std::fs::create_dir_all(dir.join("files"))?;
        std::fs::create_dir_all(dir.join("pages"))?;
        std::fs::create_dir_all(dir.join("partial"))?;
        // A download cut short by a stop is never served; one under an hour old may be
        // another process's, still being written.
        if let Ok(entries) = std::fs::read_dir(dir.join("partial")) {
            for entry in entries.flatten() {
                let old = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|m| m.elapsed().ok())
                    .is_some_and(|age| age > Duration::from_secs(3600));
                if old {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(Packages {
            kind: Kind::Python,
            index,
            dir,
            max_bytes,
            page_ttl: Duration::from_secs(600),
            resolve,
            connect_timeout: Duration::from_secs(10),
            hashes: Mutex::new(HashMap::new()),
            upstream: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            tls: Mutex::new(None),
        })
    }

    /// The same cache for an index of `kind`.
    pub fn of_kind(mut self, kind: Kind) -> Packages {
        self.kind = kind;
        self
    }

    /// What kind of index it reads through.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The index this cache reads through.
    pub fn index(&self) -> &IndexUrl {
        &self.index
    }

    /// Requests that reached the index so far.
    pub fn upstream_requests(&self) -> u64 {
        self.upstream.load(Ordering::Relaxed)
    }

    /// Requests answered from the cache so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// The variables that point pip (or npm) inside a sandbox at this index.
    pub fn env(&self) -> Vec<(String, String)> {
        if self.kind == Kind::Npm {
            // Tandem named the registry and checks every tarball against its integrity.
            return [
                ("npm_config_registry", self.index.url()),
                ("npm_config_audit", "false".to_owned()),
                ("npm_config_fund", "false".to_owned()),
                ("npm_config_update_notifier", "false".to_owned()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        }
        let mut env = vec![("PIP_INDEX_URL", self.index.url())];
        if !self.index.tls {
            // Tandem named the index and checks every file against its hashes.
            env.push(("PIP_TRUSTED_HOST", self.index.host.clone()));
        }
        env.extend([
            // A sandbox's installs go to its user's site, in its home: never the image's.
            ("PIP_USER", "1".to_owned()),
            ("PIP_BREAK_SYSTEM_PACKAGES", "1".to_owned()),
            ("PIP_DISABLE_PIP_VERSION_CHECK", "1".to_owned()),
            ("PIP_NO_INPUT", "1".to_owned()),
        ]);
        env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
    }

    /// Whether a `CONNECT` to `host:port` is this cache's to answer inside TLS: the index's
    /// own host, or a host its pages linked files on, when the index is `https://`.
    pub(crate) fn takes_tunnel(&self, host: &str, port: u16) -> bool {
        if !self.index.tls {
            return false;
        }
        if host == self.index.host && port == self.index.port {
            return true;
        }
        let prefix = format!("{host}:{port}/");
        self.hashes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .any(|k| k.starts_with(&prefix))
    }

    /// The TLS client the cache speaks to an `https://` index with, set by the proxy.
    pub(crate) fn set_tls(&self, config: Arc<rustls::ClientConfig>) {
        if let Ok(mut slot) = self.tls.lock() {
            *slot = Some(config);
        }
    }

    /// Whether a plain `GET` for `host:port` `path` is this cache's to answer.
    pub(crate) fn takes(&self, method: &str, host: &str, port: u16, path: &str) -> bool {
        if !method.eq_ignore_ascii_case("GET") {
            return false;
        }
        let path = strip_query(path);
        if host == self.index.host && port == self.index.port && path.starts_with(&self.index.path)
        {
            return true;
        }
        self.hashes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&file_key(host, port, path))
    }

    /// Answers one `GET` from the cache, or from the index and into the cache.
    pub(crate) async fn serve<S>(
        &self,
        client: &mut S,
        host: &str,
        port: u16,
        path: &str,
        headers: &[(String, String)],
        room: u64,
    ) -> Served
    where
        S: AsyncWrite + Unpin,
    {
        let bare = strip_query(path);
        let known = self
            .hashes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&file_key(host, port, bare))
            .copied();
        let answer = match known {
            Some(sum) => self.file(host, port, path, sum).await,
            None => self.page(host, port, path, headers).await,
        };
        let (head, body) = match answer {
            Ok(answer) => answer,
            Err(why) => {
                let body = format!("Tandem's package cache: {why}\n");
                let head = head_of(502, "text/plain; charset=utf-8", body.len() as u64, "error");
                let n = write_all(client, &head, Body::Bytes(body.as_bytes())).await;
                return Served {
                    bytes_out: 0,
                    bytes_in: n,
                    result: Err(why),
                };
            }
        };
        if body.len() > room {
            let why = format!("the task's network budget has {room} bytes left");
            return Served {
                bytes_out: 0,
                bytes_in: 0,
                result: Err(why),
            };
        }
        let n = write_all(client, &head, body.as_ref()).await;
        Served {
            bytes_out: 0,
            bytes_in: n,
            result: Ok(()),
        }
    }

    async fn page(
        &self,
        host: &str,
        port: u16,
        path: &str,
        headers: &[(String, String)],
    ) -> Result<(Vec<u8>, Answer), String> {
        let key = format!("{host}:{port}{path}");
        // Pages are kept on disk beside the files, so that every process on this machine
        // (a daemon, each `tandem run`) shares them, each for `page_ttl`.
        let kept = self
            .dir
            .join("pages")
            .join(hex::encode(Sha256::digest(key.as_bytes())));
        if let Some((content_type, body)) = self.kept_page(&kept) {
            self.learn(host, port, path, &content_type, &body);
            self.hits.fetch_add(1, Ordering::Relaxed);
            let head = head_of(200, &content_type, body.len() as u64, "hit");
            return Ok((head, Answer::Bytes(body)));
        }
        let mut response = self.fetch(host, port, path, headers).await?;
        let mut body = Vec::new();
        response
            .body(&mut body, MAX_PAGE)
            .await
            .map_err(|e| format!("reading {host}{path}: {e}"))?;
        if response.status == 200 {
            self.learn(host, port, path, &response.content_type, &body);
            let content_type = response.content_type.replace(['\r', '\n'], " ");
            let mut record = format!("{content_type}\n").into_bytes();
            record.extend_from_slice(&body);
            let partial = self
                .dir
                .join("partial")
                .join(uuid::Uuid::new_v4().simple().to_string());
            if std::fs::write(&partial, &record).is_ok() && std::fs::rename(&partial, &kept).is_ok()
            {
                self.evict(&kept);
            }
        }
        let head = head_of(
            response.status,
            &response.content_type,
            body.len() as u64,
            "miss",
        );
        Ok((head, Answer::Bytes(body)))
    }

    /// A page kept within its time: its content type and body.
    fn kept_page(&self, kept: &Path) -> Option<(String, Vec<u8>)> {
        let meta = std::fs::metadata(kept).ok()?;
        let age = meta.modified().ok()?.elapsed().ok()?;
        if !meta.is_file() || age >= self.page_ttl || meta.len() > MAX_PAGE + 1024 {
            return None;
        }
        let mut record = std::fs::read(kept).ok()?;
        let line = record.iter().position(|b| *b == b'\n')?;
        let body = record.split_off(line + 1);
        let content_type = String::from_utf8_lossy(&record[..line]).into_owned();
        Some((content_type, body))
    }

    async fn file(
        &self,
        host: &str,
        port: u16,
        path: &str,
        sum: Sum,
    ) -> Result<(Vec<u8>, Answer), String> {
        let name = sum.name();
        let kept = self.dir.join("files").join(&name);
        if let Ok(meta) = std::fs::metadata(&kept)
            && meta.is_file()
        {
            // Touched so that eviction takes the least recently used first.
            if let Ok(file) = std::fs::File::options().append(true).open(&kept) {
                let _ = file.set_modified(std::time::SystemTime::now());
            }
            self.hits.fetch_add(1, Ordering::Relaxed);
            let head = head_of(200, "application/octet-stream", meta.len(), "hit");
            return Ok((head, Answer::File(kept, meta.len())));
        }
        let mut response = self.fetch(host, port, path, &[]).await?;
        if response.status != 200 {
            let mut body = Vec::new();
            let _ = response.body(&mut body, 64 * 1024).await;
            let head = head_of(
                response.status,
                &response.content_type,
                body.len() as u64,
                "miss",
            );
            return Ok((head, Answer::Bytes(body)));
        }
        let partial = self
            .dir
            .join("partial")
            .join(uuid::Uuid::new_v4().simple().to_string());
        let written = async {
            let mut out = tokio::fs::File::create(&partial)
                .await
                .map_err(|e| format!("the cache could not write {}: {e}", partial.display()))?;
            let mut hasher = HashingWriter {
                file: &mut out,
                hash: Hasher::of(&sum),
                len: 0,
            };
            response
                .body(&mut hasher, self.max_bytes)
                .await
                .map_err(|e| format!("downloading {host}{path}: {e}"))?;
            let len = hasher.len;
            let got = hasher.hash.finish();
            out.flush().await.map_err(|e| e.to_string())?;
            if got != sum {
                return Err(format!(
                    "{host}{path} does not match its index's hash (the index says {}, the file is {}); it was not kept or served",
                    sum.shown(),
                    got.shown()
                ));
            }
            Ok(len)
        }
        .await;
        let len = match written {
            Ok(len) => len,
            Err(why) => {
                let _ = std::fs::remove_file(&partial);
                return Err(why);
            }
        };
        std::fs::rename(&partial, &kept)
            .map_err(|e| format!("the cache could not keep {}: {e}", kept.display()))?;
        self.evict(&kept);
        let head = head_of(200, "application/octet-stream", len, "miss");
        Ok((head, Answer::File(kept, len)))
    }

    /// Removes the least recently used files and pages until the cache is within its
    /// bound, never `keep` (the one being served).
    fn evict(&self, keep: &Path) {
        // Pages count against the bound as files do: an index that answers any path must
        // not fill the disk with them.
        let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = ["files", "pages"]
            .into_iter()
            .filter_map(|dir| std::fs::read_dir(self.dir.join(dir)).ok())
            .flat_map(|entries| entries.flatten())
            .filter_map(|e| {
                let meta = e.metadata().ok()?;
                if !meta.is_file() {
                    return None;
                }
                Some((meta.modified().ok()?, meta.len(), e.path()))
            })
            .collect();
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        files.sort();
        for (_, len, path) in files {
            if total <= self.max_bytes {
                break;
            }
            if path == keep {
                continue;
            }
            if std::fs::remove_file(&path).is_ok() {
                total = total.saturating_sub(len);
            }
        }
    }

    /// Records the files an index page links, with their hashes.
    fn learn(&self, host: &str, port: u16, path: &str, content_type: &str, body: &[u8]) {
        let text = String::from_utf8_lossy(body);
        let links: Vec<(String, Sum)> = match self.kind {
            Kind::Npm => npm_links(&text),
            Kind::Python if content_type.contains("json") => json_links(&text)
                .into_iter()
                .map(|(url, sha)| (url, Sum::Sha256(sha)))
                .collect(),
            Kind::Python => html_links(&text)
                .into_iter()
                .map(|(url, sha)| (url, Sum::Sha256(sha)))
                .collect(),
        };
        let mut hashes = self.hashes.lock().unwrap_or_else(PoisonError::into_inner);
        // Every page a sandbox asks for adds its links: the map is bounded, and a page read
        // again (from the cache or the index) teaches its links again.
        if hashes.len() + links.len() > MAX_LEARNED {
            hashes.clear();
        }
        for (href, sha) in links.into_iter().take(MAX_LEARNED) {
            if let Some((h, p, file)) = join(host, port, path, &href) {
                hashes.insert(file_key(&h, p, strip_query(&file)), sha);
            }
        }
    }

    async fn fetch(
        &self,
        host: &str,
        port: u16,
        path: &str,
        headers: &[(String, String)],
    ) -> Result<Response, String> {
        let addrs: Vec<IpAddr> = if host == self.index.host && !self.resolve.is_empty() {
            self.resolve.clone()
        } else {
            match tokio::time::timeout(self.connect_timeout, tokio::net::lookup_host((host, port)))
                .await
            {
                Ok(Ok(found)) => found.map(|a| a.ip()).collect(),
                Ok(Err(e)) => return Err(format!("the index {host} did not resolve: {e}")),
                Err(_) => return Err(format!("the index {host} did not resolve in time")),
            }
        };
        let mut last = format!("{host} resolved to no address");
        for addr in addrs {
            let to = SocketAddr::new(addr, port);
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(to)).await {
                Ok(Ok(stream)) => {
                    self.upstream.fetch_add(1, Ordering::Relaxed);
                    if !self.index.tls {
                        return Response::ask(Box::new(stream), host, port, path, headers).await;
                    }
                    let config = self
                        .tls
                        .lock()
                        .ok()
                        .and_then(|c| c.clone())
                        .ok_or_else(|| {
                            "the cache has no TLS client for an https:// index".to_owned()
                        })?;
                    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                        .map_err(|e| format!("{host} is not a TLS name: {e}"))?;
                    let tls = tokio::time::timeout(
                        self.connect_timeout,
                        tokio_rustls::TlsConnector::from(config).connect(name, stream),
                    )
                    .await
                    .map_err(|_| format!("the index {host} did not finish TLS in time"))?
                    .map_err(|e| {
                        format!("the index {host} did not prove who it is over TLS: {e}")
                    })?;
                    return Response::ask(Box::new(tls), host, port, path, headers).await;
                }
                Ok(Err(e)) => last = format!("the index at {to} refused the connection: {e}"),
                Err(_) => last = format!("the index at {to} did not answer in time"),
            }
        }
        Err(last)
    }
}

fn strip_query(path: &str) -> &str {
    path.split(['?', '#']).next().unwrap_or(path)
}

fn file_key(host: &str, port: u16, path: &str) -> String {
    format!("{host}:{port}{path}")
}

enum Answer {
    Bytes(Vec<u8>),
    File(PathBuf, u64),
}

enum Body<'a> {
    Bytes(&'a [u8]),
    File(&'a Path, u64),
}

impl Answer {
    fn len(&self) -> u64 {
        match self {
            Answer::Bytes(b) => b.len() as u64,
            Answer::File(_, n) => *n,
        }
    }

    fn as_ref(&self) -> Body<'_> {
        match self {
            Answer::Bytes(b) => Body::Bytes(b),
            Answer::File(p, n) => Body::File(p, *n),
        }
    }
}

fn head_of(status: u16, content_type: &str, len: u64, cache: &str) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        502 => "Bad Gateway",
        _ => "",
    };
    let content_type = content_type.replace(['\r', '\n'], " ");
    let content_type = if content_type.is_empty() {
        "application/octet-stream".to_owned()
    } else {
        content_type
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len}\r\nX-Tandem-Cache: {cache}\r\nConnection: close\r\n\r\n"
    )
    .into_bytes()
}

/// Writes a head and a body; answers the bytes written.
async fn write_all<S: AsyncWrite + Unpin>(client: &mut S, head: &[u8], body: Body<'_>) -> u64 {
    if client.write_all(head).await.is_err() {
        return 0;
    }
    let mut n = head.len() as u64;
    match body {
        Body::Bytes(b) => {
            if client.write_all(b).await.is_ok() {
                n += b.len() as u64;
            }
        }
        Body::File(path, len) => {
            let Ok(mut file) = tokio::fs::File::open(path).await else {
                return n;
            };
            let mut buf = vec![0u8; 64 * 1024];
            let mut left = len;
            while left > 0 {
                let Ok(k) = file.read(&mut buf).await else {
                    break;
                };
                if k == 0 {
                    break;
                }
                let k = k.min(usize::try_from(left).unwrap_or(usize::MAX));
                if client.write_all(&buf[..k]).await.is_err() {
                    break;
                }
                n += k as u64;
                left -= k as u64;
            }
        }
    }
    let _ = client.flush().await;
    let _ = client.shutdown().await;
    n
}

struct HashingWriter<'a> {
    file: &'a mut tokio::fs::File,
    hash: Hasher,
    len: u64,
}

impl Sink for HashingWriter<'_> {
    async fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.hash.update(bytes);
        self.len += bytes.len() as u64;
        self.file.write_all(bytes).await
    }
}

impl Sink for Vec<u8> {
    async fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.extend_from_slice(bytes);
        Ok(())
    }
}

/// Where a response body goes.
trait Sink {
    async fn put(&mut self, bytes: &[u8]) -> std::io::Result<()>;
}

/// One response from the index, its head read, its body not yet.
/// A connection to the index, plain or TLS.
trait Conn: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Conn for T {}

struct Response {
    stream: Box<dyn Conn>,
    status: u16,
    content_type: String,
    framing: Framing,
    /// Body bytes read with the head.
    early: Vec<u8>,
}

enum Framing {
    Length(u64),
    Chunked,
    Close,
}

impl Response {
    async fn ask(
        mut stream: Box<dyn Conn>,
        host: &str,
        port: u16,
        path: &str,
        headers: &[(String, String)],
    ) -> Result<Response, String> {
        let authority = if port == 80 || port == 443 {
            host.to_owned()
        } else {
            format!("{host}:{port}")
        };
        let mut head = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\n");
        for (name, value) in headers {
            if ["accept", "user-agent"].contains(&name.to_ascii_lowercase().as_str()) {
                head.push_str(&format!("{name}: {value}\r\n"));
            }
        }
        // Bodies are hashed and kept as the index sent them: no compression.
        head.push_str("Accept-Encoding: identity\r\nConnection: close\r\n\r\n");
        let io = |e: std::io::Error| format!("talking to the index {authority}: {e}");
        tokio::time::timeout(Duration::from_secs(30), stream.write_all(head.as_bytes()))
            .await
            .map_err(|_| format!("the index {authority} took no request in time"))?
            .map_err(io)?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let (status, content_type, framing, used) = loop {
            let n = tokio::time::timeout(Duration::from_secs(60), stream.read(&mut chunk))
                .await
                .map_err(|_| format!("the index {authority} did not answer in time"))?
                .map_err(io)?;
            if n == 0 {
                return Err(format!("the index {authority} closed without answering"));
            }
            buf.extend_from_slice(&chunk[..n]);
            let mut headers = [httparse::EMPTY_HEADER; 100];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(&buf) {
                Ok(httparse::Status::Complete(used)) => {
                    let status = response.code.unwrap_or(502);
                    let find = |name: &str| {
                        response
                            .headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case(name))
                            .map(|h| String::from_utf8_lossy(h.value).trim().to_owned())
                    };
                    let content_type = find("content-type").unwrap_or_default();
                    let framing = if find("transfer-encoding")
                        .is_some_and(|t| t.to_ascii_lowercase().contains("chunked"))
                    {
                        Framing::Chunked
                    } else if let Some(len) = find("content-length") {
                        Framing::Length(len.parse().map_err(|_| {
                            format!("the index {authority} sent a bad Content-Length {len:?}")
                        })?)
                    } else {
                        Framing::Close
                    };
                    if find("content-encoding").is_some_and(|e| !e.eq_ignore_ascii_case("identity"))
                    {
                        return Err(format!(
                            "the index {authority} sent a compressed body though asked not to"
                        ));
                    }
                    break (status, content_type, framing, used);
                }
                Ok(httparse::Status::Partial) if buf.len() <= MAX_RESPONSE_HEAD => {}
                Ok(httparse::Status::Partial) => {
                    return Err(format!("the index {authority} sent a head over 64 KiB"));
                }
                Err(e) => return Err(format!("the index {authority} answered badly: {e}")),
            }
        };
        let early = buf.split_off(used);
        Ok(Response {
            stream,
            status,
            content_type,
            framing,
            early,
        })
    }

    /// Reads the body into `sink`, refusing one over `max` bytes.
    async fn body<K: Sink>(&mut self, sink: &mut K, max: u64) -> std::io::Result<()> {
        let mut reader = Reader {
            stream: &mut self.stream,
            early: std::mem::take(&mut self.early),
            at: 0,
        };
        let too_big = || std::io::Error::other(format!("the body is over {max} bytes"));
        match self.framing {
            Framing::Length(len) => {
                if len > max {
                    return Err(too_big());
                }
                reader.copy(sink, len, true).await
            }
            Framing::Close => reader.copy(sink, max.saturating_add(1), false).await,
            Framing::Chunked => {
                let mut total = 0u64;
                loop {
                    let line = reader.line().await?;
                    let size = line.split(';').next().unwrap_or("").trim();
                    let size = u64::from_str_radix(size, 16)
                        .map_err(|_| std::io::Error::other(format!("a bad chunk size {size:?}")))?;
                    if size == 0 {
                        return Ok(());
                    }
                    total = total.saturating_add(size);
                    if total > max {
                        return Err(too_big());
                    }
                    reader.copy(sink, size, true).await?;
                    reader.line().await?;
                }
            }
        }
    }
}

/// Reads a response body: bytes read with the head first, then the stream, each read
/// bounded by an idle timeout.
struct Reader<'a> {
    stream: &'a mut Box<dyn Conn>,
    early: Vec<u8>,
    at: usize,
}

impl Reader<'_> {
    async fn fill(&mut self) -> std::io::Result<usize> {
        if self.at < self.early.len() {
            return Ok(self.early.len() - self.at);
        }
        let mut chunk = vec![0u8; 64 * 1024];
        let n = tokio::time::timeout(Duration::from_secs(60), self.stream.read(&mut chunk))
            .await
            .map_err(|_| std::io::Error::other("the index sent nothing for 60 s"))??;
        chunk.truncate(n);
        self.early = chunk;
        self.at = 0;
        Ok(n)
    }

    /// Copies `len` bytes (or up to the end when `exact` is false, failing past `len`).
    async fn copy<K: Sink>(&mut self, sink: &mut K, len: u64, exact: bool) -> std::io::Result<()> {
        let mut left = len;
        while left > 0 {
            let have = self.fill().await?;
            if have == 0 {
                return if exact {
                    Err(std::io::Error::other(
                        "the index closed before the whole body",
                    ))
                } else {
                    Ok(())
                };
            }
            let take = have.min(usize::try_from(left).unwrap_or(usize::MAX));
            sink.put(&self.early[self.at..self.at + take]).await?;
            self.at += take;
            left -= take as u64;
        }
        if exact {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "the body is over {} bytes",
                len.saturating_sub(1)
            )))
        }
    }

    async fn line(&mut self) -> std::io::Result<String> {
        let mut line = Vec::new();
        loop {
            if self.fill().await? == 0 {
                return Err(std::io::Error::other("the index closed mid-chunk"));
            }
            let byte = self.early[self.at];
            self.at += 1;
            if byte == b'\n' {
                return Ok(String::from_utf8_lossy(&line).trim_end().to_owned());
            }
            line.push(byte);
            if line.len() > 1024 {
                return Err(std::io::Error::other("a chunk line over 1 KiB"));
            }
        }
    }
}

/// `href`s of an HTML index page that carry a `#sha256=` fragment.
fn html_links(text: &str) -> Vec<(String, [u8; 32])> {
    let mut out = Vec::new();
    let lower = text.to_ascii_lowercase();
    let mut from = 0;
    while let Some(i) = lower[from..].find("href=") {
        let start = from + i + 5;
        from = start;
        let Some(quote) = text[start..].chars().next() else {
            break;
        };
        if quote != '"' && quote != '\'' {
            continue;
        }
        let Some(end) = text[start + 1..].find(quote) else {
            break;
        };
        let href = text[start + 1..start + 1 + end].replace("&amp;", "&");
        from = start + 1 + end;
        if let Some((url, sha)) = with_sha(&href) {
            out.push((url, sha));
        }
    }
    out
}

/// Files of a PEP 691 JSON page that carry a sha256.
fn json_links(text: &str) -> Vec<(String, [u8; 32])> {
    let Ok(page) = serde_json::from_str::<serde_json::Value>(text) else {
        return Vec::new();
    };
    let Some(files) = page.get("files").and_then(|f| f.as_array()) else {
        return Vec::new();
    };
    files
        .iter()
        .filter_map(|f| {
            let url = f.get("url")?.as_str()?;
            let sha = f.get("hashes")?.get("sha256")?.as_str()?;
            Some((url.split('#').next()?.to_owned(), parse_sha(sha)?))
        })
        .collect()
}

/// The tarballs of an npm packument (full or abbreviated) with their `sha512` integrity.
fn npm_links(text: &str) -> Vec<(String, Sum)> {
    use base64::Engine as _;
    let Ok(page) = serde_json::from_str::<serde_json::Value>(text) else {
        return Vec::new();
    };
    let Some(versions) = page.get("versions").and_then(|v| v.as_object()) else {
        return Vec::new();
    };
    versions
        .values()
        .filter_map(|v| {
            let dist = v.get("dist")?;
            let url = dist.get("tarball")?.as_str()?;
            // An integrity may list several digests; the sha512 one is taken.
            let sha = dist
                .get("integrity")?
                .as_str()?
                .split_whitespace()
                .find_map(|d| d.strip_prefix("sha512-"))?;
            let bytes = base64::engine::general_purpose::STANDARD.decode(sha).ok()?;
            Some((url.to_owned(), Sum::Sha512(bytes.try_into().ok()?)))
        })
        .collect()
}

fn with_sha(href: &str) -> Option<(String, [u8; 32])> {
    let (url, fragment) = href.split_once('#')?;
    let sha = fragment
        .split('&')
        .find_map(|kv| kv.strip_prefix("sha256="))?;
    Some((url.to_owned(), parse_sha(sha)?))
}

fn parse_sha(text: &str) -> Option<[u8; 32]> {
    let bytes = hex::decode(text.trim()).ok()?;
    bytes.try_into().ok()
}

/// Resolves `href` against the page at `host:port` `page`: answers the file's host, port
/// and path (port 443 is `https://`, as the index's pages give it).
fn join(host: &str, port: u16, page: &str, href: &str) -> Option<(String, u16, String)> {
    let absolute = href
        .strip_prefix("http://")
        .map(|rest| (rest, 80))
        .or_else(|| href.strip_prefix("https://").map(|rest| (rest, 443)));
    if let Some((rest, default)) = absolute {
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (h, p) = match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse().ok()?),
            None => (authority, default),
        };
        let h = crate::rule::normalize_host(h).ok()?.to_string();
        return Some((h, p, normalize_path(path)?));
    }
    if href.contains("://") {
        return None;
    }
    if let Some(rest) = href.strip_prefix("//") {
        let scheme = if port == 443 { "https" } else { "http" };
        return join(host, port, page, &format!("{scheme}://{rest}"));
    }
    let path = if href.starts_with('/') {
        href.to_owned()
    } else {
        let base = &page[..page.rfind('/').map_or(0, |i| i + 1)];
        format!("{base}{href}")
    };
    Some((host.to_owned(), port, normalize_path(&path)?))
}

/// `..` and `.` folded away, as a client would before asking.
fn normalize_path(path: &str) -> Option<String> {
    let (path, query) = match path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path, None),
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/').skip(1) {
        match part {
            "." => {}
            ".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    let mut out = format!("/{}", parts.join("/"));
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn links_are_joined_to_their_page_as_a_client_joins_them() {
        let page = "/simple/demo/";
        assert_eq!(
            join("pypi.test", 80, page, "../../packages/demo-1.0.whl"),
            Some(("pypi.test".into(), 80, "/packages/demo-1.0.whl".into()))
        );
        assert_eq!(
            join("pypi.test", 80, page, "/files/x.whl"),
            Some(("pypi.test".into(), 80, "/files/x.whl".into()))
        );
        assert_eq!(
            join("pypi.test", 80, page, "http://Files.Test:8080/a/b.whl"),
            Some(("files.test".into(), 8080, "/a/b.whl".into()))
        );
        assert_eq!(
            join("pypi.test", 80, page, "https://files.test/a.whl"),
            Some(("files.test".into(), 443, "/a.whl".into()))
        );
        assert_eq!(join("pypi.test", 80, page, "ftp://files.test/a.whl"), None);
    }

    #[test]
    fn only_links_with_a_sha256_are_learned() {
        let sha = "a".repeat(64);
        let html = format!(
            "<a href=\"demo-1.0.whl#sha256={sha}\">x</a><a href='nohash.whl'>y</a><a HREF=\"b.whl#md5=00&amp;sha256={sha}\">z</a>"
        );
        let links = html_links(&html);
        assert_eq!(
            links.iter().map(|l| l.0.as_str()).collect::<Vec<_>>(),
            ["demo-1.0.whl", "b.whl"]
        );
        let json =
            format!("{{\"files\":[{{\"url\":\"c.whl\",\"hashes\":{{\"sha256\":\"{sha}\"}}}}]}}");
        assert_eq!(json_links(&json)[0].0, "c.whl");
    }

    #[test]
    fn an_npm_packument_teaches_its_tarballs_sha512_and_nothing_without_one() {
        let digest = [7u8; 64];
        let integrity = {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(digest)
        };
        let packument = format!(
            "{{\"versions\":{{\"1.0.0\":{{\"dist\":{{\"tarball\":\"http://npm.test/t/a-1.0.0.tgz\",\"integrity\":\"sha1-xx sha512-{integrity}\"}}}},\"2.0.0\":{{\"dist\":{{\"tarball\":\"http://npm.test/t/a-2.0.0.tgz\",\"shasum\":\"00\"}}}}}}}}"
        );
        assert_eq!(
            npm_links(&packument),
            [(
                "http://npm.test/t/a-1.0.0.tgz".to_owned(),
                Sum::Sha512(digest)
            )]
        );
        assert!(npm_links("not json").is_empty());
    }

    #[test]
    fn pages_and_files_are_evicted_oldest_first_to_the_bound_but_not_the_one_served() {
        let dir = tempfile::tempdir().unwrap();
        let index = IndexUrl::parse("http://pypi.test/simple/").unwrap();
        let cache = Packages::new(index, dir.path().to_owned(), 250, Vec::new()).unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        let mut made = Vec::new();
        for (i, place) in ["files/a", "pages/b", "files/c", "pages/d"]
            .iter()
            .enumerate()
        {
            let path = dir.path().join(place);
            std::fs::write(&path, [0u8; 100]).unwrap();
            let file = std::fs::File::options().append(true).open(&path).unwrap();
            file.set_modified(old + Duration::from_secs(i as u64 * 60))
                .unwrap();
            made.push(path);
        }
        // The oldest (a) is the one being served: kept; b and c go, leaving 200 bytes.
        cache.evict(&made[0]);
        let left: Vec<bool> = made.iter().map(|p| p.exists()).collect();
        assert_eq!(left, [true, false, false, true]);
    }

    #[test]
    fn an_index_url_is_checked() {
        let url = IndexUrl::parse("http://PyPI.test:8080/simple").unwrap();
        assert_eq!(
            (url.host.as_str(), url.port, url.path.as_str()),
            ("pypi.test", 8080, "/simple/")
        );
        assert_eq!(url.url(), "http://pypi.test:8080/simple/");
        let tls = IndexUrl::parse("https://pypi.test/simple/").unwrap();
        assert_eq!(
            (tls.tls, tls.port, tls.url().as_str()),
            (true, 443, "https://pypi.test/simple/")
        );
        assert!(IndexUrl::parse("ftp://x/").is_err());
        assert!(IndexUrl::parse("http:///simple/").is_err());
        assert!(IndexUrl::parse("http://u:p@x/").is_err());
    }
}
