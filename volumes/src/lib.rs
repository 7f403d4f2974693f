//! Volumes: named storage on the daemon's machine that outlives tasks, mounted into the
//! sandboxes that name it (docs/volumes.md).
//!
//! A volume is a directory beneath the store's; one with a quota is a filesystem of its own
//! (ext4 in a sparse image file, loop-mounted on that directory), so that the kernel refuses
//! a write past it as a full disk would, whichever sandbox or executor writes. Retention
//! never removes one: only [`Volumes::remove`] does, and not while a sandbox has it mounted.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tandem_executor_kit::keeper;
use tandem_protocol::volume::{MountPath, VolumeInfo, VolumeMount, VolumeSpec, valid_name};

/// The smallest quota: ext4's own bookkeeping needs some of it.
pub const MIN_QUOTA_MB: u64 = 4;
/// The largest quota, 1 TiB: the image is sparse, so it is a ceiling, not a reservation.
pub const MAX_QUOTA_MB: u64 = 1 << 20;
/// Most volumes a daemon keeps: each with a quota holds a loop device of the machine's.
pub const MAX_VOLUMES: usize = 256;

/// Why a volume could not be made, found, mounted or removed.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// No volume has that name.
    #[error(
        "no volume `{0}` exists (list them with `tandem volume ls`; make it with `tandem volume create {0}`)"
    )]
    Unknown(String),
    /// The name is taken.
    #[error("a volume `{0}` exists already (`tandem volume rm {0}` removes it)")]
    Exists(String),
    /// What was asked is malformed.
    #[error("{0}")]
    Invalid(String),
    /// Sandboxes have it mounted.
    #[error(
        "volume `{name}` is mounted by {count} open sandbox(es); remove it once they have closed"
    )]
    InUse {
        /// Its name.
        name: String,
        /// How many sandboxes have it.
        count: u32,
    },
    /// A quota cannot be made here.
    #[error("a volume's quota cannot be made here: {0}")]
    QuotaUnavailable(String),
    /// The store's own files failed.
    #[error("the volume store failed at {what}: {source}")]
    Io {
        /// What it was doing.
        what: String,
        /// The failure.
        #[source]
        source: io::Error,
    },
}

fn io_at(what: impl Into<String>) -> impl FnOnce(io::Error) -> VolumeError {
    let what = what.into();
    move |source| VolumeError::Io { what, source }
}

/// A volume's record on disk.
#[derive(Debug, Serialize, Deserialize)]
struct Stored {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_mb: Option<u64>,
    created_secs: u64,
}

/// The daemon's volumes: a directory of them.
#[derive(Clone, Debug)]
pub struct Volumes {
    dir: PathBuf,
    uses: Arc<Mutex<HashMap<String, u32>>>,
}

/// A volume mounted into one sandbox: what the executor is given, and the count of its
/// users, which lasts until this is dropped (the sandbox closed).
#[derive(Debug)]
pub struct Held {
    /// The volume's name.
    pub name: String,
    /// Its directory on this machine (the mount point of its filesystem, with a quota).
    pub dir: PathBuf,
    /// Where the sandbox sees it: relative to the workspace, or absolute, with no trailing `/`.
    pub path: String,
    /// Whether the sandbox may only read it.
    pub read_only: bool,
    /// Its quota, if it has one.
    pub max_mb: Option<u64>,
    uses: Arc<Mutex<HashMap<String, u32>>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Ok(mut uses) = self.uses.lock()
            && let Some(n) = uses.get_mut(&self.name)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                uses.remove(&self.name);
            }
        }
    }
}

