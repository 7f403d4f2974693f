//! One running plugin process and the JSON-RPC 2.0 connection to it: newline-delimited
//! messages on its stdin and stdout, its stderr forwarded to Tandem's log.
//!
//! Invariants:
//! - nothing the plugin sends can make Tandem panic or grow without bound: lines are read
//!   with a size cap, output goes into bounded capture buffers, and a message that breaks the
//!   protocol is logged (naming the plugin) and dropped;
//! - once its stdout closes, every waiting request fails at once and the connection is dead
//!   for good: a new one is started for the next request;
//! - dropping the connection closes the plugin's stdin, which asks it to exit, and kills its
//!   process group if it has not within [`EXIT_GRACE`].

use std::collections::{HashMap, VecDeque};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_executor::{CaptureBuffer, OutputSink, Stream};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::PluginConfig;
use crate::wire::Output;

/// How long a plugin has to exit after its stdin closes before its process group is killed.
pub(crate) const EXIT_GRACE: Duration = Duration::from_secs(2);
/// How long a write to the plugin's stdin may block (it is not reading) before it counts as
/// hung.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Protocol violations remembered for error messages.
const FAULTS_KEPT: usize = 4;
/// Lines of the plugin's stderr remembered for error messages.
const STDERR_KEPT: usize = 3;

/// Why a request got no usable answer.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The plugin answered with a JSON-RPC error.
    Rpc { code: i64, message: String },
    /// The connection is gone (the plugin exited or closed its stdout).
    Gone,
    /// No answer within the time allowed.
    TimedOut(Duration),
    /// Its stdin could not be written.
    Write(String),
}

/// A response: the result, or the error object's code and message.
type Reply = Result<Value, (i64, String)>;

/// A block's output as it streams in, bounded.
pub(crate) struct RunOutput {
    pub stdout: CaptureBuffer,
    pub stderr: CaptureBuffer,
    sink: OutputSink,
}

impl RunOutput {
    pub(crate) fn new(cap: usize, sink: OutputSink) -> Self {
        Self {
            stdout: CaptureBuffer::new(cap),
            stderr: CaptureBuffer::new(cap),
            sink,
        }
    }

    /// Appends `text` to `stream` after `skipped` bytes the plugin dropped; the kept head
    /// goes to the live sink.
    pub(crate) fn push(&mut self, stream: Stream, text: &[u8], skipped: u64) {
        let buf = match stream {
            Stream::Stdout => &mut self.stdout,
            Stream::Stderr => &mut self.stderr,
        };
        buf.skip(skipped);
        let live = buf.push(text);
        if live > 0 {
            (self.sink)(stream, &text[..live]);
        }
    }
}

/// What the reader task and the callers share.
struct Shared {
    name: Arc<str>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    runs: Mutex<HashMap<u64, Arc<Mutex<RunOutput>>>>,
    /// Cancelled once the plugin's stdout closed.
    closed: CancellationToken,
    /// Protocol violations, numbered, the latest few.
    faults: Mutex<(u64, VecDeque<(u64, String)>)>,
    stderr_tail: Mutex<VecDeque<String>>,
    /// Cancelled once the plugin's stderr closed (its last lines are in `stderr_tail`).
    stderr_closed: CancellationToken,
}

impl Shared {
    fn fault(&self, what: String) {
        tracing::warn!(plugin = %self.name, "executor plugin `{}` {what}", self.name);
        if let Ok(mut faults) = self.faults.lock() {
            faults.0 += 1;
            let n = faults.0;
            faults.1.push_back((n, what));
            if faults.1.len() > FAULTS_KEPT {
                faults.1.pop_front();
            }
        }
    }

    fn close(&self) {
        self.closed.cancel();
        // Dropping the senders fails every waiting request at once.
        if let Ok(mut pending) = self.pending.lock() {
            pending.clear();
        }
        if let Ok(mut runs) = self.runs.lock() {
            runs.clear();
        }
    }

