//! Showing events to a person, or as JSON lines to a program: one [`Transcript`] per way
//! of writing them, behind one [`Renderer`] that owns the writer and its first failure.

mod human;
mod json;

use std::io::{self, IsTerminal, Write};

use tandem_protocol::{BlockResult, BlockStatus, EventMsg, OutputStream};

/// How events are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A readable transcript.
    Human,
    /// One protocol `Event` per line.
    Json,
}

impl Mode {
    /// `Json` for `--json`, else `Human`.
    pub fn json(json: bool) -> Self {
        if json { Self::Json } else { Self::Human }
    }
}

/// The output of the current block shown live so far, per stream. Live output carries only
/// the head of a long stream; what the result holds beyond it (the cut marker with its byte
/// count, the tail, a refusal or sandbox error that never streamed) is shown from here.
#[derive(Default)]
pub struct Shown {
    out: String,
    err: String,
}

impl Shown {
    /// Starts a new block.
    pub fn clear(&mut self) {
        self.out.clear();
        self.err.clear();
    }

    /// Notes text shown live.
    pub fn push(&mut self, stream: OutputStream, text: &str) {
        match stream {
            OutputStream::Stdout => self.out.push_str(text),
            OutputStream::Stderr => self.err.push_str(text),
        }
    }

    /// What of the result's `stream` text was not shown live.
    pub fn rest<'a>(&self, stream: OutputStream, result: &'a BlockResult) -> &'a str {
        let (shown, whole) = match stream {
            OutputStream::Stdout => (&self.out, &result.stdout),
            OutputStream::Stderr => (&self.err, &result.stderr),
        };
        // Live text is the head of what the result holds; anything else was shown whole.
        whole.strip_prefix(shown.as_str()).unwrap_or_default()
    }
}

/// One way of writing a task's events; the renderer gives it the writer.
trait Transcript: Send {
    /// Writes the `seq`th event.
    fn event(&mut self, out: &mut dyn Write, seq: u64, msg: &EventMsg) -> io::Result<()>;
    /// Names where the task runs, for a header.
    fn set_place(&mut self, _place: String) {}
    /// Shows pictures inline as they are drawn.
    fn set_pictures(&mut self, _pictures: Option<Pictures>) {}
    /// What comes before the kept files' `file_saved` events.
    fn kept_before(&mut self, _out: &mut dyn Write, _kept: &crate::keep::Kept) -> io::Result<()> {
        Ok(())
    }
    /// What comes after them: what the size cap left out, and the answer again.
    fn kept_after(
        &mut self,
        _out: &mut dyn Write,
        _kept: &crate::keep::Kept,
        _max_mb: u64,
        _how: &str,
    ) -> io::Result<()> {
        Ok(())
    }
}

/// Turns events into output; the first write error (a closed pipe) is kept and reported.
pub struct Renderer<W: Write> {
    out: W,
    seq: u64,
    transcript: Box<dyn Transcript>,
    /// Where a failed task's reason is said as well: the transcript may be going to a file or
    /// a pipe that no one reads now.
    failures: Option<Box<dyn Write + Send>>,
    pub error: Option<io::Error>,
}

/// Reads a picture a task drew: its path in the workspace and, on a daemon, where to
/// download it; `None` when it cannot be had (gone, too large).
pub type PictureSource = Box<dyn FnMut(&str, Option<&str>) -> Option<Vec<u8>> + Send>;

/// Pictures shown inline: the terminal's protocol and where their bytes come from.
pub struct Pictures {
    protocol: crate::picture::Protocol,
    tmux: bool,
    source: PictureSource,
    bounds: crate::picture::Bounds,
}

impl Pictures {
    /// Pictures on standard output, when it is a terminal that speaks an image protocol and
    /// the user did not say `--no-pictures`.
    pub fn for_stdout(no_pictures: bool, mode: Mode, source: PictureSource) -> Option<Self> {
        if no_pictures || mode != Mode::Human || !io::stdout().is_terminal() {
            return None;
        }
        let terminal = crate::config::terminal();
        Some(Self {
            protocol: crate::picture::Protocol::detect(&terminal)?,
            tmux: terminal.tmux,
            source,
            bounds: crate::picture::Bounds::default(),
        })
    }
}

impl Renderer<io::Stdout> {
    /// A renderer on standard output, colored when it is a terminal.
    pub fn stdout(mode: Mode) -> Self {
        let color = io::stdout().is_terminal() && !crate::config::no_color();
        let mut renderer = Self::new(io::stdout(), mode, color);
        renderer.failures = Some(Box::new(io::stderr()));
        renderer
    }
}

