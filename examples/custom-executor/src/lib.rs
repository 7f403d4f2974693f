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
//! It is deliberately small: `tandem_executor::process` supervises its processes (a session
//! of their own, rlimits, timeout and cancel, a group kill, bounded capture); the built-in
//! local executor adds what a group kill misses (children that leave the group with `setsid`)
//! and a scratch directory apart from the workspace.

use std::path::{Path, PathBuf};

use tandem_executor::workspace::write_block_script;
use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, Language, Limits,
    Session, SessionSpec, process,
};

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
            let mut cmd = tokio::process::Command::new("perl");
            cmd.arg(&script)
                .current_dir(&self.dir)
                .env_clear()
                .env("PATH", "/usr/local/bin:/usr/bin:/bin");
            // A new session, rlimits, bounded live capture, and on every path a kill of the
            // whole process group, so a block's background children die with it.
            let started = process::spawn(cmd, &self.limits, "perl")?;
            let group = started.pid;
            let timeout = req.timeout.unwrap_or(self.limits.wall);
            process::supervise(
                started,
                timeout,
                self.limits.output_bytes,
                &ctx,
                move || process::kill_group(group),
            )
            .await
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
