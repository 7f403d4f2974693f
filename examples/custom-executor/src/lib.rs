//! A third-party Tandem executor: runs `perl` blocks as local processes.
//!
//! It depends on `tandem-executor` alone. Register it next to the built-in executors:
//!
//! ```no_run
//! use std::sync::Arc;
//! let mut registry = tandem_executor::Registry::new();
//! registry.register(Arc::new(tandem_example_custom_executor::PerlExecutor::new()));
//! ```
//!
//! It is deliberately small. Each block runs in a process group of its own, killed whole
//! when the block ends, times out or is cancelled, so a background child dies with it; each
//! stream is captured within `Limits::output_bytes`; a `# filename:` line writes the block
//! beneath the workspace without following links. It honours the wall-clock and output
//! limits only: the built-in executors also set memory, process and file limits before the
//! program starts, which `tandem-executor-kit`'s `process` module does for a plugin that
//! wants it.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tandem_executor::{
    BoxFuture, CancellationToken, CaptureBuffer, Captured, ExecContext, ExecError, ExecOutcome,
    ExecRequest, Executor, ExitStatus, Language, Limits, OutputSink, Session, SessionSpec, Stream,
};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};

/// Runs perl code blocks.
pub struct PerlExecutor {
    languages: Vec<Language>,
}

impl PerlExecutor {
    /// An executor that runs `perl` from PATH.
    pub fn new() -> Self {
        Self {
            languages: vec![Language::new("perl")],
        }
    }
}

impl Default for PerlExecutor {
    fn default() -> Self {
        Self::new()
    }
}

impl Executor for PerlExecutor {
    fn name(&self) -> &str {
        "perl"
    }

    fn languages(&self) -> &[Language] {
        &self.languages
    }

    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        Box::pin(async move {
            let (dir, temp) = match spec.workdir {
                Some(dir) => (dir, None),
                None => {
                    let temp = tempfile::Builder::new()
                        .prefix("tandem-perl-")
                        .tempdir()
                        .map_err(|e| ExecError::io("creating a workspace", e))?;
                    (temp.path().to_owned(), Some(temp))
                }
            };
            Ok(Box::new(PerlSession {
                dir,
                _temp: temp,
                limits: spec.limits,
            }) as Box<dyn Session>)
        })
    }
}

struct PerlSession {
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
    limits: Limits,
}

impl Session for PerlSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(async move {
            if req.language.as_str() != "perl" {
                return Err(ExecError::unsupported(
                    &req.language,
                    "perl",
                    &[Language::new("perl")],
                ));
            }
            let mut cmd = tokio::process::Command::new("perl");
            // A `# filename:` line keeps the block as that file; any other block is read
            // from stdin, so nothing is written where earlier blocks may have planted links.
            match tandem_executor::filename_directive(&req.code) {
                Some(name) => {
                    if let Err(e) = write_beneath(&self.dir, name, &req.code) {
                        return Ok(ExecOutcome::refused(&format!("`{name}`: {e}")));
                    }
                    cmd.arg("--").arg(name).stdin(Stdio::null());
                }
                None => {
                    cmd.arg("-").stdin(Stdio::piped());
                }
            }
            cmd.current_dir(&self.dir)
                .env_clear()
                .env("PATH", "/usr/local/bin:/usr/bin:/bin")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0)
                .kill_on_drop(true);
            let mut child = cmd.spawn().map_err(|e| ExecError::io("starting perl", e))?;
            let group = child.id();
            if let Some(mut stdin) = child.stdin.take() {
                // A program that exits without reading its stdin is not an error.
                let _ = stdin.write_all(req.code.as_bytes()).await;
            }
            let cap = self.limits.output_bytes;
            let stop = CancellationToken::new();
            let read = |r: Option<Box<dyn AsyncRead + Send + Unpin>>, s| {
                tokio::spawn(capture(r, s, cap, ctx.sink.clone(), stop.clone()))
            };
            let out = read(
                child.stdout.take().map(|r| Box::new(r) as _),
                Stream::Stdout,
            );
            let err = read(
                child.stderr.take().map(|r| Box::new(r) as _),
                Stream::Stderr,
            );
            let clock = Instant::now();
            let timeout = req.timeout.unwrap_or(self.limits.wall);
            let status = tokio::select! {
                status = child.wait() => match status {
                    Ok(s) => match (s.code(), std::os::unix::process::ExitStatusExt::signal(&s)) {
                        (Some(code), _) => ExitStatus::Exited(code),
                        (None, Some(signal)) => ExitStatus::Signaled(signal),
                        (None, None) => ExitStatus::Exited(-1),
                    },
                    Err(e) => return Err(ExecError::io("waiting for perl", e)),
                },
                () = tokio::time::sleep(timeout) => ExitStatus::TimedOut,
                () = ctx.cancel.cancelled() => ExitStatus::Cancelled,
            };
            let duration = clock.elapsed();
            // On every path the whole group goes, background children included: they would
            // otherwise hold the output pipes open and outlive the block.
            kill_group(group);
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
            // A process that left the group (`setsid`) may still hold a pipe: what it wrote
            // within a moment is kept, and the reading stops.
            let stopper = stop.clone();
            let grace = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                stopper.cancel();
            });
            let (out, err) = (out.await.unwrap_or_default(), err.await.unwrap_or_default());
            grace.abort();
            Ok(ExecOutcome {
                status,
                stdout: out,
                stderr: err,
                duration,
                resources: None,
            })
        })
    }

    fn workspace(&self) -> Option<&Path> {
        Some(&self.dir)
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        // Dropping the TempDir removes a workspace this session created.
        Box::pin(async move {
            drop(self);
            Ok(())
        })
    }
}

