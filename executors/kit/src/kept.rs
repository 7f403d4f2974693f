//! A kept Python interpreter: Python blocks of a session run one after another in one
//! interpreter whose globals survive, as in a notebook, on any executor whose sessions have a
//! host workspace and can share it with a second session.
//!
//! The interpreter (`kernel.py`) is itself a block: it runs in a second session of the same
//! executor opened on the first one's workspace, so it is confined, limited and cleaned up as
//! every block is. Blocks and their output go over FIFOs in `.tandem/` of the workspace. A
//! block past its time is interrupted (`KeyboardInterrupt`) and the interpreter lives on; one
//! that does not stop within [`GRACE`], or that kills the interpreter, is reported, and the
//! next block gets a fresh interpreter. Other languages run in the first session as before.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;

use tandem_executor::{
    BoxFuture, CancellationToken, CaptureBuffer, ExecContext, ExecError, ExecOutcome, ExecRequest,
    Executor, ExitStatus, Language, SavedState, Session, SessionSpec, Stream,
};

/// The interpreter's program.
const KERNEL: &str = concat!(include_str!("prelude.py"), include_str!("kernel.py"));
/// How long an interrupted block has to stop before the interpreter is killed.
pub const GRACE: Duration = Duration::from_secs(3);
/// How long a new interpreter has to open its FIFOs.
const START: Duration = Duration::from_secs(60);

/// A session whose Python blocks share one interpreter.
pub struct KeptSession {
    inner: Box<dyn Session>,
    executor: Arc<dyn Executor>,
    spec: SessionSpec,
    kernel: Option<Kernel>,
    /// Answers the tool calls of the block running now. The interpreter outlives its blocks,
    /// so its one channel is lent to each block's handler in turn.
    tools: Arc<std::sync::Mutex<Option<crate::toolchannel::ToolHandler>>>,
}

/// A running interpreter.
struct Kernel {
    input: pipe::Sender,
    output: pipe::Receiver,
    control: pipe::Sender,
    stop: CancellationToken,
    /// Ends the interpreter when the session is dropped without being closed.
    _guard: tokio_util::sync::DropGuard,
    run: tokio::task::JoinHandle<(Box<dyn Session>, Result<ExecOutcome, ExecError>)>,
}

impl KeptSession {
    /// Keeps an interpreter for `inner`, a session of `executor` opened with `spec`.
    pub fn new(inner: Box<dyn Session>, executor: Arc<dyn Executor>, spec: SessionSpec) -> Self {
        Self {
            inner,
            executor,
            spec,
            kernel: None,
            tools: Arc::default(),
        }
    }

    fn fifo_dir(&self) -> Result<PathBuf, ExecError> {
        self.inner
            .workspace()
            .map(|w| w.join(".tandem"))
            .ok_or_else(|| ExecError::Unavailable {
                what: "a kept interpreter".to_owned(),
                hint: "this executor's sessions have no workspace Tandem can reach".to_owned(),
            })
    }

