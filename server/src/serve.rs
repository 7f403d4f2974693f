//! Listening: the Unix socket (owner-only) and optional TCP (bearer token), until shutdown.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tandem_executor::CancellationToken;
use tokio::net::{TcpListener, UnixListener};

use crate::api;
use crate::supervisor::Supervisor;

/// Why the daemon could not start listening.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Another daemon answers on the socket.
    #[error(
        "a Tandem daemon is already serving {0}; stop it first, or give this one another --socket"
    )]
    InUse(PathBuf),
    /// The socket or its directory could not be made.
    #[error("cannot listen on {path}: {source}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Binds the Unix socket at `path`: its directory made owner-only (0700), the socket 0600,
/// a stale socket file (no daemon behind it) replaced, a live one refused.
pub async fn bind_unix(path: &Path) -> Result<UnixListener, ListenError> {
    let io = |source| ListenError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.exists()
    {
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    if path.exists() {
        let probe = tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::UnixStream::connect(path),
        )
        .await;
        if matches!(probe, Ok(Ok(_))) {
            return Err(ListenError::InUse(path.to_owned()));
        }
        tracing::info!(socket = %path.display(), "replacing a stale socket");
        std::fs::remove_file(path).map_err(io)?;
    }
    let listener = UnixListener::bind(path).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    Ok(listener)
}

/// Where and how to serve.
pub struct Listeners {
    /// The Unix socket (no token: its permissions are the access control).
    pub unix: Option<UnixListener>,
    /// TCP, with the bearer token every request must carry.
    pub tcp: Option<(TcpListener, String)>,
    /// Bounds on the TCP listener's connections.
    pub limits: ConnLimits,
}

/// Bounds on TCP connections, whoever opens them: anyone who can reach the port can open
/// them before showing a token, so none of these waits on the token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Longest a connection may take to send a request's headers, and longest it may sit
    /// idle between requests; then it is closed.
    pub header_timeout: Duration,
    /// Most TCP connections open at once.
    pub max_connections: usize,
    /// Most TCP connections open at once that have not yet sent a request with the token.
    pub max_unauthenticated: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(30),
            max_connections: 512,
            max_unauthenticated: 64,
        }
    }
}

/// Serves the API until `shutdown` is cancelled; then takes no new tasks (503), gives running
/// tasks `grace` to finish and interrupts the rest (they resume on request), while still
/// serving reads and event streams, so followers see how their tasks ended; then returns.
pub async fn serve(
    supervisor: Arc<Supervisor>,
    listeners: Listeners,
    body_limit: usize,
    grace: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    // Closing the listeners and ending the streams waits for the tasks.
    let close = CancellationToken::new();
    let drain = {
        let (supervisor, shutdown, close) = (supervisor.clone(), shutdown.clone(), close.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            supervisor.shutdown(grace).await;
            close.cancel();
        })
    };
    // One pool of sandboxes for every listener: a session opened on the socket is the same
    // session over TCP.
    let sessions = crate::sandbox::Pool::new(supervisor.clone(), close.clone());
    sessions.recover_paused();
    let mut servers = tokio::task::JoinSet::new();
    if let Some(unix) = listeners.unix {
        let app = api::router(
            supervisor.clone(),
            sessions.clone(),
            None,
            body_limit,
            close.clone(),
        );
        let stop = close.clone();
        servers.spawn(async move {
            axum::serve(unix, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        });
    }
    if let Some((tcp, token)) = listeners.tcp {
        let app = api::router(
            supervisor.clone(),
            sessions.clone(),
            Some(token),
            body_limit,
            close.clone(),
        );
        let stop = close.clone();
        let limits = listeners.limits;
        servers.spawn(async move {
            serve_tcp(tcp, app, limits, stop).await;
            Ok(())
        });
    }
    let mut result = Ok(());
    while let Some(done) = servers.join_next().await {
        match done {
            Ok(Err(e)) => {
                result = Err(e);
                shutdown.cancel();
            }
            Err(e) => {
                result = Err(std::io::Error::other(e));
                shutdown.cancel();
            }
            Ok(Ok(())) => {}
        }
    }
    // A server that failed started the shutdown; the tasks are done or interrupted by now
    // (or are being, when every server failed before it).
    shutdown.cancel();
    let _ = drain.await;
    result
}

/// Serves `app` on `tcp` within `limits` until `stop`; then lets open responses (event
/// streams end with the daemon) finish, for at most a minute.
async fn serve_tcp(
    tcp: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    stop: CancellationToken,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tokio::sync::Semaphore;

    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let unauthenticated = Arc::new(Semaphore::new(limits.max_unauthenticated.max(1)));
    // Each connection is told to finish once `stop` fires, and waited for (a minute at most):
    // hyper-util's graceful watcher takes no connection that may be upgraded.
    let closing = CancellationToken::new();
    let connections = tokio_util::task::TaskTracker::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    loop {
        let accepted = tokio::select! {
            accepted = tcp.accept() => accepted,
            () = stop.cancelled() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, most likely: the Unix socket must keep its own, so
                // wait for connections to close rather than spin.
                tracing::warn!(error = %e, "accepting a TCP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Over a cap the connection is closed at once: a peer holding many learns it now,
        // and they cost the daemon nothing while they wait.
        let (Ok(slot), Ok(pending)) = (
            open.clone().try_acquire_owned(),
            unauthenticated.clone().try_acquire_owned(),
        ) else {
            tracing::debug!("a TCP connection over the caps was closed");
            continue;
        };
        let pending = api::Unauthenticated::new(pending);
        let app = app.clone();
        let service = hyper::service::service_fn(
            move |mut request: hyper::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(pending.clone());
                tower::ServiceExt::oneshot(app.clone(), request)
            },
        );
        // With upgrades: a sandbox's published port may speak WebSocket.
        let connection = http
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        let closing = closing.clone();
        connections.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                () = closing.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "a TCP connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(tcp);
    closing.cancel();
    connections.close();
    if tokio::time::timeout(Duration::from_secs(60), connections.wait())
        .await
        .is_err()
    {
        tracing::warn!("some TCP connections were still open a minute after the shutdown");
    }
}
