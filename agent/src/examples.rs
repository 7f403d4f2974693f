//! The examples a task states (doctest lines, `assert` lines), run against the model's code
//! after a clean run, so the model reads "expected X, got Y" instead of guessing whether its
//! own test prints matched.

use serde::Deserialize;

/// Most examples run after one block; more are left out, so a task of a thousand doctest
/// lines costs one bounded run.
const MOST: usize = 20;

/// Characters of an example's source, expected or got text kept in the note.
const SHOWN: usize = 200;

/// What the note says when some examples do not hold; a report holding it is not a clean run.
pub const FAILED_MARK: &str = "The task's examples do not all hold against your code";

/// What the note says when every example holds.
pub const HELD_MARK: &str = "The task's examples hold against your code";

/// Where the examples' note starts in an executor's report, which it ends; `None` when the
/// report has none.
pub fn note_in(report: &str) -> Option<usize> {
    [FAILED_MARK, HELD_MARK]
        .iter()
        .filter_map(|mark| report.rfind(&format!("\n{mark}")))
        .max()
        .map(|at| at + 1)
}

/// Whether `report` ends with the note that every example held. A block can print that line
/// itself, but only where no examples were run after it (their note comes last): code that
/// forges it ends its own task early, as the word said by its author would.
pub fn all_held_in(report: &str) -> bool {
    note_in(report)
        .and_then(|at| report.get(at..))
        .is_some_and(|note| note.starts_with(HELD_MARK))
}

/// A task's stated examples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Examples {
    /// The task's text, which the runner parses in Python (doctest's own comparison).
    task: String,
    /// Names the examples call: a block that defines one of them is what they test.
    names: Vec<String>,
}

