//! The executor agent's half of a tool call: check it, ask about it, run it where its tool
//! runs, and answer it. Every call gets exactly one answer, in the calls' order, whatever
//! goes wrong with it; the other calls of the reply still run.

use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use tandem_executor::{ExecError, Language};
use tandem_protocol::{EventMsg, ToolCall, ToolReply};
use tracing::Instrument;

use crate::blocks::{self, RunOptions, SessionSlot};
use crate::extract::CodeBlock;
use crate::tools::{Runs, Tool, ToolBox};

/// How many times in a row one call (same tool, same arguments) is run before the next one
/// is refused as a loop.
const REPEATS: usize = 3;

/// Most bytes of an HTTP or MCP tool's answer that are kept.
const HTTP_CAP: usize = 1 << 20;

/// A call refused because the same call was just made [`REPEATS`] times in a row.
#[derive(Debug, thiserror::Error)]
#[error(
    "error: not run: `{0}` was called with these same arguments {REPEATS} times in a row, and its answer will not change. Take another way, or give your answer."
)]
struct Repeated(String);

/// Why a tool that runs beside the sandbox (an HTTP endpoint, an MCP server) gave no answer.
#[derive(Debug, thiserror::Error)]
enum BesideError {
    /// No HTTP client could be made.
    #[error("{0}")]
    Client(String),
    /// The endpoint did not answer, or its answer broke off.
    #[error("{what} ({why})")]
    Http {
        /// What did not happen.
        what: &'static str,
        /// The innermost cause.
        why: String,
    },
    /// The endpoint answered with a failure status.
    #[error("the endpoint answered {status}: {body}")]
    Status {
        /// Its status.
        status: reqwest::StatusCode,
        /// What it said, trimmed.
        body: String,
    },
    /// The MCP server's error.
    #[error(transparent)]
    Mcp(#[from] crate::tools::mcp::McpError),
    /// A tool that runs inside the sandbox.
    #[error("not a tool that runs beside the sandbox")]
    Inside,
}

/// Notes `call` with its checked `args` in `recent`; refused when the same call was made
/// [`REPEATS`] times in a row before it.
fn not_repeated(
    recent: &mut Vec<String>,
    call: &ToolCall,
    args: &Map<String, Value>,
) -> Result<(), Repeated> {
    let key = format!("{}\n{}", call.name, Value::Object(args.clone()));
    let n = REPEATS;
    if recent.len() >= n && recent[recent.len() - n..].iter().all(|k| *k == key) {
        return Err(Repeated(call.name.clone()));
    }
    recent.push(key);
    if recent.len() > n {
        recent.remove(0);
    }
    Ok(())
}

/// What lets the code of an agent's blocks call `tools` (its tools), or `None` when there
/// is nothing code could call (`execute_code` alone).
pub fn code_tools(tools: Option<std::sync::Arc<ToolBox>>) -> Option<blocks::CodeTools> {
    let tools = tools.filter(|t| t.tools().iter().any(|t| t.runs != Runs::Code))?;
    Some(std::sync::Arc::new(
        move |index, executor, spec, opts: &RunOptions, task_calls| {
            code_handler(
                tools.clone(),
                executor,
                spec,
                index,
                opts.clone(),
                task_calls,
            )
        },
    ))
}

/// One answered call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answered {
    /// The answer the model reads.
    pub reply: ToolReply,
    /// Whether the call failed.
    pub is_error: bool,
}

