//! Running one block: write it to a file, spawn it sandboxed, capture, time out, clean up.

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::resource::{Resource, setrlimit};
use tandem_executor::workspace::{filename_directive, resolve_inside};
use tandem_executor::{
    CaptureBuffer, Captured, ExecContext, ExecError, ExecOutcome, ExecRequest, ExitStatus,
    OutputSink, Stream,
};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::LocalSession;
use crate::kill::{MARKER_VAR, TreeKiller};

/// How long to wait for the pipes to reach EOF once every process is dead.
const DRAIN_GRACE: Duration = Duration::from_millis(500);

pub(crate) async fn run_block(
    session: &mut LocalSession,
    req: ExecRequest,
    ctx: ExecContext,
) -> Result<ExecOutcome, ExecError> {
    let interpreters = session.inner.interpreters();
    let Some(program) = interpreters.program(&req.language) else {
        return Err(ExecError::unsupported(
            &req.language,
            "local",
            &session.inner.languages,
        ));
    };
    // Unnamed blocks run from a hidden file in the workspace, removed afterwards, so that
    // `sys.path[0]` and `require('./x')` see the files earlier blocks saved, as when a
    // person runs a script in that directory.
    let (script, transient) = match filename_directive(&req.code) {
        Some(name) => match resolve_inside(&session.workspace, name) {
            Ok(path) => (path, false),
            Err(e) => return Ok(ExecOutcome::refused(&e.to_string())),
        },
        None => {
            let name = format!(
                ".tandem-block-{}.{}",
                session.blocks,
                req.language.extension()
            );
            (session.workspace.join(name), true)
        }
    };
    tokio::fs::write(&script, &req.code)
        .await
        .map_err(|e| ExecError::io(format!("writing {}", script.display()), e))?;

    let exec_id = uuid::Uuid::new_v4().simple().to_string();
    let limits = &session.limits;
    let timeout = req.timeout.unwrap_or(limits.wall);
    let mut cmd = Command::new(program);
    cmd.arg(&script)
        .current_dir(&session.workspace)
        .env_clear()
        .envs(session.inner.env.iter().map(|(k, v)| (k, v)))
        .env("PATH", &interpreters.path_env)
        .env("HOME", &session.workspace)
        .env("TMPDIR", session.scratch.path().join("tmp"))
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env(MARKER_VAR, &exec_id)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let rlimits = [
        (Resource::RLIMIT_AS, limits.memory_bytes),
        (Resource::RLIMIT_CPU, limits.cpu_secs),
        (Resource::RLIMIT_FSIZE, limits.file_size_bytes),
        (Resource::RLIMIT_NOFILE, limits.open_files),
        (Resource::RLIMIT_CORE, Some(0)),
    ];
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

    let started = Instant::now();
    let spawned = cmd.spawn();
    if spawned.is_err() && transient {
        let _ = tokio::fs::remove_file(&script).await;
    }
    let mut child = spawned.map_err(|e| ExecError::Unavailable {
        what: format!("{} ({})", program.display(), req.language),
        hint: format!("starting it failed: {e}; install it or set its path in the config"),
    })?;
    let killer = TreeKiller::new(child.id(), &exec_id);
    let stop_reading = CancellationToken::new();
    let readers = [
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn AsyncRead + Send + Unpin>),
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn AsyncRead + Send + Unpin>),
    ];
    let [out, err] = readers;
    let out = tokio::spawn(capture(
        out,
        Stream::Stdout,
        limits.output_bytes,
        ctx.sink.clone(),
        stop_reading.clone(),
    ));
    let err = tokio::spawn(capture(
        err,
        Stream::Stderr,
        limits.output_bytes,
        ctx.sink.clone(),
        stop_reading.clone(),
    ));

    let status = tokio::select! {
        status = child.wait() => match status {
            Ok(s) => match (s.code(), s.signal()) {
                (Some(code), _) => ExitStatus::Exited(code),
                (None, Some(sig)) => ExitStatus::Signaled(sig),
                (None, None) => ExitStatus::Signaled(0),
            },
            Err(e) => return Err(ExecError::io("waiting for the block's process", e)),
        },
        () = tokio::time::sleep(timeout) => ExitStatus::TimedOut,
        () = ctx.cancel.cancelled() => ExitStatus::Cancelled,
    };
    let duration = started.elapsed();
    // Background processes of a finished block die with it, as do all of a killed one.
    tokio::task::spawn_blocking(move || killer.kill_all())
        .await
        .map_err(|e| ExecError::Backend(format!("killing the block's processes failed: {e}")))?;
    if !matches!(status, ExitStatus::Exited(_) | ExitStatus::Signaled(_)) {
        let _ = tokio::time::timeout(Duration::from_secs(1), child.wait()).await;
    }
    // Something we could not kill may hold the pipes; keep what was read and move on.
    let stopper = stop_reading.clone();
    let grace = tokio::spawn(async move {
        tokio::time::sleep(DRAIN_GRACE).await;
        stopper.cancel();
    });
    let stdout = out.await.unwrap_or_default();
    let stderr = err.await.unwrap_or_default();
    grace.abort();
    if transient {
        let _ = tokio::fs::remove_file(&script).await;
    }
    Ok(ExecOutcome {
        status,
        stdout,
        stderr,
        duration,
    })
}

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
