//! Supervising a block's processes, for executors that run them on the host: start one in a
//! session of its own with the limits as rlimits, capture both streams (bounded, live to the
//! sink), end it on its own, at its timeout or on cancel, then kill everything it left and
//! drain the pipes within a grace.
//!
//! ```no_run
//! # async fn block(ctx: tandem_executor::ExecContext) -> Result<(), tandem_executor::ExecError> {
//! use tandem_executor::Limits;
//! use tandem_executor_kit::process;
//! let limits = Limits::default();
//! let mut cmd = tokio::process::Command::new("perl");
//! cmd.arg("block.pl").env_clear();
//! let started = process::spawn(cmd, &limits, "perl")?;
//! let pgid = started.pid;
//! let outcome = process::supervise(started, limits.wall, limits.output_bytes, &ctx, move || {
//!     process::kill_group(pgid)
//! })
//! .await?;
//! # Ok(()) }
//! ```

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::resource::{Resource, setrlimit};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use tandem_executor::{
    BoxFuture, CaptureBuffer, Captured, ExecContext, ExecError, ExecOutcome, ExitStatus, Limits,
    OutputSink, Stream,
};

/// How long to wait for the pipes to reach EOF once every process is dead: something that
/// escaped the kill may hold them open, and what was read is kept.
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// One of a block's output pipes.
pub type Reader = Box<dyn AsyncRead + Send + Unpin>;

/// How to learn how a started block ended; called again after a kill to reap it.
pub trait Wait: Send {
    /// Waits for the block's main process to end.
    fn wait(&mut self) -> BoxFuture<'_, Result<ExitStatus, ExecError>>;
}

impl Wait for Child {
    fn wait(&mut self) -> BoxFuture<'_, Result<ExitStatus, ExecError>> {
        Box::pin(async move {
            let s = Child::wait(self)
                .await
                .map_err(|e| ExecError::io("waiting for the block's process", e))?;
            Ok(match (s.code(), s.signal()) {
                (Some(code), _) => ExitStatus::Exited(code),
                (None, Some(sig)) => ExitStatus::Signaled(sig),
                (None, None) => ExitStatus::Signaled(0),
            })
        })
    }
}

/// How work bounded by a timeout and a cancellation ended.
#[derive(Debug)]
pub enum Bounded<T> {
    /// It finished, with this.
    Finished(T),
    /// The timeout passed first.
    TimedOut,
    /// It was cancelled first.
    Cancelled,
}

/// Runs `work` until it finishes, `timeout` passes or `cancel` fires; a cancel that is
/// already there wins. Every executor bounds a block this way.
pub async fn bounded<F: std::future::Future>(
    work: F,
    timeout: Duration,
    cancel: &CancellationToken,
) -> Bounded<F::Output> {
    tokio::select! {
        biased;
        () = cancel.cancelled() => Bounded::Cancelled,
        () = tokio::time::sleep(timeout) => Bounded::TimedOut,
        out = work => Bounded::Finished(out),
    }
}

/// A started block: its process group, its pipes, and how to wait for it.
pub struct Started<W> {
    /// The pid of its main process, which leads its own process group; `None` when it had
    /// already ended and been reaped (there is no group to kill then).
    pub pid: Option<u32>,
    /// Its standard output.
    pub stdout: Reader,
    /// Its standard error.
    pub stderr: Reader,
    /// How it ends.
    pub wait: W,
}

/// The limits that are rlimits, as (resource, limit) pairs; a core dump is always off.
pub fn rlimits(limits: &Limits) -> [(Resource, Option<u64>); 5] {
    [
        (Resource::RLIMIT_AS, limits.memory_bytes),
        (Resource::RLIMIT_CPU, limits.cpu_secs),
        (Resource::RLIMIT_FSIZE, limits.file_size_bytes),
        (Resource::RLIMIT_NOFILE, limits.open_files),
        (Resource::RLIMIT_CORE, Some(0)),
    ]
}

