//! The two-agent task: an assistant and an executor taking turns until the assistant says
//! the termination word or a limit is hit, run as a built-in team; and its system prompt.

use std::sync::Arc;
use std::time::Duration;

use tandem_executor::{CancellationToken, Executor, Language, SessionSpec};
use tandem_protocol::team::{AgentSpec, Kind, TeamSpec, Termination};
use tandem_protocol::{ErrorCode, ErrorInfo, EventMsg, Message, Role, StopReason, Usage};

use crate::blocks::{self, SessionSlot};
use crate::chat::ChatModel;
use crate::events::EventSink;
use crate::team::task::run_team;
use crate::team::{TaskLabel, Team, check};
use crate::termination::strip_termination;

/// Everything a task needs besides the model and the executor.
#[derive(Clone, Debug)]
pub struct TaskSettings {
    /// The task text.
    pub task: String,
    /// System prompt for the assistant.
    pub system_prompt: String,
    /// The word that ends the task when the assistant says it.
    pub termination: String,
    /// Most assistant turns.
    pub max_turns: u32,
    /// Wall-clock limit for the whole task.
    pub timeout: Option<Duration>,
    /// The session's workspace and limits.
    pub session: SessionSpec,
    /// The only languages blocks may run in; `None` allows all the executor runs.
    pub languages: Option<Vec<Language>>,
    /// Turns already taken, when continuing an interrupted task: the assistant's replies and
    /// the executor's reports that followed the task, in order.
    pub history: Vec<Message>,
    /// Checks each block before it runs; `None` runs every block.
    pub approval: Option<Arc<crate::approval::ApprovalGate>>,
    /// How the assistant's code reaches the executor.
    pub code_via: tandem_protocol::CodeVia,
    /// The tools offered to the assistant besides `execute_code`.
    pub tools: Vec<crate::tools::Tool>,
    /// Run in the task's session once it ends, never shown to the model (`tandem eval`).
    pub check: Option<tandem_protocol::Check>,
    /// What the task may spend on model calls.
    pub budget: crate::budget::Budget,
    /// Models' prices by name, for the task's cost and `max_cost`.
    pub prices: std::collections::BTreeMap<String, crate::budget::Price>,
    /// The usage of each model call an interrupted run of the task made, in order.
    pub spent: Vec<Usage>,
    /// What the final answer must end with a value of.
    pub output_schema: Option<Arc<crate::schema::OutputSchema>>,
    /// How many replies to choose among, the model's own with them, when a reply's code first
    /// fails the task's examples.
    pub candidates: u32,
    /// The interrupted run of the task already drew replies: a task draws once.
    pub drew: bool,
    /// The task's network: every session it opens goes behind this proxy with this policy;
    /// `None` leaves each executor's own setting (no network, by default).
    pub network: Option<TaskNetwork>,
}

/// A task's way out: the egress proxy and the policy its sandboxes are held to.
#[derive(Clone)]
pub struct TaskNetwork {
    /// The proxy, one per process.
    pub egress: tandem_egress::Egress,
    /// What the task's sandboxes may reach.
    pub policy: Arc<tandem_egress::Policy>,
    /// Bytes the task's sandboxes carried, counted against the policy's `max_bytes`: one
    /// count for the whole task, however many executors (a team's agents) it wraps.
    pub carried: Arc<tandem_egress::Carried>,
}

impl std::fmt::Debug for TaskNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskNetwork")
            .field("allow", &self.policy.allowed_hosts())
            .finish_non_exhaustive()
    }
}

impl TaskNetwork {
    /// `executor` with every session behind the proxy, its connections told as `net` events.
    pub fn wrap(&self, executor: Arc<dyn Executor>, events: &EventSink) -> Arc<dyn Executor> {
        Arc::new(
            tandem_egress::Behind::new(
                executor,
                self.egress.clone(),
                self.policy.clone(),
                Arc::new(NetEvents(events.clone(), tracing::Span::current())),
            )
            .sharing(self.carried.clone()),
        )
    }
}

impl TaskNetwork {
    /// `executor` with every session behind the proxy, its connections told to `sink` once
    /// it is set (a team's executors are made before its task's events have a sink).
    pub fn wrap_late(&self, executor: Arc<dyn Executor>, sink: Arc<LateNet>) -> Arc<dyn Executor> {
        Arc::new(
            tandem_egress::Behind::new(executor, self.egress.clone(), self.policy.clone(), sink)
                .sharing(self.carried.clone()),
        )
    }
}

