//! Files into and out of a session's workspace as tar archives: the form files take through
//! the API, the CLI and (later) a container engine's archive calls.
//!
//! Both directions are resolved beneath the workspace's directory handle (`cap-std`), so a
//! link that code in the session planted cannot lead a write or a read out of it. An archive
//! going in may hold only regular files and directories, under relative paths with no `..`;
//! links, devices, FIFOs and sparse entries are refused by name, and its size is counted as
//! it is read, whatever its headers claim. An archive coming out holds the regular files and
//! directories there, never following a link.

use std::io::{Read, Write};
use std::os::fd::BorrowedFd;
use std::path::{Component, Path, PathBuf};

use cap_fs_ext::DirExt as _;
use cap_std::ambient_authority;
use cap_std::fs::Dir;

use crate::keeper;

pub use tandem_executor::files::{ArchiveCaps, ArchiveError, ArchivedFile};

/// Puts the regular files and directories of the tar archive `archive` into `workspace`,
/// beneath it only; a file already there is replaced. Returns the files placed.
pub fn unpack_into(
    workspace: &Path,
    archive: impl Read,
    caps: ArchiveCaps,
) -> Result<Vec<ArchivedFile>, ArchiveError> {
    unpack_dir(&open(workspace)?, None, false, archive, caps, None)
}

/// [`unpack_into`], each file and directory placed given to `owner` (`uid`, `gid`): files
/// for a sandbox whose code runs as that user and must be able to change them. Where this
/// process may not give files away (not root), they are made writable by all instead, as the
/// workspace itself is.
pub fn unpack_owned(
    workspace: &Path,
    archive: impl Read,
    caps: ArchiveCaps,
    owner: (u32, u32),
) -> Result<Vec<ArchivedFile>, ArchiveError> {
    unpack_dir(&open(workspace)?, None, false, archive, caps, Some(owner))
}

/// Gives what `fd` is (opened by this process, so no link can stand in for it) to `owner`;
/// where that is not allowed, opens it to all with `mode`.
fn give(fd: std::os::fd::BorrowedFd<'_>, owner: (u32, u32), mode: u32) -> std::io::Result<()> {
    use nix::sys::stat::{Mode, fchmod};
    use nix::unistd::{Gid, Uid, fchown};
    match fchown(
        fd,
        Some(Uid::from_raw(owner.0)),
        Some(Gid::from_raw(owner.1)),
    ) {
        Err(nix::errno::Errno::EPERM) => {
            fchmod(fd, Mode::from_bits_truncate(mode)).map_err(std::io::Error::from)
        }
        other => other.map_err(std::io::Error::from),
    }
}

/// Gives `rel` in `dir` and every directory on the way to it to `owner` ([`give`]), each
/// opened beneath `dir` without following a link.
fn give_path(dir: &Dir, rel: &Path, owner: (u32, u32)) -> std::io::Result<()> {
    use nix::fcntl::{OFlag, openat};
    use std::os::fd::AsFd as _;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut at: Option<std::os::fd::OwnedFd> = None;
    for part in rel.components() {
        let parent = match &at {
            Some(fd) => fd.as_fd(),
            None => dir.as_fd(),
        };
        let sub = openat(
            parent,
            part.as_os_str(),
            flags,
            nix::sys::stat::Mode::empty(),
        )?;
        give(sub.as_fd(), owner, 0o777)?;
        at = Some(sub);
    }
    Ok(())
}

/// Like [`unpack_into`], into the directory `sub` of `workspace` (made when missing, never
/// through a link), each entry's path first losing the leading component `strip` when given
/// (an entry that is only that component is skipped: it is `sub` itself). This is how an
/// engine's archive of one path comes back: named from that path's last component. It is a
/// copy of a sandbox's files, so links and special entries are left out rather than refused.
/// The files placed are returned relative to `workspace`.
pub fn unpack_beneath(
    workspace: &Path,
    sub: &Path,
    strip: Option<&str>,
    archive: impl Read,
    caps: ArchiveCaps,
) -> Result<Vec<ArchivedFile>, ArchiveError> {
    let mut dir = open(workspace)?;
    let shown = sub.display().to_string();
    let sub = match shown.as_str() {
        "" | "." => PathBuf::new(),
        other => inside(other)?,
    };
    for part in sub.components() {
        let io = |source| ArchiveError::Io {
            path: shown.clone(),
            source,
        };
        match dir.symlink_metadata(part) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => dir.remove_file(part).map_err(io)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        if dir.symlink_metadata(part).is_err() {
            dir.create_dir(part).map_err(io)?;
        }
        dir = dir.open_dir_nofollow(part).map_err(io)?;
    }
    let placed = unpack_dir(&dir, strip, true, archive, caps, None)?;
    Ok(placed
        .into_iter()
        .map(|f| ArchivedFile {
            path: sub.join(f.path),
            bytes: f.bytes,
        })
        .collect())
}

/// Removes the file or directory tree at `rel` in `workspace`, never following a link on
/// the way (a link itself is removed, not what it leads to); one already gone is no error.
/// The tree is removed by the keeper, without recursion, however deep it is.
pub fn remove_beneath(workspace: &Path, rel: &str) -> Result<(), ArchiveError> {
    let path = inside(rel)?;
    let dir = open(workspace)?;
    remove_rel(&dir, &path).map_err(|source| ArchiveError::Io {
        path: rel.to_owned(),
        source,
    })
}

