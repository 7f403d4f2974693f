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
    let mut servers = tokio::task::JoinSet::new();
    if let Some(unix) = listeners.unix {
        let app = api::router(supervisor.clone(), None, body_limit, close.clone());
        let stop = close.clone();
        servers.spawn(async move {
            axum::serve(unix, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        });
    }
    if let Some((tcp, token)) = listeners.tcp {
        let app = api::router(supervisor.clone(), Some(token), body_limit, close.clone());
        let stop = close.clone();
        servers.spawn(async move {
            axum::serve(tcp, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
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