/// Connections told as a task's `net` events once the task runs and its sink is known.
#[derive(Default)]
pub struct LateNet(std::sync::Mutex<Option<NetEvents>>);

impl LateNet {
    /// From now on, connections are `events`, and spans under the current span.
    pub fn set(&self, events: &EventSink) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(NetEvents(events.clone(), tracing::Span::current()));
        }
    }
}

impl tandem_egress::NetSink for LateNet {
    fn record(&self, event: tandem_protocol::net::NetEvent) {
        if let Ok(slot) = self.0.lock()
            && let Some(sink) = slot.as_ref()
        {
            sink.record(event);
        }
    }
}

/// The proxy's records as the task's events, and as spans under the task's.
struct NetEvents(EventSink, tracing::Span);

impl tandem_egress::NetSink for NetEvents {
    fn record(&self, event: tandem_protocol::net::NetEvent) {
        crate::trace::net(&self.1, &event);
        (self.0)(EventMsg::Net(event));
    }
}

impl TaskSettings {
    /// Settings with the defaults for `task`.
    pub fn new(task: impl Into<String>) -> Self {
        Self {
            task: task.into(),
            system_prompt: crate::DEFAULT_SYSTEM_PROMPT.to_owned(),
            termination: crate::DEFAULT_TERMINATION.to_owned(),
            max_turns: crate::DEFAULT_MAX_TURNS,
            timeout: None,
            session: SessionSpec::default(),
            languages: None,
            history: Vec::new(),
            approval: None,
            code_via: tandem_protocol::CodeVia::Blocks,
            tools: Vec::new(),
            check: None,
            budget: crate::budget::Budget::default(),
            prices: std::collections::BTreeMap::new(),
            spent: Vec::new(),
            output_schema: None,
            candidates: crate::DEFAULT_CANDIDATES,
            drew: false,
            network: None,
        }
    }
}

/// How a task ended, with everything said.
#[derive(Clone, Debug)]
pub struct TaskOutcome {
    /// Why it ended.
    pub stop_reason: StopReason,
    /// Assistant turns taken.
    pub turns: u32,
    /// Tokens used.
    pub usage: Usage,
    /// Set when `stop_reason` is `Error`.
    pub error: Option<ErrorInfo>,
    /// The whole conversation, system prompt first.
    pub transcript: Vec<Message>,
    /// The final answer (last reply without the termination string), when terminated.
    pub summary: Option<String>,
    /// The verdict of the task's check, when it had one and was not cancelled.
    pub check: Option<tandem_protocol::CheckOutcome>,
    /// What the model calls cost, when the model has a price.
    pub cost: Option<f64>,
    /// The budget the task stopped at, if it did.
    pub budget: Option<tandem_protocol::BudgetReached>,
    /// The value the final answer ended with, when the task has an output schema.
    pub result: Option<serde_json::Value>,
    /// The task's answer: the model's final statement, else its code's last clean output.
    pub answer: Option<String>,
    /// Where `answer` comes from.
    pub answer_from: Option<tandem_protocol::AnswerFrom>,
    /// Why there is no answer, when there is none.
    pub no_answer: Option<String>,
    /// Wall time.
    pub elapsed: Duration,
}

