//! The embedded model as the assistant's chat model.

use std::sync::Arc;

use futures::future::BoxFuture;
use tandem_agent::chat::{
    Completion, LocalModel, ModelConfig, ModelError, ModelProgress, ToolOffer,
};
use tandem_protocol::{ErrorCode, Message, Role, Usage};

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
        _tools: Option<&'a ToolOffer>,
        config: &'a ModelConfig,
        progress: &'a mut (dyn FnMut(ModelProgress<'_>) + Send),
    ) -> BoxFuture<'a, Result<Completion, ModelError>> {
        Box::pin(async move {
            let request = Generate {
                messages: messages
                    .iter()
                    .map(|m| {
                        let role = match m.role {
                            Role::System => "system",
                            Role::User | Role::Tool => "user",
                            Role::Assistant => "assistant",
                        };
                        // The template knows no calls: they go as the text Qwen writes them in.
                        let mut content = m.content.clone();
                        for call in &m.tool_calls {
                            content.push_str(&format!(
                                "\n<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
                                serde_json::Value::String(call.name.clone()),
                                call.arguments
                            ));
                        }
                        (role.to_owned(), content)
                    })
                    .collect(),
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
                        return Ok(Completion {
                            text,
                            usage: Some(Usage {
                                prompt_tokens: prompt_tokens.into(),
                                completion_tokens: completion_tokens.into(),
                            }),
                            finish_reason: Some(
                                match finish {
                                    Finish::Stop => "stop",
                                    Finish::Length => "length",
                                }
                                .to_owned(),
                            ),
                            tool_calls: Vec::new(),
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
        format!("the embedded engine ({})", self.engine.path().display())
    }
}
