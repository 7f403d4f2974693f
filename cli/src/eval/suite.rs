//! A suite of tasks for `tandem eval`: a TOML file of `[[tasks]]`, or JSON lines with one
//! task per line, each with the check that decides whether it was solved.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use tandem_protocol::Check;

/// One task of a suite.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteTask {
    /// A name unique in the suite, as the results and `--only` name it.
    pub id: String,
    /// The task, in words, as the model reads it.
    pub task: String,
    /// Decides whether it was solved; the model never sees it.
    pub check: Check,
    /// Files given to the task, relative to the suite's file.
    #[serde(default)]
    pub files: Vec<PathBuf>,
    /// Which part of the suite it is in (`tune`, `test`, ...), for `--split`.
    #[serde(default)]
    pub split: Option<String>,
    /// Words that group tasks (`csv`, `shell`), shown by nothing but kept in the results.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Most assistant turns, over the suite's default.
    #[serde(default)]
    pub max_turns: Option<u32>,
    /// Executor, over the suite's default.
    #[serde(default)]
    pub executor: Option<String>,
    /// The only languages it may run.
    #[serde(default)]
    pub languages: Option<Vec<String>>,
}

/// What every task of a TOML suite gets unless it says otherwise.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Defaults {
    /// Executor.
    #[serde(default)]
    pub executor: Option<String>,
    /// Most assistant turns.
    #[serde(default)]
    pub max_turns: Option<u32>,
    /// Wall-clock limit per task, seconds.
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// Wall-clock limit per block (and for the check), seconds.
    #[serde(default)]
    pub block_timeout_secs: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlSuite {
    #[serde(default)]
    defaults: Defaults,
    #[serde(default)]
    tasks: Vec<SuiteTask>,
}

/// A suite read and checked: its tasks, their defaults, and the directory their files are
/// relative to.
#[derive(Debug)]
pub struct Suite {
    /// The tasks, in the file's order.
    pub tasks: Vec<SuiteTask>,
    /// The suite's defaults.
    pub defaults: Defaults,
    /// The suite file's directory.
    pub dir: PathBuf,
}

impl Suite {
    /// Reads the suite at `path`: TOML when it ends in `.toml`, JSON lines otherwise.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the suite {}", path.display()))?;
        let shown = path.display();
        let (tasks, defaults) = if path.extension().is_some_and(|e| e == "toml") {
            let suite: TomlSuite =
                toml::from_str(&text).with_context(|| format!("{shown} is not a suite"))?;
            (suite.tasks, suite.defaults)
        } else {
            (json_lines(&text, &shown.to_string())?, Defaults::default())
        };
        let dir = path
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        let suite = Self {
            tasks,
            defaults,
            dir,
        };
        suite.check(&shown.to_string())?;
        Ok(suite)
    }

    /// Refuses a suite with no tasks, a task without an id or words, an id used twice, a
    /// check that checks nothing, or a file that is not there, naming the task.
    fn check(&self, shown: &str) -> Result<()> {
        if self.tasks.is_empty() {
            bail!("{shown} has no tasks");
        }
        let mut seen = HashSet::new();
        for (i, t) in self.tasks.iter().enumerate() {
            let at = format!("{shown}: task {} (`{}`)", i + 1, t.id);
            if t.id.trim().is_empty() {
                bail!("{shown}: task {} has no id", i + 1);
            }
            if !seen.insert(t.id.as_str()) {
                bail!("{at}: the id is used twice; ids name results and must differ");
            }
            if t.task.trim().is_empty() {
                bail!("{at}: the task is empty");
            }
            if let Some(problem) = t.check.problem() {
                bail!("{at}: {problem}");
            }
            for file in &t.files {
                let path = self.dir.join(file);
                if !path.exists() {
                    bail!("{at}: file {} is not there", path.display());
                }
            }
        }
        Ok(())
    }

    /// The files of `task`, as paths from here.
    pub fn files_of(&self, task: &SuiteTask) -> Vec<PathBuf> {
        task.files.iter().map(|f| self.dir.join(f)).collect()
    }
}

/// One task per non-blank line; a line that does not parse is named by its number.
fn json_lines(text: &str, shown: &str) -> Result<Vec<SuiteTask>> {
    let mut tasks = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        let task: SuiteTask = serde_json::from_str(line)
            .with_context(|| format!("{shown} line {}: not a suite task", n + 1))?;
        tasks.push(task);
    }
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(name: &str, text: &str) -> Result<Suite> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        Suite::load(&path)
    }

    fn error(name: &str, text: &str) -> String {
        format!("{:#}", load(name, text).unwrap_err())
    }

    #[test]
    fn a_bad_line_is_named_by_its_number() {
        let good = r#"{"id": "a", "task": "print 1", "check": {"expect": "1"}}"#;
        let text = format!("{good}\n\n{{\"id\": \"b\", \"task\": \n");
        let e = error("s.jsonl", &text);
        assert!(e.contains("s.jsonl line 3: not a suite task"), "{e}");
        let e = error(
            "s.jsonl",
            r#"{"id": "a", "task": "x", "check": {"expect": "1"}, "chek": 1}"#,
        );
        assert!(e.contains("line 1") && e.contains("chek"), "{e}");
    }

    #[test]
    fn a_suite_that_cannot_decide_is_refused_naming_the_task() {
        let e = error(
            "s.jsonl",
            r#"{"id": "a", "task": "x", "check": {"expect": "1", "contents": "1"}}"#,
        );
        assert!(e.contains("task 1 (`a`): check.contents"), "{e}");
        let e = error(
            "s.jsonl",
            "{\"id\": \"a\", \"task\": \"x\", \"check\": {\"expect\": \"1\"}}\n{\"id\": \"a\", \"task\": \"y\", \"check\": {\"expect\": \"2\"}}",
        );
        assert!(e.contains("used twice"), "{e}");
        let e = error(
            "s.toml",
            "[[tasks]]\nid = \"a\"\ntask = \"x\"\nfiles = [\"nope.csv\"]\n[tasks.check]\nexpect = \"1\"\n",
        );
        assert!(e.contains("nope.csv is not there"), "{e}");
        let e = error("s.toml", "[[tasks]]\nid = \"a\"\ntask = \"x\"\n");
        assert!(e.contains("check"), "{e}");
    }

    #[test]
    fn toml_suites_have_defaults() {
        let suite = load(
            "s.toml",
            "[defaults]\nmax_turns = 4\n[[tasks]]\nid = \"a\"\ntask = \"x\"\nsplit = \"test\"\n[tasks.check]\nprogram = \"assert True\"\n",
        )
        .unwrap();
        assert_eq!(suite.defaults.max_turns, Some(4));
        assert_eq!(suite.tasks[0].split.as_deref(), Some("test"));
    }
}