impl Volumes {
    /// The volumes under `dir`, made (private to the daemon's user) if missing.
    pub fn open(dir: &Path) -> Result<Self, VolumeError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_at(format!("making {}", dir.display())))?;
        Ok(Self {
            dir: dir.to_owned(),
            uses: Arc::default(),
        })
    }

    fn record_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    fn image_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.img"))
    }

    fn data_dir(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Makes a volume; with `max_mb`, a filesystem of that size of its own.
    pub fn create(&self, spec: &VolumeSpec) -> Result<VolumeInfo, VolumeError> {
        let name = &spec.name;
        if !valid_name(name) {
            return Err(VolumeError::Invalid(format!(
                "`{name}` is not a volume name: 1 to 64 of a-z, 0-9, `_` and `-`, starting with a letter or digit"
            )));
        }
        if let Some(mb) = spec.max_mb
            && !(MIN_QUOTA_MB..=MAX_QUOTA_MB).contains(&mb)
        {
            return Err(VolumeError::Invalid(format!(
                "max_mb {mb} is outside {MIN_QUOTA_MB} to {MAX_QUOTA_MB} (1 TiB)"
            )));
        }
        if spec.max_mb.is_some() {
            quota_possible()?;
        }
        if self.list()?.len() >= MAX_VOLUMES {
            return Err(VolumeError::Invalid(format!(
                "this daemon keeps at most {MAX_VOLUMES} volumes; remove one (`tandem volume rm NAME`) first"
            )));
        }
        let data = self.data_dir(name);
        // Making the directory claims the name: two creates at once cannot both get it.
        match std::fs::create_dir(&data) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(VolumeError::Exists(name.clone()));
            }
            Err(e) => return Err(io_at(format!("making {}", data.display()))(e)),
        }
        let made = self.fill(spec);
        if made.is_err() {
            if is_mounted(&data) {
                let _ = unmount(&data);
            }
            let _ = std::fs::remove_file(self.image_path(name));
            let _ = keeper::remove_tree(&data);
        }
        made?;
        self.get(name)
    }

    fn fill(&self, spec: &VolumeSpec) -> Result<(), VolumeError> {
        let data = self.data_dir(&spec.name);
        if let Some(mb) = spec.max_mb {
            let image = self.image_path(&spec.name);
            let file = std::fs::File::create(&image)
                .map_err(io_at(format!("making {}", image.display())))?;
            file.set_len(mb << 20)
                .map_err(io_at(format!("sizing {}", image.display())))?;
            drop(file);
            run(
                Command::new("mkfs.ext4")
                    .args(["-q", "-F", "-m", "0", "-E", "root_owner=0:0"])
                    .arg(&image),
                "making the volume's filesystem (mkfs.ext4, from e2fsprogs)",
            )?;
            mount(&image, &data)?;
        }
        open_to_sandboxes(&data)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let record = Stored {
            name: spec.name.clone(),
            max_mb: spec.max_mb,
            created_secs: now,
        };
        let text = serde_json::to_vec(&record).map_err(|e| VolumeError::Io {
            what: "encoding the volume's record".into(),
            source: io::Error::other(e),
        })?;
        // The record is written last and by a rename: a volume is listed only once whole.
        let path = self.record_path(&spec.name);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text).map_err(io_at(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io_at(format!("writing {}", path.display())))
    }

    fn stored(&self, name: &str) -> Result<Stored, VolumeError> {
        if !valid_name(name) {
            return Err(VolumeError::Unknown(name.to_owned()));
        }
        let path = self.record_path(name);
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(VolumeError::Unknown(name.to_owned()));
            }
            Err(e) => return Err(io_at(format!("reading {}", path.display()))(e)),
        };
        serde_json::from_slice(&text).map_err(|e| VolumeError::Io {
            what: format!("reading {}", path.display()),
            source: io::Error::other(e),
        })
    }

    fn info(&self, stored: Stored) -> VolumeInfo {
        let data = self.data_dir(&stored.name);
        let used_bytes = match stored.max_mb {
            Some(_) if is_mounted(&data) => nix::sys::statvfs::statvfs(&data)
                .ok()
                .map(|s| (s.blocks() - s.blocks_free()) * s.fragment_size()),
            _ => None,
        };
        let mounted_by = self
            .uses
            .lock()
            .ok()
            .and_then(|u| u.get(&stored.name).copied())
            .unwrap_or(0);
        VolumeInfo {
            created: tandem_protocol::rfc3339(stored.created_secs),
            name: stored.name,
            max_mb: stored.max_mb,
            used_bytes,
            mounted_by,
        }
    }

    /// One volume.
    pub fn get(&self, name: &str) -> Result<VolumeInfo, VolumeError> {
        Ok(self.info(self.stored(name)?))
    }

    /// Every volume, by name.
    pub fn list(&self) -> Result<Vec<VolumeInfo>, VolumeError> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(io_at(format!("listing {}", self.dir.display())))?;
        let mut names: Vec<String> = entries
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".json"))
                    .filter(|n| valid_name(n))
                    .map(str::to_owned)
            })
            .collect();
        names.sort();
        names
            .into_iter()
            .map(|n| self.get(&n))
            .filter(|v| !matches!(v, Err(VolumeError::Unknown(_))))
            .collect()
    }

    /// Removes a volume and everything in it; refused while a sandbox has it mounted.
    pub fn remove(&self, name: &str) -> Result<VolumeInfo, VolumeError> {
        let info = self.get(name)?;
        // The count is held locked across the removal so that no mount starts meanwhile.
        let uses = self.uses.lock().map_err(|_| VolumeError::Io {
            what: "counting the volume's users".into(),
            source: io::Error::other("a lock was poisoned"),
        })?;
        if let Some(&count) = uses.get(name) {
            return Err(VolumeError::InUse {
                name: name.to_owned(),
                count,
            });
        }
        std::fs::remove_file(self.record_path(name))
            .map_err(io_at(format!("removing {name}'s record")))?;
        let data = self.data_dir(name);
        if is_mounted(&data) {
            unmount(&data)?;
        }
        let _ = std::fs::remove_file(self.image_path(name));
        // A tree blocks shaped: removed iteratively, whatever its depth, no link followed.
        keeper::remove_tree(&data).map_err(io_at(format!("removing {}", data.display())))?;
        Ok(info)
    }

    /// Checks `mount`, makes sure its volume's filesystem is mounted on this machine (a
    /// restart of the machine unmounts it), and counts the sandbox among its users until
    /// the answer is dropped.
    pub fn hold(&self, mount: &VolumeMount) -> Result<Held, VolumeError> {
        mount.check().map_err(VolumeError::Invalid)?;
        let stored = self.stored(&mount.name)?;
        let data = self.data_dir(&mount.name);
        let mut uses = self.uses.lock().map_err(|_| VolumeError::Io {
            what: "counting the volume's users".into(),
            source: io::Error::other("a lock was poisoned"),
        })?;
        if stored.max_mb.is_some() && !is_mounted(&data) {
            mount_image(&self.image_path(&mount.name), &data)?;
        }
        *uses.entry(mount.name.clone()).or_default() += 1;
        let path =
            match tandem_protocol::volume::mount_path(&mount.path).map_err(VolumeError::Invalid)? {
                MountPath::InWorkspace(p) | MountPath::Absolute(p) => p,
            };
        Ok(Held {
            name: mount.name.clone(),
            dir: data,
            path,
            read_only: mount.read_only,
            max_mb: stored.max_mb,
            uses: self.uses.clone(),
        })
    }

    /// Mounts the filesystems of the volumes with a quota that are not mounted (after the
    /// machine restarted), so that they are ready before a sandbox asks; each failure is
    /// logged and tried again when a sandbox names the volume.
    pub fn mount_all(&self) {
        let Ok(list) = self.list() else { return };
        for v in list.into_iter().filter(|v| v.max_mb.is_some()) {
            let data = self.data_dir(&v.name);
            if !is_mounted(&data)
                && let Err(e) = mount_image(&self.image_path(&v.name), &data)
            {
                tracing::warn!(volume = %v.name, error = %e, "a volume's filesystem could not be mounted");
            }
        }
    }
}

