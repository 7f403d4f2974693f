//! Helpers for executor tests, and `all`, which runs the shared conformance kit
//! (`tandem-executor-conformance`, what `tandem executor test` runs) against an executor.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use tandem_executor::{
    CancellationToken, ExecContext, ExecOutcome, ExecRequest, Executor, Language, Limits, Session,
    SessionSpec,
};

/// Opens a session with default limits and a temporary workspace.
pub async fn open(executor: &dyn Executor, limits: Limits) -> Box<dyn Session> {
    executor
        .open(SessionSpec {
            limits,
            ..Default::default()
        })
        .await
        .expect("open a session")
}

/// Opens a session whose blocks may run for `secs` seconds.
pub async fn open_with_wall(executor: &dyn Executor, secs: u64) -> Box<dyn Session> {
    open(
        executor,
        Limits {
            wall: Duration::from_secs(secs),
            ..Limits::default()
        },
    )
    .await
}

/// Runs one block with no timeout override and a fresh cancel token.
pub async fn run(session: &mut dyn Session, lang: &str, code: &str) -> ExecOutcome {
    session
        .run(
            ExecRequest::new(Language::new(lang), code),
            ExecContext::new(CancellationToken::new()),
        )
        .await
        .unwrap_or_else(|e| panic!("running {lang} block failed: {e}\n{code}"))
}

/// A module saved with `# filename:` imports from a later python block (it leaves
/// `helper.py` in the workspace).
pub async fn saved_module_imports(s: &mut dyn Session) {
    run(
        s,
        "python",
        "# filename: helper.py\ndef double(x):\n    return 2 * x",
    )
    .await;
    let out = run(s, "python", "from helper import double\nprint(double(21))").await;
    assert_eq!(out.stdout.to_text(), "42\n", "{}", out.stderr.to_text());
}

/// The sorted names of the entries of a directory.
pub fn dir_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Runs every conformance case against `executor`: each must pass, but for exactly the
/// cases named in `not_applicable`, which must say they do not apply.
pub async fn all(executor: Arc<dyn Executor>, not_applicable: &[&str]) {
    let reports = tandem_executor_conformance::run(executor.clone(), None).await;
    let mut wrong = Vec::new();
    for r in &reports {
        let expected_na = not_applicable.contains(&r.case);
        match (&r.verdict, expected_na) {
            (tandem_executor_conformance::Verdict::Pass, false)
            | (tandem_executor_conformance::Verdict::NotApplicable(_), true) => {}
            (verdict, _) => wrong.push(format!("{}: {verdict:?}", r.case)),
        }
    }
    assert!(
        wrong.is_empty(),
        "{} fails the conformance kit:\n{}",
        executor.name(),
        wrong.join("\n")
    );
}
