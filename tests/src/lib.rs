//! Test harness for Tandem: a scripted OpenAI-compatible server over real HTTP.
//!
//! [`ScriptedOpenAi`] lists [`LISTED_MODELS`] at `GET /v1/models` and answers
//! `POST /v1/chat/completions` with
//! `script[first user message][number of assistant messages so far]`, streamed (SSE) or
//! not, as the request asks; `script["TASK#AGENT"]` scripts, within a team, the agent whose
//! system prompt starts with the line AGENT. Parallel tests use different task texts, so they never share
//! state. Every request is recorded so tests can assert what the model saw.

pub mod conformance;
pub mod daemon;
pub mod hostile_clients;
pub mod internet;
pub mod kubernetes;
pub mod mcp;
pub mod otlp;
pub mod packages;
pub mod postgres;
pub mod second_engine;
pub mod webdriver;

pub use daemon::DaemonHarness;
pub use mcp::McpHttp;
pub use postgres::Postgres;
pub use webdriver::Browser;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::StreamExt;
use serde_json::{Value, json};

/// One scripted answer.
#[derive(Clone, Debug)]
pub enum Reply {
    /// A normal reply with this text.
    Text(String),
    /// An HTTP error with this status and JSON error message.
    Error(u16, String),
    /// Wait, then answer with the inner reply (for cancellation and timeouts).
    Delayed(Duration, Box<Reply>),
    /// A streamed reply with this text whose pieces come this far apart, as a model's tokens.
    Trickle(Duration, String),
    /// A streamed reply that repeats this piece without end (stopping only at [`ENDLESS_CAP`]
    /// pieces, or when the client hangs up), as a broken or hostile server.
    Endless(String),
    /// A reply with this text and these native tool calls (`(id, name, arguments)`); streamed,
    /// each call's arguments come in pieces of a few characters.
    Calls(String, Vec<(String, String, String)>),
    /// These `choices[0].delta` objects, as raw JSON text, as the streamed chunks (for pieces
    /// a server splits in odd places, even inside a surrogate pair), then
    /// `finish_reason: tool_calls`.
    Deltas(Vec<String>),
    /// A 400 naming the parameter when the request has it; the inner reply otherwise.
    Refuses(String, Box<Reply>),
    /// The inner reply with no `usage` at all, streamed or not, as some servers and proxies
    /// answer. ([`Reply::Calls`] and [`Reply::Deltas`] never carry usage.)
    NoUsage(Box<Reply>),
}

/// A tool call for [`Reply::Calls`].
pub fn call(id: &str, name: &str, arguments: &str) -> (String, String, String) {
    (id.to_owned(), name.to_owned(), arguments.to_owned())
}

/// Most pieces an [`Reply::Endless`] sends, so a test that fails cannot run forever.
pub const ENDLESS_CAP: usize = 1 << 20;

impl From<&str> for Reply {
    fn from(text: &str) -> Self {
        Reply::Text(text.to_owned())
    }
}

/// Replies per task text, in order.
pub type Script = HashMap<String, Vec<Reply>>;

/// A request as the server saw it.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// The JSON body.
    pub body: Value,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// When it arrived.
    pub at: Instant,
    /// Who sent it, when it came to [`ScriptedOpenAi::base_url_for`]'s URL.
    pub caller: Option<String>,
}

impl Recorded {
    /// The first user message (the script key).
    pub fn task(&self) -> Option<&str> {
        messages(&self.body)
            .find(|m| m["role"] == "user")
            .and_then(|m| m["content"].as_str())
    }

    /// The content of the last message.
    pub fn last_message(&self) -> Option<&str> {
        messages(&self.body)
            .last()
            .and_then(|m| m["content"].as_str())
    }
}

fn messages(body: &Value) -> impl DoubleEndedIterator<Item = &Value> {
    body["messages"]
        .as_array()
        .map(|a| a.iter())
        .into_iter()
        .flatten()
}

#[derive(Default)]
struct Shared {
    script: Mutex<Script>,
    requests: Mutex<Vec<Recorded>>,
    /// Callers whose requests wait (see [`ScriptedOpenAi::hold`]).
    held: Mutex<std::collections::HashSet<String>>,
    /// How many of each caller's requests wait now.
    waiting: Mutex<HashMap<String, usize>>,
    released: tokio::sync::Notify,
}