/// Why no quota can be made by this process, if it cannot.
fn quota_possible() -> Result<(), VolumeError> {
    let uid = nix::unistd::geteuid();
    if !uid.is_root() {
        return Err(VolumeError::QuotaUnavailable(format!(
            "a quota is a filesystem of the volume's own, which only a daemon running as root can mount (this one runs as uid {uid}); make the volume without a quota"
        )));
    }
    Ok(())
}

fn mount_image(image: &Path, data: &Path) -> Result<(), VolumeError> {
    quota_possible()?;
    mount(image, data)
}

fn mount(image: &Path, data: &Path) -> Result<(), VolumeError> {
    run(
        Command::new("mount")
            .args(["-t", "ext4", "-o", "loop,nosuid,nodev"])
            .arg(image)
            .arg(data),
        "mounting the volume's filesystem (mount -o loop)",
    )?;
    // A fresh filesystem's lost+found is root's alone: not a thing for a sandbox to see.
    let _ = std::fs::remove_dir(data.join("lost+found"));
    open_to_sandboxes(data)
}

fn unmount(data: &Path) -> Result<(), VolumeError> {
    run(
        Command::new("umount").arg(data),
        "unmounting the volume's filesystem",
    )
}

/// A Docker block runs as a user of its own: the volume's top is open to every user, as a
/// task's workspace is; the store's directory above it stays the daemon's alone.
fn open_to_sandboxes(data: &Path) -> Result<(), VolumeError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(data, std::fs::Permissions::from_mode(0o777))
        .map_err(io_at(format!("opening {} to sandboxes", data.display())))
}

