//! The host copy (the mirror) of a workspace that lives in the sandbox, brought up to date
//! after every block from what the runner reported, by whatever way the executor copies a
//! path out of its sandbox.

use std::path::{Path, PathBuf};

use tandem_executor::{BoxFuture, ExecError};
use tandem_executor_kit::archive::{self, ArchiveCaps, ArchiveError};

use crate::Changes;

/// More changed files than this are fetched as one archive of the whole workspace instead of
/// one request each.
const WHOLE_AFTER: usize = 16;

/// Most bytes of one archive copied out of a sandbox: what a block shapes (a tree 100,000
/// deep is gigabytes of tar headers; a sparse file is all its zeros in a tar) must not fill
/// this machine's disk. A workspace over it is not mirrored (the copy says so, and the next
/// block tries again).
pub const FETCH_MAX: u64 = 2 << 30;

/// How much of a workspace is copied out to the mirror.
const MIRROR_CAPS: ArchiveCaps = ArchiveCaps {
    max_bytes: FETCH_MAX,
    max_entries: 200_000,
};

/// Copies one path out of the sandbox as a tar archive, spooled to a file: the path's last
/// component at the archive's top (as `tar -C DIR -c NAME` makes it, and Docker's archive
/// call), or `None` when the path is gone.
pub trait Fetch: Send {
    /// The archive of `path` (absolute, under `/workspace`); an error, and nothing more
    /// written, once it is over `max_bytes`.
    fn fetch(
        &mut self,
        path: String,
        max_bytes: u64,
    ) -> BoxFuture<'_, Result<Option<std::fs::File>, ExecError>>;
}

/// The error of a copy out of a sandbox that went over `max` bytes.
pub fn over_max(path: &str, max: u64) -> ExecError {
    ExecError::Backend(format!(
        "copying `{path}` out of the sandbox stopped at {} MiB: the workspace is not mirrored while it is that large",
        max >> 20
    ))
}

/// Brings `mirror` up to date with what a block changed, as `changes` and the `inline` tar
/// say; `whole` (or a change the runner could not itemise) copies the whole workspace.
pub async fn sync(
    mirror: &Path,
    changes: Changes,
    inline: Vec<u8>,
    whole: bool,
    fetch: &mut dyn Fetch,
) -> Result<(), ExecError> {
    let whole = whole
        || changes.all
        || (!changes.inline
            && changes.changed.iter().filter(|(_, k)| k == "f").count() > WHOLE_AFTER);
    if whole {
        let Some(archive) = fetch.fetch("/workspace".to_owned(), FETCH_MAX).await? else {
            return Ok(());
        };
        let mirror = mirror.to_owned();
        return blocking(move || replace(&mirror, archive)).await;
    }
    for path in changes.removed {
        let mirror = mirror.to_owned();
        blocking(move || archive::remove_beneath(&mirror, &path)).await?;
    }
    for (path, kind) in changes.changed {
        let rel = PathBuf::from(&path);
        let parent = rel.parent().map(Path::to_owned).unwrap_or_default();
        let archive = match kind.as_str() {
            // Came inline, unpacked below.
            "f" if changes.inline => continue,
            "f" => match fetch.fetch(format!("/workspace/{path}"), FETCH_MAX).await? {
                Some(archive) => archive,
                None => continue,
            },
            "d" => empty_archive()?,
            // Links and the like are not copied: what was there before goes.
            _ => {
                let mirror = mirror.to_owned();
                blocking(move || archive::remove_beneath(&mirror, &path)).await?;
                continue;
            }
        };
        let (mirror, sub) = (mirror.to_owned(), if kind == "d" { rel } else { parent });
        blocking(move || {
            archive::unpack_beneath(
                &mirror,
                &sub,
                None,
                std::io::BufReader::new(archive),
                MIRROR_CAPS,
            )
            .map(drop)
        })
        .await?;
    }
    if changes.inline {
        let mirror = mirror.to_owned();
        blocking(move || {
            archive::unpack_beneath(
                &mirror,
                Path::new(""),
                None,
                std::io::Cursor::new(inline),
                MIRROR_CAPS,
            )
            .map(drop)
        })
        .await?;
    }
    Ok(())
}

/// Makes the mirror exactly the archive of the whole workspace (`workspace/...` entries).
fn replace(mirror: &Path, archive: std::fs::File) -> Result<(), ArchiveError> {
    let placed = archive::unpack_beneath(
        mirror,
        Path::new(""),
        Some("workspace"),
        std::io::BufReader::new(archive),
        MIRROR_CAPS,
    )?;
    let kept: std::collections::HashSet<_> = placed.into_iter().map(|f| f.path).collect();
    for f in archive::list(mirror, MIRROR_CAPS.max_entries)? {
        if !kept.contains(&f.path) {
            archive::remove_beneath(mirror, &f.path.to_string_lossy())?;
        }
    }
    Ok(())
}

/// Packs the mirror (`None`), or these files of it with entries for their directories, as a
/// tar owned by `owner`, spooled to a file at its start: what goes into the sandbox's
/// workspace.
pub async fn pack(
    mirror: &Path,
    files: Option<Vec<PathBuf>>,
    owner: (u64, u64),
) -> Result<std::fs::File, ExecError> {
    let mirror = mirror.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut out = tempfile::tempfile()
            .map_err(|e| ExecError::io("making room to pack the workspace", e))?;
        let caps = ArchiveCaps {
            max_bytes: u64::MAX,
            max_entries: usize::MAX,
        };
        match files {
            None => drop(archive::pack_owned(
                &mirror,
                "",
                &mut out,
                caps,
                Some(owner),
            )?),
            Some(files) => archive::pack_files_owned(&mirror, &files, &mut out, owner)?,
        }
        use std::io::Seek;
        out.rewind()
            .map_err(|e| ExecError::io("packing the workspace", e))?;
        Ok::<_, ExecError>(out)
    })
    .await
    .map_err(|e| ExecError::Backend(format!("packing the workspace stopped: {e}")))?
}

/// The numeric `uid`, `gid` of a `uid:gid` user, whom files put in the sandbox's workspace
/// belong to; a name (which only the image can resolve) falls back to nobody's.
pub fn block_owner(user: &str) -> (u64, u64) {
    let (u, g) = user.split_once(':').unwrap_or((user, user));
    let uid = u.parse().unwrap_or(65534);
    (uid, g.parse().unwrap_or(uid))
}

/// Whether the directory at `path` holds anything.
pub fn has_entries(path: &Path) -> bool {
    std::fs::read_dir(path).is_ok_and(|mut d| d.next().is_some())
}

/// An archive with nothing in it.
fn empty_archive() -> Result<std::fs::File, ExecError> {
    use std::io::{Seek, Write};
    let io = |e| ExecError::io("copying the workspace out", e);
    let mut file = tempfile::tempfile().map_err(io)?;
    file.write_all(&[0u8; 1024]).map_err(io)?;
    file.rewind().map_err(io)?;
    Ok(file)
}

/// Runs archive work off the async threads.
async fn blocking(
    work: impl FnOnce() -> Result<(), ArchiveError> + Send + 'static,
) -> Result<(), ExecError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ExecError::Backend(format!("copying the workspace out stopped: {e}")))?
        .map_err(ExecError::Files)
}
