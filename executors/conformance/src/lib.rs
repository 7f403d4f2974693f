//! The behaviour every Tandem executor must share, as cases that can be run against any
//! executor, built-in or plugin: `tandem executor test NAME` runs them, and so do Tandem's
//! own tests for each built-in executor.
//!
//! A case passes, fails with what it saw, or does not apply (with why: a case that needs sh
//! does not apply to an executor that runs no sh). Nothing here panics on what an executor
//! does, and every case is bounded in time.
#![deny(missing_docs)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tandem_executor::{
    CancellationToken, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, ExitStatus,
    Language, Limits, Session, SessionSpec, Stream,
};

/// How one case ended.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "result", content = "why", rename_all = "snake_case")]
pub enum Verdict {
    /// The executor behaves as every executor must.
    Pass,
    /// It does not; what was seen.
    Fail(String),
    /// The case cannot apply to this executor; why.
    NotApplicable(String),
}

/// One case's result.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    /// The case's name.
    pub case: &'static str,
    /// What it checks.
    pub about: &'static str,
    /// How it ended.
    #[serde(flatten)]
    pub verdict: Verdict,
    /// How long it took.
    pub seconds: f64,
}

/// Why a case stopped before passing.
enum Stop {
    Fail(String),
    NotApplicable(String),
}

type Checked = Result<(), Stop>;

macro_rules! check {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(Stop::Fail(format!($($fmt)+)));
        }
    };
}

/// A case: its name, what it checks, the languages it needs, and its body.
pub struct Case {
    /// Its name, as `--case` takes it.
    pub name: &'static str,
    /// What it checks, in one line.
    pub about: &'static str,
    /// Languages it runs; it does not apply to an executor that lacks one.
    pub needs: &'static [&'static str],
    run: fn(Arc<dyn Executor>) -> BoxFuture<'static, Checked>,
}

macro_rules! case {
    ($name:ident, $needs:expr, $about:literal) => {
        Case {
            name: stringify!($name),
            about: $about,
            needs: $needs,
            run: |e| Box::pin($name(e)),
        }
    };
}

/// Every case, in the order they run.
pub fn cases() -> Vec<Case> {
    vec![
        case!(
            exit_codes_and_streams,
            &["python", "sh"],
            "exit codes, and stdout apart from stderr"
        ),
        case!(
            files_persist_but_variables_do_not,
            &["python", "sh"],
            "one session is one workspace; each block is a new process"
        ),
        case!(
            filename_directive,
            &["python", "sh"],
            "`# filename:` saves and runs the file; paths out of the workspace are refused"
        ),
        case!(
            environment_is_isolated,
            &["sh"],
            "none of Tandem's environment reaches code"
        ),
        case!(
            stdin_is_closed,
            &["python"],
            "code that reads stdin sees EOF at once"
        ),
        case!(
            signals_are_as_in_a_fresh_process,
            &["sh"],
            "SIGXFSZ and SIGPIPE act as in a fresh process"
        ),
        case!(
            timeout_kills_the_whole_tree,
            &["sh"],
            "a timeout kills children and detached grandchildren and keeps earlier output"
        ),
        // It forks, which needs real processes: an executor with sh has them.
        case!(
            python_daemons_do_not_outlive_their_block,
            &["python", "sh"],
            "a double-forked python daemon dies with its block"
        ),
        case!(
            published_servers_keep_serving,
            &["python"],
            "a server a block leaves listening serves later blocks and Session::ports until the session closes"
        ),
        case!(
            cancel_stops_a_block_at_once,
            &["python"],
            "cancelling stops a busy loop at once"
        ),
        case!(
            big_output_is_capped_without_deadlock,
            &["python"],
            "40 MB of output: no deadlock, head and tail kept, live output is the head"
        ),
        case!(
            invalid_utf8_is_decoded_lossily,
            &["python"],
            "bytes that are not UTF-8 become U+FFFD"
        ),
        case!(
            unsupported_language_is_an_error,
            &[],
            "a language the executor lacks is an error naming what it runs"
        ),
        case!(
            concurrent_sessions,
            &["sh"],
            "twenty sessions at once, each with its own workspace"
        ),
    ]
}