/// Runs a task to its end: the two-agent chat, as a built-in team ([`pair`]) of an
/// `assistant` and an `executor`. Every step is sent to `events`, the last being
/// [`EventMsg::TaskFinished`]; the sandbox is
/// closed on every path.
pub async fn run_task(
    settings: TaskSettings,
    model: &ChatModel,
    executor: Arc<dyn Executor>,
    events: EventSink,
    cancel: CancellationToken,
) -> TaskOutcome {
    let label = TaskLabel {
        model: model.config().model.clone(),
        base_url: model.location(),
        executor: executor.name().to_owned(),
    };
    let (executor, events) = match &settings.network {
        Some(network) => {
            let events = crate::events::counting_net(events);
            (network.wrap(executor, &events), events)
        }
        None => (executor, events),
    };
    let slot =
        SessionSlot::new(executor, settings.session.clone()).only(settings.languages.clone());
    let system = system_prompt(&settings, slot.executor().languages());
    let nudge = match settings.code_via {
        tandem_protocol::CodeVia::Tool => format!(
            "No code to run was found in your reply. If the task is done, reply with {}. Otherwise, call the `execute_code` tool with the complete code.",
            settings.termination
        ),
        _ => blocks::no_code_nudge(&settings.termination, slot.languages()),
    };
    let toolbox =
        crate::tools::ToolBox::new(settings.tools.clone(), settings.code_via, slot.languages());
    let team = check(&pair(&system, &settings.termination, &nudge))
        .map_err(|e| ErrorInfo {
            code: ErrorCode::InvalidRequest,
            message: e.to_string(),
        })
        .and_then(|root| {
            let mut slot = Some(slot);
            Team::new(
                root,
                model.clone(),
                |_| Ok(model.clone()),
                |node| {
                    slot.take().ok_or_else(|| ErrorInfo {
                        code: ErrorCode::Internal,
                        message: format!("{}: a second executor in the pair", node.path),
                    })
                },
                settings.max_turns,
                &settings.session.limits,
            )
        })
        .and_then(|team| {
            team.exchange_turns()
                .with_packages(settings.network.as_ref().is_some_and(|n| {
                    n.egress
                        .packages()
                        .iter()
                        .any(|p| p.kind() == tandem_egress::packages::Kind::Python)
                }))
                .with_budget(settings.budget, &settings.prices)
                .with_output_schema(settings.output_schema.clone())
                .with_spent(
                    &settings
                        .spent
                        .iter()
                        .map(|u| (format!("{}/{ASSISTANT}", crate::team::check::TOP), *u))
                        .collect::<Vec<_>>(),
                )
                .with_approval(settings.approval.clone())
                .with_tools(&format!("{}/{ASSISTANT}", crate::team::check::TOP), toolbox)
                .map(|team| {
                    let executor = format!("{}/{EXECUTOR}", crate::team::check::TOP);
                    team.with_examples(&executor, &settings.task)
                        .with_candidates(
                            &format!("{}/{ASSISTANT}", crate::team::check::TOP),
                            &executor,
                            if settings.drew {
                                1
                            } else {
                                settings.candidates
                            },
                        )
                })
        });
    // What the interrupted run said, by the pair's two agents in turn.
    let replay = crate::team::history::pair_turns(&settings.history)
        .into_iter()
        .map(|(assistant, said)| {
            let agent = if assistant { ASSISTANT } else { EXECUTOR };
            (format!("{}/{agent}", crate::team::check::TOP), said)
        })
        .collect();
    let word = settings.termination.clone();
    let ran = run_team(
        team,
        &settings.task,
        label,
        events,
        cancel,
        settings.timeout,
        replay,
        settings
            .check
            .clone()
            .map(|c| (format!("{}/{EXECUTOR}", crate::team::check::TOP), c)),
        |reason, history| {
            let last = history.iter().rev().find(|s| s.speaker == ASSISTANT)?;
            matches!(
                reason,
                StopReason::Terminated | StopReason::Answered | StopReason::ExamplesHeld
            )
            .then(|| strip_termination(&last.text, &word))
        },
    )
    .await;
    let mut transcript = vec![
        Message::new(Role::System, system),
        Message::new(Role::User, settings.task),
    ];
    transcript.extend(
        ran.history
            .iter()
            .skip(1)
            .flat_map(|s| s.to_messages(s.speaker == ASSISTANT)),
    );
    TaskOutcome {
        stop_reason: ran.stop_reason,
        turns: ran.turns,
        usage: ran.usage,
        error: ran.error,
        transcript,
        summary: ran.summary,
        check: ran.check,
        cost: ran.cost,
        budget: ran.budget,
        result: ran.result,
        answer: ran.answer,
        answer_from: ran.answer_from,
        no_answer: ran.no_answer,
        elapsed: ran.elapsed,
    }
}

/// The pair's assistant's name.
const ASSISTANT: &str = "assistant";
/// The pair's executor's name.
const EXECUTOR: &str = "executor";

