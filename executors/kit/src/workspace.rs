//! The `# filename:` directive and paths that must stay inside a session's workspace.

use std::path::{Component, Path, PathBuf};

pub use tandem_executor::filename_directive;

/// Where block `block` runs from, relative to the workspace, and whether the file is
/// transient (removed after the run): the path its `# filename:` line names (checked to stay
/// inside), or a hidden `.tandem-block-N.EXT`. Every executor names its scripts this way.
pub fn block_script_path(
    code: &str,
    block: u32,
    extension: &str,
) -> Result<(PathBuf, bool), PathError> {
    match filename_directive(code) {
        Some(name) => Ok((clean_relative(name)?, false)),
        None => Ok((
            PathBuf::from(format!(".tandem-block-{block}.{extension}")),
            true,
        )),
    }
}

/// Writes a block's code where it runs from: the path its `# filename:` line names, or else
/// a hidden file `.tandem-block-N.EXT` that is removed after the run (`transient`). Running
/// from a file in the workspace lets imports see the files earlier blocks saved, as when a
/// person runs a script in that directory.
///
/// Code that ran earlier in the session can change the workspace, so every step here is
/// resolved beneath the workspace's directory handle (`cap-std`): a symbolic link or `..`
/// that leads out of it is refused, never followed, and nothing is created outside. A
/// transient name is unlinked and made afresh, so a link planted under it redirects nothing.
pub fn write_block_script(
    workspace: &Path,
    code: &str,
    block: u32,
    extension: &str,
) -> Result<BlockScript, PathError> {
    use std::io::Write;
    let (rel, transient) = block_script_path(code, block, extension)?;
    let shown = filename_directive(code).map_or_else(|| rel.display().to_string(), str::to_owned);
    let dir = cap_std::fs::Dir::open_ambient_dir(workspace, cap_std::ambient_authority()).map_err(
        |source| PathError::Io {
            path: shown.clone(),
            source,
        },
    )?;
    // A failure with a link on the way is (most likely) a link that leads out: say so.
    let fail = |source: std::io::Error| {
        let mut prefix = PathBuf::new();
        for part in rel.iter() {
            prefix.push(part);
            if dir
                .symlink_metadata(&prefix)
                .is_ok_and(|m| m.file_type().is_symlink())
            {
                return PathError::ThroughLink(shown.clone());
            }
        }
        PathError::Io {
            path: shown.clone(),
            source,
        }
    };
    if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) {
        dir.create_dir_all(parent).map_err(&fail)?;
    }
    let mut options = cap_std::fs::OpenOptions::new();
    options.write(true);
    if transient {
        match dir.remove_file(&rel) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(fail(e)),
            _ => {}
        }
        options.create_new(true);
    } else {
        options.create(true).truncate(true);
    }
    let mut file = dir.open_with(&rel, &options).map_err(&fail)?;
    file.write_all(code.as_bytes()).map_err(&fail)?;
    Ok(BlockScript {
        path: workspace.join(rel),
        transient,
    })
}

/// A block's script file (see [`write_block_script`]).
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
    fn scripts_stay_inside() {
        let base = tempfile::tempdir().unwrap();
        let ws = base.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        let ws = ws.canonicalize().unwrap();
        let write = |code: &str| write_block_script(&ws, code, 2, "py");
        let named = write("# filename: a/b/c.py\nprint(1)").unwrap();
        assert_eq!(named.path, ws.join("a/b/c.py"));
        assert!(!named.transient);
        assert_eq!(
            write("# filename: ./x/../y.py\n").unwrap().path,
            ws.join("y.py")
        );
        for outside in ["../evil.py", "/etc/passwd", "a/../../x"] {
            let err = write(&format!("# filename: {outside}\n")).unwrap_err();
            assert!(matches!(err, PathError::Outside(_)), "{outside}: {err}");
        }
        // Links planted by earlier code lead nowhere outside, and create nothing there.
        let outside = base.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, ws.join("out")).unwrap();
        std::os::unix::fs::symlink("../outside/x.py", ws.join("up.py")).unwrap();
        for name in ["out/x.py", "out/new/x.py", "up.py"] {
            let err = write(&format!("# filename: {name}\n")).unwrap_err();
            assert!(matches!(err, PathError::ThroughLink(_)), "{name}: {err}");
        }
        std::os::unix::fs::symlink("../outside/t.py", ws.join(".tandem-block-2.py")).unwrap();
        let transient = write("print(2)\n").unwrap();
        assert!(transient.transient);
        assert_eq!(
            std::fs::read_to_string(&transient.path).unwrap(),
            "print(2)\n"
        );
        assert!(std::fs::read_dir(&outside).unwrap().next().is_none());
    }
}
