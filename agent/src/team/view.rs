//! What an agent sees: its instructions, the task, and the shared history told from its
//! side (its own messages as `assistant`, everyone else's as `user` with their names).

use tandem_protocol::{Message, Role};

use super::history::Said;
use super::run::Ctx;
use crate::team::Node;

impl Ctx<'_> {
    /// What `node` sees: its instructions, the task, then the history through its hooks.
    pub(super) fn view(&self, node: &Node, history: &[Said]) -> Vec<Message> {
        let spec = &node.spec;
        let mut messages = vec![Message::new(Role::System, self.instructions(node))];
        let keep = spec.keep_last.unwrap_or(usize::MAX);
        let rest = history.get(1..).unwrap_or_default();
        let kept: Vec<&Said> = history
            .iter()
            .take(1)
            .chain(rest.iter().skip(rest.len().saturating_sub(keep)))
            .collect();
        let redact = self.team.members.get(&node.path).map(|m| &m.redact);
        let clean = |text: &str, output: bool| {
            let mut text = text.to_owned();
            if output && let Some(cap) = spec.max_output_bytes {
                text = crate::grounding::clip(&text, cap);
            }
            for re in redact.into_iter().flatten() {
                text = re.replace_all(&text, "[redacted]").into_owned();
            }
            text
        };
        for i in 0..kept.len() {
            tell(&mut messages, &node.name, &kept, i, &clean);
        }
        messages
    }

    /// `node`'s instructions, and how it runs code when it has the `execute_code` tool.
    fn instructions(&self, node: &Node) -> String {
        let spec = &node.spec;
        let instructions = spec.instructions.clone().unwrap_or_else(|| {
            format!(
                "You are {}, one member of a team working on the task below.{}",
                node.name,
                spec.description
                    .as_deref()
                    .map(|d| format!(" Your part: {d}."))
                    .unwrap_or_default()
            )
        });
        let instructions = match &self.team.note {
            Some(note) => format!("{}\n\n{note}", instructions.trim_end()),
            None => instructions,
        };
        match self.team.tools(&node.name).map(|t| t.code_via) {
            Some(tandem_protocol::CodeVia::Tool) => format!(
                "{}\n- Run code by calling the `execute_code` tool; its result is the program's exit code and output.",
                instructions.trim_end()
            ),
            Some(tandem_protocol::CodeVia::Auto) => format!(
                "{}\n- You can run code by calling the `execute_code` tool, or in fenced blocks.",
                instructions.trim_end()
            ),
            _ => instructions,
        }
    }
}

/// The `i`th of the `kept` messages, as the agent `name` is told it, onto `messages`;
/// `clean` is what its text and outputs pass through.
fn tell(
    messages: &mut Vec<Message>,
    name: &str,
    kept: &[&Said],
    i: usize,
    clean: &dyn Fn(&str, bool) -> String,
) {
    let said = kept[i];
    let own = said.speaker == name;
    // The chat APIs take calls only with an answer to each right after them: this agent's
    // calls answered by the next message are native, all else is told as text.
    let answered = own
        && !said.calls.is_empty()
        && kept.get(i + 1).is_some_and(|next| {
            said.calls
                .iter()
                .map(|c| &c.id)
                .eq(next.results.iter().map(|r| &r.id))
        });
    let native_results = !said.results.is_empty()
        && i > 0
        && kept[i - 1].speaker == name
        && kept[i - 1]
            .calls
            .iter()
            .map(|c| &c.id)
            .eq(said.results.iter().map(|r| &r.id));
    let mut text = clean(&said.text, said.output);
    if !answered {
        for call in &said.calls {
            text.push_str(&format!(
                "{}[called tool `{}` with {}]",
                if text.is_empty() { "" } else { "\n" },
                call.name,
                call.arguments
            ));
        }
    }
    if native_results {
        for reply in &said.results {
            let mut tool = Message::tool(reply);
            tool.content = clean(&reply.content, true);
            messages.push(tool);
        }
        if text.is_empty() {
            return;
        }
    } else {
        for reply in &said.results {
            text.push_str(&format!(
                "{}[tool `{}` answered]\n{}",
                if text.is_empty() { "" } else { "\n" },
                reply.name,
                clean(&reply.content, true)
            ));
        }
    }
    let mut message = if own {
        Message::new(Role::Assistant, text)
    } else {
        Message::new(Role::User, text)
    };
    if answered {
        message.tool_calls = said.calls.clone();
    }
    if !own && said.speaker != "user" {
        message.name = Some(said.speaker.clone());
    }
    messages.push(message);
}
