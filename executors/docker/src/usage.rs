//! A container's memory peak, reset before each block from outside the container.
//!
//! Inside, the cgroup is mounted read-only, so the runner reports only the container's peak
//! since it started. Where the engine runs on this machine and Tandem is root, the
//! container's cgroup file is writable here: resetting it before a block makes the peak read
//! after it the block's own.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;

/// The open peak file of one container's memory cgroup.
pub(crate) struct HostPeak {
    file: File,
    /// cgroup v2's `memory.peak` resets per open file (kernel 6.12 and later); v1's
    /// `memory.max_usage_in_bytes` for every reader.
    v2: bool,
}

impl HostPeak {
    /// The container's peak file under the usual places the engine puts its cgroup (the
    /// cgroupfs and systemd drivers, v1 and v2); `None` where none is found or it cannot be
    /// written, so that blocks report the container's peak instead.
    pub(crate) fn find(id: &str) -> Option<Self> {
        if id.len() != 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let root = PathBuf::from("/sys/fs/cgroup");
        let v2 = root.join("cgroup.controllers").exists();
        let candidates: Vec<PathBuf> = if v2 {
            vec![
                root.join(format!("system.slice/docker-{id}.scope/memory.peak")),
                root.join(format!("docker/{id}/memory.peak")),
            ]
        } else {
            vec![
                root.join(format!("memory/docker/{id}/memory.max_usage_in_bytes")),
                root.join(format!(
                    "memory/system.slice/docker-{id}.scope/memory.max_usage_in_bytes"
                )),
            ]
        };
        candidates.into_iter().find_map(|path| {
            let file = File::options().read(true).write(true).open(&path).ok()?;
            let mut peak = HostPeak { file, v2 };
            // Checked once here: a kernel whose v2 peak cannot be reset refuses the write.
            peak.reset().then_some(peak)
        })
    }

    /// Starts the peak again from what the container uses now.
    pub(crate) fn reset(&mut self) -> bool {
        let text: &[u8] = if self.v2 { b"reset\n" } else { b"0\n" };
        self.file.seek(SeekFrom::Start(0)).is_ok() && self.file.write_all(text).is_ok()
    }

    /// The peak since the last reset, in bytes.
    pub(crate) fn read(&mut self) -> Option<u64> {
        let mut text = String::new();
        self.file.seek(SeekFrom::Start(0)).ok()?;
        self.file.read_to_string(&mut text).ok()?;
        text.trim().parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_that_is_not_a_container_ids_shape_finds_nothing() {
        assert!(HostPeak::find("../../etc").is_none());
        assert!(HostPeak::find(&"z".repeat(64)).is_none());
    }
}
