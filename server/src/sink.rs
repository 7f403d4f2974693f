//! Where a task's events go on their way to the store, and the rules they meet there: an
//! artifact gets the href the API serves it at; a block's start and end are told to what the
//! daemon holds of the task (a task lost to another daemon stops when its block ends); model
//! calls and blocks are counted for `/metrics`; and a task cancelled by a shutdown is
//! interrupted (it can resume) rather than finished.

use std::sync::Mutex;
use std::time::Instant;

use tandem_protocol::{EventMsg, StopReason};

use crate::files::file_href;
use crate::metrics::Metrics;
use crate::running::RunningTasks;

/// What becomes of an event.
#[derive(Debug, PartialEq)]
pub(crate) enum Then {
    /// Stored as it now is.
    Record(EventMsg),
    /// Not stored: the task is interrupted instead, in order with its events.
    Interrupt,
}

/// One task's event sink.
pub(crate) struct TaskSink {
    task: String,
    executor: String,
    model: String,
    held: RunningTasks,
    /// When the model call under way started.
    turn_started: Mutex<Option<Instant>>,
}

impl TaskSink {
    /// The sink of task `task`, whose blocks run in `executor`.
    pub(crate) fn new(task: &str, executor: &str, model: &str, held: RunningTasks) -> Self {
        Self {
            task: task.to_owned(),
            executor: executor.to_owned(),
            model: model.to_owned(),
            held,
            turn_started: Mutex::new(None),
        }
    }

    /// Applies the rules to `msg`; `stopping` is whether the daemon is shutting down.
    pub(crate) fn take(&self, mut msg: EventMsg, metrics: &Metrics, stopping: bool) -> Then {
        match &mut msg {
            EventMsg::Artifact { file, href, .. } => {
                *href = Some(file_href(&self.task, file));
            }
            EventMsg::CodeBlock { .. } => self.held.block_started(&self.task),
            EventMsg::ExecResult { result, .. } => {
                self.held.block_ended(&self.task);
                metrics.execution(&self.executor, result);
            }
            EventMsg::Net(net) => metrics.net(&self.executor, net),
            EventMsg::TurnStarted { .. } => {
                if let Ok(mut t) = self.turn_started.lock() {
                    *t = Some(Instant::now());
                }
            }
            EventMsg::AssistantMessage { usage, .. } => {
                if let Some(started) = self.turn_started.lock().ok().and_then(|mut t| t.take()) {
                    metrics.model_latency(started.elapsed());
                }
                if let Some(u) = usage {
                    metrics.tokens(*u, &self.model, &self.executor);
                }
            }
            EventMsg::TaskFinished {
                stop_reason: StopReason::Cancelled,
                ..
            } if stopping => return Then::Interrupt,
            EventMsg::TaskFinished { cost, budget, .. } => metrics.finished(
                *cost,
                budget.as_ref().map(|b| b.budget.as_str()),
                &self.model,
                &self.executor,
            ),
            _ => {}
        }
        Then::Record(msg)
    }
}

#[cfg(test)]
mod tests {
    use tandem_executor::CancellationToken;
    use tandem_protocol::{BlockResult, BlockStatus, Usage};

    use super::*;

    fn sink() -> (TaskSink, RunningTasks, CancellationToken) {
        let held = RunningTasks::default();
        let token = CancellationToken::new();
        held.take("t1", 1, token.clone());
        (TaskSink::new("t1", "local", "m", held.clone()), held, token)
    }

    fn block() -> EventMsg {
        EventMsg::CodeBlock {
            turn: 1,
            index: 1,
            language: Some("python".into()),
            code: "print(1)".into(),
        }
    }

    fn result() -> EventMsg {
        EventMsg::ExecResult {
            turn: 1,
            index: 1,
            result: BlockResult {
                language: Some("python".into()),
                status: BlockStatus::Exited,
                exit_code: Some(0),
                stdout: "1\n".into(),
                stderr: String::new(),
                truncated: false,
                duration_ms: 1500,
                resources: None,
            },
        }
    }

    fn finished(stop_reason: StopReason) -> EventMsg {
        EventMsg::finished(stop_reason, 1, Usage::default(), 1, None)
    }

    fn metric(metrics: &Metrics, line_start: &str) -> Option<String> {
        metrics
            .render(&[], 0, &[], &[], ("d", 0), None)
            .lines()
            .find(|l| l.starts_with(line_start))
            .map(str::to_owned)
    }

    #[test]
    fn an_artifact_gets_the_href_the_api_serves_it_at() {
        let (sink, ..) = sink();
        let msg = EventMsg::Artifact {
            turn: 1,
            index: 1,
            file: "out dir/plot #1.png".into(),
            mime: "image/png".into(),
            bytes: 3,
            href: None,
        };
        let Then::Record(EventMsg::Artifact { href, .. }) =
            sink.take(msg, &Metrics::default(), false)
        else {
            panic!("not recorded as an artifact");
        };
        assert_eq!(
            href.as_deref(),
            Some("/v1/tasks/t1/files/out%20dir/plot%20%231.png")
        );
    }

    #[test]
    fn a_task_lost_during_a_block_stops_when_the_block_ends() {
        let (sink, held, token) = sink();
        let metrics = Metrics::default();
        assert_eq!(sink.take(block(), &metrics, false), Then::Record(block()));
        held.lose(&[("t1".into(), 1)]);
        assert!(!token.is_cancelled(), "the running block was cut short");
        assert_eq!(sink.take(result(), &metrics, false), Then::Record(result()));
        assert!(token.is_cancelled());
    }

    #[test]
    fn a_cancel_by_shutdown_interrupts_and_any_other_end_is_stored() {
        let (sink, ..) = sink();
        let metrics = Metrics::default();
        let cancelled = finished(StopReason::Cancelled);
        assert_eq!(
            sink.take(cancelled.clone(), &metrics, true),
            Then::Interrupt
        );
        assert_eq!(
            sink.take(cancelled.clone(), &metrics, false),
            Then::Record(cancelled)
        );
        let done = finished(StopReason::Terminated);
        assert_eq!(sink.take(done.clone(), &metrics, true), Then::Record(done));
    }

    #[test]
    fn blocks_and_tokens_are_counted() {
        let (sink, ..) = sink();
        let metrics = Metrics::default();
        sink.take(result(), &metrics, false);
        let reply = EventMsg::AssistantMessage {
            turn: 1,
            text: "hi".into(),
            usage: Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 2,
                estimated: false,
            }),
            tool_calls: Vec::new(),
        };
        sink.take(
            EventMsg::TurnStarted {
                turn: 1,
                agent: None,
            },
            &metrics,
            false,
        );
        sink.take(reply, &metrics, false);
        let executions = metric(&metrics, "tandem_executions_total{").unwrap_or_default();
        assert!(
            executions.contains("executor=\"local\"") && executions.ends_with(" 1"),
            "{executions}"
        );
        let prompt = metric(
            &metrics,
            "tandem_tokens_total{kind=\"prompt\",model=\"m\",executor=\"local\"}",
        )
        .unwrap_or_default();
        assert!(prompt.ends_with(" 7"), "{prompt}");
        let calls = metric(&metrics, "tandem_model_seconds_count").unwrap_or_default();
        assert!(calls.ends_with(" 1"), "{calls}");
    }
}
