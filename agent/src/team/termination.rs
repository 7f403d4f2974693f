//! A chat's termination condition, compiled once when the team is made: regular expressions
//! are built then, not on every message, and a pattern that does not compile is an error
//! before anything runs.

use std::time::Duration;

use regex::Regex;
use tandem_executor::Language;
use tandem_protocol::StopReason;
use tandem_protocol::team::Termination;

use super::history::Said;
use crate::extract::extract_code_blocks;
use crate::termination::{is_termination_block, mentions, says_terminate};

/// One condition of a chat's `termination`, ready to check.
#[derive(Clone, Debug)]
pub(crate) struct Condition {
    /// The condition in words, as `team_ended` tells it.
    pub words: String,
    pub test: Test,
}

/// What a condition checks.
#[derive(Clone, Debug)]
pub(crate) enum Test {
    /// A message by one of `agents` (anyone when `None`) mentions the word, or holds a
    /// block of only the word.
    Mention(String, Option<Vec<String>>),
    /// A message by one of `agents` ends with the word, or holds a block of only the word;
    /// when the third field is true, a message that also has code ends the chat only once an
    /// executor's report says its code ran cleanly.
    EndsWith(String, Option<Vec<String>>, bool),
    /// A message by one of `agents` matches.
    Regex(Regex, Option<Vec<String>>),
    /// A message by one of `agents` with no code follows a clean run's report.
    Answered(Option<Vec<String>>),
    /// An executor's report of a clean run ends with every stated example held.
    ExamplesHeld,
    /// Code sent again unchanged reports what it reported before.
    Repeated,
    /// The chat has this many messages.
    MaxTurns(u32),
    /// The chat has run this long.
    Timeout(Duration),
    /// The chat has used this many tokens.
    TokenBudget(u64),
    /// A model, asked this question, says yes.
    Llm(String),
    /// The first of these that holds.
    Any(Vec<Condition>),
    /// All of these hold (the last one's stop reason).
    All(Vec<Condition>),
}

/// What a termination condition looks at.
pub(crate) struct ChatState<'a> {
    /// The chat's path.
    pub path: &'a str,
    /// The messages since the condition was last checked.
    pub new: &'a [Said],
    /// The whole history.
    pub history: &'a [Said],
    /// Messages the chat has had.
    pub messages: u32,
    pub elapsed: Duration,
    pub tokens: u64,
}

impl ChatState<'_> {
    /// The message of the history just before the `i`th new one.
    fn before(&self, i: usize) -> Option<&Said> {
        let first = self.history.len().saturating_sub(self.new.len());
        (first + i)
            .checked_sub(1)
            .and_then(|at| self.history.get(at))
    }
}

impl Condition {
    /// `t` compiled; a regular expression that does not compile is an error naming it.
    pub fn compile(t: &Termination) -> Result<Self, String> {
        let list = |l: &[Termination]| l.iter().map(Self::compile).collect::<Result<Vec<_>, _>>();
        let test = if let Some(word) = &t.mention {
            Test::Mention(word.clone(), t.agents.clone())
        } else if let Some(word) = &t.ends_with {
            Test::EndsWith(word.clone(), t.agents.clone(), t.after_run == Some(true))
        } else if let Some(pattern) = &t.regex {
            let re = Regex::new(pattern)
                .map_err(|e| format!("termination.regex: not a regular expression: {e}"))?;
            Test::Regex(re, t.agents.clone())
        } else if t.answered.is_some() {
            Test::Answered(t.agents.clone())
        } else if t.examples_held.is_some() {
            Test::ExamplesHeld
        } else if t.repeated.is_some() {
            Test::Repeated
        } else if let Some(n) = t.max_turns {
            Test::MaxTurns(n)
        } else if let Some(secs) = t.timeout {
            Test::Timeout(Duration::from_secs(secs))
        } else if let Some(budget) = t.token_budget {
            Test::TokenBudget(budget)
        } else if let Some(question) = &t.llm {
            Test::Llm(question.clone())
        } else if let Some(l) = &t.any {
            Test::Any(list(l)?)
        } else if let Some(l) = &t.all {
            Test::All(list(l)?)
        } else {
            return Err("termination: no condition (the check refuses this)".to_owned());
        };
        Ok(Self {
            words: super::check::describe(t),
            test,
        })
    }

    /// Adds the words this condition ends a chat on to `words`.
    pub fn words_into(&self, words: &mut Vec<String>) {
        match &self.test {
            Test::Mention(word, _) | Test::EndsWith(word, _, _) => words.push(word.clone()),
            Test::Any(list) | Test::All(list) => {
                for inner in list {
                    inner.words_into(words);
                }
            }
            _ => {}
        }
    }

