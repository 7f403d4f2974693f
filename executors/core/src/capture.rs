use std::collections::VecDeque;

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

    /// Lossily decoded text with a visible `[... N bytes truncated ...]` note where the
    /// middle was cut.
    pub fn to_text(&self) -> String {
        let mut text = String::from_utf8_lossy(&self.head).into_owned();
        if self.truncated() {
            if !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&format!("[... {} bytes truncated ...]\n", self.dropped()));
        }
        text.push_str(&String::from_utf8_lossy(&self.tail));
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
