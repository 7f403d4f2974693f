use std::collections::VecDeque;

/// How much of `buf` is whole characters to decode now: all of it, unless it ends inside a
/// UTF-8 sequence that more bytes could still complete.
pub fn complete_utf8(buf: &[u8]) -> usize {
    for back in 1..=buf.len().min(3) {
        let at = buf.len() - back;
        let byte = buf[at];
        if byte & 0xC0 == 0x80 {
            continue; // a continuation byte: the sequence started further back
        }
        let needs = match byte {
            0xF0..=0xF7 => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if needs > back { at } else { buf.len() };
    }
    buf.len()
}

/// Collects one output stream up to a cap, keeping the head and the tail.
///
/// Programs that print megabytes usually matter at both ends (the first error and the final
/// result), so the middle is what gets cut.
#[derive(Debug)]
pub struct CaptureBuffer {
    cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    total: u64,
}

impl CaptureBuffer {
    /// A buffer that keeps at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            head: Vec::new(),
            tail: VecDeque::new(),
            total: 0,
        }
    }

    /// Appends `data`; returns how many of its leading bytes go into the kept head (the part
    /// shown live). Live output is exactly the head, so that what a person saw live plus the
    /// cut and the tail is what the model gets.
    pub fn push(&mut self, data: &[u8]) -> usize {
        self.total += data.len() as u64;
        let head_cap = self.cap / 2 + self.cap % 2;
        let tail_cap = self.cap / 2;
        let to_head = head_cap.saturating_sub(self.head.len()).min(data.len());
        let live = to_head;
        self.head.extend_from_slice(&data[..to_head]);
        let rest = &data[to_head..];
        if tail_cap > 0 && !rest.is_empty() {
            let rest = &rest[rest.len().saturating_sub(tail_cap)..];
            let overflow = (self.tail.len() + rest.len()).saturating_sub(tail_cap);
            self.tail.drain(..overflow);
            self.tail.extend(rest);
        }
        live
    }

    /// Records `n` bytes that a sandbox dropped from the middle of the stream before they
    /// reached Tandem (it capped the stream itself); what is pushed next is the tail.
    pub fn skip(&mut self, n: u64) {
        if n > 0 {
            self.total += n;
            self.tail.clear();
        }
    }

    /// Total bytes seen so far, kept or not.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Freezes what was kept.
    pub fn finish(self) -> Captured {
        Captured {
            head: self.head,
            tail: self.tail.into(),
            total: self.total,
        }
    }
}

/// One captured output stream: the kept head and tail and how much there was in all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Captured {
    head: Vec<u8>,
    tail: Vec<u8>,
    total: u64,
}

impl Captured {
    /// Whether bytes were cut from the middle.
    pub fn truncated(&self) -> bool {
        self.dropped() > 0
    }

    /// How many bytes were cut.
    pub fn dropped(&self) -> u64 {
        self.total - (self.head.len() + self.tail.len()) as u64
    }

    /// Total bytes the program wrote to this stream.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Whether the stream went on past the kept head (so a character at the head's end may
    /// continue in what follows).
    pub fn continues_past_head(&self) -> bool {
        self.total > self.head.len() as u64
    }

    /// Lossily decoded text with a visible `[... N bytes truncated ...]` note where the
    /// middle was cut. Only bytes the program wrote wrong become U+FFFD: a character that the
    /// head and tail split is decoded whole, and the pieces of one that Tandem's cut split
    /// are counted with the cut.
    pub fn to_text(&self) -> String {
        if !self.truncated() {
            let mut whole = self.head.clone();
            whole.extend_from_slice(&self.tail);
            return String::from_utf8_lossy(&whole).into_owned();
        }
        let head = &self.head[..complete_utf8(&self.head)];
        let partial = self
            .tail
            .iter()
            .take(3)
            .take_while(|b| **b & 0xC0 == 0x80)
            .count();
        let tail = &self.tail[partial..];
        let mut text = String::from_utf8_lossy(head).into_owned();
        if !text.ends_with('\n') {
            text.push('\n');
        }
        let cut = self.total - (head.len() + tail.len()) as u64;
        text.push_str(&format!("[... {cut} bytes truncated ...]\n"));
        text.push_str(&String::from_utf8_lossy(tail));
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_split_by_the_head_or_the_cut_stay_whole() {
        // Three-byte characters: the head's edge (5 bytes) falls inside one.
        let text = "✓".repeat(3);
        let mut buf = CaptureBuffer::new(10);
        buf.push(text.as_bytes());
        assert_eq!(buf.finish().to_text(), text);
        // Past the cap, the pieces the cut leaves at both ends are counted with it.
        let mut buf = CaptureBuffer::new(10);
        buf.push("✓".repeat(10).as_bytes());
        assert_eq!(buf.finish().to_text(), "✓\n[... 24 bytes truncated ...]\n✓");
        // Bytes the program wrote wrong still show as such.
        let mut buf = CaptureBuffer::new(10);
        buf.push(b"ok\xff\n");
        assert_eq!(buf.finish().to_text(), "ok\u{FFFD}\n");
    }

    #[test]
    fn small_output_is_kept_whole() {
        let mut buf = CaptureBuffer::new(10);
        assert_eq!(buf.push(b"hello"), 5);
        let c = buf.finish();
        assert!(!c.truncated());
        assert_eq!(c.to_text(), "hello");
    }

    #[test]
    fn keeps_head_and_tail_with_a_note() {
        let mut buf = CaptureBuffer::new(8);
        assert_eq!(buf.push(b"012"), 3);
        assert_eq!(buf.push(b"3456789"), 1);
        assert_eq!(buf.push(b"abcdef"), 0);
        let c = buf.finish();
        assert_eq!(c.total(), 16);
        assert_eq!(c.dropped(), 8);
        assert_eq!(c.to_text(), "0123\n[... 8 bytes truncated ...]\ncdef");
    }

    #[test]
    fn skipped_bytes_count_as_truncated() {
        let mut buf = CaptureBuffer::new(8);
        buf.push(b"01234567");
        buf.skip(100);
        buf.push(b"wxyz");
        let c = buf.finish();
        assert_eq!(c.total(), 112);
        assert_eq!(c.to_text(), "0123\n[... 104 bytes truncated ...]\nwxyz");
    }

    #[test]
    fn invalid_utf8_is_decoded_lossily() {
        let mut buf = CaptureBuffer::new(100);
        buf.push(b"ok \xff\xfe end");
        assert_eq!(buf.finish().to_text(), "ok \u{fffd}\u{fffd} end");
    }
}