/// Runs `calls` with `tools`, numbered from `first` in the reply's events. Calls that run in
/// the session run one after another, in order; HTTP and MCP calls run beside them. `Err`
/// means the sandbox broke.
pub async fn run_calls(
    slot: &mut SessionSlot,
    tools: &ToolBox,
    calls: &[ToolCall],
    first: u32,
    opts: &RunOptions,
) -> Result<Vec<Answered>, ExecError> {
    let cap = slot.blocks_per_reply();
    let mut answers: Vec<Option<Answered>> = vec![None; calls.len()];
    let mut in_session = Vec::new();
    let mut beside = Vec::new();
    // A call the tools took under another name (`python` for `execute_code`) is told and
    // answered under the tool's, with the arguments it was taken with.
    let mut named: Vec<ToolCall> = Vec::with_capacity(calls.len());
    for (i, call) in calls.iter().enumerate() {
        let index = first + u32::try_from(i).unwrap_or(u32::MAX);
        let checked = if i >= cap {
            Err(format!(
                "error: not run: at most {cap} calls are run from one reply; call again with fewer."
            ))
        } else {
            tools.check(call).map_err(|e| e.to_string())
        };
        let call = match &checked {
            Ok((tool, args)) if tool.name != call.name => ToolCall {
                name: tool.name.clone(),
                arguments: Value::Object(args.clone()).to_string(),
                ..call.clone()
            },
            _ => call.clone(),
        };
        let refused = checked.and_then(|(tool, args)| {
            not_repeated(&mut slot.recent, &call, &args)
                .map(|()| (tool, args))
                .map_err(|e| e.to_string())
        });
        match refused {
            Err(text) => {
                told_call(&call, index, opts);
                let span = crate::trace::tool(&call.name, &call.id);
                crate::trace::fail(&span, "refused", &text);
                answers[i] = Some(answer(&call, index, text, true, Instant::now(), opts));
            }
            Ok((tool, args)) => match &tool.runs {
                Runs::Http(_) | Runs::Mcp(..) => beside.push((i, index, tool, args)),
                _ => in_session.push((i, index, tool, args)),
            },
        }
        named.push(call);
    }
    let calls = named.as_slice();
    let session = async {
        let mut done = Vec::new();
        for (i, index, tool, args) in in_session {
            let call = &calls[i];
            let span = crate::trace::tool(&call.name, &call.id);
            let answered = async {
                match &tool.runs {
                    Runs::Code => run_code(slot, call, &args, index, opts).await,
                    _ => run_command(slot, tool, call, &args, index, opts).await,
                }
            }
            .instrument(span.clone())
            .await?;
            traced(&span, &answered);
            done.push((i, answered));
        }
        Ok::<_, ExecError>(done)
    };
    let http =
        futures::future::join_all(beside.into_iter().map(|(i, index, tool, args)| async move {
            let span = crate::trace::tool(&calls[i].name, &calls[i].id);
            let answered = run_beside(tool, &calls[i], &args, index, opts)
                .instrument(span.clone())
                .await;
            traced(&span, &answered);
            (i, answered)
        }));
    let (session, http) = futures::join!(session, http);
    for (i, answered) in session?.into_iter().chain(http) {
        answers[i] = Some(answered);
    }
    Ok(answers
        .into_iter()
        .zip(calls)
        .map(|(a, call)| {
            a.unwrap_or_else(|| Answered {
                reply: ToolReply {
                    id: call.id.clone(),
                    name: call.name.clone(),
                    content: "error: not run".to_owned(),
                },
                is_error: true,
            })
        })
        .collect())
}

/// A call's answer, on its span: failed when the model is told of an error.
fn traced(span: &tracing::Span, answered: &Answered) {
    if answered.is_error {
        crate::trace::fail(span, "tool_error", "the call was answered with an error");
    }
    if crate::trace::capture_content() {
        crate::trace::set(
            span,
            "gen_ai.tool.call.result",
            answered.reply.content.clone(),
        );
    }
}

fn told_call(call: &ToolCall, index: u32, opts: &RunOptions) {
    (opts.events)(EventMsg::ToolCall {
        turn: opts.turn,
        index,
        id: call.id.clone(),
        name: call.name.clone(),
        arguments: stored(&call.arguments),
    });
}

/// Most bytes of a call's arguments or result kept in its event; the model and the code get
/// theirs whole, within the channel's own bound.
pub const STORED_BYTES: usize = 64 << 10;

/// `text` as an event keeps it: cut as a block's output is (head and tail, the cut marked),
/// by the one capture buffer outputs go through.
fn stored(text: &str) -> String {
    let mut kept = tandem_executor::CaptureBuffer::new(STORED_BYTES);
    kept.push(text.as_bytes());
    kept.finish().to_text()
}