/// Removes `rel` beneath `dir` (see [`remove_beneath`]); a parent that is not a directory
/// (or is a link) means there is nothing there to remove.
fn remove_rel(dir: &Dir, rel: &Path) -> std::io::Result<()> {
    use std::os::fd::AsFd as _;
    let (Some(parent), Some(name)) = (rel.parent(), rel.file_name()) else {
        return Ok(());
    };
    let parent = match keeper::open_dir_beneath(dir.as_fd(), parent) {
        Ok(fd) => fd,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(nix::libc::ENOENT | nix::libc::ENOTDIR | nix::libc::ELOOP)
            ) =>
        {
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    keeper::remove_at(parent.as_fd(), name)
}

fn unpack_dir(
    dir: &Dir,
    strip: Option<&str>,
    lenient: bool,
    archive: impl Read,
    caps: ArchiveCaps,
    owner: Option<(u32, u32)>,
) -> Result<Vec<ArchivedFile>, ArchiveError> {
    use std::os::fd::AsFd as _;
    let mut archive = tar::Archive::new(MetaGuard::new(archive));
    let mut placed = Vec::new();
    let (mut entries, mut bytes) = (0usize, 0u64);
    for entry in archive.entries().map_err(ArchiveError::Malformed)? {
        let mut entry = entry.map_err(ArchiveError::Malformed)?;
        entries += 1;
        if entries > caps.max_entries {
            return Err(ArchiveError::TooMany(caps.max_entries));
        }
        let admitted = match admit_stripped(&entry, strip) {
            // A sandbox's copy: its links and devices are not files to bring out.
            Err(ArchiveError::Kind { .. }) if lenient => continue,
            other => other?,
        };
        let Some(Admitted {
            rel,
            shown,
            dir: is_dir,
        }) = admitted
        else {
            continue;
        };
        let io = |source| ArchiveError::Io {
            path: shown.clone(),
            source,
        };
        if is_dir {
            dir.create_dir_all(&rel).map_err(io)?;
            if let Some(owner) = owner {
                give_path(dir, &rel, owner).map_err(io)?;
            }
            continue;
        }
        let left = caps.max_bytes.saturating_sub(bytes);
        let too_large = || ArchiveError::TooLarge {
            path: shown.clone(),
            max: caps.max_bytes,
        };
        if claims_over(&entry, left)? {
            return Err(too_large());
        }
        if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) {
            dir.create_dir_all(parent).map_err(io)?;
            if let Some(owner) = owner {
                give_path(dir, parent, owner).map_err(io)?;
            }
        }
        // A link (or anything else) at the file's own name is replaced, not written through;
        // in a sandbox's copy a directory there was replaced by this file.
        match dir.symlink_metadata(&rel) {
            Ok(m) if lenient && m.is_dir() => remove_rel(dir, &rel).map_err(io)?,
            Ok(m) if !m.file_type().is_file() => dir.remove_file(&rel).map_err(io)?,
            _ => {}
        }
        let mut file = dir.create(&rel).map_err(io)?;
        // The executable bit travels (a script stays runnable); no other mode bit does.
        // A file already there takes the archive's bit, set or cleared.
        let executable = entry.header().mode().is_ok_and(|m| m & 0o111 != 0);
        let mode = nix::sys::stat::fstat(file.as_fd())
            .map_err(|e| io(e.into()))?
            .st_mode
            & 0o777;
        let wanted = if executable {
            mode | 0o111
        } else {
            mode & !0o111
        };
        if wanted != mode {
            nix::sys::stat::fchmod(
                file.as_fd(),
                nix::sys::stat::Mode::from_bits_truncate(wanted),
            )
            .map_err(|e| io(e.into()))?;
        }
        if let Some(owner) = owner {
            give(file.as_fd(), owner, if executable { 0o777 } else { 0o666 }).map_err(io)?;
        }
        let copied =
            std::io::copy(&mut (&mut entry).take(left.saturating_add(1)), &mut file).map_err(io)?;
        if copied > left {
            drop(file);
            let _ = dir.remove_file(&rel);
            return Err(too_large());
        }
        bytes += copied;
        placed.push(ArchivedFile {
            path: rel,
            bytes: copied,
        });
    }
    Ok(placed)
}

/// Whether `path` is Tandem's own: a block's script or a kept interpreter's channel or
/// saved globals (`.tandem*` at the top of the workspace).
pub fn is_tandems(path: &Path) -> bool {
    path.components()
        .next()
        .and_then(|c| c.as_os_str().to_str())
        .is_some_and(|first| first.starts_with(".tandem"))
}

/// Checks `archive` as [`unpack_into`] would, writing nothing, and finds what a model is told
/// of its files (each one's path and size, and the first lines of the text ones), in one
/// read: its files and that text, or why it would be refused.
pub fn inspect(
    archive: impl Read,
    caps: ArchiveCaps,
) -> Result<(Vec<ArchivedFile>, String), ArchiveError> {
    let mut archive = tar::Archive::new(MetaGuard::new(archive));
    let mut files = Vec::new();
    let mut listing = Listing::default();
    let (mut entries, mut bytes) = (0usize, 0u64);
    for entry in archive.entries().map_err(ArchiveError::Malformed)? {
        let mut entry = entry.map_err(ArchiveError::Malformed)?;
        entries += 1;
        if entries > caps.max_entries {
            return Err(ArchiveError::TooMany(caps.max_entries));
        }
        let Admitted { rel, shown, dir } = admit(&entry)?;
        if dir {
            continue;
        }
        let left = caps.max_bytes.saturating_sub(bytes);
        let too_large = || ArchiveError::TooLarge {
            path: shown.clone(),
            max: caps.max_bytes,
        };
        if claims_over(&entry, left)? {
            return Err(too_large());
        }
        let mut head = Vec::new();
        (&mut entry)
            .take(HEAD_BYTES.min(left.saturating_add(1)))
            .read_to_end(&mut head)
            .map_err(ArchiveError::Malformed)?;
        let rest = std::io::copy(
            &mut (&mut entry).take(left.saturating_add(1) - head.len() as u64),
            &mut std::io::sink(),
        )
        .map_err(ArchiveError::Malformed)?;
        let counted = head.len() as u64 + rest;
        if counted > left {
            return Err(too_large());
        }
        bytes += counted;
        // Tandem's own (a snapshot's kept globals) are placed but not shown to the model.
        if !is_tandems(&rel) {
            listing.add(&shown, counted, &head);
        }
        files.push(ArchivedFile {
            path: rel,
            bytes: counted,
        });
    }
    Ok((files, listing.finish()))
}

