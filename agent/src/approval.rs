//! The approval gate: the one place a block is checked against the approval policies, and a
//! person asked, before it runs.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use regex::Regex;
use tandem_executor::{CancellationToken, Executor, Language};
use tandem_protocol::{ApprovalMode, ApprovalPolicy, Decision, EventMsg};
use tracing::Instrument;

use crate::events::EventSink;

/// A policy that cannot be used: a pattern that is not a regular expression.
#[derive(Debug, thiserror::Error)]
pub enum ApprovalError {
    /// A rule's pattern does not compile.
    #[error("approval rule `{name}` ({list}): the pattern is not a regular expression: {error}")]
    Pattern {
        /// The rule's name.
        name: String,
        /// `ask` or `deny`.
        list: &'static str,
        /// What the regex parser said.
        error: String,
    },
    /// A rule has an empty name, which nothing could report.
    #[error("an approval rule in `{0}` has an empty name; give every rule a name to report")]
    Unnamed(&'static str),
    /// The timeout is zero.
    #[error("approval timeout_secs must be at least 1")]
    ZeroTimeout,
}

/// One policy, its patterns compiled.
#[derive(Clone, Debug)]
struct Compiled {
    mode: ApprovalMode,
    languages: Vec<Language>,
    executors: Vec<String>,
    ask: Vec<(String, Regex)>,
    ask_network: bool,
    deny: Vec<(String, Regex)>,
    tools: Vec<String>,
    ask_tools: Vec<String>,
    deny_tools: Vec<String>,
}

impl Compiled {
    fn new(policy: &ApprovalPolicy) -> Result<Self, ApprovalError> {
        let compile = |rules: &[tandem_protocol::ApprovalRule], list| {
            rules
                .iter()
                .map(|r| {
                    if r.name.trim().is_empty() {
                        return Err(ApprovalError::Unnamed(list));
                    }
                    Regex::new(&r.pattern)
                        .map(|re| (r.name.clone(), re))
                        .map_err(|e| ApprovalError::Pattern {
                            name: r.name.clone(),
                            list,
                            error: e.to_string(),
                        })
                })
                .collect::<Result<Vec<_>, _>>()
        };
        if policy.timeout_secs == Some(0) {
            return Err(ApprovalError::ZeroTimeout);
        }
        Ok(Self {
            mode: policy.mode,
            languages: policy
                .auto_approve
                .languages
                .iter()
                .map(|l| Language::new(l))
                .collect(),
            executors: policy.auto_approve.executors.clone(),
            ask: compile(&policy.ask, "ask")?,
            ask_network: policy.ask_network,
            deny: compile(&policy.deny, "deny")?,
            tools: policy.auto_approve.tools.clone(),
            ask_tools: policy.ask_tools.clone(),
            deny_tools: policy.deny_tools.clone(),
        })
    }

    /// What this policy says of a call of tool `name` (other than `execute_code`).
    fn tool_verdict(&self, name: &str) -> Verdict {
        let listed = |list: &[String]| list.iter().any(|t| t == name || t == "*");
        if listed(&self.deny_tools) {
            return Verdict::Deny {
                rule: format!("deny_tools {name}"),
            };
        }
        if listed(&self.ask_tools) {
            return Verdict::Ask {
                rule: Some(format!("ask_tools {name}")),
                reason: format!("calls of tool `{name}` are asked about (ask_tools)"),
            };
        }
        match self.mode {
            ApprovalMode::Never => Verdict::Run,
            ApprovalMode::Always => Verdict::Ask {
                rule: None,
                reason: format!("every call is asked about (mode = \"always\"): tool `{name}`"),
            },
            ApprovalMode::Policy if listed(&self.tools) => Verdict::Run,
            ApprovalMode::Policy => Verdict::Ask {
                rule: None,
                reason: format!("no rule approves tool `{name}`"),
            },
        }
    }

