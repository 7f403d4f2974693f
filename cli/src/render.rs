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
    /// What a model or a program wrote is made inert as it streams.
    inert: crate::inert::Inert,
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
    /// The task's answer, told again below the list of kept files so it stays last.
    answer: Option<String>,
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
        Self {
            out,
            mode,
            color,
            seq: 0,
            streamed: false,
            at_line_start: true,
            shown: Shown::default(),
            inert: crate::inert::Inert::default(),
            place: None,
            speakers: tandem_protocol::Speakers::default(),
            failures: None,
            pictures: None,
            error: None,
            answer: None,
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
        let listed = human && (!kept.saved.is_empty() || !kept.over.is_empty());
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
        // The answer stays the transcript's last line, below the list of files.
        if let (true, Some(answer)) = (listed, self.answer.clone()) {
            self.say(|r| {
                r.rule("answer")?;
                r.text(&format!("{answer}\n"))
            });
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
        let line = crate::inert::json(serde_json::to_string(&event)?);
        self.out.write_all(line.as_bytes())?;
        self.out.write_all(b"\n")
    }

    /// Writes text a model, a program or the task's files may have chosen: inert, its
    /// control characters shown as escapes.
    fn text(&mut self, s: &str) -> io::Result<()> {
        let s = self.inert.piece(s);
        if !s.is_empty() {
            self.out.write_all(s.as_bytes())?;
            self.at_line_start = s.ends_with('\n');
        }
        Ok(())
    }

    /// Writes what the transcript says itself, its own colours included.
    fn raw(&mut self, s: &str) -> io::Result<()> {
        self.inert.interrupt();
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
    /// The label may hold what a model or a program said (a reason, an error): it is shown
    /// on the rule's one line, inert.
    fn rule_at(&mut self, indent: &str, label: &str) -> io::Result<()> {
        if !self.at_line_start {
            self.raw("\n")?;
        }
        let label = crate::inert::line(label);
        let line = if self.color {
            format!("{indent}\x1b[2m── {label} ──\x1b[0m\n")
        } else {
            format!("{indent}── {label} ──\n")
        };
        self.raw(&line)
    }

    fn output(&mut self, stream: OutputStream, text: &str) -> io::Result<()> {
        match stream {
            OutputStream::Stderr if self.color && !text.is_empty() => {
                let text = self.inert.piece(text);
                self.out
                    .write_all(format!("\x1b[31m{text}\x1b[0m").as_bytes())?;
                self.at_line_start = text.ends_with('\n');
                Ok(())
            }
            _ => self.text(text),
        }
    }

    fn human(&mut self, msg: &EventMsg) -> io::Result<()> {
        // What the pictures of a block left out is said once they end.
        let picture_of = match msg {
            EventMsg::Artifact { turn, index, .. } => Some((*turn, *index)),
            _ => None,
        };
        if let Some(note) = self
            .pictures
            .as_mut()
            .and_then(|p| p.bounds.note_before(picture_of))
        {
            self.rule(&note)?;
        }
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
                turn,
                index,
                file,
                mime,
                bytes,
                href,
            } => {
                self.rule(&format!(
                    "picture {} · {mime} · {}",
                    tandem_protocol::files::shown(file),
                    size(*bytes)
                ))?;
                let Some(p) = self.pictures.as_mut() else {
                    return Ok(());
                };
                // Only what will be read and decoded counts against the bounds on pictures.
                let escapes = if mime != "image/png" {
                    Err(crate::picture::Refused::Type)
                } else if *bytes > crate::picture::MAX_BYTES {
                    Err(crate::picture::Refused::Unread)
                } else {
                    p.bounds.try_one((*turn, *index))
                };
                let escapes = escapes
                    .and_then(|()| {
                        (p.source)(file, href.as_deref()).ok_or(crate::picture::Refused::Unread)
                    })
                    .and_then(|data| crate::picture::check(&data, mime))
                    .and_then(|picture| {
                        p.protocol
                            .encode(&picture, p.tmux)
                            .ok_or(crate::picture::Refused::Broken)
                    })
                    .and_then(|escapes| p.bounds.send(escapes.len()).map(|()| escapes));
                match escapes {
                    Ok(escapes) => {
                        self.inert.interrupt();
                        self.out.write_all(&escapes)?;
                        self.at_line_start = true;
                    }
                    Err(why) => p.bounds.leave_out(why),
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
                check,
                cost,
                budget,
                answer,
                answer_from,
                no_answer,
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
                match (answer.as_deref().map(str::trim), answer_from) {
                    (Some(answer), from) if !answer.is_empty() => {
                        self.answer = Some(answer.to_owned());
                        if *from == Some(tandem_protocol::AnswerFrom::Output) {
                            self.rule("answer: what the code printed")?;
                        }
                        self.text(&format!("{answer}\n"))
                    }
                    _ => match no_answer {
                        Some(why) => self.rule(&format!("no answer: {why}")),
                        None => Ok(()),
                    },
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
        StopReason::Answered => "done: answered",
        StopReason::ExamplesHeld => "done: the task's examples hold",
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
