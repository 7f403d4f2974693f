//! A team of agents, as users write it (`team.toml`, or `TaskSpec.team` as JSON). The field
//! names are a contract that users' files depend on; docs/teams.md documents each one.
//!
//! The top agent is `team`; every other agent is named under `agents` and listed as a member
//! by that name. Every kind shares one flat set of fields, so that a misplaced field is
//! reported with its path (`agents.critic.max_iterations: ...`) rather than as an unknown key.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A whole team: the top agent and the agents it refers to by name.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeamSpec {
    /// The top agent (usually a `chat`, `loop`, `sequence` or `parallel`).
    pub team: AgentSpec,
    /// Every other agent, by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub agents: BTreeMap<String, AgentSpec>,
}

/// What kind of agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A model with instructions.
    #[default]
    Assistant,
    /// Runs the code in the message before it; silent when there is none.
    Executor,
    /// A group chat: members share one history, a selection picks who speaks next.
    Chat,
    /// Members in order, again and again, until `max_iterations` or an escalation.
    Loop,
    /// Members once each, in order.
    Sequence,
    /// Members at the same time, each on its own copy of the history.
    Parallel,
}

impl Kind {
    /// Its name in files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Assistant => "assistant",
            Self::Executor => "executor",
            Self::Chat => "chat",
            Self::Loop => "loop",
            Self::Sequence => "sequence",
            Self::Parallel => "parallel",
        }
    }

    /// Whether it has members.
    pub fn is_team(self) -> bool {
        matches!(
            self,
            Self::Chat | Self::Loop | Self::Sequence | Self::Parallel
        )
    }
}

/// One agent. Which fields apply depends on `kind` (docs/teams.md); a field that does not
/// apply is an error, not ignored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSpec {
    /// What kind of agent (default `assistant`).
    #[serde(default)]
    pub kind: Kind,
    /// What it does, for the other agents and for `llm` selection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// An assistant's system prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// An assistant's model, instead of the task's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// An assistant's model server, instead of the task's (within the daemon's policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// A word that, said by this assistant, ends the innermost `loop` around it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalate: Option<String>,
    /// An executor agent's executor, instead of the task's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<String>,
    /// The only languages an executor agent runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub languages: Option<Vec<String>>,
    /// Whether an executor agent's Python blocks share one kept interpreter (default: the
    /// task's `keep_state`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_state: Option<bool>,
    /// How an assistant's code reaches the executors (default: the task's `code_via`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_via: Option<crate::CodeVia>,
    /// The tools offered to an assistant's model (default: the task's); the executor that
    /// answers it runs them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<crate::ToolRef>>,
    /// What an executor agent answers a message with no code to run (default: nothing, it
    /// stays silent; AutoGen's `default_auto_reply`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_code_reply: Option<String>,
    /// A team's members, by name, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agents: Option<Vec<String>>,
    /// How a chat picks the next speaker (default `round_robin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<Selection>,
    /// Who speaks first in a chat, and `llm` selection's fallback (default: the first member).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<String>,
    /// When a chat is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub termination: Option<Termination>,
    /// How a chat inside another team answers it: every message (`flat`) or its last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<Aggregate>,
    /// Most rounds of a loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_iterations: Option<u32>,
    /// Whether one failing member of a parallel cancels the others (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_fast: Option<bool>,
    /// Hook: the agent sees only the last N messages (and the task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_last: Option<usize>,
    /// Hook: program output the agent receives is cut to this many bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<usize>,
    /// Hook: text matching these regular expressions is replaced by `[redacted]` in what
    /// the agent receives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redact: Option<Vec<String>>,
}

/// How a chat picks the next speaker: a name (`"round_robin"`, `"llm"`), or a table with
/// options.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Selection {
    /// Just the strategy.
    Named(SelectionKind),
    /// The strategy with options.
    Table(SelectionTable),
}

/// A selection strategy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionKind {
    /// Members in order, from `initial`.
    #[default]
    RoundRobin,
    /// A model reads the history and the members' descriptions and names the next one.
    Llm,
}

/// Selection with options.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectionTable {
    /// The strategy.
    pub kind: SelectionKind,
    /// `llm`: the selector's instructions, instead of the built-in ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// `llm`: the selector's model, instead of the task's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// After a message with code, the chat's executor speaks next (default: on when the chat
    /// has exactly one executor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_after_code: Option<bool>,
}

impl Selection {
    /// The strategy, whichever way it was written.
    pub fn kind(&self) -> SelectionKind {
        match self {
            Self::Named(kind) => *kind,
            Self::Table(table) => table.kind,
        }
    }
}

/// When a chat is done: exactly one condition, or `any`/`all` of several.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Termination {
    /// Done when this string is said in prose (not in code or program output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mention: Option<String>,
    /// Done when a message's prose ends with this word (AutoGen's default check); a block that
    /// holds only the word counts too, and no executor runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_with: Option<String>,
    /// With `ends_with`: a message that also has code to run ends the chat only once an
    /// executor has run that code cleanly (every block exited 0, and the task's examples
    /// held where they were run); a failed run goes back to its author.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_run: Option<bool>,
    /// Done when a message matches this regular expression.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    /// Done when a message with no code follows a report of code that ran cleanly and
    /// printed something: the message gives the answer, so nothing is left to run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered: Option<bool>,
    /// Done when an executor's report says its code ran cleanly and every example the task
    /// states held against it: the code does what the task showed, so nothing is left to ask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples_held: Option<bool>,
    /// Done (`repeated`) when code sent again unchanged reports what it reported before: the
    /// model is going round, and each turn more costs what the last did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeated: Option<bool>,
    /// `mention`, `ends_with`, `regex` and `answered`: only these members' messages count
    /// (default: any member's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agents: Option<Vec<String>>,
    /// Done after this many messages of the chat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_turns: Option<u32>,
    /// Done after this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// Done once the chat's model calls used this many tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_budget: Option<u64>,
    /// Done when a model, asked this question (or a built-in one) about the history, says yes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<String>,
    /// Done when any of these is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub any: Option<Vec<Termination>>,
    /// Done when all of these are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all: Option<Vec<Termination>>,
}

/// How a chat inside another team answers it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregate {
    /// Every inner message joins the outer history.
    #[default]
    Flat,
    /// The inner conversation stays inside; the outer history gets its last message.
    Nested,
}

/// How large a team may be: the operator's `[teams]`, checked before anything of the team
/// runs. Depth comes from names (agents list each other as members), so no parser's nesting
/// limit bounds it; this does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeamBounds {
    /// Most teams nested inside one another, the top one counted.
    pub max_depth: usize,
    /// Most agents, the top one counted.
    pub max_agents: usize,
    /// Most members of one `parallel`, which run at once.
    pub max_parallel: usize,
}

impl TeamBounds {
    /// The largest `max_depth` an operator may set: checking and running a team recurses
    /// once per level, and this many levels fit a worker thread's stack many times over.
    pub const DEPTH_CEILING: usize = 64;
    /// The largest `max_agents` an operator may set.
    pub const AGENTS_CEILING: usize = 1024;

    /// The largest bounds any daemon may have: what a client checks a file within before a
    /// daemon, which knows its own, checks it again.
    pub const CEILINGS: Self = Self {
        max_depth: Self::DEPTH_CEILING,
        max_agents: Self::AGENTS_CEILING,
        max_parallel: Self::AGENTS_CEILING,
    };
}

impl Default for TeamBounds {
    fn default() -> Self {
        Self {
            max_depth: 8,
            max_agents: 64,
            max_parallel: 8,
        }
    }
}
