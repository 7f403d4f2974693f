//! Running a checked team: agents take turns on one shared history, each seeing its own
//! messages as `assistant` and everyone else's as `user` messages with the speaker's name.
//!
//! Escalation is a value a run returns ([`Ended::Escalated`]), caught by the nearest
//! enclosing loop, which ends and reports a normal end to its own parent: an escalation never
//! ends more than the innermost loop.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::future::BoxFuture;
use tandem_executor::CancellationToken;
use tandem_protocol::team::{Aggregate, Kind, SelectionKind};
use tandem_protocol::{
    ErrorCode, ErrorInfo, EventMsg, Message, Role, StopReason, ToolCall, ToolReply, Usage,
};
use tracing::Instrument;

use super::agent::{Agent, AgentReply, Turn};
use super::history::{Replay, Said, transcript};
use super::members::Team;
use super::spend::Spending;
use super::state::{Answer, Drawing};
use super::termination::ChatState;
use crate::blocks::{self, RunOptions, SessionSlot};
use crate::chat::ToolOffer;
use crate::events::EventSink;
use crate::extract::CodeBlock;
use crate::team::Node;
use crate::termination::mentions;

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

impl Team {
    /// Runs the team on `task`; returns how it ended, the history, the tokens used and the
    /// turns taken. `replay` is what a run that was interrupted already said, by agent path
    /// ([`replay_of`](super::replay_of)): those turns are not asked again but their words taken, which brings
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
            drawing: Drawing::default(),
            answer: Answer::default(),
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
            result: shared.answer.take(),
        }
    }
}

/// What every part of one run shares, parallel branches included.
pub(super) struct Shared {
    pub(super) turns: AtomicU32,
    /// What the run's model calls spent, and the budget that stopped it.
    pub(super) spending: Spending,
    pub(super) replay: Mutex<std::collections::VecDeque<(String, Said)>>,
    /// Judging replies against the examples.
    pub(super) drawing: Drawing,
    /// The final answer.
    pub(super) answer: Answer,
}