    /// The first deny rule that matches any of `texts`.
    fn denying<'a>(&'a self, texts: &[String]) -> Option<&'a str> {
        self.deny
            .iter()
            .find(|(_, re)| texts.iter().any(|t| re.is_match(t)))
            .map(|(name, _)| name.as_str())
    }

    fn verdict(&self, language: &Language, executor: &dyn Executor, code: &str) -> Verdict {
        if let Some((name, _)) = self.deny.iter().find(|(_, re)| re.is_match(code)) {
            return Verdict::Deny { rule: name.clone() };
        }
        match self.mode {
            ApprovalMode::Never => Verdict::Run,
            ApprovalMode::Always => Verdict::Ask {
                rule: None,
                reason: "every block is asked about (mode = \"always\")".to_owned(),
            },
            ApprovalMode::Policy => {
                if let Some((name, _)) = self.ask.iter().find(|(_, re)| re.is_match(code)) {
                    return Verdict::Ask {
                        rule: Some(name.clone()),
                        reason: format!("the code matches the ask rule `{name}`"),
                    };
                }
                if self.ask_network && executor.network() {
                    return Verdict::Ask {
                        rule: Some("network".to_owned()),
                        reason: format!(
                            "the {} executor's sandbox can reach the network",
                            executor.name()
                        ),
                    };
                }
                if self.languages.contains(language)
                    || self.executors.iter().any(|e| e == executor.name())
                {
                    return Verdict::Run;
                }
                Verdict::Ask {
                    rule: None,
                    reason: format!(
                        "no rule approves {language} on the {} executor",
                        executor.name()
                    ),
                }
            }
        }
    }
}

/// What the policies say of one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It runs without asking.
    Run,
    /// A person decides; `rule` names the rule that asked, when one did.
    Ask {
        /// The rule's name.
        rule: Option<String>,
        /// Why, in words.
        reason: String,
    },
    /// A deny rule matched; it never runs.
    Deny {
        /// The rule's name.
        rule: String,
    },
}

/// A block waiting for a person.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ask {
    /// Turn number.
    pub turn: u32,
    /// Block index in the reply.
    pub index: u32,
    /// Its language.
    pub language: Language,
    /// The code.
    pub code: String,
    /// The rule that asked.
    pub rule: Option<String>,
    /// Why it asks.
    pub reason: String,
}

impl Ask {
    /// Its `approval_requested` event, as approval `n`.
    pub fn requested(&self, n: u32) -> EventMsg {
        EventMsg::ApprovalRequested {
            turn: self.turn,
            index: self.index,
            n,
            language: self.language.to_string(),
            code: self.code.clone(),
            rule: self.rule.clone(),
            reason: self.reason.clone(),
        }
    }
}

/// A person's (or the timeout's) answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ruling {
    /// Approve or deny.
    pub decision: Decision,
    /// Edited code to run instead, when approved with an edit.
    pub code: Option<String>,
    /// Why, when denied (told to the model).
    pub reason: Option<String>,
    /// `user` or `timeout`.
    pub by: String,
}

impl Ruling {
    /// The denial of a request no one decided within `timeout`.
    pub fn timed_out(timeout: Duration) -> Self {
        Self {
            decision: Decision::Deny,
            code: None,
            reason: Some(format!("no decision within {} s", timeout.as_secs())),
            by: "timeout".to_owned(),
        }
    }

    /// Its `approval_decided` event, for approval `n` of block `index` in turn `turn`.
    pub fn decided(&self, turn: u32, index: u32, n: u32) -> EventMsg {
        EventMsg::ApprovalDecided {
            turn,
            index,
            n,
            decision: self.decision,
            by: self.by.clone(),
            code: self.code.clone(),
            reason: self.reason.clone(),
            rule: None,
        }
    }
}

/// Asks a person about a block and waits for the answer: a terminal prompt, the daemon's API.
/// It tells its own events (`approval_requested`, `approval_decided`), since only it knows
/// when a decision was stored.
pub trait Approver: Send + Sync {
    /// The ruling on `ask`, or `None` when `cancel` fired first.
    fn decide<'a>(
        &'a self,
        ask: Ask,
        timeout: Duration,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Option<Ruling>>;
}

