//! Snapshots: immutable, named copies of a sandbox's workspace, kept in a directory of the
//! daemon's and restored into any number of new sandboxes.
//!
//! A snapshot is a manifest (every directory and regular file, with its mode's executable
//! bit and the SHA-256 of its bytes) beside a record of what it holds; the bytes live once
//! per content in `blobs/`, so a second snapshot of mostly the same files adds only what
//! changed. The workspace it is taken from is hostile input: it is walked by the keeper's
//! iterative kit, every file opened beneath a handle without following links, bounded in
//! entries, path length and bytes. A restore checks every blob against its hash before a
//! byte of it is handed on: a corrupt or truncated snapshot is refused whole.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tandem_executor_kit::keeper;

/// What a store may hold, and how much one workspace may bring.
#[derive(Clone, Copy, Debug)]
pub struct Caps {
    /// Most snapshots kept at once.
    pub max_count: usize,
    /// Most bytes of content kept, all snapshots together (shared content counted once).
    pub max_bytes: u64,
    /// Most entries one snapshot walks.
    pub max_entries: usize,
}

impl Default for Caps {
    fn default() -> Self {
        Self {
            max_count: 100,
            max_bytes: 10 << 30,
            max_entries: 200_000,
        }
    }
}

/// Where a snapshot was taken from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Source {
    /// `session` or `task`.
    pub kind: String,
    /// Its id.
    pub id: String,
    /// The executor it ran on.
    pub executor: String,
}

/// An entry of the workspace that a snapshot does not hold, and why.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct NotSaved {
    /// Its path in the workspace (or, for kept state, the global's name).
    pub name: String,
    /// Why it is not in the snapshot.
    pub why: String,
}

/// What a snapshot is: the record the API answers with.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    /// Its id (`snap_…`).
    pub id: String,
    /// The name it was given, if any.
    pub name: Option<String>,
    /// Bytes of the files it holds.
    pub bytes: u64,
    /// Bytes this snapshot added to the store (content no earlier snapshot held).
    pub added_bytes: u64,
    /// Regular files it holds.
    pub files: u64,
    /// Directories it holds.
    pub dirs: u64,
    /// The kept interpreter's globals it holds, by name.
    pub saved: Vec<String>,
    /// Bytes of the kept interpreter's globals (their pickle, loaded only in a sandbox).
    #[serde(default)]
    pub state_bytes: u64,
    /// What it does not hold, and why: links and special files of the workspace.
    pub not_saved: Vec<NotSaved>,
    /// When it was taken, in milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// When it was taken, RFC 3339 in UTC.
    pub created: String,
    /// What it was taken from.
    pub source: Source,
}

/// One entry of a snapshot's manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Item {
    path: String,
    /// A regular file's SHA-256; `None` for a directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sha256: Option<String>,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    executable: bool,
}

/// Why a snapshot could not be taken, found, or restored.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// No snapshot has that id.
    #[error("no snapshot `{0}` exists (list them with GET /v1/snapshots or `tandem snapshot ls`)")]
    Unknown(String),
    /// The store is full.
    #[error(
        "{what}: {detail}; remove a snapshot (`tandem snapshot rm ID`) or raise [snapshots] {limit}"
    )]
    Quota {
        /// The setting that bounds it.
        limit: &'static str,
        /// What was refused.
        what: String,
        /// The figures.
        detail: String,
    },
    /// The workspace could not be walked within the caps.
    #[error("the workspace cannot be snapshotted: {0}")]
    Workspace(String),
    /// A snapshot's stored content does not match its manifest.
    #[error("snapshot `{id}` is damaged ({why}); nothing of it was restored")]
    Corrupt {
        /// Its id.
        id: String,
        /// What is wrong.
        why: String,
    },
    /// It is in use and cannot be removed.
    #[error("{0}")]
    Held(String),
    /// The store's own files failed.
    #[error("the snapshot store failed at {what}: {source}")]
    Io {
        /// What it was doing.
        what: String,
        /// The failure.
        #[source]
        source: io::Error,
    },
}

