//! Killing every process a block started, including ones that left its process group.

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// Name of the environment variable that marks every process of one execution.
pub(crate) const MARKER_VAR: &str = "TANDEM_EXEC_ID";

/// How a block's processes outside its group are found once it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sweep {
    /// The block runs in a PID namespace of its own whose init is the pid killed.
    Namespace,
    /// A subreaper waiter kills the block's descendants; the marker scan is a second net
    /// for a block that killed its waiter (possible unconfined).
    UnderSubreaper,
    /// No waiter: the marker scan is all there is.
    MarkerOnly,
}

/// Kills the block's process group and then any process still carrying its marker
/// (daemonised grandchildren that called `setsid` escape the group but keep the
/// environment). Dropping it does the same, so a cancelled future cleans up too.
pub(crate) struct TreeKiller {
    pgid: Option<Pid>,
    marker: String,
    /// What finds the processes the group kill misses.
    sweep: Sweep,
    /// Whether it kills at all (see [`TreeKiller::disarm`]).
    armed: bool,
}

impl TreeKiller {
    /// `pgid`: the block's group, or its PID namespace's init's under [`Sweep::Namespace`].
    pub(crate) fn new(pgid: Option<u32>, exec_id: &str, sweep: Sweep) -> Self {
        Self {
            // 0 and 1 are never a block's group: `killpg(0)` would kill Tandem's own group.
            pgid: pgid
                .filter(|p| *p > 1)
                .and_then(|p| i32::try_from(p).ok())
                .map(Pid::from_raw),
            marker: format!("{MARKER_VAR}={exec_id}"),
            sweep,
            armed: true,
        }
    }

    /// Kills nothing, now or when dropped: the block's processes that are left are servers
    /// its PID namespace's init keeps, and they end with their session.
    pub(crate) fn disarm(mut self) {
        self.pgid = None;
        self.armed = false;
    }

    /// Kills them all now, once: what it leaves when dropped is nothing more to do.
    pub(crate) fn kill_all(mut self) {
        self.kill_now();
        self.armed = false;
    }

    fn kill_now(&self) {
        if !self.armed {
            return;
        }
        if let Some(pgid) = self.pgid {
            let _ = killpg(pgid, Signal::SIGKILL);
        }
        // A process may fork while we scan, and one in the middle of an exec (`setsid sh`)
        // shows no environment for a moment; so passes go on, a little apart, until quiet.
        // Under a subreaper waiter one quiet pass is enough (the waiter killed its
        // descendants already); with the marker alone, two in a row.
        let quiet_needed = match self.sweep {
            // The init's death ends its namespace, but not at once: the pass sees the
            // namespace's processes until they are gone.
            Sweep::Namespace | Sweep::UnderSubreaper => 1,
            Sweep::MarkerOnly => 2,
        };
        let mut quiet = 0;
        for pass in 0..8u32 {
            if kill_marked(self.marker.as_bytes()) == 0 {
                quiet += 1;
                if quiet >= quiet_needed {
                    break;
                }
            } else {
                quiet = 0;
            }
            std::thread::sleep(std::time::Duration::from_millis(1 << pass.min(5)));
        }
    }
}

impl Drop for TreeKiller {
    fn drop(&mut self) {
        self.kill_now();
    }
}

/// Sends SIGKILL to every process whose environment names an owner that is no longer
/// running (left by a Tandem that died); returns how many.
pub(crate) fn kill_orphans() -> usize {
    let prefix = format!("{}=", tandem_executor_kit::owner::OWNER_VAR);
    let mut killed = 0;
    for (pid, environ) in processes() {
        let owner = environ
            .split(|b| *b == 0)
            .find_map(|var| var.strip_prefix(prefix.as_bytes()));
        let Some(owner) = owner.and_then(|o| std::str::from_utf8(o).ok()) else {
            continue;
        };
        if !tandem_executor_kit::owner::owner_alive(owner)
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