/// A scripted OpenAI-compatible chat server on 127.0.0.1.
pub struct ScriptedOpenAi {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl ScriptedOpenAi {
    /// Starts the server on an ephemeral port.
    pub async fn start(script: Script) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            script: Mutex::new(script),
            ..Default::default()
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/models", axum::routing::get(models))
            .route("/{caller}/v1/chat/completions", post(chat_as))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            addr,
            shared,
            server,
        })
    }

    /// Adds or replaces the replies for one task text.
    pub fn set(&self, task: &str, replies: Vec<Reply>) {
        if let Ok(mut s) = self.shared.script.lock() {
            s.insert(task.to_owned(), replies);
        }
    }

    /// The base URL to give Tandem (`http://127.0.0.1:PORT/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// A base URL that names `caller` (a daemon among several), so its requests can be told
    /// apart and held.
    pub fn base_url_for(&self, caller: &str) -> String {
        format!("http://{}/{caller}/v1", self.addr)
    }

    /// Holds `caller`'s requests, new and waiting, unanswered until [`ScriptedOpenAi::release`].
    pub fn hold(&self, caller: &str) {
        if let Ok(mut held) = self.shared.held.lock() {
            held.insert(caller.to_owned());
        }
    }

    /// Answers `caller`'s requests again, the held ones first.
    pub fn release(&self, caller: &str) {
        if let Ok(mut held) = self.shared.held.lock() {
            held.remove(caller);
        }
        self.shared.released.notify_waiters();
    }

    /// How many of `caller`'s requests are held now.
    pub fn held(&self, caller: &str) -> usize {
        self.shared
            .waiting
            .lock()
            .map(|w| w.get(caller).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared
            .requests
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// The requests whose first user message is `task`.
    pub fn requests_for(&self, task: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.task() == Some(task))
            .collect()
    }
}

impl Drop for ScriptedOpenAi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn error(status: u16, message: &str) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body =
        json!({"error": {"message": message, "type": "scripted", "param": null, "code": null}});
    (status, axum::Json(body)).into_response()
}

/// One held request of a caller, counted while it lives.
struct Waiting<'a> {
    shared: &'a Shared,
    caller: &'a str,
}

impl<'a> Waiting<'a> {
    fn new(shared: &'a Shared, caller: &'a str) -> Self {
        if let Ok(mut w) = shared.waiting.lock() {
            *w.entry(caller.to_owned()).or_default() += 1;
        }
        Self { shared, caller }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Ok(mut w) = self.shared.waiting.lock() {
            *w.entry(self.caller.to_owned()).or_default() -= 1;
        }
    }
}

async fn chat_as(
    State(shared): State<Arc<Shared>>,
    axum::extract::Path(caller): axum::extract::Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    loop {
        let released = shared.released.notified();
        let held = shared.held.lock().is_ok_and(|h| h.contains(&caller));
        if !held {
            break;
        }
        // Counted while it waits, and no longer once its client hangs up (the handler is
        // dropped with the connection).
        let _waiting = Waiting::new(&shared, &caller);
        released.await;
    }
    answer_chat(shared, headers, body, Some(caller)).await
}

async fn chat(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    answer_chat(shared, headers, body, None).await
}

async fn answer_chat(
    shared: Arc<Shared>,
    headers: HeaderMap,
    body: Bytes,
    caller: Option<String>,
) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(400, "body is not JSON");
    };
    let recorded = Recorded {
        authorization: headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        body: body.clone(),
        at: Instant::now(),
        caller,
    };
    let task = recorded.task().unwrap_or("").to_owned();
    if let Ok(mut r) = shared.requests.lock() {
        r.push(recorded);
    }
    let turn = messages(&body).filter(|m| m["role"] == "assistant").count();
    // A team's agents share a task: `TASK#AGENT` scripts the agent whose system prompt's
    // first line is AGENT, and counts its own turns.
    let agent = messages(&body)
        .find(|m| m["role"] == "system")
        .and_then(|m| m["content"].as_str())
        .and_then(|c| c.lines().next())
        .map(|line| format!("{task}#{line}"));
    // `TASK~SEED` scripts the requests sampled from that seed (replies drawn to choose
    // among), by turn as well.
    let sampled = body["seed"].as_u64().map(|seed| format!("{task}~{seed}"));
    let reply = shared.script.lock().ok().and_then(|s| {
        sampled
            .and_then(|key| s.get(&key))
            .or_else(|| agent.and_then(|key| s.get(&key)))
            .or_else(|| s.get(&task))
            // `*` scripts every task no other entry names.
            .or_else(|| s.get("*"))
            .and_then(|r| r.get(turn).cloned())
    });
    let Some(mut reply) = reply else {
        return error(400, &format!("no scripted reply {turn} for task {task:?}"));
    };
    let mut usage = true;
    loop {
        match reply {
            Reply::NoUsage(inner) => {
                usage = false;
                reply = *inner;
            }
            Reply::Delayed(wait, inner) => {
                tokio::time::sleep(wait).await;
                reply = *inner;
            }
            Reply::Error(status, message) => return error(status, &message),
            Reply::Refuses(param, inner) => {
                if body.get(&param).is_some() {
                    return error(
                        400,
                        &format!("Unrecognized request argument supplied: {param}"),
                    );
                }
                reply = *inner;
            }
            Reply::Calls(text, calls) => return answer_calls(&body, &text, &calls),
            Reply::Deltas(deltas) => return stream_deltas(&body, deltas),
            Reply::Text(text) => return answer(&body, &text, None, usage),
            Reply::Trickle(gap, text) => return answer(&body, &text, Some(gap), usage),
            Reply::Endless(piece) => return endless(&piece),
        }
    }
}

/// The models it lists: the one every test names by default, and one more.
pub const LISTED_MODELS: [&str; 2] = ["gpt-4o-mini", "scripted-large"];

