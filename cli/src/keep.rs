//! What `tandem run` keeps when a task ends: the files the task made or changed, copied out
//! of its workspace (in this process) or fetched from the daemon, into a fresh
//! `<out>/<task id>/` (`./tandem-out` unless `--out` says otherwise).
//!
//! Names come from the sandbox, so they are hostile: each file is written beneath a handle
//! on that fresh directory, created new (never over something there), and read from the
//! workspace as downloads are read (no link followed, no more than its measured size).

use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use tandem_executor_kit::archive::{self, ListedFile};

/// Most workspace entries looked at for what a task made.
pub const MADE_SCAN: usize = 100_000;

/// Where `tandem run` keeps what a task made.
#[derive(Clone, Debug, clap::Args)]
pub struct OutFlags {
    /// Keep the files the task made or changed in DIR/TASK-ID/ when it ends; `-` keeps
    /// nothing [default: ./tandem-out]
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Most megabytes of files kept from one task; the rest are named with how to get them
    #[arg(long, value_name = "MB", default_value_t = 256)]
    pub out_max_mb: u64,
    /// Show pictures by their path only, never inline (they are shown inline only on a
    /// terminal that speaks the kitty, iTerm2 or sixel image protocol)
    #[arg(long)]
    pub no_pictures: bool,
}

impl OutFlags {
    /// The directory kept files go under, or `None` for `--out -`.
    pub fn dir(&self) -> Option<PathBuf> {
        match &self.out {
            Some(p) if p.as_os_str() == "-" => None,
            Some(p) => Some(p.clone()),
            None => Some(PathBuf::from("tandem-out")),
        }
    }

    /// `--out-max-mb` in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.out_max_mb.saturating_mul(1 << 20)
    }
}

/// A file the task made, to keep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Made {
    /// Its path in the workspace: plain names only.
    pub rel: PathBuf,
    /// Its size when listed.
    pub bytes: u64,
}

impl Made {
    /// Its path as a person may safely read it.
    pub fn shown(&self) -> String {
        tandem_protocol::files::shown(&self.rel.to_string_lossy()).into_owned()
    }
}

impl From<ListedFile> for Made {
    fn from(f: ListedFile) -> Self {
        Self {
            rel: f.path,
            bytes: f.bytes,
        }
    }
}

/// A file kept.
#[derive(Clone, Debug)]
pub struct Saved {
    /// Which file of the workspace.
    pub file: Made,
    /// Where it was written.
    pub to: PathBuf,
}

/// What keeping a task's files came to.
#[derive(Debug, Default)]
pub struct Kept {
    /// The directory they went to; `None` when the task made nothing.
    pub dir: Option<PathBuf>,
    /// The files written, in path order.
    pub saved: Vec<Saved>,
    /// The files left out because `--out-max-mb` was reached.
    pub over: Vec<Made>,
    /// The files that could not be kept, each with why.
    pub failed: Vec<(Made, String)>,
    /// Why nothing could be kept at all (the directory could not be made, the daemon did
    /// not list the files).
    pub not_kept: Option<String>,
}

impl Kept {
    /// Whether something the task made could not be kept (the size cap aside, which the
    /// user set).
    pub fn lost_any(&self) -> bool {
        self.not_kept.is_some() || !self.failed.is_empty()
    }

    /// Whether every file the task made is in [`Kept::dir`].
    pub fn whole(&self) -> bool {
        !self.lost_any() && self.over.is_empty()
    }
}

/// The files to take within `max_bytes`, in path order, and those left over.
pub fn within(made: Vec<Made>, max_bytes: u64) -> (Vec<Made>, Vec<Made>) {
    let mut total = 0u64;
    let mut taken = Vec::new();
    let mut over = Vec::new();
    for f in made {
        if over.is_empty() && total.saturating_add(f.bytes) <= max_bytes {
            total += f.bytes;
            taken.push(f);
        } else {
            over.push(f);
        }
    }
    (taken, over)
}

