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

/// `events` with each block's result given the bytes its sandbox's connections through the
/// egress proxy carried: those of the `net` events told since the last result. A connection
/// still open when its block ends is told after the result, and counts with the next block.
pub fn counting_net(events: EventSink) -> EventSink {
    let since = std::sync::Mutex::new((0u64, 0u64));
    Arc::new(move |mut msg: EventMsg| {
        match &mut msg {
            EventMsg::Net(net) => {
                if let Ok(mut b) = since.lock() {
                    b.0 = b.0.saturating_add(net.bytes_in);
                    b.1 = b.1.saturating_add(net.bytes_out);
                }
            }
            EventMsg::ExecResult { result, .. } => {
                let (bytes_in, bytes_out) = since
                    .lock()
                    .map(|mut b| std::mem::take(&mut *b))
                    .unwrap_or_default();
                let used = result.resources.get_or_insert_with(Default::default);
                used.net_bytes_in = Some(bytes_in);
                used.net_bytes_out = Some(bytes_out);
            }
            _ => {}
        }
        events(msg)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_protocol::net::{NetEvent, NetVerdict};
    use tandem_protocol::{BlockResult, BlockStatus};

    fn net(bytes_in: u64, bytes_out: u64) -> EventMsg {
        EventMsg::Net(NetEvent {
            host: "pypi.test".into(),
            port: 443,
            verdict: NetVerdict::Allowed,
            rule: "pypi.test".into(),
            reason: None,
            bytes_out,
            bytes_in,
            ms: 1,
            brokered: false,
        })
    }

    fn result() -> EventMsg {
        EventMsg::ExecResult {
            turn: 1,
            index: 1,
            result: BlockResult {
                language: Some("python".into()),
                status: BlockStatus::Exited,
                exit_code: Some(0),
                stdout: String::new(),
                stderr: String::new(),
                truncated: false,
                duration_ms: 1,
                resources: None,
            },
        }
    }

    #[test]
    fn each_result_gets_the_bytes_told_since_the_last() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let into = seen.clone();
        let sink = counting_net(Arc::new(move |m| into.lock().unwrap().push(m)));
        sink(net(100, 10));
        sink(net(5, 1));
        sink(result());
        sink(result());
        let seen = seen.lock().unwrap();
        let bytes: Vec<(Option<u64>, Option<u64>)> = seen
            .iter()
            .filter_map(|m| match m {
                EventMsg::ExecResult { result, .. } => result
                    .resources
                    .as_ref()
                    .map(|r| (r.net_bytes_in, r.net_bytes_out)),
                _ => None,
            })
            .collect();
        assert_eq!(bytes, vec![(Some(105), Some(11)), (Some(0), Some(0))]);
    }
}