fn io_at(what: impl Into<String>) -> impl FnOnce(io::Error) -> SnapshotError {
    let what = what.into();
    move |source| SnapshotError::Io { what, source }
}

/// Where a snapshot's kept globals are placed on a restore, for the kept interpreter to load
/// (inside the sandbox) as it starts.
pub const STATE_PATH: &str = ".tandem-state.pickle";

/// Whether `id` has the shape of a snapshot id (so that it can name a directory).
pub fn valid_id(id: &str) -> bool {
    id.strip_prefix("snap_").is_some_and(|rest| {
        !rest.is_empty() && rest.len() <= 64 && rest.bytes().all(|b| b.is_ascii_alphanumeric())
    })
}

/// A directory of snapshots and their content.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
    caps: Caps,
}

impl Store {
    /// The store in `dir` (made if missing), bounded by `caps`.
    pub fn open(dir: &Path, caps: Caps) -> Result<Self, SnapshotError> {
        for sub in ["blobs", "snaps", "tmp"] {
            std::fs::create_dir_all(dir.join(sub))
                .map_err(io_at(format!("making {}", dir.join(sub).display())))?;
        }
        Ok(Self {
            dir: dir.to_owned(),
            caps,
        })
    }

    /// Its caps.
    pub fn caps(&self) -> Caps {
        self.caps
    }

    fn snap_dir(&self, id: &str) -> Result<PathBuf, SnapshotError> {
        if !valid_id(id) {
            return Err(SnapshotError::Unknown(id.to_owned()));
        }
        Ok(self.dir.join("snaps").join(id))
    }

    fn blob_path(&self, sha: &str) -> PathBuf {
        self.dir.join("blobs").join(&sha[..2]).join(sha)
    }