impl Examples {
    /// The examples `task` states, when it has lines that start with `>>> ` or `assert `.
    pub fn from_task(task: &str) -> Option<Self> {
        let mut names = Vec::new();
        for line in task.lines().map(str::trim_start) {
            let Some(code) = line
                .strip_prefix(">>> ")
                .or_else(|| line.strip_prefix("assert "))
                .or_else(|| prose_call(line))
            else {
                continue;
            };
            for name in called(code) {
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
        (!names.is_empty()).then(|| Self {
            task: task.to_owned(),
            names,
        })
    }

    /// Whether `code` defines (`def` or `class`) a name the examples call.
    pub fn tested_by(&self, code: &str) -> bool {
        code.lines().map(str::trim_start).any(|line| {
            let rest = line
                .strip_prefix("def ")
                .or_else(|| line.strip_prefix("async def "))
                .or_else(|| line.strip_prefix("class "));
            rest.is_some_and(|rest| {
                let name: String = rest.chars().take_while(|c| is_ident(*c)).collect();
                self.names.contains(&name)
            })
        })
    }

    /// A Python program that loads `code` (not as `__main__`, with its output set aside),
    /// runs the examples against it, and prints one JSON line of what held.
    pub fn program(&self, code: &str) -> String {
        let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned());
        format!(
            "TASK = {}\nCODE = {}\nMOST = {MOST}\n{RUNNER}",
            quote(&self.task),
            quote(code)
        )
    }

    /// How many examples held, of how many, by the runner's output; `None` when they could
    /// not be run against the code.
    pub fn held(stdout: &str) -> Option<(usize, usize)> {
        let ran = Ran::of(stdout)?;
        // The verdict line is output the code can shape: a forged count is bounded by the
        // total.
        Some((ran.total.saturating_sub(ran.failed.len()), ran.total))
    }

    /// The note for the model from the runner's output; `None` when the examples could not
    /// be run at all (the code would not load apart from its own run), which is not the
    /// model's to fix.
    pub fn note(stdout: &str) -> Option<String> {
        let ran = Ran::of(stdout)?;
        if ran.failed.is_empty() {
            return Some(format!("{HELD_MARK}: {} of {}.", ran.total, ran.total));
        }
        let mut note = format!(
            "{FAILED_MARK} ({} of {} hold):",
            ran.total.saturating_sub(ran.failed.len()),
            ran.total
        );
        // The verdict line is the block's own output too, so its length is bounded here.
        for f in ran.failed.iter().take(MOST) {
            note.push_str(&format!(
                "\n- `{}`: expected {}, got {}",
                cut(&f.example),
                shown(&f.expected),
                shown(&f.got)
            ));
        }
        Some(note)
    }
}

#[derive(Deserialize)]
struct Ran {
    total: usize,
    #[serde(default)]
    failed: Vec<Failed>,
    #[serde(default)]
    error: Option<String>,
}

impl Ran {
    /// The runner's verdict, its last line of JSON; `None` when the examples could not be run
    /// against the code.
    fn of(stdout: &str) -> Option<Self> {
        let line = stdout.lines().rev().find(|l| l.starts_with('{'))?;
        let ran: Self = serde_json::from_str(line).ok()?;
        (ran.error.is_none() && ran.total > 0).then_some(ran)
    }
}

#[derive(Deserialize)]
struct Failed {
    example: String,
    expected: String,
    got: String,
}

/// Words that tell a call's result in prose: `f(2) == 4`, `f(2) -> 4`, `f(2) ==> 4`.
const SAID_RESULT: &[&str] = &["==>", "==", "->", "=>", "\u{279e}", "should return"];

/// The part of a prose line before a word that tells a call's result, when the line is not
/// a definition (`def f(x) -> int:` states a type, not an example).
fn prose_call(line: &str) -> Option<&str> {
    if line.starts_with("def ") || line.starts_with("async def ") {
        return None;
    }
    let at = SAID_RESULT.iter().filter_map(|w| line.find(w)).min()?;
    let before = &line[..at];
    before.contains('(').then_some(before)
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Identifiers directly followed by `(` in `code`, outside string literals, that are not
/// attribute names (`x.append(`).
fn called(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut word = String::new();
    let mut quote: Option<char> = None;
    let mut after_dot = false;
    for c in code.chars() {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            continue;
        }
        if is_ident(c) {
            word.push(c);
            continue;
        }
        if c == '(' && !word.is_empty() && !after_dot && !word.starts_with(|c: char| c.is_numeric())
        {
            names.push(std::mem::take(&mut word));
        }
        after_dot = c == '.';
        word.clear();
        if c == '"' || c == '\'' {
            quote = Some(c);
        }
    }
    names
}

fn cut(text: &str) -> String {
    let text = text.trim();
    if text.chars().count() <= SHOWN {
        return text.to_owned();
    }
    let head: String = text.chars().take(SHOWN).collect();
    format!("{head}...")
}

fn shown(text: &str) -> String {
    let text = cut(text);
    if text.is_empty() {
        "nothing".to_owned()
    } else if text.contains('\n') {
        format!("\n  ```\n  {}\n  ```", text.replace('\n', "\n  "))
    } else {
        format!("`{text}`")
    }
}

/// Runs after `TASK`, `CODE` and `MOST` are set. Each example is bounded by an alarm, so
/// one that loops costs seconds, not the block's whole limit. The workspace is off `sys.path`
/// while the runner imports what it needs and then back last, so a module the task left
/// (`json.py`) never stands in for one the interpreter has; the path is as it was after.
const RUNNER: &str = r#"
def _workspace_last():
    # posix is built in: nothing is imported from the workspace before it is off the path.
    import posix, sys

    here, was = posix.getcwd(), list(sys.path)

    def inside(path, root):
        return path == root or path.startswith(root.rstrip("/") + "/")

    sys.path[:] = [p for p in sys.path if p.startswith("/") and not inside(p, here)]
    import os

