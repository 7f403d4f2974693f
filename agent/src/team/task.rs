//! A team as a whole task: the task's start and end events, its timeout and cancellation,
//! its final answer, and its sandboxes closed at the end.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tandem_executor::CancellationToken;
use tandem_protocol::{AnswerFrom, ErrorInfo, EventMsg, StopReason, Usage};

use super::history::Said;
use super::members::Team;
use super::run::{Ended, Run};
use crate::events::EventSink;

/// What a team task's start says of it.
#[derive(Clone, Debug)]
pub struct TaskLabel {
    /// The task's model (every assistant's default).
    pub model: String,
    /// Its model server.
    pub base_url: String,
    /// What runs it, as the transcript's header shows (`team review.toml`).
    pub executor: String,
}

/// Runs `team` as a whole task: a `task_started` event, the team's events, a
/// `task_finished` event with the stop reason (a team that finished its work is
/// `terminated`) and its last message as the summary, the timeout and cancellation honoured,
/// and every executor session closed at the end.
pub async fn run_team_task(
    team: Team,
    task: &str,
    label: TaskLabel,
    events: EventSink,
    cancel: CancellationToken,
    timeout: Option<Duration>,
    replay: super::history::Replay,
) -> StopReason {
    let ran = run_team(
        Ok(team),
        task,
        label,
        events,
        cancel,
        timeout,
        replay,
        None,
        |_, history| {
            history
                .iter()
                .skip(1)
                .rev()
                .find(|s| !s.output)
                .map(|s| s.text.clone())
        },
    )
    .await;
    ran.stop_reason
}

/// How a whole task run by a team ended.
pub(crate) struct TeamRun {
    pub stop_reason: StopReason,
    pub error: Option<ErrorInfo>,
    /// The shared history, the task first.
    pub history: Vec<Said>,
    pub usage: Usage,
    pub turns: u32,
    pub summary: Option<String>,
    pub check: Option<tandem_protocol::CheckOutcome>,
    pub cost: Option<f64>,
    pub budget: Option<tandem_protocol::BudgetReached>,
    pub result: Option<serde_json::Value>,
    pub answer: Option<String>,
    pub answer_from: Option<AnswerFrom>,
    pub no_answer: Option<String>,
    pub elapsed: Duration,
}

/// [`run_team_task`] with the final answer chosen by `summary` from the stop reason and the
/// history; a team that could not be made ends the task with its error.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_team(
    team: Result<Team, ErrorInfo>,
    task: &str,
    label: TaskLabel,
    events: EventSink,
    cancel: CancellationToken,
    timeout: Option<Duration>,
    replay: super::history::Replay,
    check: Option<(String, tandem_protocol::Check)>,
    summary: impl FnOnce(StopReason, &[Said]) -> Option<String>,
) -> TeamRun {
    let started = Instant::now();
    // The caller's task span, when it made one: its context is kept with the task, so that a
    // later run of it (resumed, on this daemon or another) joins the same trace.
    let span = tracing::Span::current();
    events(EventMsg::TaskStarted {
        task: task.to_owned(),
        model: label.model,
        base_url: label.base_url,
        executor: label.executor,
        trace: crate::trace::traceparent(&span),
    });
    // One token for both ways a task is stopped from outside; the flag tells them apart.
    let stop = cancel.child_token();
    let timed_out = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let timer = timeout.map(|limit| {
        let (stop, timed_out) = (stop.clone(), timed_out.clone());
        tokio::spawn(async move {
            tokio::time::sleep(limit).await;
            timed_out.store(true, Ordering::SeqCst);
            stop.cancel();
        })
    });
    let (ran, checked) = match team {
        Ok(team) => {
            let ran = team.run(task, events.clone(), stop, replay).await;
            if let Some(timer) = &timer {
                timer.abort();
            }
            let (stop_reason, _) = stop_of(&ran.ended, &timed_out);
            let grounded = answer_of(stop_reason, &ran.history, team.words());
            let answer = summary(stop_reason, &ran.history);
            // A task stopped from outside is not judged; one that ran out of turns or time is.
            let checked = match &check {
                Some((path, check)) if stop_reason != StopReason::Cancelled => {
                    let outputs: Vec<&str> = ran
                        .history
                        .iter()
                        .filter(|s| s.output)
                        .map(|s| s.text.as_str())
                        .collect();
                    team.check(path, check, grounded.text(), &outputs, &cancel)
                        .await
                }
                _ => None,
            };
            team.close().await;
            (ran, (answer, checked, grounded))
        }
        Err(e) => (
            Run {
                ended: Err(e),
                history: Vec::new(),
                usage: Usage::default(),
                turns: 0,
                cost: None,
                budget: None,
                result: None,
            },
            (
                None,
                None,
                Answer::None("the task could not start".to_owned()),
            ),
        ),
    };
    if let Some(timer) = timer {
        timer.abort();
    }
    let Run {
        ended,
        history,
        usage,
        turns,
        cost,
        budget,
        result,
    } = ran;
    let (stop_reason, error) = stop_of(&ended, &timed_out);
    let (summary, check, answer) = checked;
    let (answer_text, answer_from, no_answer) = answer.into_parts();
    let elapsed = started.elapsed();
    if !span.is_disabled() {
        trace_task(&span, stop_reason, error.as_ref(), usage, turns, cost);
    }
    events(EventMsg::TaskFinished {
        stop_reason,
        turns,
        usage,
        elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        error: error.clone(),
        summary: summary.clone(),
        check: check.clone().map(Box::new),
        cost,
        budget: budget.clone().map(Box::new),
        result: result.clone().map(Box::new),
        answer: answer_text.clone(),
        answer_from,
        no_answer: no_answer.clone(),
    });
    TeamRun {
        stop_reason,
        error,
        history,
        usage,
        turns,
        summary,
        check,
        cost,
        budget,
        result,
        answer: answer_text,
        answer_from,
        no_answer,
        elapsed,
    }
}

