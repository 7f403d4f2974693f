//! Which process owns a sandbox, so that a Tandem can reap what a dead one left behind.
//!
//! A tag is `host/pid:start-time`; the start time (clock ticks since boot, from
//! `/proc/PID/stat`) tells a live owner from a new process that reused its pid.

/// Environment variable that carries the owner tag into sandboxed processes.
pub const OWNER_VAR: &str = "TANDEM_OWNER";

/// This host's name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".to_owned())
}

/// Start time of a process (field 22 of `/proc/PID/stat`).
pub fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = stat.rsplit_once(')')?.1;
    after_name.split_whitespace().nth(19).map(str::to_owned)
}

/// This process's tag.
pub fn owner_tag() -> String {
    let pid = std::process::id();
    format!(
        "{}/{pid}:{}",
        hostname(),
        start_time(pid).unwrap_or_default()
    )
}

/// Whether the owner named by `tag` still runs; owners on other hosts count as alive, since
/// they cannot be checked from here.
pub fn owner_alive(tag: &str) -> bool {
    let Some((host, rest)) = tag.split_once('/') else {
        return false;
    };
    if host != hostname() {
        return true;
    }
    let Some((pid, start)) = rest.split_once(':') else {
        return false;
    };
    pid.parse::<u32>()
        .ok()
        .and_then(start_time)
        .is_some_and(|s| s == start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners() {
        assert!(owner_alive(&owner_tag()));
        assert!(!owner_alive(&format!("{}/999999999:1", hostname())));
        assert!(owner_alive("some-other-host/1:1"));
        assert!(!owner_alive("garbage"));
    }
}
