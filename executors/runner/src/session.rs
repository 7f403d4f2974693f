//! What a session whose blocks a runner runs does the same in every sandbox: start a runner
//! again when the last one died, run a block, keep the workspace's mirror, put files in. A
//! container executor gives only its [`Transport`]: how a runner starts in its sandbox and
//! how files go in and out of it.

use std::path::PathBuf;

use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Language, Limits,
};
use tandem_executor_kit::archive::{ArchiveCaps, ArchivedFile};

use crate::mirror::{self, Fetch};
use crate::{Conn, Prepared, READY_LIMIT, Request, Sandbox};

/// How a runner is reached in one sandbox, and how files cross into it.
pub trait Transport: Send {
    /// The sandbox, for logs: a container's id, a pod's name.
    fn name(&self) -> &str;

    /// Starts a runner in the sandbox and connects to it.
    fn start(&mut self) -> BoxFuture<'_, Result<Conn, ExecError>>;

    /// Starts a runner again after the last one died or was ended.
    fn restart(&mut self) -> BoxFuture<'_, Result<Conn, ExecError>> {
        self.start()
    }

    /// Ends a runner that stopped answering; an error says the sandbox's host is gone.
    fn stop(&mut self) -> BoxFuture<'_, Result<(), ExecError>>;

    /// Unpacks `archive`, a tar owned by the blocks' user, into the sandbox's `/workspace`.
    fn unpack(&mut self, archive: std::fs::File) -> BoxFuture<'_, Result<(), ExecError>>;

    /// What copies paths out of the sandbox into the mirror.
    fn fetcher(&self) -> Box<dyn Fetch>;
}

/// What the sandbox runs, and as whom.
pub struct Offer {
    /// The executor's name, for errors.
    pub executor: &'static str,
    /// The languages it runs.
    pub languages: Vec<Language>,
    /// The executor's own variables for every block.
    pub env: Vec<(String, String)>,
    /// The blocks' user, `uid:gid`, whom files put in the sandbox belong to.
    pub user: String,
}

/// The part of a session that is the same whatever the sandbox: the runner's connection,
/// the workspace on this machine and the blocks run so far.
pub struct RunnerSession {
    /// The workspace on this machine: bound into the sandbox, or the mirror of its own.
    pub workspace: PathBuf,
    /// `workspace` is a mirror, copied in before and out after every block, rather than
    /// the very directory the sandbox sees.
    mirrored: bool,
    offer: Offer,
    limits: Limits,
    /// `None` after the runner died; the next block starts another.
    conn: Option<Conn>,
    /// The mirror missed a block's changes: the next copy takes the whole workspace.
    resync: bool,
    blocks: u32,
}

impl RunnerSession {
    /// A session on `workspace` (a mirror when `mirrored`) whose runner is not started yet.
    pub fn new(workspace: PathBuf, mirrored: bool, offer: Offer, limits: Limits) -> Self {
        Self {
            workspace,
            mirrored,
            offer,
            limits,
            conn: None,
            resync: false,
            blocks: 0,
        }
    }

    /// Connected to a runner already started.
    pub fn with_conn(mut self, conn: Option<Conn>) -> Self {
        self.conn = conn;
        self
    }

    /// Starts the first runner; a mirror that holds files is copied in.
    pub async fn start(&mut self, transport: &mut dyn Transport) -> Result<(), ExecError> {
        self.conn = Some(transport.start().await?);
        if self.mirrored && mirror::has_entries(&self.workspace) {
            self.upload(transport, None).await?;
        }
        Ok(())
    }

    /// The runner's connection, taken (to keep it elsewhere, or to end it).
    pub fn take_conn(&mut self) -> Option<Conn> {
        self.conn.take()
    }

    /// Sends `op` to the runner and waits for its `d`.
    pub async fn request_done(&mut self, op: &Request<'_>) -> Result<(), ExecError> {
        match self.conn.as_mut() {
            Some(conn) => conn.request_done(op, READY_LIMIT).await,
            None => Err(not_running()),
        }
    }