/// A task's answer at its end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The model's final statement, which its code's output does not contradict.
    Model(String),
    /// What its code last printed in a clean run.
    Output(String),
    /// Neither: why.
    None(String),
}

impl Answer {
    /// The answer's text, when it has one.
    pub fn text(&self) -> Option<&str> {
        match self {
            Self::Model(t) | Self::Output(t) => Some(t),
            Self::None(_) => None,
        }
    }

    /// The answer, where it came from, and why there is none, as the wire has them.
    pub fn into_parts(self) -> (Option<String>, Option<AnswerFrom>, Option<String>) {
        match self {
            Self::Model(t) => (Some(t), Some(AnswerFrom::Model), None),
            Self::Output(t) => (Some(t), Some(AnswerFrom::Output), None),
            Self::None(why) => (None, None, Some(why)),
        }
    }
}

/// The answer of a task that stopped for `reason` with `history`: the model's final
/// statement when it ended the task with one its code's last clean output does not
/// contradict; else that output; else the last statement it made; else, when it ended the
/// task with code that printed nothing, that code; else none, and why.
pub(crate) fn answer_of(reason: StopReason, history: &[Said], words: &[String]) -> Answer {
    use crate::grounding::{ANSWER_CAP, clip, disagreement, statement};
    let last = history.iter().skip(1).rev().find(|s| !s.output);
    // The model's last reply as it wrote it, code and all.
    let reply = last
        .map(|said| {
            words.iter().fold(said.text.clone(), |text, word| {
                crate::termination::strip_termination(&text, word)
            })
        })
        .map(|text| text.trim().to_owned())
        .filter(|text| !text.is_empty());
    // Code that held every example the task states is the answer.
    if reason == StopReason::ExamplesHeld
        && let Some(code) = &reply
    {
        return Answer::Model(clip(code, ANSWER_CAP));
    }
    let said = last
        .map(|s| statement(&s.text, words))
        .filter(|s| !s.is_empty());
    let ended = matches!(reason, StopReason::Terminated | StopReason::Answered);
    let printed = super::history::printed_of(history).map(|p| p.trim().to_owned());
    match (said, printed) {
        (Some(said), Some(printed)) if ended && disagreement(&printed, &said).is_none() => {
            Answer::Model(clip(&said, ANSWER_CAP))
        }
        (_, Some(printed)) => Answer::Output(clip(&printed, ANSWER_CAP)),
        (Some(said), None) => Answer::Model(clip(&said, ANSWER_CAP)),
        // Code that printed nothing, sent as the end: the code is what the model answered.
        (None, None) => match reply {
            Some(code) if ended => Answer::Model(clip(&code, ANSWER_CAP)),
            _ => Answer::None(if ended {
                "the model ended the task without stating an answer, and no code of it printed anything in a clean run".to_owned()
            } else {
                format!(
                    "the task stopped ({}) before any code of it printed anything in a clean run, and the model stated no answer",
                    reason.as_str()
                )
            }),
        },
    }
}

/// How the task ended, on its span.
fn trace_task(
    span: &tracing::Span,
    stop_reason: StopReason,
    error: Option<&ErrorInfo>,
    usage: Usage,
    turns: u32,
    cost: Option<f64>,
) {
    use crate::trace::set;
    let tokens = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    set(
        span,
        "gen_ai.usage.input_tokens",
        tokens(usage.prompt_tokens),
    );
    set(
        span,
        "gen_ai.usage.output_tokens",
        tokens(usage.completion_tokens),
    );
    set(span, "tandem.stop_reason", stop_reason.as_str());
    set(span, "tandem.turns", i64::from(turns));
    if let Some(cost) = cost {
        set(span, "tandem.cost", cost);
    }
    if let Some(e) = error {
        crate::trace::fail(span, e.code.as_str(), &e.message);
    }
}

/// Why a run ended, and its error: a team that finished its work is `terminated`, and a stop
/// from outside after the timer fired is a timeout.
fn stop_of(
    ended: &Result<Ended, ErrorInfo>,
    timed_out: &std::sync::atomic::AtomicBool,
) -> (StopReason, Option<ErrorInfo>) {
    match ended {
        Ok(Ended::Done | Ended::Escalated) => (StopReason::Terminated, None),
        Ok(Ended::Finished { reason, .. }) => (*reason, None),
        Ok(Ended::Stopped(StopReason::Cancelled)) if timed_out.load(Ordering::SeqCst) => {
            (StopReason::Timeout, None)
        }
        Ok(Ended::Stopped(reason)) => (*reason, None),
        Err(info) => (StopReason::Error, Some(info.clone())),
    }
}
