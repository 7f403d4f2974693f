//! Running a checked team: agents take turns on one shared history, each seeing its own
//! messages as `assistant` and everyone else's as `user` messages with the speaker's name.
//!
//! Escalation is a value a run returns ([`Ended::Escalated`]), caught by the nearest
//! enclosing loop, which ends and reports a normal end to its own parent: an escalation never
//! ends more than the innermost loop.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use regex::Regex;
use tandem_executor::CancellationToken;
use tandem_protocol::team::{Aggregate, Kind, SelectionKind};
use tandem_protocol::{
    ErrorCode, ErrorInfo, EventMsg, Message, Role, StopReason, ToolCall, ToolReply, Usage,
};
use tracing::Instrument;

pub use super::history::{Replay, Said};
use super::spend::{Spend, Spending};
use super::termination::{ChatState, Condition, Test};
use crate::blocks::{self, RunOptions, SessionSlot};
use crate::chat::{ChatModel, ToolOffer};
use crate::events::EventSink;
use crate::events::progress;
use crate::examples::Examples;
use crate::extract::{CodeBlock, extract_code_blocks};
use crate::team::Node;
use crate::termination::{is_termination_block, mentions};
use crate::tools::ToolBox;

/// Most replies drawn to choose among: each is a whole generation.
pub const MOST_CANDIDATES: u32 = 8;

/// The temperature of the replies drawn beside the agent's own: varied enough to differ
/// where the agent's own went wrong.
pub(super) const CANDIDATE_TEMPERATURE: f32 = 0.8;

/// How one agent's (or team's) run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It did its part (said something, or had nothing to say).
    Done,
    /// An assistant said its `escalate` word: the innermost loop around it ends.
    Escalated,
    /// A chat's termination fired: why, and whether that was a limit (`max_turns`, ...).
    Finished {
        /// The condition, in words.
        by: String,
        /// The stop reason for the task when this is the top team.
        reason: StopReason,
    },
    /// The task was cancelled or ran out of time or turns: everything stops.
    Stopped(StopReason),
}

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
    /// Where its events go: streamed text ([`EventMsg::AssistantDelta`]), retries. Its
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
/// model is one (an `assistant` of a team file); [`Team::with_agent`] puts one written in
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

/// What a team needs that the file does not say: a model per assistant, an executor session
/// per executor, and where events go.
pub struct Team {
    pub(super) root: Node,
    /// Every agent, a chat's selector model and the team's own ([`SELECTOR`]), by path.
    pub(super) members: HashMap<String, Member>,
    /// Most turns of all agents together, whatever the team's own limits.
    pub max_turns: u32,
    pub(super) hooks: Vec<std::sync::Arc<dyn Hook>>,
    pub(super) approval: Option<Arc<crate::approval::ApprovalGate>>,
    pub(super) block_timeout: Duration,
    pub(super) output_cap: usize,
    /// Every `mention` and `ends_with` word of the team's chats: a block holding only one of
    /// them is a way of saying it, which no executor runs.
    pub(super) words: Vec<String>,
    /// Turns are the assistants' alone, told as `turn_started`: an executor's reply belongs
    /// to the turn whose code it answers (the two-agent pair's shape).
    pub(super) exchange_turns: bool,
    /// What the task may spend on model calls, and each model's price.
    pub(super) spend: Spend,
    /// The JSON Schema the task's final answer ends with a value of, checked when the top
    /// chat would end; a task's result.
    pub(super) output_schema: Option<Arc<crate::schema::OutputSchema>>,
    /// Each assistant's tools, by its name (what its messages' `speaker` is): offered to its
    /// model, and run by the executor that answers it.
    pub(super) tools: HashMap<String, Arc<ToolBox>>,
}

/// One agent of the team (or a chat's own selector model), by its path: what it was made
/// with and what the task gave it.
#[derive(Default)]
pub(super) struct Member {
    /// An assistant's (or a selector's) model, with the model's name and whether it runs in
    /// this process.
    pub(super) model: Option<(Arc<dyn Agent>, String, bool)>,
    /// An executor's session.
    pub(super) slot: Option<tokio::sync::Mutex<SessionSlot>>,
    /// What is hidden from what it is shown.
    pub(super) redact: Vec<Regex>,
    /// A chat's termination, compiled once.
    pub(super) condition: Option<Condition>,
    /// The examples an executor runs against each clean run of code.
    pub(super) examples: Option<Arc<Examples>>,
    /// How many replies an assistant draws, and the executor whose examples choose.
    pub(super) candidates: Option<(String, u32)>,
}

impl Member {
    pub(super) fn with_model(agent: Arc<dyn Agent>, made: &ChatModel) -> Self {
        Self {
            model: Some((agent, made.config().model.clone(), made.is_embedded())),
            ..Self::default()
        }
    }
}

/// What an answer's value for the output schema does to a chat.
pub(super) enum SchemaStep {
    /// The chat ends here.
    End(Ended),
    /// This member is asked again.
    Again(usize),
    /// The chat goes on as it would.
    On,
}

/// How a run of a team went.
#[derive(Debug)]
pub struct Run {
    /// How it ended, or what broke.
    pub ended: Result<Ended, ErrorInfo>,
    /// The shared history, the task first.
    pub history: Vec<Said>,
    /// Tokens used.
    pub usage: Usage,
    /// Turns taken.
    pub turns: u32,
    /// What the model calls cost, when every model called has a price.
    pub cost: Option<f64>,
    /// The budget the run stopped at, if it did.
    pub budget: Option<tandem_protocol::BudgetReached>,
    /// The value its final answer ended with, when the task has an output schema.
    pub result: Option<serde_json::Value>,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("root", &self.root.path)
            .finish_non_exhaustive()
    }
}

