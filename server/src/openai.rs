//! The daemon's embedded model as an OpenAI-compatible chat API (`POST /v1/chat/completions`),
//! so a team's agents, a second daemon or any OpenAI client share the one loaded copy.
//!
//! What a request asks is turned into the assistant's own types (messages, a tool offer,
//! sampling settings) and answered by the same `LocalModel` that answers tasks. A call the
//! model writes (`<tool_call>`) comes back as `tool_calls`, never as text.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tandem_agent::chat::{Completion, LocalModel, ModelConfig, ModelProgress, ToolOffer};
use tandem_protocol::{Message, ToolCall};
use tokio::sync::{Semaphore, mpsc};

/// Most chat completions served at once. More are refused (429) rather than queued in front
/// of the daemon's own tasks, which share the engine and its first-come order.
pub(crate) const MOST_AT_ONCE: usize = 8;

static AT_ONCE: Semaphore = Semaphore::const_new(MOST_AT_ONCE);

/// Why a request was not answered.
pub(crate) enum Refusal {
    /// `MOST_AT_ONCE` are being served.
    Busy(String),
    /// The model failed.
    Failed(String),
}

/// Where a call starts in the model's text; nothing from it on is sent as content.
const CALL_TAG: &str = "<tool_call>";

/// A chat completion request: the fields Tandem's engine honours; the rest of what OpenAI
/// clients send (`top_p`, `user`, penalties) is accepted and has no effect.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    messages: Vec<Value>,
    #[serde(default)]
    tools: Vec<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    seed: Option<i64>,
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// What the request asks, in the assistant's types.
pub(crate) struct Asked {
    messages: Vec<Message>,
    offer: Option<ToolOffer>,
    config: ModelConfig,
    stream: bool,
    usage_in_stream: bool,
}

impl ChatRequest {
    /// The request in the assistant's types, or what is wrong with it.
    pub(crate) fn asked(self) -> Result<Asked, String> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(
                "n: the embedded model gives one choice per request; leave n out or send 1"
                    .to_owned(),
            );
        }
        if self.messages.is_empty() {
            return Err("messages is empty; send at least one message".to_owned());
        }
        let messages = self
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| message(m).map_err(|e| format!("messages[{i}]: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let offer = offer(self.tools, self.tool_choice)?;
        // Any integer is a seed, as OpenAI takes it; the engine's is 32 bits.
        let seed = self
            .seed
            .map(|s| u32::try_from(s.rem_euclid(1 << 32)).unwrap_or(0));
        let config = ModelConfig {
            temperature: self.temperature,
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            seed,
            stop: match self.stop {
                None => Vec::new(),
                Some(Stop::One(s)) => vec![s],
                Some(Stop::Many(v)) => v,
            },
            tool_required: offer.as_ref().is_some_and(|o| o.required),
            ..ModelConfig::default()
        };
        Ok(Asked {
            messages,
            offer,
            config,
            stream: self.stream,
            usage_in_stream: self.stream_options.is_some_and(|o| o.include_usage),
        })
    }
}

/// One message of the request: content as text (a list of text parts is joined; `null` is
/// empty), `developer` read as `system`.
fn message(mut m: Value) -> Result<Message, String> {
    let Some(obj) = m.as_object_mut() else {
        return Err("a message is an object with role and content".to_owned());
    };
    let content = match obj.remove("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(format!(
                            "content part of type {} cannot be read by the embedded model; send text",
                            kind.unwrap_or("(none)")
                        ));
                    }
                }
            }
            text
        }
        Some(_) => return Err("content is text, a list of text parts, or null".to_owned()),
    };
    obj.insert("content".to_owned(), Value::String(content));
    if obj.get("role").and_then(Value::as_str) == Some("developer") {
        obj.insert("role".to_owned(), json!("system"));
    }
    // Fields of other APIs (`refusal`, `audio`) are not the model's to read.
    obj.retain(|k, _| {
        matches!(
            k.as_str(),
            "role" | "content" | "name" | "tool_calls" | "tool_call_id"
        )
    });
    serde_json::from_value(m).map_err(|e| {
        format!("{e}; a message has role (system, user, assistant or tool) and content")
    })
}