/// How long one case may take before it fails.
const CASE_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs the cases whose name contains `filter` (all when `None`) against `executor`, one at
/// a time.
pub async fn run(executor: Arc<dyn Executor>, filter: Option<&str>) -> Vec<Report> {
    let mut reports = Vec::new();
    for case in cases() {
        if filter.is_some_and(|f| !case.name.contains(f)) {
            continue;
        }
        let started = Instant::now();
        let missing: Vec<&str> = case
            .needs
            .iter()
            .copied()
            .filter(|l| !executor.supports(&Language::new(l)))
            .collect();
        let verdict = if missing.is_empty() {
            // Its own task, so that even a panicking executor fails the case, not the run.
            let body = tokio::spawn((case.run)(executor.clone()));
            match tokio::time::timeout(CASE_TIMEOUT, body).await {
                Ok(Ok(Ok(()))) => Verdict::Pass,
                Ok(Ok(Err(Stop::Fail(why)))) => Verdict::Fail(why),
                Ok(Ok(Err(Stop::NotApplicable(why)))) => Verdict::NotApplicable(why),
                Ok(Err(e)) => Verdict::Fail(format!("the executor panicked: {e}")),
                Err(_) => Verdict::Fail(format!(
                    "did not finish within {} s",
                    CASE_TIMEOUT.as_secs()
                )),
            }
        } else {
            Verdict::NotApplicable(format!(
                "needs {}, which `{}` does not run",
                missing.join(" and "),
                executor.name()
            ))
        };
        reports.push(Report {
            case: case.name,
            about: case.about,
            verdict,
            seconds: started.elapsed().as_secs_f64(),
        });
    }
    reports
}

async fn open(executor: &dyn Executor, limits: Limits) -> Result<Box<dyn Session>, Stop> {
    executor
        .open(SessionSpec {
            limits,
            ..Default::default()
        })
        .await
        .map_err(|e| Stop::Fail(format!("opening a session failed: {e}")))
}

fn wall(secs: u64) -> Limits {
    Limits {
        wall: Duration::from_secs(secs),
        ..Limits::default()
    }
}

async fn run_in(session: &mut dyn Session, lang: &str, code: &str) -> Result<ExecOutcome, Stop> {
    session
        .run(
            ExecRequest::new(Language::new(lang), code),
            ExecContext::new(CancellationToken::new()),
        )
        .await
        .map_err(|e| Stop::Fail(format!("running a {lang} block failed: {e}\n{code}")))
}

async fn close(session: Box<dyn Session>) -> Checked {
    session
        .close()
        .await
        .map_err(|e| Stop::Fail(format!("closing the session failed: {e}")))
}

/// The command lines of this machine's processes that contain `marker`.
fn processes_matching(marker: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(marker))
        .collect()
}

fn no_process_matches(marker: &str) -> Checked {
    let left = processes_matching(marker);
    check!(left.is_empty(), "processes survived their block: {left:?}");
    Ok(())
}

async fn exit_codes_and_streams(executor: Arc<dyn Executor>) -> Checked {
    let mut s = open(&*executor, Limits::default()).await?;
    let out = run_in(
        &mut *s,
        "python",
        "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)",
    )
    .await?;
    let seen = (out.status, out.stdout.to_text(), out.stderr.to_text());
    check!(
        seen == (ExitStatus::Exited(3), "out\n".into(), "err\n".into()),
        "python `sys.exit(3)` after one line on each stream gave {seen:?}"
    );
    let out = run_in(&mut *s, "sh", "echo shell; echo oops >&2; exit 7").await?;
    let seen = (out.status, out.stdout.to_text(), out.stderr.to_text());
    check!(
        seen == (ExitStatus::Exited(7), "shell\n".into(), "oops\n".into()),
        "sh `exit 7` after one line on each stream gave {seen:?}"
    );
    let out = run_in(&mut *s, "python", "def f(:\n  pass").await?;
    check!(
        out.status == ExitStatus::Exited(1) && out.stderr.to_text().contains("SyntaxError"),
        "a python syntax error gave {:?} and stderr {:?}",
        out.status,
        out.stderr.to_text()
    );
    close(s).await
}

