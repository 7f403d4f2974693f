//! Running one block: write it to a file, start it sandboxed (a fresh interpreter, or a fork
//! of the warm Python), capture, time out, clean up.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::resource::{Resource, setrlimit};
use tandem_executor::workspace::{BlockScript, write_block_script};
use tandem_executor::{
    CaptureBuffer, Captured, ExecContext, ExecError, ExecOutcome, ExecRequest, ExitStatus,
    Language, Limits, OutputSink, Stream,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::LocalSession;
use crate::forkserver::{ForkServer, decode_wait_status};
use crate::kill::{MARKER_VAR, TreeKiller};

/// How long to wait for the pipes to reach EOF once every process is dead.
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// How long a forked block may take to report that it started.
const FORK_START_LIMIT: Duration = Duration::from_secs(10);

type Reader = Box<dyn AsyncRead + Send + Unpin>;

/// A started block: its process group and how to learn how it ended.
enum Running {
    Spawned(Child),
    /// Forked by the Python fork server; its waiter writes the wait status here.
    Forked(BufReader<pipe::Receiver>),
}

impl Running {
    async fn wait(&mut self) -> Result<ExitStatus, ExecError> {
        match self {
            Running::Spawned(child) => {
                let s = child
                    .wait()
                    .await
                    .map_err(|e| ExecError::io("waiting for the block's process", e))?;
                Ok(match (s.code(), s.signal()) {
                    (Some(code), _) => ExitStatus::Exited(code),
                    (None, Some(sig)) => ExitStatus::Signaled(sig),
                    (None, None) => ExitStatus::Signaled(0),
                })
            }
            Running::Forked(status) => {
                let mut text = String::new();
                status
                    .read_to_string(&mut text)
                    .await
                    .map_err(|e| ExecError::io("waiting for the block's process", e))?;
                // No status means the waiter itself was killed.
                Ok(text
                    .trim()
                    .parse::<i32>()
                    .map_or(ExitStatus::Signaled(9), decode_wait_status))
            }
        }
    }
}

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
    let BlockScript {
        path: script,
        transient,
    } = match write_block_script(
        &session.workspace,
        &req.code,
        session.blocks,
        req.language.extension(),
    ) {
        Ok(script) => script,
        Err(e) => return Ok(ExecOutcome::refused(&e.to_string())),
    };
    let result = supervise(session, program, &script, req, ctx).await;
    if transient {
        let _ = tokio::fs::remove_file(&script).await;
    }
    result
}

