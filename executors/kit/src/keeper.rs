//! The one keeper of sandbox-shaped trees: every host-side touch of a directory that code in a
//! sandbox could have shaped (a workspace, a block's tmp, a kept interpreter's `.tandem/`)
//! goes through here.
//!
//! Invariants, whatever the tree holds:
//! - nothing is resolved through a link: every step is an `openat` beneath a directory
//!   handle with `O_NOFOLLOW`, so a link planted anywhere leads nowhere;
//! - a file is opened with `O_NONBLOCK` and its descriptor checked (`fstat`) before a byte is
//!   read, so a FIFO or device swapped in for a file cannot stall the reader;
//! - walks are iterative: no recursion, at most two descriptors open (three while removing),
//!   memory bounded by the entries a caller lets it look at (removal holds no names at all),
//!   whatever the depth or width;
//! - sizes are allocated blocks (`st_blocks`), not the sizes files claim, so sparse files
//!   weigh what they cost on disk.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, RenameFlags, openat, renameat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat};
use nix::unistd::{UnlinkatFlags, unlinkat};

/// Longest relative path a walk descends to; deeper entries are no path a client could
/// name (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

fn errno(e: Errno) -> io::Error {
    io::Error::from(e)
}

/// What a directory entry is, from `lstat` (never followed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A directory.
    Dir,
    /// A regular file.
    File,
    /// A symbolic link.
    Link,
    /// A FIFO, socket or device.
    Special,
}

fn kind_of(stat: &FileStat) -> Kind {
    match SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFDIR => Kind::Dir,
        SFlag::S_IFREG => Kind::File,
        SFlag::S_IFLNK => Kind::Link,
        _ => Kind::Special,
    }
}

/// One entry as a walk meets it.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// What it is.
    pub kind: Kind,
    /// Its apparent size in bytes (what reading it gives).
    pub len: u64,
    /// Bytes it holds on disk (`st_blocks` × 512).
    pub allocated: u64,
    /// When it was last written, in milliseconds since the Unix epoch (0 before it).
    pub modified_ms: u64,
}

impl Entry {
    /// The entry `stat` (an `lstat`) describes.
    pub fn from_stat(stat: &FileStat) -> Self {
        let modified_ms = u64::try_from(stat.st_mtime)
            .unwrap_or(0)
            .saturating_mul(1000)
            .saturating_add(u64::try_from(stat.st_mtime_nsec / 1_000_000).unwrap_or(0));
        Self {
            kind: kind_of(stat),
            len: u64::try_from(stat.st_size).unwrap_or(0),
            allocated: u64::try_from(stat.st_blocks)
                .unwrap_or(0)
                .saturating_mul(512),
            modified_ms,
        }
    }
}

/// Opens the directory `path`, the last component not followed (its parents are the
/// daemon's own, not a sandbox's).
pub fn open_root(path: &Path) -> io::Result<OwnedFd> {
    openat(nix::fcntl::AT_FDCWD, path, DIR_FLAGS, Mode::empty()).map_err(errno)
}

/// `rel` as plain names (a `.` is dropped); `None` for `..`, an absolute path, or nothing.
pub fn plain(rel: &Path) -> Option<Vec<&OsStr>> {
    let mut parts = Vec::new();
    for comp in rel.components() {
        match comp {
            Component::Normal(part) => parts.push(part),
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(parts)
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.into())
}

/// Opens the directory at `rel` beneath `dir`, one component at a time, never through a
/// link (a link on the way fails with `ELOOP` or `ENOTDIR`).
pub fn open_dir_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    let parts =
        plain(rel).ok_or_else(|| invalid(format!("`{}` leaves the tree", rel.display())))?;
    let mut current = openat(dir, ".", DIR_FLAGS, Mode::empty()).map_err(errno)?;
    for part in parts {
        current = openat(&current, part, DIR_FLAGS, Mode::empty()).map_err(errno)?;
    }
    Ok(current)
}

