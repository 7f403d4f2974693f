use std::fmt;

use serde::{Deserialize, Serialize};

/// A normalised language name: `python`, `sh`, `javascript`, or any other lowercase name.
///
/// [`Language::new`] is the one alias table: `py`/`python3` → python, `bash`/`shell`/`zsh`
/// → sh, `js`/`node` → javascript.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub struct Language(String);

impl Language {
    /// Normalises a name through the alias table.
    pub fn new(raw: &str) -> Self {
        let lower = raw.trim().to_ascii_lowercase();
        let canonical = match lower.as_str() {
            "python" | "py" | "python3" | "py3" | "python3.12" | "python3.11" => "python",
            "sh" | "bash" | "shell" | "zsh" | "ksh" | "dash" | "shellscript" | "shell-script" => {
                "sh"
            }
            "javascript" | "js" | "node" | "nodejs" | "mjs" | "cjs" => "javascript",
            "typescript" | "ts" => "typescript",
            "ruby" | "rb" => "ruby",
            "perl" | "pl" => "perl",
            _ => return Self(lower),
        };
        Self(canonical.to_owned())
    }

    /// Python 3.
    pub fn python() -> Self {
        Self("python".to_owned())
    }

    /// POSIX shell.
    pub fn sh() -> Self {
        Self("sh".to_owned())
    }

    /// JavaScript (node or QuickJS).
    pub fn javascript() -> Self {
        Self("javascript".to_owned())
    }

    /// The normalised name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Data and prose formats that are shown, never run (`text`, `json`, `output`, ...).
    pub fn is_data(&self) -> bool {
        matches!(
            self.0.as_str(),
            "text"
                | "txt"
                | "plaintext"
                | "plain"
                | "output"
                | "out"
                | "console"
                | "log"
                | "json"
                | "jsonl"
                | "yaml"
                | "yml"
                | "toml"
                | "ini"
                | "csv"
                | "tsv"
                | "xml"
                | "html"
                | "css"
                | "markdown"
                | "md"
                | "diff"
                | "patch"
                | "sql"
                | "mermaid"
        )
    }

    /// The usual file extension, for naming block files.
    pub fn extension(&self) -> &str {
        match self.0.as_str() {
            "python" => "py",
            "sh" => "sh",
            "javascript" => "js",
            "typescript" => "ts",
            "ruby" => "rb",
            "perl" => "pl",
            other => other,
        }
    }

    /// The usual command that runs a file of this language (`python3`, `sh`, `node`,
    /// `perl`), looked up on a PATH; `None` for data formats and languages with no one command.
    pub fn program(&self) -> Option<&'static str> {
        match self.0.as_str() {
            "python" => Some("python3"),
            "sh" => Some("sh"),
            "javascript" => Some("node"),
            "ruby" => Some("ruby"),
            "perl" => Some("perl"),
            _ => None,
        }
    }

    /// The language a file extension means, such as `py` → python.
    pub fn from_extension(ext: &str) -> Option<Self> {
        let lang = match ext.to_ascii_lowercase().as_str() {
            "py" => "python",
            "sh" | "bash" => "sh",
            "js" | "mjs" | "cjs" => "javascript",
            "ts" => "typescript",
            "rb" => "ruby",
            "pl" => "perl",
            _ => return None,
        };
        Some(Self(lang.to_owned()))
    }
}

impl From<String> for Language {
    fn from(raw: String) -> Self {
        Self::new(&raw)
    }
}

impl From<Language> for String {
    fn from(lang: Language) -> Self {
        lang.0
    }
}

impl fmt::Display for Language {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Joins language names for messages: `python, sh`.
pub fn join(langs: &[Language]) -> String {
    langs
        .iter()
        .map(Language::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_normalise() {
        for (raw, want) in [
            ("py", "python"),
            ("Python", "python"),
            ("python3", "python"),
            ("bash", "sh"),
            ("shell", "sh"),
            ("zsh", "sh"),
            ("js", "javascript"),
            ("node", "javascript"),
            ("Rust", "rust"),
        ] {
            assert_eq!(Language::new(raw).as_str(), want, "{raw}");
        }
    }
}
