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
//! It is deliberately small: the built-in local executor shows the full treatment
//! (rlimits, killing detached grandchildren, a scratch directory apart from the workspace).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

use tandem_executor::workspace::write_block_script;
use tandem_executor::{
    BoxFuture, CaptureBuffer, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor,
    ExitStatus, Language, Limits, Session, SessionSpec, Stream,
};
use tokio::io::{AsyncRead, AsyncReadExt};

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
                blocks: 0,
            }) as Box<dyn Session>)
        })
    }
}

struct PerlSession {
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
    limits: Limits,
    blocks: u32,
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
            self.blocks += 1;
            // Never a plain write: earlier blocks may have planted links in the workspace.
            let script = match write_block_script(&self.dir, &req.code, self.blocks, "pl") {
                Ok(script) => script.path,
                Err(e) => return Ok(ExecOutcome::refused(&e.to_string())),
            };
            let mut child = tokio::process::Command::new("perl")
                .arg(&script)
                .current_dir(&self.dir)
                .env_clear()
                .env("PATH", "/usr/local/bin:/usr/bin:/bin")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| ExecError::Unavailable {
                    what: "perl".into(),
                    hint: format!("{e}; install perl"),
                })?;
            let started = Instant::now();
            let cap = self.limits.output_bytes;
            let out = tokio::spawn(capture(
                child.stdout.take(),
                Stream::Stdout,
                cap,
                ctx.clone(),
            ));
            let err = tokio::spawn(capture(
                child.stderr.take(),
                Stream::Stderr,
                cap,
                ctx.clone(),
            ));
            let timeout = req.timeout.unwrap_or(self.limits.wall);
            let status = tokio::select! {
                s = child.wait() => {
                    let s = s.map_err(|e| ExecError::io("waiting for perl", e))?;
                    s.code().map_or(ExitStatus::Signaled(9), ExitStatus::Exited)
                }
                () = tokio::time::sleep(timeout) => ExitStatus::TimedOut,
                () = ctx.cancel.cancelled() => ExitStatus::Cancelled,
            };
            let _ = child.start_kill();
            let _ = child.wait().await;
            Ok(ExecOutcome {
                status,
                stdout: out.await.unwrap_or_default(),
                stderr: err.await.unwrap_or_default(),
                duration: started.elapsed(),
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

async fn capture<R: AsyncRead + Unpin>(
    reader: Option<R>,
    stream: Stream,
    cap: usize,
    ctx: ExecContext,
) -> tandem_executor::Captured {
    let mut buf = CaptureBuffer::new(cap);
    if let Some(mut reader) = reader {
        let mut chunk = [0u8; 8192];
        while let Ok(n) = reader.read(&mut chunk).await {
            if n == 0 {
                break;
            }
            let live = buf.push(&chunk[..n]);
            (ctx.sink)(stream, &chunk[..live]);
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
}