/// The answer to `call`, told as its `tool_result`.
fn answer(
    call: &ToolCall,
    index: u32,
    content: String,
    is_error: bool,
    started: Instant,
    opts: &RunOptions,
) -> Answered {
    (opts.events)(EventMsg::ToolResult {
        turn: opts.turn,
        index,
        id: call.id.clone(),
        name: call.name.clone(),
        result: stored(&content),
        is_error,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    });
    Answered {
        reply: ToolReply {
            id: call.id.clone(),
            name: call.name.clone(),
            content,
        },
        is_error,
    }
}

/// An `execute_code` call runs as a block: its events, approval, limits and report are a
/// block's.
async fn run_code(
    slot: &mut SessionSlot,
    call: &ToolCall,
    args: &Map<String, Value>,
    index: u32,
    opts: &RunOptions,
) -> Result<Answered, ExecError> {
    let started = Instant::now();
    let text = |key| args.get(key).and_then(Value::as_str).unwrap_or_default();
    let language = Language::new(text("language"));
    let mut code = text("code").to_owned();
    let filename = text("filename").trim();
    if !filename.is_empty() && !filename.contains('\n') {
        let comment = if language == Language::javascript() {
            "//"
        } else {
            "#"
        };
        code = format!("{comment} filename: {filename}\n{code}");
    }
    told_call(call, index, opts);
    let block = CodeBlock {
        language: Some(language.to_string()),
        info: language.to_string(),
        code,
        unterminated: false,
    };
    let run = blocks::run_block(slot, &block, index, false, opts).await?;
    let is_error = !run.result.succeeded();
    let content = blocks::report(
        std::slice::from_ref(&run),
        0,
        opts.timeout.unwrap_or(slot.block_timeout()),
        slot.output_cap(),
        "",
    );
    Ok(answer(call, index, content, is_error, started, opts))
}

/// Takes up a call of `tool` (not `execute_code`, whose block is asked about as a block):
/// asks about it where the policy says, and tells it. A command's program and the call's
/// arguments meet the deny rules as a block's code does. The arguments it runs with (a
/// person's edit, checked against the tool's parameters like the model's), or the answer
/// that ends it.
async fn take_up(
    tool: &Tool,
    call: &ToolCall,
    args: &Map<String, Value>,
    index: u32,
    started: Instant,
    opts: &RunOptions,
) -> Result<Map<String, Value>, Answered> {
    let decided = match &opts.approval {
        None => Ok(args.clone()),
        Some(gate) => {
            let at = crate::approval::BlockAt {
                turn: opts.turn,
                index,
                events: &opts.events,
                cancel: &opts.cancel,
            };
            let arguments = Value::Object(args.clone()).to_string();
            let argv = match &tool.runs {
                Runs::Command(argv) => Some(argv.as_slice()),
                _ => None,
            };
            match gate.decide_tool(&tool.name, argv, &arguments, &at).await {
                None => Err(
                    "error: not run: the task stopped while the call waited for approval"
                        .to_owned(),
                ),
                Some(Err(why)) => Err(format!(
                    "error: not run: {why}. Do not call it again unchanged."
                )),
                Some(Ok(edited)) if edited == arguments => Ok(args.clone()),
                Some(Ok(edited)) => tool.arguments(&edited).map_err(|e| e.to_string()),
            }
        }
    };
    told_call(call, index, opts);
    decided.map_err(|text| answer(call, index, text, true, started, opts))
}

/// A command tool runs as a program in the session, started by a small Python launcher
/// (never a shell), with the arguments as JSON on its stdin.
async fn run_command(
    slot: &mut SessionSlot,
    tool: &Tool,
    call: &ToolCall,
    args: &Map<String, Value>,
    index: u32,
    opts: &RunOptions,
) -> Result<Answered, ExecError> {
    let started = Instant::now();
    let Runs::Command(argv) = &tool.runs else {
        return Ok(answer(
            call,
            index,
            "error: not a command".to_owned(),
            true,
            started,
            opts,
        ));
    };
    let arguments = match take_up(tool, call, args, index, started, opts).await {
        Ok(args) => Value::Object(args).to_string(),
        Err(answered) => return Ok(answered),
    };
    if let Some(why) = slot.refusal(&Language::python()) {
        let text = format!(
            "error: tool `{}` is a command, which needs an executor that runs python to start it: {why}",
            tool.name
        );
        return Ok(answer(call, index, text, true, started, opts));
    }
    let launcher = launcher(argv, &arguments);
    let mut run_opts = opts.clone();
    if let Some(t) = tool.timeout {
        run_opts.timeout = Some(t);
    }
    // A tool's output is its answer, told once as its `tool_result`, not streamed as a
    // block's.
    let events = opts.events.clone();
    run_opts.events = std::sync::Arc::new(move |e| {
        if !matches!(e, EventMsg::ExecOutput { .. }) {
            events(e);
        }
    });
    let (outcome, pictures) =
        blocks::run_one(slot, &Language::python(), &launcher, index, &run_opts).await?;
    blocks::tell_pictures(pictures, index, opts);
    let (content, is_error) = command_answer(&tool.name, outcome);
    Ok(answer(call, index, content, is_error, started, opts))
}

