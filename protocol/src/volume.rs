//! Volumes: named storage that outlives tasks, mounted into a task's or session's sandbox
//! (docs/volumes.md).

use serde::{Deserialize, Serialize};

/// A volume mounted into a sandbox: the `volumes` of a task or session spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    /// The volume's name (`tandem volume create NAME`).
    pub name: String,
    /// Where the sandbox sees it: relative to the workspace (`data`), or, on executors
    /// whose sandbox has a filesystem of its own (Docker, Kubernetes), absolute (`/data`).
    pub path: String,
    /// Mounted read-only: the block's writes fail.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

impl VolumeMount {
    /// Parses `NAME:PATH[:ro|:rw]`, the `--volume` flag's form; an error names what is wrong.
    pub fn parse(flag: &str) -> Result<Self, String> {
        let mut parts = flag.split(':');
        let (Some(name), Some(path)) = (parts.next(), parts.next()) else {
            return Err(format!(
                "--volume `{flag}`: expected NAME:PATH or NAME:PATH:ro (such as data:/data:ro)"
            ));
        };
        let read_only = match parts.next() {
            None | Some("rw") => false,
            Some("ro") => true,
            Some(other) => {
                return Err(format!(
                    "--volume `{flag}`: `{other}` is not a mode; the third part is `ro` or `rw`"
                ));
            }
        };
        if parts.next().is_some() {
            return Err(format!(
                "--volume `{flag}`: too many `:`; expected NAME:PATH[:ro]"
            ));
        }
        let mount = Self {
            name: name.to_owned(),
            path: path.to_owned(),
            read_only,
        };
        mount
            .check()
            .map_err(|e| format!("--volume `{flag}`: {e}"))?;
        Ok(mount)
    }

    /// Why the mount cannot be made as written, naming the field; `Ok` when it can.
    pub fn check(&self) -> Result<(), String> {
        if !valid_name(&self.name) {
            return Err(format!(
                "`{}` is not a volume name: 1 to 64 of a-z, 0-9, `_` and `-`, starting with a letter or digit",
                self.name
            ));
        }
        mount_path(&self.path).map(|_| ())
    }
}

/// Whether `name` may name a volume: 1 to 64 of `a-z0-9_-`, not starting with `_` or `-`
/// (so that it can name a directory, a Docker volume and a Kubernetes claim).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
}

/// Where a mount goes, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MountPath {
    /// Beneath the workspace: its normal components.
    InWorkspace(String),
    /// An absolute path of the sandbox's own filesystem.
    Absolute(String),
}

/// Paths a volume may not cover: what the sandbox itself runs on, and where its programs and
/// their libraries are found (Tandem's runner, which may be root, starts `python3` and `tar`
/// from `PATH`: a volume a block filled must not put its own there).
const RESERVED: &[&str] = &[
    "/proc",
    "/sys",
    "/dev",
    "/run/tandem",
    "/tmp",
    "/workspace",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
];

/// Checks a mount's `path`: no `..`, `.` or empty parts, not the workspace itself, nor
/// the sandbox's `/`, `/proc`, `/sys`, `/dev`, `/tmp`, Tandem's own `/run/tandem`, nor where
/// programs and their libraries are found (`/usr`, `/bin`, `/sbin`, `/lib*`, `/etc`).
pub fn mount_path(path: &str) -> Result<MountPath, String> {
    let absolute = path.starts_with('/');
    let rest = path.trim_start_matches('/').trim_end_matches('/');
    if rest.is_empty() {
        return Err(format!(
            "path `{path}` names the sandbox's root or nothing; name a directory such as /data or data"
        ));
    }
    if path.len() > 1024 || path.contains('\0') {
        return Err("a volume's path is at most 1024 bytes, with no NUL".to_owned());
    }
    for part in rest.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err(format!(
                "path `{path}` has an empty, `.` or `..` part; name the directory plainly"
            ));
        }
    }
    let rest = rest.to_owned();
    if !absolute {
        return Ok(MountPath::InWorkspace(rest));
    }
    let full = format!("/{rest}");
    if let Some(r) = RESERVED
        .iter()
        .find(|r| full == **r || full.starts_with(&format!("{r}/")))
    {
        return Err(format!(
            "path `{path}` is beneath {r}, which the sandbox itself needs; mount the volume elsewhere (such as /data, or data inside the workspace)"
        ));
    }
    Ok(MountPath::Absolute(full))
}

/// `POST /v1/volumes`'s body.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeSpec {
    /// Its name.
    pub name: String,
    /// Its quota, in MiB: a block's write past it fails (`No space left on device`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_mb: Option<u64>,
}

/// A volume, as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeInfo {
    /// Its name.
    pub name: String,
    /// Its quota in MiB, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_mb: Option<u64>,
    /// Bytes its files take now, where Tandem can tell without walking them (a volume with a
    /// quota: its filesystem's count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<u64>,
    /// When it was made, RFC 3339 in UTC.
    pub created: String,
    /// Sandboxes of this daemon that have it mounted now.
    #[serde(default)]
    pub mounted_by: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_and_its_errors() {
        assert_eq!(
            VolumeMount::parse("data:/data:ro").unwrap(),
            VolumeMount {
                name: "data".into(),
                path: "/data".into(),
                read_only: true
            }
        );
        assert!(!VolumeMount::parse("data:out").unwrap().read_only);
        for bad in [
            "data",
            "data:/data:rx",
            "Data:/d",
            "-x:/d",
            "d:/",
            "d:/proc/x",
            "d:/workspace",
            "d:/tmp",
            "d:/usr/local/bin",
            "d:/bin",
            "d:/lib64",
            "d:/etc/ld.so.preload",
            "d:a/../b",
            "d:/a:ro:ro",
            "d:",
        ] {
            assert!(VolumeMount::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            mount_path("/workspace2/x/").unwrap(),
            MountPath::Absolute("/workspace2/x".into())
        );
        assert!(mount_path("/usr2").is_ok() && mount_path("/opt/tools").is_ok());
        assert_eq!(
            mount_path("a/b").unwrap(),
            MountPath::InWorkspace("a/b".into())
        );
        assert!(valid_name(&"a".repeat(64)) && !valid_name(&"a".repeat(65)));
    }
}
