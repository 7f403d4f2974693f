//! The embedded model as the assistant's chat model.

use std::sync::Arc;

use futures::future::BoxFuture;
use tandem_agent::chat::{
    Completion, LocalModel, ModelConfig, ModelError, ModelProgress, ToolOffer,
};
use tandem_protocol::{ErrorCode, Message, ToolCall, Usage};

use crate::{Embedded, Event, Finish, Generate};

/// Most tokens of one reply when the configuration sets no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: u32 = 1536;
/// The sampler's seed when the configuration sets none: replies repeat run to run.
pub const DEFAULT_SEED: u32 = 42;

/// A loaded model under the name it was pulled as.
#[derive(Debug, Clone)]
pub struct EmbeddedChat {
    engine: Arc<Embedded>,
    name: String,
}

impl EmbeddedChat {
    /// Serves `engine` as the model called `name`.
    pub fn new(engine: Arc<Embedded>, name: impl Into<String>) -> Self {
        Self {
            engine,
            name: name.into(),
        }
    }
}

fn failed(message: String) -> ModelError {
    ModelError::new(ErrorCode::ModelUnavailable, message)
}

impl LocalModel for EmbeddedChat {
    fn complete<'a>(
        &'a self,
        messages: &'a [Message],
        tools: Option<&'a ToolOffer>,
        config: &'a ModelConfig,
        progress: &'a mut (dyn FnMut(ModelProgress<'_>) + Send),
    ) -> BoxFuture<'a, Result<Completion, ModelError>> {
        Box::pin(async move {
            let offered: Vec<serde_json::Value> =
                tools.map(|t| t.tools.clone()).unwrap_or_default();
            let grammar = match tools.filter(|t| !t.tools.is_empty()) {
                Some(offer) => {
                    // Made off the async workers: a client's schema is walked there.
                    let tools = offer.tools.clone();
                    let made = tokio::task::spawn_blocking(move || crate::tool_grammar(&tools))
                        .await
                        .map_err(|e| {
                            failed(format!("the tools' grammar could not be made: {e}"))
                        })?;
                    Some((made.map_err(failed)?, offer.required))
                }
                None => None,
            };
            let request = Generate {
                messages: messages.iter().map(wire_message).collect(),
                tools: offered.clone(),
                grammar,
                max_tokens: config.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
                temperature: config.temperature.unwrap_or(0.0),
                seed: config.seed.unwrap_or(DEFAULT_SEED),
                stop: config.stop.clone(),
            };
            let mut reply = self
                .engine
                .generate(request)
                .map_err(|e| failed(e.to_string()))?;
            let mut text = String::new();
            while let Some(event) = reply.events.recv().await {
                match event {
                    Event::Text(piece) => {
                        let room = config.max_reply_bytes.saturating_sub(text.len());
                        let piece = &piece[..piece.floor_char_boundary(room)];
                        progress(ModelProgress::Delta(piece));
                        text.push_str(piece);
                    }
                    Event::Done {
                        finish,
                        prompt_tokens,
                        completion_tokens,
                        ..
                    } => {
                        let (text, tool_calls) = calls_of(text, &offered);
                        return Ok(Completion {
                            text,
                            usage: Some(Usage {
                                prompt_tokens: prompt_tokens.into(),
                                completion_tokens: completion_tokens.into(),
                                estimated: false,
                            }),
                            finish_reason: Some(
                                match finish {
                                    Finish::Stop => "stop",
                                    Finish::Length => "length",
                                }
                                .to_owned(),
                            ),
                            tool_calls,
                            ..Completion::default()
                        });
                    }
                    Event::Failed(reason) => {
                        return Err(failed(format!(
                            "the embedded model {} failed: {reason}",
                            self.name
                        )));
                    }
                }
            }
            Err(failed(format!(
                "the embedded model {} stopped without finishing its reply",
                self.name
            )))
        })
    }

    fn describe(&self) -> String {
        match self.engine.draft() {
            Some(draft) => format!(
                "the embedded engine ({}, drafting with {})",
                self.engine.path().display(),
                draft.display()
            ),
            None => format!("the embedded engine ({})", self.engine.path().display()),
        }
    }

    fn stats(&self) -> Option<tandem_protocol::engine::EngineStats> {
        Some(self.engine.stats())
    }
}

/// A message as the chat template reads it: the OpenAI shape, a call's arguments as an
/// object where they are JSON.
fn wire_message(m: &Message) -> serde_json::Value {
    let mut v = serde_json::json!({"role": m.role.as_str(), "content": m.content});
    if !m.tool_calls.is_empty() {
        v["tool_calls"] = m
            .tool_calls
            .iter()
            .map(|c| {
                let arguments = serde_json::from_str::<serde_json::Value>(&c.arguments)
                    .unwrap_or_else(|_| serde_json::Value::String(c.arguments.clone()));
                serde_json::json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
            })
            .collect();
    }
    if let Some(id) = &m.tool_call_id {
        v["tool_call_id"] = serde_json::json!(id);
    }
    v
}

/// The reply's prose and the calls it wrote (`<tool_call>` elements) of the tools it was
/// offered, as native calls.
fn calls_of(text: String, offered: &[serde_json::Value]) -> (String, Vec<ToolCall>) {
    if offered.is_empty() {
        return (text, Vec::new());
    }
    let known = |name: &str| offered.iter().any(|t| t["function"]["name"] == name);
    let calls = tandem_agent::tools::calls::calls_in_text(&text, &known);
    if calls.is_empty() {
        return (text, calls);
    }
    let prose = text
        .split("<tool_call>")
        .next()
        .unwrap_or("")
        .trim_end()
        .to_owned();
    let calls = calls
        .into_iter()
        .enumerate()
        .map(|(n, c)| ToolCall {
            id: format!("call_{}", n + 1),
            ..c
        })
        .collect();
    (prose, calls)
}
