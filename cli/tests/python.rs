//! The Python client (`python/`) against this build's daemon: its pytest suites, run in the
//! environment `scripts/fetch-python-env.sh` made (AutoGen, smolagents, pytest from PyPI).

use std::path::PathBuf;
use std::process::Command;

/// The environment's Python; its absence fails the test with the fix.
fn python() -> PathBuf {
    let venv = std::env::var_os("TANDEM_PYTHON_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/tandem/python-env")
        });
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "no Python test environment at {}: run scripts/fetch-python-env.sh",
        venv.display()
    );
    python
}

/// Runs the pytest files `files` of python/tests; fails with pytest's report.
fn pytest(files: &[&str]) {
    let files: Vec<String> = files.iter().map(|f| format!("tests/{f}")).collect();
    pytest_at(&files);
}

/// Runs the pytest files at `files`, relative to python/; fails with pytest's report.
fn pytest_at(files: &[String]) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../python");
    let out = Command::new(python())
        .current_dir(&dir)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"])
        .args(files)
        .env("TANDEM_BIN", env!("CARGO_BIN_EXE_tandem"))
        .env("PYTHONPATH", dir.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("pytest starts");
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "pytest {files:?} failed:\n{report}");
    assert!(
        report.contains(" passed") && !report.contains(" skipped"),
        "pytest {files:?} ran nothing, or skipped some:\n{report}"
    );
}

#[test]
fn the_peers_benchmark_judges_answers_as_tandem_eval_does() {
    pytest_at(&["bench/test_peers_judge.py".to_owned()]);
}

#[test]
fn the_client_and_its_models() {
    pytest(&["test_client.py", "test_models.py"]);
}

#[test]
fn autogen_code_executor() {
    pytest(&["test_autogen.py"]);
}

#[test]
fn smolagents_executor() {
    pytest(&["test_smolagents.py", "test_smolagents_upstream.py"]);
}

#[test]
fn the_client_reads_with_a_bound() {
    pytest(&["test_bounds.py"]);
}

#[test]
fn the_python_page_examples_run() {
    pytest(&["test_docs.py"]);
}