async fn files_persist_but_variables_do_not(executor: Arc<dyn Executor>) -> Checked {
    let mut s = open(&*executor, Limits::default()).await?;
    let ws = s.workspace().map(ToOwned::to_owned);
    let out = run_in(
        &mut *s,
        "python",
        "x = 1\nopen('note.txt', 'w').write('kept')",
    )
    .await?;
    check!(
        out.status == ExitStatus::Exited(0),
        "writing a file gave {:?}: {}",
        out.status,
        out.stderr.to_text()
    );
    let out = run_in(&mut *s, "sh", "cat note.txt").await?;
    check!(
        out.stdout.to_text() == "kept",
        "a file written by one block reads {:?} in the next",
        out.stdout.to_text()
    );
    let out = run_in(&mut *s, "python", "print(x)").await?;
    check!(
        out.status == ExitStatus::Exited(1) && out.stderr.to_text().contains("NameError"),
        "a variable of an earlier block is still defined: {:?} {:?}",
        out.status,
        out.stdout.to_text()
    );
    close(s).await?;
    if let Some(ws) = ws {
        check!(
            !ws.exists(),
            "a temporary workspace outlived its session: {}",
            ws.display()
        );
    }
    Ok(())
}

async fn filename_directive(executor: Arc<dyn Executor>) -> Checked {
    let mut s = open(&*executor, Limits::default()).await?;
    let out = run_in(
        &mut *s,
        "python",
        "# filename: pkg/mod.py\nprint(__file__.endswith('pkg/mod.py'))",
    )
    .await?;
    check!(
        out.stdout.to_text() == "True\n",
        "a block saved as pkg/mod.py did not run as that file: {:?} {:?}",
        out.stdout.to_text(),
        out.stderr.to_text()
    );
    let out = run_in(&mut *s, "sh", "cat pkg/mod.py | head -1").await?;
    check!(
        out.stdout.to_text() == "# filename: pkg/mod.py\n",
        "pkg/mod.py holds {:?}",
        out.stdout.to_text()
    );
    for bad in ["../up.py", "/etc/evil.py", "a/../../up.py"] {
        let out = run_in(&mut *s, "python", &format!("# filename: {bad}\nprint(1)")).await?;
        check!(
            out.status == ExitStatus::Exited(1)
                && out.stdout.to_text().is_empty()
                && out
                    .stderr
                    .to_text()
                    .contains("must stay inside the workspace"),
            "`# filename: {bad}` was not refused: {:?} {:?} {:?}",
            out.status,
            out.stdout.to_text(),
            out.stderr.to_text()
        );
    }
    let out = run_in(&mut *s, "python", "# just a comment\nprint('ran')").await?;
    check!(
        out.stdout.to_text() == "ran\n",
        "a first-line comment that is not a directive changed the block: {:?}",
        out.stdout.to_text()
    );
    run_in(
        &mut *s,
        "python",
        "# filename: helper.py\ndef double(x):\n    return 2 * x",
    )
    .await?;
    let out = run_in(
        &mut *s,
        "python",
        "from helper import double\nprint(double(21))",
    )
    .await?;
    check!(
        out.stdout.to_text() == "42\n",
        "a saved module does not import from a later block: {}",
        out.stderr.to_text()
    );
    if let Some(ws) = s.workspace() {
        let mut names: Vec<String> = std::fs::read_dir(ws)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        check!(
            names == ["helper.py", "pkg"],
            "unnamed blocks left files in the workspace: {names:?}"
        );
    }
    close(s).await
}

