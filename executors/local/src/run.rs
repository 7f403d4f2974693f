//! Running one block: write it to a file, start it sandboxed (a fresh interpreter, or a fork
//! of the warm Python), capture, time out, clean up.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, ExitStatus, Language, Limits,
    Resources,
};
use tandem_executor_kit::process::{self, Reader, Started, Wait};
use tandem_executor_kit::workspace::{BlockScript, write_block_script};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};

use crate::LocalSession;
use crate::forkserver::{ForkServer, decode_wait_status};
use crate::kill::{MARKER_VAR, Sweep, TreeKiller};

/// What a forked block used, as its waiter reported it.
type Used = Arc<std::sync::Mutex<Option<Resources>>>;

/// How long a forked block may take to report that it started.
const FORK_START_LIMIT: Duration = Duration::from_secs(10);

/// A started block: how to learn how it ended.
enum Running {
    Spawned(Child),
    /// Forked by the Python fork server; its waiter writes the wait status here, what the
    /// block used (kept in the third), and `kept` when servers the block left run on (then
    /// set in the second).
    Forked(BufReader<pipe::Receiver>, Arc<AtomicBool>, Used),
}

impl Wait for Running {
    fn wait(&mut self) -> BoxFuture<'_, Result<ExitStatus, ExecError>> {
        Box::pin(async move {
            match self {
                Running::Spawned(child) => Wait::wait(child).await,
                Running::Forked(status, kept, used) => {
                    let mut text = String::new();
                    status
                        .read_to_string(&mut text)
                        .await
                        .map_err(|e| ExecError::io("waiting for the block's process", e))?;
                    let mut lines = text.lines();
                    // No status means the waiter itself was killed.
                    let status = lines
                        .next()
                        .and_then(|l| l.trim().parse::<i32>().ok())
                        .map_or(ExitStatus::Signaled(9), decode_wait_status);
                    for line in lines {
                        if line == "kept" {
                            kept.store(true, Ordering::SeqCst);
                        } else if let Some(json) = line.strip_prefix("usage ") {
                            let parsed = serde_json::from_str(json).ok();
                            if let Ok(mut slot) = used.lock() {
                                *slot = parsed;
                            }
                        }
                    }
                    Ok(status)
                }
            }
        })
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
    if session.egress.is_some() {
        env.extend(tandem_executor::egress_env());
        env.extend(session.egress_env.iter().cloned());
    }
    env.extend([
        ("PATH".to_owned(), interpreters.path_env.clone()),
        ("HOME".to_owned(), session.workspace.display().to_string()),
        (
            "TMPDIR".to_owned(),
            session.scratch.path().join("tmp").display().to_string(),
        ),
        // Caches (matplotlib's font list, pip's) go with the session rather than show up
        // among the task's files.
        (
            "XDG_CACHE_HOME".to_owned(),
            session
                .scratch
                .path()
                .join("tmp/.cache")
                .display()
                .to_string(),
        ),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
        ("PYTHONDONTWRITEBYTECODE".to_owned(), "1".to_owned()),
        (MARKER_VAR.to_owned(), exec_id.clone()),
    ]);
    if session.policy.is_some() {
        // A confined block cannot read the host's /etc/gitconfig (Landlock), and git stops
        // at a system config it cannot read: the sandbox's git runs without it.
        env.push(("GIT_CONFIG_NOSYSTEM".to_owned(), "1".to_owned()));
    }
    if req.isolated {
        // HOME is the workspace: its user site is the blocks' to fill. (A block forked from
        // the fork server has the server's start-up, which read no workspace.)
        env.push(("PYTHONNOUSERSITE".to_owned(), "1".to_owned()));
    }
    // The block's tools channel: a socket pair made here, its end inherited by the block.
    let channel = match &ctx.tools {
        Some(handler) => Some(tools_channel(session, &mut env, handler.clone())?),
        None => None,
    };

