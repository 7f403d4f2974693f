//! The turn loop: assistant reply → run its code → report back, until done or a limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tandem_executor::{CancellationToken, Executor, Language, SessionSpec};
use tandem_protocol::{ErrorCode, ErrorInfo, EventMsg, Message, Role, StopReason, Usage};

use crate::blocks::{self, EventSink, RunOptions, SessionSlot};
use crate::chat::{ChatModel, ModelProgress};
use crate::extract::extract_code_blocks;
use crate::termination::{is_termination_block, says_terminate, strip_termination};

/// Everything a task needs besides the model and the executor.
#[derive(Clone, Debug)]
pub struct TaskSettings {
    /// The task text.
    pub task: String,
    /// System prompt for the assistant.
    pub system_prompt: String,
    /// The word that ends the task when the assistant says it.
    pub termination: String,
    /// Most assistant turns.
    pub max_turns: u32,
    /// Wall-clock limit for the whole task.
    pub timeout: Option<Duration>,
    /// The session's workspace and limits.
    pub session: SessionSpec,
    /// The only languages blocks may run in; `None` allows all the executor runs.
    pub languages: Option<Vec<Language>>,
    /// Turns already taken, when continuing an interrupted task: the assistant's replies and
    /// the executor's reports that followed the task, in order.
    pub history: Vec<Message>,
}

impl TaskSettings {
    /// Settings with the defaults for `task`.
    pub fn new(task: impl Into<String>) -> Self {
        Self {
            task: task.into(),
            system_prompt: crate::DEFAULT_SYSTEM_PROMPT.to_owned(),
            termination: crate::DEFAULT_TERMINATION.to_owned(),
            max_turns: 10,
            timeout: None,
            session: SessionSpec::default(),
            languages: None,
            history: Vec::new(),
        }
    }
}

/// How a task ended, with everything said.
#[derive(Clone, Debug)]
pub struct TaskOutcome {
    /// Why it ended.
    pub stop_reason: StopReason,
    /// Assistant turns taken.
    pub turns: u32,
    /// Tokens used.
    pub usage: Usage,
    /// Set when `stop_reason` is `Error`.
    pub error: Option<ErrorInfo>,
    /// The whole conversation, system prompt first.
    pub transcript: Vec<Message>,
    /// The final answer (last reply without the termination string), when terminated.
    pub summary: Option<String>,
    /// Wall time.
    pub elapsed: Duration,
}

/// Runs a task to its end. Every step is sent to `events`, the last being
/// [`EventMsg::TaskFinished`]; the sandbox is closed on every path.
pub async fn run_task(
    settings: TaskSettings,
    model: &ChatModel,
    executor: Arc<dyn Executor>,
    events: EventSink,
    cancel: CancellationToken,
) -> TaskOutcome {
    let started = Instant::now();
    events(EventMsg::TaskStarted {
        task: settings.task.clone(),
        model: model.config().model.clone(),
        base_url: model.config().base_url.clone(),
        executor: executor.name().to_owned(),
    });
    // One token for both ways a task is stopped from outside; the flag tells them apart.
    let stop = cancel.child_token();
    let timed_out = Arc::new(AtomicBool::new(false));
    let timer = settings.timeout.map(|limit| {
        let (stop, timed_out) = (stop.clone(), timed_out.clone());
        tokio::spawn(async move {
            tokio::time::sleep(limit).await;
            timed_out.store(true, Ordering::SeqCst);
            stop.cancel();
        })
    });
    let block_timeout = settings.session.limits.wall;
    let output_cap = settings.session.limits.output_bytes;
    let mut slot =
        SessionSlot::new(executor, settings.session.clone()).only(settings.languages.clone());
    let mut transcript = vec![
        Message::new(
            Role::System,
            system_prompt(&settings, slot.executor().languages()),
        ),
        Message::new(Role::User, settings.task.clone()),
    ];
    transcript.extend(settings.history.iter().cloned());
    let turns_done = settings
        .history
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .count();
    let mut state = LoopState {
        transcript,
        usage: Usage::default(),
        turns: u32::try_from(turns_done).unwrap_or(u32::MAX),
        summary: None,
    };
    let ended = turn_loop(
        &settings,
        model,
        &mut slot,
        &events,
        &stop,
        &mut state,
        block_timeout,
        output_cap,
    )
    .await;
    if let Some(timer) = timer {
        timer.abort();
    }
    let (mut stop_reason, mut error) = match ended {
        Ok(reason) => (reason, None),
        Err(info) => (StopReason::Error, Some(info)),
    };
    if stop.is_cancelled() && stop_reason != StopReason::Terminated {
        stop_reason = if timed_out.load(Ordering::SeqCst) {
            StopReason::Timeout
        } else {
            StopReason::Cancelled
        };
        error = None;
    }
    if let Err(e) = slot.close().await {
        tracing::warn!(error = %e, "closing the task's sandbox failed");
    }
    let elapsed = started.elapsed();
    events(EventMsg::TaskFinished {
        stop_reason,
        turns: state.turns,
        usage: state.usage,
        elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        error: error.clone(),
        summary: state.summary.clone(),
    });
    TaskOutcome {
        stop_reason,
        turns: state.turns,
        usage: state.usage,
        error,
        transcript: state.transcript,
        summary: state.summary,
        elapsed,
    }
}

struct LoopState {
    transcript: Vec<Message>,
    usage: Usage,
    turns: u32,
    summary: Option<String>,
}

