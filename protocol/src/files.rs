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
    /// Whether it is one of the files the task was given, its bytes unchanged (workspaces
    /// only): what `tandem run` leaves out when it keeps what the task made.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub given: bool,
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

/// `name` (a path code in a sandbox chose) as a person may safely read it on one line:
/// control characters (C0, DEL, C1), line and paragraph separators and the bidirectional
/// overrides that reorder text are written as `\u{..}` escapes, and a backslash as `\\`,
/// so no name can move the cursor, retitle a terminal, or forge a line of a listing.
pub fn shown(name: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| {
        c.is_control()
            || c == '\\'
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !name.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len() + 8);
    for c in name.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if unsafe_char(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::shown;

    #[test]
    fn names_with_escapes_and_newlines_stay_on_one_inert_line() {
        assert_eq!(shown("chart.png"), "chart.png");
        assert_eq!(
            shown("a\u{1b}]0;pwned\u{7}\u{1b}[2J\n   9 B  forged.txt"),
            "a\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\u{a}   9 B  forged.txt"
        );
        assert_eq!(shown("r\u{202e}gnp.exe"), "r\\u{202e}gnp.exe");
        assert_eq!(shown("back\\slash"), "back\\\\slash");
        assert_eq!(shown("c1\u{9b}31m"), "c1\\u{9b}31m");
    }
}
