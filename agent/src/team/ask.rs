//! Model calls outside any agent's turn: a chat's choice of who speaks next and its `llm`
//! terminations, each shown as the turn of a pseudo-agent.

use std::sync::atomic::Ordering;

use futures::future::BoxFuture;
use tandem_protocol::{ErrorInfo, EventMsg, Message, Role, StopReason};

use super::history::{Said, transcript};
use super::members::SELECTOR;
use super::run::Ctx;
use super::termination::{ChatState, Condition, Test};

impl Ctx<'_> {
    /// One model call outside any agent's turn (selection, an `llm` termination), shown as
    /// the turn of a pseudo-agent at `path`; it is told the task, then asked `question`.
    pub(super) async fn ask(
        &self,
        path: &str,
        system: &str,
        history: &[Said],
        question: &str,
    ) -> Result<String, ErrorInfo> {
        if let Some(answer) = self.replayed(path) {
            return Ok(answer.text);
        }
        let turn = self.shared.turns.load(Ordering::SeqCst);
        (self.events)(EventMsg::TurnStarted {
            turn,
            agent: Some(path.to_owned()),
        });
        let task = history.first().map_or("", |s| s.text.as_str());
        let messages = [
            Message::new(Role::System, system),
            Message::new(Role::User, task),
            Message::new(Role::User, question),
        ];
        // A task out of budget asks no model: the next turn stops it.
        if self.over_budget().is_some() {
            return Ok(String::new());
        }
        let Some((priced, model)) = self
            .team
            .model(path)
            .map(|m| (path, m))
            .or_else(|| self.team.model(SELECTOR).map(|m| (SELECTOR, m)))
        else {
            return Ok(String::new());
        };
        Ok(self
            .call(priced, model.as_ref(), &messages, turn, None)
            .await?
            .map(|r| r.text)
            .unwrap_or_default())
    }

    /// Whether `c` holds after the chat's latest messages: the condition in words and the
    /// stop reason it means for a whole task.
    pub(super) fn fired<'b>(
        &'b self,
        c: &'b Condition,
        s: &'b ChatState<'b>,
    ) -> BoxFuture<'b, Result<Option<(String, StopReason)>, ErrorInfo>> {
        Box::pin(async move {
            if let Some(held) = c.holds(s) {
                return Ok(held.map(|reason| (c.words.clone(), reason)));
            }
            Ok(match &c.test {
                Test::Llm(question) => {
                    let answer = self
                        .ask(
                            &format!("{}/termination", s.path),
                            "You judge a team's conversation. Answer yes or no.",
                            s.history,
                            &format!("Conversation:\n{}\n\n{question}", transcript(s.history)),
                        )
                        .await?;
                    answer
                        .trim_start()
                        .to_ascii_lowercase()
                        .starts_with("yes")
                        .then(|| (c.words.clone(), StopReason::Terminated))
                }
                Test::Any(list) => {
                    let mut first = None;
                    for inner in list {
                        if let Some(found) = self.fired(inner, s).await? {
                            first = Some(found);
                            break;
                        }
                    }
                    first
                }
                Test::All(list) => {
                    let mut last = None;
                    for inner in list {
                        match self.fired(inner, s).await? {
                            Some(found) => last = Some(found),
                            None => return Ok(None),
                        }
                    }
                    last.map(|(_, reason)| (c.words.clone(), reason))
                }
                _ => None,
            })
        })
    }
}