#[allow(clippy::too_many_arguments)]
async fn turn_loop(
    settings: &TaskSettings,
    model: &ChatModel,
    slot: &mut SessionSlot,
    events: &EventSink,
    stop: &CancellationToken,
    state: &mut LoopState,
    block_timeout: Duration,
    output_cap: usize,
) -> Result<StopReason, ErrorInfo> {
    let word = settings.termination.as_str();
    while state.turns < settings.max_turns {
        state.turns += 1;
        let turn = state.turns;
        events(EventMsg::TurnStarted { turn });
        let mut progress = progress(events, turn);
        let reply = tokio::select! {
            reply = model.complete(&state.transcript, &mut progress) => reply.map_err(ErrorInfo::from)?,
            () = stop.cancelled() => return Ok(StopReason::Cancelled),
        };
        if let Some(u) = reply.usage {
            state.usage.add(u);
        }
        events(EventMsg::AssistantMessage {
            turn,
            text: reply.text.clone(),
            usage: reply.usage,
        });
        state
            .transcript
            .push(Message::new(Role::Assistant, reply.text.clone()));

        let mut code_blocks = extract_code_blocks(&reply.text);
        let before = code_blocks.len();
        code_blocks.retain(|b| !is_termination_block(&b.code, word));
        let terminate = says_terminate(&reply.text, word) || code_blocks.len() < before;

        let report = if code_blocks.is_empty() {
            if terminate {
                state.summary = Some(strip_termination(&reply.text, word));
                return Ok(StopReason::Terminated);
            }
            blocks::no_code_nudge(word, slot.languages())
        } else {
            let opts = RunOptions {
                turn,
                timeout: None,
                cancel: stop.clone(),
                events: events.clone(),
            };
            let runs = blocks::run_blocks(slot, &code_blocks, &opts)
                .await
                .map_err(|e| ErrorInfo {
                    code: ErrorCode::Executor,
                    message: format!("the {} executor failed: {e}", slot.executor().name()),
                })?;
            if stop.is_cancelled() {
                return Ok(StopReason::Cancelled);
            }
            blocks::report(&runs, block_timeout, output_cap, word, slot.languages())
        };
        // Code in a terminating reply still runs and is recorded; then the task ends.
        if terminate {
            events(EventMsg::ExecutorMessage {
                turn,
                text: report.clone(),
            });
            state.transcript.push(Message::new(Role::User, report));
            state.summary = Some(strip_termination(&reply.text, word));
            return Ok(StopReason::Terminated);
        }
        events(EventMsg::ExecutorMessage {
            turn,
            text: report.clone(),
        });
        state.transcript.push(Message::new(Role::User, report));
    }
    Ok(StopReason::MaxTurns)
}

/// Turns a model call's progress (streamed text, retries) into turn `turn`'s events.
pub(crate) fn progress(events: &EventSink, turn: u32) -> impl FnMut(ModelProgress<'_>) + Send + '_ {
    move |p| match p {
        ModelProgress::Delta(text) => events(EventMsg::AssistantDelta {
            turn,
            text: text.to_owned(),
        }),
        ModelProgress::Retry {
            attempt,
            delay,
            reason,
        } => events(EventMsg::ModelRetry {
            turn,
            attempt,
            delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            reason: reason.to_owned(),
        }),
    }
}

/// The system prompt the model gets: `{languages}` names exactly the languages that run
/// (the task's list, else every language the executor runs), python first when it runs; a
/// task that allows only some also gets a line that says so.
pub fn render_system_prompt(
    template: &str,
    executor: &[Language],
    allowed: Option<&[Language]>,
) -> String {
    let runs: Vec<&Language> = allowed
        .unwrap_or(executor)
        .iter()
        .filter(|l| !l.is_data())
        .collect();
    let python = Language::python();
    let fence = |l: &Language| format!("```{l}");
    let others: Vec<String> = runs
        .iter()
        .filter(|l| ***l != python)
        .map(|l| fence(l))
        .collect();
    let fences = match (runs.contains(&&python), others.as_slice()) {
        (true, []) => fence(&python),
        (true, others) => format!(
            "{} blocks (preferred) or {}",
            fence(&python),
            others.join(" or ")
        ),
        (false, others) => others.join(" or "),
    };
    let prompt = template.replace("{languages}", &fences);
    match allowed {
        None => prompt,
        Some(languages) => format!(
            "{}\n- Only code in these languages is run: {}. Blocks in other languages are not run.",
            prompt.trim_end(),
            tandem_executor::join_languages(languages)
        ),
    }
}

fn system_prompt(settings: &TaskSettings, executor: &[Language]) -> String {
    render_system_prompt(
        &settings.system_prompt,
        executor,
        settings.languages.as_deref(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_names_exactly_the_languages_that_run() {
        let template = "code in {languages} blocks.";
        let (py, sh, js) = (Language::python(), Language::sh(), Language::javascript());
        let render = |executor: &[Language], allowed: Option<&[Language]>| {
            render_system_prompt(template, executor, allowed)
        };
        assert_eq!(
            render(&[py.clone(), sh.clone()], None),
            "code in ```python blocks (preferred) or ```sh blocks."
        );
        assert_eq!(
            render(&[py.clone(), js.clone()], None),
            "code in ```python blocks (preferred) or ```javascript blocks."
        );
        assert_eq!(
            render(std::slice::from_ref(&sh), None),
            "code in ```sh blocks."
        );
        assert_eq!(
            render(&[py.clone(), sh.clone(), js], Some(&[py])),
            "code in ```python blocks.\n- Only code in these languages is run: python. Blocks in other languages are not run."
        );
        // A prompt without the placeholder is the operator's own words.
        assert_eq!(render_system_prompt("Be brief.", &[sh], None), "Be brief.");
    }
}