/// The operator's policy and the task's, and who to ask.
#[derive(Clone)]
pub struct ApprovalGate {
    policies: Vec<Compiled>,
    timeout: Duration,
    approver: Option<Arc<dyn Approver>>,
    guard: Option<Guard>,
}

/// Asked after a block (or a tool call) is cleared to run and before it runs: `false` stops
/// it, as a cancel does. A daemon confirms here that its lease on the task is still its own,
/// so a daemon that lost the task runs nothing more of it.
pub type Guard = Arc<dyn Fn() -> futures::future::BoxFuture<'static, bool> + Send + Sync>;

impl std::fmt::Debug for ApprovalGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApprovalGate")
            .field("policies", &self.policies)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// How long a request waits for a decision unless the operator says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

impl ApprovalGate {
    /// A gate over `operator`'s policy tightened by `task`'s.
    pub fn new(
        operator: &ApprovalPolicy,
        task: Option<&ApprovalPolicy>,
    ) -> Result<Self, ApprovalError> {
        let mut policies = vec![Compiled::new(operator)?];
        let mut timeout = operator
            .timeout_secs
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
        if let Some(task) = task {
            policies.push(Compiled::new(task)?);
            if let Some(secs) = task.timeout_secs {
                timeout = timeout.min(Duration::from_secs(secs));
            }
        }
        Ok(Self {
            policies,
            timeout,
            approver: None,
            guard: None,
        })
    }

    /// Asks `approver` when a policy says to ask.
    pub fn with_approver(mut self, approver: Arc<dyn Approver>) -> Self {
        self.approver = Some(approver);
        self
    }

    /// Asks `guard` before anything it clears runs.
    pub fn with_guard(mut self, guard: Guard) -> Self {
        self.guard = Some(guard);
        self
    }

    /// Whether some block or call could be asked about (so a person must be there to answer):
    /// `ask_tools` asks in every mode.
    pub fn may_ask(&self) -> bool {
        self.policies
            .iter()
            .any(|p| p.mode != ApprovalMode::Never || !p.ask_tools.is_empty())
    }

    /// Whether the gate lets every block and call through (no deny rule, no tool denied,
    /// never asks).
    pub fn is_open(&self) -> bool {
        !self.may_ask()
            && self
                .policies
                .iter()
                .all(|p| p.deny.is_empty() && p.deny_tools.is_empty())
    }

    /// Whether every block runs unasked: no deny rule, and no mode that asks about blocks
    /// (rules about tools aside).
    pub fn blocks_open(&self) -> bool {
        self.policies
            .iter()
            .all(|p| p.mode == ApprovalMode::Never && p.deny.is_empty())
    }

    /// The deny rule that refuses the command tool `argv`, run with `arguments` (the JSON its
    /// stdin gets) when given. A command is as much a program as a block: the rules search
    /// each of its words, the whole line, and the arguments both as sent and as each string
    /// in them decodes (an escape such as `\u0072m` must not hide `rm`).
    pub fn denies_command(&self, argv: &[String], arguments: Option<&str>) -> Option<String> {
        let texts = command_texts(argv, arguments);
        self.policies
            .iter()
            .find_map(|p| p.denying(&texts))
            .map(str::to_owned)
    }

    /// The strictest verdict on a call of command tool `name` (`argv`) with `arguments`: its
    /// name's, or a deny rule's on what it would run.
    fn command_verdict(&self, name: &str, argv: &[String], arguments: &str) -> Verdict {
        match self.denies_command(argv, Some(arguments)) {
            Some(rule) => Verdict::Deny { rule },
            None => self.tool_verdict(name),
        }
    }

    /// The strictest verdict of the policies on a block.
    pub fn verdict(&self, language: &Language, executor: &dyn Executor, code: &str) -> Verdict {
        self.policies
            .iter()
            .map(|p| p.verdict(language, executor, code))
            .max_by_key(rank)
            .unwrap_or(Verdict::Run)
    }

    /// The strictest verdict of the policies on a call of tool `name`.
    pub fn tool_verdict(&self, name: &str) -> Verdict {
        self.policies
            .iter()
            .map(|p| p.tool_verdict(name))
            .max_by_key(rank)
            .unwrap_or(Verdict::Run)
    }

