//! `--file`: the files a task is given, packed once into a tar archive that every session of
//! the task unpacks into its workspace, and the listing the model is told.

use std::fmt::Write as _;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use tandem_daemon::plan::Inputs;

/// Most lines of a text file the model is shown.
const HEAD_LINES: usize = 5;
/// Most characters of one shown line.
const LINE_CHARS: usize = 200;
/// Most files listed one by one; the rest are counted.
const LISTED: usize = 50;

/// The files at `paths` (a directory is taken whole, under its own name) as the task's
/// inputs, packed into an archive in `dir`.
pub fn pack(paths: &[PathBuf], dir: &Path) -> Result<Inputs> {
    let archive = dir.join("files.tar");
    let out = std::fs::File::create(&archive)
        .with_context(|| format!("cannot write {}", archive.display()))?;
    let mut builder = tar::Builder::new(std::io::BufWriter::new(out));
    // A link among the user's files is packed as what it points to, never as a link.
    builder.follow_symlinks(true);
    let mut names = Vec::new();
    for path in paths {
        let meta = std::fs::metadata(path).with_context(|| format!("--file {}", path.display()))?;
        let Some(name) = path.file_name() else {
            bail!("--file {} names no file", path.display());
        };
        let name = PathBuf::from(name);
        if names.contains(&name) {
            bail!(
                "--file {}: two files are called {}; rename one",
                path.display(),
                name.display()
            );
        }
        if meta.is_dir() {
            builder
                .append_dir_all(&name, path)
                .with_context(|| format!("--file {}", path.display()))?;
        } else if meta.is_file() {
            builder
                .append_path_with_name(path, &name)
                .with_context(|| format!("--file {}", path.display()))?;
        } else {
            bail!(
                "--file {} is neither a file nor a directory",
                path.display()
            );
        }
        names.push(name);
    }
    builder
        .into_inner()
        .and_then(|mut w| std::io::Write::flush(&mut w))
        .with_context(|| format!("cannot write {}", archive.display()))?;
    let listing = listing(&archive)?;
    Ok(Inputs { archive, listing })
}

/// What the model is told: each file's path and size, and the first lines of text files.
fn listing(archive: &Path) -> Result<String> {
    let file = std::fs::File::open(archive)?;
    let mut tar = tar::Archive::new(std::io::BufReader::new(file));
    let mut text = String::from("Files in your working directory (the current directory):\n");
    let mut shown = 0;
    let mut more = 0;
    for entry in tar.entries()? {
        let entry = entry?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        if shown == LISTED {
            more += 1;
            continue;
        }
        shown += 1;
        let path = entry.path()?.display().to_string();
        let size = entry.header().size()?;
        let _ = writeln!(text, "- {path} ({size} bytes)");
        let mut head = Vec::new();
        entry.take(8192).read_to_end(&mut head)?;
        // Text: valid UTF-8 up to where the first 8 KiB were cut, and no NUL.
        let head = match std::str::from_utf8(&head) {
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
                let _ = writeln!(text, "    {line}");
            }
        }
    }
    if more > 0 {
        let _ = writeln!(text, "- and {more} more files");
    }
    if shown == 0 {
        let _ = writeln!(text, "- (no files)");
    }
    Ok(text.trim_end().to_owned())
}