/// Whether `dir` is a mount point: another device than its parent's.
fn is_mounted(dir: &Path) -> bool {
    let Some(parent) = dir.parent() else {
        return false;
    };
    match (nix::sys::stat::lstat(dir), nix::sys::stat::stat(parent)) {
        (Ok(d), Ok(p)) => d.st_dev != p.st_dev,
        _ => false,
    }
}

fn run(cmd: &mut Command, what: &str) -> Result<(), VolumeError> {
    let out = cmd.output().map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            VolumeError::QuotaUnavailable(format!("{what}: the program is not installed"))
        } else {
            io_at(what)(e)
        }
    })?;
    if out.status.success() {
        return Ok(());
    }
    Err(VolumeError::QuotaUnavailable(format!(
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn spec(name: &str, max_mb: Option<u64>) -> VolumeSpec {
        VolumeSpec {
            name: name.into(),
            max_mb,
        }
    }

    #[test]
    fn a_volume_is_made_held_and_refused_removal_while_held() {
        let dir = tempfile::tempdir().unwrap();
        let vols = Volumes::open(dir.path()).unwrap();
        let made = vols.create(&spec("data", None)).unwrap();
        assert_eq!((made.name.as_str(), made.mounted_by), ("data", 0));
        assert!(matches!(
            vols.create(&spec("data", None)),
            Err(VolumeError::Exists(_))
        ));
        let mount = VolumeMount {
            name: "data".into(),
            path: "/data".into(),
            read_only: false,
        };
        let held = vols.hold(&mount).unwrap();
        std::fs::write(held.dir.join("f"), "kept").unwrap();
        assert_eq!(vols.get("data").unwrap().mounted_by, 1);
        assert!(matches!(
            vols.remove("data"),
            Err(VolumeError::InUse { count: 1, .. })
        ));
        drop(held);
        assert_eq!(vols.list().unwrap().len(), 1);
        vols.remove("data").unwrap();
        assert!(matches!(vols.get("data"), Err(VolumeError::Unknown(_))));
        assert!(!dir.path().join("data").exists());
    }

    #[test]
    fn bad_names_quotas_and_unknown_volumes_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let vols = Volumes::open(dir.path()).unwrap();
        for bad in ["", "A", "../x", "-x", &"a".repeat(65)] {
            assert!(
                matches!(vols.create(&spec(bad, None)), Err(VolumeError::Invalid(_))),
                "{bad}"
            );
        }
        for mb in [0, 3, MAX_QUOTA_MB + 1, u64::MAX] {
            let e = vols.create(&spec("q", Some(mb))).unwrap_err();
            assert!(e.to_string().contains(&mb.to_string()), "{e}");
        }
        let e = vols
            .hold(&VolumeMount {
                name: "nope".into(),
                path: "d".into(),
                read_only: false,
            })
            .unwrap_err();
        assert!(e.to_string().contains("no volume `nope`"), "{e}");
    }
}
