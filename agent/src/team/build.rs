//! A team made ready to run: each assistant's model, each executor's session, each chat's
//! termination compiled, and what the task adds (examples, candidates, tools, budget, output
//! schema, hooks).

use std::collections::HashMap;
use std::sync::Arc;

use regex::Regex;
use tandem_protocol::team::Kind;
use tandem_protocol::{ErrorCode, ErrorInfo, Usage};

use super::agent::{Agent, Hook};
use super::members::{BlockRules, Member, SELECTOR, Team};
use super::run::MOST_CANDIDATES;
use super::termination::Condition;
use crate::blocks::SessionSlot;
use crate::chat::ChatModel;
use crate::examples::Examples;
use crate::team::Node;
use crate::tools::ToolBox;

impl Team {
    /// The model of the assistant at `path`: not a chat's selector, nor the team's own.
    fn assistant_mut(&mut self, path: &str) -> Option<&mut (Arc<dyn Agent>, String, bool)> {
        if path == SELECTOR || path.ends_with("/selector") {
            return None;
        }
        self.members.get_mut(path)?.model.as_mut()
    }

    /// Prepares `root`: `model` gives each assistant's (and the selector's) model, `slot`
    /// each executor's session.
    pub fn new(
        root: Node,
        selector: ChatModel,
        mut model: impl FnMut(&Node) -> Result<ChatModel, ErrorInfo>,
        mut slot: impl FnMut(&Node) -> Result<SessionSlot, ErrorInfo>,
        max_turns: u32,
        limits: &tandem_executor::Limits,
    ) -> Result<Self, ErrorInfo> {
        let mut members: HashMap<String, Member> = HashMap::new();
        members.insert(
            SELECTOR.to_owned(),
            Member::with_model(Arc::new(selector.clone()), &selector),
        );
        let mut team = Self {
            members,
            max_turns,
            hooks: Vec::new(),
            blocks: BlockRules {
                approval: None,
                timeout: limits.wall,
                output_cap: limits.output_bytes,
                packages: false,
            },
            words: Vec::new(),
            exchange_turns: false,
            spend: super::spend::Spend::default(),
            output_schema: None,
            note: None,
            root: root.clone(),
        };
        let mut stack = vec![&root];
        while let Some(node) = stack.pop() {
            let mut member = Member::default();
            match node.spec.kind {
                Kind::Assistant => {
                    let made = model(node)?;
                    member = Member::with_model(Arc::new(made.clone()), &made);
                }
                Kind::Executor => {
                    member.slot = Some(tokio::sync::Mutex::new(slot(node)?));
                }
                Kind::Chat => {
                    if let Some(t) = &node.spec.termination {
                        let condition = Condition::compile(t).map_err(|e| ErrorInfo {
                            code: ErrorCode::InvalidRequest,
                            message: format!("{}.{e}", node.path),
                        })?;
                        condition.words_into(&mut team.words);
                        member.condition = Some(condition);
                    }
                    // A chat's `llm` selection may name its own model: made as an
                    // assistant with that model would be.
                    if let Some(tandem_protocol::team::Selection::Table(t)) = &node.spec.selection
                        && let Some(m) = &t.model
                    {
                        let mut selector = node.clone();
                        selector.spec.model = Some(m.clone());
                        selector.spec.base_url = None;
                        let made = model(&selector)?;
                        team.members.insert(
                            format!("{}/selector", node.path),
                            Member::with_model(Arc::new(made.clone()), &made),
                        );
                    }
                }
                _ => {}
            }
            let patterns = node.spec.redact.iter().flatten();
            let compiled: Result<Vec<Regex>, _> = patterns.map(|p| Regex::new(p)).collect();
            member.redact = compiled.map_err(|e| ErrorInfo {
                code: ErrorCode::InvalidRequest,
                message: format!("{}: {e}", node.path),
            })?;
            team.members.insert(node.path.clone(), member);
            stack.extend(&node.members);
        }
        Ok(team)
    }

    /// Has the executor at `path` run the examples `task` states (if it states any) against
    /// each clean run of code that defines what they call.
    pub fn with_examples(mut self, path: &str, task: &str) -> Self {
        if let Some(examples) = Examples::from_task(task) {
            self.members.entry(path.to_owned()).or_default().examples = Some(Arc::new(examples));
        }
        self
    }