/// The tools offered, under `tool_choice`: `none` offers none, `required` (or one function
/// named) makes the reply a call.
fn offer(tools: Vec<Value>, choice: Option<Value>) -> Result<Option<ToolOffer>, String> {
    for (i, t) in tools.iter().enumerate() {
        if t["type"] != "function" || !t["function"]["name"].is_string() {
            return Err(format!(
                "tools[{i}] is not {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
            ));
        }
        if let Some(parameters) = t["function"].get("parameters") {
            tandem_agent::schema::bounded(parameters)
                .map_err(|e| format!("tools[{i}].function.parameters {e}"))?;
        }
    }
    let (tools, required) = match choice {
        None => (tools, false),
        Some(Value::String(c)) => match c.as_str() {
            "auto" => (tools, false),
            "none" => (Vec::new(), false),
            "required" => (tools, true),
            other => {
                return Err(format!(
                    "tool_choice `{other}` is not auto, none, required or a function"
                ));
            }
        },
        Some(c) => {
            let Some(name) = c["function"]["name"].as_str() else {
                return Err("tool_choice is auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}".to_owned());
            };
            let named: Vec<Value> = tools
                .into_iter()
                .filter(|t| t["function"]["name"] == name)
                .collect();
            if named.is_empty() {
                return Err(format!("tool_choice names `{name}`, which is not in tools"));
            }
            (named, true)
        }
    };
    if tools.is_empty() {
        if required {
            return Err("tool_choice is required but no tools are offered".to_owned());
        }
        return Ok(None);
    }
    Ok(Some(ToolOffer {
        tools,
        required,
        optional: false,
    }))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn completion_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!(
        "chatcmpl-{}-{}",
        now(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

fn wire_calls(calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"index": i, "id": c.id, "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}})
        })
        .collect()
}

fn finish_reason(c: &Completion) -> String {
    if c.tool_calls.is_empty() {
        c.finish_reason.clone().unwrap_or_else(|| "stop".to_owned())
    } else {
        "tool_calls".to_owned()
    }
}

fn usage(c: &Completion) -> Value {
    let (p, g) = c
        .usage
        .map_or((0, 0), |u| (u.prompt_tokens, u.completion_tokens));
    json!({"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g})
}

/// Answers `asked` with `model` (served as `name`): one JSON reply, or a stream of chunks
/// that stops the generation when the client goes.
pub(crate) async fn answer(
    model: Arc<dyn LocalModel>,
    name: String,
    asked: Asked,
) -> Result<Response, Refusal> {
    let Ok(permit) = AT_ONCE.try_acquire() else {
        return Err(Refusal::Busy(format!(
            "{MOST_AT_ONCE} chat completions are being served already; try again when one ends"
        )));
    };
    let id = completion_id();
    let created = now();
    if !asked.stream {
        let completion = model
            .complete(
                &asked.messages,
                asked.offer.as_ref(),
                &asked.config,
                &mut |_| {},
            )
            .await
            .map_err(|e| Refusal::Failed(e.to_string()))?;
        drop(permit);
        let mut message = json!({"role": "assistant", "content": completion.text});
        if !completion.tool_calls.is_empty() {
            message["tool_calls"] = wire_calls(&completion.tool_calls);
        }
        return Ok(Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(&completion)}],
            "usage": usage(&completion),
        }))
        .into_response());
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<SseEvent>();
    let chunk = {
        let (id, name) = (id.clone(), name.clone());
        move |choices: Value, extra: Option<(&str, Value)>| {
            let mut v = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                               "model": name, "choices": choices});
            if let Some((k, x)) = extra {
                v[k] = x;
            }
            SseEvent::default().data(v.to_string())
        }
    };
    let _ = tx.send(chunk(
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
        None,
    ));
    tokio::spawn(async move {
        // PendingText until the stream ends or its client goes.
        let _permit = permit;
        let offered = asked.offer.is_some();
        let mut held = PendingText::default();
        let mut progress = |p: ModelProgress<'_>| {
            if let ModelProgress::Delta(piece) = p {
                let out = if offered {
                    held.push(piece)
                } else {
                    piece.to_owned()
                };
                held.sent += out.len();
                if !out.is_empty() {
                    let _ = tx.send(chunk(
                        json!([{"index": 0, "delta": {"content": out}, "finish_reason": null}]),
                        None,
                    ));
                }
            }
        };
        let generation = model.complete(
            &asked.messages,
            asked.offer.as_ref(),
            &asked.config,
            &mut progress,
        );
        // A client that goes stops the generation: the future is dropped.
        let result = tokio::select! {
            r = generation => r,
            () = tx.closed() => return,
        };
        match result {
            Ok(completion) => {
                if completion.tool_calls.is_empty() {
                    // No call came: what was held back as a possible one is text after all.
                    if let Some(rest) = completion.text.get(held.sent..).filter(|r| !r.is_empty()) {
                        let _ = tx.send(chunk(
                            json!([{"index": 0, "delta": {"content": rest}, "finish_reason": null}]),
                            None,
                        ));
                    }
                } else {
                    let _ = tx.send(chunk(
                        json!([{"index": 0, "delta": {"tool_calls": wire_calls(&completion.tool_calls)}, "finish_reason": null}]),
                        None,
                    ));
                }
                let _ = tx.send(chunk(
                    json!([{"index": 0, "delta": {}, "finish_reason": finish_reason(&completion)}]),
                    None,
                ));
                if asked.usage_in_stream {
                    let _ = tx.send(chunk(json!([]), Some(("usage", usage(&completion)))));
                }
            }
            Err(e) => {
                let _ = tx.send(
                    SseEvent::default().data(
                        json!({"error": {"message": e.to_string(), "type": "model_unavailable"}})
                            .to_string(),
                    ),
                );
            }
        }
        let _ = tx.send(SseEvent::default().data("[DONE]"));
    });
    let stream = futures::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|e| e.map(Ok::<_, std::convert::Infallible>))
    });
    Ok(Sse::new(stream).into_response())
}

/// Text streamed while tools are offered: everything before a call's tag, held back while
/// the tail could still become one.
#[derive(Default)]
struct PendingText {
    pending: String,
    in_call: bool,
    /// Bytes of text sent so far.
    sent: usize,
}

impl PendingText {
    /// The text that can be sent now, after `piece`.
    fn push(&mut self, piece: &str) -> String {
        if self.in_call {
            return String::new();
        }
        self.pending.push_str(piece);
        if let Some(at) = self.pending.find(CALL_TAG) {
            self.in_call = true;
            let out = self.pending[..at].to_owned();
            self.pending.clear();
            return out;
        }
        // Keep the longest tail that begins the tag.
        let keep = (1..CALL_TAG.len())
            .rev()
            .find(|&n| self.pending.ends_with(&CALL_TAG[..n]))
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        out
    }
}
