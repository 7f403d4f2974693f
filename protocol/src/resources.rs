//! What a block or a session used of the machine: CPU, memory, disk and network.

use serde::{Deserialize, Serialize};

/// What a block (or, summed, a session) used. A figure the sandbox could not measure is
/// absent, never zero, and `unavailable` says why.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    /// CPU time, user and system, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_secs: Option<f64>,
    /// The most memory in use at once, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<u64>,
    /// `block` when the peak is the block's own; `session` when the kernel gave only the
    /// sandbox's peak so far, which may come from an earlier block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_scope: Option<PeakScope>,
    /// Bytes the block's processes caused to be written to storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_written_bytes: Option<u64>,
    /// Bytes received through the egress proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_bytes_in: Option<u64>,
    /// Bytes sent through the egress proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_bytes_out: Option<u64>,
    /// Where the figures come from: `cgroup v1`, `cgroup v2`, `getrusage`, `wasmtime`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Why a figure is missing, when one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

// The figures are counts and sums of counts: never NaN.
impl Eq for Resources {}

/// Whose peak a `peak_memory_bytes` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeakScope {
    /// The block's own: the peak was reset when it started.
    Block,
    /// The sandbox's since it started.
    Session,
}

impl Resources {
    /// Figures that could not be had at all, and why.
    pub fn unavailable(why: impl Into<String>) -> Self {
        Self {
            unavailable: Some(why.into()),
            ..Self::default()
        }
    }

    /// Adds a later block's figures: times and bytes add up, a peak is the larger one.
    pub fn add(&mut self, other: &Resources) {
        fn sum<T: std::ops::Add<Output = T>>(a: Option<T>, b: Option<T>) -> Option<T> {
            match (a, b) {
                (Some(a), Some(b)) => Some(a + b),
                (a, b) => a.or(b),
            }
        }
        self.cpu_secs = sum(self.cpu_secs, other.cpu_secs);
        self.disk_written_bytes = sum(self.disk_written_bytes, other.disk_written_bytes);
        self.net_bytes_in = sum(self.net_bytes_in, other.net_bytes_in);
        self.net_bytes_out = sum(self.net_bytes_out, other.net_bytes_out);
        if other.peak_memory_bytes > self.peak_memory_bytes {
            self.peak_memory_bytes = other.peak_memory_bytes;
        }
        // A sum over blocks is the session's, whatever each block's was.
        if self.peak_memory_bytes.is_some() {
            self.peak_memory_scope = Some(PeakScope::Session);
        }
        if self.source.is_none() {
            self.source.clone_from(&other.source);
        }
        if self.unavailable.is_none() {
            self.unavailable.clone_from(&other.unavailable);
        }
    }

    /// One line for a person: `cpu 1.02 s · peak 212 MB (block) · disk 4.1 MB`.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if let Some(cpu) = self.cpu_secs {
            parts.push(format!("cpu {cpu:.2} s"));
        }
        if let Some(peak) = self.peak_memory_bytes {
            let scope = match self.peak_memory_scope {
                Some(PeakScope::Session) => " (session)",
                _ => "",
            };
            parts.push(format!("peak {}{scope}", bytes(peak)));
        }
        if let Some(disk) = self.disk_written_bytes {
            parts.push(format!("disk {}", bytes(disk)));
        }
        if self.net_bytes_in.is_some() || self.net_bytes_out.is_some() {
            parts.push(format!(
                "net {} in, {} out",
                bytes(self.net_bytes_in.unwrap_or(0)),
                bytes(self.net_bytes_out.unwrap_or(0))
            ));
        }
        if parts.is_empty()
            && let Some(why) = &self.unavailable
        {
            parts.push(format!("usage unavailable: {why}"));
        }
        parts.join(" · ")
    }
}

/// `4.1 MB`, `512 B`: decimal units, as `docker stats` prints them.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["kB", "MB", "GB", "TB"];
    if n < 1000 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1000.0;
    let mut unit = UNITS[0];
    for u in &UNITS[1..] {
        if v < 1000.0 {
            break;
        }
        v /= 1000.0;
        unit = u;
    }
    format!("{v:.1} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_add_and_peaks_take_the_larger() {
        let mut total = Resources::default();
        total.add(&Resources {
            cpu_secs: Some(0.5),
            peak_memory_bytes: Some(200_000_000),
            peak_memory_scope: Some(PeakScope::Block),
            disk_written_bytes: Some(10),
            ..Resources::default()
        });
        total.add(&Resources {
            cpu_secs: Some(0.25),
            peak_memory_bytes: Some(100),
            disk_written_bytes: None,
            ..Resources::default()
        });
        assert_eq!(total.cpu_secs, Some(0.75));
        assert_eq!(total.peak_memory_bytes, Some(200_000_000));
        assert_eq!(total.peak_memory_scope, Some(PeakScope::Session));
        assert_eq!(total.disk_written_bytes, Some(10));
        assert_eq!(
            total.summary(),
            "cpu 0.75 s · peak 200.0 MB (session) · disk 10 B"
        );
    }

    #[test]
    fn nothing_measured_says_why() {
        let r = Resources::unavailable("the cgroup is not readable");
        assert_eq!(r.summary(), "usage unavailable: the cgroup is not readable");
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"unavailable": "the cgroup is not readable"})
        );
    }
}
