//! Tandem's in-sandbox runner (`runner.py`) and the client side of its protocol: one request
//! per line in, frames out. The container executors (Docker, Kubernetes) start the runner in
//! their sandbox, by attach or by exec, and talk to it the same way through this crate.

pub mod mirror;
pub mod relay;
pub mod session;

use std::collections::HashMap;
use std::pin::Pin;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tandem_executor::{
    CaptureBuffer, Captured, ExecContext, ExecError, ExecOutcome, ExecRequest, ExitStatus, Limits,
    Stream,
};
use tandem_executor_kit::process::{Bounded, bounded};
use tandem_executor_kit::workspace::block_script_path;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::bytes::BytesMut;
use tokio_util::codec::{Decoder, LengthDelimitedCodec};

/// The runner's source, run as `python3 -I -c RUNNER USER [volume]`: `runner.py`, after the
/// shared Python prelude as the string `PRELUDE` its blocks' boot starts with.
pub static RUNNER: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "PRELUDE = r\"\"\"{}\"\"\"\n{}",
        tandem_executor_kit::PYTHON_PRELUDE,
        include_str!("runner.py")
    )
});

/// A short program that reads the runner's source from stdin (its length in decimal on one
/// line, then the source) and runs it, as `python3 -I -c BOOT USER [volume]`: for sandboxes
/// entered by exec, where the whole runner would not fit a command line. Nothing else is
/// sent before the runner says it is ready, so its buffered reads take nothing of the
/// requests.
pub const BOOT: &str = "import sys\nn = int(sys.stdin.buffer.readline())\nexec(compile(sys.stdin.buffer.read(n), 'tandem-runner', 'exec'))\n";

/// What a runner started with [`BOOT`] must be sent first.
pub fn boot_payload() -> Vec<u8> {
    let mut payload = format!("{}\n", RUNNER.len()).into_bytes();
    payload.extend_from_slice(RUNNER.as_bytes());
    payload
}

/// How long a runner may take to start and say it is ready, or to finish a request.
pub const READY_LIMIT: Duration = Duration::from_secs(30);
/// How long a killed block may take to be reported before the sandbox is given up on.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// What the runner says, one frame at a time.
#[derive(Debug)]
pub enum Frame {
    /// The runner started and waits for requests.
    Ready,
    /// Bytes a block wrote.
    Output(Stream, Vec<u8>),
    /// This many bytes of a stream were dropped; its tail follows.
    Dropped(Stream, u64),
    /// The block ended.
    Exit(ExitFrame),
    /// Bytes the block wrote on its tools channel.
    Tool(Vec<u8>),
    /// What the block changed in a workspace that is the sandbox's own.
    Changes(Changes),
    /// A piece of the tar of the files a block changed, sent inline.
    Archive(Vec<u8>),
    /// A request other than a block finished.
    Done,
    /// The runner failed, or what it sent is not the protocol.
    Error(String),
}

/// The runner's report of what a block changed in the workspace (`c` frame).
#[derive(Debug, Default, Deserialize)]
pub struct Changes {
    /// Too much, or something unreadable: copy the whole workspace.
    pub all: bool,
    /// Entries new or changed: path and kind (`f` file, `d` directory, `o` anything else).
    pub changed: Vec<(String, String)>,
    /// Entries gone.
    pub removed: Vec<String>,
    /// The changed files came before this report, as a tar in `a` frames.
    #[serde(default)]
    pub inline: bool,
}

/// Most bytes of changed files the runner sends inline (its `INLINE_BYTES`, and the tar's
/// headers): more is not the runner's.
const INLINE_MAX: usize = 512 * 1024;

/// How a block ended, as the runner saw it.
#[derive(Debug, Deserialize)]
pub struct ExitFrame {
    /// Its exit code, when it exited.
    pub code: Option<i32>,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
    /// The sandbox's memory limit killed something while it ran.
    pub oom: bool,
    /// What the block used, as the runner measured it in the sandbox.
    #[serde(default)]
    pub resources: Option<Box<tandem_executor::Resources>>,
}

/// Largest frame the runner sends (its output chunks are 64 KiB); a bigger header is not the
/// runner's, and is refused before anything is buffered for it.
const MAX_FRAME: usize = 1 << 20;

