//! The code in a message: what an executor runs for it (its blocks and its calls) and what
//! is only a way of saying a termination word.

use tandem_protocol::ToolCall;

use super::history::Said;
use super::run::Ctx;
use crate::extract::{CodeBlock, extract_code_blocks};
use crate::termination::is_termination_block;

impl Ctx<'_> {
    /// What an executor does for `said`: its calls (native, else written as text when its
    /// speaker has tools) and the blocks to run.
    pub(super) fn work(&self, said: &Said) -> (Vec<ToolCall>, Vec<CodeBlock>) {
        let mut blocks = self.runnable(&said.text);
        if !said.calls.is_empty() {
            return (said.calls.clone(), blocks);
        }
        let Some(tools) = self.team.tools(&said.speaker) else {
            return (Vec::new(), blocks);
        };
        let calls =
            crate::tools::calls::calls_in_text(&said.text, &|name| tools.get(name).is_some());
        if !calls.is_empty() {
            // A call written as a fenced block of JSON is the call, not code to run.
            blocks.retain(|b| !crate::tools::calls::is_json(&b.code));
        }
        (calls, blocks)
    }

    /// The blocks of `text` an executor runs: all but those holding only a termination word.
    pub(super) fn runnable(&self, text: &str) -> Vec<CodeBlock> {
        let mut code = extract_code_blocks(text);
        code.retain(|b| {
            !self
                .team
                .words
                .iter()
                .any(|w| is_termination_block(&b.code, w))
        });
        code
    }

    /// Whether `said` has a program for an executor: a call, or a block that is not data
    /// (the ```json block of an answer is data).
    pub(super) fn programs(&self, said: &Said) -> bool {
        super::termination::programs(said, &self.team.words)
    }

    /// `text` with every termination word taken out.
    pub(super) fn without_words(&self, text: &str) -> String {
        self.team.words.iter().fold(text.to_owned(), |t, w| {
            crate::termination::strip_termination(&t, w)
        })
    }

    /// Whether the last of `new` is a member's message with code for an executor.
    pub(super) fn has_code(&self, new: &[Said]) -> bool {
        new.last().is_some_and(|s| {
            let (calls, code) = self.work(s);
            !s.output && (!code.is_empty() || !calls.is_empty())
        })
    }
}