async fn supervise(
    session: &LocalSession,
    program: &Path,
    script: &Path,
    req: ExecRequest,
    ctx: ExecContext,
) -> Result<ExecOutcome, ExecError> {
    let exec_id = uuid::Uuid::new_v4().simple().to_string();
    let limits = &session.limits;
    let timeout = req.timeout.unwrap_or(limits.wall);
    let interpreters = session.inner.interpreters();
    let mut env: Vec<(String, String)> = session.inner.env.clone();
    env.extend([
        ("PATH".to_owned(), interpreters.path_env.clone()),
        ("HOME".to_owned(), session.workspace.display().to_string()),
        (
            "TMPDIR".to_owned(),
            session.scratch.path().join("tmp").display().to_string(),
        ),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
        ("PYTHONDONTWRITEBYTECODE".to_owned(), "1".to_owned()),
        (MARKER_VAR.to_owned(), exec_id.clone()),
    ]);

    let started = Instant::now();
    // Every language goes through the fork server when it runs: its per-block waiter is a
    // subreaper, so processes that leave the block's session and environment (`setsid env -i
    // sleep 999 &`) are still its descendants when it kills them.
    let server = match interpreters.program(&Language::python()) {
        Some(python) => session.inner.fork_server(python).await,
        None => None,
    };
    let argv = (req.language != Language::python())
        .then(|| vec![program.display().to_string(), script.display().to_string()]);
    let marker_only = server.is_none();
    let (pgid, out, err, mut running) = match server {
        Some(server) => fork(&server, script, argv, &session.workspace, &env, limits).await?,
        None => spawn(
            program,
            script,
            &session.workspace,
            &env,
            limits,
            &req.language,
        )?,
    };
    let killer = TreeKiller::new(pgid, &exec_id, marker_only);
    let stop_reading = CancellationToken::new();
    let cap = limits.output_bytes;
    let out = tokio::spawn(capture(
        out,
        Stream::Stdout,
        cap,
        ctx.sink.clone(),
        stop_reading.clone(),
    ));
    let err = tokio::spawn(capture(
        err,
        Stream::Stderr,
        cap,
        ctx.sink.clone(),
        stop_reading.clone(),
    ));

    let status = tokio::select! {
        status = running.wait() => status?,
        () = tokio::time::sleep(timeout) => ExitStatus::TimedOut,
        () = ctx.cancel.cancelled() => ExitStatus::Cancelled,
    };
    let duration = started.elapsed();
    // Background processes of a finished block die with it, as do all of a killed one.
    tokio::task::spawn_blocking(move || killer.kill_all())
        .await
        .map_err(|e| ExecError::Backend(format!("killing the block's processes failed: {e}")))?;
    if !matches!(status, ExitStatus::Exited(_) | ExitStatus::Signaled(_)) {
        let _ = tokio::time::timeout(Duration::from_secs(1), running.wait()).await;
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
    Ok(ExecOutcome {
        status,
        stdout,
        stderr,
        duration,
    })
}

fn rlimits(limits: &Limits) -> [(Resource, Option<u64>); 5] {
    [
        (Resource::RLIMIT_AS, limits.memory_bytes),
        (Resource::RLIMIT_CPU, limits.cpu_secs),
        (Resource::RLIMIT_FSIZE, limits.file_size_bytes),
        (Resource::RLIMIT_NOFILE, limits.open_files),
        (Resource::RLIMIT_CORE, Some(0)),
    ]
}

/// Starts a fresh interpreter in its own session, with rlimits.
fn spawn(
    program: &Path,
    script: &Path,
    workspace: &Path,
    env: &[(String, String)],
    limits: &Limits,
    language: &Language,
) -> Result<(Option<u32>, Reader, Reader, Running), ExecError> {
    let mut cmd = Command::new(program);
    cmd.arg(script)
        .current_dir(workspace)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
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
        what: format!("{} ({language})", program.display()),
        hint: format!("starting it failed: {e}; install it or set its path in the config"),
    })?;
    // No pid means it already exited and was reaped; there is no group to kill then (and a
    // pgid of 0 would be Tandem's own).
    let pid = child.id();
    let out: Reader = match child.stdout.take() {
        Some(r) => Box::new(r),
        None => Box::new(tokio::io::empty()),
    };
    let err: Reader = match child.stderr.take() {
        Some(r) => Box::new(r),
        None => Box::new(tokio::io::empty()),
    };
    Ok((pid, out, err, Running::Spawned(child)))
}

/// Starts a block as a fork of the warm Python (which execs `argv` for other languages).
async fn fork(
    server: &Arc<ForkServer>,
    script: &Path,
    argv: Option<Vec<String>>,
    workspace: &Path,
    env: &[(String, String)],
    limits: &Limits,
) -> Result<(Option<u32>, Reader, Reader, Running), ExecError> {
    let rlimits: Vec<(String, u64)> = rlimits(limits)
        .into_iter()
        .filter_map(|(r, l)| l.map(|l| (format!("{r:?}"), l)))
        .collect();
    let request = serde_json::json!({
        "script": script,
        "argv": argv,
        "cwd": workspace,
        "env": env.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
        "rlimits": rlimits,
    })
    .to_string();
    let server = server.clone();
    let launched = tokio::task::spawn_blocking(move || server.launch(request.as_bytes()))
        .await
        .map_err(|e| ExecError::Backend(format!("the Python fork server failed: {e}")))?
        .map_err(|e| ExecError::io("starting a block through the Python fork server", e))?;
    let wrap = |fd| {
        pipe::Receiver::from_owned_fd(fd)
            .map_err(|e| ExecError::io("reading the block's output", e))
    };
    let out: Reader = Box::new(wrap(launched.stdout)?);
    let err: Reader = Box::new(wrap(launched.stderr)?);
    let mut status = BufReader::new(wrap(launched.status)?);
    // The block reports its pid only once it leads its own process group, so a kill right
    // after this cannot miss it.
    let mut line = String::new();
    let read = tokio::time::timeout(FORK_START_LIMIT, status.read_line(&mut line)).await;
    let pid = match read {
        Ok(Ok(_)) => line.trim().parse::<u32>().ok(),
        _ => None,
    }
    .ok_or_else(|| {
        ExecError::Backend(format!(
            "the Python fork server did not start the block within {FORK_START_LIMIT:?}"
        ))
    })?;
    Ok((Some(pid), out, err, Running::Forked(status)))
}

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
