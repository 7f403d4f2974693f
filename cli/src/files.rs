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
    // Links inside a directory are not followed (one could lead to `/`, or round in a
    // circle); they are refused below, by name. A path given itself is resolved first.
    builder.follow_symlinks(false);
    let mut names = Vec::new();
    for given in paths {
        let at = || format!("--file {}", given.display());
        let path = &std::fs::canonicalize(given).with_context(at)?;
        let meta = std::fs::metadata(path).with_context(at)?;
        let Some(name) = given.file_name().or(path.file_name()) else {
            bail!("--file {} names no file", given.display());
        };
        let name = PathBuf::from(name);
        if names.contains(&name) {
            bail!(
                "--file {}: two files are called {}; rename one",
                given.display(),
                name.display()
            );
        }
        if meta.is_dir() {
            builder.append_dir_all(&name, path).with_context(at)?;
        } else if meta.is_file() {
            builder
                .append_path_with_name(path, &name)
                .with_context(at)?;
        } else {
            bail!(
                "--file {} is neither a file nor a directory",
                given.display()
            );
        }
        names.push(name);
    }
    builder
        .into_inner()
        .and_then(|mut w| std::io::Write::flush(&mut w))
        .with_context(|| format!("cannot write {}", archive.display()))?;
    let read = || {
        std::fs::File::open(&archive)
            .map(std::io::BufReader::new)
            .with_context(|| format!("cannot read {}", archive.display()))
    };
    // Refused now, by the rules every session applies, rather than at the first block.
    tandem_executor::archive::check(read()?, tandem_executor::archive::ArchiveCaps::default())
        .context("--file")?;
    let listing = tandem_executor::archive::describe(read()?)?;
    Ok(Inputs { archive, listing })
}
