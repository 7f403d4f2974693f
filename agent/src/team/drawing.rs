//! A reply judged against the task's examples before it is told: run them against its
//! code, and the first time they do not all hold, draw more replies at once and keep the one
//! whose code holds the most; what the examples said, told to the model.
use std::sync::Arc;

use tandem_protocol::{ErrorInfo, EventMsg, Message, Usage};

use super::agent::{Agent, AgentReply, Sample, Turn};
use super::run::{CANDIDATE_TEMPERATURE, Ctx};
use crate::blocks::{self, ForkPoint, SessionSlot};
use crate::chat::ToolOffer;
use crate::events::EventSink;
use crate::examples::Examples;
use crate::extract::CodeBlock;
use crate::team::Node;

/// Where this turn's replies are judged: on forks from one copy of the workspace as it was
/// before the turn, made when the first code is judged; in the task's own sandbox where its
/// executor's sessions have no workspace to copy.
#[derive(Default)]
pub(super) struct Judging(Option<Option<ForkPoint>>);

impl Ctx<'_> {
    /// The executor whose examples run against `node`'s reply before it is told, and how
    /// many replies a reply they do not hold draws: while the task has not drawn, when code
    /// comes as fenced blocks.
    pub(super) fn drawing(&self, node: &Node, offer: Option<&ToolOffer>) -> Option<(&str, u32)> {
        let (executor, k) = self.team.members.get(&node.path)?.candidates.as_ref()?;
        (offer.is_none()
            && self
                .team
                .members
                .get(executor)
                .is_some_and(|m| m.examples.is_some() && m.slot.is_some())
            && self.shared.drawing.may_draw())
        .then_some((executor.as_str(), *k))
    }

    /// The agent's reply, streamed as always, with the task's examples run against its code
    /// before it is told. The first time they do not all hold, `k - 1` more replies to the
    /// same view are drawn at once and quietly, sampled; the first whose code holds every
    /// example, else the one that holds the most (the agent's own on a tie), is told as the
    /// turn's reply, with the tokens of all of them.
    pub(super) async fn checked(
        &self,
        path: &str,
        agent: &dyn Agent,
        messages: &[Message],
        turn: u32,
        executor: &str,
        k: u32,
    ) -> Result<Option<AgentReply>, ErrorInfo> {
        let left = self.shared.spending.output_left(&self.team.spend);
        let own = Turn {
            number: turn,
            events: &self.events,
            cancel: &self.cancel,
            tools: None,
            max_tokens: left.map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
            sample: None,
        };
        let Some(reply) = agent.reply(messages, own).await? else {
            return Ok(None);
        };
        let Some(session) = self.team.slot(executor) else {
            self.told(path, turn, &reply);
            return Ok(Some(reply));
        };
        let mut slot = session.lock().await;
        // Every reply's code is judged on a fork of the workspace as it is before the turn,
        // so none can spoil the task's sandbox or another's run; the reply told then runs
        // in the task's own sandbox, which no judged code touched.
        let mut point = Judging::default();
        let verdict = self
            .verdict(executor, &mut slot, &reply.text, &mut point)
            .await;
        let held = verdict
            .as_ref()
            .and_then(|(_, v)| Examples::held(v))
            .filter(|(held, total)| held < total);
        // Only code the examples ran against and did not all hold draws: a reply they could
        // not test is no worse for it.
        let Some((own_held, total)) = held.filter(|_| self.shared.drawing.take()) else {
            drop(slot);
            self.keep_verdict(verdict);
            self.told(path, turn, &reply);
            return Ok(Some(reply));
        };
        // The session is not held while the model writes.
        drop(slot);
        let spent_own = reply.usage.map_or(0, |u| u.completion_tokens);
        let replies = self
            .draw(
                agent,
                messages,
                turn,
                k,
                left.map(|n| n.saturating_sub(spent_own)),
            )
            .await;
        if self.cancel.is_cancelled() {
            return Ok(None);
        }
        let own = (reply, verdict, own_held);
        let Some((reply, verdict, held, chosen)) = self
            .choose(path, executor, session, own, total, replies, &mut point)
            .await
        else {
            return Ok(None);
        };
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        (self.events)(EventMsg::RepliesDrawn {
            turn,
            drawn: k - 1,
            chosen,
            held: count(held),
            examples: count(total),
        });
        self.keep_verdict(verdict);
        self.told(path, turn, &reply);
        Ok(Some(reply))
    }

    /// `k - 1` replies to `messages` drawn at once and quietly, sampled, sharing the `left`
    /// output tokens.
    async fn draw(
        &self,
        agent: &dyn Agent,
        messages: &[Message],
        turn: u32,
        k: u32,
        left: Option<u64>,
    ) -> Vec<Result<Option<AgentReply>, ErrorInfo>> {
        let quiet: EventSink = Arc::new(|_| {});
        let max_tokens = left.map(|n| u32::try_from(n / u64::from(k - 1)).unwrap_or(u32::MAX));
        let asks = (1..k).map(|i| {
            let asked = Turn {
                number: turn,
                events: &quiet,
                cancel: &self.cancel,
                tools: None,
                max_tokens,
                sample: Some(Sample {
                    temperature: CANDIDATE_TEMPERATURE,
                    seed: turn.wrapping_mul(1000).wrapping_add(i),
                }),
            };
            agent.reply(messages, asked)
        });
        futures::future::join_all(asks).await
    }

    /// Of the agent's own reply (`own`: with its verdict and how many of the `total`
    /// examples held) and the drawn `replies`, the one whose code holds the most (the
    /// earlier on a tie), carrying the tokens of all; with its verdict, the examples it held
    /// and its place (0 for the agent's own). `None` when the run was cancelled meanwhile.
    #[allow(clippy::too_many_arguments)]
    async fn choose(
        &self,
        path: &str,
        executor: &str,
        session: &tokio::sync::Mutex<SessionSlot>,
        own: (AgentReply, Option<(String, String)>, usize),
        total: usize,
        replies: Vec<Result<Option<AgentReply>, ErrorInfo>>,
        point: &mut Judging,
    ) -> Option<(AgentReply, Option<(String, String)>, usize, u32)> {
        let mut slot = session.lock().await;
        let mut usage = own.0.usage;
        let mut best = own;
        let mut chosen = 0;
        for (i, candidate) in (1..).zip(replies) {
            let candidate = match candidate {
                Ok(Some(candidate)) => candidate,
                Ok(None) => return None,
                Err(e) => {
                    tracing::info!(agent = %path, error = %e.message, "a reply drawn beside the agent's own failed");
                    continue;
                }
            };
            if let Some(u) = candidate.usage {
                usage.get_or_insert_with(Usage::default).add(u);
            }
            // Once one holds every example the rest are not run: its tokens are spent, its
            // sandbox time need not be.
            if best.2 == total {
                continue;
            }
            let verdict = self
                .verdict(executor, &mut slot, &candidate.text, point)
                .await;
            let count = verdict
                .as_ref()
                .and_then(|(_, v)| Examples::held(v))
                .map_or(0, |h| h.0);
            if count > best.2 {
                best = (candidate, verdict, count);
                chosen = i;
            }
        }
        let (mut reply, verdict, held) = best;
        reply.usage = usage;
        Some((reply, verdict, held, chosen))
    }

    /// What the examples printed against the code of the reply about to be told, kept for
    /// its executor when every example held. A verdict that failed is not: it was taken
    /// before the reply's other blocks ran, and a file one of them writes may make it hold.
    pub(super) fn keep_verdict(&self, verdict: Option<(String, String)>) {
        let held = verdict.filter(|(_, v)| Examples::held(v).is_some_and(|(h, t)| h == t));
        self.shared.drawing.keep(held);
    }

    /// The block of `text` that `executor`'s examples test, and what they print when run
    /// against it (on a fork from `point`'s, made on first need, where there can be one);
    /// `None` when none could be run against it.
    pub(super) async fn verdict(
        &self,
        executor: &str,
        slot: &mut SessionSlot,
        text: &str,
        point: &mut Judging,
    ) -> Option<(String, String)> {
        let examples = self.team.members.get(executor)?.examples.as_ref()?;
        let tested = self
            .runnable(text)
            .into_iter()
            .rev()
            .filter(|b| b.language.as_deref().is_none_or(|l| l == "python"))
            .find(|b| examples.tested_by(&b.code))?;
        if point.0.is_none() {
            point.0 = Some(match slot.fork_point(&self.cancel).await {
                Ok(made) => made,
                Err(e) => {
                    tracing::info!(error = %e, "no fork to judge replies on; they are judged in the task's sandbox");
                    None
                }
            });
        }
        let at = point.0.as_ref().and_then(Option::as_ref);
        let verdict = self.run_examples(examples, slot, &tested.code, at).await?;
        Some((tested.code, verdict))
    }

    /// What the examples' program prints when run quietly against `code` in `slot` (or on a
    /// fork of it from `point`); `None` when it did not run to its end, or the approval
    /// policies would not let it run unasked (it runs the model's code again, with no one
    /// asked).
    pub(super) async fn run_examples(
        &self,
        examples: &crate::examples::Examples,
        slot: &mut SessionSlot,
        code: &str,
        point: Option<&ForkPoint>,
    ) -> Option<String> {
        let program = examples.program(code);
        let python = tandem_executor::Language::python();
        if let Some(gate) = &self.team.blocks.approval
            && gate.verdict(&python, slot.executor().as_ref(), &program)
                != crate::approval::Verdict::Run
        {
            return None;
        }
        let ran = match point {
            Some(point) => {
                slot.run_on_fork(point, &python, &program, &self.cancel)
                    .await
            }
            None => slot.run_quiet(&python, &program, &self.cancel).await,
        };
        match ran {
            Ok(Some(out)) if out.status == tandem_executor::ExitStatus::Exited(0) => {
                Some(out.stdout.to_text())
            }
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(error = %e, "the task's examples did not run");
                None
            }
        }
    }

    /// What the task's examples say of the last Python block of `runs` that defines what
    /// they call, when every block ran cleanly; `None` when there is nothing to run them
    /// against or they could not be run (a sandbox failure here is the next block's to tell).
    pub(super) async fn examples_note(
        &self,
        node: &Node,
        slot: &mut SessionSlot,
        code: &[CodeBlock],
        runs: &[blocks::BlockRun],
    ) -> Option<String> {
        let examples = self.team.members.get(&node.path)?.examples.as_ref()?;
        if runs.is_empty() || !runs.iter().all(|r| r.result.succeeded()) {
            return None;
        }
        let python = tandem_executor::Language::python();
        let tested = runs
            .iter()
            .rev()
            .filter(|r| {
                r.language == python && r.result.status == tandem_protocol::BlockStatus::Exited
            })
            .filter_map(|r| code.get(usize::try_from(r.index).ok()?.checked_sub(1)?))
            .find(|b| examples.tested_by(&b.code))?;
        let kept = self.shared.drawing.kept_for(&tested.code);
        // The examples load the code alone in a fresh interpreter: where they all held before
        // the blocks ran, they hold now.
        let verdict = match kept {
            Some(verdict) => verdict,
            None => {
                self.run_examples(examples, slot, &tested.code, None)
                    .await?
            }
        };
        Examples::note(&verdict)
    }
}