/// Why a file could not be opened for reading.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Something other than a regular file is there (or a link on the way).
    #[error("it is a {0}, not a regular file")]
    NotRegular(&'static str),
    /// The open failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Opens the regular file `rel` beneath `dir` for reading: no link followed at any step,
/// opened without blocking (a FIFO swapped in answers at once) and checked on the opened
/// descriptor, so what was checked is what is read. Returns it with its size and entry.
pub fn open_regular(dir: BorrowedFd<'_>, rel: &Path) -> Result<(File, Entry), OpenError> {
    let parts =
        plain(rel).ok_or_else(|| invalid(format!("`{}` leaves the tree", rel.display())))?;
    let Some((last, parents)) = parts.split_last() else {
        return Err(OpenError::NotRegular("directory"));
    };
    let mut current = openat(dir, ".", DIR_FLAGS, Mode::empty()).map_err(errno)?;
    for part in parents {
        current = match openat(&current, *part, DIR_FLAGS, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ELOOP) | Err(Errno::ENOTDIR) => {
                return Err(OpenError::NotRegular(link_or(&current, part)));
            }
            Err(e) => return Err(OpenError::Io(errno(e))),
        };
    }
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_NONBLOCK
        | OFlag::O_NOCTTY
        | OFlag::O_CLOEXEC;
    let fd = match openat(&current, *last, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ELOOP) => return Err(OpenError::NotRegular("symbolic link")),
        // A device or socket may refuse the open itself.
        Err(Errno::ENXIO) | Err(Errno::EOPNOTSUPP) => {
            return Err(OpenError::NotRegular("special entry"));
        }
        Err(e) => return Err(OpenError::Io(errno(e))),
    };
    let stat = fstat(&fd).map_err(errno)?;
    let entry = Entry::from_stat(&stat);
    match entry.kind {
        Kind::File => {}
        Kind::Dir => return Err(OpenError::NotRegular("directory")),
        _ => return Err(OpenError::NotRegular("special entry")),
    }
    // A regular file never blocks; the flag only mattered while it could have been a FIFO.
    nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_RDONLY)).map_err(errno)?;
    Ok((File::from(fd), entry))
}

fn link_or(dir: &OwnedFd, name: &OsStr) -> &'static str {
    match nix::sys::stat::fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(stat) if kind_of(&stat) == Kind::Link => "symbolic link",
        _ => "path with something other than a directory on the way",
    }
}

/// The names in the directory `dir` (not `.` or `..`), at most `max`, read through a fresh
/// handle so each call starts at the beginning.
fn names(dir: BorrowedFd<'_>, max: usize) -> io::Result<Vec<OsString>> {
    let fresh = openat(dir, ".", DIR_FLAGS, Mode::empty()).map_err(errno)?;
    let mut stream = nix::dir::Dir::from_fd(fresh).map_err(errno)?;
    let mut out = Vec::new();
    for entry in stream.iter() {
        let entry = entry.map_err(errno)?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        if out.len() == max {
            break;
        }
        out.push(OsStr::from_bytes(name).to_owned());
    }
    Ok(out)
}

/// Makes the directory `name` beneath `dir` searchable and writable by its owner: what a
/// removal does when code left a mode-000 or read-only directory behind.
fn open_up(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    set_mode(dir, name, SFlag::S_IFDIR, 0o700)
}

/// Sets the mode of the entry `name` beneath `dir`, which must be of type `kind` (`S_IFDIR`,
/// `S_IFIFO`, ...), never following a link: it is reached through an `O_PATH` descriptor
/// checked to be that kind, and changed through that descriptor's magic link, which names
/// exactly the inode opened whatever a sandbox renames meanwhile.
pub fn set_mode(dir: BorrowedFd<'_>, name: &OsStr, kind: SFlag, mode: u32) -> io::Result<()> {
    let fd = openat(
        dir,
        name,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(errno)?;
    let stat = fstat(&fd).map_err(errno)?;
    if stat.st_mode & SFlag::S_IFMT.bits() != kind.bits() {
        return Err(io::Error::other(format!(
            "`{}` was replaced by something else",
            Path::new(name).display()
        )));
    }
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        std::fs::Permissions::from_mode(mode),
    )
}