    fn dispatch(&self, line: &[u8]) {
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        let message: Value = match serde_json::from_slice(line) {
            Ok(v) => v,
            Err(e) => {
                return self.fault(format!(
                    "sent a line that is not JSON ({e}); it was ignored: {}",
                    preview(line)
                ));
            }
        };
        let Some(object) = message.as_object() else {
            return self.fault(format!(
                "sent JSON that is not a message object; it was ignored: {}",
                preview(line)
            ));
        };
        if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return self.fault(format!(
                "sent a message without \"jsonrpc\": \"2.0\"; it was ignored: {}",
                preview(line)
            ));
        }
        match (object.get("method").and_then(Value::as_str), object.get("id")) {
            (Some(method), None) => self.notification(method, object.get("params")),
            (Some(method), Some(_)) => self.fault(format!(
                "sent a request (`{method}`), but Tandem takes only responses and notifications from a plugin; it was ignored"
            )),
            (None, Some(id)) => self.response(id, object),
            (None, None) => self.fault(format!(
                "sent a message that is neither a response nor a notification; it was ignored: {}",
                preview(line)
            )),
        }
    }

    fn response(&self, id: &Value, object: &serde_json::Map<String, Value>) {
        let Some(n) = id.as_u64() else {
            return self.fault(format!(
                "answered with id {id}, which is not an id Tandem sends; the answer was ignored"
            ));
        };
        let reply = match (object.get("result"), object.get("error")) {
            (Some(result), None) => Ok(result.clone()),
            (None, Some(error)) => Err((
                error.get("code").and_then(Value::as_i64).unwrap_or(0),
                error
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("(no message)")
                    .to_owned(),
            )),
            _ => {
                return self.fault(format!(
                    "answered request {n} with neither exactly one of `result` and `error`; the answer was ignored"
                ));
            }
        };
        let waiter = self.pending.lock().ok().and_then(|mut p| p.remove(&n));
        match waiter {
            Some(waiter) => {
                let _ = waiter.send(reply);
            }
            None => self.fault(format!(
                "answered id {n}, which Tandem never sent or no longer waits for; the answer was ignored"
            )),
        }
    }

    fn notification(&self, method: &str, params: Option<&Value>) {
        match method {
            "session/output" => {
                let output: Output = match params.map(serde::Deserialize::deserialize) {
                    Some(Ok(o)) => o,
                    Some(Err(e)) => {
                        return self.fault(format!(
                            "sent a session/output notification Tandem cannot read ({e}); it was ignored"
                        ));
                    }
                    None => {
                        return self.fault(
                            "sent a session/output notification without params; it was ignored"
                                .to_owned(),
                        );
                    }
                };
                let run = self
                    .runs
                    .lock()
                    .ok()
                    .and_then(|r| r.get(&output.run).cloned());
                // Output for a run Tandem stopped waiting for is dropped: the block is over.
                if let Some(run) = run
                    && let Ok(mut run) = run.lock()
                {
                    run.push(output.stream.into(), output.text.as_bytes(), output.skipped);
                }
            }
            // Notifications Tandem does not know are ignored, as JSON-RPC allows.
            other => tracing::debug!(plugin = %self.name, method = other, "unknown notification"),
        }
    }
}

/// The first bytes of a line, for a log message.
fn preview(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(&line[..line.len().min(120)]);
    let text = text.trim_end();
    if line.len() > 120 {
        format!("{text}...")
    } else {
        text.to_owned()
    }
}

/// What a bounded line read found.
enum Line {
    /// A whole line is in the buffer (without its newline).
    Complete,
    /// A line longer than the cap was read and thrown away.
    TooLong,
    /// The stream ended.
    Eof,
}

/// Reads one line of at most `max` bytes into `buf`; a longer one is consumed and dropped.
async fn read_line<R: AsyncBufRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Line> {
    buf.clear();
    let mut too_long = false;
    loop {
        let available = r.fill_buf().await?;
        if available.is_empty() {
            return Ok(if too_long {
                Line::TooLong
            } else if buf.is_empty() {
                Line::Eof
            } else {
                Line::Complete
            });
        }
        let (chunk, done) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (&available[..i], Some(i + 1)),
            None => (available, None),
        };
        if !too_long && buf.len() + chunk.len() <= max {
            buf.extend_from_slice(chunk);
        } else {
            too_long = true;
            buf.clear();
        }
        let used = done.unwrap_or(available.len());
        r.consume(used);
        if done.is_some() {
            return Ok(if too_long {
                Line::TooLong
            } else {
                Line::Complete
            });
        }
    }
}

/// A started plugin process and the connection to it.
pub(crate) struct Connection {
    name: Arc<str>,
    shared: Arc<Shared>,
    stdin: tokio::sync::Mutex<Option<tokio::process::ChildStdin>>,
    child: Mutex<Option<Child>>,
    pid: u32,
    next_id: AtomicU64,
}