/// Variables a block may have that do not come from Tandem's environment: the shell's, the
/// locale, and the two that executors set for python blocks themselves.
const COMMON: &[&str] = &[
    "PATH",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "HOME",
    "USER",
    "LOGNAME",
    "TMPDIR",
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
    "TERM",
    "HOSTNAME",
    "SHELL",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
];

async fn environment_is_isolated(executor: Arc<dyn Executor>) -> Checked {
    let ours: Vec<String> = std::env::vars()
        .map(|(k, _)| k)
        .filter(|k| !COMMON.contains(&k.as_str()) && !k.starts_with("TANDEM_"))
        .collect();
    if ours.is_empty() {
        return Err(Stop::NotApplicable(
            "Tandem's own environment holds only common variables, so nothing could leak"
                .to_owned(),
        ));
    }
    let mut s = open(&*executor, Limits::default()).await?;
    let out = run_in(&mut *s, "sh", "env | cut -d= -f1").await?;
    let text = out.stdout.to_text();
    let leaked: Vec<&str> = text
        .lines()
        .filter(|k| ours.iter().any(|o| o == k))
        .collect();
    check!(
        leaked.is_empty(),
        "Tandem's variables reached the block: {}",
        leaked.join(", ")
    );
    close(s).await
}

async fn stdin_is_closed(executor: Arc<dyn Executor>) -> Checked {
    let mut s = open(&*executor, wall(20)).await?;
    let started = Instant::now();
    let out = run_in(
        &mut *s,
        "python",
        "import sys\nprint(repr(sys.stdin.read()))",
    )
    .await?;
    check!(
        out.stdout.to_text() == "''\n" && started.elapsed() < Duration::from_secs(5),
        "reading stdin gave {:?} after {:?} ({:?})",
        out.stdout.to_text(),
        started.elapsed(),
        out.status
    );
    close(s).await
}

async fn signals_are_as_in_a_fresh_process(executor: Arc<dyn Executor>) -> Checked {
    let limits = Limits {
        file_size_bytes: Some(1 << 20),
        ..Limits::default()
    };
    let mut s = open(&*executor, limits).await?;
    let out = run_in(
        &mut *s,
        "sh",
        "head -c 2000000 /dev/zero > big; echo xfsz $?\n(yes; echo yes-ended $? >&2) | head -n 1 > /dev/null; echo pipe done",
    )
    .await?;
    let err = out.stderr.to_text();
    check!(
        out.stdout.to_text() == "xfsz 153\npipe done\n" && err.ends_with("\nyes-ended 141\n"),
        "a write past the file-size limit and a write into a closed pipe gave {:?} and stderr {err:?} (want `xfsz 153` and `yes-ended 141`)",
        out.stdout.to_text()
    );
    close(s).await
}

async fn timeout_kills_the_whole_tree(executor: Arc<dyn Executor>) -> Checked {
    // Unique per call: suites for several executors may run at once in one process.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let marker = format!("tandem-conformance-{}-{call}x", std::process::id());
    let mut s = open(&*executor, wall(1)).await?;
    let code = format!(
        "sleep 300 &\nsetsid sh -c 'sleep 300; : {marker}' > /dev/null 2>&1 &\nsetsid sh -c 'sleep 300; : {marker}-holds-stdout' &\necho started\nsleep 300"
    );
    let started = Instant::now();
    let out = run_in(&mut *s, "sh", &code).await?;
    let took = started.elapsed();
    check!(
        out.status == ExitStatus::TimedOut
            && out.stdout.to_text() == "started\n"
            && took < Duration::from_secs(2),
        "a 1 s timeout gave {:?} with stdout {:?} after {took:?}",
        out.status,
        out.stdout.to_text()
    );
    no_process_matches(&marker)?;
    let out = run_in(&mut *s, "sh", "echo still usable").await?;
    check!(
        out.stdout.to_text() == "still usable\n",
        "the session after a timeout gave {:?}",
        out.stdout.to_text()
    );
    let out = run_in(
        &mut *s,
        "sh",
        &format!("setsid sh -c 'sleep 300; : {marker}-bg' > /dev/null 2>&1 &\necho done"),
    )
    .await?;
    check!(
        out.status == ExitStatus::Exited(0),
        "a block that starts a detached process gave {:?}",
        out.status
    );
    no_process_matches(&marker)?;
    close(s).await
}