/// Writes `code` to `name` beneath `dir`: no `..`, no absolute path and no link on the way
/// resolve (the kernel's `RESOLVE_BENEATH` and `RESOLVE_NO_SYMLINKS`).
fn write_beneath(dir: &Path, name: &str, code: &str) -> std::io::Result<()> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let root = std::fs::File::open(dir)?;
    let fd = rustix::fs::openat2(
        &root,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::from_raw_mode(0o644),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?;
    let mut file = std::fs::File::from(fd);
    file.write_all(code.as_bytes())
}

/// Kills every process of the group `pgid` leads.
fn kill_group(pgid: Option<u32>) {
    let pid = pgid
        .and_then(|p| i32::try_from(p).ok())
        .and_then(rustix::process::Pid::from_raw);
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
}

/// Reads one stream to its end (or until `stop`), keeping what `cap` allows and passing the kept head to
/// `sink` as it arrives.
async fn capture(
    reader: Option<Box<dyn AsyncRead + Send + Unpin>>,
    stream: Stream,
    cap: usize,
    sink: OutputSink,
    stop: CancellationToken,
) -> Captured {
    let mut buf = CaptureBuffer::new(cap);
    let Some(mut reader) = reader else {
        return buf.finish();
    };
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let n = tokio::select! {
            n = reader.read(&mut chunk) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            () = stop.cancelled() => break,
        };
        let live = buf.push(&chunk[..n]);
        if live > 0 {
            sink(stream, &chunk[..live]);
        }
    }
    buf.finish()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tandem_agent::blocks::{RunOptions, SessionSlot, run_blocks};
    use tandem_agent::extract_code_blocks;
    use tandem_executor::{CancellationToken, Registry};
    use tandem_executor_local::{LocalConfig, LocalExecutor};

    use super::*;

    #[tokio::test]
    async fn registered_next_to_the_built_ins_and_run_by_the_executor_agent() {
        let mut registry = Registry::new();
        registry.register(Arc::new(LocalExecutor::new(LocalConfig::default())));
        registry.register(Arc::new(PerlExecutor::new()));
        assert_eq!(registry.names(), ["local", "perl"]);

        let perl = registry.get("perl").unwrap();
        let reply = "```perl\n# filename: greet.pl\nmy @x = map { $_ * 2 } (1..3);\nprint join(',', @x), \"\\n\";\n```\n```pl\nprint -e 'greet.pl' ? \"kept\\n\" : \"gone\\n\"; exit 4;\n```\n```python\nprint('not perl')\n```";
        let blocks = extract_code_blocks(reply);
        let mut slot = SessionSlot::new(perl, SessionSpec::default());
        let opts = RunOptions {
            turn: 1,
            timeout: None,
            cancel: CancellationToken::new(),
            events: Arc::new(|_| {}),
            approval: None,
            code_tools: None,
        };
        let runs = run_blocks(&mut slot, &blocks, &opts).await.unwrap();
        slot.close().await.unwrap();
        let got: Vec<(&str, Option<i32>, &str)> = runs
            .iter()
            .map(|r| {
                (
                    r.result.status.as_str(),
                    r.result.exit_code,
                    r.result.stdout.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("exited", Some(0), "2,4,6\n"),
                ("exited", Some(4), "kept\n"),
                ("not_run", None, "")
            ]
        );
    }

    /// Whether process `pid` is gone (or a zombie that only waits to be reaped).
    fn gone(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|s| s.trim_start().starts_with('Z'))
        })
    }

    #[tokio::test]
    async fn a_blocks_background_children_die_with_it_and_a_timeout_kills() {
        let exec = PerlExecutor::new();
        let mut session = exec.open(SessionSpec::default()).await.unwrap();
        // The block exits at once; its child would sleep a minute holding stdout open.
        let code = "my $pid = fork(); if ($pid == 0) { sleep 60; exit 0 } print \"$pid\\n\";";
        let started = std::time::Instant::now();
        let ctx = ExecContext::new(CancellationToken::new());
        let outcome = session
            .run(ExecRequest::new(Language::new("perl"), code), ctx.clone())
            .await
            .unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
        let child: u32 = outcome.stdout.to_text().trim().parse().unwrap();
        for _ in 0..50 {
            if gone(child) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(gone(child), "the block's child {child} outlived it");

        let mut req = ExecRequest::new(Language::new("perl"), "$| = 1; print \"a\\n\"; sleep 30;");
        req.timeout = Some(std::time::Duration::from_millis(500));
        let outcome = session.run(req, ctx).await.unwrap();
        assert_eq!(outcome.status, tandem_executor::ExitStatus::TimedOut);
        assert_eq!(outcome.stdout.to_text(), "a\n");
        session.close().await.unwrap();
    }

    /// The conformance kit (what `tandem executor test` runs): a perl-only executor passes
    /// the one case that applies to it, and every other case says why it does not apply.
    #[tokio::test(flavor = "multi_thread")]
    async fn passes_the_conformance_kit_where_it_applies() {
        let reports = tandem_executor_conformance::run(Arc::new(PerlExecutor::new()), None).await;
        for r in &reports {
            match (&r.verdict, r.case) {
                (
                    tandem_executor_conformance::Verdict::Pass,
                    "unsupported_language_is_an_error",
                ) => {}
                (tandem_executor_conformance::Verdict::NotApplicable(why), _) => {
                    assert!(
                        why.contains("which `perl` does not run"),
                        "{}: {why}",
                        r.case
                    )
                }
                (verdict, case) => panic!("{case}: {verdict:?}"),
            }
        }
    }
}
