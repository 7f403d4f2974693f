//! Files into and out of tasks: what an upload holds and what a task's workspace lists.

use serde::{Deserialize, Serialize};

/// A file, by its path in an upload or a workspace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Its path, relative to the workspace, with `/` between parts.
    pub path: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// When it was last written, in milliseconds since the Unix epoch (workspaces only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modified_ms: Option<u64>,
}

/// Files received by `POST /v1/uploads`, for a task to name in `files`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Upload {
    /// The id a task names to be given these files.
    pub id: String,
    /// The files, in the order the archive held them.
    pub files: Vec<FileInfo>,
    /// Their bytes, in all.
    pub bytes: u64,
    /// When the upload is removed if no task took it, in milliseconds since the Unix epoch;
    /// a task that names it keeps its own copy.
    pub expires_ms: u64,
}

/// What `GET /v1/tasks/{id}/files` lists: the regular files of a task's workspace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskFiles {
    /// The task.
    pub task: String,
    /// Its files, in path order; empty before its first session opens.
    pub files: Vec<FileInfo>,
}
