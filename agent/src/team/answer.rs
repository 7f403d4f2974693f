//! The task's final answer: asking for it in one line, holding it to what the code printed,
//! and the value an output schema asks it to end with.
use std::sync::atomic::Ordering;

use super::run::{Ctx, printed_of};
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
        if node.path != self.team.root.path || self.shared.grounded.load(Ordering::SeqCst) {
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
        self.shared.grounded.store(true, Ordering::SeqCst);
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
        if let Ok(mut r) = self.shared.result.lock() {
            *r = Some(value);
        }
    }
}
