use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tandem_executor::Language;

use crate::LocalConfig;

/// The programs that run each language, resolved once per executor.
#[derive(Clone, Debug)]
pub struct Interpreters {
    /// The real python binary (version-manager shims resolved), if any.
    pub python: Option<PathBuf>,
    /// `node`, if installed.
    pub node: Option<PathBuf>,
    /// POSIX shell.
    pub sh: PathBuf,
    /// PATH given to code: the interpreters' own directories first, then the configured PATH.
    pub path_env: String,
}

impl Interpreters {
    pub(crate) fn discover(config: &LocalConfig, path: &str) -> Self {
        let python = config
            .python
            .clone()
            .or_else(|| which(program(&Language::python()), path))
            .map(|p| resolve_shim(&p).unwrap_or(p));
        let node = config
            .node
            .clone()
            .or_else(|| which(program(&Language::javascript()), path));
        let sh = which(program(&Language::sh()), path).unwrap_or_else(|| PathBuf::from("/bin/sh"));
        // Shims of version managers (pyenv, asdf) find their root through HOME, which code
        // does not share with the daemon; putting the real interpreter's directory first
        // makes `python3` inside an sh block the same interpreter as python blocks use.
        let mut dirs: Vec<String> = Vec::new();
        for p in [&python, &node].into_iter().flatten() {
            if let Some(dir) = p.parent().and_then(Path::to_str)
                && !dirs.iter().any(|d| d == dir)
            {
                dirs.push(dir.to_owned());
            }
        }
        dirs.push(path.to_owned());
        Self {
            python,
            node,
            sh,
            path_env: dirs.join(":"),
        }
    }

    /// Languages runnable with what PATH holds, without starting anything.
    pub(crate) fn languages_on(config: &LocalConfig, path: &str) -> Vec<Language> {
        let mut langs = Vec::new();
        if config.python.is_some() || which(program(&Language::python()), path).is_some() {
            langs.push(Language::python());
        }
        langs.push(Language::sh());
        if config.node.is_some() || which(program(&Language::javascript()), path).is_some() {
            langs.push(Language::javascript());
        }
        langs
    }

    /// The installations the interpreters run from (`/usr`, a pyenv version, a venv):
    /// what a confined block must be able to read.
    pub fn prefixes(&self) -> Vec<PathBuf> {
        let mut prefixes: Vec<PathBuf> = Vec::new();
        for program in [
            self.python.as_deref(),
            self.node.as_deref(),
            Some(self.sh.as_path()),
        ]
        .into_iter()
        .flatten()
        {
            let real = std::fs::canonicalize(program).unwrap_or_else(|_| program.to_owned());
            for path in [program, real.as_path()] {
                if let Some(prefix) = path.parent().and_then(Path::parent)
                    && !prefixes.iter().any(|p| p == prefix)
                {
                    prefixes.push(prefix.to_owned());
                }
            }
        }
        prefixes
    }

    /// The program that runs `language`, if any.
    pub fn program(&self, language: &Language) -> Option<&Path> {
        match language.as_str() {
            "python" => self.python.as_deref(),
            "sh" => Some(&self.sh),
            "javascript" => self.node.as_deref(),
            _ => None,
        }
    }
}

/// The command that runs `language` (every built-in language has one).
fn program(language: &Language) -> &'static str {
    language.program().unwrap_or("sh")
}

/// `name` on `path`: an executable file, as a shell finds it (relative entries against `/`,
/// not the daemon's working directory).
fn which(name: &str, path: &str) -> Option<PathBuf> {
    which::which_in(name, Some(path), "/").ok()
}

/// A script (`#!`) named python3 is a version-manager shim costing ~100 ms per start; ask it
/// once for the real binary.
fn resolve_shim(path: &Path) -> Option<PathBuf> {
    let mut magic = [0u8; 2];
    std::fs::File::open(path)
        .ok()?
        .read_exact(&mut magic)
        .ok()?;
    if &magic != b"#!" {
        return None;
    }
    let out = Command::new(path)
        .args(["-c", "import sys; print(sys.executable)"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let real = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && real.is_absolute()).then_some(real)
}