impl Team {
    /// The model of the agent (or selector) at `path`.
    pub(super) fn model(&self, path: &str) -> Option<&Arc<dyn Agent>> {
        self.members.get(path)?.model.as_ref().map(|(m, ..)| m)
    }

    /// The session of the executor at `path`.
    pub(super) fn slot(&self, path: &str) -> Option<&tokio::sync::Mutex<SessionSlot>> {
        self.members.get(path)?.slot.as_ref()
    }

    /// Runs the team on `task`; returns how it ended, the history, the tokens used and the
    /// turns taken. `replay` is what a run that was interrupted already said, by agent path
    /// ([`replay_of`]): those turns are not asked again but their words taken, which brings
    /// every selection and iteration counter back where it was.
    pub async fn run(
        &self,
        task: &str,
        events: EventSink,
        cancel: CancellationToken,
        replay: Replay,
    ) -> Run {
        let shared = Shared {
            turns: AtomicU32::new(0),
            spending: self.spend.start(),
            replay: Mutex::new(replay.into()),
            result: Mutex::new(None),
            drew: std::sync::atomic::AtomicBool::new(false),
            checked: Mutex::new(None),
            grounded: std::sync::atomic::AtomicBool::new(false),
        };
        let ctx = Ctx {
            team: self,
            shared: &shared,
            events,
            cancel,
        };
        let mut history = vec![Said {
            speaker: "user".to_owned(),
            text: task.to_owned(),
            ..Said::default()
        }];
        let ended = ctx.run(&self.root, &mut history, true).await;
        Run {
            ended,
            history,
            usage: shared.spending.spent(),
            turns: shared.turns.load(Ordering::SeqCst),
            cost: shared.spending.cost(),
            budget: shared.spending.take_reached(),
            result: shared.result.lock().ok().and_then(|mut r| r.take()),
        }
    }

    /// Every word that ends one of the team's chats.
    pub(crate) fn words(&self) -> &[String] {
        &self.words
    }

    /// Runs a task's `check` in the session of the executor at `path`, after the run.
    pub(crate) async fn check(
        &self,
        path: &str,
        check: &tandem_protocol::Check,
        answer: Option<&str>,
        outputs: &[&str],
        cancel: &CancellationToken,
    ) -> Option<tandem_protocol::CheckOutcome> {
        let Some(slot) = self.slot(path) else {
            return Some(tandem_protocol::CheckOutcome {
                verdict: tandem_protocol::Verdict::Error,
                detail: format!("{path}: no executor session to run the check in"),
                printed: None,
            });
        };
        let mut slot = slot.lock().await;
        crate::check::run_check(&mut slot, check, answer, outputs, cancel).await
    }

    /// Closes every executor session.
    pub async fn close(self) {
        for (path, member) in self.members {
            let Some(slot) = member.slot else {
                continue;
            };
            if let Err(e) = slot.into_inner().close().await {
                tracing::warn!(agent = %path, error = %e, "closing an executor session failed");
            }
        }
    }
}

/// The key of the team's own model (selection and `llm` terminations of chats that name no
/// model of their own) among the agents' paths, which are never empty.
pub(super) const SELECTOR: &str = "";

/// What every part of one run shares, parallel branches included.
pub(super) struct Shared {
    pub(super) turns: AtomicU32,
    /// What the run's model calls spent, and the budget that stopped it.
    pub(super) spending: Spending,
    pub(super) replay: Mutex<std::collections::VecDeque<(String, Said)>>,
    /// The value the final answer ended with, checked against the output schema.
    pub(super) result: Mutex<Option<serde_json::Value>>,
    /// Replies were drawn to choose among: a task draws once, at its first reply whose
    /// code does not hold its examples.
    pub(super) drew: std::sync::atomic::AtomicBool,
    /// The code of the last reply told whose examples ran before it was, and what they
    /// printed: its executor reads that rather than run them again.
    pub(super) checked: Mutex<Option<(String, String)>>,
    /// The model was told once that its answer disagrees with its code's output.
    pub(super) grounded: std::sync::atomic::AtomicBool,
}

/// A run, as one branch of it sees it: a parallel branch has its own event sink.
pub(super) struct Ctx<'a> {
    pub(super) team: &'a Team,
    pub(super) shared: &'a Shared,
    pub(super) events: EventSink,
    pub(super) cancel: CancellationToken,
}

/// The session slot of an executor agent `node` on `executor`, limited to the agent's
/// `languages`; a language the executor does not run is an error naming the field.
pub fn executor_slot(
    node: &Node,
    executor: std::sync::Arc<dyn tandem_executor::Executor>,
    session: tandem_executor::SessionSpec,
) -> Result<SessionSlot, ErrorInfo> {
    let languages = node
        .spec
        .languages
        .as_deref()
        .map(|asked| crate::allowed_languages(asked, executor.as_ref()))
        .transpose()
        .map_err(|e| ErrorInfo {
            code: ErrorCode::InvalidRequest,
            message: format!("{}.languages: {e}", node.path),
        })?;
    let mut session = session;
    if let Some(keep) = node.spec.keep_state {
        session.keep_state = keep;
    }
    if session.keep_state && !executor.keeps_state() {
        return Err(ErrorInfo {
            code: ErrorCode::InvalidRequest,
            message: format!(
                "{}.keep_state: the {} executor cannot keep a Python interpreter between blocks; use local or docker, or leave keep_state out",
                node.path,
                executor.name()
            ),
        });
    }
    Ok(SessionSlot::new(executor, session).only(languages))
}