/// An entry that may go into a workspace: its clean path, as sent, and whether it is a
/// directory.
pub(crate) struct Admitted {
    pub(crate) rel: PathBuf,
    pub(crate) shown: String,
    pub(crate) dir: bool,
}

/// [`admit`], after taking `strip` off the front of the entry's path; `None` for the entry
/// that is `strip` itself.
fn admit_stripped<R: Read>(
    entry: &tar::Entry<'_, R>,
    strip: Option<&str>,
) -> Result<Option<Admitted>, ArchiveError> {
    let Some(strip) = strip else {
        return admit(entry).map(Some);
    };
    let shown = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
    let full = Path::new(&shown);
    let rest = match full.strip_prefix(strip) {
        Ok(rest) => rest,
        Err(_) => return Err(ArchiveError::Outside(shown)),
    };
    if rest.as_os_str().is_empty() {
        return Ok(None);
    }
    let rel = inside(&rest.to_string_lossy())?;
    let kind = entry.header().entry_type();
    if !kind.is_dir() && !kind.is_file() {
        return Err(ArchiveError::Kind {
            path: shown,
            kind: kind_name(kind),
        });
    }
    Ok(Some(Admitted {
        rel,
        shown,
        dir: kind.is_dir(),
    }))
}

/// `entry` when it is a regular file or a directory under a path inside the workspace.
pub(crate) fn admit<R: Read>(entry: &tar::Entry<'_, R>) -> Result<Admitted, ArchiveError> {
    let shown = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
    let rel = inside(&shown)?;
    let kind = entry.header().entry_type();
    if !kind.is_dir() && !kind.is_file() {
        return Err(ArchiveError::Kind {
            path: shown,
            kind: kind_name(kind),
        });
    }
    Ok(Admitted {
        rel,
        shown,
        dir: kind.is_dir(),
    })
}

/// Most bytes of one GNU long name or link, or pax header, an archive may carry: far over
/// any path a file system holds, far under what the tar reader would otherwise buffer whole.
pub const MAX_META_BYTES: u64 = 64 << 10;

/// A tar stream passed through as it is read, with every header looked at before the tar
/// reader sees it: an entry that only carries metadata (a GNU long name or link, a pax
/// header) and claims more than [`MAX_META_BYTES`] is refused there, before a byte of it is
/// buffered. Tracks entries' boundaries itself, GNU sparse headers' extensions included.
struct MetaGuard<R> {
    inner: R,
    state: Guard,
    /// A header read whole, and how much of it was handed on.
    header: [u8; 512],
    handed: usize,
}

#[derive(Clone, Copy)]
enum Guard {
    /// At the start of a header.
    Header { sparse_ext: bool },
    /// Passing a header on, then `data` bytes (padded) of its entry.
    Passing { data: u64, sparse_ext: bool },
    /// Inside an entry's data.
    Data { left: u64 },
}

impl<R: Read> MetaGuard<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            state: Guard::Header { sparse_ext: false },
            header: [0; 512],
            handed: 0,
        }
    }

    /// Reads the next header whole; `false` at a clean end of the stream.
    fn fill_header(&mut self) -> std::io::Result<bool> {
        let mut got = 0;
        while got < 512 {
            match self.inner.read(&mut self.header[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the archive ends inside a header",
                    ));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

/// The value of a tar numeric field: octal text, or base-256 when its top bit is set.
fn tar_number(field: &[u8]) -> u64 {
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        return field.iter().enumerate().fold(0u64, |n, (i, b)| {
            let b = if i == 0 { b & 0x7f } else { *b };
            n.checked_mul(256).map_or(u64::MAX, |n| n | u64::from(b))
        });
    }
    field
        .iter()
        .skip_while(|b| **b == b' ' || **b == 0)
        .take_while(|b| (b'0'..=b'7').contains(*b))
        .fold(0u64, |n, b| {
            n.saturating_mul(8).saturating_add(u64::from(b - b'0'))
        })
}

impl<R: Read> Read for MetaGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match self.state {
                Guard::Header { sparse_ext } => {
                    if !self.fill_header()? {
                        return Ok(0);
                    }
                    self.handed = 0;
                    let h = &self.header;
                    if sparse_ext {
                        // A GNU sparse extension block: 512 bytes, another follows if flagged.
                        self.state = Guard::Passing {
                            data: 0,
                            sparse_ext: h[504] != 0,
                        };
                        continue;
                    }
                    let kind = h[156];
                    let size = tar_number(&h[124..136]);
                    if matches!(kind, b'L' | b'K' | b'x' | b'g') && size > MAX_META_BYTES {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!(
                                "an entry carries a {size} byte name or extended header; at most {MAX_META_BYTES} bytes are taken"
                            ),
                        ));
                    }
                    self.state = Guard::Passing {
                        data: size.div_ceil(512).saturating_mul(512),
                        sparse_ext: kind == b'S' && h[482] != 0,
                    };
                }
                Guard::Passing { data, sparse_ext } => {
                    if self.handed == 512 {
                        self.state = if data > 0 {
                            Guard::Data { left: data }
                        } else {
                            Guard::Header { sparse_ext }
                        };
                        if sparse_ext && data > 0 {
                            // Extension blocks come before the data; rare enough to refuse.
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::InvalidData,
                                "a sparse entry's extension blocks are not taken",
                            ));
                        }
                        continue;
                    }
                    let n = buf.len().min(512 - self.handed);
                    buf[..n].copy_from_slice(&self.header[self.handed..self.handed + n]);
                    self.handed += n;
                    return Ok(n);
                }
                Guard::Data { left } => {
                    let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                    let n = self.inner.read(&mut buf[..want])?;
                    if n == 0 {
                        return Ok(0);
                    }
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        Guard::Header { sparse_ext: false }
                    } else {
                        Guard::Data { left }
                    };
                    return Ok(n);
                }
            }
        }
    }
}