    // Every language goes through the fork server when it runs: its per-block waiter is a
    // subreaper, so processes that leave the block's session and environment (`setsid env -i
    // sleep 999 &`) are still its descendants when it kills them.
    let server = match interpreters.program(&Language::python()) {
        Some(python) => session.inner.fork_server(python).await,
        None => None,
    };
    let argv = (req.language != Language::python())
        .then(|| vec![program.display().to_string(), script.display().to_string()]);
    let mut sweep = if server.is_none() {
        Sweep::MarkerOnly
    } else {
        Sweep::UnderSubreaper
    };
    let started = match server {
        Some(server) => {
            let hold = session.hold(&server).await?;
            let confine = session.policy.as_ref();
            let request = ForkRequest {
                script,
                argv,
                cwd: &session.workspace,
                env: env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
                rlimits: process::rlimits(limits)
                    .into_iter()
                    .filter_map(|(r, l)| l.map(|l| (format!("{r:?}"), l)))
                    .collect(),
                confine,
                tools: channel.is_some(),
                hold,
            };
            let behind = session.egress.is_some();
            let ruleset = confine
                .map(|c| c.ruleset(behind, hold.is_some()))
                .transpose()
                .map_err(|e| ExecError::io("making the block's Landlock ruleset", e))?;
            let (started, namespace) = fork(
                &server,
                &request,
                ruleset,
                channel.as_ref().map(|c| c.theirs.clone()),
            )
            .await?;
            // Taken only where this block was asked to have a namespace of its own.
            if namespace && confine.is_some_and(|c| c.pid_namespace.is_some()) {
                sweep = Sweep::Namespace;
            }
            started
        }
        // Confinement is the fork server's: a session that has a policy (or a way out only
        // through the proxy) and no fork server runs nothing rather than run unconfined.
        None if session.policy.is_some() || session.egress.is_some() => {
            return Err(ExecError::Unavailable {
                what: "confinement of local blocks".to_owned(),
                hint: "the Python fork server that applies it did not start (see the log); set [executors.local] confine = \"off\" to run unconfined".to_owned(),
            });
        }
        None => spawn(
            program,
            script,
            &session.workspace,
            &env,
            limits,
            &req.language,
        )?,
    };
    let killer = TreeKiller::new(started.pid, &exec_id, sweep);
    // The calls are answered while the block runs, and no longer.
    let serving = channel.map(|c| tokio::spawn(c.serve));
    let (kept, used) = match &started.wait {
        Running::Forked(_, kept, used) => (kept.clone(), Some(used.clone())),
        Running::Spawned(_) => (Arc::new(AtomicBool::new(false)), None),
    };
    // Servers it kept hold the block's pipes: what they write later is read and dropped.
    let started = Started {
        stdout: Box::new(Drained::new(started.stdout, kept.clone())) as Reader,
        stderr: Box::new(Drained::new(started.stderr, kept.clone())) as Reader,
        ..started
    };
    // Background processes of a finished block die with it, as do all of a killed one; but
    // for the servers its PID namespace's init kept, which die with the session's holder.
    let outcome = process::supervise(started, timeout, limits.output_bytes, &ctx, move || {
        if kept.load(Ordering::SeqCst) {
            killer.disarm();
        } else {
            killer.kill_all();
        }
    })
    .await;
    if let Some(serving) = serving {
        serving.abort();
    }
    outcome.map(|mut outcome| {
        let measured = used.and_then(|u| u.lock().ok().and_then(|mut u| u.take()));
        outcome.resources = Some(measured.unwrap_or_else(|| {
            Resources::unavailable(
                "the block ran without the fork server, whose waiter measures what blocks use",
            )
        }));
        outcome
    })
}

/// A block's tools channel: the block's end, and the future that answers on ours.
struct Channel {
    theirs: Arc<std::os::fd::OwnedFd>,
    serve: futures::future::BoxFuture<'static, ()>,
}

/// Makes the channel for one block and tells the block where the module, the command, the
/// descriptor (by the fork server) and the secret are.
fn tools_channel(
    session: &LocalSession,
    env: &mut Vec<(String, String)>,
    handler: tandem_executor_kit::toolchannel::ToolHandler,
) -> Result<Channel, ExecError> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    use tandem_executor_kit::toolchannel;
    let dir = session.scratch.path().join(crate::TOOLS_DIR);
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| ExecError::io("making a tools channel", e.into()))?;
    let ours = std::os::unix::net::UnixStream::from(ours);
    ours.set_nonblocking(true)
        .map_err(|e| ExecError::io("making a tools channel", e))?;
    let ours = tokio::net::UnixStream::from_std(ours)
        .map_err(|e| ExecError::io("making a tools channel", e))?;
    let token = toolchannel::secret();
    let dir = dir.display().to_string();
    for (key, value) in env.iter_mut() {
        if key == "PATH" {
            *value = format!("{dir}:{value}");
        }
    }
    env.push(("PYTHONPATH".to_owned(), dir));
    env.push(("TANDEM_TOOLS_TOKEN".to_owned(), token.clone()));
    Ok(Channel {
        theirs: Arc::new(theirs),
        serve: Box::pin(toolchannel::serve(ours, token, handler)),
    })
}

