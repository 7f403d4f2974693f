//! Per-process directories for temporary workspaces, and reaping the ones a dead Tandem left.
//!
//! Each backend keeps its temporary directories under `$TMPDIR/<prefix><pid>-<start-time>/`,
//! so a later Tandem can tell (from the owner's pid and start time) which roots belong to a
//! process that has died without cleaning up, and remove them.

use std::path::{Path, PathBuf};

use tandem_executor::ExecError;

use crate::{keeper, owner};

/// This process's root for `prefix`: `$TMPDIR/<prefix><pid>-<start-time>`.
pub fn process_root(prefix: &str) -> PathBuf {
    process_root_in(&std::env::temp_dir(), prefix)
}

/// This process's root for `prefix` in `base`: `<base>/<prefix><pid>-<start-time>`.
pub fn process_root_in(base: &Path, prefix: &str) -> PathBuf {
    let pid = std::process::id();
    base.join(format!(
        "{prefix}{pid}-{}",
        owner::start_time(pid).unwrap_or_default()
    ))
}

/// A temporary directory that code in a sandbox may have shaped: removed, when closed or
/// dropped, by the keeper (iteratively, no link followed), never by a recursive delete that
/// a deep tree would overflow.
#[derive(Debug)]
pub struct TempTree {
    path: PathBuf,
    removed: bool,
}

impl TempTree {
    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes it now, saying whether that worked.
    pub fn close(mut self) -> std::io::Result<()> {
        self.removed = true;
        keeper::remove_tree(&self.path)
    }
}

impl Drop for TempTree {
    fn drop(&mut self) {
        if !self.removed {
            let _ = keeper::remove_tree(&self.path);
        }
    }
}

/// A temporary directory inside `root`, which is made (owner-only) when missing: the last
/// session to close removes `root` again, so a one-shot command leaves nothing in `$TMPDIR`.
pub fn temp_in(root: &Path, prefix: &str) -> std::io::Result<TempTree> {
    use std::os::unix::fs::DirBuilderExt;
    let make = || match std::fs::DirBuilder::new().mode(0o700).create(root) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    };
    let temp = || {
        tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in(root)
            .map(|dir| TempTree {
                path: dir.keep(),
                removed: false,
            })
    };
    make()?;
    match temp() {
        // Another session's close removed the root in between.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            make()?;
            temp()
        }
        other => other,
    }
}

/// A session's workspace, canonical: `workdir` (made if missing, kept afterwards) or a new
/// temporary directory in `root`, returned with its owner so it is removed with the session.
pub fn open_workspace(
    workdir: Option<PathBuf>,
    root: &Path,
    prefix: &str,
) -> Result<(PathBuf, Option<TempTree>), ExecError> {
    match workdir {
        Some(dir) => {
            let ws_err = |source| ExecError::Workspace {
                path: dir.clone(),
                source,
            };
            std::fs::create_dir_all(&dir).map_err(ws_err)?;
            let canonical = dir.canonicalize().map_err(ws_err)?;
            Ok((canonical, None))
        }
        None => {
            let temp =
                temp_in(root, prefix).map_err(|e| ExecError::io("creating a workspace", e))?;
            // Canonical, like a workdir, so paths resolved inside it compare equal.
            let path = temp
                .path()
                .canonicalize()
                .map_err(|e| ExecError::io("creating a workspace", e))?;
            Ok((path, Some(temp)))
        }
    }
}

/// Removes a closing session's temporary directories, then `root` if that left it empty; off
/// the async workers, since a big workspace takes a while to delete.
pub async fn remove_dirs(dirs: Vec<TempTree>, root: PathBuf) -> Result<(), ExecError> {
    tokio::task::spawn_blocking(move || {
        let result = dirs
            .into_iter()
            .map(TempTree::close)
            .fold(Ok(()), Result::and);
        remove_root_if_empty(&root);
        result
    })
    .await
    .map_err(|e| ExecError::Backend(format!("removing a session's directories failed: {e}")))?
    .map_err(|e| ExecError::io("removing the session's directories", e))
}

/// Removes `root` if it is empty; it stays while other sessions still have directories in it.
pub fn remove_root_if_empty(root: &Path) {
    let _ = std::fs::remove_dir(root);
}

/// Removes the roots for `prefix` whose owner process has died; returns how many it removed.
pub fn reap_dead_roots(prefix: &str) -> usize {
    reap_dead_roots_in(&std::env::temp_dir(), prefix)
}

/// [`reap_dead_roots`] in `base` instead of `$TMPDIR`.
pub fn reap_dead_roots_in(base: &Path, prefix: &str) -> usize {
    let Ok(entries) = std::fs::read_dir(base) else {
        return 0;
    };
    let mut reaped = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let Some((pid, start)) = rest.split_once('-') else {
            continue;
        };
        let tag = format!("{}/{pid}:{start}", owner::hostname());
        if !owner::owner_alive(&tag) && keeper::remove_tree(&entry.path()).is_ok() {
            reaped += 1;
        }
    }
    reaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_roots_are_reaped_and_live_ones_kept() {
        let prefix = format!("tandem-scratch-test-{}-", std::process::id());
        let live = process_root(&prefix);
        let ws = temp_in(&live, "ws-").unwrap();
        let dead = std::env::temp_dir().join(format!("{prefix}999999999-1"));
        std::fs::create_dir_all(dead.join("leftover")).unwrap();
        assert_eq!(reap_dead_roots(&prefix), 1);
        assert!(!dead.exists());
        assert!(ws.path().exists());
        ws.close().unwrap();
        remove_root_if_empty(&live);
        assert!(!live.exists());
    }
}