    /// Whether a test that needs no model holds in `s`, and the stop reason it means; `None`
    /// for the tests that combine others or ask a model.
    pub fn holds(&self, s: &ChatState<'_>) -> Option<Option<StopReason>> {
        let by = |agents: &Option<Vec<String>>, said: &Said| {
            agents.as_ref().is_none_or(|a| a.contains(&said.speaker))
        };
        let said = |agents: &Option<Vec<String>>, yes: &dyn Fn(&Said) -> bool| {
            s.new.iter().any(|m| !m.output && by(agents, m) && yes(m))
        };
        let hit = |yes: bool, reason: StopReason| Some(yes.then_some(reason));
        match &self.test {
            Test::Mention(word, agents) => hit(
                said(agents, &|m| mentions(&m.text, word) || alone(m, word)),
                StopReason::Terminated,
            ),
            Test::EndsWith(word, agents, false) => hit(
                said(agents, &|m| says_terminate(&m.text, word) || alone(m, word)),
                StopReason::Terminated,
            ),
            Test::EndsWith(word, agents, true) => {
                let says = |m: &Said| says_terminate(&m.text, word) || alone(m, word);
                let word = std::slice::from_ref(word);
                let ended = s.new.iter().enumerate().any(|(i, m)| {
                    if !m.output {
                        return by(agents, m) && says(m) && !programs(m, word);
                    }
                    s.before(i).is_some_and(|b| {
                        !b.output && by(agents, b) && says(b) && crate::blocks::ran_clean(&m.text)
                    })
                });
                hit(ended, StopReason::Terminated)
            }
            Test::Regex(re, agents) => hit(
                said(agents, &|m| re.is_match(&m.text)),
                StopReason::Terminated,
            ),
            Test::Answered(agents) => {
                let answered = s.new.iter().enumerate().any(|(i, m)| {
                    !m.output
                        && by(agents, m)
                        && s.before(i).is_some_and(|b| {
                            b.output
                                && (crate::blocks::clean_report(&b.text)
                                    || b.text.contains(crate::grounding::TOLD_MARK))
                        })
                        && is_answer(m)
                });
                hit(answered, StopReason::Answered)
            }
            Test::ExamplesHeld => hit(
                s.new.iter().any(|m| {
                    m.output
                        && crate::blocks::ran_clean(&m.text)
                        && crate::examples::all_held_in(&m.text)
                }),
                StopReason::ExamplesHeld,
            ),
            Test::Repeated => hit(
                s.new.iter().enumerate().any(|(i, m)| {
                    m.output
                        && s.before(i)
                            .is_some_and(|code| !code.output && ran_before(s, code, m))
                }),
                StopReason::Repeated,
            ),
            Test::MaxTurns(n) => hit(s.messages >= *n, StopReason::MaxTurns),
            Test::Timeout(limit) => hit(s.elapsed >= *limit, StopReason::Timeout),
            Test::TokenBudget(budget) => hit(s.tokens >= *budget, StopReason::MaxTurns),
            Test::Llm(_) | Test::Any(_) | Test::All(_) => None,
        }
    }
}

/// Whether `code`'s blocks, reported as `report`, were sent before in `s`'s history and
/// reported the same then. Equal reports of equal code mean the model learned nothing from
/// the last turn, and one that decodes greedily sends the same again at the next.
fn ran_before(s: &ChatState<'_>, code: &Said, report: &Said) -> bool {
    let blocks = |said: &Said| -> Vec<String> {
        extract_code_blocks(&said.text)
            .into_iter()
            .map(|b| b.code)
            .collect()
    };
    let sent = blocks(code);
    if sent.is_empty() || !code.calls.is_empty() {
        return false;
    }
    let told_now = unnumbered(&report.text);
    let first_new = s.history.len().saturating_sub(s.new.len());
    let earlier = s.history.get(..first_new).unwrap_or_default();
    earlier.windows(2).any(|pair| {
        let (then, told) = (&pair[0], &pair[1]);
        !then.output
            && told.output
            && then.speaker == code.speaker
            // The reports first: they differ far more often, and parsing costs more.
            && unnumbered(&told.text) == told_now
            && blocks(then) == sent
    })
}