/// What a team's stored events say each agent said, in order: the replay for a resume. A
/// turn that was cut off (no message after its `turn_started`) is not in it, so it runs again.
pub fn replay_of(events: &[EventMsg]) -> Replay {
    let mut said = Vec::new();
    // By turn: parallel members' events interleave, and each message names its turn.
    let mut speaking: HashMap<u32, &str> = HashMap::new();
    for e in events {
        match e {
            EventMsg::TurnStarted {
                turn,
                agent: Some(agent),
            } => {
                speaking.insert(*turn, agent);
            }
            EventMsg::AssistantMessage {
                turn,
                text,
                tool_calls,
                ..
            } => {
                if let Some(agent) = speaking.remove(turn) {
                    said.push((
                        agent.to_owned(),
                        Said {
                            text: text.clone(),
                            calls: tool_calls.clone(),
                            ..Said::default()
                        },
                    ));
                }
            }
            EventMsg::ExecutorMessage {
                turn,
                text,
                tool_results,
            } => {
                if let Some(agent) = speaking.remove(turn) {
                    said.push((
                        agent.to_owned(),
                        Said {
                            text: text.clone(),
                            output: true,
                            results: tool_results.clone(),
                            ..Said::default()
                        },
                    ));
                }
            }
            _ => {}
        }
    }
    said
}

