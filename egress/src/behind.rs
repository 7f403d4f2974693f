//! An executor whose every session is put behind the egress proxy: one task's policy, its
//! byte budget and its event sink, whichever of the task's agents or branches opens it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tandem_executor::{
    EgressSocket, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, HostStatus, Language,
    Session, SessionSpec, files,
};

use crate::Policy;
use crate::proxy::{BoxFuture, Carried, Egress, Grant, NetSink, SocketGrant};

/// A task's executor behind the proxy: it opens each session with a socket of its own.
pub struct Behind {
    inner: Arc<dyn Executor>,
    egress: Egress,
    policy: Arc<Policy>,
    carried: Arc<Carried>,
    sink: Arc<dyn NetSink>,
}

impl Behind {
    /// `inner`'s sessions, each behind `egress` under `policy`, recorded into `sink`.
    pub fn new(
        inner: Arc<dyn Executor>,
        egress: Egress,
        policy: Arc<Policy>,
        sink: Arc<dyn NetSink>,
    ) -> Behind {
        Behind {
            inner,
            egress,
            policy,
            carried: Arc::new(Carried::default()),
            sink,
        }
    }

    /// Counts what its sandboxes carry in `carried`, shared with other executors of the
    /// same task, so that `max_bytes` bounds the task, not each executor.
    pub fn sharing(mut self, carried: Arc<Carried>) -> Behind {
        self.carried = carried;
        self
    }

    fn socket_for(&self) -> Result<(SocketGrant, PathBuf), ExecError> {
        use std::os::unix::fs::PermissionsExt;
        let root = self.egress.socket_dir();
        let dir = root.join(uuid::Uuid::new_v4().simple().to_string());
        let fail = |source| ExecError::Workspace {
            path: dir.clone(),
            source,
        };
        // Whoever can connect to a socket acts under its grant: the directories are not
        // listable by other users, and a socket's name cannot be guessed.
        std::fs::create_dir_all(&dir).map_err(fail)?;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).map_err(fail)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).map_err(fail)?;
        let grant = Grant::new(self.policy.clone(), self.carried.clone(), self.sink.clone());
        let socket = self
            .egress
            .listen_unix(&dir.join("proxy.sock"), grant)
            .map_err(fail)?;
        Ok((socket, dir))
    }
}

impl Executor for Behind {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn languages(&self) -> &[Language] {
        self.inner.languages()
    }

    fn open(&self, mut spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        Box::pin(async move {
            if !self.inner.carries_egress() {
                return Err(ExecError::Unavailable {
                    what: format!("a network policy on the {} executor", self.inner.name()),
                    hint: "its sandboxes cannot be put behind Tandem's egress proxy; run the task on the docker, kubernetes or confined local executor, or without `network`".to_owned(),
                });
            }
            let (socket, dir) = self.socket_for()?;
            let ca_bundle = match self.egress.broker() {
                Some(broker) => {
                    let path = dir.join("ca.pem");
                    std::fs::write(&path, broker.bundle()).map_err(|source| {
                        ExecError::Workspace {
                            path: path.clone(),
                            source,
                        }
                    })?;
                    Some(path)
                }
                None => None,
            };
            spec.egress = Some(EgressSocket {
                socket: socket.path().to_owned(),
                env: self.egress.sandbox_env(),
                ca_bundle,
                adopt: Some(socket.adopter()),
            });
            let session = self.inner.open(spec).await?;
            Ok(Box::new(BehindSession {
                session,
                socket,
                dir,
            }) as Box<dyn Session>)
        })
    }

    fn supports(&self, language: &Language) -> bool {
        self.inner.supports(language)
    }

    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        self.inner.health()
    }

    fn network(&self) -> bool {
        true
    }

    fn keeps_state(&self) -> bool {
        self.inner.keeps_state()
    }

    fn carries_tool_calls(&self) -> bool {
        self.inner.carries_tool_calls()
    }

    fn carries_egress(&self) -> bool {
        self.inner.carries_egress()
    }

    fn mounts_volumes(&self) -> bool {
        self.inner.mounts_volumes()
    }

    fn pools(&self) -> Vec<tandem_executor::PoolStatus> {
        self.inner.pools()
    }

    fn hosts(&self) -> Vec<HostStatus> {
        self.inner.hosts()
    }
}

/// A session and the socket that is its one way out; the socket goes when it does.
struct BehindSession {
    session: Box<dyn Session>,
    socket: SocketGrant,
    dir: PathBuf,
}

impl Drop for BehindSession {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Session for BehindSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        self.socket.new_block();
        self.session.run(req, ctx)
    }

    fn workspace(&self) -> Option<&Path> {
        self.session.workspace()
    }

    fn host(&self) -> Option<&str> {
        self.session.host()
    }

    fn pool_wait(&self) -> Option<std::time::Duration> {
        self.session.pool_wait()
    }

    fn put_archive(
        &mut self,
        archive: &Path,
        caps: files::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<files::ArchivedFile>, ExecError>> {
        self.session.put_archive(archive, caps)
    }

    fn ports(&self) -> Option<std::sync::Arc<dyn tandem_executor::Ports>> {
        self.session.ports()
    }

    fn save_state(
        &mut self,
        dest: &Path,
        max_bytes: u64,
        wait: std::time::Duration,
    ) -> BoxFuture<'_, Result<Option<tandem_executor::SavedState>, ExecError>> {
        self.session.save_state(dest, max_bytes, wait)
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        let mut this = self;
        let session = std::mem::replace(&mut this.session, Box::new(Closed));
        Box::pin(async move {
            // The socket stays until the sandbox is gone, then goes with `this`.
            let closed = session.close().await;
            drop(this);
            closed
        })
    }
}

/// What a closed session leaves in its place while its socket is dropped.
struct Closed;

impl Session for Closed {
    fn run(
        &mut self,
        _: ExecRequest,
        _: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(async { Err(ExecError::Backend("the session is closed".to_owned())) })
    }

    fn workspace(&self) -> Option<&Path> {
        None
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        Box::pin(async { Ok(()) })
    }
}
