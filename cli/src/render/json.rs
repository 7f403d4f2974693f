//! One protocol `Event` per line, for programs.

use std::io::{self, Write};
use std::time::{SystemTime, UNIX_EPOCH};

use tandem_protocol::{Event, EventMsg};

use super::Transcript;

/// JSON lines: each event with its number, time and agent.
#[derive(Default)]
pub(super) struct JsonLines {
    /// Which agent each event belongs to.
    speakers: tandem_protocol::Speakers,
}

impl Transcript for JsonLines {
    fn event(&mut self, out: &mut dyn Write, seq: u64, msg: &EventMsg) -> io::Result<()> {
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        let event = Event {
            seq,
            at_ms,
            path: self.speakers.agent_of(msg),
            msg: msg.clone(),
        };
        let line = crate::inert::json(serde_json::to_string(&event)?);
        out.write_all(line.as_bytes())?;
        out.write_all(b"\n")
    }
}
