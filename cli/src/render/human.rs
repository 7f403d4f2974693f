//! The transcript a person reads: rules between the parts, the model's text and the code's
//! output as they stream, made inert, pictures inline where the terminal shows them.

use std::io::{self, Write};

use tandem_protocol::{
    AnswerFrom, BlockResult, BudgetReached, CheckOutcome, Decision, ErrorInfo, EventMsg,
    OutputStream, StopReason, Usage,
};

use super::{Pictures, Shown, Transcript, result_and_usage, size};

/// What the human transcript keeps between events.
pub(super) struct Human {
    color: bool,
    /// Whether streamed text was shown for the current turn (non-streaming servers send none).
    streamed: bool,
    at_line_start: bool,
    shown: Shown,
    /// What a model or a program wrote is made inert as it streams.
    inert: crate::inert::Inert,
    /// Where the task runs ("in this process", "on the daemon at ..."), for the header.
    place: Option<String>,
    /// How pictures are shown inline, when they are.
    pictures: Option<Pictures>,
    /// The task's answer, told again below the list of kept files so it stays last.
    answer: Option<String>,
}

impl Human {
    pub(super) fn new(color: bool) -> Self {
        Self {
            color,
            streamed: false,
            at_line_start: true,
            shown: Shown::default(),
            inert: crate::inert::Inert::default(),
            place: None,
            pictures: None,
            answer: None,
        }
    }

    /// Writes text a model, a program or the task's files may have chosen: inert, its
    /// control characters shown as escapes.
    fn text(&mut self, out: &mut dyn Write, s: &str) -> io::Result<()> {
        let s = self.inert.piece(s);
        if !s.is_empty() {
            out.write_all(s.as_bytes())?;
            self.at_line_start = s.ends_with('\n');
        }
        Ok(())
    }

    /// [`Human::text`], then a newline unless it ended with one.
    fn text_line(&mut self, out: &mut dyn Write, s: &str) -> io::Result<()> {
        self.text(out, s)?;
        self.text(out, if s.ends_with('\n') { "" } else { "\n" })
    }

    /// Writes what the transcript says itself, its own colours included.
    fn raw(&mut self, out: &mut dyn Write, s: &str) -> io::Result<()> {
        self.inert.interrupt();
        if !s.is_empty() {
            out.write_all(s.as_bytes())?;
            self.at_line_start = s.ends_with('\n');
        }
        Ok(())
    }

    fn rule(&mut self, out: &mut dyn Write, label: &str) -> io::Result<()> {
        self.rule_at(out, "", label)
    }

    /// A rule on a line of its own, after `indent`.
    /// The label may hold what a model or a program said (a reason, an error): it is shown
    /// on the rule's one line, inert.
    fn rule_at(&mut self, out: &mut dyn Write, indent: &str, label: &str) -> io::Result<()> {
        if !self.at_line_start {
            self.raw(out, "\n")?;
        }
        let label = crate::inert::line(label);
        let line = if self.color {
            format!("{indent}\x1b[2m── {label} ──\x1b[0m\n")
        } else {
            format!("{indent}── {label} ──\n")
        };
        self.raw(out, &line)
    }

    fn output(&mut self, out: &mut dyn Write, stream: OutputStream, text: &str) -> io::Result<()> {
        match stream {
            OutputStream::Stderr if self.color && !text.is_empty() => {
                let text = self.inert.piece(text);
                out.write_all(format!("\x1b[31m{text}\x1b[0m").as_bytes())?;
                self.at_line_start = text.ends_with('\n');
                Ok(())
            }
            _ => self.text(out, text),
        }
    }

    fn task_started(
        &mut self,
        out: &mut dyn Write,
        model: &str,
        base_url: &str,
        executor: &str,
        trace: Option<&str>,
    ) -> io::Result<()> {
        let place = self
            .place
            .as_deref()
            .map_or(String::new(), |p| format!(" · {p}"));
        let trace = trace
            .and_then(tandem_protocol::trace_id_of)
            .map_or(String::new(), |id| format!(" · trace {id}"));
        self.rule(
            out,
            &format!("tandem · model {model} at {base_url} · executor {executor}{place}{trace}"),
        )
    }

    fn turn_started(
        &mut self,
        out: &mut dyn Write,
        turn: u32,
        agent: Option<&str>,
    ) -> io::Result<()> {
        self.streamed = false;
        match agent {
            None => self.rule(out, &format!("assistant · turn {turn}")),
            Some(agent) => {
                let (indent, name) = speaker(agent);
                self.rule_at(out, &indent, &format!("{name} · turn {turn}"))
            }
        }
    }

