use std::path::PathBuf;

use crate::Language;

/// The sandbox failed; distinct from a program that failed (that is an `ExecOutcome`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// No executor with that name is registered.
    #[error("executor `{name}` is not registered; available: {available}")]
    UnknownExecutor {
        /// The name asked for.
        name: String,
        /// Comma-separated registered names.
        available: String,
    },
    /// The executor does not run this language.
    #[error(
        "language `{language}` is not supported by the {executor} executor; supported: {supported}"
    )]
    UnsupportedLanguage {
        /// The language asked for.
        language: Language,
        /// Executor name.
        executor: String,
        /// Comma-separated supported languages.
        supported: String,
    },
    /// An interpreter or runtime the executor needs is missing.
    #[error("{what} is not available: {hint}")]
    Unavailable {
        /// What is missing.
        what: String,
        /// How to get it.
        hint: String,
    },
    /// Files given to the session could not be placed (or read out).
    #[error(transparent)]
    Files(#[from] crate::files::ArchiveError),
    /// The workspace could not be prepared.
    #[error("workspace {path}: {source}")]
    Workspace {
        /// The directory.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// Starting or supervising the sandbox failed.
    #[error("{context}: {source}")]
    Io {
        /// What Tandem was doing.
        context: String,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// Nothing in the sandbox accepted a connection to a port Tandem was asked to reach.
    #[error(
        "nothing in the sandbox accepts connections on port {port} ({reason}); a block must leave a server listening on it"
    )]
    PortClosed {
        /// The port.
        port: u16,
        /// What the connection attempt met.
        reason: String,
    },
    /// Every sandbox the operator allows is in use, and none was freed in time.
    #[error(
        "no {executor} sandbox was free within {waited:?}: {cap} may be open at once ({which} in the daemon's config), {held}; try again when a task ends, or raise the cap"
    )]
    Busy {
        /// Executor name.
        executor: String,
        /// The cap that was full.
        cap: usize,
        /// Where the operator sets that cap.
        which: String,
        /// How long the open waited.
        waited: std::time::Duration,
        /// Who holds the open sessions: how many, and how many of them no task holds.
        held: String,
    },
    /// The machine the sandbox ran on stopped answering (its engine died, its network went):
    /// the session is gone, and a new one, placed elsewhere, may carry the task on from its
    /// last mirrored files.
    #[error("the sandbox on {host} was lost: {reason}")]
    Lost {
        /// The host (engine) it ran on, by the operator's name for it.
        host: String,
        /// What was seen.
        reason: String,
    },
    /// The backend failed in its own way (engine errors and the like).
    #[error("{0}")]
    Backend(String),
}

impl ExecError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

impl ExecError {
    /// The error for a language an executor does not run.
    pub fn unsupported(language: &Language, executor: &str, supported: &[Language]) -> Self {
        Self::UnsupportedLanguage {
            language: language.clone(),
            executor: executor.to_owned(),
            supported: crate::language::join(supported),
        }
    }
}
