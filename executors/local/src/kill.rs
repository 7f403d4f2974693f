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
        // A process may fork while we scan; a few passes catch its children.
        for _ in 0..5 {
            if kill_marked(self.marker.as_bytes()) == 0 {
                break;
            }
        }
    }
}

impl Drop for TreeKiller {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Sends SIGKILL to every live process whose environment holds `marker`; returns how many.
fn kill_marked(marker: &[u8]) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let me = std::process::id();
    let mut killed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        // Other users' processes are unreadable and cannot be ours; zombies read as empty.
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|var| var == marker) {
            if let Ok(pid) = i32::try_from(pid) {
                if kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
                    killed += 1;
                }
            }
        }
    }
    killed
}