    fn model_retry(
        &mut self,
        out: &mut dyn Write,
        attempt: u32,
        delay_ms: u64,
        reason: &str,
    ) -> io::Result<()> {
        self.streamed = false;
        self.rule(
            out,
            &format!(
                "model call failed ({reason}); retry {attempt} in {:.1} s",
                delay_ms as f64 / 1000.0
            ),
        )
    }

    fn replies_drawn(
        &mut self,
        out: &mut dyn Write,
        drawn: u32,
        chosen: u32,
        held: u32,
        examples: u32,
    ) -> io::Result<()> {
        let kept = match chosen {
            0 => "kept this one".to_owned(),
            n => {
                // The text streamed above is not the reply run: the kept one is shown.
                self.streamed = false;
                format!("kept drawn reply {n}, below")
            }
        };
        let replies = if drawn == 1 { "reply" } else { "replies" };
        self.rule(
            out,
            &format!(
                "the task's examples do not all hold against its code: drew {drawn} more {replies}; {kept}, which holds {held} of {examples}"
            ),
        )
    }

    fn assistant_message(&mut self, out: &mut dyn Write, text: &str) -> io::Result<()> {
        if !self.streamed {
            self.text(out, text)?;
        }
        if self.at_line_start {
            Ok(())
        } else {
            self.text(out, "\n")
        }
    }

    fn code_block(
        &mut self,
        out: &mut dyn Write,
        index: u32,
        language: Option<&str>,
    ) -> io::Result<()> {
        self.shown.clear();
        let lang = language.unwrap_or("untagged");
        self.rule(out, &format!("block {index} · {lang}"))
    }

    fn approval_requested(
        &mut self,
        out: &mut dyn Write,
        n: u32,
        rule: Option<&str>,
        reason: &str,
    ) -> io::Result<()> {
        let by = rule.map(|r| format!(" (rule `{r}`)")).unwrap_or_default();
        self.rule(out, &format!("approval {n} asked{by}: {reason}"))
    }

    #[allow(clippy::too_many_arguments)]
    fn approval_decided(
        &mut self,
        out: &mut dyn Write,
        n: u32,
        decision: Decision,
        by: &str,
        code: Option<&str>,
        reason: Option<&str>,
        rule: Option<&str>,
    ) -> io::Result<()> {
        let what = match (decision, code.is_some()) {
            (Decision::Approve, true) => "approved, edited",
            (Decision::Approve, false) => "approved",
            (Decision::Deny, _) => "denied",
        };
        let by = match rule {
            Some(rule) => format!("rule `{rule}`"),
            None => by.to_owned(),
        };
        let why = reason.map(|r| format!(": {r}")).unwrap_or_default();
        let label = if n == 0 {
            format!("{what} by {by}{why}")
        } else {
            format!("approval {n} {what} by {by}{why}")
        };
        self.rule(out, &label)?;
        match code {
            Some(code) => self.text_line(out, code),
            None => Ok(()),
        }
    }

    fn exec_output(
        &mut self,
        out: &mut dyn Write,
        stream: OutputStream,
        text: &str,
    ) -> io::Result<()> {
        self.shown.push(stream, text);
        self.output(out, stream, text)
    }

    fn exec_result(&mut self, out: &mut dyn Write, result: &BlockResult) -> io::Result<()> {
        for stream in [OutputStream::Stdout, OutputStream::Stderr] {
            let rest = self.shown.rest(stream, result);
            self.output(out, stream, rest)?;
        }
        self.rule(out, &result_and_usage(result))
    }