impl<W: Write> Renderer<W> {
    pub fn new(out: W, mode: Mode, color: bool) -> Self {
        let transcript: Box<dyn Transcript> = match mode {
            Mode::Human => Box::new(human::Human::new(color)),
            Mode::Json => Box::new(json::JsonLines::default()),
        };
        Self {
            out,
            seq: 0,
            transcript,
            failures: None,
            error: None,
        }
    }

    /// Names where the task runs in the transcript's header.
    pub fn set_place(&mut self, place: impl Into<String>) {
        self.transcript.set_place(place.into());
    }

    /// Shows pictures inline as they are drawn.
    pub fn pictures(mut self, pictures: Option<Pictures>) -> Self {
        self.set_pictures(pictures);
        self
    }

    /// [`Renderer::pictures`], after the renderer was made.
    pub fn set_pictures(&mut self, pictures: Option<Pictures>) {
        self.transcript.set_pictures(pictures);
    }

    /// Says what was kept of the task's files: a rule naming the directory and a line per
    /// file (as JSON, a `file_saved` event per file), then what the size cap left out and
    /// how to get it; nothing when the task made nothing.
    pub fn kept(&mut self, kept: &crate::keep::Kept, max_mb: u64, how: &str) {
        self.say(|out, t| t.kept_before(out, kept));
        for s in &kept.saved {
            self.event(&EventMsg::FileSaved {
                file: s.file.rel.to_string_lossy().into_owned(),
                bytes: s.file.bytes,
                to: s.to.display().to_string(),
            });
        }
        self.say(|out, t| t.kept_after(out, kept, max_mb, how));
    }

    /// Writes with `f` unless an earlier write failed; keeps the first failure.
    fn say(&mut self, f: impl FnOnce(&mut dyn Write, &mut dyn Transcript) -> io::Result<()>) {
        if self.error.is_some() {
            return;
        }
        if let Err(e) = f(&mut self.out, &mut *self.transcript).and_then(|()| self.out.flush()) {
            self.error = Some(e);
        }
    }

    /// Whether the reader went away (`| head`), which ends the output but is no failure.
    pub fn reader_gone(&self) -> bool {
        self.error
            .as_ref()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    }

    /// Writes one event; after a write error, later events are dropped.
    pub fn event(&mut self, msg: &EventMsg) {
        // Said even when the transcript's reader is gone.
        if let (EventMsg::TaskFinished { error: Some(e), .. }, Some(to)) = (msg, &mut self.failures)
        {
            let _ = writeln!(
                to,
                "tandem: the task failed: {}",
                crate::inert::line(&e.message)
            );
        }
        if self.error.is_some() {
            return;
        }
        self.seq += 1;
        let seq = self.seq;
        self.say(|out, t| t.event(out, seq, msg));
    }
}

/// One line summing up a block's result.
pub fn result_line(r: &BlockResult) -> String {
    let ms = r.duration_ms;
    match r.status {
        BlockStatus::Exited => format!("exit {} · {ms} ms", r.exit_code.unwrap_or(-1)),
        BlockStatus::TimedOut => format!("timed out after {ms} ms; killed"),
        BlockStatus::Killed => format!("killed · {ms} ms"),
        BlockStatus::OutOfMemory => "out of memory; killed".to_owned(),
        BlockStatus::Cancelled => "cancelled".to_owned(),
        BlockStatus::Unsupported => "not run: unsupported language".to_owned(),
        BlockStatus::Skipped => "not run: data, not a program".to_owned(),
        BlockStatus::NotRun => "not run: an earlier block failed".to_owned(),
        BlockStatus::Incomplete => "not run: the reply was cut off inside this block".to_owned(),
        BlockStatus::Declined => "not run: declined".to_owned(),
        BlockStatus::Error => "sandbox error".to_owned(),
    }
}

/// A block's result line and, where it was measured, what the block used.
pub fn result_and_usage(r: &BlockResult) -> String {
    let mut line = result_line(r);
    if let Some(used) = r.resources.as_ref().map(|u| u.summary())
        && !used.is_empty()
    {
        line.push_str(" · ");
        line.push_str(&used);
    }
    line
}