    /// Every snapshot, oldest first.
    pub fn list(&self) -> Result<Vec<Record>, SnapshotError> {
        let snaps = self.dir.join("snaps");
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&snaps).map_err(io_at("listing snapshots"))? {
            let entry = entry.map_err(io_at("listing snapshots"))?;
            let name = entry.file_name();
            let Some(id) = name.to_str().filter(|id| valid_id(id)) else {
                continue;
            };
            if let Ok(record) = self.get(id) {
                out.push(record);
            }
        }
        out.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        Ok(out)
    }

    /// The snapshot `id`'s record.
    pub fn get(&self, id: &str) -> Result<Record, SnapshotError> {
        let path = self.snap_dir(id)?.join("record.json");
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(SnapshotError::Unknown(id.to_owned()));
            }
            Err(e) => return Err(io_at(format!("reading {}", path.display()))(e)),
        };
        serde_json::from_slice(&text).map_err(|e| SnapshotError::Corrupt {
            id: id.to_owned(),
            why: format!("its record does not parse: {e}"),
        })
    }

    /// Bytes of content kept now, every blob once.
    pub fn stored_bytes(&self) -> Result<u64, SnapshotError> {
        let mut total = 0u64;
        let blobs = self.dir.join("blobs");
        for shard in std::fs::read_dir(&blobs).map_err(io_at("measuring the store"))? {
            let shard = shard.map_err(io_at("measuring the store"))?;
            let Ok(files) = std::fs::read_dir(shard.path()) else {
                continue;
            };
            for file in files.flatten() {
                total = total.saturating_add(file.metadata().map(|m| m.len()).unwrap_or(0));
            }
        }
        Ok(total)
    }

    /// A directory for files on their way into the store, on its file system.
    pub fn scratch(&self) -> PathBuf {
        self.dir.join("tmp")
    }

    /// Bytes the store can still take under `max_bytes`.
    pub fn room(&self) -> Result<u64, SnapshotError> {
        Ok(self.caps.max_bytes.saturating_sub(self.stored_bytes()?))
    }

    /// Takes a snapshot of the tree at `workspace`: its directories and regular files (the
    /// executable bit kept), with `saved` and `not_saved` as the kept state's part, and
    /// `state` the file that holds its pickle (restored as [`STATE_PATH`]). Blocking.
    /// Refused past `max_count` or `max_bytes` (then nothing of it is kept).
    pub fn take(
        &self,
        workspace: &Path,
        name: Option<String>,
        source: Source,
        saved: Vec<String>,
        mut not_saved: Vec<NotSaved>,
        state: Option<&Path>,
    ) -> Result<Record, SnapshotError> {
        let count = self.list()?.len();
        if count >= self.caps.max_count {
            return Err(SnapshotError::Quota {
                limit: "max_count",
                what: "a new snapshot".into(),
                detail: format!("{count} are kept, the most this daemon keeps"),
            });
        }
        let root = keeper::open_root(workspace)
            .map_err(|e| SnapshotError::Workspace(format!("{}: {e}", workspace.display())))?;
        // What a block wrote is read at most up to the store's size, whatever it claims (a
        // sparse file of a terabyte is read no further), and kept only if the store holds it.
        let stored = self.stored_bytes()?;
        let mut over: Option<SnapshotError> = None;
        let mut items = Vec::new();
        let mut added_bytes = 0u64;
        let mut bytes = 0u64;
        let (mut files, mut dirs) = (0u64, 0u64);
        let caps = keeper::WalkCaps {
            max_entries: self.caps.max_entries,
            sorted: true,
            max_path: Some(keeper::MAX_PATH_BYTES),
        };
        let walked = keeper::walk(root.as_fd(), Path::new(""), caps, |dir, path, entry| {
            // Tandem's own files (block scripts, a kept interpreter's pipes) are not the code's.
            if tandem_executor_kit::archive::is_tandems(path) {
                return Ok(keeper::Step::Skip);
            }
            let shown = path.to_string_lossy().into_owned();
            match entry.kind {
                keeper::Kind::Dir => {
                    if path.as_os_str().len() >= keeper::MAX_PATH_BYTES {
                        not_saved.push(NotSaved {
                            name: shown,
                            why: "its path is longer than 4096 bytes".into(),
                        });
                        return Ok(keeper::Step::Skip);
                    }
                    dirs += 1;
                    items.push(Item {
                        path: shown,
                        sha256: None,
                        size: 0,
                        executable: false,
                    });
                    Ok(keeper::Step::Enter)
                }
                keeper::Kind::File => {
                    let Some(file_name) = path.file_name() else {
                        return Ok(keeper::Step::Skip);
                    };
                    let (file, _) = match keeper::open_regular(dir, Path::new(file_name)) {
                        Ok(opened) => opened,
                        Err(keeper::OpenError::NotRegular(what)) => {
                            not_saved.push(NotSaved {
                                name: shown,
                                why: format!("it became a {what} while it was read"),
                            });
                            return Ok(keeper::Step::Skip);
                        }
                        Err(keeper::OpenError::Io(e)) => return Err(e),
                    };
                    let executable = file
                        .metadata()
                        .map(|m| m.permissions().mode() & 0o111 != 0)
                        .unwrap_or(false);
                    let (sha, size) = match self.keep_blob(file, bytes, stored, &mut added_bytes) {
                        Ok(kept) => kept,
                        Err(e) => {
                            let why = e.to_string();
                            over = Some(e);
                            return Err(io::Error::other(why));
                        }
                    };
                    bytes = bytes.saturating_add(size);
                    files += 1;
                    items.push(Item {
                        path: shown,
                        sha256: Some(sha),
                        size,
                        executable,
                    });
                    Ok(keeper::Step::Skip)
                }
                keeper::Kind::Link => {
                    not_saved.push(NotSaved {
                        name: shown,
                        why: "a symbolic link: snapshots hold regular files and directories".into(),
                    });
                    Ok(keeper::Step::Skip)
                }
                keeper::Kind::Special => {
                    not_saved.push(NotSaved {
                        name: shown,
                        why:
                            "a FIFO, socket or device: snapshots hold regular files and directories"
                                .into(),
                    });
                    Ok(keeper::Step::Skip)
                }
            }
        });
        if let Err(e) = walked {
            self.collect_garbage()?;
            return Err(over.unwrap_or_else(|| SnapshotError::Workspace(e.to_string())));
        }
        // The state's pickle is the daemon's own file (written from the interpreter's frames),
        // kept under Tandem's part of the workspace, which the walk above never takes.
        let mut state_bytes = 0u64;
        if let Some(state) = state {
            let file = File::open(state).map_err(io_at("reading the kept globals"))?;
            let (sha, size) = match self.keep_blob(file, bytes, stored, &mut added_bytes) {
                Ok(kept) => kept,
                Err(e) => {
                    self.collect_garbage()?;
                    return Err(e);
                }
            };
            state_bytes = size;
            items.push(Item {
                path: STATE_PATH.to_owned(),
                sha256: Some(sha),
                size,
                executable: false,
            });
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let id = format!("snap_{}", uuid::Uuid::now_v7().simple());
        let record = Record {
            id: id.clone(),
            name: name.filter(|n| !n.trim().is_empty()),
            bytes,
            added_bytes,
            files,
            dirs,
            saved,
            state_bytes,
            not_saved,
            created_ms: u64::try_from(now.as_millis()).unwrap_or(u64::MAX),
            created: tandem_protocol::rfc3339(now.as_secs()),
            source,
        };
        // Written in a directory of its own, then renamed into place: a snapshot is whole
        // or absent.
        let tmp = tempfile::Builder::new()
            .prefix("snap-")
            .tempdir_in(self.dir.join("tmp"))
            .map_err(io_at("making a snapshot's directory"))?;
        write_json(&tmp.path().join("manifest.json"), &items)?;
        write_json(&tmp.path().join("record.json"), &record)?;
        let dest = self.snap_dir(&id)?;
        let tmp = tmp.keep();
        std::fs::rename(&tmp, &dest).map_err(io_at("keeping the snapshot"))?;
        Ok(record)
    }

    /// Keeps `file` as a blob within the store's size, this snapshot holding `bytes` so far
    /// and the store `stored` before it; its hash and size, what is new counted into `added`.
    fn keep_blob(
        &self,
        file: File,
        bytes: u64,
        stored: u64,
        added: &mut u64,
    ) -> Result<(String, u64), SnapshotError> {
        let most = self.caps.max_bytes.saturating_sub(bytes);
        let kept = self
            .store_blob(file, most)
            .map_err(io_at("keeping a file's content"))?;
        let Some((sha, size, new)) = kept else {
            return Err(self.over_quota(
                format!("a snapshot of more than {} bytes", self.caps.max_bytes),
                stored,
            ));
        };
        if new {
            *added = added.saturating_add(size);
            if stored.saturating_add(*added) > self.caps.max_bytes {
                return Err(self.over_quota(
                    format!("a snapshot adding more than {} bytes", *added),
                    stored,
                ));
            }
        }
        Ok((sha, size))
    }

    /// The refusal of `what`, with the store holding `stored` bytes.
    fn over_quota(&self, what: String, stored: u64) -> SnapshotError {
        SnapshotError::Quota {
            limit: "max_mb",
            what,
            detail: format!(
                "the store holds {stored} bytes of its {} MB",
                self.caps.max_bytes >> 20
            ),
        }
    }

    /// Copies `file` into the blobs, named by its SHA-256; answers the hash, its size, and
    /// whether the content is new to the store; `None`, keeping nothing, once it holds more
    /// than `most` bytes.
    fn store_blob(&self, mut file: File, most: u64) -> io::Result<Option<(String, u64, bool)>> {
        let mut tmp = tempfile::NamedTempFile::new_in(self.dir.join("tmp"))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut size = 0u64;
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            size += n as u64;
            if size > most {
                return Ok(None);
            }
            hasher.update(&buf[..n]);
            tmp.write_all(&buf[..n])?;
        }
        let sha = hex::encode(hasher.finalize());
        let dest = self.blob_path(&sha);
        if dest.exists() {
            return Ok(Some((sha, size, false)));
        }
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        tmp.persist(&dest).map_err(|e| e.error)?;
        Ok(Some((sha, size, true)))
    }

    /// Removes the snapshot `id`, and the content no other snapshot holds.
    pub fn remove(&self, id: &str) -> Result<Record, SnapshotError> {
        let record = self.get(id)?;
        let dir = self.snap_dir(id)?;
        // Out of sight first (a rename), then gone: a list meanwhile does not see half.
        let doomed = self
            .dir
            .join("tmp")
            .join(format!("rm-{id}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::rename(&dir, &doomed).map_err(io_at("removing the snapshot"))?;
        std::fs::remove_dir_all(&doomed).map_err(io_at("removing the snapshot"))?;
        self.collect_garbage()?;
        Ok(record)
    }

    /// Removes every blob no snapshot's manifest names.
    fn collect_garbage(&self) -> Result<(), SnapshotError> {
        let mut live = HashSet::new();
        let snaps = self.dir.join("snaps");
        for entry in std::fs::read_dir(&snaps).map_err(io_at("listing snapshots"))? {
            let entry = entry.map_err(io_at("listing snapshots"))?;
            if let Ok(items) = read_manifest(&entry.path().join("manifest.json")) {
                live.extend(items.into_iter().filter_map(|i| i.sha256));
            }
        }
        let blobs = self.dir.join("blobs");
        for shard in std::fs::read_dir(&blobs).map_err(io_at("reading the store"))? {
            let shard = shard.map_err(io_at("reading the store"))?;
            let Ok(files) = std::fs::read_dir(shard.path()) else {
                continue;
            };
            for file in files.flatten() {
                let name = file.file_name();
                if !name.to_str().is_some_and(|n| live.contains(n)) {
                    let _ = std::fs::remove_file(file.path());
                }
            }
        }
        Ok(())
    }

    /// Writes the snapshot `id` as a tar archive to a new file in `dir`, every blob checked
    /// against its hash first; returns its path. Entries are owned by `owner` when given.
    pub fn restore_tar(
        &self,
        id: &str,
        dir: &Path,
        owner: Option<(u64, u64)>,
    ) -> Result<tempfile::TempPath, SnapshotError> {
        self.get(id)?;
        let corrupt = |why: String| SnapshotError::Corrupt {
            id: id.to_owned(),
            why,
        };
        let items = read_manifest(&self.snap_dir(id)?.join("manifest.json"))
            .map_err(|e| corrupt(format!("its manifest cannot be read: {e}")))?;
        for item in &items {
            if keeper::plain(Path::new(&item.path)).is_none_or(|p| p.is_empty()) {
                return Err(corrupt(format!("its manifest names `{}`", item.path)));
            }
        }
        let out =
            tempfile::NamedTempFile::new_in(dir).map_err(io_at("making the restore's archive"))?;
        let (file, path) = out.into_parts();
        let mut builder = tar::Builder::new(std::io::BufWriter::with_capacity(1 << 20, file));
        for item in &items {
            let mut header = tar::Header::new_gnu();
            header.set_mtime(0);
            if let Some((uid, gid)) = owner {
                header.set_uid(uid);
                header.set_gid(gid);
            }
            let appended = match &item.sha256 {
                None => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_mode(0o755);
                    header.set_size(0);
                    builder.append_data(&mut header, &item.path, io::empty())
                }
                Some(sha) => {
                    let mut blob = self.blob(sha, item.size).map_err(&corrupt)?;
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_mode(if item.executable { 0o755 } else { 0o644 });
                    header.set_size(item.size);
                    let appended = builder.append_data(&mut header, &item.path, &mut blob);
                    // Checked as it streams: the archive is handed on only once every file
                    // held its size and hash (a bad one removes it, unread).
                    if let Err(why) = blob.verdict() {
                        return Err(corrupt(why));
                    }
                    appended
                }
            };
            appended.map_err(io_at("writing the restore's archive"))?;
        }
        // Not synced: the archive is read at once and then removed, and a crash meanwhile
        // loses nothing the snapshot's own (synced) content does not still hold.
        builder
            .into_inner()
            .and_then(|w| w.into_inner().map_err(|e| e.into_error()))
            .map_err(io_at("writing the restore's archive"))?;
        Ok(path)
    }

    /// The blob `sha`, to be read once as it is checked against `size` and its hash.
    fn blob(&self, sha: &str, size: u64) -> Result<CheckedBlob, String> {
        if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("a file's hash `{sha}` is not a SHA-256"));
        }
        let file = File::open(self.blob_path(sha))
            .map_err(|e| format!("content {sha} is missing: {e}"))?;
        let held = file
            .metadata()
            .map_err(|e| format!("content {sha} cannot be read: {e}"))?
            .len();
        if held != size {
            return Err(format!(
                "content {sha} holds {held} bytes where {size} were kept"
            ));
        }
        Ok(CheckedBlob {
            file: file.take(size),
            sha: sha.to_owned(),
            size,
            read: 0,
            hasher: Sha256::new(),
            failed: None,
        })
    }
}

