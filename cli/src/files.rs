//! `--file`: the files a task is given, packed once into a tar archive that every session of
//! the task unpacks into its workspace, and the listing the model is told.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use tandem_daemon::plan::Inputs;

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
    let packed = std::fs::File::open(&archive)
        .with_context(|| format!("cannot read {}", archive.display()))?;
    let listing = tandem_executor::archive::describe(std::io::BufReader::new(packed))?;
    Ok(Inputs { archive, listing })
}
