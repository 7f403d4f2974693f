//! `--file`: the files a task is given, packed once into a tar archive that every session of
//! the task unpacks into its workspace (or that is sent to a daemon), and the listing the
//! model is told; and `tandem files`, which reads a task's workspace on a daemon.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use tandem_daemon::plan::Inputs;

/// The files at `paths` (a directory is taken whole, under its own name) as the task's
/// inputs in this process, packed into an archive in `dir` and checked.
pub fn pack(paths: &[PathBuf], dir: &Path) -> Result<Inputs> {
    let archive = archive_of(paths, dir)?;
    let read = std::fs::File::open(&archive)
        .map(|f| std::io::BufReader::with_capacity(1 << 20, f))
        .with_context(|| format!("cannot read {}", archive.display()))?;
    // Refused now, by the rules every session applies, rather than at the first block.
    let (_, listing) = tandem_executor_kit::archive::inspect(
        read,
        tandem_executor_kit::archive::ArchiveCaps::default(),
    )
    .context("--file")?;
    Ok(Inputs {
        archive: Some(archive),
        listing,
    })
}

/// The files at `paths` as one tar archive in `dir`, unchecked: links in a directory are
/// written as links, for the reader's rules to refuse by name.
fn archive_of(paths: &[PathBuf], dir: &Path) -> Result<PathBuf> {
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
    Ok(archive)
}

/// Sends the files at `paths` to the daemon; the upload's id for the task's `files`, or
/// `None` when there are none.
pub async fn upload(client: &crate::client::Client, paths: &[PathBuf]) -> Result<Option<String>> {
    if paths.is_empty() {
        return Ok(None);
    }
    let dir = tempfile::Builder::new()
        .prefix("tandem-files-")
        .tempdir()
        .context("cannot make a directory for the task's files")?;
    // Checked by the daemon, under its own caps, which may be other than this machine's.
    let archive = archive_of(paths, dir.path())?;
    let upload = client.upload(&archive).await.context("--file")?;
    Ok(Some(upload.id))
}

#[derive(Debug, clap::Args)]
pub struct FilesArgs {
    /// Task id
    id: String,
    /// Download this file of the task's workspace
    #[arg(long, value_name = "PATH", conflicts_with = "tar")]
    get: Option<String>,
    /// Download the whole workspace as one tar archive
    #[arg(long)]
    tar: bool,
    /// Write the download here instead of to standard output
    #[arg(long, short = 'o', value_name = "OUT")]
    output: Option<PathBuf>,
    /// Print the list as JSON
    #[arg(long, conflicts_with_all = ["get", "tar"])]
    json: bool,
    #[command(flatten)]
    host: crate::client::HostFlag,
}

/// `tandem files`.
pub async fn files(args: FilesArgs) -> Result<u8> {
    use std::io::IsTerminal as _;
    let client = crate::client::Client::new(&args.host)?;
    let id = &args.id;
    let path = match (&args.get, args.tar) {
        (Some(path), _) => {
            // Said here: an HTTP client would fold `..` away and ask for something else.
            if path.starts_with('/') || path.split('/').any(|part| part == "..") {
                bail!(
                    "--get {}: not a path inside the workspace; give it relative, without `..` (tandem files {id} lists them)",
                    tandem_protocol::files::shown(path)
                );
            }
            tandem_daemon::supervisor::file_href(id, path)
        }
        (None, true) => format!("/v1/tasks/{id}/files?format=tar"),
        (None, false) => {
            let list = client.get(&format!("/v1/tasks/{id}/files")).await?;
            if args.json {
                println!("{list}");
                return Ok(crate::exit::DONE);
            }
            let list: tandem_protocol::files::TaskFiles =
                crate::client::typed(list, "a file list")?;
            print!("{}", listing(&list));
            return Ok(crate::exit::DONE);
        }
    };
    if args.output.is_none() && std::io::stdout().is_terminal() {
        bail!("the download would go to the terminal; give -o FILE, or pipe it");
    }
    let mut resp = client.download(&path).await?;
    let mut out: Box<dyn std::io::Write> = match &args.output {
        Some(out) => Box::new(
            std::fs::File::create(out)
                .with_context(|| format!("cannot write {}", out.display()))?,
        ),
        None => Box::new(std::io::stdout().lock()),
    };
    while let Some(chunk) = resp
        .chunk()
        .await
        .with_context(|| format!("the download of {path} broke off"))?
    {
        out.write_all(&chunk).context("cannot write the download")?;
    }
    out.flush().context("cannot write the download")?;
    Ok(crate::exit::DONE)
}

/// The files of a workspace, one per line: size, then path.
pub fn listing(list: &tandem_protocol::files::TaskFiles) -> String {
    use std::fmt::Write as _;
    if list.files.is_empty() {
        return format!("task {} has no files\n", list.task);
    }
    let mut text = String::new();
    for f in &list.files {
        let _ = writeln!(
            text,
            "{:>10}  {}",
            crate::render::size(f.bytes),
            tandem_protocol::files::shown(&f.path)
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use tandem_protocol::files::{FileInfo, TaskFiles};

    #[test]
    fn a_name_with_escapes_and_a_newline_is_one_inert_line_of_the_listing() {
        let list = TaskFiles {
            task: "t".to_owned(),
            files: vec![FileInfo {
                path: "esc\u{1b}]0;pwned\u{7}\u{1b}[2J\n   9 B  forged.txt".to_owned(),
                bytes: 1,
                modified_ms: None,
                given: false,
            }],
        };
        let text = super::listing(&list);
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{text}"
        );
        assert!(text.contains("esc\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\u{a}   9 B  forged.txt"));
    }
}