/// Whether `entry`'s header claims more than `left` bytes. Checked before anything is
/// written, so a huge claim costs nothing; the bytes are counted again as they arrive, so a
/// header that lies is no way round the cap.
fn claims_over<R: Read>(entry: &tar::Entry<'_, R>, left: u64) -> Result<bool, ArchiveError> {
    Ok(entry.header().size().map_err(ArchiveError::Malformed)? > left)
}

/// Writes the regular files and directories at `rel` in `workspace` (the whole workspace
/// when `rel` is empty or `.`) to `out` as a tar archive; links are left out, never
/// followed. Returns the files written.
pub fn pack(
    workspace: &Path,
    rel: &str,
    out: impl Write,
    caps: ArchiveCaps,
) -> Result<Vec<ArchivedFile>, ArchiveError> {
    pack_owned(workspace, rel, out, caps, None)
}

/// [`pack`], with each entry owned by `owner` (`uid`, `gid`) instead of root: an archive
/// for a sandbox whose code runs as that user and must be able to change the files.
pub fn pack_owned(
    workspace: &Path,
    rel: &str,
    out: impl Write,
    caps: ArchiveCaps,
    owner: Option<(u64, u64)>,
) -> Result<Vec<ArchivedFile>, ArchiveError> {
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    let mut packed = Vec::new();
    let mut bytes = 0u64;
    walk(workspace, rel, caps.max_entries, |dir, path, found| {
        let shown = path.display().to_string();
        let io = |source| ArchiveError::Io {
            path: shown.clone(),
            source,
        };
        let mut header = tar::Header::new_gnu();
        header.set_mtime(0);
        if let Some((uid, gid)) = owner {
            header.set_uid(uid);
            header.set_gid(gid);
        }
        match found {
            Found::Dir => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o755);
                header.set_size(0);
                builder
                    .append_data(&mut header, path, std::io::empty())
                    .map_err(io)
            }
            Found::File {
                bytes: size,
                modified_ms,
            } => {
                if owner.is_some() {
                    // A sandbox's copy keeps its files' times (make, caches); a download
                    // does not say when the files were written.
                    header.set_mtime(modified_ms / 1000);
                }
                if size > caps.max_bytes.saturating_sub(bytes) {
                    return Err(ArchiveError::TooLarge {
                        path: shown.clone(),
                        max: caps.max_bytes,
                    });
                }
                let file = open_file(dir, path)?;
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(file_mode(&file));
                header.set_size(size);
                // Only what was measured is read, so a file growing meanwhile cannot break
                // the archive.
                builder
                    .append_data(&mut header, path, file.take(size))
                    .map_err(io)?;
                bytes += size;
                packed.push(ArchivedFile {
                    path: path.to_owned(),
                    bytes: size,
                });
                Ok(())
            }
        }
    })?;
    builder.finish().map_err(|source| ArchiveError::Io {
        path: rel.to_owned(),
        source,
    })?;
    Ok(packed)
}

/// Writes the regular files `files` of `workspace` to `out` as a tar archive owned by `owner`
/// (`uid`, `gid`), each read as [`read`] reads it (a link on the way is refused), keeping
/// their times, with an entry for each directory they are in (else the sandbox would make
/// those as root): the files just placed in a mirror, for the sandbox it mirrors.
pub fn pack_files_owned(
    workspace: &Path,
    files: &[PathBuf],
    out: impl Write,
    owner: (u64, u64),
) -> Result<(), ArchiveError> {
    let mut builder = tar::Builder::new(out);
    let mut dirs = std::collections::BTreeSet::new();
    for path in files {
        let shown = path.display().to_string();
        let parents: Vec<&Path> = path
            .ancestors()
            .skip(1)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
        for dir in parents.into_iter().rev() {
            if dirs.insert(dir.to_owned()) {
                let mut header = tar::Header::new_gnu();
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o755);
                header.set_size(0);
                header.set_uid(owner.0);
                header.set_gid(owner.1);
                builder
                    .append_data(&mut header, dir, std::io::empty())
                    .map_err(|source| ArchiveError::Io {
                        path: dir.display().to_string(),
                        source,
                    })?;
            }
        }
        let (file, size) = read(workspace, &shown)?;
        let io = |source| ArchiveError::Io {
            path: shown.clone(),
            source,
        };
        let modified = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(file_mode(&file));
        header.set_size(size);
        header.set_mtime(modified);
        header.set_uid(owner.0);
        header.set_gid(owner.1);
        builder
            .append_data(&mut header, path, file.take(size))
            .map_err(io)?;
    }
    builder.finish().map_err(|source| ArchiveError::Io {
        path: String::new(),
        source,
    })
}