    #[allow(clippy::too_many_arguments)]
    fn artifact(
        &mut self,
        out: &mut dyn Write,
        turn: u32,
        index: u32,
        file: &str,
        mime: &str,
        bytes: u64,
        href: Option<&str>,
    ) -> io::Result<()> {
        self.rule(
            out,
            &format!(
                "picture {} · {mime} · {}",
                tandem_protocol::files::shown(file),
                size(bytes)
            ),
        )?;
        let Some(p) = self.pictures.as_mut() else {
            return Ok(());
        };
        // Only what will be read and decoded counts against the bounds on pictures.
        let escapes = if mime != "image/png" {
            Err(crate::picture::Refused::Type)
        } else if bytes > crate::picture::MAX_BYTES {
            Err(crate::picture::Refused::Unread)
        } else {
            p.bounds.try_one((turn, index))
        };
        let escapes = escapes
            .and_then(|()| (p.source)(file, href).ok_or(crate::picture::Refused::Unread))
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
                out.write_all(&escapes)?;
                self.at_line_start = true;
            }
            Err(why) => p.bounds.leave_out(why),
        }
        Ok(())
    }

    fn tool_call(&mut self, out: &mut dyn Write, name: &str, arguments: &str) -> io::Result<()> {
        self.shown.clear();
        self.rule(out, &format!("call {name}"))?;
        // The code of an `execute_code` call is shown as code, not as JSON.
        let code = (name == tandem_protocol::tools::EXECUTE_CODE)
            .then(|| serde_json::from_str::<serde_json::Value>(arguments).ok())
            .flatten()
            .and_then(|v| v.get("code").and_then(|c| c.as_str()).map(str::to_owned));
        let shown = code.as_deref().unwrap_or(arguments);
        self.text_line(out, shown)
    }

    fn tool_result(
        &mut self,
        out: &mut dyn Write,
        name: &str,
        result: &str,
        is_error: bool,
        duration_ms: u64,
    ) -> io::Result<()> {
        // An `execute_code` call's output was shown as a block's.
        if name == tandem_protocol::tools::EXECUTE_CODE {
            return Ok(());
        }
        let how = if is_error { "failed" } else { "answered" };
        self.rule(out, &format!("{name} {how} · {duration_ms} ms"))?;
        self.text(out, result)?;
        self.text(
            out,
            if result.ends_with('\n') || result.is_empty() {
                ""
            } else {
                "\n"
            },
        )
    }

    fn executor_message(&mut self, out: &mut dyn Write, text: &str) -> io::Result<()> {
        // Output was shown live; only the executor's own words are worth repeating.
        if !text.is_empty() && !text.starts_with("exitcode:") {
            self.rule(out, "executor")?;
            self.text(out, text)?;
            self.text(out, "\n")?;
        } else if let Some(at) = tandem_agent::examples::note_in(text) {
            // What the examples said is the model's reason to go on or stop, and was never
            // shown live.
            self.rule(out, "the task's examples")?;
            self.text(out, &text[at..])?;
            self.text(out, "\n")?;
        }
        Ok(())
    }

    fn task_finished(&mut self, out: &mut dyn Write, end: Finished<'_>) -> io::Result<()> {
        if let Some(e) = end.error {
            self.rule(out, &format!("error: {}", e.message))?;
        }
        if let Some(b) = end.budget {
            self.rule(out, &format!("budget: {}", b.message()))?;
        }
        let turns = end.turns;
        self.rule(
            out,
            &format!(
                "{} · {turns} turn{} · {} in / {} out tokens{} · {:.1} s",
                stop_label(end.stop_reason),
                if turns == 1 { "" } else { "s" },
                end.usage.prompt_tokens,
                end.usage.completion_tokens,
                end.cost
                    .filter(|c| *c > 0.0)
                    .map(|c| format!(" · cost {c:.4}"))
                    .unwrap_or_default(),
                end.elapsed_ms as f64 / 1000.0
            ),
        )?;
        if let Some(check) = end.check {
            let detail = check.gist();
            let sep = if detail.is_empty() { "" } else { ": " };
            self.rule(
                out,
                &format!("check {}{sep}{detail}", check.verdict.as_str()),
            )?;
        }
        // The answer last, where `| tail` and a person's eye find it.
        match (end.answer.map(str::trim), end.answer_from) {
            (Some(answer), from) if !answer.is_empty() => {
                self.answer = Some(answer.to_owned());
                if from == Some(AnswerFrom::Output) {
                    self.rule(out, "answer: what the code printed")?;
                }
                self.text(out, &format!("{answer}\n"))
            }
            _ => match end.no_answer {
                Some(why) => self.rule(out, &format!("no answer: {why}")),
                None => Ok(()),
            },
        }
    }
}

/// What the last event of a task says, as the transcript shows it.
struct Finished<'a> {
    stop_reason: StopReason,
    turns: u32,
    usage: &'a Usage,
    elapsed_ms: u64,
    error: Option<&'a ErrorInfo>,
    check: Option<&'a CheckOutcome>,
    cost: Option<f64>,
    budget: Option<&'a BudgetReached>,
    answer: Option<&'a str>,
    answer_from: Option<AnswerFrom>,
    no_answer: Option<&'a str>,
}