/// The runner's framing: a kind byte, a big-endian `u32` payload length, the payload; a
/// length over [`MAX_FRAME`] is refused before anything is buffered for it.
fn frame_codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_offset(1)
        .length_field_type::<u32>()
        // Yield the whole frame, kind and length included: the length counts the payload.
        .length_adjustment(5)
        .num_skip(0)
        .max_frame_length(MAX_FRAME)
        .new_codec()
}

/// Splits complete frames off the front of `buf`; a frame over [`MAX_FRAME`] ends the stream
/// with an error (the rest of `buf` is dropped).
fn parse_frames(codec: &mut LengthDelimitedCodec, buf: &mut BytesMut) -> Vec<Frame> {
    let mut frames = Vec::new();
    loop {
        match codec.decode(buf) {
            Ok(Some(frame)) => match (frame.first(), frame.get(5..)) {
                (Some(&kind), Some(payload)) => frames.push(frame_of(kind, payload)),
                _ => frames.push(Frame::Error("a frame shorter than its header".to_owned())),
            },
            Ok(None) => return frames,
            Err(_) => {
                let len = buf
                    .get(1..5)
                    .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                let kind = buf.first().map_or('?', |k| char::from(*k));
                frames.push(Frame::Error(format!(
                    "a frame of {len} bytes (kind {kind:?}) is over the {MAX_FRAME} byte limit"
                )));
                buf.clear();
                return frames;
            }
        }
    }
}

/// One frame, by its kind byte.
fn frame_of(kind: u8, payload: &[u8]) -> Frame {
    let stream = |k: u8| match k.to_ascii_lowercase() {
        b'e' => Stream::Stderr,
        _ => Stream::Stdout,
    };
    match kind {
        b'R' => Frame::Ready,
        k @ (b'o' | b'e') => Frame::Output(stream(k), payload.to_vec()),
        k @ (b'O' | b'E') => {
            let mut n = [0u8; 8];
            n.copy_from_slice(payload.get(..8).unwrap_or(&[0; 8]));
            Frame::Dropped(stream(k), u64::from_be_bytes(n))
        }
        b'x' => match serde_json::from_slice(payload) {
            Ok(exit) => Frame::Exit(exit),
            Err(e) => Frame::Error(format!("bad exit frame: {e}")),
        },
        b'd' => Frame::Done,
        b't' => Frame::Tool(payload.to_vec()),
        b'a' => Frame::Archive(payload.to_vec()),
        b'c' => match serde_json::from_slice(payload) {
            Ok(changes) => Frame::Changes(changes),
            Err(e) => Frame::Error(format!("bad changes frame: {e}")),
        },
        _ => Frame::Error(String::from_utf8_lossy(payload).into_owned()),
    }
}

/// Turns the bytes of the runner's stdout and stderr, as a transport delivers them, into
/// frames for a [`Conn`].
pub struct FrameReader {
    codec: LengthDelimitedCodec,
    buf: BytesMut,
    tx: mpsc::UnboundedSender<Frame>,
}

impl FrameReader {
    /// Takes bytes of the runner's stdout; `false` once the connection is over (its reader
    /// went away, or the stream is out of step after an error and must not be read on).
    pub fn stdout(&mut self, bytes: &[u8]) -> bool {
        self.buf.extend_from_slice(bytes);
        for frame in parse_frames(&mut self.codec, &mut self.buf) {
            let broken = matches!(frame, Frame::Error(_));
            if self.tx.send(frame).is_err() || broken {
                return false;
            }
        }
        true
    }

    /// Takes bytes of the runner's stderr, which it writes only when it fails.
    pub fn stderr(&mut self, bytes: &[u8]) -> bool {
        let text = String::from_utf8_lossy(bytes);
        tracing::warn!(runner = %text.trim_end(), "the runner wrote to stderr");
        self.tx
            .send(Frame::Error(text.trim_end().to_owned()))
            .is_ok()
    }
}

/// A live connection to a runner: requests go to `input`, frames come from its reader.
pub struct Conn {
    input: Pin<Box<dyn AsyncWrite + Send>>,
    frames: mpsc::UnboundedReceiver<Frame>,
}