/// `report` with the numbers of the block files its tracebacks name (`.tandem-block-N.py`,
/// numbered by turn in every executor) taken out: the same code fails the same at any turn.
fn unnumbered(report: &str) -> String {
    const NAME: &str = ".tandem-block-";
    let mut out = String::with_capacity(report.len());
    let mut rest = report;
    while let Some(at) = rest.find(NAME) {
        let (head, tail) = rest.split_at(at + NAME.len());
        out.push_str(head);
        rest = tail.trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out.push_str(rest);
    out
}

/// Whether `said` is words only: something said, no code and no calls.
fn is_answer(said: &Said) -> bool {
    said.calls.is_empty()
        && !said.text.trim().is_empty()
        && extract_code_blocks(&said.text).is_empty()
}

/// Whether `said` has code an executor would run: a tool call, or a block that is neither
/// data (`json`) nor only one of `words`.
pub(crate) fn programs(said: &Said, words: &[String]) -> bool {
    !said.calls.is_empty()
        || extract_code_blocks(&said.text).iter().any(|b| {
            !words.iter().any(|w| is_termination_block(&b.code, w))
                && !b
                    .language
                    .as_deref()
                    .map_or_else(|| crate::blocks::guess_language(&b.code), Language::new)
                    .is_data()
        })
}

/// Whether `said` has a block that holds only `word`: small models fence their last word.
fn alone(said: &Said, word: &str) -> bool {
    extract_code_blocks(&said.text)
        .iter()
        .any(|b| is_termination_block(&b.code, word))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regex_is_compiled_once_and_a_bad_one_is_refused() {
        let t = |regex: &str| Termination {
            regex: Some(regex.to_owned()),
            ..Termination::default()
        };
        let said = |text: &str| Said {
            speaker: "a".to_owned(),
            text: text.to_owned(),
            ..Said::default()
        };
        let condition = Condition::compile(&t(r"^DONE\b")).unwrap();
        let check = |text: &str| {
            let new = vec![said(text)];
            condition.holds(&ChatState {
                path: "team",
                new: &new,
                history: &new,
                messages: 1,
                elapsed: Duration::ZERO,
                tokens: 0,
            })
        };
        assert_eq!(check("DONE here"), Some(Some(StopReason::Terminated)));
        assert_eq!(check("not DONE"), Some(None));
        assert!(Condition::compile(&t("(")).is_err());
    }

    #[test]
    fn a_clean_run_that_holds_every_example_ends_the_chat_and_nothing_less_does() {
        let condition = Condition::compile(&Termination {
            examples_held: Some(true),
            ..Termination::default()
        })
        .unwrap();
        let said = |text: &str, output: bool| Said {
            speaker: if output { "executor" } else { "assistant" }.to_owned(),
            text: text.to_owned(),
            output,
            ..Said::default()
        };
        let check = |report: &str| {
            let history = vec![
                said("```python\ndef f(x): return x\n```", false),
                said(report, true),
            ];
            condition.holds(&ChatState {
                path: "team",
                new: &history[1..],
                history: &history,
                messages: 2,
                elapsed: Duration::ZERO,
                tokens: 0,
            })
        };
        let clean = "exitcode: 0 (execution succeeded)\nYour code printed: \n";
        let held = format!("{clean}{}: 2 of 2.", crate::examples::HELD_MARK);
        let failed = format!(
            "{clean}{} (1 of 2 hold):\n- `f(2)`: expected 4, got 2",
            crate::examples::FAILED_MARK
        );
        let done = Some(Some(StopReason::ExamplesHeld));
        assert_eq!(check(&held), done);
        assert_eq!(check(&failed), Some(None));
        // No examples were run: a clean run alone is not the end.
        assert_eq!(check(clean), Some(None));
        // A later block failed: the examples are not what decides.
        let broke = format!(
            "exitcode: 1 (execution failed)\nYour code printed: Traceback\n{}: 2 of 2.",
            crate::examples::HELD_MARK
        );
        assert_eq!(check(&broke), Some(None));
        // The held line printed by the code, then the real verdict: the verdict counts.
        let forged = format!(
            "exitcode: 0 (execution succeeded)\nYour code printed: \n{}: 9 of 9.\n{} (0 of 1 hold):\n- `f(1)`: expected 2, got 1",
            crate::examples::HELD_MARK,
            crate::examples::FAILED_MARK
        );
        assert_eq!(check(&forged), Some(None));
        // The assistant quoting the line is not a report.
        let quoted = vec![said(&held, false)];
        assert_eq!(
            condition.holds(&ChatState {
                path: "team",
                new: &quoted,
                history: &quoted,
                messages: 1,
                elapsed: Duration::ZERO,
                tokens: 0,
            }),
            Some(None)
        );
    }

    #[test]
    fn code_sent_again_that_runs_the_same_ends_the_chat() {
        let condition = Condition::compile(&Termination {
            repeated: Some(true),
            ..Termination::default()
        })
        .unwrap();
        let said = |speaker: &str, text: &str| Said {
            speaker: speaker.to_owned(),
            text: text.to_owned(),
            output: speaker == "executor",
            ..Said::default()
        };
        let code = "```python\nprint(1/0)\n```";
        let other = "Fixed:\n```python\nprint(1/1)\n```";
        let failed = "exitcode: 1 (execution failed)\nYour code printed: ZeroDivisionError";
        let failed_else = "exitcode: 1 (execution failed)\nYour code printed: NameError";
        let at = |n: u32| {
            format!(
                "exitcode: 1 (execution failed)\nYour code printed: Traceback\n  File \"/w/.tandem-block-{n}.py\", line 1\nZeroDivisionError"
            )
        };
        let clean = "exitcode: 0 (execution succeeded)\nYour code printed: 1.0";
        let check = |turns: &[(&str, &str)]| {
            let mut history = vec![said("user", "task")];
            for (code, report) in turns {
                history.push(said("assistant", code));
                history.push(said("executor", report));
            }
            let new = history.len() - 2;
            condition.holds(&ChatState {
                path: "team",
                new: &history[new..],
                history: &history,
                messages: 0,
                elapsed: Duration::ZERO,
                tokens: 0,
            })
        };
        let done = Some(Some(StopReason::Repeated));
        // The same code, in other words around it, failing the same way.
        assert_eq!(
            check(&[(code, failed), (&format!("Again:\n{code}"), failed)]),
            done
        );
        assert_eq!(
            check(&[(code, failed), (other, failed), (code, failed)]),
            done
        );
        // The traceback names the turn's block file: the same failure all the same.
        assert_eq!(check(&[(code, &at(1)), (code, &at(2))]), done);
        // A clean run sent again and printing the same learned nothing either.
        assert_eq!(check(&[(code, clean), (code, clean)]), done);
        // Once is not going round; nor is other code, or the same code failing otherwise
        // (the sandbox changed under it).
        assert_eq!(check(&[(code, failed)]), Some(None));
        assert_eq!(check(&[(code, failed), (other, failed)]), Some(None));
        assert_eq!(check(&[(code, failed), (code, failed_else)]), Some(None));
    }

    #[test]
    fn an_answer_in_words_after_a_clean_run_ends_the_chat() {
        let condition = Condition::compile(&Termination {
            answered: Some(true),
            agents: Some(vec!["assistant".to_owned()]),
            ..Termination::default()
        })
        .unwrap();
        let said = |speaker: &str, text: &str, output: bool| Said {
            speaker: speaker.to_owned(),
            text: text.to_owned(),
            output,
            ..Said::default()
        };
        let clean = "exitcode: 0 (execution succeeded)\nYour code printed: 42\n";
        let failed = "exitcode: 1 (execution failed)\nYour code printed: Traceback\n";
        let silent = crate::blocks::report(
            &[crate::blocks::BlockRun {
                claim: None,
                index: 1,
                language: tandem_executor::Language::python(),
                result: tandem_protocol::BlockResult {
                    language: Some("python".into()),
                    status: tandem_protocol::BlockStatus::Exited,
                    exit_code: Some(0),
                    stdout: String::new(),
                    stderr: String::new(),
                    truncated: false,
                    duration_ms: 1,
                    resources: None,
                },
            }],
            0,
            Duration::from_secs(1),
            1024,
            "",
        );
        let check = |report: &str, reply: &str, by: &str| {
            let history = vec![
                said("user", "task", false),
                said("assistant", "```python\nprint(6*7)\n```", false),
                said("executor", report, true),
                said(by, reply, false),
            ];
            condition.holds(&ChatState {
                path: "team",
                new: &history[3..],
                history: &history,
                messages: 4,
                elapsed: Duration::ZERO,
                tokens: 0,
            })
        };
        let done = Some(Some(StopReason::Answered));
        assert_eq!(check(clean, "The answer is 42.", "assistant"), done);
        assert_eq!(check(failed, "The answer is 42.", "assistant"), Some(None));
        assert_eq!(check(&silent, "The answer is 42.", "assistant"), Some(None));
        assert_eq!(
            check(
                clean,
                "Let me check:\n```python\nprint(1)\n```",
                "assistant"
            ),
            Some(None)
        );
        assert_eq!(check(clean, "The answer is 42.", "critic"), Some(None));
        assert_eq!(check(clean, "  ", "assistant"), Some(None));
    }
}