/// Starts a fresh interpreter in its own session, with rlimits.
fn spawn(
    program: &Path,
    script: &Path,
    workspace: &Path,
    env: &[(String, String)],
    limits: &Limits,
    language: &Language,
) -> Result<Started<Running>, ExecError> {
    let mut cmd = Command::new(program);
    cmd.arg(script)
        .current_dir(workspace)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)));
    let what = format!("{} ({language})", program.display());
    let started = process::spawn(cmd, limits, &what)?;
    Ok(Started {
        pid: started.pid,
        stdout: started.stdout,
        stderr: started.stderr,
        wait: Running::Spawned(started.wait),
    })
}

/// What the fork server (`forkserver.py`) is asked to start, one JSON line.
#[derive(serde::Serialize)]
struct ForkRequest<'a> {
    /// The block's file: run in the fork itself, when `argv` is `None` (python).
    script: &'a Path,
    /// A program the fork's child execs instead (sh, node).
    argv: Option<Vec<String>>,
    cwd: &'a Path,
    env: std::collections::BTreeMap<&'a str, &'a str>,
    /// `RLIMIT_*` names and values.
    rlimits: Vec<(String, u64)>,
    /// What the waiter confines itself (and so the block) with; `None` runs it unconfined.
    confine: Option<&'a crate::confine::Policy>,
    /// Whether the block's tools channel comes as the last descriptor.
    tools: bool,
    /// The session's holder, whose network namespace the block joins (and whose servers the
    /// block's PID namespace keeps); `None` leaves it in the fork server's empty one.
    #[serde(skip_serializing_if = "Option::is_none")]
    hold: Option<u64>,
}

/// Starts a block as a fork of the warm Python (which execs `argv` for other languages);
/// and whether the pid is the init of the block's own PID namespace.
async fn fork(
    server: &Arc<ForkServer>,
    request: &ForkRequest<'_>,
    ruleset: Option<std::os::fd::OwnedFd>,
    tools: Option<Arc<std::os::fd::OwnedFd>>,
) -> Result<(Started<Running>, bool), ExecError> {
    let request = serde_json::to_string(request)
        .map_err(|e| ExecError::Backend(format!("encoding a fork server request failed: {e}")))?;
    let server = server.clone();
    let launched = tokio::task::spawn_blocking(move || {
        server.launch(request.as_bytes(), ruleset.as_ref(), tools.as_deref())
    })
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
    let mut said = line.split_whitespace();
    let pid = match read {
        // 0 and 1 are no block's pid (a status line taken for one would kill Tandem's group).
        Ok(Ok(_)) => said
            .next()
            .and_then(|p| p.parse::<u32>().ok())
            .filter(|p| *p > 1),
        _ => None,
    }
    .ok_or_else(|| {
        ExecError::Backend(format!(
            "the Python fork server did not start the block within {FORK_START_LIMIT:?}"
        ))
    })?;
    let namespace = said.next() == Some("ns");
    Ok((
        Started {
            pid: Some(pid),
            stdout: out,
            stderr: err,
            wait: Running::Forked(status, Arc::new(AtomicBool::new(false)), Used::default()),
        },
        namespace,
    ))
}

/// A block's output pipe that, dropped once its block kept servers, is read to its end in
/// the background: those servers hold it and write on, and a write must not fail them.
struct Drained {
    inner: Option<Reader>,
    kept: Arc<AtomicBool>,
}

impl Drained {
    fn new(inner: Reader, kept: Arc<AtomicBool>) -> Self {
        Self {
            inner: Some(inner),
            kept,
        }
    }
}

impl tokio::io::AsyncRead for Drained {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.inner.as_mut() {
            Some(inner) => std::pin::Pin::new(inner).poll_read(cx, buf),
            None => std::task::Poll::Ready(Ok(())),
        }
    }
}

impl Drop for Drained {
    fn drop(&mut self) {
        if !self.kept.load(Ordering::SeqCst) {
            return;
        }
        if let (Some(mut inner), Ok(runtime)) =
            (self.inner.take(), tokio::runtime::Handle::try_current())
        {
            // Ends at EOF, when the last server holding the pipe dies with its session.
            runtime.spawn(async move {
                let _ = tokio::io::copy(&mut inner, &mut tokio::io::sink()).await;
            });
        }
    }
}
