//! Why a request about tasks failed.

use crate::store::StoreError;

/// Why a request about tasks failed; the API turns these into 4xx/5xx answers.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// The request is invalid.
    #[error("{0}")]
    Invalid(String),
    /// No task has that id.
    #[error("task `{0}` does not exist")]
    NotFound(String),
    /// The task exists but not the thing asked about (an approval number); says which.
    #[error("{0}")]
    Missing(String),
    /// The task is in a state that does not allow this.
    #[error("{0}")]
    Conflict(String),
    /// The operator's policy does not allow it.
    #[error("{0}")]
    NotAllowed(String),
    /// The executor cannot run code now (its health check says why).
    #[error("{0}")]
    Unavailable(String),
    /// The daemon is stopping.
    #[error("the daemon is shutting down and takes no new work")]
    ShuttingDown,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}