impl Ctx<'_> {
    fn run<'b>(
        &'b self,
        node: &'b Node,
        history: &'b mut Vec<Said>,
        top: bool,
    ) -> BoxFuture<'b, Result<Ended, ErrorInfo>> {
        Box::pin(async move {
            if self.cancel.is_cancelled() {
                return Ok(Ended::Stopped(StopReason::Cancelled));
            }
            match node.spec.kind {
                Kind::Assistant => self.assistant(node, history).await,
                Kind::Executor => self.executor(node, history).await,
                Kind::Sequence => {
                    for member in &node.members {
                        match self.run(member, history, false).await? {
                            Ended::Done | Ended::Finished { .. } => {}
                            other => return Ok(other),
                        }
                    }
                    Ok(Ended::Done)
                }
                Kind::Loop => {
                    let max = node.spec.max_iterations.unwrap_or(u32::MAX);
                    for _ in 0..max {
                        for member in &node.members {
                            match self.run(member, history, false).await? {
                                // Caught here, by the innermost loop: the team around it
                                // goes on.
                                Ended::Escalated => {
                                    let by = history.last().map_or_else(
                                        || "an escalation".to_owned(),
                                        |s| format!("{} escalated", s.speaker),
                                    );
                                    self.ended(node, by);
                                    return Ok(Ended::Done);
                                }
                                Ended::Stopped(r) => return Ok(Ended::Stopped(r)),
                                Ended::Done | Ended::Finished { .. } => {}
                            }
                        }
                    }
                    self.ended(node, format!("max_iterations {max}"));
                    Ok(Ended::Done)
                }
                Kind::Parallel => self.parallel(node, history).await,
                Kind::Chat => {
                    let nested = !top && node.spec.aggregate == Some(Aggregate::Nested);
                    if !nested {
                        return self.chat(node, history).await;
                    }
                    // The inner conversation stays inside; the outer history gets its end.
                    let mut inner = history.clone();
                    let before = inner.len();
                    let ended = self.chat(node, &mut inner).await?;
                    if let Some(last) = inner.get(before..).and_then(|new| new.last()) {
                        history.push(Said {
                            speaker: node.name.clone(),
                            text: last.text.clone(),
                            output: last.output,
                            ..Said::default()
                        });
                    }
                    Ok(ended)
                }
            }
        })
    }

    /// Starts `node`'s turn: its number, announced; or the stop when the team's turn limit
    /// is reached.
    fn start_turn(&self, node: &Node) -> Result<u32, StopReason> {
        if self.uncounted(node) {
            return Ok(self.shared.turns.load(Ordering::SeqCst));
        }
        let turn = self.count_turn()?;
        // A pair's turns are exchanges, and name no agent.
        let agent = (!self.team.exchange_turns).then(|| node.path.clone());
        (self.events)(EventMsg::TurnStarted { turn, agent });
        Ok(turn)
    }

    /// Whether `node`'s turns go uncounted: an executor's, when turns are exchanges.
    fn uncounted(&self, node: &Node) -> bool {
        self.team.exchange_turns && node.spec.kind == Kind::Executor
    }

    /// What an executor does for `said`: its calls (native, else written as text when its
    /// speaker has tools) and the blocks to run.
    fn work(&self, said: &Said) -> (Vec<ToolCall>, Vec<CodeBlock>) {
        let mut blocks = self.runnable(&said.text);
        if !said.calls.is_empty() {
            return (said.calls.clone(), blocks);
        }
        let Some(tools) = self.team.tools.get(&said.speaker) else {
            return (Vec::new(), blocks);
        };
        let calls = crate::calls::calls_in_text(&said.text, &|name| tools.get(name).is_some());
        if !calls.is_empty() {
            // A call written as a fenced block of JSON is the call, not code to run.
            blocks.retain(|b| !crate::calls::is_json(&b.code));
        }
        (calls, blocks)
    }

    /// The blocks of `text` an executor runs: all but those holding only a termination word.
    pub(super) fn runnable(&self, text: &str) -> Vec<CodeBlock> {
        let mut code = extract_code_blocks(text);
        code.retain(|b| {
            !self
                .team
                .words
                .iter()
                .any(|w| is_termination_block(&b.code, w))
        });
        code
    }

    fn count_turn(&self) -> Result<u32, StopReason> {
        let turn = self.shared.turns.fetch_add(1, Ordering::SeqCst) + 1;
        if turn > self.team.max_turns {
            self.shared.turns.fetch_sub(1, Ordering::SeqCst);
            return Err(StopReason::MaxTurns);
        }
        Ok(turn)
    }

    /// What the agent at `path` said next in the run being resumed, if it said more. Taken
    /// by agent, not strictly in order: parallel members may ask in another order than
    /// they answered before.
    fn replayed(&self, path: &str) -> Option<Said> {
        let mut replay = self.shared.replay.lock().ok()?;
        let at = replay.iter().position(|(agent, _)| agent == path)?;
        replay.remove(at).map(|(_, said)| said)
    }

    /// What `node` sees: its instructions, the task, then the history through its hooks.
    fn view(&self, node: &Node, history: &[Said]) -> Vec<Message> {
        let spec = &node.spec;
        let instructions = spec.instructions.clone().unwrap_or_else(|| {
            format!(
                "You are {}, one member of a team working on the task below.{}",
                node.name,
                spec.description
                    .as_deref()
                    .map(|d| format!(" Your part: {d}."))
                    .unwrap_or_default()
            )
        });
        let instructions = match self.team.tools.get(&node.name).map(|t| t.code_via) {
            Some(tandem_protocol::CodeVia::Tool) => format!(
                "{}\n- Run code by calling the `execute_code` tool; its result is the program's exit code and output.",
                instructions.trim_end()
            ),
            Some(tandem_protocol::CodeVia::Auto) => format!(
                "{}\n- You can run code by calling the `execute_code` tool, or in fenced blocks.",
                instructions.trim_end()
            ),
            _ => instructions,
        };
        let mut messages = vec![Message::new(Role::System, instructions)];
        let keep = spec.keep_last.unwrap_or(usize::MAX);
        let rest = history.get(1..).unwrap_or_default();
        let kept: Vec<&Said> = history
            .iter()
            .take(1)
            .chain(rest.iter().skip(rest.len().saturating_sub(keep)))
            .collect();
        let redact = self.team.members.get(&node.path).map(|m| &m.redact);
        let clean = |text: &str, output: bool| {
            let mut text = text.to_owned();
            if output && let Some(cap) = spec.max_output_bytes {
                text = crate::grounding::clip(&text, cap);
            }
            for re in redact.into_iter().flatten() {
                text = re.replace_all(&text, "[redacted]").into_owned();
            }
            text
        };
        for (i, said) in kept.iter().enumerate() {
            let own = said.speaker == node.name;
            // The chat APIs take calls only with an answer to each right after them: this
            // agent's calls answered by the next message are native, all else is told as text.
            let answered = own
                && !said.calls.is_empty()
                && kept.get(i + 1).is_some_and(|next| {
                    said.calls
                        .iter()
                        .map(|c| &c.id)
                        .eq(next.results.iter().map(|r| &r.id))
                });
            let native_results = !said.results.is_empty()
                && i > 0
                && kept[i - 1].speaker == node.name
                && kept[i - 1]
                    .calls
                    .iter()
                    .map(|c| &c.id)
                    .eq(said.results.iter().map(|r| &r.id));
            let mut text = clean(&said.text, said.output);
            if !answered {
                for call in &said.calls {
                    text.push_str(&format!(
                        "{}[called tool `{}` with {}]",
                        if text.is_empty() { "" } else { "\n" },
                        call.name,
                        call.arguments
                    ));
                }
            }
            if native_results {
                for reply in &said.results {
                    let mut tool = Message::tool(reply);
                    tool.content = clean(&reply.content, true);
                    messages.push(tool);
                }
                if text.is_empty() {
                    continue;
                }
            } else {
                for reply in &said.results {
                    text.push_str(&format!(
                        "{}[tool `{}` answered]\n{}",
                        if text.is_empty() { "" } else { "\n" },
                        reply.name,
                        clean(&reply.content, true)
                    ));
                }
            }
            let mut message = if own {
                Message::new(Role::Assistant, text)
            } else {
                Message::new(Role::User, text)
            };
            if answered {
                message.tool_calls = said.calls.clone();
            }
            if !own && said.speaker != "user" {
                message.name = Some(said.speaker.clone());
            }
            messages.push(message);
        }
        messages
    }

    async fn assistant(&self, node: &Node, history: &mut Vec<Said>) -> Result<Ended, ErrorInfo> {
        if let Some(said) = self.replayed(&node.path) {
            if let Err(reason) = self.count_turn() {
                return Ok(Ended::Stopped(reason));
            }
            return Ok(self.said(node, history, said.text, said.calls));
        }
        let Some(model) = self.team.model(&node.path) else {
            return Err(internal(&node.path, "has no model"));
        };
        if let Some(reason) = self.over_budget() {
            return Ok(Ended::Stopped(reason));
        }
        let turn = match self.start_turn(node) {
            Ok(turn) => turn,
            Err(reason) => return Ok(Ended::Stopped(reason)),
        };
        let mut view = self.view(node, history);
        if let Err(reason) = self.hooked(node, &mut view) {
            tracing::info!(agent = %node.path, %reason, "a hook refused the turn");
            return Ok(Ended::Done);
        }
        let offer = self.team.tools.get(&node.name).and_then(|t| t.offer());
        let span = crate::trace::agent(&node.name, &node.path, turn);
        let asked = match self.drawing(node, offer) {
            Some((executor, k)) => {
                self.checked(&node.path, model.as_ref(), &view, turn, executor, k)
                    .instrument(span)
                    .await?
            }
            None => {
                self.call(&node.path, model.as_ref(), &view, turn, offer)
                    .instrument(span)
                    .await?
            }
        };
        match asked {
            Some(reply) => Ok(self.said(node, history, reply.text, reply.calls)),
            None => Ok(Ended::Stopped(StopReason::Cancelled)),
        }
    }

    /// One agent's reply in turn `turn`: streamed as its events, its tokens counted, its reply
    /// told as an `assistant_message`; `None` when the run was cancelled meanwhile.
    async fn call(
        &self,
        path: &str,
        agent: &dyn Agent,
        messages: &[Message],
        turn: u32,
        tools: Option<&ToolOffer>,
    ) -> Result<Option<AgentReply>, ErrorInfo> {
        let asked = Turn {
            number: turn,
            events: &self.events,
            cancel: &self.cancel,
            tools,
            max_tokens: self
                .shared
                .spending
                .output_left(&self.team.spend)
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
            sample: None,
        };
        let Some(reply) = agent.reply(messages, asked).await? else {
            return Ok(None);
        };
        self.told(path, turn, &reply);
        Ok(Some(reply))
    }

    /// The reply of turn `turn` is counted (its tokens and their cost) and told, as an
    /// `assistant_message`.
    pub(super) fn told(&self, path: &str, turn: u32, reply: &AgentReply) {
        self.shared
            .spending
            .record(&self.team.spend, path, reply.usage);
        (self.events)(EventMsg::AssistantMessage {
            turn,
            text: reply.text.clone(),
            usage: reply.usage,
            tool_calls: reply.calls.clone(),
        });
    }

    /// An assistant's words join the history; its escalation word ends its loop.
    fn said(
        &self,
        node: &Node,
        history: &mut Vec<Said>,
        text: String,
        calls: Vec<ToolCall>,
    ) -> Ended {
        let escalates = node
            .spec
            .escalate
            .as_deref()
            .is_some_and(|word| mentions(&text, word));
        history.push(Said {
            speaker: node.name.clone(),
            text,
            calls,
            ..Said::default()
        });
        if escalates {
            Ended::Escalated
        } else {
            Ended::Done
        }
    }

    /// Runs the code and the tool calls of the message before it; when there is none (or
    /// the message is its own), says its `no_code_reply`, or nothing.
    async fn executor(&self, node: &Node, history: &mut Vec<Said>) -> Result<Ended, ErrorInfo> {
        let Some(last) = history
            .last()
            .filter(|s| s.speaker != node.name && !s.output)
        else {
            return Ok(Ended::Done);
        };
        let (calls, code) = self.work(last);
        let has_code = !code.is_empty() || !calls.is_empty();
        if !has_code && node.spec.no_code_reply.is_none() {
            return Ok(Ended::Done);
        }
        let native = !last.calls.is_empty();
        let caller = last.speaker.clone();
        if let Some(mut report) = self.replayed(&node.path) {
            if !self.uncounted(node)
                && let Err(reason) = self.count_turn()
            {
                return Ok(Ended::Stopped(reason));
            }
            report.speaker = node.name.clone();
            report.output = true;
            history.push(report);
            return Ok(Ended::Done);
        }
        let Some(slot) = self.team.slot(&node.path) else {
            return Err(internal(&node.path, "has no executor session"));
        };
        let turn = match self.start_turn(node) {
            Ok(turn) => turn,
            Err(reason) => return Ok(Ended::Stopped(reason)),
        };
        let no_code = node.spec.no_code_reply.clone().unwrap_or_default();
        let span = crate::trace::agent(&node.name, &node.path, turn);
        if !has_code {
            return Ok(self.reported(node, history, turn, no_code, Vec::new()));
        }
        let refuse_all = |why: &str| {
            calls
                .iter()
                .map(|c| ToolReply {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    content: format!("error: not run: {why}"),
                })
                .collect::<Vec<_>>()
        };
        let mut code_message = vec![Message::new(Role::User, last.text.clone())];
        if let Err(reason) = self.hooked(node, &mut code_message) {
            let results = if native {
                refuse_all(&reason)
            } else {
                Vec::new()
            };
            return Ok(self.reported(node, history, turn, format!("Not run: {reason}"), results));
        }
        let code = if calls.is_empty() || native {
            code_message
                .first()
                .map(|m| self.runnable(&m.content))
                .unwrap_or_default()
        } else {
            code
        };
        let mut slot = slot.lock().await;
        let opts = RunOptions {
            turn,
            timeout: None,
            cancel: self.cancel.clone(),
            events: self.events.clone(),
            approval: self.team.approval.clone(),
            code_tools: crate::dispatch::code_tools(self.team.tools.get(&caller).cloned()),
        };
        let broke = |e: tandem_executor::ExecError, slot: &blocks::SessionSlot| ErrorInfo {
            code: ErrorCode::Executor,
            message: format!(
                "{}: the {} executor failed: {e}",
                node.path,
                slot.executor().name()
            ),
        };
        let runs = match blocks::run_blocks(&mut slot, &code, &opts)
            .instrument(span.clone())
            .await
        {
            Ok(runs) => runs,
            Err(e) => return Err(broke(e, &slot)),
        };
        let tools = self.team.tools.get(&caller).cloned().unwrap_or_default();
        let first = u32::try_from(code.len() + 1).unwrap_or(u32::MAX);
        let answered = match crate::dispatch::run_calls(&mut slot, &tools, &calls, first, &opts)
            .instrument(span)
            .await
        {
            Ok(answered) => answered,
            Err(e) => return Err(broke(e, &slot)),
        };
        if self.cancel.is_cancelled() {
            return Ok(Ended::Stopped(StopReason::Cancelled));
        }
        let mut report = if code.is_empty() {
            String::new()
        } else {
            blocks::report(
                &runs,
                code.len().saturating_sub(runs.len()),
                self.team.block_timeout,
                self.team.output_cap,
                &no_code,
            )
        };
        if let Some(note) = self.examples_note(node, &mut slot, &code, &runs).await {
            report = blocks::with_examples(report, &note);
        }
        let results: Vec<ToolReply> = answered.into_iter().map(|a| a.reply).collect();
        let asked_calls = !calls.is_empty();
        Ok(self.tell_runs(
            node,
            history,
            turn,
            report,
            &runs,
            results,
            native,
            asked_calls,
        ))
    }

    /// A turn's runs told as the executor's reply: the blocks' report, after a clean run
    /// that printed something the pair's ask for the answer, and the calls' answers (as
    /// native replies, or as text when the calls were written as text).
    #[allow(clippy::too_many_arguments)]
    fn tell_runs(
        &self,
        node: &Node,
        history: &mut Vec<Said>,
        turn: u32,
        mut report: String,
        runs: &[blocks::BlockRun],
        results: Vec<ToolReply>,
        native: bool,
        asked_calls: bool,
    ) -> Ended {
        let ran: Vec<&blocks::BlockRun> = runs.iter().filter(|r| r.claim.is_none()).collect();
        let printed = (!ran.is_empty() && ran.iter().all(|r| r.result.succeeded()))
            .then(|| {
                ran.iter()
                    .map(|r| r.result.stdout.as_str())
                    .collect::<String>()
            })
            .filter(|p| !p.trim().is_empty());
        // The pair's model hears its output as its own, and what to do with it.
        if self.team.exchange_turns
            && printed.is_some()
            && !asked_calls
            && !report.contains(crate::examples::FAILED_MARK)
        {
            if !report.ends_with('\n') {
                report.push('\n');
            }
            report.push_str(&self.answer_ask());
        }
        if native {
            let ended = self.reported(node, history, turn, report, results);
            if let Some(said) = history.last_mut() {
                said.printed = printed;
            }
            return ended;
        }
        // Calls written as text are answered as text: there is no call id to answer.
        for r in results {
            if !report.is_empty() {
                report.push_str("\n\n");
            }
            report.push_str(&format!("Result of tool `{}`:\n{}", r.name, r.content));
        }
        let ended = self.reported(node, history, turn, report, Vec::new());
        if let Some(said) = history.last_mut() {
            said.printed = printed;
        }
        ended
    }

    /// An executor's report (and its answers to native calls) joins the history.
    pub(super) fn reported(
        &self,
        node: &Node,
        history: &mut Vec<Said>,
        turn: u32,
        report: String,
        results: Vec<ToolReply>,
    ) -> Ended {
        (self.events)(EventMsg::ExecutorMessage {
            turn,
            text: report.clone(),
            tool_results: results.clone(),
        });
        history.push(Said {
            speaker: node.name.clone(),
            text: report,
            output: true,
            results,
            ..Said::default()
        });
        Ended::Done
    }

    /// Members at once, each on its own copy of the history; their messages join it in
    /// member order once all have answered.
    async fn parallel(&self, node: &Node, history: &mut Vec<Said>) -> Result<Ended, ErrorInfo> {
        let before = history.len();
        let mut branches: Vec<Vec<Said>> = node.members.iter().map(|_| history.clone()).collect();
        // Each branch's events wait for the others and are told in member order: streamed
        // text of several agents at once would be unreadable interleaved.
        let buffers: Vec<Arc<Mutex<Vec<EventMsg>>>> =
            node.members.iter().map(|_| Arc::default()).collect();
        let contexts: Vec<Ctx<'_>> = buffers
            .iter()
            .map(|buffer| {
                let buffer = buffer.clone();
                Ctx {
                    team: self.team,
                    shared: self.shared,
                    events: Arc::new(move |e| {
                        if let Ok(mut b) = buffer.lock() {
                            b.push(e);
                        }
                    }),
                    cancel: self.cancel.clone(),
                }
            })
            .collect();
        let runs = node
            .members
            .iter()
            .zip(branches.iter_mut())
            .zip(&contexts)
            .map(|((member, branch), ctx)| ctx.run(member, branch, false));
        // fail_fast: the first error drops the other branches' futures, which cancels them.
        let results: Vec<Result<Ended, ErrorInfo>> = if node.spec.fail_fast == Some(true) {
            match futures::future::try_join_all(runs).await {
                Ok(ended) => ended.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e)],
            }
        } else {
            futures::future::join_all(runs).await
        };
        for buffer in &buffers {
            let events = buffer
                .lock()
                .map(|mut b| std::mem::take(&mut *b))
                .unwrap_or_default();
            for e in events {
                (self.events)(e);
            }
        }
        for branch in &branches {
            history.extend(branch.get(before..).unwrap_or_default().iter().cloned());
        }
        let mut ended = Ended::Done;
        for result in results {
            match result? {
                Ended::Stopped(r) => return Ok(Ended::Stopped(r)),
                Ended::Escalated => ended = Ended::Escalated,
                Ended::Done | Ended::Finished { .. } => {}
            }
        }
        Ok(ended)
    }

    async fn chat(&self, node: &Node, history: &mut Vec<Said>) -> Result<Ended, ErrorInfo> {
        let spec = &node.spec;
        let members = &node.members;
        let started = Instant::now();
        let tokens_before = self.tokens();
        let selection = spec.selection.as_ref();
        let kind = selection.map_or(SelectionKind::RoundRobin, |s| s.kind());
        let executors: Vec<usize> = members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.spec.kind == Kind::Executor)
            .map(|(i, _)| i)
            .collect();
        let after_code = match selection {
            Some(tandem_protocol::team::Selection::Table(t)) => t.executor_after_code,
            _ => None,
        }
        .unwrap_or(executors.len() == 1);
        let initial = spec
            .initial
            .as_ref()
            .and_then(|i| members.iter().position(|m| &m.name == i))
            .unwrap_or(0);
        let mut next = initial;
        let mut messages = 0u32;
        let mut silent = 0usize;
        loop {
            let before = history.len();
            let ended = self.run(&members[next], history, false).await?;
            if !matches!(ended, Ended::Done | Ended::Finished { .. }) {
                return Ok(ended);
            }
            let new: Vec<Said> = history.get(before..).unwrap_or_default().to_vec();
            messages += u32::try_from(new.len()).unwrap_or(u32::MAX);
            silent = if new.is_empty() { silent + 1 } else { 0 };
            match self.schema_answer(node, &new, &executors, history) {
                SchemaStep::End(ended) => return Ok(ended),
                SchemaStep::Again(speaker) => {
                    messages += 1;
                    next = speaker;
                    continue;
                }
                SchemaStep::On => {}
            }
            if let Some(condition) = self
                .team
                .members
                .get(&node.path)
                .and_then(|m| m.condition.as_ref())
            {
                let state = ChatState {
                    path: &node.path,
                    new: &new,
                    history,
                    messages,
                    elapsed: started.elapsed(),
                    tokens: self.tokens() - tokens_before,
                };
                if let Some((by, reason)) = self.fired(condition, &state).await? {
                    // Code in the message that ended the chat still runs, and its output
                    // is recorded, before the chat ends.
                    if let (true, Some(&executor)) =
                        (after_code && self.has_code(&new), executors.first())
                        && let Ended::Stopped(r) =
                            self.run(&members[executor], history, false).await?
                    {
                        return Ok(Ended::Stopped(r));
                    }
                    if let Some(speaker) =
                        self.before_answer_ends(node, &executors, history, reason)
                    {
                        messages += 1;
                        next = speaker;
                        continue;
                    }
                    self.ended(node, by.clone());
                    return Ok(Ended::Finished { by, reason });
                }
            }
            if silent >= members.len() {
                let by = "no member had anything to say".to_owned();
                self.ended(node, by.clone());
                return Ok(Ended::Finished {
                    by,
                    reason: StopReason::Terminated,
                });
            }
            next = match (after_code && self.has_code(&new), executors.first(), kind) {
                (true, Some(&executor), _) => executor,
                (_, _, SelectionKind::RoundRobin) => (next + 1) % members.len(),
                (_, _, SelectionKind::Llm) => self.select(node, history, initial).await?,
            };
        }
    }

    /// Whether `said` has a program for an executor: a call, or a block that is not data
    /// (the ```json block of an answer is data).
    pub(super) fn programs(&self, said: &Said) -> bool {
        super::termination::programs(said, &self.team.words)
    }

    /// `text` with every termination word taken out.
    pub(super) fn without_words(&self, text: &str) -> String {
        self.team.words.iter().fold(text.to_owned(), |t, w| {
            crate::termination::strip_termination(&t, w)
        })
    }

    /// Whether the last of `new` is a member's message with code for an executor.
    fn has_code(&self, new: &[Said]) -> bool {
        new.last().is_some_and(|s| {
            let (calls, code) = self.work(s);
            !s.output && (!code.is_empty() || !calls.is_empty())
        })
    }

    /// Passes `messages` through every hook; the first refusal stops the turn.
    fn hooked(&self, node: &Node, messages: &mut Vec<Message>) -> Result<(), String> {
        for hook in &self.team.hooks {
            hook.before_reply(&node.path, node.spec.kind, messages)?;
        }
        Ok(())
    }

    /// Says that the chat or loop at `node` ended, and why.
    pub(super) fn ended(&self, node: &Node, by: String) {
        if self.team.exchange_turns {
            return;
        }
        (self.events)(EventMsg::TeamEnded {
            agent: node.path.clone(),
            by,
        });
    }

    fn spent(&self) -> Usage {
        self.shared.spending.spent()
    }

    fn over_budget(&self) -> Option<StopReason> {
        self.shared.spending.over(&self.team.spend)
    }

    fn tokens(&self) -> u64 {
        let spent = self.spent();
        spent.prompt_tokens + spent.completion_tokens
    }

    /// The member a model names to speak next; `fallback` when it names none.
    async fn select(
        &self,
        node: &Node,
        history: &[Said],
        fallback: usize,
    ) -> Result<usize, ErrorInfo> {
        let members: Vec<String> = node
            .members
            .iter()
            .map(|m| {
                format!(
                    "- {}: {}",
                    m.name,
                    m.spec
                        .description
                        .as_deref()
                        .unwrap_or(m.spec.kind.as_str())
                )
            })
            .collect();
        let custom = match &node.spec.selection {
            Some(tandem_protocol::team::Selection::Table(t)) => t.prompt.clone(),
            _ => None,
        };
        let prompt = custom.unwrap_or_else(|| {
            "You choose who speaks next in a team's conversation. Answer with the name of one member and nothing else.".to_owned()
        });
        let question = format!(
            "Members:\n{}\n\nConversation:\n{}\n\nWho speaks next?",
            members.join("\n"),
            transcript(history)
        );
        let answer = self
            .ask(
                &format!("{}/selector", node.path),
                &prompt,
                history,
                &question,
            )
            .await?;
        Ok(node
            .members
            .iter()
            .position(|m| mentions(&answer, &m.name))
            .unwrap_or(fallback))
    }

    /// One model call outside any agent's turn (selection, an `llm` termination), shown as
    /// the turn of a pseudo-agent at `path`; it is told the task, then asked `question`.
    async fn ask(
        &self,
        path: &str,
        system: &str,
        history: &[Said],
        question: &str,
    ) -> Result<String, ErrorInfo> {
        if let Some(answer) = self.replayed(path) {
            return Ok(answer.text);
        }
        let turn = self.shared.turns.load(Ordering::SeqCst);
        (self.events)(EventMsg::TurnStarted {
            turn,
            agent: Some(path.to_owned()),
        });
        let task = history.first().map_or("", |s| s.text.as_str());
        let messages = [
            Message::new(Role::System, system),
            Message::new(Role::User, task),
            Message::new(Role::User, question),
        ];
        // A task out of budget asks no model: the next turn stops it.
        if self.over_budget().is_some() {
            return Ok(String::new());
        }
        let Some((priced, model)) = self
            .team
            .model(path)
            .map(|m| (path, m))
            .or_else(|| self.team.model(SELECTOR).map(|m| (SELECTOR, m)))
        else {
            return Ok(String::new());
        };
        Ok(self
            .call(priced, model.as_ref(), &messages, turn, None)
            .await?
            .map(|r| r.text)
            .unwrap_or_default())
    }

    /// Whether `c` holds after the chat's latest messages: the condition in words and the
    /// stop reason it means for a whole task.
    fn fired<'b>(
        &'b self,
        c: &'b Condition,
        s: &'b ChatState<'b>,
    ) -> BoxFuture<'b, Result<Option<(String, StopReason)>, ErrorInfo>> {
        Box::pin(async move {
            if let Some(held) = c.holds(s) {
                return Ok(held.map(|reason| (c.words.clone(), reason)));
            }
            Ok(match &c.test {
                Test::Llm(question) => {
                    let answer = self
                        .ask(
                            &format!("{}/termination", s.path),
                            "You judge a team's conversation. Answer yes or no.",
                            s.history,
                            &format!("Conversation:\n{}\n\n{question}", transcript(s.history)),
                        )
                        .await?;
                    answer
                        .trim_start()
                        .to_ascii_lowercase()
                        .starts_with("yes")
                        .then(|| (c.words.clone(), StopReason::Terminated))
                }
                Test::Any(list) => {
                    let mut first = None;
                    for inner in list {
                        if let Some(found) = self.fired(inner, s).await? {
                            first = Some(found);
                            break;
                        }
                    }
                    first
                }
                Test::All(list) => {
                    let mut last = None;
                    for inner in list {
                        match self.fired(inner, s).await? {
                            Some(found) => last = Some(found),
                            None => return Ok(None),
                        }
                    }
                    last.map(|(_, reason)| (c.words.clone(), reason))
                }
                _ => None,
            })
        })
    }
}