impl Conn {
    /// A connection writing requests to `input`, and the reader its transport feeds.
    pub fn new(input: Pin<Box<dyn AsyncWrite + Send>>) -> (Self, FrameReader) {
        let (tx, frames) = mpsc::unbounded_channel();
        let reader = FrameReader {
            codec: frame_codec(),
            buf: BytesMut::new(),
            tx,
        };
        (Self { input, frames }, reader)
    }

    /// Sends one request.
    pub async fn send(&mut self, request: &Request<'_>) -> std::io::Result<()> {
        send_on(&mut self.input, request).await
    }

    /// Waits for the runner's first frame: `Ok` when it says it is ready, else what it said
    /// instead (`None`: the stream ended), or `Err` after [`READY_LIMIT`].
    pub async fn ready(
        &mut self,
    ) -> Result<Result<(), Option<Frame>>, tokio::time::error::Elapsed> {
        tokio::time::timeout(READY_LIMIT, self.frames.recv())
            .await
            .map(|frame| match frame {
                Some(Frame::Ready) => Ok(()),
                other => Err(other),
            })
    }

    /// Whether the runner's stream is still open with nothing unread (a runner that died
    /// while idle is not).
    pub fn alive(&mut self) -> bool {
        matches!(
            self.frames.try_recv(),
            Err(mpsc::error::TryRecvError::Empty)
        )
    }

    /// Sends `op` and waits for its `d`, at most `limit`.
    pub async fn request_done(
        &mut self,
        op: &Request<'_>,
        limit: Duration,
    ) -> Result<(), ExecError> {
        self.send(op)
            .await
            .map_err(|e| ExecError::io("talking to the sandbox's runner", e))?;
        let waited = tokio::time::timeout(limit, async {
            while let Some(frame) = self.frames.recv().await {
                match frame {
                    Frame::Done => return Ok(()),
                    Frame::Error(e) => return Err(e),
                    _ => {}
                }
            }
            Err("the runner went away".to_owned())
        })
        .await;
        match waited {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ExecError::Backend(format!("Tandem's runner failed: {e}"))),
            Err(_) => Err(ExecError::Backend(format!(
                "Tandem's runner did not answer within {limit:?}"
            ))),
        }
    }
}

async fn send_on(
    input: &mut Pin<Box<dyn AsyncWrite + Send>>,
    request: &Request<'_>,
) -> std::io::Result<()> {
    let mut line = serde_json::to_string(request).map_err(std::io::Error::other)?;
    line.push('\n');
    input.write_all(line.as_bytes()).await?;
    input.flush().await
}

/// A block's tools channel, relayed through the runner: the bytes its code writes arrive as
/// `t` frames and are answered here; the answers go back as `tool` requests.
struct Relay {
    to_serve: tokio::io::WriteHalf<tokio::io::DuplexStream>,
    answers: mpsc::UnboundedReceiver<String>,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl Relay {
    fn new(handler: tandem_executor_kit::toolchannel::ToolHandler, token: String) -> Self {
        use tokio::io::AsyncBufReadExt;
        let (served, ours) = tokio::io::duplex(1 << 16);
        let serve = tokio::spawn(tandem_executor_kit::toolchannel::serve(
            served, token, handler,
        ));
        let (read, to_serve) = tokio::io::split(ours);
        let (tx, answers) = mpsc::unbounded_channel();
        let pump = tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if tx.send(line + "\n").is_err() {
                    return;
                }
            }
        });
        Self {
            to_serve,
            answers,
            tasks: [serve, pump],
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A request to the runner, one JSON line each.
#[derive(Debug, serde::Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request<'a> {
    /// Run a block: write `code` to `path` (removed afterwards when `transient`), run `argv`
    /// as the block's user with `env` and `rlimits`, stream at most `cap` bytes per stream.
    Run {
        /// The interpreter and the script.
        argv: [&'a str; 2],
        /// Where the script is written.
        path: &'a str,
        /// The script is removed after the block.
        transient: bool,
        /// The block's code.
        code: &'a str,
        /// The block's whole environment.
        env: HashMap<&'a str, &'a str>,
        /// Resource limits, by `RLIMIT_*` name.
        rlimits: Vec<(String, u64)>,
        /// Bytes kept per stream.
        cap: usize,
        /// The tools module and command, by file name, when the block may call tools.
        #[serde(skip_serializing_if = "Option::is_none")]
        tools: Option<HashMap<&'a str, &'a str>>,
    },
    /// Kill every process of the running block; it is then reported as done.
    Kill,
    /// An answer on the running block's tools channel.
    Tool {
        /// The bytes to write to it.
        data: &'a str,
    },
    /// Remove the files of a temporary workspace, which the block's user may own.
    Wipe,
    /// Give a kept workspace's files back to the host user.
    Release,
    /// Take the workspace as it is now as what Tandem has seen.
    Rescan,
}

/// The environment every block in a container starts with, then `extra`.
pub fn base_env(extra: &[(String, String)]) -> impl Iterator<Item = (&str, &str)> {
    [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("LANG", "C.UTF-8"),
        ("HOME", "/workspace"),
        ("TMPDIR", "/tmp"),
        // Caches (matplotlib's font list, pip's) live and die with the sandbox instead of
        // showing up among the task's files.
        ("XDG_CACHE_HOME", "/tmp/.cache"),
    ]
    .into_iter()
    .chain(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())))
}

