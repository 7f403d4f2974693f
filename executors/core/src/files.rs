//! What a session's files cross its boundary as: the bounds of one archive, the files that
//! went in or came out, and why an archive was refused. The packing and unpacking itself is
//! in `tandem-executor-kit`.

use std::path::PathBuf;

/// How much one archive may bring in or take out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchiveCaps {
    /// Most bytes of file content, in all.
    pub max_bytes: u64,
    /// Most entries (files and directories).
    pub max_entries: usize,
}

impl Default for ArchiveCaps {
    fn default() -> Self {
        Self {
            max_bytes: 256 << 20,
            max_entries: 10_000,
        }
    }
}

/// A file that went into the workspace, or came out of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchivedFile {
    /// Its path, relative to the workspace.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Why an archive was refused; each names the entry and what to send instead.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// A path that is absolute, holds `..`, or names nothing.
    #[error("`{0}` is not a path inside the workspace: use a relative path without `..`")]
    Outside(String),
    /// An entry that is not a regular file or a directory.
    #[error("`{path}` is a {kind}; only regular files and directories can go into a workspace")]
    Kind {
        /// The entry.
        path: String,
        /// What it is (`symbolic link`, `device`, ...).
        kind: &'static str,
    },
    /// A path to read that is not a regular file, or has a link on the way.
    #[error("`{path}` is a {kind}, not a regular file")]
    NotRegular {
        /// The path asked for.
        path: String,
        /// What is there (`symbolic link`, `directory`, ...).
        kind: &'static str,
    },
    /// Past [`ArchiveCaps::max_bytes`].
    #[error("the files are over the {max} byte limit (at `{path}`)")]
    TooLarge {
        /// The entry that went past it.
        path: String,
        /// The limit.
        max: u64,
    },
    /// Past [`ArchiveCaps::max_entries`].
    #[error("the archive has more than {0} entries")]
    TooMany(usize),
    /// A link on the way that leads out of the workspace, or any other failure there.
    #[error("`{path}`: {source}")]
    Io {
        /// The entry.
        path: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The archive itself does not read as tar.
    #[error("the archive is not a tar archive: {0}")]
    Malformed(std::io::Error),
}
