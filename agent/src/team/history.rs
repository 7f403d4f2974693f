//! The team's shared history, message by message.

use std::collections::HashMap;

use tandem_protocol::{EventMsg, ToolCall, ToolReply};

/// One message of the team's shared history.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Said {
    /// Who said it: an agent's name, or `user` for the task.
    pub speaker: String,
    /// What was said.
    pub text: String,
    /// Whether it is an executor's report of program output.
    pub output: bool,
    /// An assistant's native tool calls.
    pub calls: Vec<ToolCall>,
    /// An executor's answers to the native calls of the message before it.
    pub results: Vec<ToolReply>,
    /// What the blocks of an executor's report printed to stdout, when every block it ran
    /// exited cleanly.
    pub printed: Option<String>,
}

/// What an agent said in a run being resumed: its words, and its calls or their answers.
pub type Replay = Vec<(String, Said)>;

impl Said {
    /// The chat messages it is for the model that said it (`mine`) or answered by it: an
    /// assistant message with its calls, or the answers to them as `tool` messages and its
    /// report, if any, as a `user` message.
    pub fn to_messages(&self, mine: bool) -> Vec<tandem_protocol::Message> {
        use tandem_protocol::{Message, Role};
        if mine {
            let mut m = Message::new(Role::Assistant, self.text.clone());
            m.tool_calls = self.calls.clone();
            return vec![m];
        }
        let mut out: Vec<Message> = self.results.iter().map(Message::tool).collect();
        if out.is_empty() || !self.text.is_empty() {
            out.push(Message::new(Role::User, self.text.clone()));
        }
        out
    }
}

/// The turns of a two-agent conversation (`messages`, after the task) as what each agent
/// said: an assistant message, then the executor's `tool` answers and report.
pub fn pair_turns(messages: &[tandem_protocol::Message]) -> Vec<(bool, Said)> {
    use tandem_protocol::Role;
    let mut turns: Vec<(bool, Said)> = Vec::new();
    for m in messages {
        match m.role {
            Role::Assistant => turns.push((
                true,
                Said {
                    text: m.content.clone(),
                    calls: m.tool_calls.clone(),
                    ..Said::default()
                },
            )),
            Role::Tool | Role::User | Role::System => {
                if !matches!(turns.last(), Some((false, s)) if s.text.is_empty()) {
                    turns.push((
                        false,
                        Said {
                            output: true,
                            ..Said::default()
                        },
                    ));
                }
                let Some((_, said)) = turns.last_mut() else {
                    continue;
                };
                match (&m.role, &m.tool_call_id) {
                    (Role::Tool, Some(id)) => said.results.push(ToolReply {
                        id: id.clone(),
                        name: String::new(),
                        content: m.content.clone(),
                    }),
                    _ => said.text = m.content.clone(),
                }
            }
        }
    }
    // A tool answer names its tool by the call it answers.
    for i in 1..turns.len() {
        let (before, after) = turns.split_at_mut(i);
        let calls = &before[i - 1].1.calls;
        for r in &mut after[0].1.results {
            if let Some(c) = calls.iter().find(|c| c.id == r.id) {
                r.name = c.name.clone();
            }
        }
    }
    turns
}

/// What a team's stored events say each agent said, in order: the replay for a resume. A
/// turn that was cut off (no message after its `turn_started`) is not in it, so it runs again.
pub fn replay_of(events: &[EventMsg]) -> Replay {
    let mut said = Vec::new();
    // By turn: parallel members' events interleave, and each message names its turn.
    let mut speaking: HashMap<u32, &str> = HashMap::new();
    for e in events {
        match e {
            EventMsg::TurnStarted {
                turn,
                agent: Some(agent),
            } => {
                speaking.insert(*turn, agent);
            }
            EventMsg::AssistantMessage {
                turn,
                text,
                tool_calls,
                ..
            } => {
                if let Some(agent) = speaking.remove(turn) {
                    said.push((
                        agent.to_owned(),
                        Said {
                            text: text.clone(),
                            calls: tool_calls.clone(),
                            ..Said::default()
                        },
                    ));
                }
            }
            EventMsg::ExecutorMessage {
                turn,
                text,
                tool_results,
            } => {
                if let Some(agent) = speaking.remove(turn) {
                    said.push((
                        agent.to_owned(),
                        Said {
                            text: text.clone(),
                            output: true,
                            results: tool_results.clone(),
                            ..Said::default()
                        },
                    ));
                }
            }
            _ => {}
        }
    }
    said
}

/// What the task's code last printed in a clean run: kept with the report, or read back
/// from a report of a resumed run.
pub(crate) fn printed_of(history: &[Said]) -> Option<String> {
    history.iter().rev().filter(|s| s.output).find_map(|s| {
        s.printed
            .clone()
            .or_else(|| crate::blocks::printed_in(&s.text))
    })
}

pub(super) fn transcript(history: &[Said]) -> String {
    history
        .iter()
        .map(|s| format!("{}: {}", s.speaker, s.text))
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_attributes_interleaved_messages_by_turn() {
        let turn = |turn, agent: &str| EventMsg::TurnStarted {
            turn,
            agent: Some(agent.to_owned()),
        };
        let says = |turn, text: &str| EventMsg::AssistantMessage {
            turn,
            text: text.to_owned(),
            usage: None,
            tool_calls: Vec::new(),
        };
        // Two parallel members: b answers before a; then a turn cut off by a crash.
        let events = [
            turn(1, "team/p/a"),
            turn(2, "team/p/b"),
            says(2, "from b"),
            says(1, "from a"),
            turn(3, "team/c"),
        ];
        assert_eq!(
            replay_of(&events)
                .into_iter()
                .map(|(agent, said)| (agent, said.text))
                .collect::<Vec<_>>(),
            [
                ("team/p/b".to_owned(), "from b".to_owned()),
                ("team/p/a".to_owned(), "from a".to_owned())
            ]
        );
    }
}