/// The mode a copied file keeps: its executable bit, nothing else of its own.
fn file_mode(file: &std::fs::File) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    let executable = file
        .metadata()
        .is_ok_and(|m| m.permissions().mode() & 0o111 != 0);
    if executable { 0o755 } else { 0o644 }
}

/// A regular file in a workspace, as [`list`] finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedFile {
    /// Its path, relative to the workspace.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// When it was last written, in milliseconds since the Unix epoch (0 when unknown).
    pub modified_ms: u64,
}

/// The regular files in `workspace`, in path order, at most `max_entries` entries looked at;
/// links are neither listed nor followed.
pub fn list(workspace: &Path, max_entries: usize) -> Result<Vec<ListedFile>, ArchiveError> {
    let mut files = Vec::new();
    walk(workspace, "", max_entries, |_, path, found| {
        if let Found::File { bytes, modified_ms } = found {
            files.push(ListedFile {
                path: path.to_owned(),
                bytes,
                modified_ms,
            });
        }
        Ok(())
    })?;
    Ok(files)
}

/// Opens the regular file `rel` of `workspace` for reading, with its size. A link anywhere
/// on the way is refused rather than followed, so a link planted by code in the session
/// leads nowhere, inside or out; a FIFO or device there is refused without waiting on it.
pub fn read(workspace: &Path, rel: &str) -> Result<(std::fs::File, u64), ArchiveError> {
    read_path(workspace, &inside(rel)?)
}

/// [`read`] for a path as [`list`] gives it (its names need not be UTF-8); one that is not
/// plain names is refused.
pub fn read_path(workspace: &Path, rel: &Path) -> Result<(std::fs::File, u64), ArchiveError> {
    use std::os::fd::AsFd as _;
    let shown = rel.display().to_string();
    if rel.as_os_str().is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(ArchiveError::Outside(shown));
    }
    let dir = open(workspace)?;
    let (file, entry) = open_checked(dir.as_fd(), rel, &shown)?;
    Ok((file, entry.len))
}

/// [`keeper::open_regular`], its refusals as [`ArchiveError`]s naming `shown`.
fn open_checked(
    dir: std::os::fd::BorrowedFd<'_>,
    path: &Path,
    shown: &str,
) -> Result<(std::fs::File, keeper::Entry), ArchiveError> {
    keeper::open_regular(dir, path).map_err(|e| match e {
        keeper::OpenError::NotRegular(kind) => ArchiveError::NotRegular {
            path: shown.to_owned(),
            kind,
        },
        keeper::OpenError::Io(source) => ArchiveError::Io {
            path: shown.to_owned(),
            source,
        },
    })
}

/// The media type of a picture file, by its name's extension; `None` for anything else.
pub fn picture_type(path: &Path) -> Option<&'static str> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    Some(match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "svg" => "image/svg+xml",
        _ => return None,
    })
}

/// What [`walk`] found at a path.
#[derive(Clone, Copy)]
enum Found {
    Dir,
    File { bytes: u64, modified_ms: u64 },
}