/// What the model (or the calling code) is told of a command tool's run: its stdout, or why
/// it failed.
fn command_answer(name: &str, outcome: tandem_executor::ExecOutcome) -> (String, bool) {
    let result = blocks::to_result(&Language::python(), outcome);
    if result.succeeded() {
        return (result.stdout, false);
    }
    let code = blocks::exit_code_of(&result);
    let mut text = format!("error: tool `{name}` failed (exit code {code})");
    for stream in [&result.stderr, &result.stdout] {
        if !stream.trim().is_empty() {
            text.push_str(":\n");
            text.push_str(stream.trim_end());
            break;
        }
    }
    (text, true)
}

/// Answers calls from the code of block `index`: `tools` are its caller's. A command runs in
/// a second session on the same workspace (the block's own is busy running the block), an
/// HTTP tool from here; `execute_code` is refused, since code can run code itself. Every call
/// is told as a block's are, and passes the same approval.
fn code_handler(
    tools: std::sync::Arc<ToolBox>,
    executor: std::sync::Arc<dyn tandem_executor::Executor>,
    spec: tandem_executor::SessionSpec,
    index: u32,
    opts: RunOptions,
    task_calls: std::sync::Arc<std::sync::atomic::AtomicU32>,
) -> tandem_executor_kit::toolchannel::ToolHandler {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (per_block, per_task) = (
        spec.limits.code_calls_per_block,
        spec.limits.code_calls_per_task,
    );
    // Opened at the first command the block's code calls, and kept for the rest of the block.
    let beside = std::sync::Arc::new(Beside {
        executor,
        spec,
        session: tokio::sync::Mutex::new(None),
    });
    std::sync::Arc::new(move |name: String, arguments: String| {
        let (tools, beside, opts) = (tools.clone(), beside.clone(), opts.clone());
        let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        // The task counts the calls its blocks were let make, not those each block's own cap
        // already refused: so the first call past the task's cap is the one told.
        let t = if n <= per_block {
            task_calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
        } else {
            0
        };
        Box::pin(async move {
            let started = Instant::now();
            let call = ToolCall {
                id: format!("code_call_{}_{index}_{n}", opts.turn),
                name,
                arguments,
            };
            let refuse = |text: String| {
                told_call(&call, index, &opts);
                let a = answer(&call, index, text, true, started, &opts);
                Err(a.reply.content)
            };
            // Past a cap, a call costs nothing: refused at once, and only the first refusal
            // is stored, so code in a loop cannot fill the store with them.
            let over = if n > per_block {
                Some((
                    n == per_block + 1,
                    format!(
                        "error: not run: this block's code has made {per_block} tool calls, the most one block may make (the operator's [limits] code_calls_per_block); do the rest in a later block, or without the tool"
                    ),
                ))
            } else if t > per_task {
                Some((
                    t == per_task + 1,
                    format!(
                        "error: not run: this task's code has made {per_task} tool calls, the most one task may make (the operator's [limits] code_calls_per_task)"
                    ),
                ))
            } else {
                None
            };
            if let Some((first, text)) = over {
                return if first { refuse(text) } else { Err(text) };
            }
            let (tool, args) = match tools.check(&call) {
                Ok(found) => found,
                Err(e) => return refuse(e.to_string()),
            };
            let done = match &tool.runs {
                Runs::Code => {
                    return refuse(format!(
                        "error: `{}` cannot be called from code: run the code directly",
                        tool.name
                    ));
                }
                Runs::Http(_) | Runs::Mcp(..) => run_beside(tool, &call, &args, index, &opts).await,
                Runs::Command(argv) => {
                    match take_up(tool, &call, &args, index, started, &opts).await {
                        Ok(args) => {
                            let arguments = Value::Object(args).to_string();
                            let (content, is_error) = beside
                                .command(&tool.name, argv, &arguments, tool.timeout, &opts)
                                .await;
                            answer(&call, index, content, is_error, started, &opts)
                        }
                        Err(answered) => answered,
                    }
                }
            };
            if done.is_error {
                Err(done.reply.content)
            } else {
                Ok(done.reply.content)
            }
        })
    })
}

