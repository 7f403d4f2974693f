//! The `# filename:` directive and paths that must stay inside a session's workspace.

use std::path::{Component, Path, PathBuf};

/// The path named by a first line such as `# filename: src/app.py` (or `// filename:` for
/// C-like languages), if the block has one.
pub fn filename_directive(code: &str) -> Option<&str> {
    let first = code.lines().next()?.trim();
    let rest = first
        .strip_prefix('#')
        .or_else(|| first.strip_prefix("//"))?
        .trim_start();
    let name = rest.strip_prefix("filename:")?.trim();
    (!name.is_empty()).then_some(name)
}

/// Where a block's code is written: the path its `# filename:` line names, or else a hidden
/// file `.tandem-block-N.EXT` that is removed after the run (`transient`). Running from a
/// file in the workspace lets imports see the files earlier blocks saved, as when a person
/// runs a script in that directory.
pub fn block_script(
    workspace: &Path,
    code: &str,
    block: u32,
    extension: &str,
) -> Result<BlockScript, PathError> {
    Ok(match filename_directive(code) {
        Some(name) => BlockScript {
            path: resolve_inside(workspace, name)?,
            transient: false,
        },
        None => BlockScript {
            path: workspace.join(format!(".tandem-block-{block}.{extension}")),
            transient: true,
        },
    })
}

/// A block's script file (see [`block_script`]).
#[derive(Debug)]
pub struct BlockScript {
    /// The host path.
    pub path: PathBuf,
    /// Whether it is removed after the run.
    pub transient: bool,
}

/// Why a path was refused.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    /// The path is absolute or climbs out with `..`.
    #[error(
        "refused to write `{0}`: the path must stay inside the workspace (a relative path without `..` above it)"
    )]
    Outside(String),
    /// A symlink inside the workspace points out of it.
    #[error("refused to write `{0}`: it resolves outside the workspace through a symbolic link")]
    ThroughLink(String),
    /// Creating directories failed.
    #[error("cannot create the directories for `{path}`: {source}")]
    Io {
        /// The path asked for.
        path: String,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
}

/// The normalised relative path `rel` names (`.` and inner `..` resolved), refused when it
/// would leave the directory it is relative to. Lexical only: sandboxes that resolve the path
/// inside their own filesystem (containers) need nothing more.
pub fn clean_relative(rel: &str) -> Result<PathBuf, PathError> {
    let outside = || PathError::Outside(rel.to_owned());
    let mut clean = PathBuf::new();
    for comp in Path::new(rel).components() {
        match comp {
            Component::Normal(part) => clean.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !clean.pop() {
                    return Err(outside());
                }
            }
            Component::RootDir | Component::Prefix(_) => return Err(outside()),
        }
    }
    if clean.file_name().is_none() {
        return Err(outside());
    }
    Ok(clean)
}

/// Resolves `rel` under `root`, creating parent directories, and refuses anything that would
/// land outside `root` (absolute paths, `..`, symlinks pointing out).
pub fn resolve_inside(root: &Path, rel: &str) -> Result<PathBuf, PathError> {
    let clean = clean_relative(rel)?;
    let Some(file_name) = clean.file_name().map(ToOwned::to_owned) else {
        return Err(PathError::Outside(rel.to_owned()));
    };
    let io = |source| PathError::Io {
        path: rel.to_owned(),
        source,
    };
    let root = root.canonicalize().map_err(io)?;
    let parent = root.join(clean.parent().unwrap_or(Path::new("")));
    std::fs::create_dir_all(&parent).map_err(io)?;
    let parent = parent.canonicalize().map_err(io)?;
    if !parent.starts_with(&root) {
        return Err(PathError::ThroughLink(rel.to_owned()));
    }
    let target = parent.join(file_name);
    // A symlink at the final component would redirect the write.
    if let Ok(meta) = std::fs::symlink_metadata(&target) {
        if meta.file_type().is_symlink() {
            let real = target.canonicalize().map_err(io)?;
            if !real.starts_with(&root) {
                return Err(PathError::ThroughLink(rel.to_owned()));
            }
        }
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directive_forms() {
        assert_eq!(
            filename_directive("# filename: a/b.py\nprint(1)"),
            Some("a/b.py")
        );
        assert_eq!(filename_directive("// filename: app.js\n"), Some("app.js"));
        assert_eq!(filename_directive("#filename:x.sh"), Some("x.sh"));
        assert_eq!(filename_directive("# a comment\n"), None);
        assert_eq!(filename_directive("print(1)\n# filename: late.py"), None);
        assert_eq!(filename_directive("# filename:   \n"), None);
    }

    #[test]
    fn paths_stay_inside() {
        let dir = std::env::temp_dir().join(format!("tandem-ws-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let root = dir.canonicalize().unwrap();
        assert_eq!(
            resolve_inside(&dir, "a/b/c.py").unwrap(),
            root.join("a/b/c.py")
        );
        assert_eq!(
            resolve_inside(&dir, "./x/../y.py").unwrap(),
            root.join("y.py")
        );
        assert!(matches!(
            resolve_inside(&dir, "../evil.py"),
            Err(PathError::Outside(_))
        ));
        assert!(matches!(
            resolve_inside(&dir, "/etc/passwd"),
            Err(PathError::Outside(_))
        ));
        assert!(matches!(
            resolve_inside(&dir, "a/../../x"),
            Err(PathError::Outside(_))
        ));
        std::os::unix::fs::symlink("/tmp", dir.join("out")).unwrap();
        assert!(matches!(
            resolve_inside(&dir, "out/x.py"),
            Err(PathError::ThroughLink(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