/// What a sandbox offers a block: its languages, and the environment every block starts with.
pub struct Sandbox<'a> {
    /// The executor's name, for errors.
    pub executor: &'a str,
    /// The languages it runs.
    pub languages: &'a [tandem_executor::Language],
    /// Variables every block gets, before the executor's own.
    pub env: Vec<(&'a str, &'a str)>,
}

/// One block run through a runner, as far as it went.
pub struct Block {
    /// How it ended.
    pub status: ExitStatus,
    /// What it wrote.
    pub stdout: Captured,
    /// What it wrote on stderr.
    pub stderr: Captured,
    /// How long it took.
    pub duration: Duration,
    /// What it used, when the runner measured it.
    pub resources: Option<tandem_executor::Resources>,
    /// The runner reported the block's end; when it did not, the runner is gone or stuck
    /// and the connection must not be used again.
    pub answered: bool,
    /// The runner failed while the block ran.
    pub runner_error: Option<String>,
    /// What the block changed, when the runner reports changes.
    pub changes: Option<Changes>,
    /// The tar of the changed files the runner sent inline.
    pub inline: Vec<u8>,
}

impl Block {
    /// What the block changed and the tar that came inline, for the mirror: everything, when
    /// the runner did not answer for the block (what it did is unknown).
    pub fn take_changes(&mut self) -> (Changes, Vec<u8>) {
        let changes = match self.changes.take() {
            Some(changes) if self.answered => changes,
            _ if self.answered => Changes::default(),
            _ => Changes {
                all: true,
                ..Changes::default()
            },
        };
        (changes, std::mem::take(&mut self.inline))
    }

    /// The outcome of a block the runner answered for.
    pub fn outcome(self) -> ExecOutcome {
        ExecOutcome {
            status: self.status,
            stdout: self.stdout,
            stderr: self.stderr,
            duration: self.duration,
            resources: self.resources,
        }
    }
}

/// What [`run`] did not get to: a refused block is an outcome, not an error.
pub enum Prepared {
    /// The block's script path could not be used.
    Refused(Box<ExecOutcome>),
    /// Run it.
    Ready(Box<Block>),
}

