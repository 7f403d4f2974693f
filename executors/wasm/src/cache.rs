//! Compiled modules cached on disk, so only the first use ever pays for compiling.
//!
//! Compiling CPython's 26 MB module takes seconds; mapping a precompiled `.cwasm` takes about a
//! millisecond. A cache entry is named by the wasm's sha256 and the engine's compatibility
//! hash (wasmtime version, target and the settings that change code), and is written
//! atomically. Beside it a checksum file guards against a damaged entry, which wasmtime would
//! otherwise map and run: a mismatch rebuilds the entry.

use std::fs::File;
use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tandem_executor::ExecError;
use wasmtime::component::Component;
use wasmtime::{Engine, Module};
use xxhash_rust::xxh3::Xxh3;

/// Where a loaded module came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleSource {
    /// Mapped from the on-disk cache.
    Cache,
    /// Compiled now (and stored in the cache when it was writable).
    Compiled,
}

/// What the cache holds: a core module or a component.
pub(crate) trait Artifact: Sized {
    fn compile(engine: &Engine, wasm: &[u8]) -> wasmtime::Result<Self>;
    fn serialize(&self) -> wasmtime::Result<Vec<u8>>;
    /// Maps a precompiled entry that was checked against its checksum.
    fn map(engine: &Engine, file: File, path: &Path) -> wasmtime::Result<Self>;
}

// SAFETY (both `map`s): wasmtime runs whatever code the file holds and maps it lazily. The
// file is an entry this cache wrote itself (atomically renamed into place, never modified
// after), and its contents were just checked against the checksum recorded when it was
// written; wasmtime itself checks the header and engine compatibility.
impl Artifact for Module {
    fn compile(engine: &Engine, wasm: &[u8]) -> wasmtime::Result<Self> {
        Module::from_binary(engine, wasm)
    }

    fn serialize(&self) -> wasmtime::Result<Vec<u8>> {
        Module::serialize(self)
    }

    #[allow(unsafe_code)]
    fn map(engine: &Engine, file: File, _path: &Path) -> wasmtime::Result<Self> {
        // SAFETY: see above; mapped from the same open file that was checked.
        unsafe { Module::deserialize_open_file(engine, file) }
    }
}

impl Artifact for Component {
    fn compile(engine: &Engine, wasm: &[u8]) -> wasmtime::Result<Self> {
        Component::from_binary(engine, wasm)
    }

    fn serialize(&self) -> wasmtime::Result<Vec<u8>> {
        Component::serialize(self)
    }

    #[allow(unsafe_code)]
    fn map(engine: &Engine, file: File, path: &Path) -> wasmtime::Result<Self> {
        drop(file);
        // SAFETY: see above; components can only be mapped by path.
        unsafe { Component::deserialize_file(engine, path) }
    }
}

/// A loaded module or component, how it was obtained and how long that took.
pub(crate) struct Loaded<T> {
    pub artifact: T,
    pub source: ModuleSource,
    pub took: Duration,
}

impl<T> Loaded<T> {
    /// The same load with the artifact converted.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Loaded<U> {
        Loaded {
            artifact: f(self.artifact),
            source: self.source,
            took: self.took,
        }
    }
}