    /// Decides a call of tool `name` with `arguments` (a person sees them as the code, and
    /// an edit replaces them): `Ok(arguments)` to run, `Err(reason)` for the model. A command
    /// tool's `argv` is judged by the deny rules with the arguments, a person's edit again.
    pub(crate) async fn decide_tool(
        &self,
        name: &str,
        argv: Option<&[String]>,
        arguments: &str,
        at: &BlockAt<'_>,
    ) -> Option<Result<String, String>> {
        let judge = |arguments: &str| match argv {
            Some(argv) => self.command_verdict(name, argv, arguments),
            None => self.tool_verdict(name),
        };
        self.settle(
            judge(arguments),
            &Language::new("tool"),
            arguments,
            "call",
            at,
            &judge,
        )
        .await
    }

    /// Why a block may not run where no person can be asked (an MCP tool call): the deny
    /// rule that refuses it, or the policy that would ask; `None` when it runs.
    pub fn unattended(
        &self,
        language: &Language,
        executor: &dyn Executor,
        code: &str,
    ) -> Option<String> {
        match self.verdict(language, executor, code) {
            Verdict::Run => None,
            Verdict::Deny { rule } => Some(denial(&rule, None)),
            Verdict::Ask { reason, .. } => Some(no_one_to_ask(&reason)),
        }
    }

    /// Decides the block `at` names: `Ok(code)` to run (edited or not),
    /// `Err(reason)` when it must not run (the reason is for the model). Rule denials are
    /// told here; asks by the approver. `None` when the task was cancelled while waiting.
    pub(crate) async fn decide(
        &self,
        language: &Language,
        executor: &dyn Executor,
        code: &str,
        at: &BlockAt<'_>,
    ) -> Option<Result<String, String>> {
        let verdict = self.verdict(language, executor, code);
        self.settle(verdict, language, code, "block", at, &|edited| {
            self.verdict(language, executor, edited)
        })
        .await
    }

    /// Carries out `verdict` on `code` (a block, or a tool call's arguments: `what`): runs
    /// it, tells a rule's denial, or asks; `recheck` judges a person's edit.
    async fn settle(
        &self,
        verdict: Verdict,
        language: &Language,
        code: &str,
        what: &str,
        at: &BlockAt<'_>,
        recheck: &(dyn Fn(&str) -> Verdict + Sync),
    ) -> Option<Result<String, String>> {
        let settled = self
            .verdict_of(verdict, language, code, what, at, recheck)
            .await;
        if let (Some(Ok(_)), Some(guard)) = (&settled, &self.guard)
            && !guard().await
        {
            return None;
        }
        settled
    }

    async fn verdict_of(
        &self,
        verdict: Verdict,
        language: &Language,
        code: &str,
        what: &str,
        at: &BlockAt<'_>,
        recheck: &(dyn Fn(&str) -> Verdict + Sync),
    ) -> Option<Result<String, String>> {
        let (turn, index, cancel) = (at.turn, at.index, at.cancel);
        let this = (what != "block").then(|| format!("this {what}"));
        match verdict {
            Verdict::Run => Some(Ok(code.to_owned())),
            Verdict::Deny { rule } => Some(Err(denied_by_rule(at, &rule, this.as_deref()))),
            Verdict::Ask { rule, reason } => {
                let Some(approver) = &self.approver else {
                    return Some(Err(no_one_to_ask(&reason)));
                };
                let span = crate::trace::approval(what, rule.as_deref().unwrap_or("policy"));
                let ask = Ask {
                    turn,
                    index,
                    language: language.clone(),
                    code: code.to_owned(),
                    rule,
                    reason,
                };
                let ruling = approver
                    .decide(ask, self.timeout, cancel)
                    .instrument(span.clone())
                    .await;
                let Some(ruling) = ruling else {
                    crate::trace::set(&span, "tandem.approval.decision", "cancelled");
                    return None;
                };
                crate::trace::set(
                    &span,
                    "tandem.approval.decision",
                    match ruling.decision {
                        Decision::Approve => "approve",
                        Decision::Deny => "deny",
                    },
                );
                crate::trace::set(&span, "tandem.approval.by", ruling.by.clone());
                Some(match ruling.decision {
                    // An approver's edit is new code: the deny rules hold for it as for the
                    // model's, so an approval cannot carry what a rule refuses.
                    Decision::Approve => match ruling.code {
                        Some(edited) => match recheck(&edited) {
                            Verdict::Deny { rule } => {
                                Err(denied_by_rule(at, &rule, Some("the edited code")))
                            }
                            Verdict::Run | Verdict::Ask { .. } => Ok(edited),
                        },
                        None => Ok(code.to_owned()),
                    },
                    Decision::Deny => Err(match (ruling.by.as_str(), ruling.reason) {
                        ("timeout", _) => format!(
                            "no one approved it within {} s, so it was denied",
                            self.timeout.as_secs()
                        ),
                        (_, Some(reason)) if !reason.trim().is_empty() => {
                            format!("the user declined to run this {what}: {}", reason.trim())
                        }
                        _ => format!("the user declined to run this {what}"),
                    }),
                })
            }
        }
    }
}

