//! What a task tells as it goes: the sink its events go to, and the events a model call's
//! progress becomes.

use std::sync::Arc;

use tandem_protocol::EventMsg;

use crate::chat::ModelProgress;

/// Receives every event of a task as it happens.
pub type EventSink = Arc<dyn Fn(EventMsg) + Send + Sync>;

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