async fn python_daemons_do_not_outlive_their_block(executor: Arc<dyn Executor>) -> Checked {
    let mut s = open(&*executor, wall(1)).await?;
    for (beat, tail, status) in [
        ("ended", "", ExitStatus::Exited(0)),
        ("timed-out", "time.sleep(300)\n", ExitStatus::TimedOut),
    ] {
        let code = format!(
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True:\n            with open('{beat}', 'a') as f:\n                f.write('.')\n            time.sleep(0.02)\n    os._exit(0)\nwhile not os.path.exists('{beat}'):\n    time.sleep(0.01)\nprint('daemon running')\n{tail}"
        );
        let out = run_in(&mut *s, "python", &code).await?;
        check!(
            (out.status, out.stdout.to_text()) == (status, "daemon running\n".to_owned()),
            "the {beat} block gave {:?} {:?}: {}",
            out.status,
            out.stdout.to_text(),
            out.stderr.to_text()
        );
        // Watched from inside the sandbox, by the next block: a workspace the host sees
        // only as a copy made after each block would show no heartbeat either way.
        let watch = format!(
            "import os, time\na = os.path.getsize('{beat}')\ntime.sleep(0.3)\nprint(os.path.getsize('{beat}') - a)"
        );
        let grew = run_in(&mut *s, "python", &watch).await?;
        check!(
            grew.stdout.to_text() == "0\n",
            "a daemon of the {beat} block is still writing: the file grew by {:?} bytes ({})",
            grew.stdout.to_text(),
            grew.stderr.to_text()
        );
    }
    close(s).await
}

/// An echo server on a port of its own choosing, which it writes to `port.txt`.
const ECHO_SERVER: &str = "import os, socket, threading\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('127.0.0.1', 0))\ns.listen(16)\nwith open('port.tmp', 'w') as f:\n    f.write(str(s.getsockname()[1]))\nos.rename('port.tmp', 'port.txt')\ndef echo(c):\n    while True:\n        d = c.recv(65536)\n        if not d:\n            break\n        c.sendall(d)\n    c.close()\nwhile True:\n    c, _ = s.accept()\n    threading.Thread(target=echo, args=(c,), daemon=True).start()\n";

