//! Killing every process a block started, including ones that left its process group.

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// Name of the environment variable that marks every process of one execution.
pub(crate) const MARKER_VAR: &str = "TANDEM_EXEC_ID";

/// Kills the block's process group and then any process still carrying its marker
/// (daemonised grandchildren that called `setsid` escape the group but keep the
/// environment). Dropping it does the same, so a cancelled future cleans up too.
pub(crate) struct TreeKiller {
    pgid: Option<Pid>,
    marker: String,
}

impl TreeKiller {
    pub(crate) fn new(pgid: Option<u32>, exec_id: &str) -> Self {
        Self {
            pgid: pgid.and_then(|p| i32::try_from(p).ok()).map(Pid::from_raw),
            marker: format!("{MARKER_VAR}={exec_id}"),
        }
    }

    pub(crate) fn kill_all(&self) {
        if let Some(pgid) = self.pgid {
            let _ = killpg(pgid, Signal::SIGKILL);
        }
        // A process may fork while we scan; a few passes catch its children. When a pass
        // killed something, the next waits a moment: a child forked just before its parent
        // died (`setsid` forks) can take that long to show in /proc. Nothing left (the usual
        // case) costs one pass and no wait.
        for pass in 0..5 {
            if kill_marked(self.marker.as_bytes()) == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5 << pass.min(3)));
        }
    }
}

impl Drop for TreeKiller {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Sends SIGKILL to every process whose environment names an owner that is no longer
/// running (left by a Tandem that died); returns how many.
pub(crate) fn kill_orphans() -> usize {
    let prefix = format!("{}=", tandem_executor::owner::OWNER_VAR);
    let mut killed = 0;
    for (pid, environ) in processes() {
        let owner = environ
            .split(|b| *b == 0)
            .find_map(|var| var.strip_prefix(prefix.as_bytes()));
        let Some(owner) = owner.and_then(|o| std::str::from_utf8(o).ok()) else {
            continue;
        };
        if !tandem_executor::owner::owner_alive(owner)
            && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok()
        {
            killed += 1;
        }
    }
    killed
}

/// Live processes other than this one, with their environments (other users' are unreadable
/// and cannot be ours; zombies read as empty).
fn processes() -> impl Iterator<Item = (i32, Vec<u8>)> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(move |entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            if pid == me {
                return None;
            }
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            Some((i32::try_from(pid).ok()?, environ))
        })
}

/// Sends SIGKILL to every live process whose environment holds `marker`; returns how many.
fn kill_marked(marker: &[u8]) -> usize {
    let mut killed = 0;
    for (pid, environ) in processes() {
        if environ.split(|b| *b == 0).any(|var| var == marker)
            && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok()
        {
            killed += 1;
        }
    }
    killed
}