/// A byte count as a person reads it: `812 B`, `12.3 KiB`, `4.0 MiB`.
pub fn size(bytes: u64) -> String {
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..1_048_576 => format!("{:.1} KiB", bytes as f64 / 1024.0),
        _ => format!("{:.1} MiB", bytes as f64 / 1_048_576.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keep::{Kept, Made, Saved};

    #[test]
    fn kept_files_are_one_inert_line_each_and_nothing_made_says_nothing() {
        let mut r = Renderer::new(Vec::new(), Mode::Human, false);
        r.kept(&Kept::default(), 256, "");
        assert!(r.out.is_empty());
        let kept = Kept {
            dir: Some("tandem-out/t".into()),
            saved: vec![Saved {
                file: Made {
                    rel: "a\u{1b}[2J\n   9 B  forged".into(),
                    bytes: 2048,
                },
                to: "tandem-out/t/x".into(),
            }],
            ..Kept::default()
        };
        r.kept(&kept, 256, "");
        let text = String::from_utf8(r.out).unwrap_or_default();
        assert_eq!(
            text,
            "── files kept in tandem-out/t ──\n   2.0 KiB  a\\u{1b}[2J\\u{a}   9 B  forged\n"
        );
    }

    /// Whatever in `out` a terminal would act on, other than a newline, a tab and the
    /// transcript's own colours (SGR `ESC [ digits m`): empty when `out` is inert.
    fn acted_on(out: &[u8]) -> Vec<String> {
        let text = String::from_utf8_lossy(out);
        let mut found = Vec::new();
        let mut chars = text.char_indices().peekable();
        while let Some((at, c)) = chars.next() {
            if c == '\x1b' {
                let rest = &text[at + 1..];
                let sgr = rest.strip_prefix('[').and_then(|r| {
                    let params = r.len()
                        - r.trim_start_matches(|c: char| c.is_ascii_digit() || c == ';')
                            .len();
                    r[params..].starts_with('m').then_some(params + 2)
                });
                match sgr {
                    Some(len) => {
                        for _ in 0..len {
                            chars.next();
                        }
                    }
                    None => found.push(format!(
                        "{:?}",
                        text[at..].chars().take(12).collect::<String>()
                    )),
                }
            } else if c.is_control() && !matches!(c, '\n' | '\t') {
                found.push(format!("{c:?} at {at}"));
            }
        }
        found
    }

    /// What an attacker's model and program write, each sequence split between two pieces.
    const HOSTILE: [&str; 6] = [
        "copy \x1b]52;c;cm0gLXJmIH4K\x07 then \x1b",
        "]8;;https://evil.example/\x1b\\a link\x1b]8;;\x1b\\ and \x1b]0;ti",
        "tle\x1b\\ then\x1b[2",
        "J\x1b[H\u{9b}2J\u{9d}52;c;eA==\u{9c} \x1bP1$q\x1b\\\x1b_Gf=1\x1b\\\x1b^pm\x1b\\",
        "\x07bell\x08\x08\x08\x08 over\rwritten\r",
        "\nend\n",
    ];

    #[test]
    fn control_sequences_in_model_text_and_output_are_shown_as_text() {
        for color in [true, false] {
            let mut r = Renderer::new(Vec::new(), Mode::Human, color);
            r.event(&EventMsg::TurnStarted {
                turn: 1,
                agent: None,
            });
            for piece in HOSTILE {
                r.event(&EventMsg::AssistantDelta {
                    turn: 1,
                    text: piece.to_owned(),
                });
            }
            for stream in [OutputStream::Stdout, OutputStream::Stderr] {
                for piece in HOSTILE {
                    r.event(&EventMsg::ExecOutput {
                        turn: 1,
                        index: 1,
                        stream,
                        text: piece.to_owned(),
                    });
                }
            }
            r.event(&EventMsg::ModelRetry {
                turn: 2,
                attempt: 1,
                delay_ms: 10,
                reason: HOSTILE.concat(),
            });
            assert_eq!(acted_on(&r.out), Vec::<String>::new(), "color {color}");
            let text = String::from_utf8_lossy(&r.out);
            assert!(
                text.contains(
                    "copy \\u{1b}]52;c;cm0gLXJmIH4K\\u{7} then \\u{1b}]8;;https://evil.example/"
                ),
                "{text}"
            );
            assert!(
                text.contains("then\\u{1b}[2J\\u{1b}[H\\u{9b}2J\\u{9d}52;c;eA==\\u{9c}"),
                "{text}"
            );
            // A carriage return ends the line rather than let the next text write over it.
            assert!(text.contains("\\u{8} over\nwritten\nend\n"), "{text}");
        }
    }

    #[test]
    fn an_escaped_sequence_reads_as_text_to_a_person() {
        let mut r = Renderer::new(Vec::new(), Mode::Human, false);
        r.event(&EventMsg::TurnStarted {
            turn: 1,
            agent: None,
        });
        for piece in HOSTILE {
            r.event(&EventMsg::AssistantDelta {
                turn: 1,
                text: piece.to_owned(),
            });
        }
        r.event(&next_block(1, 1));
        r.event(&EventMsg::ExecOutput {
            turn: 1,
            index: 1,
            stream: OutputStream::Stdout,
            text: HOSTILE.concat(),
        });
        r.event(&EventMsg::ModelRetry {
            turn: 2,
            attempt: 1,
            delay_ms: 1000,
            reason: "server said \x1b]0;pwned\x07\n\x1b[2J".to_owned(),
        });
        insta::assert_snapshot!(String::from_utf8_lossy(&r.out));
    }

    #[test]
    fn a_json_line_carries_c1_controls_escaped_and_the_same_text() {
        let mut r = Renderer::new(Vec::new(), Mode::Json, false);
        for piece in HOSTILE {
            r.event(&EventMsg::AssistantDelta {
                turn: 1,
                text: piece.to_owned(),
            });
        }
        assert_eq!(acted_on(&r.out), Vec::<String>::new());
        let back: String = String::from_utf8_lossy(&r.out)
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap_or_default();
                v["text"].as_str().unwrap_or_default().to_owned()
            })
            .collect();
        assert_eq!(back, HOSTILE.concat());
    }

    /// Pictures read from `dir` as `tandem run` reads a local task's, shown with `protocol`.
    fn pictures_from(dir: &std::path::Path, protocol: crate::picture::Protocol) -> Pictures {
        Pictures {
            protocol,
            tmux: false,
            source: crate::run::workspace_pictures(dir.to_owned()),
            bounds: crate::picture::Bounds::default(),
        }
    }

    fn artifact(turn: u32, index: u32, file: &str, bytes: u64) -> EventMsg {
        EventMsg::Artifact {
            turn,
            index,
            file: file.to_owned(),
            mime: "image/png".to_owned(),
            bytes,
            href: None,
        }
    }

    fn next_block(turn: u32, index: u32) -> EventMsg {
        EventMsg::CodeBlock {
            turn,
            index,
            language: Some("python".to_owned()),
            code: String::new(),
        }
    }

    /// A `width` x `height` grey PNG, written with the `png` crate.
    fn png(width: u32, height: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, width, height);
        encoder.set_color(png::ColorType::Grayscale);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().unwrap();
        let pixels: Vec<u8> = (0..u64::from(width) * u64::from(height))
            .map(|i| (i % 251) as u8)
            .collect();
        writer.write_image_data(&pixels).unwrap();
        writer.finish().unwrap();
        out
    }

    /// The size of each PNG sent in kitty escapes in `out`.
    fn kitty_sizes(out: &[u8]) -> Vec<(u32, u32)> {
        use base64::Engine as _;
        let text = String::from_utf8_lossy(out);
        let mut sizes = Vec::new();
        for picture in text.split("\x1b_Gf=").skip(1) {
            let mut b64 = String::new();
            for part in picture.split("\x1b\\") {
                if let Some((_, payload)) = part.split_once(';') {
                    b64.push_str(payload);
                }
            }
            let data = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap_or_default();
            let info = png::Decoder::new(std::io::Cursor::new(data))
                .read_info()
                .map(|r| r.info().size());
            sizes.push(info.unwrap_or((0, 0)));
        }
        sizes
    }

    #[test]
    fn two_dozen_sparse_8_mib_files_named_png_send_no_escapes_and_are_said_left_out() {
        let dir = tempfile::tempdir().unwrap();
        for protocol in [
            crate::picture::Protocol::Kitty,
            crate::picture::Protocol::ITerm,
            crate::picture::Protocol::Sixel,
        ] {
            let mut r = Renderer::new(Vec::new(), Mode::Human, false)
                .pictures(Some(pictures_from(dir.path(), protocol)));
            for i in 0..24 {
                let name = format!("p{i}.png");
                let f = std::fs::File::create(dir.path().join(&name)).unwrap();
                f.set_len(crate::picture::MAX_BYTES).unwrap();
                r.event(&artifact(1, 1, &name, crate::picture::MAX_BYTES));
            }
            r.event(&next_block(1, 2));
            assert!(r.out.len() < 1 << 20, "{protocol:?}: {} bytes", r.out.len());
            assert_eq!(acted_on(&r.out), Vec::<String>::new(), "{protocol:?}");
            let text = String::from_utf8_lossy(&r.out);
            assert!(
                text.contains(
                    "── 24 pictures not drawn: 4 not a PNG that decodes within 4096 x 4096 pixels; 20 past the 4 a block may draw ──\n── block 2 · python ──"
                ),
                "{protocol:?}: {text}"
            );
        }
    }

    #[test]
    fn a_file_named_png_that_is_no_png_is_not_sent() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("fake.png"), b"GIF89a, or anything at all").unwrap();
        for protocol in [
            crate::picture::Protocol::Kitty,
            crate::picture::Protocol::ITerm,
        ] {
            let mut r = Renderer::new(Vec::new(), Mode::Human, false)
                .pictures(Some(pictures_from(dir.path(), protocol)));
            r.event(&artifact(1, 1, "fake.png", 26));
            r.event(&next_block(1, 2));
            assert_eq!(acted_on(&r.out), Vec::<String>::new(), "{protocol:?}");
            let text = String::from_utf8_lossy(&r.out);
            assert!(
                text.contains("── 1 picture not drawn: 1 not a PNG that decodes"),
                "{text}"
            );
        }
    }

    #[test]
    fn a_png_a_million_pixels_high_is_scaled_into_the_box_for_every_protocol() {
        let dir = tempfile::tempdir().unwrap();
        let tall = png(1, 1_000_000);
        // Its rows compress to almost nothing: the file is small, what it decodes to is not.
        assert!(tall.len() < 64 << 10, "{}", tall.len());
        std::fs::write(dir.path().join("tall.png"), &tall).unwrap();
        std::fs::write(dir.path().join("wide.png"), png(100_000, 1)).unwrap();
        for protocol in [
            crate::picture::Protocol::Kitty,
            crate::picture::Protocol::ITerm,
            crate::picture::Protocol::Sixel,
        ] {
            let mut r = Renderer::new(Vec::new(), Mode::Human, false)
                .pictures(Some(pictures_from(dir.path(), protocol)));
            r.event(&artifact(1, 1, "tall.png", tall.len() as u64));
            let tall_out = r.out.split_off(0);
            r.event(&artifact(1, 2, "wide.png", 1));
            let wide_out = r.out.split_off(0);
            for (out, box_) in [(&tall_out, "c=1,r=20,"), (&wide_out, "c=40,r=1,")] {
                let text = String::from_utf8_lossy(out);
                assert!(out.len() < 1 << 20, "{protocol:?}: {} bytes", out.len());
                match protocol {
                    crate::picture::Protocol::Kitty => {
                        assert!(text.contains(box_), "{text:.200}");
                        let sizes = kitty_sizes(out);
                        assert_eq!(sizes.len(), 1);
                        assert!(sizes[0].0 <= 320 && sizes[0].1 <= 320, "{sizes:?}");
                    }
                    crate::picture::Protocol::ITerm => {
                        let (c, rows) = box_.trim_end_matches(',').split_once(",r=").unwrap();
                        let cells = format!("width={};height={rows};", &c[2..]);
                        assert!(text.contains(&cells), "{text:.200}");
                    }
                    crate::picture::Protocol::Sixel => {
                        let raster = if box_.starts_with("c=1,") {
                            "\"1;1;1;320#"
                        } else {
                            "\"1;1;320;1#"
                        };
                        assert!(text.contains(raster), "{text:.200}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_task_draws_at_most_sixteen_pictures_and_says_how_many_it_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let small = png(2, 2);
        std::fs::write(dir.path().join("a.png"), &small).unwrap();
        let mut r = Renderer::new(Vec::new(), Mode::Human, false).pictures(Some(pictures_from(
            dir.path(),
            crate::picture::Protocol::Kitty,
        )));
        for block in 1..=5 {
            r.event(&next_block(1, block));
            for _ in 0..4 {
                r.event(&artifact(1, block, "a.png", small.len() as u64));
            }
        }
        r.event(&next_block(2, 1));
        let sizes = kitty_sizes(&r.out);
        assert_eq!(sizes, vec![(2, 2); 16]);
        let text = String::from_utf8_lossy(&r.out);
        assert!(
            text.contains(
                "── 4 pictures not drawn: 4 past the 16 a task may draw ──\n── block 1 · python ──"
            ),
            "{text}"
        );
    }
}