    real = os.path.realpath(here)
    sys.path[:] = [p for p in sys.path if not inside(os.path.realpath(p), real)]
    return here, was

_HERE, _WAS = _workspace_last()
import ast, contextlib, doctest, io, json, math, re, signal, sys
sys.path.append(_HERE)

_SAID = re.compile(r"\s*(==>|==|->|=>|\u279e|should return)\s*")

def _literal(text):
    try:
        return True, ast.literal_eval(text)
    except Exception:
        return False, None

def _call(left):
    # The longest tail of `left` that is a call of a name on literal arguments.
    for i in range(len(left)):
        if not (left[i].isalpha() or left[i] == "_") or (i and (left[i - 1].isalnum() or left[i - 1] in "_.")):
            continue
        text = left[i:].strip()
        try:
            node = ast.parse(text, mode="eval").body
        except SyntaxError:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and all(
            _literal(ast.unparse(a))[0] for a in node.args
        ) and all(_literal(ast.unparse(k.value))[0] for k in node.keywords):
            return text
    return None

def _want(right):
    # The longest head of `right` that is a literal.
    right = right.strip()
    cuts = [len(right)] + [j for j in range(len(right) - 1, 0, -1) if right[j] in " ,.;"]
    for j in cuts:
        head = right[:j].rstrip(" ,.;")
        # `f(1) == 1 + 9 = 10` works the result out: its head is not the result.
        rest = right[len(head):].lstrip()
        if head and _literal(head)[0] and not rest[:1] in tuple("+-*/=<>%"):
            return head
    return None

def _prose(line):
    s = line.strip().replace("`", "")
    if len(s) > 400 or s.startswith(("def ", "async def ", ">>>", "...", "assert ")):
        return None
    for m in _SAID.finditer(s):
        call = _call(s[: m.start()])
        want = _want(s[m.end():]) if call else None
        if call and want is not None:
            return call, want
    return None

def _examples(text):
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        line = lines[i]
        body = line.lstrip()
        indent = len(line) - len(body)
        if body.startswith(">>> "):
            source = [body[4:]]
            i += 1
            while i < len(lines) and lines[i].lstrip().startswith("... "):
                source.append(lines[i].lstrip()[4:])
                i += 1
            want = []
            while i < len(lines):
                w = lines[i]
                s = w.strip()
                if not s or s.startswith(">>>") or s.startswith("```") or s in ('"""', "'''"):
                    break
                want.append(w[indent:] if w[:indent].strip() == "" else s)
                i += 1
            found.append(("doctest", "\n".join(source), "\n".join(want)))
            continue
        if body.startswith("assert "):
            found.append(("assert", body, ""))
        else:
            said = _prose(body)
            if said:
                found.append(("said", said[0], said[1]))
        i += 1
    return found[:MOST]

def _alarm(*_):
    raise TimeoutError("the example ran longer than 5 s")

def _run(source, mode, ns):
    out = io.StringIO()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(5)
    try:
        with contextlib.redirect_stdout(out):
            value = eval(compile(source, "<example>", mode), ns)
        return value, out.getvalue(), None
    except BaseException as e:
        return None, out.getvalue(), e
    finally:
        signal.alarm(0)

def _same(got, want):
    if got == want:
        return True
    if isinstance(got, float) and isinstance(want, (int, float)) and not isinstance(want, bool):
        return math.isclose(got, want, rel_tol=1e-6)
    return False

def _defined(source, ns):
    # An example that calls a name the code does not define cannot test it.
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name not in ns and not hasattr(__builtins__, name):
                return False
    return True

def _raised(e):
    return "%s: %s" % (type(e).__name__, e)

def main():
    result = {"total": 0, "failed": [], "error": None}
    ns = {"__name__": "__tandem_examples__", "__builtins__": __builtins__}
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            exec(compile(CODE, "<your code>", "exec"), ns)
    except BaseException as e:
        result["error"] = _raised(e)
        print(json.dumps(result))
        return
    checker = doctest.OutputChecker()
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    for kind, source, want in _examples(TASK):
        if not _defined(source, ns):
            continue
        result["total"] += 1
        if kind == "doctest":
            _, got, e = _run(source + "\n", "single", ns)
            if e is not None:
                last = want.strip().splitlines()[-1:] if want.strip() else []
                if want.startswith("Traceback") and last and last[0].startswith(type(e).__name__):
                    continue
                got += "raised " + _raised(e)
            elif checker.check_output(want + "\n", got, flags):
                continue
            else:
                # The same value written another way (`"a"` for `'a'`, `[1,2]`), or a
                # comparison stated with nothing under it, which says it is true.
                ok, want_value = _literal(want.strip()) if want.strip() else (True, True)
                value, _, e2 = _run(source, "eval", ns) if ok else (None, "", True)
                if ok and e2 is None and _same(value, want_value):
                    continue
            result["failed"].append({"example": source, "expected": want.strip() or "True", "got": got.strip()})
            continue
        if kind == "said":
            got, _, e = _run(source, "eval", ns)
            want_value = ast.literal_eval(want)
            if e is None and _same(got, want_value):
                continue
            result["failed"].append({
                "example": source,
                "expected": repr(want_value),
                "got": "raised " + _raised(e) if e else repr(got),
            })
            continue
        try:
            test = ast.parse(source).body[0].test
        except Exception:
            result["total"] -= 1
            continue
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left = ast.unparse(test.left)
            got, _, e1 = _run(left, "eval", ns)
            want_value, _, e2 = _run(ast.unparse(test.comparators[0]), "eval", ns)
            if e1 is None and e2 is None and got == want_value:
                continue
            result["failed"].append({
                "example": left,
                "expected": _raised(e2) if e2 else repr(want_value),
                "got": "raised " + _raised(e1) if e1 else repr(got),
            })
            continue
        value, _, e = _run(ast.unparse(test), "eval", ns)
        if e is None and value:
            continue
        result["failed"].append({
            "example": source,
            "expected": "true",
            "got": "raised " + _raised(e) if e else "false",
        })
    print(json.dumps(result))

try:
    main()
finally:
    # A kept interpreter runs the task's next blocks with this path.
    sys.path[:] = _WAS
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_states_examples_by_doctest_or_assert_lines() {
        let task = "Write `add(a, b)`.\n    >>> add(2, 3)\n    5\n    >>> [x.upper() for x in words('a b')]\n    ['A', 'B']\nassert add(1, 1) == 2\n";
        let ex = Examples::from_task(task).expect("examples");
        assert_eq!(ex.names, ["add", "words"]);
        assert!(ex.tested_by("import math\n\ndef add(a, b):\n    return a + b\n"));
        assert!(ex.tested_by("class words:\n    pass\n"));
        assert!(!ex.tested_by("def addition(a, b):\n    return a + b\n"));
        assert!(!ex.tested_by("print(add(2, 3))\n"));
        assert!(Examples::from_task("Print the 10th prime.").is_none());
        // Results said in prose count; a signature's return type does not.
        let prose =
            Examples::from_task("e.g. `to_roman(1994)` -> 'MCMXCIV'\nfix(\"a b\") == \"a_b\"")
                .expect("examples");
        assert_eq!(prose.names, ["to_roman", "fix"]);
        assert!(Examples::from_task("def f(x) -> int:\n    pass").is_none());
        // A call inside a string and a method call are not names to define.
        assert_eq!(called("f('g(x)', y.h(1)) + int(z)"), ["f", "int"]);
    }

    #[test]
    fn the_note_says_expected_against_got() {
        let out = r#"{"total": 3, "failed": [{"example": "add(2, 3)", "expected": "5", "got": "6"}], "error": null}"#;
        let note = Examples::note(&format!("noise\n{out}\n")).expect("a note");
        assert!(
            note.contains("do not all hold against your code (2 of 3 hold)"),
            "{note}"
        );
        assert!(
            note.contains("`add(2, 3)`: expected `5`, got `6`"),
            "{note}"
        );
        let held = Examples::note(r#"{"total": 2, "failed": []}"#).expect("a note");
        assert!(!held.contains(FAILED_MARK), "{held}");
        assert!(Examples::note(r#"{"total": 2, "failed": [], "error": "NameError: x"}"#).is_none());
        assert!(Examples::note("not json").is_none());
        // The note ends the report it was added to.
        let report = format!("exitcode: 0 (execution succeeded)\nYour code printed: \n{held}");
        assert_eq!(
            note_in(&report).map(|at| &report[at..]),
            Some(held.as_str())
        );
        assert_eq!(
            note_in("exitcode: 0 (execution succeeded)\nYour code printed: 1\n"),
            None
        );
    }
}
