//! The documents speak of the product: none of them tells of the work that made it. A
//! sandbox session is a product word and stays; "session 40" or "this session's run" is a
//! diary and belongs in the commit history.

use std::path::{Path, PathBuf};

/// Every markdown file a user reads: README, CHANGELOG, docs/ and the crates' own.
fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    let mut todo = vec![root.clone()];
    while let Some(dir) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "node_modules" {
                    todo.push(path);
                }
            } else if kind.is_file() && name.ends_with(".md") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The diary's words in `line`, lowercased: a numbered session, or a session told of.
fn diary(line: &str) -> Option<String> {
    let lower = line.to_lowercase();
    for told in [
        "last session",
        "previous session",
        "work session",
        "earlier session",
    ] {
        if lower.contains(told) {
            return Some(told.to_owned());
        }
    }
    for numbered in ["session ", "sessions "] {
        for (at, _) in lower.match_indices(numbered) {
            let after = &lower[at + numbered.len()..];
            if after.starts_with(|c: char| c.is_ascii_digit()) {
                return Some(lower[at..].chars().take(numbered.len() + 3).collect());
            }
        }
    }
    None
}

#[test]
fn no_document_tells_of_work_sessions() {
    let documents = documents();
    assert!(
        documents.iter().any(|p| p.ends_with("docs/benchmarks.md")),
        "the walk found no docs/benchmarks.md: {documents:?}"
    );
    let mut found = Vec::new();
    for path in &documents {
        let text = std::fs::read_to_string(path).unwrap();
        for (n, line) in text.lines().enumerate() {
            if let Some(words) = diary(line) {
                found.push(format!("{}:{}: `{words}`", path.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "documents tell of work sessions; say what the product does and leave history to git:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_diary_check_can_fail() {
    assert!(diary("## 2026-11-28 (session 40: the stops)").is_some());
    assert!(diary("as the previous session measured").is_some());
    assert!(diary("a Docker host for this session is not available").is_none());
    assert!(diary("a session's workspace is a volume").is_none());
    assert!(diary("open sessions 2 at a time").is_some());
    assert!(diary("POST /v1/sessions then exec").is_none());
}