    async fn start(&mut self) -> Result<(), ExecError> {
        let dir = self.fifo_dir()?;
        let workspace = self.inner.workspace().map(Path::to_owned);
        let io = |what: &str| {
            let what = what.to_owned();
            move |source| ExecError::Io {
                context: format!("{what} for the kept interpreter"),
                source,
            }
        };
        let fifos = tokio::task::spawn_blocking(move || make_fifos(&dir))
            .await
            .map_err(|e| ExecError::Backend(format!("making the kept interpreter's FIFOs: {e}")))?
            .map_err(io("making .tandem"))?;
        let mut spec = self.spec.clone();
        spec.workdir = workspace;
        spec.inputs = None;
        spec.keep_state = false;
        let mut session = self.executor.open(spec).await?;
        let stop = CancellationToken::new();
        let token = stop.clone();
        let mut ctx = ExecContext::new(token);
        if self.executor.carries_tool_calls() {
            let current = self.tools.clone();
            ctx = ctx.with_tools(Arc::new(move |name, arguments| {
                let handler = current.lock().ok().and_then(|h| h.clone());
                match handler {
                    Some(handler) => handler(name, arguments),
                    None => Box::pin(async {
                        Err("this block may call no tools: its task offers none".to_owned())
                    }),
                }
            }));
        }
        let run = tokio::spawn(async move {
            let mut req = ExecRequest::new(Language::python(), KERNEL);
            req.timeout = Some(Duration::from_secs(u64::from(u32::MAX)));
            let ran = session.run(req, ctx).await;
            (session, ran)
        });
        // Until the interpreter is handed over, any way out of here ends it.
        let guard = stop.clone().drop_guard();
        let started = Instant::now();
        let input = loop {
            match fifos.open("in", true).and_then(Fifo::sender) {
                Ok(sender) => break sender,
                // No reader yet: the interpreter is still starting.
                Err(e) if e.raw_os_error() == Some(nix::libc::ENXIO) => {}
                Err(e) => {
                    stop.cancel();
                    return Err(io("opening the input")(e));
                }
            }
            if run.is_finished() || started.elapsed() > START {
                stop.cancel();
                let why = match run.await {
                    Ok((session, ran)) => {
                        let _ = session.close().await;
                        match ran {
                            Ok(outcome) => outcome.stderr.to_text(),
                            Err(e) => e.to_string(),
                        }
                    }
                    Err(e) => e.to_string(),
                };
                return Err(ExecError::Backend(format!(
                    "the kept Python interpreter did not start: {}",
                    why.trim()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let output = fifos
            .open("out", false)
            .and_then(Fifo::receiver)
            .map_err(io("opening the output"))?;
        let control = loop {
            match fifos.open("ctl", true).and_then(Fifo::sender) {
                Ok(sender) => break sender,
                Err(e) if e.raw_os_error() == Some(nix::libc::ENXIO) => {}
                Err(e) => return Err(io("opening the control")(e)),
            }
            if run.is_finished() || started.elapsed() > START {
                stop.cancel();
                return Err(ExecError::Backend(
                    "the kept Python interpreter stopped while it started".to_owned(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        self.kernel = Some(Kernel {
            input,
            output,
            control,
            _guard: guard,
            stop,
            run,
        });
        Ok(())
    }

    /// Ends the interpreter (if any) and closes its session.
    async fn stop_kernel(&mut self) {
        if let Some(kernel) = self.kernel.take() {
            kernel.stop.cancel();
            drop((kernel.input, kernel.output, kernel.control));
            if let Ok((session, _)) = kernel.run.await {
                let _ = session.close().await;
            }
        }
    }

    async fn run_python(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> Result<ExecOutcome, ExecError> {
        if self.kernel.is_none() {
            self.start().await?;
        }
        let limit = req.timeout.unwrap_or(self.spec.limits.wall);
        let cap = self.spec.limits.output_bytes;
        let (mut stdout, mut stderr) = (CaptureBuffer::new(cap), CaptureBuffer::new(cap));
        // Live output is the head of each stream, as every executor sends it.
        let mut live = [cap / 2, cap / 2];
        let mut show = |stream: Stream, data: &[u8]| {
            let left = &mut live[stream as usize];
            let n = data.len().min(*left);
            if n > 0 {
                (ctx.sink)(stream, &data[..n]);
                *left -= n;
            }
        };
        let started = Instant::now();
        let Some(kernel) = self.kernel.as_mut() else {
            return Err(ExecError::Backend("no interpreter".to_owned()));
        };
        // A leading NUL marks the interpreter's commands; in a block it is only a syntax
        // error, which Python reports the same one line down.
        let code = if req.code.starts_with('\0') {
            format!("\n{}", req.code)
        } else {
            req.code
        };
        let code = code.as_bytes();
        let mut frame = Vec::with_capacity(code.len() + 4);
        frame.extend_from_slice(&u32::try_from(code.len()).unwrap_or(u32::MAX).to_be_bytes());
        frame.extend_from_slice(code);
        let sent = kernel.input.write_all(&frame).await;
        let deadline = tokio::time::Instant::now() + limit;
        let mut interrupted: Option<ExitStatus> = None;
        let mut ended = None;
        if sent.is_ok() {
            loop {
                let wait_until = match interrupted {
                    None => deadline,
                    Some(_) => tokio::time::Instant::now() + GRACE,
                };
                let next = tokio::select! {
                    frame = read_frame(&mut kernel.output) => Some(frame),
                    () = tokio::time::sleep_until(wait_until) => None,
                    () = ctx.cancel.cancelled(), if interrupted.is_none() => {
                        interrupted = Some(ExitStatus::Cancelled);
                        let _ = kernel.control.write_all(b"i").await;
                        continue;
                    }
                };
                match next {
                    None if interrupted.is_none() => {
                        interrupted = Some(ExitStatus::TimedOut);
                        let _ = kernel.control.write_all(b"i").await;
                    }
                    // It did not stop within the grace: it is killed below.
                    None => break,
                    Some(Ok((b'o', data))) => {
                        show(Stream::Stdout, &data);
                        stdout.push(&data);
                    }
                    Some(Ok((b'e', data))) => {
                        show(Stream::Stderr, &data);
                        stderr.push(&data);
                    }
                    Some(Ok((b'd', data))) => {
                        ended = Some(serde_json::from_slice::<Done>(&data).unwrap_or_default());
                        break;
                    }
                    Some(Ok(_)) => {}
                    // The interpreter is gone.
                    Some(Err(_)) => break,
                }
            }
        }
        let resources = match &ended {
            Some(Done {
                resources: Some(used),
                ..
            }) => serde_json::from_value(used.clone()).unwrap_or_else(|e| {
                tandem_executor::Resources::unavailable(format!(
                    "the interpreter's figures for the block do not read ({e})"
                ))
            }),
            Some(_) => tandem_executor::Resources::unavailable(
                "the interpreter did not say what the block used",
            ),
            None => tandem_executor::Resources::unavailable(
                "the interpreter ended during this block, before it could say what the block used",
            ),
        };
        let status = match (&ended, interrupted) {
            (Some(_), Some(status)) => status,
            (Some(done), None) => ExitStatus::Exited(done.exit_code),
            (None, _) => {
                // Killed, wedged or gone: its state is lost, and the model is told.
                let kernel = self.kernel.take();
                let mut why = String::new();
                let mut status = interrupted.unwrap_or(ExitStatus::Exited(1));
                if let Some(mut kernel) = kernel {
                    // One that died on its own has its end reported as it was; one that is
                    // wedged is killed.
                    let mut ended = None;
                    if interrupted.is_none() {
                        ended = tokio::time::timeout(GRACE, &mut kernel.run).await.ok();
                    }
                    if ended.is_none() {
                        kernel.stop.cancel();
                    }
                    drop((kernel.input, kernel.output, kernel.control));
                    let ended = match ended {
                        Some(ended) => ended,
                        None => kernel.run.await,
                    };
                    if let Ok((session, ran)) = ended {
                        let _ = session.close().await;
                        if let Ok(outcome) = ran {
                            why = outcome.stderr.to_text();
                            if interrupted.is_none() {
                                status = match outcome.status {
                                    ExitStatus::Cancelled => ExitStatus::Exited(1),
                                    other => other,
                                };
                            }
                        }
                    }
                }
                let what = match (interrupted, status) {
                    (Some(_), _) => format!(
                        "the block did not stop within {} s of being interrupted, so its interpreter was killed",
                        GRACE.as_secs()
                    ),
                    (None, ExitStatus::Exited(code)) => {
                        format!("the interpreter exited with code {code} during this block")
                    }
                    (None, ExitStatus::Signaled(sig)) => {
                        format!("the interpreter was killed by signal {sig} during this block")
                    }
                    (None, ExitStatus::OutOfMemory) => {
                        "the interpreter ran out of memory during this block".to_owned()
                    }
                    (None, _) => "the interpreter stopped during this block".to_owned(),
                };
                let tail = why.trim();
                let tail = if tail.is_empty() {
                    String::new()
                } else {
                    format!("\n{tail}")
                };
                stderr.push(
                    format!(
                        "{tail}\ntandem: {what}; the variables of earlier blocks are gone, and the next Python block starts a fresh interpreter\n"
                    )
                    .as_bytes(),
                );
                status
            }
        };
        if ended.is_some() && interrupted == Some(ExitStatus::TimedOut) {
            stderr.push(
                format!(
                    "tandem: the block was interrupted after its {} s limit; the interpreter and its variables live on\n",
                    limit.as_secs()
                )
                .as_bytes(),
            );
        }
        Ok(ExecOutcome {
            status,
            stdout: stdout.finish(),
            stderr: stderr.finish(),
            duration: started.elapsed(),
            resources: Some(resources),
        })
    }
}

/// The interpreter's word that a block ended, and what the block used of it.
#[derive(Debug, Default, serde::Deserialize)]
struct Done {
    exit_code: i32,
    /// Read apart from the rest: figures that do not parse lose nothing but themselves.
    #[serde(default)]
    resources: Option<serde_json::Value>,
}

/// The interpreter's word that its globals were saved, or why not.
#[derive(Debug, Default, serde::Deserialize)]
struct Saved {
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    saved: Vec<String>,
    #[serde(default)]
    not_saved: Vec<NotSavedName>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct NotSavedName {
    name: String,
    why: String,
}

impl KeptSession {
    async fn save(
        &mut self,
        dest: &Path,
        max_bytes: u64,
        wait: Duration,
    ) -> Result<SavedState, ExecError> {
        if self.kernel.is_none() {
            // A restored pickle no block has loaded yet is loaded now, or it would be lost.
            let pending = self
                .inner
                .workspace()
                .map(|w| w.join(".tandem-state.pickle"))
                .ok_or_else(|| ExecError::Unavailable {
                    what: "a kept interpreter".to_owned(),
                    hint: "this executor's sessions have no workspace Tandem can reach".to_owned(),
                })?;
            if std::fs::symlink_metadata(&pending).is_err() {
                return Ok(SavedState::default());
            }
            self.start().await?;
        }
        let Some(kernel) = self.kernel.as_mut() else {
            return Err(ExecError::Backend("no interpreter".to_owned()));
        };
        let io = |what: &'static str| {
            move |source| ExecError::Io {
                context: format!("{what} the kept interpreter's globals"),
                source,
            }
        };
        let mut file = tokio::fs::File::create(dest).await.map_err(io("writing"))?;
        let mut frame = 5u32.to_be_bytes().to_vec();
        frame.extend_from_slice(b"\0save");
        let sent = kernel.input.write_all(&frame).await;
        let deadline = tokio::time::Instant::now() + wait;
        let mut interrupted = false;
        let mut bytes = 0u64;
        let mut over = false;
        let mut answer = None;
        if sent.is_ok() {
            loop {
                let until = if interrupted {
                    tokio::time::Instant::now() + GRACE
                } else {
                    deadline
                };
                let next = tokio::select! {
                    frame = read_frame(&mut kernel.output) => Some(frame),
                    () = tokio::time::sleep_until(until) => None,
                };
                match next {
                    None if !interrupted => {
                        interrupted = true;
                        let _ = kernel.control.write_all(b"i").await;
                    }
                    None => break,
                    Some(Ok((b'p', data))) => {
                        bytes = bytes.saturating_add(data.len() as u64);
                        over |= bytes > max_bytes;
                        if !over {
                            file.write_all(&data).await.map_err(io("writing"))?;
                        }
                    }
                    Some(Ok((b'd', data))) => {
                        answer = Some(serde_json::from_slice::<Saved>(&data).unwrap_or_else(|e| {
                            Saved {
                                error: Some(format!("its answer could not be read: {e}")),
                                ..Saved::default()
                            }
                        }));
                        break;
                    }
                    // What pickling printed.
                    Some(Ok(_)) => {}
                    Some(Err(_)) => break,
                }
            }
        }
        let Some(answer) = answer else {
            // Wedged or gone: it is ended, and the next block starts afresh (and says so).
            self.stop_kernel().await;
            return Err(ExecError::Backend(if interrupted {
                format!(
                    "saving the kept interpreter's globals took longer than {} s, and it did not stop when interrupted; it was ended, and its globals are lost",
                    wait.as_secs()
                )
            } else {
                "the kept interpreter ended while its globals were saved; they are lost".to_owned()
            }));
        };
        if let Some(error) = answer.error {
            return Err(ExecError::Backend(if interrupted {
                format!(
                    "saving the kept interpreter's globals took longer than {} s ({error}); the interpreter lives on",
                    wait.as_secs()
                )
            } else {
                format!("saving the kept interpreter's globals failed: {error}")
            }));
        }
        if over {
            return Err(ExecError::Backend(format!(
                "the kept interpreter's globals pickle to more than the {max_bytes} bytes the snapshot store has left"
            )));
        }
        file.sync_all().await.map_err(io("writing"))?;
        Ok(SavedState {
            bytes,
            saved: answer.saved,
            not_saved: answer
                .not_saved
                .into_iter()
                .map(|n| (n.name, n.why))
                .collect(),
        })
    }
}

/// One frame from the interpreter: its kind and data.
async fn read_frame(r: &mut pipe::Receiver) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    // The interpreter reads at most 64 KiB at a time; anything larger is not its frame.
    if len > 1 << 20 {
        return Err(std::io::Error::other("a frame too large"));
    }
    let mut data = vec![0u8; len];
    r.read_exact(&mut data).await?;
    Ok((head[4], data))
}

impl Session for KeptSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(async move {
            // An isolated block runs in a fresh process of the first session: the kept
            // interpreter is the task's code's to change.
            if req.language == Language::python() && !req.isolated {
                if let Ok(mut current) = self.tools.lock() {
                    current.clone_from(&ctx.tools);
                }
                let ran = self.run_python(req, ctx).await;
                if let Ok(mut current) = self.tools.lock() {
                    *current = None;
                }
                ran
            } else {
                self.inner.run(req, ctx).await
            }
        })
    }

    fn workspace(&self) -> Option<&Path> {
        self.inner.workspace()
    }

    fn host(&self) -> Option<&str> {
        self.inner.host()
    }

    fn pool_wait(&self) -> Option<std::time::Duration> {
        self.inner.pool_wait()
    }

    fn ports(&self) -> Option<std::sync::Arc<dyn tandem_executor::Ports>> {
        self.inner.ports()
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        Box::pin(async move {
            self.stop_kernel().await;
            self.inner.close().await
        })
    }

    fn put_archive(
        &mut self,
        archive: &Path,
        caps: crate::archive::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<crate::archive::ArchivedFile>, ExecError>> {
        self.inner.put_archive(archive, caps)
    }

    fn save_state(
        &mut self,
        dest: &Path,
        max_bytes: u64,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Option<SavedState>, ExecError>> {
        let dest = dest.to_owned();
        Box::pin(async move { self.save(&dest, max_bytes, wait).await.map(Some) })
    }
}

/// `.tandem/` of a workspace, held open: the kept interpreter's FIFOs are made and opened
/// beneath this handle, never by a path a block could have turned into a link.
struct Fifos(std::os::fd::OwnedFd);

/// One of the FIFOs, opened without blocking and checked to be one.
struct Fifo(std::os::fd::OwnedFd);

impl Fifos {
    fn open(&self, name: &str, write: bool) -> std::io::Result<Fifo> {
        use nix::fcntl::OFlag;
        let access = if write {
            OFlag::O_WRONLY
        } else {
            OFlag::O_RDONLY
        };
        let fd = nix::fcntl::openat(
            &self.0,
            name,
            access | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        let stat = nix::sys::stat::fstat(&fd)?;
        if stat.st_mode & nix::libc::S_IFMT != nix::libc::S_IFIFO {
            return Err(std::io::Error::other(format!(
                ".tandem/{name} is no longer the interpreter's FIFO"
            )));
        }
        Ok(Fifo(fd))
    }
}

impl Fifo {
    fn sender(self) -> std::io::Result<pipe::Sender> {
        pipe::Sender::from_owned_fd(self.0)
    }

    fn receiver(self) -> std::io::Result<pipe::Receiver> {
        pipe::Receiver::from_owned_fd(self.0)
    }
}

/// Makes `dir` afresh (whatever a block left there is removed by the keeper, however deep)
/// with the FIFOs `in`, `out` and `ctl`, every step beneath a handle: the directory is made,
/// then opened without following a link and checked to be the one made; each FIFO's mode is
/// set through a descriptor of it. The directory is world-writable with the sticky bit, as
/// `/tmp` is: a block that runs as another user (Docker) can open the FIFOs, and none but
/// their owner can rename or replace them.
fn make_fifos(dir: &Path) -> std::io::Result<Fifos> {
    use nix::sys::stat::Mode;
    use std::os::fd::AsFd as _;
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Err(std::io::Error::other("no directory for the FIFOs"));
    };
    let parent = crate::keeper::open_root(parent)?;
    crate::keeper::remove_at(parent.as_fd(), name)?;
    nix::sys::stat::mkdirat(&parent, name, Mode::from_bits_truncate(0o700))?;
    let fd = crate::keeper::open_dir_beneath(parent.as_fd(), Path::new(name))?;
    nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(0o1777))?;
    for fifo in ["in", "out", "ctl"] {
        nix::unistd::mkfifoat(&fd, fifo, Mode::from_bits_truncate(0o600))?;
        crate::keeper::set_mode(
            fd.as_fd(),
            std::ffi::OsStr::new(fifo),
            nix::sys::stat::SFlag::S_IFIFO,
            0o666,
        )?;
    }
    Ok(Fifos(fd))
}

#[cfg(test)]
mod tests {
    /// The Docker runner carries the figures code in a raw triple-quoted string.
    #[test]
    fn the_figures_code_can_be_carried_in_a_python_string() {
        assert!(!crate::PYTHON_PRELUDE.contains("\"\"\""));
        assert!(!crate::PYTHON_PRELUDE.trim_end().ends_with('\\'));
    }
}