/// A blob read through once, its bytes counted and hashed on the way.
struct CheckedBlob {
    file: io::Take<File>,
    sha: String,
    size: u64,
    read: u64,
    hasher: Sha256,
    failed: Option<String>,
}

impl Read for CheckedBlob {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read(buf).inspect_err(|e| {
            self.failed = Some(format!("content {} cannot be read: {e}", self.sha));
        })?;
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        Ok(n)
    }
}

impl CheckedBlob {
    /// Whether what was read was the whole blob, and the content its hash names.
    fn verdict(self) -> Result<(), String> {
        if let Some(why) = self.failed {
            return Err(why);
        }
        if self.read != self.size {
            return Err(format!(
                "content {} held {} bytes where {} were kept",
                self.sha, self.read, self.size
            ));
        }
        if hex::encode(self.hasher.finalize()) != self.sha {
            return Err(format!("content {} does not match its hash", self.sha));
        }
        Ok(())
    }
}

fn read_manifest(path: &Path) -> io::Result<Vec<Item>> {
    let text = std::fs::read(path)?;
    serde_json::from_slice(&text).map_err(io::Error::other)
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), SnapshotError> {
    let text = serde_json::to_vec(value)
        .map_err(|e| io_at(format!("encoding {}", path.display()))(io::Error::other(e)))?;
    std::fs::write(path, text).map_err(io_at(format!("writing {}", path.display())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn source() -> Source {
        Source {
            kind: "session".into(),
            id: "s1".into(),
            executor: "local".into(),
        }
    }

    #[test]
    fn a_second_snapshot_of_the_same_files_adds_nothing_and_removal_keeps_shared_content() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path(), Caps::default()).unwrap();
        let ws = tempfile::tempdir().unwrap();
        std::fs::write(ws.path().join("a.txt"), "alpha").unwrap();
        std::fs::create_dir(ws.path().join("empty")).unwrap();
        std::fs::write(ws.path().join("empty.txt"), "").unwrap();
        let run = ws.path().join("run.sh");
        std::fs::write(&run, "#!/bin/sh\necho hi\n").unwrap();
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", ws.path().join("link")).unwrap();
        nix::unistd::mkfifo(&ws.path().join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();

        let first = store
            .take(
                ws.path(),
                Some("one".into()),
                source(),
                vec![],
                vec![],
                None,
            )
            .unwrap();
        assert_eq!((first.files, first.dirs), (3, 1));
        assert_eq!(first.bytes, 5 + 18);
        let skipped: Vec<&str> = first.not_saved.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(skipped, ["fifo", "link"]);
        let second = store
            .take(ws.path(), None, source(), vec![], vec![], None)
            .unwrap();
        assert_eq!(second.added_bytes, 0);
        assert_eq!(store.list().unwrap().len(), 2);

        store.remove(&first.id).unwrap();
        assert!(matches!(
            store.get(&first.id),
            Err(SnapshotError::Unknown(_))
        ));
        let out = tempfile::tempdir().unwrap();
        let tar = store.restore_tar(&second.id, out.path(), None).unwrap();
        let dest = tempfile::tempdir().unwrap();
        tar::Archive::new(File::open(&tar).unwrap())
            .unpack(dest.path())
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(dest.path().join("a.txt")).unwrap(),
            "alpha"
        );
        assert_eq!(std::fs::read(dest.path().join("empty.txt")).unwrap(), b"");
        assert!(dest.path().join("empty").is_dir());
        let mode = std::fs::metadata(dest.path().join("run.sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o111, 0o111);
        assert!(!dest.path().join("link").exists());
    }

    #[test]
    fn a_damaged_snapshot_is_refused_whole_and_quotas_name_their_setting() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            store_dir.path(),
            Caps {
                max_count: 1,
                ..Caps::default()
            },
        )
        .unwrap();
        let ws = tempfile::tempdir().unwrap();
        std::fs::write(ws.path().join("a.txt"), "alpha").unwrap();
        let snap = store
            .take(ws.path(), None, source(), vec![], vec![], None)
            .unwrap();
        let refused = store.take(ws.path(), None, source(), vec![], vec![], None);
        assert!(
            matches!(
                &refused,
                Err(SnapshotError::Quota {
                    limit: "max_count",
                    ..
                })
            ),
            "{refused:?}"
        );
        assert!(
            refused
                .unwrap_err()
                .to_string()
                .contains("[snapshots] max_count")
        );
        let sha = hex::encode(Sha256::digest(b"alpha"));
        std::fs::write(store.blob_path(&sha), "alphx").unwrap();
        let out = tempfile::tempdir().unwrap();
        let err = store.restore_tar(&snap.id, out.path(), None).unwrap_err();
        assert!(err.to_string().contains("does not match its hash"), "{err}");
        assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
        std::fs::write(store.blob_path(&sha), "alp").unwrap();
        let err = store.restore_tar(&snap.id, out.path(), None).unwrap_err();
        assert!(err.to_string().contains("3 bytes where 5"), "{err}");
        assert!(matches!(
            store.get("../etc"),
            Err(SnapshotError::Unknown(_))
        ));
    }

    #[test]
    fn a_sparse_terabyte_is_read_no_further_than_the_store_holds() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(
            store_dir.path(),
            Caps {
                max_bytes: 1 << 20,
                ..Caps::default()
            },
        )
        .unwrap();
        let ws = tempfile::tempdir().unwrap();
        File::create(ws.path().join("huge"))
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        let refused = store.take(ws.path(), None, source(), vec![], vec![], None);
        assert!(
            matches!(
                &refused,
                Err(SnapshotError::Quota {
                    limit: "max_mb",
                    ..
                })
            ),
            "{refused:?}"
        );
        assert_eq!(store.stored_bytes().unwrap(), 0);
        assert!(store.list().unwrap().is_empty());
    }

    #[test]
    fn a_tree_100000_deep_is_walked_without_recursion_and_bounded() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path(), Caps::default()).unwrap();
        let ws = tempfile::tempdir().unwrap();
        // Made beneath a handle, one level at a time: the path is far past PATH_MAX.
        let mut dir = keeper::open_root(ws.path()).unwrap();
        for _ in 0..100_000 {
            nix::sys::stat::mkdirat(&dir, "d", nix::sys::stat::Mode::S_IRWXU).unwrap();
            dir = nix::fcntl::openat(
                &dir,
                "d",
                nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
                nix::sys::stat::Mode::empty(),
            )
            .unwrap();
        }
        std::fs::write(ws.path().join("top.txt"), "top").unwrap();
        let snap = store
            .take(ws.path(), None, source(), vec![], vec![], None)
            .unwrap();
        assert_eq!(snap.files, 1);
        assert!(snap.dirs < 3000, "{}", snap.dirs);
        assert!(
            snap.not_saved.iter().any(|n| n.why.contains("4096 bytes")),
            "{:?}",
            snap.not_saved.len()
        );
        let _ = keeper::remove_tree(ws.path());
    }
}
