//! What an agent is to the team: something that replies to what it sees, turn by turn, and
//! the hooks every turn passes through.

use futures::future::BoxFuture;
use tandem_executor::CancellationToken;
use tandem_protocol::team::Kind;
use tandem_protocol::{ErrorInfo, Message, ToolCall, Usage};

use crate::chat::{ChatModel, ToolOffer};
use crate::events::{EventSink, progress};

/// Code that sees what an agent is about to receive before it replies, and may change it or
/// refuse the turn: what the file's hooks (`keep_last`, `redact`, ...) do as data, in code.
/// An approval gate is one.
pub trait Hook: Send + Sync {
    /// Called before the agent at `path` replies. `messages` is all it will receive: an
    /// assistant's whole view (system prompt first), or, for an executor, the one message
    /// whose code it is about to run (an edit changes the code). `Err(reason)` refuses the
    /// turn: an assistant says nothing; an executor runs nothing and reports the reason.
    fn before_reply(
        &self,
        path: &str,
        kind: Kind,
        messages: &mut Vec<Message>,
    ) -> Result<(), String>;
}

/// What an agent said in one turn, and the tokens it spent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentReply {
    /// Its words (markdown; code in fenced blocks).
    pub text: String,
    /// Tokens used, when it called a model that said.
    pub usage: Option<Usage>,
    /// The tools it called natively.
    pub calls: Vec<ToolCall>,
}

/// One turn of an [`Agent`]: its number, where its progress goes, and how it is stopped.
pub struct Turn<'a> {
    /// The team's turn number, which its events carry.
    pub number: u32,
    /// Where its events go: streamed text ([`EventMsg::AssistantDelta`](tandem_protocol::EventMsg::AssistantDelta)), retries. Its
    /// whole reply is told for it, as an `assistant_message`.
    pub events: &'a EventSink,
    /// Cancelled when the task is: a reply still coming is no longer wanted.
    pub cancel: &'a CancellationToken,
    /// The tools offered, if any.
    pub tools: Option<&'a ToolOffer>,
    /// Most tokens the reply may have: what is left of the task's `max_output_tokens`.
    pub max_tokens: Option<u32>,
    /// How to sample this reply instead of the agent's own settings: one of several drawn
    /// to choose among. An agent that does not sample may ignore it.
    pub sample: Option<Sample>,
}

/// Sampling for one of several replies drawn to the same view.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// The temperature.
    pub temperature: f32,
    /// The seed: each reply drawn has its own.
    pub seed: u32,
}

/// Something that replies to what it sees: the one thing every agent that speaks does. A
/// model is one (an `assistant` of a team file); [`Team::with_agent`](super::Team::with_agent) puts one written in
/// Rust (rules, a tool, another framework) in an assistant's place. Teams themselves (chat,
/// loop, sequence, parallel) are made of agents by the file, and executors run code.
pub trait Agent: Send + Sync {
    /// Replies to `messages`: the agent's whole view, its instructions first, the others'
    /// messages as `user` messages with their names. `Ok(None)` when `turn.cancel` fired.
    fn reply<'a>(
        &'a self,
        messages: &'a [Message],
        turn: Turn<'a>,
    ) -> BoxFuture<'a, Result<Option<AgentReply>, ErrorInfo>>;
}

impl Agent for ChatModel {
    fn reply<'a>(
        &'a self,
        messages: &'a [Message],
        turn: Turn<'a>,
    ) -> BoxFuture<'a, Result<Option<AgentReply>, ErrorInfo>> {
        Box::pin(async move {
            let mut progress = progress(turn.events, turn.number);
            let mut model = std::borrow::Cow::Borrowed(self);
            if let Some(n) = turn.max_tokens {
                model = std::borrow::Cow::Owned(model.capped(n));
            }
            if let Some(sample) = turn.sample {
                model = std::borrow::Cow::Owned(model.sampled(sample.temperature, sample.seed));
            }
            tokio::select! {
                reply = model.complete_with(messages, turn.tools, &mut progress) => {
                    let reply = reply.map_err(ErrorInfo::from)?;
                    Ok(Some(AgentReply { text: reply.text, usage: reply.usage, calls: reply.tool_calls }))
                }
                () = turn.cancel.cancelled() => Ok(None),
            }
        })
    }
}
