//! Showing events to a person, or as JSON lines to a program.

use std::io::{self, IsTerminal, Write};
use std::time::{SystemTime, UNIX_EPOCH};

use tandem_protocol::{BlockResult, BlockStatus, Event, EventMsg, OutputStream, StopReason};

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

/// Turns events into output; the first write error (a closed pipe) is kept and reported.
pub struct Renderer<W: Write> {
    out: W,
    mode: Mode,
    color: bool,
    seq: u64,
    /// Whether streamed text was shown for the current turn (non-streaming servers send none).
    streamed: bool,
    at_line_start: bool,
    shown: Shown,
    /// Where the task runs ("in this process", "on the daemon at ..."), for the header.
    place: Option<String>,
    /// Which agent each event belongs to, for `--json`.
    speakers: tandem_protocol::Speakers,
    /// Where a failed task's reason is said as well: the transcript may be going to a file or
    /// a pipe that no one reads now.
    failures: Option<Box<dyn Write + Send>>,
    /// How pictures are shown inline, when they are.
    pictures: Option<Pictures>,
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
        Self {
            out,
            mode,
            color,
            seq: 0,
            streamed: false,
            at_line_start: true,
            shown: Shown::default(),
            place: None,
            speakers: tandem_protocol::Speakers::default(),
            failures: None,
            pictures: None,
            error: None,
        }
    }

    /// Names where the task runs in the transcript's header.
    pub fn place(mut self, place: impl Into<String>) -> Self {
        self.place = Some(place.into());
        self
    }

    /// Names where the task runs, after the renderer was made.
    pub fn set_place(&mut self, place: impl Into<String>) {
        self.place = Some(place.into());
    }

    /// Shows pictures inline as they are drawn.
    pub fn pictures(mut self, pictures: Option<Pictures>) -> Self {
        self.pictures = pictures;
        self
    }

    /// [`Renderer::pictures`], after the renderer was made.
    pub fn set_pictures(&mut self, pictures: Option<Pictures>) {
        self.pictures = pictures;
    }

    /// Says what was kept of the task's files: a rule naming the directory and a line per
    /// file (as JSON, a `file_saved` event per file), then what the size cap left out and
    /// how to get it; nothing when the task made nothing.
    pub fn kept(&mut self, kept: &crate::keep::Kept, max_mb: u64, how: &str) {
        let human = self.mode == Mode::Human;
        if let (true, Some(dir), false) = (human, &kept.dir, kept.saved.is_empty()) {
            let label = format!(
                "files kept in {}",
                tandem_protocol::files::shown(&dir.display().to_string())
            );
            self.say(|r| r.rule(&label));
        }
        for s in &kept.saved {
            self.event(&EventMsg::FileSaved {
                file: s.file.rel.to_string_lossy().into_owned(),
                bytes: s.file.bytes,
                to: s.to.display().to_string(),
            });
        }
        if human && !kept.over.is_empty() {
            let bytes: u64 = kept.over.iter().map(|f| f.bytes).sum();
            let n = kept.over.len();
            let label = format!(
                "{n} file{} ({}) not kept, over --out-max-mb {max_mb}: {how}",
                if n == 1 { "" } else { "s" },
                size(bytes)
            );
            self.say(|r| r.rule(&label));
        }
    }

    /// Writes with `f` unless an earlier write failed; keeps the first failure.
    fn say(&mut self, f: impl FnOnce(&mut Self) -> io::Result<()>) {
        if self.error.is_some() {
            return;
        }
        if let Err(e) = f(self).and_then(|()| self.out.flush()) {
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
            let _ = writeln!(to, "tandem: the task failed: {}", e.message);
        }
        if self.error.is_some() {
            return;
        }
        self.seq += 1;
        let result = match self.mode {
            Mode::Json => self.json(msg),
            Mode::Human => self.human(msg),
        };
        if let Err(e) = result.and_then(|()| self.out.flush()) {
            self.error = Some(e);
        }
    }

    fn json(&mut self, msg: &EventMsg) -> io::Result<()> {
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        let event = Event {
            seq: self.seq,
            at_ms,
            path: self.speakers.agent_of(msg),
            msg: msg.clone(),
        };
        serde_json::to_writer(&mut self.out, &event)?;
        self.out.write_all(b"\n")
    }

    fn text(&mut self, s: &str) -> io::Result<()> {
        if !s.is_empty() {
            self.out.write_all(s.as_bytes())?;
            self.at_line_start = s.ends_with('\n');
        }
        Ok(())
    }

    fn rule(&mut self, label: &str) -> io::Result<()> {
        self.rule_at("", label)
    }

    /// A rule on a line of its own, after `indent`.
    fn rule_at(&mut self, indent: &str, label: &str) -> io::Result<()> {
        if !self.at_line_start {
            self.text("\n")?;
        }
        let line = if self.color {
            format!("{indent}\x1b[2m── {label} ──\x1b[0m\n")
        } else {
            format!("{indent}── {label} ──\n")
        };
        self.text(&line)
    }

    fn output(&mut self, stream: OutputStream, text: &str) -> io::Result<()> {
        match stream {
            OutputStream::Stderr if self.color && !text.is_empty() => {
                self.out
                    .write_all(format!("\x1b[31m{text}\x1b[0m").as_bytes())?;
                self.at_line_start = text.ends_with('\n');
                Ok(())
            }
            _ => self.text(text),
        }
    }

    fn human(&mut self, msg: &EventMsg) -> io::Result<()> {
        match msg {
            EventMsg::TaskStarted {
                model,
                base_url,
                executor,
                trace,
                ..
            } => {
                let place = self
                    .place
                    .as_deref()
                    .map_or(String::new(), |p| format!(" · {p}"));
                let trace = trace
                    .as_deref()
                    .and_then(tandem_protocol::trace_id_of)
                    .map_or(String::new(), |id| format!(" · trace {id}"));
                self.rule(&format!(
                    "tandem · model {model} at {base_url} · executor {executor}{place}{trace}"
                ))
            }
            EventMsg::TurnStarted { turn, agent: None } => {
                self.streamed = false;
                self.rule(&format!("assistant · turn {turn}"))
            }
            EventMsg::TeamEnded { agent, by } => {
                let (indent, name) = speaker(agent);
                self.rule_at(&indent, &format!("{name} ended: {by}"))
            }
            EventMsg::TurnStarted {
                turn,
                agent: Some(agent),
            } => {
                self.streamed = false;
                let (indent, name) = speaker(agent);
                self.rule_at(&indent, &format!("{name} · turn {turn}"))
            }
            EventMsg::AssistantDelta { text, .. } => {
                self.streamed = true;
                self.text(text)
            }
            EventMsg::SandboxLost { host, reason, .. } => self.rule(&format!(
                "the sandbox on {host} was lost ({reason}); running the block again on another host"
            )),
            EventMsg::ModelRetry {
                attempt,
                delay_ms,
                reason,
                ..
            } => {
                self.streamed = false;
                self.rule(&format!(
                    "model call failed ({reason}); retry {attempt} in {:.1} s",
                    *delay_ms as f64 / 1000.0
                ))
            }
            EventMsg::RepliesDrawn {
                drawn,
                chosen,
                held,
                examples,
                ..
            } => {
                let kept = match chosen {
                    0 => "kept this one".to_owned(),
                    n => {
                        // The text streamed above is not the reply run: the kept one is shown.
                        self.streamed = false;
                        format!("kept drawn reply {n}, below")
                    }
                };
                let replies = if *drawn == 1 { "reply" } else { "replies" };
                self.rule(&format!(
                    "the task's examples do not all hold against its code: drew {drawn} more {replies}; {kept}, which holds {held} of {examples}"
                ))
            }
            EventMsg::AssistantMessage { text, .. } => {
                if !self.streamed {
                    self.text(text)?;
                }
                if self.at_line_start {
                    Ok(())
                } else {
                    self.text("\n")
                }
            }
            EventMsg::CodeBlock {
                index, language, ..
            } => {
                self.shown.clear();
                let lang = language.as_deref().unwrap_or("untagged");
                self.rule(&format!("block {index} · {lang}"))
            }
            EventMsg::ApprovalRequested {
                n, rule, reason, ..
            } => {
                let by = rule
                    .as_deref()
                    .map(|r| format!(" (rule `{r}`)"))
                    .unwrap_or_default();
                self.rule(&format!("approval {n} asked{by}: {reason}"))
            }
            EventMsg::ApprovalDecided {
                n,
                decision,
                by,
                code,
                reason,
                rule,
                ..
            } => {
                let what = match (decision, code.is_some()) {
                    (tandem_protocol::Decision::Approve, true) => "approved, edited",
                    (tandem_protocol::Decision::Approve, false) => "approved",
                    (tandem_protocol::Decision::Deny, _) => "denied",
                };
                let by = match rule {
                    Some(rule) => format!("rule `{rule}`"),
                    None => by.clone(),
                };
                let why = reason
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default();
                let label = if *n == 0 {
                    format!("{what} by {by}{why}")
                } else {
                    format!("approval {n} {what} by {by}{why}")
                };
                self.rule(&label)?;
                match code {
                    Some(code) => {
                        self.text(code)?;
                        self.text(if code.ends_with('\n') { "" } else { "\n" })
                    }
                    None => Ok(()),
                }
            }
            EventMsg::ExecOutput { text, stream, .. } => {
                self.shown.push(*stream, text);
                self.output(*stream, text)
            }
            EventMsg::ExecResult { result, .. } => {
                for stream in [OutputStream::Stdout, OutputStream::Stderr] {
                    let rest = self.shown.rest(stream, result);
                    self.output(stream, rest)?;
                }
                self.rule(&result_line(result))
            }
            EventMsg::Artifact {
                file,
                mime,
                bytes,
                href,
                ..
            } => {
                self.rule(&format!(
                    "picture {} · {mime} · {}",
                    tandem_protocol::files::shown(file),
                    size(*bytes)
                ))?;
                let shown = self.pictures.as_mut().and_then(|p| {
                    let data = (p.source)(file, href.as_deref())?;
                    p.protocol.encode(&data, mime, p.tmux)
                });
                if let Some(escapes) = shown {
                    self.out.write_all(&escapes)?;
                    self.at_line_start = true;
                }
                Ok(())
            }
            EventMsg::FileSaved { file, bytes, .. } => self.text(&format!(
                "{:>10}  {}\n",
                size(*bytes),
                tandem_protocol::files::shown(file)
            )),
            EventMsg::ToolCall {
                name, arguments, ..
            } => {
                self.shown.clear();
                self.rule(&format!("call {name}"))?;
                // The code of an `execute_code` call is shown as code, not as JSON.
                let code = (name == tandem_protocol::tools::EXECUTE_CODE)
                    .then(|| serde_json::from_str::<serde_json::Value>(arguments).ok())
                    .flatten()
                    .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned));
                let shown = code.as_deref().unwrap_or(arguments);
                self.text(shown)?;
                self.text(if shown.ends_with('\n') { "" } else { "\n" })
            }
            EventMsg::ToolResult {
                name,
                result,
                is_error,
                duration_ms,
                ..
            } => {
                // An `execute_code` call's output was shown as a block's.
                if name == tandem_protocol::tools::EXECUTE_CODE {
                    return Ok(());
                }
                let how = if *is_error { "failed" } else { "answered" };
                self.rule(&format!("{name} {how} · {duration_ms} ms"))?;
                self.text(result)?;
                self.text(if result.ends_with('\n') || result.is_empty() {
                    ""
                } else {
                    "\n"
                })
            }
            EventMsg::ExecutorMessage { text, .. } => {
                // Output was shown live; only the executor's own words are worth repeating.
                if !text.is_empty() && !text.starts_with("exitcode:") {
                    self.rule("executor")?;
                    self.text(text)?;
                    self.text("\n")?;
                } else if let Some(at) = tandem_agent::examples::note_in(text) {
                    // What the examples said is the model's reason to go on or stop, and
                    // was never shown live.
                    self.rule("the task's examples")?;
                    self.text(&text[at..])?;
                    self.text("\n")?;
                }
                Ok(())
            }
            EventMsg::TaskFinished {
                stop_reason,
                turns,
                usage,
                elapsed_ms,
                error,
                summary,
                check,
                cost,
                budget,
                ..
            } => {
                if let Some(e) = error {
                    self.rule(&format!("error: {}", e.message))?;
                }
                if let Some(b) = budget {
                    self.rule(&format!("budget: {}", b.message()))?;
                }
                self.rule(&format!(
                    "{} · {turns} turn{} · {} in / {} out tokens{} · {:.1} s",
                    stop_label(*stop_reason),
                    if *turns == 1 { "" } else { "s" },
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    cost.filter(|c| *c > 0.0)
                        .map(|c| format!(" · cost {c:.4}"))
                        .unwrap_or_default(),
                    *elapsed_ms as f64 / 1000.0
                ))?;
                if let Some(check) = check {
                    let detail = check.gist();
                    let sep = if detail.is_empty() { "" } else { ": " };
                    self.rule(&format!("check {}{sep}{detail}", check.verdict.as_str()))?;
                }
                // The answer last, where `| tail` and a person's eye find it.
                match summary.as_deref().map(str::trim) {
                    Some(answer) if !answer.is_empty() => self.text(&format!("{answer}\n")),
                    _ => Ok(()),
                }
            }
        }
    }
}

/// A team member's path (`team/solve/coder`) as the transcript shows it: indented by its
/// nesting, named by its last part.
fn speaker(path: &str) -> (String, &str) {
    let mut parts: Vec<&str> = path.split('/').collect();
    let name = parts.pop().unwrap_or_default();
    ("  ".repeat(parts.len().saturating_sub(1)), name)
}

fn stop_label(reason: StopReason) -> &'static str {
    match reason {
        StopReason::Terminated => "done",
        StopReason::MaxTurns => "stopped: turn limit reached",
        StopReason::Timeout => "stopped: task timeout",
        StopReason::Budget => "stopped: budget reached",
        StopReason::Cancelled => "cancelled",
        StopReason::Error => "failed",
        StopReason::Repeated => "stopped: the same code sent again",
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
}