/// A fresh directory that kept files are written into, beneath its handle.
pub struct Target {
    dir: cap_std::fs::Dir,
    path: PathBuf,
}

impl Target {
    /// Makes `<out>/<id>`: `out` as needed (the user's own path), `id` new.
    pub fn create(out: &Path, id: &str) -> Result<Self, String> {
        let path = out.join(id);
        let fail = |e: std::io::Error| {
            format!(
                "cannot make {} to keep the task's files in: {e}; give --out a directory you can write (or --out - to keep nothing)",
                path.display()
            )
        };
        std::fs::create_dir_all(out).map_err(fail)?;
        std::fs::create_dir(&path).map_err(fail)?;
        let dir = cap_std::fs::Dir::open_ambient_dir(&path, cap_std::ambient_authority())
            .map_err(fail)?;
        Ok(Self { dir, path })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A new file at `rel` (plain names; its directories made), open for writing.
    pub fn file(&self, rel: &Path) -> std::io::Result<std::fs::File> {
        if rel.as_os_str().is_empty()
            || !rel.components().all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a plain path inside the workspace",
            ));
        }
        if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) {
            self.dir.create_dir_all(parent)?;
        }
        let mut options = cap_std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        Ok(self.dir.open_with(rel, &options)?.into_std())
    }

    /// Writes `from` (at most `bytes` of it) to a new file at `rel`; one that could not be
    /// written whole is removed, so that no part of a file passes for the file.
    pub fn write(&self, rel: &Path, from: impl Read, bytes: u64) -> std::io::Result<u64> {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, self.file(rel)?);
        let written =
            std::io::copy(&mut from.take(bytes), &mut out).and_then(|n| out.flush().map(|()| n));
        if written.is_err() {
            self.discard(rel);
        }
        written
    }

    /// Removes what was written of `rel`.
    pub fn discard(&self, rel: &Path) {
        let _ = self.dir.remove_file(rel);
    }
}

/// Why writing a kept file failed, as a person reads it.
pub fn why(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(code) if code == nix::libc::ENAMETOOLONG => {
            format!("this machine cannot hold a name that long ({e})")
        }
        Some(code) if code == nix::libc::EILSEQ || code == nix::libc::EINVAL => {
            format!("the file system of --out cannot hold this name ({e})")
        }
        _ => e.to_string(),
    }
}

/// Keeps the files `workspace` (this process's) holds that the task made, within
/// `max_bytes`, in `<out>/<id>`.
pub fn from_workspace(
    workspace: &Path,
    made: Vec<Made>,
    out: &Path,
    id: &str,
    max_bytes: u64,
) -> Kept {
    let mut kept = Kept::default();
    if made.is_empty() {
        return kept;
    }
    let (taken, over) = within(made, max_bytes);
    kept.over = over;
    if taken.is_empty() {
        return kept;
    }
    let target = match Target::create(out, id) {
        Ok(t) => t,
        Err(e) => {
            kept.not_kept = Some(e);
            return kept;
        }
    };
    for file in taken {
        let copied = archive::read_path(workspace, &file.rel)
            .map_err(|e| e.to_string())
            .and_then(|(from, size)| target.write(&file.rel, from, size).map_err(|e| why(&e)));
        match copied {
            Ok(bytes) => kept.saved.push(Saved {
                to: target.path().join(&file.rel),
                file: Made { bytes, ..file },
            }),
            Err(e) => kept.failed.push((file, e)),
        }
    }
    kept.dir = Some(target.path().to_owned());
    kept
}