/// Visits the directories and regular files beneath `rel` in `workspace` (all of it when
/// `rel` is empty or `.`), in path order, parents first; links and special files are
/// skipped, never followed. The keeper walks, iteratively, at most `max_entries` entries
/// read in all and no path longer than [`keeper::MAX_PATH_BYTES`]; `visit` gets the handle
/// of the directory the entry is in.
fn walk(
    workspace: &Path,
    rel: &str,
    max_entries: usize,
    mut visit: impl FnMut(BorrowedFd<'_>, &Path, Found) -> Result<(), ArchiveError>,
) -> Result<(), ArchiveError> {
    use std::os::fd::AsFd as _;
    let dir = open(workspace)?;
    let start = match rel.trim() {
        "" | "." => PathBuf::new(),
        other => inside(other)?,
    };
    let found = |entry: keeper::Entry| match entry.kind {
        keeper::Kind::Dir => Some(Found::Dir),
        keeper::Kind::File => Some(Found::File {
            bytes: entry.len,
            modified_ms: entry.modified_ms,
        }),
        // Links, sockets, FIFOs and devices stay where they are.
        keeper::Kind::Link | keeper::Kind::Special => None,
    };
    if !start.as_os_str().is_empty() {
        // The start itself: a file is the whole walk; a directory is visited, then entered.
        let parent = start.parent().unwrap_or(Path::new(""));
        let io = |source| ArchiveError::Io {
            path: start.display().to_string(),
            source,
        };
        let parent_fd = keeper::open_dir_beneath(dir.as_fd(), parent).map_err(io)?;
        let name = start.file_name().unwrap_or_default();
        let stat =
            nix::sys::stat::fstatat(&parent_fd, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
                .map_err(|e| io(e.into()))?;
        let entry = keeper::Entry::from_stat(&stat);
        match found(entry) {
            Some(Found::Dir) => visit(parent_fd.as_fd(), &start, Found::Dir)?,
            Some(file) => return visit(parent_fd.as_fd(), &start, file),
            None => return Ok(()),
        }
    }
    let caps = keeper::WalkCaps {
        max_entries,
        sorted: true,
        max_path: Some(keeper::MAX_PATH_BYTES),
    };
    let mut failed = None;
    let walked = keeper::walk(dir.as_fd(), &start, caps, |parent, path, entry| {
        let Some(found) = found(entry) else {
            return Ok(keeper::Step::Skip);
        };
        match visit(parent, path, found) {
            Ok(()) => Ok(keeper::Step::Enter),
            Err(e) => {
                failed = Some(e);
                Err(std::io::Error::other("stopped"))
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    walked.map_err(|e| match e {
        keeper::WalkError::TooMany(max) => ArchiveError::TooMany(max),
        keeper::WalkError::Io { path, source } => ArchiveError::Io {
            path: path.display().to_string(),
            source,
        },
        other => ArchiveError::Io {
            path: rel.to_owned(),
            source: std::io::Error::other(other.to_string()),
        },
    })
}

/// Opens the regular file `path` (its last component, beneath `dir`, the handle of the
/// directory it is in) for reading, through the keeper: no link, no FIFO.
fn open_file(dir: BorrowedFd<'_>, path: &Path) -> Result<std::fs::File, ArchiveError> {
    let name = Path::new(path.file_name().unwrap_or_default());
    open_checked(dir, name, &path.display().to_string()).map(|(file, _)| file)
}

/// Most lines of a text file [`inspect`] shows.
const HEAD_LINES: usize = 5;
/// Most characters of one shown line.
const LINE_CHARS: usize = 200;
/// Most files [`inspect`] lists one by one; the rest are counted.
const LISTED: usize = 50;

/// Bytes of each file [`inspect`] looks at for its first lines.
const HEAD_BYTES: u64 = 8192;

/// The text [`inspect`] writes, file by file.
#[derive(Default)]
struct Listing {
    text: String,
    shown: usize,
    more: usize,
}

impl Listing {
    fn add(&mut self, path: &str, size: u64, head: &[u8]) {
        use std::fmt::Write as _;
        use std::io::BufRead;
        if self.shown == LISTED {
            self.more += 1;
            return;
        }
        self.shown += 1;
        let _ = writeln!(self.text, "- {path} ({size} bytes)");
        // Text: valid UTF-8 up to where the head was cut, and no NUL.
        let head = match std::str::from_utf8(head) {
            Ok(text) => Some(text),
            Err(e) if e.error_len().is_none() => std::str::from_utf8(&head[..e.valid_up_to()]).ok(),
            Err(_) => None,
        };
        if let Some(head) = head.filter(|h| !h.contains('\0')) {
            for line in head
                .as_bytes()
                .lines()
                .take(HEAD_LINES)
                .map_while(Result::ok)
            {
                let line: String = line.chars().take(LINE_CHARS).collect();
                let _ = writeln!(self.text, "    {line}");
            }
        }
    }

    fn finish(mut self) -> String {
        use std::fmt::Write as _;
        if self.more > 0 {
            let _ = writeln!(self.text, "- and {} more files", self.more);
        }
        if self.shown == 0 {
            let _ = writeln!(self.text, "- (no files)");
        }
        format!(
            "Files in your working directory (the current directory):\n{}",
            self.text
        )
        .trim_end()
        .to_owned()
    }
}

fn open(workspace: &Path) -> Result<Dir, ArchiveError> {
    Dir::open_ambient_dir(workspace, ambient_authority()).map_err(|source| ArchiveError::Io {
        path: workspace.display().to_string(),
        source,
    })
}

/// `path` as a relative path of plain names (a `.` is dropped); anything else is refused.
fn inside(path: &str) -> Result<PathBuf, ArchiveError> {
    let mut clean = PathBuf::new();
    for comp in Path::new(path).components() {
        match comp {
            Component::Normal(part) => clean.push(part),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(ArchiveError::Outside(path.to_owned()));
            }
        }
    }
    if clean.as_os_str().is_empty() {
        return Err(ArchiveError::Outside(path.to_owned()));
    }
    Ok(clean)
}

fn kind_name(kind: tar::EntryType) -> &'static str {
    match kind {
        tar::EntryType::Symlink => "symbolic link",
        tar::EntryType::Link => "hard link",
        tar::EntryType::Char | tar::EntryType::Block => "device",
        tar::EntryType::Fifo => "FIFO",
        tar::EntryType::GNUSparse => "sparse file",
        _ => "special entry",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar archive of `entries`, each written with its header as given (no checks: the
    /// archive an attacker would send).
    fn archive(entries: &[(&str, tar::EntryType, &[u8], u64)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (path, kind, data, claimed) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(*kind);
            header.set_size(*claimed);
            header.set_mode(0o644);
            let name = path.as_bytes();
            header.as_old_mut().name[..name.len()].copy_from_slice(name);
            if *kind == tar::EntryType::Symlink {
                header.set_link_name("/etc/passwd").unwrap();
            }
            if *kind == tar::EntryType::GNUSparse {
                // A terabyte of holes in no bytes at all.
                let gnu = header.as_gnu_mut().unwrap();
                gnu.set_real_size(1 << 40);
                gnu.sparse[0].set_offset(1 << 40);
                gnu.sparse[0].set_length(0);
            }
            header.set_cksum();
            out.extend_from_slice(header.as_bytes());
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(512) * 512, 0);
        }
        out.resize(out.len() + 1024, 0);
        out
    }

    fn file(
        path: &'static str,
        data: &'static [u8],
    ) -> (&'static str, tar::EntryType, &'static [u8], u64) {
        (path, tar::EntryType::Regular, data, data.len() as u64)
    }

    fn workspace() -> (tempfile::TempDir, PathBuf) {
        let base = tempfile::tempdir().unwrap();
        let ws = base.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        (base, ws)
    }

    #[test]
    fn files_placed_for_a_sandbox_user_are_theirs_to_change() {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let (_base, ws) = workspace();
        let placed = unpack_owned(
            &ws,
            &archive(&[file("d/e/notes.txt", b"alpha\n"), file("top.csv", b"a\n")])[..],
            ArchiveCaps::default(),
            (65534, 65534),
        )
        .unwrap();
        assert_eq!(placed.len(), 2);
        let root = nix::unistd::geteuid().is_root();
        for path in ["d", "d/e", "d/e/notes.txt", "top.csv"] {
            let m = std::fs::symlink_metadata(ws.join(path)).unwrap();
            if root {
                assert_eq!((m.uid(), m.gid()), (65534, 65534), "{path}");
            } else {
                let want = if m.is_dir() { 0o777 } else { 0o666 };
                assert_eq!(m.permissions().mode() & 0o777, want, "{path}");
            }
        }
        // The workspace itself stays as it was.
        assert_ne!(std::fs::metadata(&ws).unwrap().uid(), 65534);
    }

    #[test]
    fn files_and_directories_go_in_and_come_out_the_same() {
        let (_base, ws) = workspace();
        let tar = archive(&[
            file("sales.csv", b"month,revenue\n1,10\n"),
            ("data", tar::EntryType::Directory, b"", 0),
            file("./data/more.txt", b"more"),
        ]);
        let placed = unpack_into(&ws, &tar[..], ArchiveCaps::default()).unwrap();
        assert_eq!(
            placed,
            vec![
                ArchivedFile {
                    path: "sales.csv".into(),
                    bytes: 19
                },
                ArchivedFile {
                    path: "data/more.txt".into(),
                    bytes: 4
                },
            ]
        );
        assert_eq!(std::fs::read(ws.join("data/more.txt")).unwrap(), b"more");
        let mut out = Vec::new();
        let packed = pack(&ws, ".", &mut out, ArchiveCaps::default()).unwrap();
        assert_eq!(packed.len(), 2);
        let (_again, copy) = workspace();
        unpack_into(&copy, &out[..], ArchiveCaps::default()).unwrap();
        assert_eq!(
            std::fs::read(copy.join("sales.csv")).unwrap(),
            b"month,revenue\n1,10\n"
        );
        let mut one = Vec::new();
        let packed = pack(&ws, "data", &mut one, ArchiveCaps::default()).unwrap();
        assert_eq!(packed[0].path, PathBuf::from("data/more.txt"));
    }

    #[test]
    fn an_archive_cannot_place_anything_outside_or_anything_but_files() {
        let (base, ws) = workspace();
        // Checking says what unpacking would, and writes nothing either way.
        let refused = |entries: &[(&str, tar::EntryType, &'static [u8], u64)]| {
            let tar = archive(entries);
            let checked = inspect(&tar[..], ArchiveCaps::default())
                .map(|(files, _)| files)
                .unwrap_err()
                .to_string();
            let unpacked = unpack_into(&ws, &tar[..], ArchiveCaps::default())
                .unwrap_err()
                .to_string();
            assert_eq!(checked, unpacked);
            unpacked
        };
        assert_eq!(
            refused(&[file("../escaped.txt", b"x")]),
            "`../escaped.txt` is not a path inside the workspace: use a relative path without `..`"
        );
        assert!(refused(&[file("/tmp/abs.txt", b"x")]).contains("not a path inside"));
        assert!(refused(&[file("a/../../b", b"x")]).contains("not a path inside"));
        assert_eq!(
            refused(&[("link", tar::EntryType::Symlink, b"", 0)]),
            "`link` is a symbolic link; only regular files and directories can go into a workspace"
        );
        assert!(refused(&[("hard", tar::EntryType::Link, b"", 0)]).contains("hard link"));
        assert!(refused(&[("dev", tar::EntryType::Char, b"", 0)]).contains("device"));
        assert!(refused(&[("fifo", tar::EntryType::Fifo, b"", 0)]).contains("FIFO"));
        let sparse = refused(&[("sparse", tar::EntryType::GNUSparse, b"", 0)]);
        assert!(sparse.contains("sparse"), "{sparse}");
        // Nothing landed beside the workspace or in it.
        assert!(!base.path().join("escaped.txt").exists());
        assert_eq!(std::fs::read_dir(&ws).unwrap().count(), 0);
    }

    /// A reader that gives `n` zero bytes and counts how many were taken.
    struct Zeros {
        left: u64,
        taken: std::rc::Rc<std::cell::Cell<u64>>,
    }

    impl Read for Zeros {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = usize::try_from(self.left)
                .unwrap_or(usize::MAX)
                .min(buf.len());
            buf[..n].fill(b'a');
            self.left -= n as u64;
            self.taken.set(self.taken.get() + n as u64);
            Ok(n)
        }
    }

    #[test]
    fn a_long_name_entry_is_refused_before_it_is_buffered() {
        // A GNU long name of 200 MiB, as the upload that grew the daemon to 3 GiB sent it.
        for kind in [b'L', b'x', b'K', b'g'] {
            let mut header = tar::Header::new_gnu();
            header.as_old_mut().name[..13].copy_from_slice(b"././@LongLink");
            header.set_size(200 << 20);
            header.set_entry_type(tar::EntryType::new(kind));
            header.set_cksum();
            let taken = std::rc::Rc::new(std::cell::Cell::new(0));
            let body = Zeros {
                left: 200 << 20,
                taken: taken.clone(),
            };
            let stream = std::io::Read::chain(&header.as_bytes()[..], body);
            let err = inspect(stream, ArchiveCaps::default())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("209715200 byte name or extended header"),
                "{err}"
            );
            assert_eq!(taken.get(), 0, "not a byte of the name was read");
        }
        // A long name within the bound still works.
        let long = "d/".repeat(200) + "f.txt";
        let mut out = Vec::new();
        let mut builder = tar::Builder::new(&mut out);
        let mut header = tar::Header::new_gnu();
        header.set_size(2);
        header.set_mode(0o644);
        builder.append_data(&mut header, &long, &b"ok"[..]).unwrap();
        builder.finish().unwrap();
        drop(builder);
        let (_base, ws) = workspace();
        let placed = unpack_into(&ws, &out[..], ArchiveCaps::default()).unwrap();
        assert_eq!(placed[0].path, PathBuf::from(&long));
    }

    #[test]
    fn a_link_planted_in_the_workspace_leads_nowhere_outside() {
        let (base, ws) = workspace();
        let outside = base.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("secret"), "host secret").unwrap();
        // What code in the session could have made.
        std::os::unix::fs::symlink(&outside, ws.join("out")).unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), ws.join("secret.txt")).unwrap();
        let err = unpack_into(
            &ws,
            &archive(&[file("out/planted", b"x")])[..],
            ArchiveCaps::default(),
        )
        .unwrap_err();
        assert!(matches!(err, ArchiveError::Io { .. }), "{err}");
        assert!(!outside.join("planted").exists());
        // An upload at a link's name replaces the link; the host file is untouched.
        unpack_into(
            &ws,
            &archive(&[file("secret.txt", b"mine")])[..],
            ArchiveCaps::default(),
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(outside.join("secret")).unwrap(),
            "host secret"
        );
        assert_eq!(std::fs::read(ws.join("secret.txt")).unwrap(), b"mine");
        // Reading out never follows a link: not the whole workspace, not one named.
        std::os::unix::fs::symlink(outside.join("secret"), ws.join("again")).unwrap();
        let mut out = Vec::new();
        let packed = pack(&ws, ".", &mut out, ArchiveCaps::default()).unwrap();
        let names: Vec<_> = packed.iter().map(|f| f.path.clone()).collect();
        assert_eq!(names, vec![PathBuf::from("secret.txt")]);
        assert!(!String::from_utf8_lossy(&out).contains("host secret"));
        assert!(pack(&ws, "out/secret", std::io::sink(), ArchiveCaps::default()).is_err());
        // Listing and reading one file do not follow one either, at any part of the path;
        // links inside the workspace are refused too, so none can be swapped to lead out.
        std::fs::create_dir(ws.join("sub")).unwrap();
        std::fs::write(ws.join("sub/real.txt"), "inside").unwrap();
        std::os::unix::fs::symlink(ws.join("sub"), ws.join("sublink")).unwrap();
        let listed: Vec<_> = list(&ws, 100)
            .unwrap()
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(
            listed,
            vec![PathBuf::from("secret.txt"), PathBuf::from("sub/real.txt")]
        );
        for planted in [
            "again",
            "out/secret",
            "sublink/real.txt",
            "sublink",
            "../outside/secret",
        ] {
            let err = read(&ws, planted).unwrap_err();
            assert!(
                matches!(
                    err,
                    ArchiveError::NotRegular { .. } | ArchiveError::Outside(_)
                ),
                "{planted}: {err}"
            );
        }
        let (mut file, len) = read(&ws, "sub/real.txt").unwrap();
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        assert_eq!((text.as_str(), len), ("inside", 6));
    }

    #[test]
    fn sizes_are_counted_whatever_the_headers_claim() {
        let (_base, ws) = workspace();
        let caps = ArchiveCaps {
            max_bytes: 10,
            max_entries: 3,
        };
        // A header claiming a terabyte (a sparse bomb) is refused before anything is written.
        let err = unpack_into(
            &ws,
            &archive(&[("huge", tar::EntryType::Regular, b"", 1 << 40)])[..],
            caps,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the files are over the 10 byte limit (at `huge`)"
        );
        assert!(!ws.join("huge").exists());
        let together = archive(&[file("a", b"123456"), file("b", b"123456")]);
        assert!(matches!(
            inspect(&together[..], caps).map(|(files, _)| files),
            Err(ArchiveError::TooLarge { .. })
        ));
        // Files that fit one by one but not together.
        let err = unpack_into(
            &ws,
            &archive(&[file("a", b"123456"), file("b", b"123456")])[..],
            caps,
        )
        .unwrap_err();
        assert!(matches!(err, ArchiveError::TooLarge { .. }), "{err}");
        assert!(!ws.join("b").exists());
        let many: Vec<_> = ["1", "2", "3", "4"].iter().map(|n| file(n, b"")).collect();
        let err = unpack_into(&ws, &archive(&many)[..], caps).unwrap_err();
        assert_eq!(err.to_string(), "the archive has more than 3 entries");
        // Out, too.
        std::fs::write(ws.join("big"), vec![b'x'; 100]).unwrap();
        let err = pack(&ws, "big", std::io::sink(), caps).unwrap_err();
        assert!(matches!(err, ArchiveError::TooLarge { .. }), "{err}");
        // Not an archive at all.
        let err = unpack_into(&ws, &b"not a tar archive, just some text"[..], caps);
        assert!(err.is_err());
    }
}