/// The strictness of a verdict: the strictest of several policies' wins.
fn rank(v: &Verdict) -> u8 {
    match v {
        Verdict::Run => 0,
        Verdict::Ask { .. } => 1,
        Verdict::Deny { .. } => 2,
    }
}

/// Which block a decision is about, where its events go, and what stops a wait for it.
pub(crate) struct BlockAt<'a> {
    /// Turn number.
    pub turn: u32,
    /// The block's index in the reply.
    pub index: u32,
    pub events: &'a EventSink,
    pub cancel: &'a CancellationToken,
}

/// Tells that deny rule `rule` refused the block `at` (its `what`, when not the model's code),
/// and returns what the model is told.
fn denied_by_rule(at: &BlockAt<'_>, rule: &str, what: Option<&str>) -> String {
    (at.events)(EventMsg::ApprovalDecided {
        turn: at.turn,
        index: at.index,
        n: 0,
        decision: Decision::Deny,
        by: "rule".to_owned(),
        code: None,
        reason: what.map(str::to_owned),
        rule: Some(rule.to_owned()),
    });
    denial(rule, what)
}

/// What the model is told of code (`what`, else the block) that deny rule `rule` refuses.
fn denial(rule: &str, what: Option<&str>) -> String {
    format!(
        "the operator's approval policy does not allow {} (deny rule `{rule}`)",
        what.unwrap_or("this code")
    )
}