async fn models() -> Response {
    let data: Vec<Value> = LISTED_MODELS
        .iter()
        .map(|id| json!({"id": id, "object": "model", "owned_by": "scripted"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// A text reply; with `usage` false, one that says nothing of the tokens it used.
fn answer(request: &Value, text: &str, gap: Option<Duration>, usage: bool) -> Response {
    let model = request["model"].as_str().unwrap_or("scripted");
    let prompt_chars: usize = messages(request)
        .filter_map(|m| m["content"].as_str())
        .map(str::len)
        .sum();
    let usage = usage.then(|| {
        json!({
            "prompt_tokens": prompt_chars / 4 + 1,
            "completion_tokens": text.len() / 4 + 1,
            "total_tokens": prompt_chars / 4 + text.len() / 4 + 2,
        })
    });
    if request["stream"] != true {
        let mut body = json!({
            "id": "chatcmpl-scripted", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        });
        if let Some(usage) = usage {
            body["usage"] = usage;
        }
        return axum::Json(body).into_response();
    }
    let chunk = |delta: Value, finish: Value| {
        json!({
            "id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    };
    let mut sse = Vec::new();
    let mut push = |v: Value| sse.push(format!("data: {v}\n\n"));
    push(chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    ));
    let chars: Vec<char> = text.chars().collect();
    for piece in chars.chunks(24) {
        push(chunk(
            json!({"content": piece.iter().collect::<String>()}),
            Value::Null,
        ));
    }
    push(chunk(json!({}), json!("stop")));
    if let Some(usage) = usage.filter(|_| request["stream_options"]["include_usage"] == true) {
        push(json!({
            "id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0,
            "model": model, "choices": [], "usage": usage,
        }));
    }
    sse.push("data: [DONE]\n\n".to_owned());
    let body = match gap {
        None => axum::body::Body::from(sse.concat()),
        Some(gap) => axum::body::Body::from_stream(futures::stream::iter(sse).then(
            move |event| async move {
                tokio::time::sleep(gap).await;
                Ok::<_, std::convert::Infallible>(event)
            },
        )),
    };
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

fn answer_calls(request: &Value, text: &str, calls: &[(String, String, String)]) -> Response {
    if request["stream"] != true {
        let model = request["model"].as_str().unwrap_or("scripted");
        let tool_calls: Vec<Value> = calls
            .iter()
            .map(|(id, name, args)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
            })
            .collect();
        let body = json!({
            "id": "chatcmpl-scripted", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text) }, "tool_calls": tool_calls}, "finish_reason": "tool_calls"}],
        });
        return axum::Json(body).into_response();
    }
    let mut deltas = Vec::new();
    if !text.is_empty() {
        deltas.push(json!({"content": text}).to_string());
    }
    for (index, (id, name, args)) in calls.iter().enumerate() {
        deltas.push(json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}).to_string());
        let chars: Vec<char> = args.chars().collect();
        for piece in chars.chunks(7) {
            deltas.push(json!({"tool_calls": [{"index": index, "function": {"arguments": piece.iter().collect::<String>()}}]}).to_string());
        }
    }
    stream_deltas(request, deltas)
}

fn stream_deltas(request: &Value, deltas: Vec<String>) -> Response {
    let model = json!(request["model"].as_str().unwrap_or("scripted"));
    let chunk = |delta: &str, finish: &str| {
        format!(
            "data: {{\"id\": \"chatcmpl-scripted\", \"object\": \"chat.completion.chunk\", \"created\": 0, \"model\": {model}, \"choices\": [{{\"index\": 0, \"delta\": {delta}, \"finish_reason\": {finish}}}]}}\n\n"
        )
    };
    let mut sse: Vec<String> = Vec::new();
    sse.push(chunk(r#"{"role": "assistant"}"#, "null"));
    for delta in &deltas {
        sse.push(chunk(delta, "null"));
    }
    sse.push(chunk("{}", r#""tool_calls""#));
    sse.push("data: [DONE]\n\n".to_owned());
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        axum::body::Body::from(sse.concat()),
    )
        .into_response()
}

fn endless(piece: &str) -> Response {
    let event = format!(
        "data: {}\n\n",
        json!({
            "id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0,
            "model": "scripted",
            "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": null}],
        })
    );
    let events = futures::stream::repeat(event)
        .take(ENDLESS_CAP)
        .map(Ok::<_, std::convert::Infallible>);
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        axum::body::Body::from_stream(events),
    )
        .into_response()
}

/// The parent of process `pid`, from its `/proc/<pid>/stat` (the field after the name, whose
/// parentheses may hold anything); `None` once it is gone.
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A script from `(task, replies)` pairs.
pub fn script<const N: usize>(entries: [(&str, Vec<Reply>); N]) -> Script {
    entries
        .into_iter()
        .map(|(task, replies)| (task.to_owned(), replies))
        .collect()
}

/// Shorthand for a list of text replies.
pub fn texts(replies: &[&str]) -> Vec<Reply> {
    replies.iter().map(|r| Reply::from(*r)).collect()
}