async fn published_servers_keep_serving(executor: Arc<dyn Executor>) -> Checked {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut s = open(&*executor, wall(30)).await?;
    let Some(ports) = s.ports() else {
        close(s).await?;
        return Err(Stop::NotApplicable(format!(
            "{}'s sessions give no way in to their ports (Session::ports)",
            executor.name()
        )));
    };
    // Started in the background, writing to the block's own stdout: the server must outlive
    // its block, and its writes must not fail once the block's output is taken.
    let start = format!(
        "import os, subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {ECHO_SERVER:?}])\nwhile not os.path.exists('port.txt'):\n    time.sleep(0.01)\nprint(open('port.txt').read())"
    );
    let out = run_in(&mut *s, "python", &start).await?;
    let port: u16 = out.stdout.to_text().trim().parse().map_err(|_| {
        Stop::Fail(format!(
            "the server's block printed no port: {:?} {}",
            out.stdout.to_text(),
            out.stderr.to_text()
        ))
    })?;
    let again = format!(
        "import socket\nc = socket.create_connection(('127.0.0.1', {port}), timeout=10)\nc.sendall(b'from a later block')\nprint(c.recv(100).decode())"
    );
    let out = run_in(&mut *s, "python", &again).await?;
    check!(
        out.stdout.to_text() == "from a later block\n",
        "the server did not answer the next block: {:?} {}",
        out.stdout.to_text(),
        out.stderr.to_text()
    );
    let mut conn = ports
        .dial(port)
        .await
        .map_err(|e| Stop::Fail(format!("dialling the server's port failed: {e}")))?;
    let said = b"through Session::ports";
    let mut heard = vec![0u8; said.len()];
    let echoed = tokio::time::timeout(Duration::from_secs(30), async {
        conn.write_all(said).await?;
        conn.flush().await?;
        conn.read_exact(&mut heard).await
    })
    .await;
    check!(
        matches!(echoed, Ok(Ok(_))) && heard == said,
        "the port did not echo: {echoed:?} {:?}",
        String::from_utf8_lossy(&heard)
    );
    // A block's end spares the relay that carries an open connection: it still echoes.
    run_in(&mut *s, "python", "print('between')").await?;
    let echoed = tokio::time::timeout(Duration::from_secs(30), async {
        conn.write_all(said).await?;
        conn.flush().await?;
        conn.read_exact(&mut heard).await
    })
    .await;
    check!(
        matches!(echoed, Ok(Ok(_))) && heard == said,
        "a connection open across a block's end stopped: {echoed:?}"
    );
    drop(conn);
    let closed_port = if port == 1 { 2 } else { port - 1 };
    let refused = ports.dial(closed_port).await;
    check!(
        matches!(refused, Err(ExecError::PortClosed { port: p, .. }) if p == closed_port),
        "a port nothing listens on gave {:?}",
        refused.map(|_| "a connection")
    );
    close(s).await?;
    let after = ports.dial(port).await;
    check!(
        after.is_err(),
        "the server's port still answers after its session closed"
    );
    Ok(())
}

async fn cancel_stops_a_block_at_once(executor: Arc<dyn Executor>) -> Checked {
    let mut s = open(&*executor, Limits::default()).await?;
    let cancel = CancellationToken::new();
    // Cancel once the block is seen running (its first line arrives), not after a fixed delay:
    // on a loaded machine an interpreter can take longer than any fixed delay to start.
    let cancelled_at = Arc::new(Mutex::new(None::<Instant>));
    let (trigger, at) = (cancel.clone(), cancelled_at.clone());
    // The whole line, not its first piece: an unbuffered interpreter writes `going` and its
    // newline apart, and a cancel between the two would cut the line.
    let ctx = ExecContext::new(cancel.clone()).with_sink(Arc::new(move |stream, bytes| {
        if stream == Stream::Stdout && bytes.contains(&b'\n') && !trigger.is_cancelled() {
            if let Ok(mut at) = at.lock() {
                *at = Some(Instant::now());
            }
            trigger.cancel();
        }
    }));
    // Should the first line never come, the block is still cancelled, late, and fails below.
    let late = cancel.clone();
    let backstop = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(60)).await;
        late.cancel();
    });
    // A busy loop: a sandbox must stop code that never waits on anything.
    let out = s
        .run(
            ExecRequest::new(
                Language::python(),
                "print('going', flush=True)\nwhile True:\n    pass",
            ),
            ctx,
        )
        .await
        .map_err(|e| Stop::Fail(format!("the cancelled block failed: {e}")))?;
    backstop.abort();
    let after = cancelled_at
        .lock()
        .ok()
        .and_then(|at| *at)
        .map(|at| at.elapsed());
    check!(
        out.status == ExitStatus::Cancelled
            && out.stdout.to_text() == "going\n"
            && after.is_some_and(|after| after < Duration::from_secs(5)),
        "cancelling once the block printed gave {:?} with stdout {:?}, {:?} after the cancel",
        out.status,
        out.stdout.to_text(),
        after
    );
    close(s).await
}