/// What the deny rules search of a command tool's run: each word of `argv`, the words as one
/// line, and `arguments` as sent and each string (key or value) in it decoded.
fn command_texts(argv: &[String], arguments: Option<&str>) -> Vec<String> {
    let mut texts = argv.to_vec();
    texts.push(argv.join(" "));
    if let Some(arguments) = arguments {
        texts.push(arguments.to_owned());
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(arguments) {
            let mut stack = vec![&value];
            while let Some(v) = stack.pop() {
                match v {
                    serde_json::Value::String(s) => texts.push(s.clone()),
                    serde_json::Value::Array(items) => stack.extend(items),
                    serde_json::Value::Object(map) => {
                        for (k, v) in map {
                            texts.push(k.clone());
                            stack.push(v);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    texts
}

/// What the model is told of a block that needs a person's approval when no one can be asked.
fn no_one_to_ask(reason: &str) -> String {
    format!("it needs a person's approval ({reason}) and no one can be asked here")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_executor::{BoxFuture as ExecFuture, ExecError, Session, SessionSpec};
    use tandem_protocol::{ApprovalRule, AutoApprove};

    /// An executor that only has a name and a network answer: verdicts need nothing else.
    struct Named(&'static str, bool);

    impl Executor for Named {
        fn name(&self) -> &str {
            self.0
        }
        fn languages(&self) -> &[Language] {
            &[]
        }
        fn open(&self, _: SessionSpec) -> ExecFuture<'_, Result<Box<dyn Session>, ExecError>> {
            Box::pin(async { Err(ExecError::Backend("not for running".to_owned())) })
        }
        fn network(&self) -> bool {
            self.1
        }
    }

    fn rule(name: &str, pattern: &str) -> ApprovalRule {
        ApprovalRule {
            name: name.to_owned(),
            pattern: pattern.to_owned(),
        }
    }

    fn operator() -> ApprovalPolicy {
        ApprovalPolicy {
            mode: ApprovalMode::Policy,
            auto_approve: AutoApprove {
                languages: vec!["py".to_owned()],
                executors: vec!["wasm".to_owned()],
                tools: vec!["lookup".to_owned()],
            },
            ask: vec![rule("pip", r"pip\s+install")],
            ask_network: true,
            ask_tools: vec!["wire_money".to_owned()],
            deny_tools: vec!["format_disk".to_owned()],
            deny: vec![rule("rm root", r"rm\s+-rf\s+/")],
            timeout_secs: Some(60),
        }
    }

    #[test]
    fn the_strictest_policy_wins_and_rules_are_named() {
        let gate = ApprovalGate::new(&operator(), None).unwrap();
        let (py, sh) = (Language::python(), Language::sh());
        let (local, docker, wasm) = (
            Named("local", false),
            Named("docker", true),
            Named("wasm", false),
        );
        let ask = |rule: Option<&str>, reason: &str| Verdict::Ask {
            rule: rule.map(str::to_owned),
            reason: reason.to_owned(),
        };
        assert_eq!(gate.verdict(&py, &local, "print(1)"), Verdict::Run);
        assert_eq!(gate.verdict(&sh, &wasm, "echo"), Verdict::Run);
        // Tools by name: approved, asked about, denied, and asked about when no rule says.
        assert_eq!(gate.tool_verdict("lookup"), Verdict::Run);
        assert_eq!(
            gate.tool_verdict("wire_money"),
            ask(
                Some("ask_tools wire_money"),
                "calls of tool `wire_money` are asked about (ask_tools)"
            )
        );
        assert_eq!(
            gate.tool_verdict("format_disk"),
            Verdict::Deny {
                rule: "deny_tools format_disk".to_owned()
            }
        );
        assert_eq!(
            gate.tool_verdict("other"),
            ask(None, "no rule approves tool `other`")
        );
        assert_eq!(
            gate.verdict(&sh, &local, "echo"),
            ask(None, "no rule approves sh on the local executor")
        );
        assert_eq!(
            gate.verdict(&py, &local, "# pip  install x"),
            ask(Some("pip"), "the code matches the ask rule `pip`")
        );
        assert_eq!(
            gate.verdict(&py, &docker, "print(1)"),
            ask(
                Some("network"),
                "the docker executor's sandbox can reach the network"
            )
        );
        // Deny beats every other rule.
        assert_eq!(
            gate.verdict(&py, &local, "pip install x; rm -rf /"),
            Verdict::Deny {
                rule: "rm root".to_owned()
            }
        );

        // A task cannot loosen: "never" and its own auto-approvals change nothing...
        let loose = ApprovalPolicy {
            auto_approve: AutoApprove {
                languages: vec!["sh".to_owned()],
                executors: Vec::new(),
                tools: vec!["send_mail".to_owned()],
            },
            ..ApprovalPolicy::default()
        };
        let gate = ApprovalGate::new(&operator(), Some(&loose)).unwrap();
        assert_eq!(
            gate.tool_verdict("send_mail"),
            ask(None, "no rule approves tool `send_mail`")
        );
        assert!(matches!(
            gate.verdict(&sh, &local, "echo"),
            Verdict::Ask { .. }
        ));
        assert!(matches!(
            gate.verdict(&py, &local, "rm -rf /"),
            Verdict::Deny { .. }
        ));
        // ...but it tightens: "always" asks for what the operator lets run, its deny rules
        // add to the operator's, and its timeout can only be shorter.
        let strict = ApprovalPolicy {
            mode: ApprovalMode::Always,
            deny: vec![rule("no sleep", "sleep")],
            timeout_secs: Some(3600),
            ..ApprovalPolicy::default()
        };
        let gate = ApprovalGate::new(&operator(), Some(&strict)).unwrap();
        assert!(matches!(
            gate.verdict(&py, &local, "print(1)"),
            Verdict::Ask { .. }
        ));
        assert_eq!(
            gate.verdict(&py, &wasm, "time.sleep(1)"),
            Verdict::Deny {
                rule: "no sleep".to_owned()
            }
        );
        assert_eq!(gate.timeout, Duration::from_secs(60));
    }

    #[test]
    fn a_policy_that_cannot_work_is_refused_naming_the_rule() {
        let mut bad = operator();
        bad.ask.push(rule("broken", "(unclosed"));
        let e = ApprovalGate::new(&bad, None).unwrap_err().to_string();
        assert!(
            e.starts_with("approval rule `broken` (ask): the pattern is not a regular expression"),
            "{e}"
        );
        let mut unnamed = operator();
        unnamed.deny.push(rule(" ", "x"));
        assert_eq!(
            ApprovalGate::new(&unnamed, None).unwrap_err().to_string(),
            "an approval rule in `deny` has an empty name; give every rule a name to report"
        );
        let zero = ApprovalPolicy {
            timeout_secs: Some(0),
            ..ApprovalPolicy::default()
        };
        assert!(ApprovalGate::new(&operator(), Some(&zero)).is_err());
        // Nothing to check: the gate is open and never asks.
        let open = ApprovalGate::new(&ApprovalPolicy::default(), None).unwrap();
        assert!(open.is_open() && !open.may_ask());
    }

    #[test]
    fn tool_rules_close_the_gate_in_never_mode_and_deny_rules_see_commands() {
        // "never" with rules about tools alone still has something to judge.
        let deny_tools = ApprovalPolicy {
            deny_tools: vec!["erase".to_owned()],
            ..ApprovalPolicy::default()
        };
        let gate = ApprovalGate::new(&deny_tools, None).unwrap();
        assert!(!gate.is_open() && gate.blocks_open() && !gate.may_ask());
        let ask_tools = ApprovalPolicy {
            ask_tools: vec!["send_mail".to_owned()],
            ..ApprovalPolicy::default()
        };
        let gate = ApprovalGate::new(&ask_tools, None).unwrap();
        assert!(!gate.is_open() && gate.may_ask());

        let never = ApprovalPolicy {
            deny: vec![rule("rm root", r"rm\s+-rf\s+/")],
            ..ApprovalPolicy::default()
        };
        let gate = ApprovalGate::new(&never, None).unwrap();
        let argv = |words: &[&str]| words.iter().map(|w| (*w).to_owned()).collect::<Vec<_>>();
        let denied = Some("rm root".to_owned());
        // In the program's words, across them, and in the arguments (escaped or not).
        assert_eq!(
            gate.denies_command(&argv(&["sh", "-c", "rm -rf /"]), None),
            denied
        );
        assert_eq!(
            gate.denies_command(&argv(&["rm", "-rf", "/"]), None),
            denied
        );
        let sh = argv(&["sh", "-c", "sh"]);
        assert_eq!(gate.denies_command(&sh, None), None);
        assert_eq!(
            gate.denies_command(&sh, Some(r#"{"cmd": "rm -rf /"}"#)),
            denied
        );
        assert_eq!(
            gate.denies_command(&sh, Some(r#"{"cmd": ["rm\n-rf\t/"]}"#)),
            denied
        );
        assert_eq!(
            gate.denies_command(&sh, Some(r#"{"cmd": "\u0072m -rf /"}"#)),
            denied
        );
        assert_eq!(gate.denies_command(&sh, Some(r#"{"cmd": "ls /"}"#)), None);
        assert_eq!(
            gate.command_verdict("x", &sh, r#"{"cmd": "rm -rf /"}"#),
            Verdict::Deny {
                rule: "rm root".to_owned()
            }
        );
        assert_eq!(gate.command_verdict("x", &sh, "{}"), Verdict::Run);
    }
}
