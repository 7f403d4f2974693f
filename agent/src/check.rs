//! A task's check, run in the task's own session once the task has ended: never shown to the
//! model, and run with the task's limits.

use tandem_executor::{CancellationToken, ExitStatus, Language};
use tandem_protocol::{Check, CheckOutcome, Verdict};

use crate::blocks::SessionSlot;

/// Most characters of a check program's output kept as its verdict's detail.
const DETAIL_CHARS: usize = 2000;

/// What starts each line a Python check's frame writes to say how far it got; a secret of
/// one run follows it, so no output of the task's code can say it in the frame's place.
const FRAME_TAG: &str = "tandem-check";

/// Runs `check` against a task that ended with `answer` (its final answer, if any) after its
/// blocks printed `outputs`; `None` when `cancel` fired before the check could decide.
pub async fn run_check(
    slot: &mut SessionSlot,
    check: &Check,
    answer: Option<&str>,
    outputs: &[&str],
    cancel: &CancellationToken,
) -> Option<CheckOutcome> {
    let outcome = |verdict, detail: String| {
        Some(CheckOutcome {
            verdict,
            detail,
            printed: None,
        })
    };
    if let Some(problem) = check.problem() {
        return outcome(Verdict::Error, problem.to_owned());
    }
    let mut printed = None;
    if let Some(value) = &check.value {
        let tolerance = check.tolerance.unwrap_or(0.0);
        let line = answer
            .map(crate::grounding::answer_line)
            .unwrap_or_default();
        let found = outputs.iter().any(|o| {
            o.lines()
                .any(|l| crate::grounding::gives(l, value, tolerance))
        });
        if !crate::grounding::gives(&line, value, tolerance) {
            let expected = crate::grounding::clip(&value.to_string(), 200);
            let detail = match answer {
                None => format!("expected {expected}; the task has no answer"),
                Some(_) => format!(
                    "expected {expected}; the answer says {}",
                    crate::grounding::clip(&format!("{line:?}"), 200)
                ),
            };
            return Some(CheckOutcome {
                verdict: Verdict::Unsolved,
                detail,
                printed: Some(found),
            });
        }
        printed = Some(found);
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
        let decided = run_python(slot, &program, cancel).await?;
        if decided.verdict != Verdict::Solved {
            return Some(decided);
        }
    }
    if let Some(program) = &check.program {
        let language = check
            .language
            .as_deref()
            .map_or_else(Language::python, Language::new);
        let decided = if language == Language::python() {
            run_python(slot, program, cancel).await?
        } else {
            run(slot, &language, program, None, cancel).await?
        };
        if decided.verdict != Verdict::Solved {
            return Some(decided);
        }
    }
    Some(CheckOutcome {
        verdict: Verdict::Solved,
        detail: String::new(),
        printed,
    })
}

/// Runs a Python check inside its frame ([`python_check`]), which says with this run's
/// secret that it started and what it decided.
async fn run_python(
    slot: &mut SessionSlot,
    program: &str,
    cancel: &CancellationToken,
) -> Option<CheckOutcome> {
    let tag = format!("{FRAME_TAG} {}", tandem_executor_kit::toolchannel::secret());
    let code = python_check(program, &tag);
    run(slot, &Language::python(), &code, Some(&tag), cancel).await
}