/// Keeps the files that task `id` on the daemon made (its list marks those it was given
/// and left alone), fetched within `max_bytes`, in `<out>/<id>`.
pub async fn from_daemon(
    client: &crate::client::Client,
    id: &str,
    out: &Path,
    max_bytes: u64,
) -> Kept {
    let mut kept = Kept::default();
    let listed = match client
        .get(&format!("/v1/tasks/{id}/files"))
        .await
        .and_then(|v| crate::client::typed::<tandem_protocol::files::TaskFiles>(v, "a file list"))
    {
        Ok(list) => list,
        Err(e) => {
            kept.not_kept = Some(format!(
                "cannot list the files of task {id} on the daemon: {e:#}; `tandem files {id}` lists them"
            ));
            return kept;
        }
    };
    let made: Vec<Made> = listed
        .files
        .into_iter()
        .map(|f| {
            (
                f.given,
                Made {
                    rel: PathBuf::from(f.path),
                    bytes: f.bytes,
                },
            )
        })
        .filter(|(given, f)| !given && !tandem_executor_kit::archive::is_tandems(&f.rel))
        .map(|(_, f)| f)
        .collect();
    if made.is_empty() {
        return kept;
    }
    let (taken, over) = within(made, max_bytes);
    kept.over = over;
    if taken.is_empty() {
        return kept;
    }
    let target = match Target::create(out, id) {
        Ok(t) => t,
        Err(e) => {
            kept.not_kept = Some(e);
            return kept;
        }
    };
    for file in taken {
        let fetched = fetch(client, id, &file, &target).await;
        if fetched.is_err() {
            target.discard(&file.rel);
        }
        match fetched {
            Ok(bytes) => kept.saved.push(Saved {
                to: target.path().join(&file.rel),
                file: Made { bytes, ..file },
            }),
            Err(e) => kept.failed.push((file, e)),
        }
    }
    kept.dir = Some(target.path().to_owned());
    kept
}

/// Downloads `file` of task `id` into `target`, no more than its listed size.
async fn fetch(
    client: &crate::client::Client,
    id: &str,
    file: &Made,
    target: &Target,
) -> Result<u64, String> {
    let path = file.rel.to_string_lossy();
    let mut resp = client
        .download(&tandem_daemon::supervisor::file_href(id, &path))
        .await
        .map_err(|e| format!("{e:#}"))?;
    let mut out = target.file(&file.rel).map_err(|e| why(&e))?;
    let mut written = 0u64;
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| format!("the download broke off: {e}"))?
    {
        if written == file.bytes {
            break;
        }
        let room = usize::try_from(file.bytes - written).unwrap_or(usize::MAX);
        let part = &chunk[..chunk.len().min(room)];
        out.write_all(part).map_err(|e| why(&e))?;
        written += part.len() as u64;
    }
    out.flush().map_err(|e| why(&e))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made(name: &str, bytes: u64) -> Made {
        Made {
            rel: PathBuf::from(name),
            bytes,
        }
    }

    #[test]
    fn the_cap_takes_files_in_order_and_leaves_the_rest() {
        let (taken, over) = within(vec![made("a", 4), made("b", 5), made("c", 1)], 8);
        assert_eq!(taken, vec![made("a", 4)]);
        // Not c, though it would fit: what is kept is a prefix of the listing.
        assert_eq!(over, vec![made("b", 5), made("c", 1)]);
        let (taken, over) = within(vec![made("a", 4), made("b", 4)], 8);
        assert_eq!((taken.len(), over.len()), (2, 0));
    }

    #[test]
    fn a_target_writes_only_beneath_itself_and_never_over_a_file() -> std::io::Result<()> {
        let out = tempfile::tempdir()?;
        let t = Target::create(out.path(), "t1").map_err(std::io::Error::other)?;
        assert_eq!(t.write(Path::new("d/x.txt"), &b"hello"[..], 3)?, 3);
        assert_eq!(std::fs::read(out.path().join("t1/d/x.txt"))?, b"hel");
        assert!(t.write(Path::new("d/x.txt"), &b"again"[..], 5).is_err());
        assert!(t.write(Path::new("../escape"), &b"x"[..], 1).is_err());
        assert!(!out.path().join("escape").exists());
        // The same task id twice is refused, not mixed.
        assert!(Target::create(out.path(), "t1").is_err());
        Ok(())
    }
}
