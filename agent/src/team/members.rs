//! A team made ready to run, as the interpreter reads it: one member per agent path, with
//! what it was made with and what the task gave it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use regex::Regex;
use tandem_executor::CancellationToken;
use tandem_protocol::{ErrorCode, ErrorInfo};

use super::agent::{Agent, Hook};
use super::spend::Spend;
use super::termination::Condition;
use crate::blocks::SessionSlot;
use crate::chat::ChatModel;
use crate::examples::Examples;
use crate::team::Node;
use crate::tools::ToolBox;

/// What a team needs that the file does not say: a model per assistant, an executor session
/// per executor, and where events go.
pub struct Team {
    pub(super) root: Node,
    /// Every agent, a chat's selector model and the team's own ([`SELECTOR`]), by path.
    pub(super) members: HashMap<String, Member>,
    /// Most turns of all agents together, whatever the team's own limits.
    pub max_turns: u32,
    pub(super) hooks: Vec<std::sync::Arc<dyn Hook>>,
    /// How its executors' blocks are gated and told.
    pub(super) blocks: BlockRules,
    /// Every `mention` and `ends_with` word of the team's chats: a block holding only one of
    /// them is a way of saying it, which no executor runs.
    pub(super) words: Vec<String>,
    /// Turns are the assistants' alone, told as `turn_started`: an executor's reply belongs
    /// to the turn whose code it answers (the two-agent pair's shape).
    pub(super) exchange_turns: bool,
    /// What the task may spend on model calls, and each model's price.
    pub(super) spend: Spend,
    /// The JSON Schema the task's final answer ends with a value of, checked when the top
    /// chat would end; a task's result.
    pub(super) output_schema: Option<Arc<crate::schema::OutputSchema>>,
    /// Told to every assistant after its instructions (what its sandbox's network reaches).
    pub(super) note: Option<String>,
}

/// How a team's executors run blocks: the gate each block passes, and the limits its report
/// is told against.
pub(super) struct BlockRules {
    /// Asks before each block runs.
    pub(super) approval: Option<Arc<crate::approval::ApprovalGate>>,
    /// A block's wall-clock limit.
    pub(super) timeout: Duration,
    /// Most bytes of a block's output kept.
    pub(super) output_cap: usize,
    /// pip can install from a package index here: a failed import is told how.
    pub(super) packages: bool,
}

/// One agent of the team (or a chat's own selector model), by its path: what it was made
/// with and what the task gave it.
#[derive(Default)]
pub(super) struct Member {
    /// An assistant's (or a selector's) model, with the model's name and whether it runs in
    /// this process.
    pub(super) model: Option<(Arc<dyn Agent>, String, bool)>,
    /// An executor's session.
    pub(super) slot: Option<tokio::sync::Mutex<SessionSlot>>,
    /// What is hidden from what it is shown.
    pub(super) redact: Vec<Regex>,
    /// A chat's termination, compiled once.
    pub(super) condition: Option<Condition>,
    /// The examples an executor runs against each clean run of code.
    pub(super) examples: Option<Arc<Examples>>,
    /// How many replies an assistant draws, and the executor whose examples choose.
    pub(super) candidates: Option<(String, u32)>,
    /// An assistant's tools: offered to its model, and run by the executor that answers it.
    pub(super) tools: Option<Arc<ToolBox>>,
}

impl Member {
    pub(super) fn with_model(agent: Arc<dyn Agent>, made: &ChatModel) -> Self {
        Self {
            model: Some((agent, made.config().model.clone(), made.is_embedded())),
            ..Self::default()
        }
    }
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("root", &self.root.path)
            .finish_non_exhaustive()
    }
}

impl Team {
    /// The model of the agent (or selector) at `path`.
    pub(super) fn model(&self, path: &str) -> Option<&Arc<dyn Agent>> {
        self.members.get(path)?.model.as_ref().map(|(m, ..)| m)
    }

    /// The tools of the assistant named `name` (what its messages' `speaker` is): names are
    /// unique among a team's agents, and a path ends with its agent's name.
    pub(super) fn tools(&self, name: &str) -> Option<&Arc<ToolBox>> {
        self.members
            .iter()
            .find(|(path, _)| path.rsplit('/').next() == Some(name))
            .and_then(|(_, m)| m.tools.as_ref())
    }

    /// The termination of the chat at `path`.
    pub(super) fn condition(&self, path: &str) -> Option<&Condition> {
        self.members.get(path)?.condition.as_ref()
    }

    /// The session of the executor at `path`.
    pub(super) fn slot(&self, path: &str) -> Option<&tokio::sync::Mutex<SessionSlot>> {
        self.members.get(path)?.slot.as_ref()
    }

    /// Every word that ends one of the team's chats.
    pub(crate) fn words(&self) -> &[String] {
        &self.words
    }

    /// Runs a task's `check` in the session of the executor at `path`, after the run.
    pub(crate) async fn check(
        &self,
        path: &str,
        check: &tandem_protocol::Check,
        answer: Option<&str>,
        outputs: &[&str],
        cancel: &CancellationToken,
    ) -> Option<tandem_protocol::CheckOutcome> {
        let Some(slot) = self.slot(path) else {
            return Some(tandem_protocol::CheckOutcome {
                verdict: tandem_protocol::Verdict::Error,
                detail: format!("{path}: no executor session to run the check in"),
                printed: None,
            });
        };
        let mut slot = slot.lock().await;
        crate::check::run_check(&mut slot, check, answer, outputs, cancel).await
    }

    /// Closes every executor session.
    pub async fn close(self) {
        for (path, member) in self.members {
            let Some(slot) = member.slot else {
                continue;
            };
            if let Err(e) = slot.into_inner().close().await {
                tracing::warn!(agent = %path, error = %e, "closing an executor session failed");
            }
        }
    }
}

/// The key of the team's own model (selection and `llm` terminations of chats that name no
/// model of their own) among the agents' paths, which are never empty.
pub(super) const SELECTOR: &str = "";

/// The session slot of an executor agent `node` on `executor`, limited to the agent's
/// `languages`; a language the executor does not run is an error naming the field.
pub fn executor_slot(
    node: &Node,
    executor: std::sync::Arc<dyn tandem_executor::Executor>,
    session: tandem_executor::SessionSpec,
) -> Result<SessionSlot, ErrorInfo> {
    let languages = node
        .spec
        .languages
        .as_deref()
        .map(|asked| crate::allowed_languages(asked, executor.as_ref()))
        .transpose()
        .map_err(|e| ErrorInfo {
            code: ErrorCode::InvalidRequest,
            message: format!("{}.languages: {e}", node.path),
        })?;
    let mut session = session;
    if let Some(keep) = node.spec.keep_state {
        session.keep_state = keep;
    }
    if session.keep_state && !executor.keeps_state() {
        return Err(ErrorInfo {
            code: ErrorCode::InvalidRequest,
            message: format!(
                "{}.keep_state: the {} executor cannot keep a Python interpreter between blocks; use local or docker, or leave keep_state out",
                node.path,
                executor.name()
            ),
        });
    }
    Ok(SessionSlot::new(executor, session).only(languages))
}