/// Starts `cmd` as a block: stdin closed, stdout and stderr piped, in a new session (so its
/// process group is its own and a group kill reaches its children) with `limits`' rlimits,
/// killed if dropped. `what` names the program in the error when it cannot start.
pub fn spawn(mut cmd: Command, limits: &Limits, what: &str) -> Result<Started<Child>, ExecError> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let rlimits = rlimits(limits);
    // SAFETY: the closure runs between fork and exec, where only async-signal-safe calls are
    // allowed; setsid and setrlimit are plain system calls and nothing here allocates.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid()?;
            for (resource, limit) in rlimits {
                if let Some(limit) = limit {
                    setrlimit(resource, limit, limit)?;
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| ExecError::Unavailable {
        what: what.to_owned(),
        hint: format!("starting it failed: {e}; install it or set its path in the config"),
    })?;
    let pipe = |r: Option<Reader>| r.unwrap_or_else(|| Box::new(tokio::io::empty()));
    Ok(Started {
        pid: child.id(),
        stdout: pipe(child.stdout.take().map(|r| Box::new(r) as Reader)),
        stderr: pipe(child.stderr.take().map(|r| Box::new(r) as Reader)),
        wait: child,
    })
}

/// Kills process group `pgid` with SIGKILL; nothing when there is none (`None`, or a group
/// that is gone). Never signals group 0, which would be the caller's own.
pub fn kill_group(pgid: Option<u32>) {
    let Some(pgid) = pgid.and_then(|p| i32::try_from(p).ok()).filter(|p| *p > 0) else {
        return;
    };
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pgid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Runs a started block to its end, its `timeout` or `ctx`'s cancellation, capturing at most
/// `cap` bytes of each stream; then `kill` (on a blocking thread, on every path) kills what
/// is left, such as the background processes of a block that ended.
pub async fn supervise<W: Wait>(
    started: Started<W>,
    timeout: Duration,
    cap: usize,
    ctx: &ExecContext,
    kill: impl FnOnce() + Send + 'static,
) -> Result<ExecOutcome, ExecError> {
    let Started {
        stdout,
        stderr,
        mut wait,
        ..
    } = started;
    let clock = Instant::now();
    let stop_reading = CancellationToken::new();
    let read = |r, s| tokio::spawn(capture(r, s, cap, ctx.sink.clone(), stop_reading.clone()));
    let (out, err) = (read(stdout, Stream::Stdout), read(stderr, Stream::Stderr));
    let status = match bounded(wait.wait(), timeout, &ctx.cancel).await {
        Bounded::Finished(status) => status,
        Bounded::TimedOut => Ok(ExitStatus::TimedOut),
        Bounded::Cancelled => Ok(ExitStatus::Cancelled),
    };
    let duration = clock.elapsed();
    let killed = tokio::task::spawn_blocking(kill).await;
    let status = status?;
    killed.map_err(|e| ExecError::Backend(format!("killing the block's processes failed: {e}")))?;
    if !matches!(status, ExitStatus::Exited(_) | ExitStatus::Signaled(_)) {
        let _ = tokio::time::timeout(Duration::from_secs(1), wait.wait()).await;
    }
    let stopper = stop_reading.clone();
    let grace = tokio::spawn(async move {
        tokio::time::sleep(DRAIN_GRACE).await;
        stopper.cancel();
    });
    let stdout = out.await.unwrap_or_default();
    let stderr = err.await.unwrap_or_default();
    grace.abort();
    Ok(ExecOutcome {
        status,
        stdout,
        stderr,
        duration,
        resources: None,
    })
}

/// Reads `reader` to its end (or until `stop`), keeping what `cap` allows and passing the
/// kept head to `sink` as it arrives.
async fn capture(
    mut reader: Reader,
    stream: Stream,
    cap: usize,
    sink: OutputSink,
    stop: CancellationToken,
) -> Captured {
    let mut buf = CaptureBuffer::new(cap);
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
