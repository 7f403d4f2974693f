//! What a task made: the regular files of its workspace other than those it was given and
//! left as they were, and other than Tandem's own. This is what `tandem run` keeps when a
//! task ends, and what a daemon's file list tells apart from the inputs.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::archive::{self, ArchiveError, ListedFile};

/// The files a task was given: each one's size and SHA-256, by its path in the workspace.
#[derive(Clone, Debug, Default)]
pub struct Given(HashMap<PathBuf, (u64, [u8; 32])>);

impl Given {
    /// The regular files of the inputs archive `archive`, by the paths the workspace gets
    /// them at; an entry the archive rules refuse is refused here too.
    pub fn of_archive(archive: impl Read) -> Result<Self, ArchiveError> {
        let mut tar = tar::Archive::new(archive);
        let mut given = HashMap::new();
        for entry in tar.entries().map_err(ArchiveError::Malformed)? {
            let mut entry = entry.map_err(ArchiveError::Malformed)?;
            let admitted = archive::admit(&entry)?;
            if admitted.dir {
                continue;
            }
            let sum = digest(&mut entry).map_err(ArchiveError::Malformed)?;
            given.insert(admitted.rel, sum);
        }
        Ok(Self(given))
    }

    /// Whether `file` of `workspace` is a given file with its bytes unchanged. One that
    /// cannot be read (swapped for a FIFO, removed meanwhile) counts as changed, so that the
    /// copy that follows says what is wrong with it.
    pub fn unchanged(&self, workspace: &Path, file: &ListedFile) -> bool {
        let Some(&(bytes, want)) = self.0.get(&file.path) else {
            return false;
        };
        if bytes != file.bytes {
            return false;
        }
        archive::read_path(workspace, &file.path)
            .ok()
            .and_then(|(f, size)| digest(&mut f.take(size)).ok())
            .is_some_and(|got| got == (bytes, want))
    }
}

/// Size and SHA-256 of what `from` reads.
fn digest(from: &mut impl Read) -> std::io::Result<(u64, [u8; 32])> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut bytes = 0u64;
    loop {
        let n = from.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok((bytes, hasher.finalize().into()))
}

/// The files of `workspace` the task made or changed, in path order: the keeper walks it
/// (no link followed, at most `max_entries` entries looked at).
pub fn made(
    workspace: &Path,
    given: &Given,
    max_entries: usize,
) -> Result<Vec<ListedFile>, ArchiveError> {
    Ok(archive::list(workspace, max_entries)?
        .into_iter()
        .filter(|f| !archive::is_tandems(&f.path) && !given.unchanged(workspace, f))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in files {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, name, *data).unwrap_or_default();
        }
        b.into_inner().unwrap_or_default()
    }

    #[test]
    fn given_files_left_alone_are_not_made_and_changed_ones_are() -> std::io::Result<()> {
        let ws = tempfile::tempdir()?;
        let given = Given::of_archive(
            &inputs(&[
                ("same.csv", b"a,b\n"),
                ("d/edit.txt", b"one"),
                ("gone", b"x"),
            ])[..],
        )
        .map_err(std::io::Error::other)?;
        std::fs::create_dir_all(ws.path().join("d"))?;
        std::fs::create_dir_all(ws.path().join(".tandem"))?;
        std::fs::write(ws.path().join("same.csv"), b"a,b\n")?;
        // Same size, other bytes: changed.
        std::fs::write(ws.path().join("d/edit.txt"), b"two")?;
        std::fs::write(ws.path().join("chart.png"), b"png")?;
        std::fs::write(ws.path().join(".tandem-block-1.py"), b"print()")?;
        std::fs::write(ws.path().join(".tandem/state"), b"")?;
        std::os::unix::fs::symlink("/etc/passwd", ws.path().join("leak"))?;
        let made: Vec<PathBuf> = made(ws.path(), &given, 1000)
            .map_err(std::io::Error::other)?
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(
            made,
            vec![PathBuf::from("chart.png"), PathBuf::from("d/edit.txt")]
        );
        Ok(())
    }
}