/// Runs block number `number` of a session on `conn`: writes its script into `/workspace`,
/// streams its output to `ctx`, relays its tools, and stops it at its deadline or on cancel.
/// The one error is a language the sandbox does not run; a runner that fails is a block it
/// did not answer for.
pub async fn run(
    conn: &mut Conn,
    sandbox: &Sandbox<'_>,
    req: &ExecRequest,
    ctx: &ExecContext,
    limits: &Limits,
    number: u32,
) -> Result<Prepared, ExecError> {
    let Some(argv0) = req
        .language
        .program()
        .filter(|_| sandbox.languages.contains(&req.language))
    else {
        return Err(ExecError::unsupported(
            &req.language,
            sandbox.executor,
            sandbox.languages,
        ));
    };
    // Unnamed blocks run from a hidden file in the workspace, removed afterwards, so that
    // imports see the files earlier blocks saved.
    let (rel, transient) = match block_script_path(&req.code, number, req.language.extension()) {
        Ok(named) => named,
        Err(e) => {
            return Ok(Prepared::Refused(Box::new(ExecOutcome::refused(
                &e.to_string(),
            ))));
        }
    };
    let path = format!("/workspace/{}", rel.display());
    // Memory is the sandbox's cgroup limit, not an address-space rlimit.
    let rlimits: Vec<(String, u64)> = tandem_executor_kit::process::rlimits(limits)
        .into_iter()
        .filter(|(r, _)| *r != nix::sys::resource::Resource::RLIMIT_AS)
        .filter_map(|(r, limit)| limit.map(|l| (format!("{r:?}"), l)))
        .collect();
    let mut env: HashMap<&str, &str> = sandbox
        .env
        .iter()
        .copied()
        .chain([("PYTHONUNBUFFERED", "1"), ("PYTHONDONTWRITEBYTECODE", "1")])
        .collect();
    if req.isolated {
        // HOME is the workspace: its user site is the blocks' to fill.
        env.insert("PYTHONNOUSERSITE", "1");
    }
    let token = tandem_executor_kit::toolchannel::secret();
    let mut relay = ctx.tools.clone().map(|handler| {
        env.insert("TANDEM_TOOLS_TOKEN", &token);
        Relay::new(handler, token.clone())
    });
    let tools = relay.as_ref().map(|_| {
        HashMap::from([
            (
                "tandem_tools.py",
                tandem_executor_kit::toolchannel::MODULE_PY,
            ),
            ("tandem-tool", tandem_executor_kit::toolchannel::COMMAND),
        ])
    });
    let request = Request::Run {
        argv: [argv0, &path],
        path: &path,
        transient,
        code: &req.code,
        env,
        rlimits,
        cap: limits.output_bytes,
        tools,
    };
    let timeout = req.timeout.unwrap_or(limits.wall);
    let cap = limits.output_bytes;
    let started = Instant::now();
    let mut streams = Streams {
        out: CaptureBuffer::new(cap),
        err: CaptureBuffer::new(cap),
        runner_error: None,
        changes: None,
        inline: Vec::new(),
    };
    if let Err(e) = conn.send(&request).await {
        streams.runner_error = Some(format!("sending it a block failed: {e}"));
        return Ok(Prepared::Ready(Box::new(streams.into_block(
            ExitStatus::Signaled(9),
            started,
            false,
        ))));
    }
    let (stopped, exit) = match bounded(
        streams.until_exit(conn, ctx, relay.as_mut()),
        timeout,
        &ctx.cancel,
    )
    .await
    {
        Bounded::Finished(exit) => (None, exit),
        stop => {
            let stopped = match stop {
                Bounded::TimedOut => ExitStatus::TimedOut,
                _ => ExitStatus::Cancelled,
            };
            // The runner kills every process of the block and then reports it.
            let _ = conn.send(&Request::Kill).await;
            let exit =
                tokio::time::timeout(KILL_GRACE, streams.until_exit(conn, ctx, relay.as_mut()))
                    .await
                    .ok()
                    .flatten();
            (Some(stopped), exit)
        }
    };
    let answered = exit.is_some();
    let resources = exit.as_ref().and_then(|e| e.resources.as_deref().cloned());
    let status = match (stopped, exit) {
        (Some(stopped), _) => stopped,
        (None, Some(ExitFrame { oom: true, .. })) => ExitStatus::OutOfMemory,
        (
            None,
            Some(ExitFrame {
                code: Some(code), ..
            }),
        ) => ExitStatus::Exited(code),
        (None, Some(ExitFrame { signal, .. })) => ExitStatus::Signaled(signal.unwrap_or(9)),
        (None, None) => ExitStatus::Signaled(9),
    };
    let mut block = streams.into_block(status, started, answered);
    block.resources = resources;
    Ok(Prepared::Ready(Box::new(block)))
}