/// Removes the tree at `path` (a link there is removed, not followed); one already gone is
/// no error. Iterative, with three descriptors and no list of names, whatever its depth or
/// width: each directory's subdirectories are moved up to the top of the tree (a rename is
/// O(1)), emptied there and removed, so no walk ever goes deeper than one level.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(invalid(format!("`{}` names no entry", path.display())));
    };
    let parent = match open_root(if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    }) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    remove_at(parent.as_fd(), name)
}

/// [`remove_tree`] of the entry `name` in the directory `parent`.
pub fn remove_at(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match unlinkat(parent, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => return Ok(()),
        Err(Errno::EISDIR) | Err(Errno::EPERM) => {}
        Err(e) => return Err(errno(e)),
    }
    let top = match openat(parent, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::EACCES) => {
            open_up(parent, name)?;
            openat(parent, name, DIR_FLAGS, Mode::empty()).map_err(errno)?
        }
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(errno(e)),
    };
    match empty(top.as_fd()) {
        // The top itself is read-only: its entries cannot be unlinked until it is not.
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            open_up(parent, name)?;
            empty(top.as_fd())?;
        }
        other => other?,
    }
    match unlinkat(parent, name, UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(errno(e)),
    }
}

/// Removes everything in the directory `top`, keeping `top`.
pub fn empty(top: BorrowedFd<'_>) -> io::Result<()> {
    let mut fresh = 0u64;
    loop {
        let mut progress = false;
        let mut last_error = None;
        let seen = each_name(top, |name| match drain_one(top, name, &mut fresh) {
            Ok(()) => progress = true,
            Err(e) => last_error = Some((name.to_owned(), e)),
        })?;
        if !seen {
            return Ok(());
        }
        if !progress && let Some((name, e)) = last_error {
            // Nothing in a whole pass could go: stop rather than read it again forever. (A
            // read-only top is the caller's to open up: its error kind says so.)
            return Err(io::Error::new(
                e.kind(),
                format!("cannot remove `{}`: {e}", Path::new(&name).display()),
            ));
        }
    }
}

/// Calls `f` with each name in the directory `dir` (not `.` or `..`), read in one pass
/// through a fresh handle while `f` may remove or add entries (one removed is not read
/// again; one added may or may not be, so callers pass again until a pass sees nothing).
/// Whether it saw any. Reading from the start again after each batch would rescan the
/// holes deletions leave: quadratic in a wide directory.
fn each_name(dir: BorrowedFd<'_>, mut f: impl FnMut(&OsStr)) -> io::Result<bool> {
    let fresh = openat(dir, ".", DIR_FLAGS, Mode::empty()).map_err(errno)?;
    let mut stream = nix::dir::Dir::from_fd(fresh).map_err(errno)?;
    let mut seen = false;
    for entry in stream.iter() {
        let entry = entry.map_err(errno)?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        seen = true;
        f(OsStr::from_bytes(name));
    }
    Ok(seen)
}

/// Removes the top-level entry `name` of `top`: a non-directory at once, a directory after
/// its files are unlinked and its subdirectories moved up beside it (to be emptied in turn).
fn drain_one(top: BorrowedFd<'_>, name: &OsStr, fresh: &mut u64) -> io::Result<()> {
    match unlinkat(top, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => return Ok(()),
        Err(Errno::EISDIR) | Err(Errno::EPERM) => {}
        Err(e) => return Err(errno(e)),
    }
    match unlinkat(top, name, UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => return Ok(()),
        Err(Errno::ENOTEMPTY) | Err(Errno::EEXIST) => {}
        Err(Errno::EACCES) => open_up(top, name)?,
        Err(e) => return Err(errno(e)),
    }
    let dir = match openat(top, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::EACCES) => {
            open_up(top, name)?;
            openat(top, name, DIR_FLAGS, Mode::empty()).map_err(errno)?
        }
        Err(e) => return Err(errno(e)),
    };
    // Its entries are unlinked and moved out of it: a read-only one is opened up (once) when
    // the first of them is refused, not before, which would cost a chmod per directory.
    let mut opened = false;
    loop {
        let mut progress = false;
        let mut denied = false;
        let mut last_error = None;
        let seen = each_name(dir.as_fd(), |child| {
            match unlinkat(&dir, child, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {
                    progress = true;
                    return;
                }
                Err(Errno::EISDIR) | Err(Errno::EPERM) => {}
                Err(Errno::EACCES) => {
                    denied = true;
                    return;
                }
                Err(e) => {
                    last_error = Some(errno(e));
                    return;
                }
            }
            match move_up(dir.as_fd(), child, top, fresh) {
                Ok(()) => progress = true,
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => denied = true,
                Err(e) => last_error = Some(e),
            }
        })?;
        if !seen {
            break;
        }
        if denied && !opened {
            opened = true;
            open_up(top, name)?;
            continue;
        }
        if !progress {
            return Err(last_error.unwrap_or_else(|| errno(Errno::EACCES)));
        }
    }
    drop(dir);
    match unlinkat(top, name, UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(errno(e)),
    }
}