/// A run, as one branch of it sees it: a parallel branch has its own event sink.
pub(super) struct Ctx<'a> {
    pub(super) team: &'a Team,
    pub(super) shared: &'a Shared,
    pub(super) events: EventSink,
    pub(super) cancel: CancellationToken,
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
    pub(super) fn replayed(&self, path: &str) -> Option<Said> {
        let mut replay = self.shared.replay.lock().ok()?;
        let at = replay.iter().position(|(agent, _)| agent == path)?;
        replay.remove(at).map(|(_, said)| said)
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
        let offer = self.team.tools(&node.name).and_then(|t| t.offer());
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
    pub(super) async fn call(
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
        let (caller, text) = (last.speaker.clone(), last.text.clone());
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
        let mut code_message = vec![Message::new(Role::User, text)];
        if let Err(reason) = self.hooked(node, &mut code_message) {
            let results = if native {
                not_run(&calls, &reason)
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
        let work = Work {
            turn,
            caller,
            code,
            calls,
            native,
            no_code,
            span,
        };
        self.run_work(node, history, slot, work).await
    }

    /// Runs `work` in the executor's session, then tells what ran.
    async fn run_work(
        &self,
        node: &Node,
        history: &mut Vec<Said>,
        slot: &tokio::sync::Mutex<SessionSlot>,
        work: Work,
    ) -> Result<Ended, ErrorInfo> {
        let span = work.span.clone();
        let mut slot = slot.lock().await;
        let tools = self.team.tools(&work.caller).cloned();
        let opts = RunOptions {
            turn: work.turn,
            timeout: None,
            cancel: self.cancel.clone(),
            events: self.events.clone(),
            approval: self.team.blocks.approval.clone(),
            code_tools: crate::tools::dispatch::code_tools(tools.clone()),
        };
        let broke = |e: tandem_executor::ExecError, slot: &SessionSlot| ErrorInfo {
            code: ErrorCode::Executor,
            message: format!(
                "{}: the {} executor failed: {e}",
                node.path,
                slot.executor().name()
            ),
        };
        let runs = match blocks::run_blocks(&mut slot, &work.code, &opts)
            .instrument(span.clone())
            .await
        {
            Ok(runs) => runs,
            Err(e) => return Err(broke(e, &slot)),
        };
        let tools = tools.unwrap_or_default();
        let first = u32::try_from(work.code.len() + 1).unwrap_or(u32::MAX);
        let answered =
            match crate::tools::dispatch::run_calls(&mut slot, &tools, &work.calls, first, &opts)
                .instrument(span)
                .await
            {
                Ok(answered) => answered,
                Err(e) => return Err(broke(e, &slot)),
            };
        if self.cancel.is_cancelled() {
            return Ok(Ended::Stopped(StopReason::Cancelled));
        }
        let mut report = if work.code.is_empty() {
            String::new()
        } else {
            let rules = &self.team.blocks;
            let skipped = work.code.len().saturating_sub(runs.len());
            blocks::report(
                &runs,
                skipped,
                rules.timeout,
                rules.output_cap,
                &work.no_code,
            )
        };
        if self.team.blocks.packages
            && let Some(module) = blocks::missing_module(&runs)
        {
            report = blocks::with_examples(
                report,
                &format!(
                    "`{module}` is not installed, and can be: run `pip install {module}` (from Python, `subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"{module}\"])`) in a block of its own, then import it."
                ),
            );
        }
        if let Some(note) = self.examples_note(node, &mut slot, &work.code, &runs).await {
            report = blocks::with_examples(report, &note);
        }
        let results: Vec<ToolReply> = answered.into_iter().map(|a| a.reply).collect();
        Ok(self.tell_runs(node, history, &work, report, &runs, results))
    }

    /// A turn's runs told as the executor's reply: the blocks' report, after a clean run
    /// that printed something the pair's ask for the answer, and the calls' answers (as
    /// native replies, or as text when the calls were written as text).
    fn tell_runs(
        &self,
        node: &Node,
        history: &mut Vec<Said>,
        work: &Work,
        mut report: String,
        runs: &[blocks::BlockRun],
        results: Vec<ToolReply>,
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
            && work.calls.is_empty()
            && !report.contains(crate::examples::FAILED_MARK)
        {
            if !report.ends_with('\n') {
                report.push('\n');
            }
            report.push_str(&self.answer_ask());
        }
        let mut native_results = Vec::new();
        if work.native {
            native_results = results;
        } else {
            // Calls written as text are answered as text: there is no call id to answer.
            for r in results {
                if !report.is_empty() {
                    report.push_str("\n\n");
                }
                report.push_str(&format!("Result of tool `{}`:\n{}", r.name, r.content));
            }
        }
        let ended = self.reported(node, history, work.turn, report, native_results);
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
        let members = &node.members;
        let started = Instant::now();
        let tokens_before = self.tokens();
        let order = Order::of(node);
        let mut next = order.initial;
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
            let mut step = self.schema_answer(node, &new, &order.executors, history);
            if let SchemaStep::On = step
                && let Some(condition) = self.team.condition(&node.path)
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
                    step = self
                        .finishing(node, &order, history, &new, by, reason)
                        .await?;
                }
            }
            match step {
                SchemaStep::End(ended) => return Ok(ended),
                SchemaStep::Again(speaker) => {
                    messages += 1;
                    next = speaker;
                    continue;
                }
                SchemaStep::On => {}
            }
            if silent >= members.len() {
                let by = "no member had anything to say".to_owned();
                self.ended(node, by.clone());
                return Ok(Ended::Finished {
                    by,
                    reason: StopReason::Terminated,
                });
            }
            next = match order.executors.first() {
                Some(&executor) if order.after_code && self.has_code(&new) => executor,
                _ if matches!(order.kind, SelectionKind::Llm) => {
                    self.select(node, history, order.initial).await?
                }
                _ => (next + 1) % members.len(),
            };
        }
    }

    /// A chat whose termination fired `by`: code in the message that ended it still runs,
    /// and its output is recorded; then the answer is asked for if it must be; then it ends.
    async fn finishing(
        &self,
        node: &Node,
        order: &Order,
        history: &mut Vec<Said>,
        new: &[Said],
        by: String,
        reason: StopReason,
    ) -> Result<SchemaStep, ErrorInfo> {
        if let (true, Some(&executor)) = (
            order.after_code && self.has_code(new),
            order.executors.first(),
        ) && let Ended::Stopped(r) = self.run(&node.members[executor], history, false).await?
        {
            return Ok(SchemaStep::End(Ended::Stopped(r)));
        }
        if let Some(speaker) = self.before_answer_ends(node, &order.executors, history, reason) {
            return Ok(SchemaStep::Again(speaker));
        }
        self.ended(node, by.clone());
        Ok(SchemaStep::End(Ended::Finished { by, reason }))
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

    pub(super) fn over_budget(&self) -> Option<StopReason> {
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
}

/// Who speaks in a chat: first, next, and after code.
struct Order {
    /// Its executors' places among its members.
    executors: Vec<usize>,
    /// An executor speaks after each message with code.
    after_code: bool,
    /// The first speaker's place.
    initial: usize,
    kind: SelectionKind,
}

impl Order {
    fn of(node: &Node) -> Self {
        let spec = &node.spec;
        let selection = spec.selection.as_ref();
        let executors: Vec<usize> = node
            .members
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
            .and_then(|i| node.members.iter().position(|m| &m.name == i))
            .unwrap_or(0);
        Self {
            executors,
            after_code,
            initial,
            kind: selection.map_or(SelectionKind::RoundRobin, |s| s.kind()),
        }
    }
}

/// What an executor's turn runs: the code and the calls of one message, and whose they are.
struct Work {
    turn: u32,
    /// The name of the agent whose message it is (its tools answer the calls).
    caller: String,
    code: Vec<CodeBlock>,
    calls: Vec<ToolCall>,
    /// The calls are native, and are answered as tool replies.
    native: bool,
    /// What the executor says when nothing ran.
    no_code: String,
    /// The turn's span, which its runs are in.
    span: tracing::Span,
}

/// The answer to each of `calls` when a hook refused the turn.
fn not_run(calls: &[ToolCall], why: &str) -> Vec<ToolReply> {
    calls
        .iter()
        .map(|c| ToolReply {
            id: c.id.clone(),
            name: c.name.clone(),
            content: format!("error: not run: {why}"),
        })
        .collect()
}

fn internal(path: &str, what: &str) -> ErrorInfo {
    ErrorInfo {
        code: ErrorCode::Internal,
        message: format!("{path}: {what}"),
    }
}