/// The two-agent chat as a team: the assistant (with `system` as its instructions) and an
/// executor that runs its code or, when there is none, answers `nudge`, taking turns until
/// the assistant ends its prose with `word`, answers in words after a clean run, or its
/// code holds every example the task states; or until it resends code that runs as before.
pub fn pair(system: &str, word: &str, nudge: &str) -> TeamSpec {
    let names = |names: &[&str]| Some(names.iter().map(|n| (*n).to_owned()).collect());
    TeamSpec {
        team: AgentSpec {
            kind: Kind::Chat,
            agents: names(&[ASSISTANT, EXECUTOR]),
            // The word ends the task; so does an answer in words right after code that ran
            // cleanly, which small models give without the word, and a clean run that holds
            // every example the task states, after which a small model only says the word.
            termination: Some(Termination {
                any: Some(vec![
                    Termination {
                        ends_with: Some(word.to_owned()),
                        after_run: Some(true),
                        agents: names(&[ASSISTANT]),
                        ..Termination::default()
                    },
                    Termination {
                        answered: Some(true),
                        agents: names(&[ASSISTANT]),
                        ..Termination::default()
                    },
                    Termination {
                        examples_held: Some(true),
                        ..Termination::default()
                    },
                    // A small model that resends code unchanged, and reads the same report,
                    // resends it to the turn limit, each turn as long as the last.
                    Termination {
                        repeated: Some(true),
                        ..Termination::default()
                    },
                ]),
                ..Termination::default()
            }),
            ..AgentSpec::default()
        },
        agents: [
            (
                ASSISTANT.to_owned(),
                AgentSpec {
                    kind: Kind::Assistant,
                    instructions: Some(system.to_owned()),
                    ..AgentSpec::default()
                },
            ),
            (
                EXECUTOR.to_owned(),
                AgentSpec {
                    kind: Kind::Executor,
                    no_code_reply: Some(nudge.to_owned()),
                    ..AgentSpec::default()
                },
            ),
        ]
        .into(),
    }
}

/// The system prompt the model gets: `{languages}` names exactly the languages that run
/// (the task's list, else every language the executor runs), python first when it runs; a
/// task that allows only some also gets a line that says so.
pub fn render_system_prompt(
    template: &str,
    executor: &[Language],
    allowed: Option<&[Language]>,
) -> String {
    let runs: Vec<&Language> = allowed
        .unwrap_or(executor)
        .iter()
        .filter(|l| !l.is_data())
        .collect();
    let python = Language::python();
    let fence = |l: &Language| format!("```{l}");
    let others: Vec<String> = runs
        .iter()
        .filter(|l| ***l != python)
        .map(|l| fence(l))
        .collect();
    let fences = match (runs.contains(&&python), others.as_slice()) {
        (true, []) => fence(&python),
        (true, others) => format!(
            "{} blocks (preferred) or {}",
            fence(&python),
            others.join(" or ")
        ),
        (false, others) => others.join(" or "),
    };
    let prompt = template.replace("{languages}", &fences);
    match allowed {
        None => prompt,
        Some(languages) => format!(
            "{}\n- Only code in these languages is run: {}. Blocks in other languages are not run.",
            prompt.trim_end(),
            tandem_executor::join_languages(languages)
        ),
    }
}

fn system_prompt(settings: &TaskSettings, executor: &[Language]) -> String {
    render_system_prompt(
        &settings.system_prompt,
        executor,
        settings.languages.as_deref(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_names_exactly_the_languages_that_run() {
        let template = "code in {languages} blocks.";
        let (py, sh, js) = (Language::python(), Language::sh(), Language::javascript());
        let render = |executor: &[Language], allowed: Option<&[Language]>| {
            render_system_prompt(template, executor, allowed)
        };
        assert_eq!(
            render(&[py.clone(), sh.clone()], None),
            "code in ```python blocks (preferred) or ```sh blocks."
        );
        assert_eq!(
            render(&[py.clone(), js.clone()], None),
            "code in ```python blocks (preferred) or ```javascript blocks."
        );
        assert_eq!(
            render(std::slice::from_ref(&sh), None),
            "code in ```sh blocks."
        );
        assert_eq!(
            render(&[py.clone(), sh.clone(), js], Some(&[py])),
            "code in ```python blocks.\n- Only code in these languages is run: python. Blocks in other languages are not run."
        );
        // A prompt without the placeholder is the operator's own words.
        assert_eq!(render_system_prompt("Be brief.", &[sh], None), "Be brief.");
    }
}