/// Moves the directory `child` of `dir` to a fresh name at the top of the tree.
fn move_up(
    dir: BorrowedFd<'_>,
    child: &OsStr,
    top: BorrowedFd<'_>,
    fresh: &mut u64,
) -> io::Result<()> {
    let mut opened = false;
    loop {
        *fresh += 1;
        let target = format!(".tandem-rm-{fresh}");
        match renameat2(
            dir,
            child,
            top,
            target.as_str(),
            RenameFlags::RENAME_NOREPLACE,
        ) {
            Ok(()) | Err(Errno::ENOENT) => return Ok(()),
            Err(Errno::EEXIST) => continue,
            // Moving a directory rewrites its `..`: a read-only one must be opened up first.
            Err(Errno::EACCES) if !opened => {
                opened = true;
                open_up(dir, child)?;
            }
            Err(e) => return Err(errno(e)),
        }
    }
}

/// What [`usage`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes on disk of everything seen (allocated blocks, directories and links included).
    pub allocated: u64,
    /// Entries seen.
    pub entries: u64,
    /// Whether the walk stopped at its entry bound before seeing everything.
    pub capped: bool,
}

/// The bytes the tree at `path` holds on disk, counting allocated blocks of every entry and
/// following no link; stops after `max_entries` entries (`capped`).
pub fn usage(path: &Path, max_entries: u64) -> io::Result<Usage> {
    let root = open_root(path)?;
    let mut usage = Usage {
        allocated: Entry::from_stat(&fstat(&root).map_err(errno)?).allocated,
        entries: 1,
        capped: false,
    };
    let result = walk(
        root.as_fd(),
        Path::new(""),
        WalkCaps {
            max_entries: usize::try_from(max_entries).unwrap_or(usize::MAX),
            sorted: false,
            max_path: None,
        },
        |_, _, entry| {
            usage.allocated = usage.allocated.saturating_add(entry.allocated);
            usage.entries += 1;
            Ok(Step::Enter)
        },
    );
    match result {
        Ok(()) => Ok(usage),
        Err(WalkError::TooMany(_)) => Ok(Usage {
            capped: true,
            ..usage
        }),
        Err(WalkError::Visit(e)) | Err(WalkError::Io { source: e, .. }) => Err(e),
        Err(WalkError::Changed(path)) => Err(io::Error::other(format!(
            "`{}` changed while it was measured",
            path.display()
        ))),
    }
}

/// How far a walk may go.
#[derive(Clone, Copy, Debug)]
pub struct WalkCaps {
    /// Most entries read, in all (names read count even before they are visited, so memory
    /// stays within this however wide or deep the tree).
    pub max_entries: usize,
    /// Whether entries are visited in name order (each directory's names are then read
    /// whole, within `max_entries`, before the first is visited).
    pub sorted: bool,
    /// Longest relative path entered, if any: deeper directories are visited, not entered.
    pub max_path: Option<usize>,
}

/// What a visit asks of the walk at a directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Go into it.
    Enter,
    /// Leave it out.
    Skip,
}

/// Why a walk stopped.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    /// More than [`WalkCaps::max_entries`] entries.
    #[error("more than {0} entries")]
    TooMany(usize),
    /// A directory was moved while it was walked.
    #[error("`{}` was moved while it was read", .0.display())]
    Changed(PathBuf),
    /// Reading failed.
    #[error("`{}`: {source}", path.display())]
    Io {
        /// Where.
        path: PathBuf,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// The visitor's own failure.
    #[error(transparent)]
    Visit(io::Error),
}