async fn big_output_is_capped_without_deadlock(executor: Arc<dyn Executor>) -> Checked {
    let cap = 64 << 10;
    let mut s = open(
        &*executor,
        Limits {
            output_bytes: cap,
            ..Limits::default()
        },
    )
    .await?;
    let live = Arc::new(Mutex::new((0usize, 0usize)));
    let seen = live.clone();
    let ctx =
        ExecContext::new(CancellationToken::new()).with_sink(Arc::new(move |stream, bytes| {
            if let Ok(mut l) = seen.lock() {
                match stream {
                    Stream::Stdout => l.0 += bytes.len(),
                    Stream::Stderr => l.1 += bytes.len(),
                }
            }
        }));
    let code = "import sys\nfor i in range(200):\n    sys.stdout.write('o' * 100_000)\n    sys.stderr.write('e' * 100_000)\nprint('\\nLAST')";
    let out = s
        .run(ExecRequest::new(Language::python(), code), ctx)
        .await
        .map_err(|e| Stop::Fail(format!("the block failed: {e}")))?;
    check!(
        out.status == ExitStatus::Exited(0),
        "the block gave {:?}",
        out.status
    );
    check!(
        (out.stdout.total(), out.stderr.total()) == (20_000_006, 20_000_000),
        "the totals are {} and {} bytes, not 20000006 and 20000000",
        out.stdout.total(),
        out.stderr.total()
    );
    let text = out.stdout.to_text();
    check!(
        out.stdout.truncated()
            && out.stderr.truncated()
            && text.ends_with("\nLAST\n")
            && text.contains(&format!("[... {} bytes truncated ...]", 20_000_006 - cap)),
        "the kept output is not the head and the tail of {cap} bytes: {} bytes kept, ends {:?}",
        text.len(),
        &text[text.floor_char_boundary(text.len().saturating_sub(20))..]
    );
    let live = live.lock().map(|l| *l).unwrap_or_default();
    check!(
        live == (cap / 2, cap / 2),
        "live output was {live:?} bytes, not the kept heads ({0}, {0})",
        cap / 2
    );
    close(s).await
}

async fn invalid_utf8_is_decoded_lossily(executor: Arc<dyn Executor>) -> Checked {
    let mut s = open(&*executor, Limits::default()).await?;
    let out = run_in(
        &mut *s,
        "python",
        "import sys\nsys.stdout.buffer.write(b'a\\xffb\\xc3\\n')",
    )
    .await?;
    check!(
        out.stdout.to_text() == "a\u{fffd}b\u{fffd}\n",
        "bytes ff and a cut c3 gave {:?}",
        out.stdout.to_text()
    );
    close(s).await
}

async fn unsupported_language_is_an_error(executor: Arc<dyn Executor>) -> Checked {
    let mut s = open(&*executor, Limits::default()).await?;
    let result = s
        .run(
            ExecRequest::new(Language::new("cobol"), "DISPLAY 'HI'."),
            ExecContext::new(CancellationToken::new()),
        )
        .await;
    let want = format!(
        "language `cobol` is not supported by the {} executor; supported: ",
        executor.name()
    );
    match result {
        Err(e @ ExecError::UnsupportedLanguage { .. }) => check!(
            e.to_string().starts_with(&want),
            "the error reads {e}, not {want}..."
        ),
        other => check!(
            false,
            "a cobol block gave {other:?}, not an unsupported-language error"
        ),
    }
    close(s).await
}

async fn concurrent_sessions(executor: Arc<dyn Executor>) -> Checked {
    let mut tasks = Vec::new();
    for i in 0..20 {
        let executor = executor.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = open(&*executor, Limits::default()).await?;
            let out = run_in(
                &mut *s,
                "sh",
                &format!("echo {i} > mine.txt; cat mine.txt; ls | wc -l"),
            )
            .await?;
            close(s).await?;
            Ok::<_, Stop>(out.stdout.to_text())
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let text = t
            .await
            .map_err(|e| Stop::Fail(format!("session {i} panicked: {e}")))??;
        check!(
            text.split_whitespace().collect::<Vec<_>>() == [i.to_string(), "1".to_owned()],
            "session {i} saw {text:?}: workspaces are shared or the file is lost"
        );
    }
    Ok(())
}