/// A second session on a block's workspace, for the commands its code calls: the block's
/// own session is busy running the block. Closed when the block's handler goes.
struct Beside {
    executor: std::sync::Arc<dyn tandem_executor::Executor>,
    spec: tandem_executor::SessionSpec,
    session: tokio::sync::Mutex<Option<Box<dyn tandem_executor::Session>>>,
}

impl Beside {
    /// Runs command tool `name` (`argv`) with `arguments` on its stdin.
    async fn command(
        &self,
        name: &str,
        argv: &[String],
        arguments: &str,
        timeout: Option<Duration>,
        opts: &RunOptions,
    ) -> (String, bool) {
        let mut slot = self.session.lock().await;
        if slot.is_none() {
            match self.executor.open(self.spec.clone()).await {
                Ok(s) => *slot = Some(s),
                Err(e) => return (format!("error: tool `{name}` could not start: {e}"), true),
            }
        }
        let Some(session) = slot.as_mut() else {
            return (format!("error: tool `{name}` has no session"), true);
        };
        let mut req =
            tandem_executor::ExecRequest::new(Language::python(), launcher(argv, arguments));
        req.timeout = timeout;
        let ctx = tandem_executor::ExecContext::new(opts.cancel.child_token());
        match session.run(req, ctx).await {
            Ok(outcome) => command_answer(name, outcome),
            Err(e) => {
                // A broken session is not used again.
                if let Some(broken) = slot.take() {
                    let _ = broken.close().await;
                }
                (format!("error: tool `{name}` could not run: {e}"), true)
            }
        }
    }
}

impl Drop for Beside {
    fn drop(&mut self) {
        let Some(session) = self.session.get_mut().take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    if let Err(e) = session.close().await {
                        tracing::warn!(error = %e, "closing a tool's session failed");
                    }
                });
            }
            // No runtime to close it on: dropped, each executor's own drop cleans up.
            Err(_) => drop(session),
        }
    }
}

/// Python that runs `argv` with `stdin` on its standard input and exits as it did. Both are
/// carried as JSON string literals, which Python reads as its own.
fn launcher(argv: &[String], stdin: &str) -> String {
    let literal = |v: &str| serde_json::to_string(v).unwrap_or_else(|_| "\"\"".to_owned());
    let argv = serde_json::to_string(argv).unwrap_or_else(|_| "[]".to_owned());
    format!(
        "import json, sys\n\
         argv = json.loads({argv})\n\
         try:\n    import subprocess\n    done = subprocess.run(argv, input=json.loads({stdin}).encode())\n\
         except OSError as e:\n    print('tandem: cannot start the tool %s: %s' % (argv[0], e), file=sys.stderr)\n    sys.exit(127)\n\
         except Exception as e:\n    print('tandem: this sandbox cannot start programs (%s); a command tool needs the local or docker executor' % e, file=sys.stderr)\n    sys.exit(127)\n\
         sys.exit(done.returncode if done.returncode >= 0 else 128 - done.returncode)\n",
        argv = literal(&argv),
        stdin = literal(&literal(stdin)),
    )
}