struct Frame {
    dev: u64,
    ino: u64,
    /// Names still to visit, last first.
    pending: Vec<OsString>,
}

/// Visits every entry beneath `start` in `root` (parents before their contents), with its
/// path relative to `root` and its `lstat`; links and special files are reported, never
/// followed. `visit` gets the directory handle the entry is in and says whether to enter a
/// directory. Iterative, two descriptors open: going back up is `..` checked against the
/// device and inode recorded on the way down, so a directory moved meanwhile ends the walk
/// (`Changed`) rather than lead it elsewhere.
pub fn walk(
    root: BorrowedFd<'_>,
    start: &Path,
    caps: WalkCaps,
    mut visit: impl FnMut(BorrowedFd<'_>, &Path, Entry) -> io::Result<Step>,
) -> Result<(), WalkError> {
    let io_at = |path: &Path| {
        let path = path.to_owned();
        move |e: Errno| WalkError::Io {
            path,
            source: errno(e),
        }
    };
    let mut current = open_dir_beneath(root, start).map_err(|source| WalkError::Io {
        path: start.to_owned(),
        source,
    })?;
    let mut path = PathBuf::from(start);
    let mut read = 0usize;
    let read_names = |dir: BorrowedFd<'_>, path: &Path, read: &mut usize| {
        let left = caps.max_entries.saturating_sub(*read);
        let mut names = names(dir, left.saturating_add(1)).map_err(|source| WalkError::Io {
            path: path.to_owned(),
            source,
        })?;
        *read += names.len();
        if *read > caps.max_entries {
            return Err(WalkError::TooMany(caps.max_entries));
        }
        if caps.sorted {
            names.sort_unstable_by(|a, b| b.cmp(a));
        }
        Ok(names)
    };
    let stat = fstat(&current).map_err(io_at(&path))?;
    let pending = read_names(current.as_fd(), &path, &mut read)?;
    let mut stack = vec![Frame {
        dev: stat.st_dev,
        ino: stat.st_ino,
        pending,
    }];
    loop {
        let Some(frame) = stack.last_mut() else {
            return Ok(());
        };
        let Some(name) = frame.pending.pop() else {
            // Done here: back up to the parent, and make sure it is the one we came from.
            stack.pop();
            let Some(parent) = stack.last() else {
                return Ok(());
            };
            let up = openat(&current, "..", DIR_FLAGS, Mode::empty()).map_err(io_at(&path))?;
            let stat = fstat(&up).map_err(io_at(&path))?;
            if (stat.st_dev, stat.st_ino) != (parent.dev, parent.ino) {
                return Err(WalkError::Changed(path));
            }
            current = up;
            path.pop();
            continue;
        };
        path.push(&name);
        let stat = match nix::sys::stat::fstatat(
            &current,
            name.as_os_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(stat) => stat,
            // Gone since it was listed.
            Err(Errno::ENOENT) => {
                path.pop();
                continue;
            }
            Err(e) => return Err(io_at(&path)(e)),
        };
        let entry = Entry::from_stat(&stat);
        let step = visit(current.as_fd(), &path, entry).map_err(WalkError::Visit)?;
        let deeper = entry.kind == Kind::Dir
            && step == Step::Enter
            && caps.max_path.is_none_or(|max| path.as_os_str().len() < max);
        if !deeper {
            path.pop();
            continue;
        }
        let sub = match openat(&current, name.as_os_str(), DIR_FLAGS, Mode::empty()) {
            Ok(fd) => fd,
            // Swapped for something else, or closed to us: not entered.
            Err(Errno::ELOOP | Errno::ENOTDIR | Errno::ENOENT | Errno::EACCES) => {
                path.pop();
                continue;
            }
            Err(e) => return Err(io_at(&path)(e)),
        };
        let stat = fstat(&sub).map_err(io_at(&path))?;
        let pending = read_names(sub.as_fd(), &path, &mut read)?;
        stack.push(Frame {
            dev: stat.st_dev,
            ino: stat.st_ino,
            pending,
        });
        current = sub;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deep(root: &Path, depth: usize) {
        let base = open_root(root).unwrap();
        let mut dir = base;
        for _ in 0..depth {
            nix::sys::stat::mkdirat(&dir, "d", Mode::from_bits_truncate(0o755)).unwrap();
            dir = openat(&dir, "d", DIR_FLAGS, Mode::empty()).unwrap();
        }
        std::fs::write(
            format!("/proc/self/fd/{}/leaf", {
                use std::os::fd::AsRawFd;
                dir.as_raw_fd()
            }),
            b"x",
        )
        .unwrap();
    }

    #[test]
    fn a_100000_deep_tree_is_measured_and_removed_without_recursion() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("tree");
        std::fs::create_dir(&root).unwrap();
        deep(&root, 100_000);
        // Run on a small stack: a recursive walk would overflow it long before the bottom.
        let r = root.clone();
        let measured = std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || usage(&r, 1_000_000))
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        assert!(!measured.capped);
        assert_eq!(measured.entries, 100_002);
        let r = root.clone();
        std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || remove_tree(&r))
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        assert!(!root.exists());
    }

    #[test]
    fn removal_unlinks_links_and_never_what_they_lead_to() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"host").unwrap();
        let tree = tmp.path().join("tree");
        std::fs::create_dir_all(tree.join("a/b")).unwrap();
        std::os::unix::fs::symlink(&outside, tree.join("a/b/out")).unwrap();
        std::os::unix::fs::symlink(&outside, tree.join("dirlink")).unwrap();
        nix::unistd::mkfifo(&tree.join("a/fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir(tree.join("a/locked")).unwrap();
        std::fs::write(tree.join("a/locked/f"), b"x").unwrap();
        std::fs::set_permissions(
            tree.join("a/locked"),
            std::fs::Permissions::from_mode(0o000),
        )
        .unwrap();
        remove_tree(&tree).unwrap();
        assert!(!tree.exists());
        assert_eq!(std::fs::read(outside.join("keep")).unwrap(), b"host");
        // The tree's own link at the top is a link, not followed either.
        std::os::unix::fs::symlink(&outside, tmp.path().join("top")).unwrap();
        remove_tree(&tmp.path().join("top")).unwrap();
        assert!(outside.join("keep").exists());
    }

    #[test]
    fn a_fifo_is_refused_without_waiting_and_a_link_is_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        nix::unistd::mkfifo(&tmp.path().join("x.txt"), Mode::from_bits_truncate(0o600)).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", tmp.path().join("p")).unwrap();
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        std::os::unix::fs::symlink("/etc", tmp.path().join("d/etc")).unwrap();
        let root = open_root(tmp.path()).unwrap();
        for (rel, kind) in [
            ("x.txt", "special entry"),
            ("p", "symbolic link"),
            ("d/etc/passwd", "symbolic link"),
            ("d", "directory"),
        ] {
            match open_regular(root.as_fd(), Path::new(rel)) {
                Err(OpenError::NotRegular(k)) => assert_eq!(k, kind, "{rel}"),
                other => panic!("{rel}: {other:?}"),
            }
        }
    }

    #[test]
    fn sparse_files_weigh_their_blocks() {
        let tmp = tempfile::tempdir().unwrap();
        let file = std::fs::File::create(tmp.path().join("sparse")).unwrap();
        file.set_len(1 << 30).unwrap();
        let usage = usage(tmp.path(), 100).unwrap();
        assert!(usage.allocated < 1 << 20, "{usage:?}");
    }

    #[test]
    fn a_wide_directory_is_read_within_the_entry_bound() {
        let tmp = tempfile::tempdir().unwrap();
        for i in 0..2_000 {
            std::fs::write(tmp.path().join(format!("f{i}")), b"").unwrap();
        }
        let root = open_root(tmp.path()).unwrap();
        let caps = WalkCaps {
            max_entries: 500,
            sorted: true,
            max_path: None,
        };
        let mut seen = 0;
        let result = walk(root.as_fd(), Path::new(""), caps, |_, _, _| {
            seen += 1;
            Ok(Step::Enter)
        });
        assert!(matches!(result, Err(WalkError::TooMany(500))), "{result:?}");
        assert_eq!(
            seen, 0,
            "nothing is visited before the bound is known to hold"
        );
    }
}