/// What the task's code last printed in a clean run: kept with the report, or read back
/// from a report of a resumed run.
pub(crate) fn printed_of(history: &[Said]) -> Option<String> {
    history
        .iter()
        .rev()
        .filter(|s| s.output)
        .find_map(|s| s.printed.clone().or_else(|| blocks::printed_in(&s.text)))
}

fn transcript(history: &[Said]) -> String {
    history
        .iter()
        .map(|s| format!("{}: {}", s.speaker, s.text))
        .collect::<Vec<_>>()
        .join("\n\n")
}

fn internal(path: &str, what: &str) -> ErrorInfo {
    ErrorInfo {
        code: ErrorCode::Internal,
        message: format!("{path}: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_attributes_interleaved_messages_by_turn() {
        let turn = |turn, agent: &str| EventMsg::TurnStarted {
            turn,
            agent: Some(agent.to_owned()),
        };
        let says = |turn, text: &str| EventMsg::AssistantMessage {
            turn,
            text: text.to_owned(),
            usage: None,
            tool_calls: Vec::new(),
        };
        // Two parallel members: b answers before a; then a turn cut off by a crash.
        let events = [
            turn(1, "team/p/a"),
            turn(2, "team/p/b"),
            says(2, "from b"),
            says(1, "from a"),
            turn(3, "team/c"),
        ];
        assert_eq!(
            replay_of(&events)
                .into_iter()
                .map(|(agent, said)| (agent, said.text))
                .collect::<Vec<_>>(),
            [
                ("team/p/b".to_owned(), "from b".to_owned()),
                ("team/p/a".to_owned(), "from a".to_owned())
            ]
        );
    }

    #[test]
    fn long_output_keeps_its_head_and_tail() {
        assert_eq!(crate::grounding::clip("short", 10), "short");
        let cut = crate::grounding::clip(&format!("{}{}", "a".repeat(50), "z".repeat(50)), 20);
        assert_eq!(
            cut,
            format!(
                "{}\n[... 80 bytes cut ...]\n{}",
                "a".repeat(10),
                "z".repeat(10)
            )
        );
        // Never inside a character.
        let cut = crate::grounding::clip(&"é".repeat(20), 9);
        assert!(cut.starts_with("éé\n[..."), "{cut}");
    }
}
