//! Paused sessions: an API session unused for `[sessions] pause_after_secs` is saved as a
//! snapshot (its files and kept globals) and its sandbox closed; its next block opens a new
//! sandbox from that snapshot. What each paused session is lives on disk beside the
//! snapshots, so a paused session outlives a daemon restart.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A paused session, as it is kept on disk.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct PausedRecord {
    pub id: String,
    pub executor: String,
    pub keep_state: bool,
    #[serde(default)]
    pub tools: Vec<String>,
    pub idle_timeout_secs: u64,
    #[serde(default)]
    pub limits: tandem_protocol::TaskLimits,
    #[serde(default)]
    pub network: Option<tandem_protocol::net::NetworkRequest>,
    #[serde(default)]
    pub volumes: Vec<tandem_protocol::volume::VolumeMount>,
    /// The snapshot it was saved as.
    pub snapshot: String,
    /// The daemon that paused it (its name on the store): sessions are each daemon's own,
    /// so daemons sharing a files directory take back only their own.
    #[serde(default)]
    pub daemon: String,
    pub created_ms: u64,
    pub blocks: u64,
}

fn dir(root: &Path) -> PathBuf {
    root.join("paused")
}

/// Keeps `record`, whole or not at all (written aside, then renamed).
pub(super) fn keep(root: &Path, record: &PausedRecord) -> std::io::Result<()> {
    let dir = dir(root);
    std::fs::create_dir_all(&dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(&dir)?;
    serde_json::to_writer(&mut tmp, record).map_err(std::io::Error::other)?;
    tmp.as_file().sync_all()?;
    tmp.persist(dir.join(format!("{}.json", record.id)))
        .map_err(|e| e.error)?;
    Ok(())
}

/// Forgets the paused session `id`.
pub(super) fn forget(root: &Path, id: &str) {
    let path = dir(root).join(format!("{id}.json"));
    if let Err(e) = std::fs::remove_file(&path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(session = %id, error = %e, "forgetting a paused session failed");
    }
}

/// Every paused session kept; one that cannot be read is named in the log and left.
pub(super) fn kept(root: &Path) -> Vec<PausedRecord> {
    let Ok(entries) = std::fs::read_dir(dir(root)) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<PausedRecord>(&b).map_err(|e| e.to_string()))
        {
            Ok(record) => found.push(record),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "a paused session's record cannot be read; it is left as it is");
            }
        }
    }
    found.sort_by_key(|r| r.created_ms);
    found
}