impl Connection {
    /// Starts the plugin (its own process group, the configured environment only).
    pub(crate) fn spawn(config: &PluginConfig) -> std::io::Result<Self> {
        let Some((program, args)) = config.command.split_first() else {
            return Err(std::io::Error::other("the command is empty"));
        };
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env_clear()
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(cwd) = &config.cwd {
            cmd.current_dir(cwd);
        }
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn()?;
        let pipes = (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let (Some(stdin), Some(stdout), Some(stderr)) = pipes else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other("its pipes were not made"));
        };
        let name: Arc<str> = Arc::from(config.name.as_str());
        let shared = Arc::new(Shared {
            name: name.clone(),
            pending: Mutex::new(HashMap::new()),
            runs: Mutex::new(HashMap::new()),
            closed: CancellationToken::new(),
            faults: Mutex::new((0, VecDeque::new())),
            stderr_tail: Mutex::new(VecDeque::new()),
            stderr_closed: CancellationToken::new(),
        });
        let stdout = tokio::process::ChildStdout::from_std(stdout)?;
        let stderr = tokio::process::ChildStderr::from_std(stderr)?;
        let stdin = tokio::process::ChildStdin::from_std(stdin)?;
        let max = config.max_message_bytes;
        let reader = shared.clone();
        tokio::spawn(async move {
            let mut r = BufReader::with_capacity(64 << 10, stdout);
            let mut line = Vec::new();
            loop {
                match read_line(&mut r, &mut line, max).await {
                    Ok(Line::Complete) => reader.dispatch(&line),
                    Ok(Line::TooLong) => reader.fault(format!(
                        "sent a message of more than {max} bytes; it was dropped"
                    )),
                    Ok(Line::Eof) => break,
                    Err(e) => {
                        reader.fault(format!("could not be read from: {e}"));
                        break;
                    }
                }
            }
            reader.close();
        });
        let logger = shared.clone();
        tokio::spawn(async move {
            let mut r = BufReader::new(stderr);
            let mut line = Vec::new();
            while let Ok(Line::Complete | Line::TooLong) = read_line(&mut r, &mut line, 4096).await
            {
                let text = String::from_utf8_lossy(&line).into_owned();
                tracing::info!(plugin = %logger.name, "{text}");
                if let Ok(mut tail) = logger.stderr_tail.lock() {
                    tail.push_back(text);
                    if tail.len() > STDERR_KEPT {
                        tail.pop_front();
                    }
                }
            }
            logger.stderr_closed.cancel();
        });
        Ok(Self {
            name,
            shared,
            stdin: tokio::sync::Mutex::new(Some(stdin)),
            pid: child.id(),
            child: Mutex::new(Some(child)),
            next_id: AtomicU64::new(1),
        })
    }

    /// The plugin's process id (which is also its process group's).
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the plugin is still there to answer.
    pub(crate) fn alive(&self) -> bool {
        !self.shared.closed.is_cancelled()
            && self
                .child
                .lock()
                .ok()
                .and_then(|mut c| c.as_mut().map(|c| matches!(c.try_wait(), Ok(None))))
                .unwrap_or(false)
    }

    async fn send(&self, message: &Value) -> Result<(), CallError> {
        let mut line = serde_json::to_vec(message).map_err(|e| CallError::Write(e.to_string()))?;
        line.push(b'\n');
        let mut stdin = self.stdin.lock().await;
        let Some(pipe) = stdin.as_mut() else {
            return Err(CallError::Gone);
        };
        let write = async {
            pipe.write_all(&line).await?;
            pipe.flush().await
        };
        match tokio::time::timeout(WRITE_TIMEOUT, write).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(CallError::Write(e.to_string())),
            Err(_) => Err(CallError::Write(format!(
                "it read nothing from its stdin for {} s",
                WRITE_TIMEOUT.as_secs()
            ))),
        }
    }

    /// Sends a notification.
    pub(crate) async fn notify(&self, method: &str, params: Value) -> Result<(), CallError> {
        self.send(&json!({"jsonrpc": "2.0", "method": method, "params": params}))
            .await
    }

    /// Sends a request and returns its id and where its answer will come; with `output`,
    /// the request's `session/output` notifications go there.
    pub(crate) async fn begin(
        &self,
        method: &str,
        params: Value,
        output: Option<Arc<Mutex<RunOutput>>>,
    ) -> Result<(u64, oneshot::Receiver<Reply>), CallError> {
        if self.shared.closed.is_cancelled() {
            return Err(CallError::Gone);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        if let Ok(mut pending) = self.shared.pending.lock() {
            pending.insert(id, tx);
        }
        if let Some(output) = output
            && let Ok(mut runs) = self.shared.runs.lock()
        {
            runs.insert(id, output);
        }
        let sent = self
            .send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        if let Err(e) = sent {
            self.forget(id);
            return Err(e);
        }
        Ok((id, rx))
    }

    /// Stops routing anything for request `id`.
    pub(crate) fn forget(&self, id: u64) {
        if let Ok(mut pending) = self.shared.pending.lock() {
            pending.remove(&id);
        }
        if let Ok(mut runs) = self.shared.runs.lock() {
            runs.remove(&id);
        }
    }

    /// A request answered within `timeout`.
    pub(crate) async fn call(
        &self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, CallError> {
        let (id, rx) = self.begin(method, params, None).await?;
        let answer = tokio::time::timeout(timeout, rx).await;
        self.forget(id);
        match answer {
            Ok(Ok(Ok(result))) => Ok(result),
            Ok(Ok(Err((code, message)))) => Err(CallError::Rpc { code, message }),
            Ok(Err(_)) => Err(CallError::Gone),
            Err(_) => Err(CallError::TimedOut(timeout)),
        }
    }

    /// The number of the latest protocol violation, to ask later what happened since.
    pub(crate) fn fault_mark(&self) -> u64 {
        self.shared.faults.lock().map(|f| f.0).unwrap_or(0)
    }

    /// The protocol violations after `mark`, joined for an error message.
    pub(crate) fn faults_since(&self, mark: u64) -> Option<String> {
        let faults = self.shared.faults.lock().ok()?;
        let said: Vec<&str> = faults
            .1
            .iter()
            .filter(|(n, _)| *n > mark)
            .map(|(_, what)| what.as_str())
            .collect();
        (!said.is_empty()).then(|| said.join("; "))
    }

    /// Kills the plugin's process group now and reaps it on a thread of its own; `why` goes
    /// to the log.
    pub(crate) fn kill(&self, why: &str) {
        tracing::warn!(plugin = %self.name, "executor plugin `{}` {why}; killing it", self.name);
        kill_group(self.pid);
        if let Some(mut child) = self.child.lock().ok().and_then(|mut c| c.take()) {
            let _ = child.kill();
            let _ = std::thread::Builder::new()
                .name("tandem-plugin-reap".to_owned())
                .spawn(move || child.wait());
        }
        self.shared.close();
    }

    /// How the plugin ended, with its last stderr lines: for errors about a plugin that is
    /// gone. Waits up to a second for it to be reaped.
    pub(crate) async fn how_it_ended(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(1);
        let status = loop {
            let polled = self
                .child
                .lock()
                .ok()
                .and_then(|mut c| c.as_mut().map(Child::try_wait));
            match polled {
                Some(Ok(Some(status))) => break Some(status),
                Some(Ok(None)) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                _ => break None,
            }
        };
        let killed = self.child.lock().is_ok_and(|c| c.is_none());
        let mut said = match status {
            Some(s) => match (s.code(), std::os::unix::process::ExitStatusExt::signal(&s)) {
                (Some(code), _) => format!("exited with status {code}"),
                (None, Some(signal)) => format!("was killed by signal {signal}"),
                (None, None) => "ended".to_owned(),
            },
            None if killed => "was killed by Tandem".to_owned(),
            None => "closed its stdout".to_owned(),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let _ = tokio::time::timeout(left, self.shared.stderr_closed.cancelled()).await;
        let tail: Vec<String> = self
            .shared
            .stderr_tail
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        if let Some(last) = tail.last() {
            said.push_str(&format!(" (its last stderr line: {last})"));
        }
        said
    }
}

fn kill_group(pid: u32) {
    if let Ok(pgid) = i32::try_from(pid)
        && pgid > 0
    {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pgid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.shared.close();
        // Closing stdin asks the plugin to exit; it gets EXIT_GRACE to clean up its own.
        if let Ok(mut stdin) = self.stdin.try_lock() {
            stdin.take();
        }
        let Some(mut child) = self.child.lock().ok().and_then(|mut c| c.take()) else {
            return;
        };
        let pid = self.pid;
        let _ = std::thread::Builder::new()
            .name("tandem-plugin-exit".to_owned())
            .spawn(move || {
                let deadline = Instant::now() + EXIT_GRACE;
                while Instant::now() < deadline {
                    if !matches!(child.try_wait(), Ok(None)) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                // The group goes too: what the plugin started must not outlive it.
                kill_group(pid);
                let _ = child.kill();
                let _ = child.wait();
            });
    }
}