    /// Has the assistant at `path` run the examples `executor` runs against each reply's
    /// code before `executor` runs it, and the first time they do not all hold, draw `k - 1`
    /// more replies at once and keep the one whose code holds the most; without examples, or
    /// with `k` below 2, it replies once.
    pub fn with_candidates(mut self, path: &str, executor: &str, k: u32) -> Self {
        if k > 1 {
            self.members.entry(path.to_owned()).or_default().candidates =
                Some((executor.to_owned(), k.min(MOST_CANDIDATES)));
        }
        self
    }

    /// Puts `agent` in the place of the assistant at `path` (`team/reviewer`); an error when
    /// there is no assistant there.
    pub fn with_agent(mut self, path: &str, agent: Arc<dyn Agent>) -> Result<Self, ErrorInfo> {
        match self.assistant_mut(path) {
            Some(model) => {
                model.0 = agent;
                Ok(self)
            }
            _ => Err(ErrorInfo {
                code: ErrorCode::InvalidRequest,
                message: format!("{path}: no assistant of this team is there"),
            }),
        }
    }

    /// Gives the assistant at `path` (`team/coder`) `tools`; an error when there is no
    /// assistant there.
    pub fn with_tools(mut self, path: &str, tools: ToolBox) -> Result<Self, ErrorInfo> {
        if self.assistant_mut(path).is_none() {
            return Err(ErrorInfo {
                code: ErrorCode::InvalidRequest,
                message: format!("{path}: no assistant of this team is there"),
            });
        }
        if let Some(member) = self.members.get_mut(path) {
            member.tools = (!tools.is_empty()).then(|| Arc::new(tools));
        }
        Ok(self)
    }

    /// Counts and tells turns as the two-agent pair does: only assistants' turns count
    /// against `max_turns`, each is announced by `turn_started`, an executor's reply shares
    /// the number of the turn it answers, and no agent or `team_ended` is told.
    pub fn exchange_turns(mut self) -> Self {
        self.exchange_turns = true;
        self
    }

    /// Checks every executor's blocks with `gate` before they run (an approval gate asks per
    /// block, which a whole-message [`Hook`] cannot).
    pub fn with_approval(mut self, gate: Option<Arc<crate::approval::ApprovalGate>>) -> Self {
        self.blocks.approval = gate;
        self
    }

    /// Holds the task's model calls to `budget`, pricing each model by its name in `prices`
    /// (a model run in this process costs nothing).
    pub fn with_budget(
        mut self,
        budget: crate::budget::Budget,
        prices: &std::collections::BTreeMap<String, crate::budget::Price>,
    ) -> Self {
        let models = self
            .members
            .iter()
            .filter_map(|(path, m)| {
                let (_, name, embedded) = m.model.as_ref()?;
                Some((path.clone(), (name.clone(), *embedded)))
            })
            .collect();
        self.spend.set_budget(budget, prices, &models);
        self
    }

    /// Counts what an interrupted run of the task already spent, a model call's usage by the
    /// path of the agent that made it, so that a resumed task's budgets hold across its runs.
    /// Call after [`Team::with_budget`], whose prices it counts the cost at.
    pub fn with_spent(mut self, calls: &[(String, Usage)]) -> Self {
        self.spend.set_spent(calls);
        self
    }

    /// Has the task's final answer end with a value matching `schema`: a chat at the top that
    /// would end without one goes on, the model told what is wrong (a turn like any other).
    pub fn with_output_schema(mut self, schema: Option<Arc<crate::schema::OutputSchema>>) -> Self {
        self.output_schema = schema;
        self
    }

    /// Tells every assistant `note` after its instructions.
    pub fn with_note(mut self, note: String) -> Self {
        self.note = Some(note);
        self
    }

    /// Tells the model how to install a module its code could not import, when its sandbox
    /// reaches a package index.
    pub fn with_packages(mut self, packages: bool) -> Self {
        self.blocks.packages = packages;
        self
    }

    /// Adds a hook that every agent's turn passes through, in the order added.
    pub fn with_hook(mut self, hook: std::sync::Arc<dyn Hook>) -> Self {
        self.hooks.push(hook);
        self
    }
}