/// A block's two output streams as the runner reports them.
struct Streams {
    out: CaptureBuffer,
    err: CaptureBuffer,
    runner_error: Option<String>,
    changes: Option<Changes>,
    /// The tar of the changed files, as the runner sent it inline.
    inline: Vec<u8>,
}

impl Streams {
    fn into_block(self, status: ExitStatus, started: Instant, answered: bool) -> Block {
        Block {
            status,
            stdout: self.out.finish(),
            stderr: self.err.finish(),
            duration: started.elapsed(),
            resources: None,
            answered,
            runner_error: self.runner_error,
            changes: self.changes,
            inline: self.inline,
        }
    }

    /// Takes the runner's frames until the block's exit report (`None`: the runner is gone
    /// or failed); stopping it between frames loses nothing, so it can be resumed.
    async fn until_exit(
        &mut self,
        conn: &mut Conn,
        ctx: &ExecContext,
        mut relay: Option<&mut Relay>,
    ) -> Option<ExitFrame> {
        let Conn { input, frames } = conn;
        loop {
            let answer = async {
                match relay.as_mut() {
                    Some(r) => r.answers.recv().await,
                    None => std::future::pending().await,
                }
            };
            let frame = tokio::select! {
                frame = frames.recv() => frame?,
                Some(line) = answer => {
                    if send_on(input, &Request::Tool { data: &line }).await.is_err() {
                        return None;
                    }
                    continue;
                }
            };
            match frame {
                Frame::Tool(bytes) => {
                    if let Some(r) = relay.as_mut() {
                        // A channel that stopped being served (a wrong token) takes no more.
                        let _ = r.to_serve.write_all(&bytes).await;
                    }
                }
                Frame::Output(stream, data) => {
                    let buf = match stream {
                        Stream::Stdout => &mut self.out,
                        Stream::Stderr => &mut self.err,
                    };
                    let live = buf.push(&data);
                    if live > 0 {
                        (ctx.sink)(stream, &data[..live]);
                    }
                }
                Frame::Dropped(Stream::Stdout, n) => self.out.skip(n),
                Frame::Dropped(Stream::Stderr, n) => self.err.skip(n),
                Frame::Changes(changes) => self.changes = Some(changes),
                Frame::Archive(bytes) => {
                    if self.inline.len() + bytes.len() > INLINE_MAX {
                        self.runner_error =
                            Some(format!("changed files inline over {INLINE_MAX} bytes"));
                        return None;
                    }
                    self.inline.extend_from_slice(&bytes);
                }
                Frame::Exit(exit) => return Some(exit),
                Frame::Error(e) => {
                    self.runner_error = Some(e);
                    return None;
                }
                Frame::Ready | Frame::Done => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_across_chunks() {
        let mut wire = Vec::new();
        for (k, p) in [
            (b'R', b"{}".to_vec()),
            (b'o', b"hi\n".to_vec()),
            (b'E', 7u64.to_be_bytes().to_vec()),
        ] {
            wire.push(k);
            wire.extend_from_slice(&(p.len() as u32).to_be_bytes());
            wire.extend_from_slice(&p);
        }
        let mut codec = frame_codec();
        let mut buf = BytesMut::from(&wire[..7]);
        let first = parse_frames(&mut codec, &mut buf);
        assert!(matches!(first.as_slice(), [Frame::Ready]));
        buf.extend_from_slice(&wire[7..]);
        let rest = parse_frames(&mut codec, &mut buf);
        assert!(matches!(
            rest.as_slice(),
            [Frame::Output(Stream::Stdout, d), Frame::Dropped(Stream::Stderr, 7)] if d == b"hi\n"
        ));
        assert!(buf.is_empty());
    }

    #[test]
    fn a_frame_claiming_gigabytes_is_refused_before_it_is_buffered() {
        let mut buf = BytesMut::from(&b"o"[..]);
        buf.extend_from_slice(&u32::MAX.to_be_bytes());
        buf.extend_from_slice(b"the start of 4 GiB");
        let frames = parse_frames(&mut frame_codec(), &mut buf);
        assert!(
            matches!(frames.as_slice(), [Frame::Error(e)] if e == "a frame of 4294967295 bytes (kind 'o') is over the 1048576 byte limit"),
            "{frames:?}"
        );
        assert!(buf.is_empty());
    }
}
