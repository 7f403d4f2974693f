//! The task's final answer: asking for it in one line, holding it to what the code printed,
//! and the value an output schema asks it to end with.
use std::sync::atomic::Ordering;

use tandem_protocol::StopReason;

use super::history::printed_of;
use super::run::{Ctx, Ended, SchemaStep};
use crate::extract::extract_code_blocks;
use crate::team::{Node, Said};

impl Ctx<'_> {
    /// What the pair's model is asked after a clean run: the answer in one line.
    pub(super) fn answer_ask(&self) -> String {
        match self.team.words.first() {
            Some(word) => format!(
                "If this answers the task, write the answer as `Answer: ...` in one line, then {word}; if not, send the next code."
            ),
            None => "If this answers the task, write the answer as `Answer: ...` in one line; if not, send the next code.".to_owned(),
        }
    }

    /// Where the statement that would end the task disagrees with what its code last printed
    /// cleanly: what to tell the model, once per task, before the task may end.
    pub(super) fn ungrounded(&self, node: &Node, history: &[Said]) -> Option<String> {
        if node.path != self.team.root.path || self.shared.answer.told() {
            return None;
        }
        let said = history
            .iter()
            .rev()
            .find(|s| !s.output && s.speaker != "user")?;
        let statement = crate::grounding::statement(&said.text, &self.team.words);
        // A statement without a number is not told: the answer is then what the code printed.
        if crate::grounding::numbers(&statement).is_empty() {
            return None;
        }
        let printed = printed_of(history)?;
        let differs = crate::grounding::disagreement(&printed, &statement)?;
        self.shared.answer.tell();
        let word = self
            .team
            .words
            .first()
            .map(|w| format!(", then {w}"))
            .unwrap_or_default();
        Some(format!(
            "{differs} {} Write the answer as your code found it, as `Answer: ...` in one line{word}.",
            crate::grounding::TOLD_MARK
        ))
    }

    /// The output schema, when `node` is the chat whose end is the task's.
    pub(super) fn schema_at(&self, node: &Node) -> Option<&crate::schema::OutputSchema> {
        (node.path == self.team.root.path)
            .then_some(self.team.output_schema.as_deref())
            .flatten()
    }

    /// The value the task's final answer ends with: in the last message that is not output,
    /// else in the output of its code (small models print the answer, then say the word).
    pub(super) fn final_value(
        &self,
        schema: &crate::schema::OutputSchema,
        history: &[Said],
    ) -> Result<serde_json::Value, String> {
        let answer = history
            .iter()
            .rev()
            .find(|s| !s.output && s.speaker != "user");
        let said = answer.map(|s| schema.take(&self.without_words(&s.text)));
        match said {
            Some(Ok(value)) => Ok(value),
            other => {
                let output = history
                    .iter()
                    .rev()
                    .take_while(|s| s.output)
                    .find_map(|s| schema.take(&s.text).ok());
                output.ok_or_else(|| {
                    other
                        .and_then(Result::err)
                        .unwrap_or_else(|| schema.take("").err().unwrap_or_default())
                })
            }
        }
    }

    /// Tells the member who answered last `why` its answer is not the task's result, as the
    /// chat's executor's reply, so that it answers next; its index, or `None` when the chat
    /// has no executor to say it.
    pub(super) fn ask_again(
        &self,
        node: &Node,
        executors: &[usize],
        history: &mut Vec<Said>,
        why: String,
    ) -> Option<usize> {
        let last = history.iter().rev().find(|s| !s.output)?.speaker.clone();
        let speaker = node.members.iter().position(|m| m.name == last)?;
        let executor = &node.members[*executors.first()?];
        let turn = self.shared.turns.load(Ordering::SeqCst);
        self.reported(executor, history, turn, why, Vec::new());
        Some(speaker)
    }

    pub(super) fn keep_result(&self, value: serde_json::Value) {
        self.shared.answer.keep(value);
    }

    /// With an output schema, an answer without a program that ends with a matching value
    /// is the task's end, whether or not it says the word; a block of data that is not the
    /// value is an answer to correct now.
    pub(super) fn schema_answer(
        &self,
        node: &Node,
        new: &[Said],
        executors: &[usize],
        history: &mut Vec<Said>,
    ) -> SchemaStep {
        let Some(schema) = self.schema_at(node) else {
            return SchemaStep::On;
        };
        let Some(said) = new.iter().rev().find(|s| !s.output && !self.programs(s)) else {
            return SchemaStep::On;
        };
        match schema.take(&self.without_words(&said.text)) {
            Ok(value) => {
                self.keep_result(value);
                let by = "the answer matches the output schema".to_owned();
                self.ended(node, by.clone());
                let reason = if self
                    .team
                    .words
                    .iter()
                    .any(|w| crate::termination::says_terminate(&said.text, w))
                {
                    StopReason::Terminated
                } else {
                    StopReason::Answered
                };
                SchemaStep::End(Ended::Finished { by, reason })
            }
            Err(why) if !extract_code_blocks(&said.text).is_empty() => self
                .ask_again(node, executors, history, why)
                .map_or(SchemaStep::On, SchemaStep::Again),
            Err(_) => SchemaStep::On,
        }
    }

    /// Before a chat ends on an answer (`reason`): an answer its own code's output
    /// contradicts is told so, once; the output schema's value is taken from it, or the
    /// model asked again. The member asked again, when one is.
    pub(super) fn before_answer_ends(
        &self,
        node: &Node,
        executors: &[usize],
        history: &mut Vec<Said>,
        reason: StopReason,
    ) -> Option<usize> {
        if !matches!(reason, StopReason::Terminated | StopReason::Answered) {
            return None;
        }
        if let Some(why) = self.ungrounded(node, history)
            && let Some(speaker) = self.ask_again(node, executors, history, why)
        {
            return Some(speaker);
        }
        let schema = self.schema_at(node)?;
        match self.final_value(schema, history) {
            Ok(value) => {
                self.keep_result(value);
                None
            }
            Err(why) => self.ask_again(node, executors, history, why),
        }
    }
}