    /// Copies the mirror (`None`), or these files of it, into the sandbox, owned by the
    /// blocks' user, and has the runner take them as seen (they are no block's changes).
    pub async fn upload(
        &mut self,
        transport: &mut dyn Transport,
        files: Option<Vec<PathBuf>>,
    ) -> Result<(), ExecError> {
        let owner = mirror::block_owner(&self.offer.user);
        let packed = mirror::pack(&self.workspace, files, owner).await?;
        transport.unpack(packed).await?;
        self.request_done(&Request::Rescan).await
    }

    /// Checks and places the files of `archive` in the workspace, then in the sandbox.
    pub async fn put_archive(
        &mut self,
        transport: &mut dyn Transport,
        archive: PathBuf,
        caps: ArchiveCaps,
    ) -> Result<Vec<ArchivedFile>, ExecError> {
        // Bound into the sandbox, the files must be the blocks' user's to change; a mirror
        // is copied in as theirs below.
        let owner = (!self.mirrored).then(|| {
            let (uid, gid) = mirror::block_owner(&self.offer.user);
            (
                u32::try_from(uid).unwrap_or(65534),
                u32::try_from(gid).unwrap_or(65534),
            )
        });
        let placed = tandem_executor_kit::place_archive_for(
            Some(self.workspace.clone()),
            archive,
            caps,
            owner,
        )
        .await?;
        if self.mirrored {
            let paths: Vec<PathBuf> = placed.iter().map(|f| f.path.clone()).collect();
            self.upload(transport, Some(paths)).await?;
        }
        Ok(placed)
    }

    /// Starts a runner again (files in the workspace survive).
    async fn restart(&mut self, transport: &mut dyn Transport) -> Result<(), ExecError> {
        self.conn = Some(transport.restart().await?);
        if self.mirrored {
            // The new runner has seen nothing: it takes the workspace as it is, which the
            // last copy out already holds.
            self.request_done(&Request::Rescan).await?;
        }
        Ok(())
    }

    /// Runs one block, starting a runner first when the last one is gone.
    pub async fn run(
        &mut self,
        transport: &mut dyn Transport,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> Result<ExecOutcome, ExecError> {
        // A runner whose stream ended while it sat idle is gone: writing a large block to
        // it would wait forever.
        if self.conn.as_mut().is_some_and(|c| !c.alive()) {
            self.conn = None;
        }
        if self.conn.is_none() {
            self.restart(transport).await?;
        }
        self.blocks += 1;
        let sandbox = Sandbox {
            executor: self.offer.executor,
            languages: &self.offer.languages,
            env: crate::base_env(&self.offer.env).collect(),
        };
        let conn = self.conn.as_mut().ok_or_else(not_running)?;
        let block = match crate::run(conn, &sandbox, &req, &ctx, &self.limits, self.blocks).await? {
            Prepared::Ready(block) => block,
            Prepared::Refused(outcome) => return Ok(*outcome),
        };
        if !block.answered {
            tracing::warn!(sandbox = %transport.name(), "the runner stopped answering; starting another for the next block");
            self.conn = None;
            transport.stop().await?;
        }
        if let Some(e) = &block.runner_error {
            // What the block changed was not reported: the next copy takes it all.
            self.resync = true;
            return Err(ExecError::Backend(format!("Tandem's runner failed: {e}")));
        }
        let mut block = *block;
        if self.mirrored {
            // Copied out after every block: the mirror is what the task's files API shows
            // and what carries the task on if the sandbox goes away.
            let (changes, inline) = block.take_changes();
            let mut fetch = transport.fetcher();
            let synced = mirror::sync(
                &self.workspace,
                changes,
                inline,
                self.resync,
                fetch.as_mut(),
            )
            .await;
            self.resync = synced.is_err();
            if let Err(e) = synced {
                tracing::warn!(sandbox = %transport.name(), error = %e, "copying the workspace out failed; the next block copies all of it");
            }
        }
        Ok(block.outcome())
    }
}

fn not_running() -> ExecError {
    ExecError::Backend("the session's runner is not running".to_owned())
}