impl Transcript for Human {
    fn event(&mut self, out: &mut dyn Write, _seq: u64, msg: &EventMsg) -> io::Result<()> {
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
            self.rule(out, &note)?;
        }
        match msg {
            EventMsg::TaskStarted {
                model,
                base_url,
                executor,
                trace,
                ..
            } => self.task_started(out, model, base_url, executor, trace.as_deref()),
            EventMsg::TurnStarted { turn, agent } => self.turn_started(out, *turn, agent.as_deref()),
            EventMsg::TeamEnded { agent, by } => {
                let (indent, name) = speaker(agent);
                self.rule_at(out, &indent, &format!("{name} ended: {by}"))
            }
            EventMsg::AssistantDelta { text, .. } => {
                self.streamed = true;
                self.text(out, text)
            }
            EventMsg::Net(net) => self.rule(out, &net.line()),
            EventMsg::SandboxLost { host, reason, .. } => self.rule(
                out,
                &format!(
                    "the sandbox on {host} was lost ({reason}); running the block again on another host"
                ),
            ),
            EventMsg::ModelRetry {
                attempt,
                delay_ms,
                reason,
                ..
            } => self.model_retry(out, *attempt, *delay_ms, reason),
            EventMsg::RepliesDrawn {
                drawn,
                chosen,
                held,
                examples,
                ..
            } => self.replies_drawn(out, *drawn, *chosen, *held, *examples),
            EventMsg::AssistantMessage { text, .. } => self.assistant_message(out, text),
            EventMsg::CodeBlock {
                index, language, ..
            } => self.code_block(out, *index, language.as_deref()),
            EventMsg::ApprovalRequested {
                n, rule, reason, ..
            } => self.approval_requested(out, *n, rule.as_deref(), reason),
            EventMsg::ApprovalDecided {
                n,
                decision,
                by,
                code,
                reason,
                rule,
                ..
            } => self.approval_decided(
                out,
                *n,
                *decision,
                by,
                code.as_deref(),
                reason.as_deref(),
                rule.as_deref(),
            ),
            EventMsg::ExecOutput { text, stream, .. } => self.exec_output(out, *stream, text),
            EventMsg::ExecResult { result, .. } => self.exec_result(out, result),
            EventMsg::Artifact {
                turn,
                index,
                file,
                mime,
                bytes,
                href,
            } => self.artifact(out, *turn, *index, file, mime, *bytes, href.as_deref()),
            EventMsg::FileSaved { file, bytes, .. } => self.text(
                out,
                &format!(
                    "{:>10}  {}\n",
                    size(*bytes),
                    tandem_protocol::files::shown(file)
                ),
            ),
            EventMsg::ToolCall {
                name, arguments, ..
            } => self.tool_call(out, name, arguments),
            EventMsg::ToolResult {
                name,
                result,
                is_error,
                duration_ms,
                ..
            } => self.tool_result(out, name, result, *is_error, *duration_ms),
            EventMsg::ExecutorMessage { text, .. } => self.executor_message(out, text),
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
            } => self.task_finished(
                out,
                Finished {
                    stop_reason: *stop_reason,
                    turns: *turns,
                    usage,
                    elapsed_ms: *elapsed_ms,
                    error: error.as_ref(),
                    check: check.as_deref(),
                    cost: *cost,
                    budget: budget.as_deref(),
                    answer: answer.as_deref(),
                    answer_from: *answer_from,
                    no_answer: no_answer.as_deref(),
                },
            ),
        }
    }

    fn set_place(&mut self, place: String) {
        self.place = Some(place);
    }

    fn set_pictures(&mut self, pictures: Option<Pictures>) {
        self.pictures = pictures;
    }

    fn kept_before(&mut self, out: &mut dyn Write, kept: &crate::keep::Kept) -> io::Result<()> {
        if let (Some(dir), false) = (&kept.dir, kept.saved.is_empty()) {
            let label = format!(
                "files kept in {}",
                tandem_protocol::files::shown(&dir.display().to_string())
            );
            self.rule(out, &label)?;
        }
        Ok(())
    }

    fn kept_after(
        &mut self,
        out: &mut dyn Write,
        kept: &crate::keep::Kept,
        max_mb: u64,
        how: &str,
    ) -> io::Result<()> {
        if !kept.over.is_empty() {
            let bytes: u64 = kept.over.iter().map(|f| f.bytes).sum();
            let n = kept.over.len();
            let label = format!(
                "{n} file{} ({}) not kept, over --out-max-mb {max_mb}: {how}",
                if n == 1 { "" } else { "s" },
                size(bytes)
            );
            self.rule(out, &label)?;
        }
        // The answer stays the transcript's last line, below the list of files.
        let listed = !kept.saved.is_empty() || !kept.over.is_empty();
        if let (true, Some(answer)) = (listed, self.answer.clone()) {
            self.rule(out, "answer")?;
            self.text(out, &format!("{answer}\n"))?;
        }
        Ok(())
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