/// An operator's tool that runs outside the sandbox: an HTTP endpoint the arguments are
/// POSTed to as JSON (a 2xx body is the answer), or an MCP server's tool.
async fn run_beside(
    tool: &Tool,
    call: &ToolCall,
    args: &Map<String, Value>,
    index: u32,
    opts: &RunOptions,
) -> Answered {
    let started = Instant::now();
    let args = match take_up(tool, call, args, index, started, opts).await {
        Ok(args) => args,
        Err(answered) => return answered,
    };
    let timeout = tool.timeout.unwrap_or(Duration::from_secs(60));
    let ran = async {
        match &tool.runs {
            Runs::Http(url) => post(url, Value::Object(args).to_string(), timeout).await,
            Runs::Mcp(source, name) => Ok(source.call(name, args, timeout).await?),
            _ => Err(BesideError::Inside),
        }
    };
    let (content, is_error) = tokio::select! {
        got = ran => match got {
            Ok(body) => (body, false),
            Err(why) => (format!("error: tool `{}` failed: {why}", tool.name), true),
        },
        () = opts.cancel.cancelled() => ("error: the task stopped during the call".to_owned(), true),
    };
    // An MCP server's answer is as long as it likes; what the model reads is not.
    let mut content = content;
    if content.len() > HTTP_CAP {
        content.truncate(content.floor_char_boundary(HTTP_CAP));
        content.push_str(&format!("\n[cut at {} KiB]", HTTP_CAP / 1024));
    }
    answer(call, index, content, is_error, started, opts)
}

async fn post(url: &str, body: String, timeout: Duration) -> Result<String, BesideError> {
    use futures::StreamExt;
    // One client per process and scheme: its connections are kept for the next call.
    static CLIENTS: std::sync::OnceLock<[Result<reqwest::Client, String>; 2]> =
        std::sync::OnceLock::new();
    let clients = CLIENTS.get_or_init(|| {
        [false, true].map(|https| {
            let tls = crate::chat::tls_config(https).map_err(|e| e.message)?;
            reqwest::Client::builder()
                .tls_backend_preconfigured(tls)
                .build()
                .map_err(|e| e.to_string())
        })
    });
    let client = clients[usize::from(url.starts_with("https://"))]
        .as_ref()
        .map_err(|e| BesideError::Client(e.clone()))?;
    let response = client
        .post(url)
        .timeout(timeout)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| BesideError::Http {
            what: "the endpoint did not answer",
            why: root(&e),
        })?;
    let status = response.status();
    let mut stream = response.bytes_stream();
    let mut bytes = Vec::new();
    let mut cut = false;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BesideError::Http {
            what: "reading the answer failed",
            why: root(&e),
        })?;
        let room = HTTP_CAP.saturating_sub(bytes.len());
        bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if chunk.len() > room {
            cut = true;
            break;
        }
    }
    let mut text = String::from_utf8_lossy(&bytes).into_owned();
    if cut {
        text.push_str(&format!("\n[cut at {} KiB]", HTTP_CAP / 1024));
    }
    if status.is_success() {
        Ok(text)
    } else {
        Err(BesideError::Status {
            status,
            body: text.trim().to_owned(),
        })
    }
}

fn root(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launcher_runs_the_program_itself_with_any_text_as_it_was() {
        // The tool is a Python program that prints what it was given, as JSON.
        let echo = "import json, sys; print(json.dumps([sys.argv[1:], sys.stdin.read()]))";
        let odd = "it's \"x\"\n\\ $(reboot) `id` ; | *";
        let argv = vec![
            "python3".to_owned(),
            "-c".to_owned(),
            echo.to_owned(),
            odd.to_owned(),
        ];
        let stdin = "{\"text\": \"é 🎉 '''\\u0000\"}";
        let run = |code: String| {
            std::process::Command::new("python3")
                .arg("-c")
                .arg(code)
                .output()
                .unwrap_or_else(|e| panic!("python3: {e}"))
        };
        let out = run(launcher(&argv, stdin));
        let printed: (Vec<String>, String) = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        assert_eq!(printed, (vec![odd.to_owned()], stdin.to_owned()));
        assert!(out.status.success());
        // A program that is not there is exit code 127 and a line that names it.
        let out = run(launcher(&["no-such-tool".to_owned()], "{}"));
        assert_eq!(out.status.code(), Some(127));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("tandem: cannot start the tool no-such-tool:"),
            "{err}"
        );
    }
}
