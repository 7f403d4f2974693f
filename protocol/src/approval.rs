//! Which code blocks wait for a person before they run, as data: the operator's `[approval]`
//! in `tandem.toml` and a task's `TaskSpec.approval` have this one shape.

use serde::{Deserialize, Serialize};

/// An approval policy. Deny rules apply in every mode; the rest depends on [`ApprovalMode`].
/// A task's policy is checked beside the operator's, and the stricter answer wins, so a task
/// can only tighten what the operator set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalPolicy {
    /// When a person is asked.
    #[serde(default)]
    pub mode: ApprovalMode,
    /// In `policy` mode, blocks that run without asking (unless an `ask` rule fires).
    #[serde(default, skip_serializing_if = "AutoApprove::is_empty")]
    pub auto_approve: AutoApprove,
    /// In `policy` mode, code matching any of these is always asked about.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ask: Vec<ApprovalRule>,
    /// In `policy` mode, every block of an executor that can reach the network is asked about.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ask_network: bool,
    /// Code matching any of these never runs, in any mode; the model is told the rule's name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<ApprovalRule>,
    /// Tools (by name) whose calls are always asked about, in every mode.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ask_tools: Vec<String>,
    /// Tools (by name, or `*` for all) that are never called, in any mode; the model is told.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_tools: Vec<String>,
    /// How long a request waits for a decision before it is denied; a task may only shorten
    /// the operator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// When a person is asked before a block runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalMode {
    /// Never: blocks run unless a deny rule matches.
    #[default]
    Never,
    /// As the rules say; a block that no rule approves is asked about.
    Policy,
    /// Every block.
    Always,
}

/// What runs without asking in `policy` mode: a block in one of `languages`, or on one of
/// `executors`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoApprove {
    /// Languages (`python`, `sh`, ...; aliases allowed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub languages: Vec<String>,
    /// Executor names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub executors: Vec<String>,
    /// Tool names whose calls run without asking (`execute_code` is a block: its language
    /// and executor decide).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
}

impl AutoApprove {
    /// Whether it approves nothing.
    pub fn is_empty(&self) -> bool {
        self.languages.is_empty() && self.executors.is_empty() && self.tools.is_empty()
    }
}

/// A named pattern: a regular expression searched for in a block's code.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalRule {
    /// Reported when the rule fires (`pip install`, `rm at the root`).
    pub name: String,
    /// A regular expression (Rust `regex` syntax).
    pub pattern: String,
}

/// An approval's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Run it (as edited, when edited).
    Approve,
    /// Do not run it; the model is told why.
    Deny,
}

impl Decision {
    /// The snake_case name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::Deny => "deny",
        }
    }
}