/// Runs one program of the check, in a process of its own that runs nothing the task left
/// for an interpreter's start. Unframed, exit 0 holds, exit 1 does not, anything else is the
/// check's own failure; framed (`tag`), the frame's own last word decides, and a process that
/// ended after the frame started but before its word was ended by the task's code.
async fn run(
    slot: &mut SessionSlot,
    language: &Language,
    code: &str,
    tag: Option<&str>,
    cancel: &CancellationToken,
) -> Option<CheckOutcome> {
    let outcome = |verdict, detail: String| {
        Some(CheckOutcome {
            verdict,
            detail: cap(detail.trim()),
            printed: None,
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
    let ran = match slot.run_apart(language, code, cancel).await {
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
    let stdout = ran.stdout.to_text();
    let (stdout, framed) = match tag {
        Some(tag) => {
            let (rest, framed) = Framed::take(&stdout, tag);
            (rest, Some(framed))
        }
        None => (stdout, None),
    };
    let said = format!("{stdout}{}", ran.stderr.to_text());
    match (ran.status, framed) {
        (ExitStatus::Exited(_), Some(Framed { word: Some(v), .. })) => outcome(v, said),
        (ExitStatus::Exited(code), Some(Framed { started: true, .. })) => outcome(
            Verdict::Unsolved,
            format!(
                "the process ended before the check ran to its end (exit {code}): code the task left ended it (an exit as a module of its was imported or called)\n{said}"
            ),
        ),
        (ExitStatus::Exited(code), Some(Framed { started: false, .. })) => outcome(
            Verdict::Error,
            format!("the check's frame did not start (exit {code})\n{said}"),
        ),
        (ExitStatus::Exited(0), None) => outcome(Verdict::Solved, said),
        (ExitStatus::Exited(1), None) => outcome(Verdict::Unsolved, said),
        (ExitStatus::Exited(code), None) => outcome(
            Verdict::Error,
            format!("the check exited with {code}, neither 0 (solved) nor 1 (unsolved)\n{said}"),
        ),
        (ExitStatus::Cancelled, _) => None,
        (ExitStatus::TimedOut, _) => outcome(
            Verdict::Error,
            format!(
                "the check ran longer than the task's block timeout ({} s)",
                slot.block_timeout().as_secs_f64()
            ),
        ),
        (ExitStatus::OutOfMemory, _) => outcome(
            Verdict::Error,
            "the check ran out of the task's memory".to_owned(),
        ),
        (ExitStatus::Signaled(sig), _) => outcome(
            Verdict::Error,
            format!("the check was killed by signal {sig}"),
        ),
    }
}

/// What a Python check's frame wrote of its progress, each on a line of its own after `tag`:
/// `started` once the frame stands, then its verdict.
#[derive(Debug, Default, PartialEq, Eq)]
struct Framed {
    started: bool,
    word: Option<Verdict>,
}

impl Framed {
    /// `stdout` without the frame's lines, and what they said.
    fn take(stdout: &str, tag: &str) -> (String, Self) {
        let mut framed = Self::default();
        let mut rest = stdout.to_owned();
        for (word, verdict) in [
            ("started", None),
            ("solved", Some(Verdict::Solved)),
            ("unsolved", Some(Verdict::Unsolved)),
            ("error", Some(Verdict::Error)),
        ] {
            let line = format!("\n{tag} {word}\n");
            if rest.contains(&line) {
                rest = rest.replace(&line, "");
                match verdict {
                    None => framed.started = true,
                    Some(v) => framed.word = Some(v),
                }
            }
        }
        (rest, framed)
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

/// A Python check that holds when the workspace has `file` (with `contents`, whitespace
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
/// compile among them), is unsolved; a check that does not compile, or names something it
/// never defined, is a check error. The frame writes its word after `tag` (a secret of this
/// run), and exits at once, past any exit handler the task's code set.
///
/// What the task left cannot stand in for the frame or for any module the interpreter has: the
/// workspace is off `sys.path` while the frame imports what it needs, and back only after the
/// interpreter's own directories and its site-packages, so a `traceback.py`, `json.py` or
/// `pandas.py` of the task's is never imported in their place, while a module the interpreter
/// does not have (the task's `solution`) is found there. A `SystemExit` raised by a frame of
/// the task's code (its `sys.exit(0)`) is not the check's.
fn python_check(program: &str, tag: &str) -> String {
    format!(
        "{PYTHON_FRAME}\n__tandem_frame({source}, {tag})\n",
        source = literal(program),
        tag = literal(tag),
    )
}

/// The Python check's frame: defines `__tandem_frame(source, tag)`, which never returns.
const PYTHON_FRAME: &str = r#"import sys


def __tandem_frame(source, tag):
    # Nothing is imported from the workspace until it is put back: posix is built in.
    import posix

    here = posix.getcwd()

    def inside(path, root):
        return path == root or path.startswith(root.rstrip("/") + "/")

    sys.path[:] = [p for p in sys.path if p.startswith("/") and not inside(p, here)]
    import os

    real = os.path.realpath(here)

    def theirs(path):
        return path.startswith("/") and inside(os.path.realpath(path), real)

    mine = sys._getframe().f_code.co_filename
    sys.path[:] = [p for p in sys.path if not theirs(p)]
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file != mine and theirs(file):
            del sys.modules[name]
    import traceback
    import types

    # Held before the check runs: its modules could swap the names.
    write, end, streams = os.write, os._exit, (sys.stdout, sys.stderr)

    def said(word, status):
        for stream in streams:
            try:
                stream.flush()
            except BaseException:
                pass
        write(1, ("\n%s %s\n" % (tag, word)).encode())
        end(status)

    sys.path.append(here)
    write(1, ("\n%s started\n" % tag).encode())
    try:
        code = compile(source, "<check>", "exec")
    except SyntaxError as e:
        print("the check does not compile: %s" % e)
        said("error", 3)
    # The check is __main__ (unittest.main() finds its tests there).
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    except SystemExit as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != mine]
        if any(theirs(f.filename) for f in frames):
            print("the task's code ended the check with SystemExit(%r) before it ran to its end" % (e.code,))
            said("unsolved", 1)
        status = e.code
        if status is None:
            status = 0
        elif not isinstance(status, int):
            print(status, file=sys.stderr)
            status = 1
        if status in (0, 1):
            said(("solved", "unsolved")[status], status)
        print("the check exited with %d, neither 0 (solved) nor 1 (unsolved)" % status)
        said("error", 3)
    except BaseException as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != mine]
        last = frames[-1] if frames else None
        own = last is not None and last.filename == "<check>"
        where = " (line %d of the check)" % last.lineno if own else ""
        if isinstance(e, AssertionError):
            print("assertion failed%s: %s" % (where, e) if str(e) else "assertion failed%s" % where)
            said("unsolved", 1)
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        # A module of the task's that does not compile is the task's fault, not the check's.
        broken = isinstance(e, SyntaxError) and e.filename == "<check>"
        if broken or (own and isinstance(e, NameError)):
            said("error", 3)
        said("unsolved", 1)
    said("solved", 0)
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frames_lines_are_taken_out_of_what_the_check_said() {
        let tag = "tandem-check 1234";
        let out = format!("\n{tag} started\nhello\n\n{tag} unsolved\n");
        let (rest, framed) = Framed::take(&out, tag);
        assert_eq!(rest, "hello\n");
        assert_eq!(
            framed,
            Framed {
                started: true,
                word: Some(Verdict::Unsolved)
            }
        );
        // A verdict under another secret is output like any other.
        let forged = format!("\n{tag} started\n\ntandem-check 9999 solved\n");
        let (rest, framed) = Framed::take(&forged, tag);
        assert_eq!(rest, "\ntandem-check 9999 solved\n");
        assert_eq!(
            framed,
            Framed {
                started: true,
                word: None
            }
        );
        assert_eq!(Framed::take("", tag).1, Framed::default());
    }
}
