//! The workspace of a task run in this process: made by this process, removed when the task
//! is done with it, or kept where no later Tandem removes it.

use std::path::PathBuf;

use anyhow::{Context, Result};

/// The workspace of a task run in this process, which this process makes and removes (when
/// dropped too): in a root named for this process, so a later Tandem removes it if this one
/// is killed.
pub(super) struct OwnWorkspace {
    temp: tandem_executor_kit::scratch::TempTree,
    pub(super) path: PathBuf,
    root: PathBuf,
}

/// Prefix of the roots of [`OwnWorkspace`]s in `$TMPDIR`.
const RUN_ROOT: &str = "tandem-run-";

impl OwnWorkspace {
    pub(super) fn new() -> Result<Self> {
        tandem_executor_kit::scratch::reap_dead_roots(RUN_ROOT);
        let root = tandem_executor_kit::scratch::process_root(RUN_ROOT);
        let temp = tandem_executor_kit::scratch::temp_in(&root, "ws-")
            .context("cannot make a workspace for the task")?;
        // Canonical, as a session makes a workdir, so paths resolved inside compare equal.
        let path = temp
            .path()
            .canonicalize()
            .context("cannot make a workspace for the task")?;
        Ok(Self { temp, path, root })
    }

    /// Removes it.
    pub(super) fn remove(self) {
        if let Err(e) = self.temp.close() {
            tracing::warn!(workspace = %self.path.display(), error = %e, "could not remove the task's workspace");
        }
        tandem_executor_kit::scratch::remove_root_if_empty(&self.root);
    }

    /// Moves it where no later Tandem removes it, and says where it is.
    pub(super) fn keep(self, id: &str) -> PathBuf {
        let to = std::env::temp_dir().join(format!("tandem-workspace-{id}"));
        if std::fs::rename(&self.path, &to).is_err() {
            // Left where it is, and not removed by this process.
            std::mem::forget(self.temp);
            return self.path;
        }
        // What the temporary directory's drop removes is gone already.
        drop(self.temp);
        tandem_executor_kit::scratch::remove_root_if_empty(&self.root);
        to
    }
}
