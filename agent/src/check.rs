//! A task's check, run in the task's own session once the task has ended: never shown to the
//! model, and run with the task's limits.

use tandem_executor::{CancellationToken, ExitStatus, Language};
use tandem_protocol::{Check, CheckOutcome, Verdict};

use crate::blocks::SessionSlot;

/// Most characters of a check program's output kept as its verdict's detail.
const DETAIL_CHARS: usize = 2000;

/// Runs `check` against a task that ended with `answer` (its final answer, if any) after its
/// blocks printed `outputs`; `None` when `cancel` fired before the check could decide.
pub async fn run_check(
    slot: &mut SessionSlot,
    check: &Check,
    answer: Option<&str>,
    outputs: &[&str],
    cancel: &CancellationToken,
) -> Option<CheckOutcome> {
    let outcome = |verdict, detail: String| Some(CheckOutcome { verdict, detail });
    if let Some(problem) = check.problem() {
        return outcome(Verdict::Error, problem.to_owned());
    }
    if let Some(expected) = &check.expect {
        let expected = expected.trim();
        let found = answer.is_some_and(|a| a.contains(expected))
            || outputs.iter().any(|o| o.contains(expected));
        if !found {
            return outcome(
                Verdict::Unsolved,
                format!("`{expected}` is neither in the final answer nor in any block's output"),
            );
        }
    }
    if let Some(file) = &check.file {
        let program = file_check(file, check.contents.as_deref());
        let decided = run(slot, &Language::python(), &program, cancel).await?;
        if decided.verdict != Verdict::Solved {
            return Some(decided);
        }
    }
    if let Some(program) = &check.program {
        let language = check
            .language
            .as_deref()
            .map_or_else(Language::python, Language::new);
        let code = if language == Language::python() {
            python_check(program)
        } else {
            program.clone()
        };
        let decided = run(slot, &language, &code, cancel).await?;
        if decided.verdict != Verdict::Solved {
            return Some(decided);
        }
    }
    outcome(Verdict::Solved, String::new())
}

/// Runs one program of the check: exit 0 holds, exit 1 does not, anything else is the check's
/// own failure.
async fn run(
    slot: &mut SessionSlot,
    language: &Language,
    code: &str,
    cancel: &CancellationToken,
) -> Option<CheckOutcome> {
    let outcome = |verdict, detail: String| {
        Some(CheckOutcome {
            verdict,
            detail: cap(detail.trim()),
        })
    };
    // The task's own list of languages binds the model's blocks, not its check.
    if !slot.executor().supports(language) {
        return outcome(
            Verdict::Error,
            format!(
                "the check cannot run: the {} executor does not run {language}",
                slot.executor().name()
            ),
        );
    }
    let ran = match slot.run_quiet(language, code, cancel).await {
        Ok(Some(ran)) => ran,
        Ok(None) => return None,
        Err(e) => {
            return outcome(
                Verdict::Error,
                format!(
                    "the {} executor could not run the check: {e}",
                    slot.executor().name()
                ),
            );
        }
    };
    let said = format!("{}{}", ran.stdout.to_text(), ran.stderr.to_text());
    match ran.status {
        ExitStatus::Exited(0) => outcome(Verdict::Solved, said),
        ExitStatus::Exited(1) => outcome(Verdict::Unsolved, said),
        ExitStatus::Exited(code) => outcome(
            Verdict::Error,
            format!("the check exited with {code}, neither 0 (solved) nor 1 (unsolved)\n{said}"),
        ),
        ExitStatus::Cancelled => None,
        ExitStatus::TimedOut => outcome(
            Verdict::Error,
            format!(
                "the check ran longer than the task's block timeout ({} s)",
                slot.block_timeout().as_secs_f64()
            ),
        ),
        ExitStatus::OutOfMemory => outcome(
            Verdict::Error,
            "the check ran out of the task's memory".to_owned(),
        ),
        ExitStatus::Signaled(sig) => outcome(
            Verdict::Error,
            format!("the check was killed by signal {sig}"),
        ),
    }
}

fn cap(text: &str) -> String {
    match text.char_indices().nth(DETAIL_CHARS) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// A string as a Python literal: a JSON string is one.
fn literal(text: &str) -> String {
    serde_json::Value::String(text.to_owned()).to_string()
}

/// A Python program that holds when the workspace has `file` (with `contents`, whitespace
/// around it aside). It reads the file beneath the workspace without following a link out.
fn file_check(file: &str, contents: Option<&str>) -> String {
    let contents = contents.map_or_else(|| "None".to_owned(), literal);
    format!(
        r#"import os, sys
path = {path}
want = {contents}
real = os.path.realpath(path)
if os.path.commonpath([real, os.getcwd()]) != os.getcwd():
    print(f"{{path}} is outside the workspace"); sys.exit(1)
if not os.path.isfile(real):
    print(f"{{path}} does not exist or is not a file"); sys.exit(1)
with open(real, encoding="utf-8", errors="replace") as f:
    got = f.read()
if want is not None and got.strip() != want.strip():
    print(f"{{path}} holds {{got.strip()[:300]!r}}, not {{want.strip()[:300]!r}}"); sys.exit(1)
"#,
        path = literal(file),
    )
}

/// The check's Python program inside a frame that tells its verdict apart from its crash: a
/// failed assert, or an exception raised by what the task left (a module of its that does not
/// compile among them), is unsolved (1); a check that does not compile, or names something it
/// never defined, is a check error (3).
fn python_check(program: &str) -> String {
    format!(
        r#"import os, sys, traceback
sys.path.insert(0, os.getcwd())
try:
    code = compile({source}, "<check>", "exec")
except SyntaxError as e:
    print(f"the check does not compile: {{e}}"); sys.exit(3)
try:
    exec(code, {{"__name__": "__main__"}})
except SystemExit:
    raise
except BaseException as e:
    frames = traceback.extract_tb(e.__traceback__)
    last = frames[-1] if frames else None
    own = last is not None and last.filename == "<check>"
    where = f" (line {{last.lineno}} of the check)" if own else ""
    if isinstance(e, AssertionError):
        print(f"assertion failed{{where}}: {{e}}" if str(e) else f"assertion failed{{where}}")
        sys.exit(1)
    traceback.print_exc()
    # A module of the task's that does not compile is the task's fault, not the check's.
    broken = isinstance(e, SyntaxError) and e.filename == "<check>"
    sys.exit(3 if broken or (own and isinstance(e, NameError)) else 1)
"#,
        source = literal(program),
    )
}