/// Loads `wasm` for `engine`, from `cache_dir` when a valid entry is there, compiling and
/// storing it otherwise. Blocking: call it off the async workers.
pub(crate) fn load<T: Artifact>(
    engine: &Engine,
    wasm: &Path,
    cache_dir: &Path,
) -> Result<Loaded<T>, ExecError> {
    let started = Instant::now();
    let entry = entry_path(engine, wasm, cache_dir)?;
    let cached = |artifact| Loaded {
        artifact,
        source: ModuleSource::Cache,
        took: started.elapsed(),
    };
    if let Ok(module) = map_entry(engine, &entry) {
        return Ok(cached(module));
    }
    // One compiler per entry across threads and processes; the others wait and then map what
    // it stored (best effort: without the lock, each compiles its own).
    let _lock = lock(&entry);
    match map_entry(engine, &entry) {
        Ok(module) => return Ok(cached(module)),
        Err(EntryError::Missing) => {}
        Err(EntryError::Invalid(why)) => {
            tracing::warn!(entry = %entry.display(), %why, "the cached compiled module is damaged; rebuilding it");
        }
    }
    let bytes =
        std::fs::read(wasm).map_err(|e| ExecError::io(format!("reading {}", wasm.display()), e))?;
    let module = T::compile(engine, &bytes)
        .map_err(|e| ExecError::Backend(format!("compiling {} failed: {e}", wasm.display())))?;
    match module.serialize() {
        Ok(compiled) => {
            if let Err(e) = store_entry(cache_dir, &entry, &compiled) {
                tracing::warn!(dir = %cache_dir.display(), error = %e, "cannot store the compiled module; the next process compiles it again");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot serialise the compiled module"),
    }
    Ok(Loaded {
        artifact: module,
        source: ModuleSource::Compiled,
        took: started.elapsed(),
    })
}

/// Where the cache keeps `wasm` compiled for `engine`.
fn entry_path(engine: &Engine, wasm: &Path, cache_dir: &Path) -> Result<PathBuf, ExecError> {
    let meta = std::fs::metadata(wasm)
        .map_err(|e| ExecError::io(format!("reading {}", wasm.display()), e))?;
    let stem = wasm
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("module")
        .to_owned();
    let sha = wasm_sha256(wasm, &meta, cache_dir, &stem)?;
    Ok(cache_dir.join(format!(
        "{stem}-{}-{:016x}.cwasm",
        &sha[..16],
        compatibility(engine)
    )))
}

/// Whether the cache has an entry (and its checksum) for `wasm`; the entry is checked when it
/// is loaded, and rebuilt then if it is damaged.
pub(crate) fn has_entry(engine: &Engine, wasm: &Path, cache_dir: &Path) -> Result<bool, ExecError> {
    let entry = entry_path(engine, wasm, cache_dir)?;
    Ok(entry.is_file() && sum_path(&entry).is_file())
}

/// Holds an exclusive lock on `<entry>.lock` until dropped.
fn lock(entry: &Path) -> Option<File> {
    std::fs::create_dir_all(entry.parent()?).ok()?;
    let file = File::create(entry.with_extension("cwasm.lock")).ok()?;
    file.lock().ok()?;
    Some(file)
}

/// The engine's compatibility hash as a number for file names.
fn compatibility(engine: &Engine) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    hasher.finish()
}

/// The wasm's sha256, remembered per (size, mtime, inode) so a fresh process does not hash
/// 26 MB again.
fn wasm_sha256(
    wasm: &Path,
    meta: &std::fs::Metadata,
    cache_dir: &Path,
    stem: &str,
) -> Result<String, ExecError> {
    let index = cache_dir.join("index").join(format!(
        "{stem}-{}-{}.{}-{}.sha256",
        meta.len(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ino()
    ));
    if let Ok(known) = std::fs::read_to_string(&index) {
        let known = known.trim();
        if known.len() == 64 && known.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(known.to_owned());
        }
    }
    let mut file =
        File::open(wasm).map_err(|e| ExecError::io(format!("reading {}", wasm.display()), e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| ExecError::io(format!("reading {}", wasm.display()), e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let sha = hex::encode(hasher.finalize());
    if let Err(e) = write_atomic(&index, sha.as_bytes()) {
        tracing::debug!(error = %e, "cannot remember the runtime's sha256");
    }
    Ok(sha)
}

enum EntryError {
    Missing,
    Invalid(String),
}

/// The checksum file beside a cache entry.
fn sum_path(entry: &Path) -> PathBuf {
    entry.with_extension("cwasm.xxh3")
}

/// Maps a cache entry after checking it against its checksum.
fn map_entry<T: Artifact>(engine: &Engine, entry: &Path) -> Result<T, EntryError> {
    let mut file = match File::open(entry) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(EntryError::Missing),
        Err(e) => return Err(EntryError::Invalid(e.to_string())),
    };
    let expected = std::fs::read_to_string(sum_path(entry))
        .map_err(|e| EntryError::Invalid(format!("its checksum file: {e}")))?;
    let actual = checksum(&mut file).map_err(|e| EntryError::Invalid(e.to_string()))?;
    if expected.trim() != actual {
        return Err(EntryError::Invalid(format!(
            "checksum {actual} does not match the recorded {}",
            expected.trim()
        )));
    }
    T::map(engine, file, entry).map_err(|e| EntryError::Invalid(e.to_string()))
}

/// `xxh3-64 hex` and length of a file's contents.
fn checksum(file: &mut File) -> std::io::Result<String> {
    let mut hasher = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        len += n as u64;
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:016x} {len}", hasher.digest()))
}

/// Writes the checksum, then the entry, each atomically.
fn store_entry(cache_dir: &Path, entry: &Path, compiled: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(cache_dir)?;
    let mut hasher = Xxh3::new();
    hasher.update(compiled);
    let sum = format!("{:016x} {}", hasher.digest(), compiled.len());
    write_atomic(&sum_path(entry), sum.as_bytes())?;
    write_atomic(entry, compiled)
}

/// Writes `path` through a temporary file in the same directory and a rename, so readers see
/// the old file or the whole new one.
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(data)?;
    tmp.as_file().sync_data()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}
