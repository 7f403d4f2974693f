//! Checking a [`TeamSpec`] before anything runs: every error at once, each named by the path
//! of the bad field (`agents.critic.escalate: ...`), and the checked team as a tree.

use std::collections::{BTreeMap, BTreeSet};

use tandem_protocol::team::{AgentSpec, Kind, SelectionKind, TeamBounds, TeamSpec, Termination};

/// The name of the top agent, `[team]` in a file.
pub const TOP: &str = "team";

/// Names of the model calls a chat makes itself, which speak under its path.
const RESERVED: [&str; 2] = ["selector", "termination"];

/// A checked agent and, for a team, its members in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Its name (`team` for the top agent).
    pub name: String,
    /// Names from the top down to it, joined by `/` (`team/refine/critic`).
    pub path: String,
    /// What the file says of it.
    pub spec: AgentSpec,
    /// Its members, when it is a team.
    pub members: Vec<Node>,
}

/// A team file that does not check: every problem, each one line that starts with the path
/// of the field it is about.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.join("\n"))]
pub struct TeamErrors(pub Vec<String>);

/// Fields each kind may set, besides `kind`, `description` and the hooks.
fn allowed(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Assistant => &["instructions", "model", "base_url", "escalate"],
        Kind::Executor => &["executor", "languages", "no_code_reply", "keep_state"],
        Kind::Chat => &["agents", "selection", "initial", "termination", "aggregate"],
        Kind::Loop => &["agents", "max_iterations"],
        Kind::Sequence => &["agents"],
        Kind::Parallel => &["agents", "fail_fast"],
    }
}

/// The fields an agent sets, by their names in files.
fn set_fields(a: &AgentSpec) -> Vec<&'static str> {
    [
        ("instructions", a.instructions.is_some()),
        ("model", a.model.is_some()),
        ("base_url", a.base_url.is_some()),
        ("escalate", a.escalate.is_some()),
        ("executor", a.executor.is_some()),
        ("languages", a.languages.is_some()),
        ("no_code_reply", a.no_code_reply.is_some()),
        ("keep_state", a.keep_state.is_some()),
        ("agents", a.agents.is_some()),
        ("selection", a.selection.is_some()),
        ("initial", a.initial.is_some()),
        ("termination", a.termination.is_some()),
        ("aggregate", a.aggregate.is_some()),
        ("max_iterations", a.max_iterations.is_some()),
        ("fail_fast", a.fail_fast.is_some()),
    ]
    .into_iter()
    .filter_map(|(name, set)| set.then_some(name))
    .collect()
}

/// Checks a team within the default [`TeamBounds`]; on success, the tree of agents from the
/// top.
pub fn check(spec: &TeamSpec) -> Result<Node, TeamErrors> {
    check_within(spec, &TeamBounds::default())
}

/// Checks a team within `bounds`; on success, the tree of agents from the top.
pub fn check_within(spec: &TeamSpec, bounds: &TeamBounds) -> Result<Node, TeamErrors> {
    // Before anything else walks the agents: a file past this bound is refused whole.
    let agents = spec.agents.len() + 1;
    if agents > bounds.max_agents {
        return Err(TeamErrors(vec![format!(
            "agents: the team has {agents} agents (the top one counted); at most {} are allowed ([teams] max_agents in the daemon's config)",
            bounds.max_agents
        )]));
    }
    let mut errors = Vec::new();
    let mut parent: BTreeMap<&str, String> = BTreeMap::new();
    let all =
        std::iter::once((TOP, &spec.team)).chain(spec.agents.iter().map(|(n, a)| (n.as_str(), a)));
    for (name, agent) in all.clone() {
        let at = field_path(name);
        if name == TOP && spec.agents.contains_key(TOP) {
            errors.push(format!(
                "agents.{TOP}: `{TOP}` is the top agent's name; call this one something else"
            ));
        }
        if RESERVED.contains(&name) {
            errors.push(format!(
                "{at}: `{name}` is reserved (a chat's selector and judge speak under it); call this agent something else"
            ));
        }
        if !valid_name(name) {
            errors.push(format!(
                "{at}: the name `{name}` must be 1 to 64 letters, digits, `_` or `-` (it is sent to the model as the speaker's name)"
            ));
        }
        check_agent(name, agent, spec, &mut errors);
        for member in agent.agents.iter().flatten() {
            if let Some(first) = parent.insert(member.as_str(), name.to_owned()) {
                if first != name {
                    errors.push(format!(
                        "{at}.agents: `{member}` is already a member of `{first}`; an agent belongs to one team"
                    ));
                } else {
                    errors.push(format!("{at}.agents: `{member}` is listed twice"));
                }
            }
        }
    }
    for name in spec.agents.keys() {
        if !parent.contains_key(name.as_str()) && name != TOP {
            errors.push(format!(
                "agents.{name}: not a member of any team; list it in a team's `agents` or remove it"
            ));
        }
    }
    // Escalation ends the innermost loop around the agent that says the word; a loop
    // stops at max_iterations or by such an escalation.
    let mut escalated = BTreeSet::new();
    for (name, agent) in all.clone() {
        if agent.escalate.is_some() {
            match innermost_loop(name, spec, &parent) {
                Some(up) => {
                    escalated.insert(up);
                }
                None => errors.push(format!(
                    "{}.escalate: `{name}` is not inside a loop, so there is nothing for it to end",
                    field_path(name)
                )),
            }
        }
    }
    for (name, agent) in all {
        if agent.kind == Kind::Loop && agent.max_iterations.is_none() && !escalated.contains(name) {
            errors.push(format!(
                "{}: a loop needs a way to stop: max_iterations, or a member with escalate",
                field_path(name)
            ));
        }
        let members = agent.agents.as_ref().map_or(0, Vec::len);
        if agent.kind == Kind::Parallel && members > bounds.max_parallel {
            errors.push(format!(
                "{}.agents: a parallel runs its {members} members at once; at most {} are allowed ([teams] max_parallel in the daemon's config)",
                field_path(name),
                bounds.max_parallel
            ));
        }
    }
    // Every agent has one parent here, so walking up ends at the top or, in a cycle that
    // does not reach it, after the bound: building the tree below then recurses at most
    // `max_depth` times, however deep the names nest.
    if errors.is_empty()
        && let Some(error) = too_deep(spec, &parent, bounds.max_depth)
    {
        errors.push(error);
    }
    if errors.is_empty() {
        let mut seen = BTreeSet::new();
        let tree = build(TOP, &spec.team, TOP, spec, &mut seen, &mut errors);
        if errors.is_empty() {
            return Ok(tree);
        }
    }
    Err(TeamErrors(errors))
}

/// The first agent found nested more than `max` teams deep (the top team is level 1), or
/// inside a cycle of teams that the top does not reach, said as an error; the walk up from
/// each agent stops after `max + 1` steps.
fn too_deep(spec: &TeamSpec, parent: &BTreeMap<&str, String>, max: usize) -> Option<String> {
    spec.agents.keys().find_map(|name| {
        let mut at = name.as_str();
        let mut depth = 0;
        while let Some(up) = parent.get(at) {
            depth += 1;
            if up == name {
                return Some(format!(
                    "{}.agents: `{name}` contains itself through its members: a team cannot contain itself",
                    field_path(up)
                ));
            }
            if depth > max {
                return Some(format!(
                    "{}: nested more than {max} teams deep; at most {max} levels are allowed ([teams] max_depth in the daemon's config)",
                    field_path(name)
                ));
            }
            at = up;
        }
        None
    })
}

fn field_path(name: &str) -> String {
    if name == TOP {
        TOP.to_owned()
    } else {
        format!("agents.{name}")
    }
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The nearest loop that contains `name`, if any.
fn innermost_loop<'a>(
    name: &str,
    spec: &TeamSpec,
    parent: &'a BTreeMap<&str, String>,
) -> Option<&'a str> {
    let mut at = name;
    // Bounded by the number of agents, so a cycle (reported elsewhere) cannot spin here.
    for _ in 0..=spec.agents.len() {
        let up = parent.get(at)?;
        let kind = if up == TOP {
            spec.team.kind
        } else {
            spec.agents.get(up).map_or(Kind::Assistant, |a| a.kind)
        };
        if kind == Kind::Loop {
            return Some(up);
        }
        at = up;
    }
    None
}

fn check_agent(name: &str, a: &AgentSpec, spec: &TeamSpec, errors: &mut Vec<String>) {
    let at = field_path(name);
    let kind = a.kind;
    for field in set_fields(a) {
        if !allowed(kind).contains(&field) {
            errors.push(format!(
                "{at}.{field}: not a field of an agent of kind `{}` (it takes: {})",
                kind.as_str(),
                ["kind", "description"]
                    .iter()
                    .chain(allowed(kind))
                    .chain(&["keep_last", "max_output_bytes", "redact"])
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    for (field, value) in [
        ("keep_last", a.keep_last),
        ("max_output_bytes", a.max_output_bytes),
    ] {
        if value == Some(0) {
            errors.push(format!("{at}.{field}: must be at least 1"));
        }
    }
    for (i, pattern) in a.redact.iter().flatten().enumerate() {
        if let Err(e) = regex::Regex::new(pattern) {
            errors.push(format!("{at}.redact[{i}]: not a regular expression: {e}"));
        }
    }
    if a.escalate.as_deref().is_some_and(|w| w.trim().is_empty()) {
        errors.push(format!("{at}.escalate: must not be empty"));
    }
    if !kind.is_team() {
        return;
    }
    let members = a.agents.as_deref().unwrap_or_default();
    if members.is_empty() {
        errors.push(format!(
            "{at}.agents: a `{}` needs at least one member",
            kind.as_str()
        ));
    }
    for member in members {
        if member == TOP || !spec.agents.contains_key(member) {
            errors.push(format!(
                "{at}.agents: `{member}` is not defined; add an [agents.{member}] section"
            ));
        }
    }
    let kind_of = |m: &str| spec.agents.get(m).map(|a| a.kind);
    match kind {
        Kind::Chat => {
            if let Some(initial) = &a.initial
                && !members.contains(initial)
            {
                errors.push(format!(
                    "{at}.initial: `{initial}` is not a member of this chat ({})",
                    members.join(", ")
                ));
            }
            if let Some(table) = match &a.selection {
                Some(tandem_protocol::team::Selection::Table(t)) => Some(t),
                _ => None,
            } && table.kind == SelectionKind::RoundRobin
                && (table.prompt.is_some() || table.model.is_some())
            {
                errors.push(format!(
                    "{at}.selection: `prompt` and `model` are options of `llm` selection"
                ));
            }
            match &a.termination {
                None => errors.push(format!(
                    "{at}.termination: a chat needs a way to stop, such as termination = {{ max_turns = 12 }} or a mention"
                )),
                Some(t) => check_termination(&format!("{at}.termination"), t, members, errors),
            }
            if name == TOP && a.aggregate.is_some() {
                errors.push(format!(
                    "{at}.aggregate: only a chat inside another team aggregates"
                ));
            }
        }
        Kind::Loop if a.max_iterations == Some(0) => {
            errors.push(format!("{at}.max_iterations: must be at least 1"));
        }
        Kind::Parallel if members.iter().any(|m| kind_of(m) == Some(Kind::Executor)) => {
            errors.push(format!(
                "{at}.agents: an executor runs the code of the message before it, which a parallel member does not have; put it in a chat or sequence with the agent that writes the code"
            ));
        }
        _ => {}
    }
}

const TERMINATION_KINDS: &str = "mention, ends_with, regex, answered, examples_held, repeated, max_turns, timeout, token_budget, llm, any, all";

fn check_termination(at: &str, t: &Termination, members: &[String], errors: &mut Vec<String>) {
    let set = [
        t.mention.is_some(),
        t.ends_with.is_some(),
        t.regex.is_some(),
        t.answered.is_some(),
        t.examples_held.is_some(),
        t.repeated.is_some(),
        t.max_turns.is_some(),
        t.timeout.is_some(),
        t.token_budget.is_some(),
        t.llm.is_some(),
        t.any.is_some(),
        t.all.is_some(),
    ]
    .into_iter()
    .filter(|s| *s)
    .count();
    if set != 1 {
        errors.push(format!(
            "{at}: give exactly one of {TERMINATION_KINDS} (combine several with any or all)"
        ));
        return;
    }
    if t.agents.is_some()
        && t.mention.is_none()
        && t.ends_with.is_none()
        && t.regex.is_none()
        && t.answered.is_none()
    {
        errors.push(format!(
            "{at}.agents: only `mention`, `ends_with`, `regex` and `answered` are limited to some agents"
        ));
    }
    if t.after_run.is_some() && t.ends_with.is_none() {
        errors.push(format!(
            "{at}.after_run: only `ends_with` waits for a run of the message's code"
        ));
    }
    if t.after_run == Some(false) {
        errors.push(format!(
            "{at}.after_run: true is the only value; leave it out to end as soon as the word is said"
        ));
    }
    if t.examples_held == Some(false) {
        errors.push(format!(
            "{at}.examples_held: true is the only value; leave the condition out to not end when the examples hold"
        ));
    }
    if t.repeated == Some(false) {
        errors.push(format!(
            "{at}.repeated: true is the only value; leave the condition out to let a model resend the same code"
        ));
    }
    if t.answered == Some(false) {
        errors.push(format!(
            "{at}.answered: true is the only value; leave the condition out to not end on an answer"
        ));
    }
    for agent in t.agents.iter().flatten() {
        if !members.contains(agent) {
            errors.push(format!(
                "{at}.agents: `{agent}` is not a member of this chat ({})",
                members.join(", ")
            ));
        }
    }
    for (field, word) in [("mention", &t.mention), ("ends_with", &t.ends_with)] {
        if word.as_deref().is_some_and(|m| m.trim().is_empty()) {
            errors.push(format!("{at}.{field}: must not be empty"));
        }
    }
    if let Some(pattern) = &t.regex
        && let Err(e) = regex::Regex::new(pattern)
    {
        errors.push(format!("{at}.regex: not a regular expression: {e}"));
    }
    for (field, value) in [
        ("max_turns", t.max_turns.map(u64::from)),
        ("timeout", t.timeout),
        ("token_budget", t.token_budget),
    ] {
        if value == Some(0) {
            errors.push(format!("{at}.{field}: must be at least 1"));
        }
    }
    for (field, list) in [("any", &t.any), ("all", &t.all)] {
        if let Some(list) = list {
            if list.is_empty() {
                errors.push(format!("{at}.{field}: list at least one condition"));
            }
            for (i, inner) in list.iter().enumerate() {
                check_termination(&format!("{at}.{field}[{i}]"), inner, members, errors);
            }
        }
    }
}

/// The tree from `name` down; a name met twice on one path is a cycle.
fn build(
    name: &str,
    agent: &AgentSpec,
    path: &str,
    spec: &TeamSpec,
    on_path: &mut BTreeSet<String>,
    errors: &mut Vec<String>,
) -> Node {
    on_path.insert(name.to_owned());
    let mut members = Vec::new();
    for member in agent.agents.iter().flatten() {
        if on_path.contains(member) {
            errors.push(format!(
                "{}.agents: `{member}` contains `{name}`, which contains it: a team cannot contain itself",
                field_path(name)
            ));
            continue;
        }
        if let Some(m) = spec.agents.get(member) {
            members.push(build(
                member,
                m,
                &format!("{path}/{member}"),
                spec,
                on_path,
                errors,
            ));
        }
    }
    on_path.remove(name);
    Node {
        name: name.to_owned(),
        path: path.to_owned(),
        spec: agent.clone(),
        members,
    }
}

impl Node {
    /// The tree as `tandem team check` prints it: one line per agent, members indented.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.render_into(&mut out, "", "");
        out
    }

    fn render_into(&self, out: &mut String, first: &str, rest: &str) {
        out.push_str(first);
        out.push_str(&self.name);
        out.push_str(" (");
        out.push_str(&self.summary());
        out.push(')');
        if let Some(d) = &self.spec.description {
            out.push_str(": ");
            out.push_str(d);
        }
        out.push('\n');
        for (i, m) in self.members.iter().enumerate() {
            let last = i + 1 == self.members.len();
            let (branch, more) = if last {
                ("└─ ", "   ")
            } else {
                ("├─ ", "│  ")
            };
            m.render_into(out, &format!("{rest}{branch}"), &format!("{rest}{more}"));
        }
    }

    fn summary(&self) -> String {
        let s = &self.spec;
        let mut parts = vec![s.kind.as_str().to_owned()];
        match s.kind {
            Kind::Assistant => {
                if let Some(m) = &s.model {
                    parts.push(format!("model {m}"));
                }
                if let Some(w) = &s.escalate {
                    parts.push(format!("escalates with {w}"));
                }
            }
            Kind::Executor => {
                parts.push(
                    s.executor
                        .clone()
                        .unwrap_or_else(|| "the task's executor".to_owned()),
                );
                if let Some(l) = &s.languages {
                    parts.push(l.join(", "));
                }
            }
            Kind::Chat => {
                let kind = s
                    .selection
                    .as_ref()
                    .map_or(SelectionKind::RoundRobin, |x| x.kind());
                let first = s
                    .initial
                    .clone()
                    .or_else(|| self.members.first().map(|m| m.name.clone()))
                    .unwrap_or_default();
                parts.push(match kind {
                    SelectionKind::RoundRobin => format!("round robin from {first}"),
                    SelectionKind::Llm => format!("llm selection, fallback {first}"),
                });
                if let Some(t) = &s.termination {
                    parts.push(format!("stops: {}", describe(t)));
                }
                if let Some(a) = s.aggregate {
                    parts.push(format!(
                        "aggregate {}",
                        if a == tandem_protocol::team::Aggregate::Nested {
                            "nested"
                        } else {
                            "flat"
                        }
                    ));
                }
            }
            Kind::Loop => {
                parts.push(s.max_iterations.map_or_else(
                    || "until an escalation".to_owned(),
                    |n| format!("at most {n} iterations"),
                ));
            }
            Kind::Sequence => {}
            Kind::Parallel => {
                if s.fail_fast == Some(true) {
                    parts.push("fail fast".to_owned());
                }
            }
        }
        parts.join(" · ")
    }
}

/// A termination condition in words, for the tree and for stop reports.
pub fn describe(t: &Termination) -> String {
    let by = |agents: &Option<Vec<String>>| {
        agents
            .as_ref()
            .map_or(String::new(), |a| format!(" by {}", a.join(" or ")))
    };
    let list = |name: &str, l: &[Termination]| {
        format!(
            "{name}({})",
            l.iter().map(describe).collect::<Vec<_>>().join(", ")
        )
    };
    if let Some(m) = &t.mention {
        format!("mention {m}{}", by(&t.agents))
    } else if let Some(w) = &t.ends_with {
        let after = if t.after_run.is_some() {
            " (after its code ran cleanly)"
        } else {
            ""
        };
        format!("ends_with {w}{after}{}", by(&t.agents))
    } else if let Some(r) = &t.regex {
        format!("regex /{r}/{}", by(&t.agents))
    } else if t.answered.is_some() {
        format!("an answer after a clean run{}", by(&t.agents))
    } else if t.examples_held.is_some() {
        "the task's examples held".to_owned()
    } else if t.repeated.is_some() {
        "the same code sent again, running the same".to_owned()
    } else if let Some(n) = t.max_turns {
        format!("max_turns {n}")
    } else if let Some(n) = t.timeout {
        format!("timeout {n} s")
    } else if let Some(n) = t.token_budget {
        format!("token_budget {n}")
    } else if let Some(q) = &t.llm {
        format!("llm: {q}")
    } else if let Some(l) = &t.any {
        list("any", l)
    } else if let Some(l) = &t.all {
        list("all", l)
    } else {
        "nothing".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use tandem_protocol::team::Aggregate;

    use super::*;

    fn agent(kind: Kind, members: &[&str]) -> AgentSpec {
        AgentSpec {
            kind,
            agents: (!members.is_empty())
                .then(|| members.iter().map(|m| (*m).to_owned()).collect()),
            ..AgentSpec::default()
        }
    }

    fn team(top: AgentSpec, agents: Vec<(&str, AgentSpec)>) -> TeamSpec {
        TeamSpec {
            team: top,
            agents: agents.into_iter().map(|(n, a)| (n.to_owned(), a)).collect(),
        }
    }

    fn errors(spec: &TeamSpec) -> Vec<String> {
        check(spec).err().map(|e| e.0).unwrap_or_default()
    }

    #[test]
    fn a_team_with_no_way_to_stop_is_refused() {
        let chat = team(
            agent(Kind::Chat, &["a"]),
            vec![("a", agent(Kind::Assistant, &[]))],
        );
        assert_eq!(
            errors(&chat),
            [
                "team.termination: a chat needs a way to stop, such as termination = { max_turns = 12 } or a mention"
            ]
        );
        let endless = team(
            agent(Kind::Loop, &["a"]),
            vec![("a", agent(Kind::Assistant, &[]))],
        );
        assert_eq!(
            errors(&endless),
            ["team: a loop needs a way to stop: max_iterations, or a member with escalate"]
        );
        // An escalation deeper down stops the loop too: the innermost loop is this one.
        let mut critic = agent(Kind::Assistant, &[]);
        critic.escalate = Some("STOP".to_owned());
        let nested = team(
            agent(Kind::Loop, &["steps"]),
            vec![
                ("steps", agent(Kind::Sequence, &["critic"])),
                ("critic", critic),
            ],
        );
        assert_eq!(errors(&nested), Vec::<String>::new());
    }

    #[test]
    fn every_problem_is_named_by_its_path() {
        let mut top = agent(Kind::Chat, &["a", "b"]);
        top.termination = Some(Termination {
            any: Some(vec![
                Termination {
                    mention: Some("DONE".to_owned()),
                    agents: Some(vec!["zed".to_owned()]),
                    ..Termination::default()
                },
                Termination {
                    max_turns: Some(0),
                    timeout: Some(5),
                    ..Termination::default()
                },
            ]),
            ..Termination::default()
        });
        top.aggregate = Some(Aggregate::Nested);
        let mut a = agent(Kind::Executor, &[]);
        a.instructions = Some("x".to_owned());
        a.redact = Some(vec!["(".to_owned()]);
        let spec = team(
            top,
            vec![
                ("a", a),
                ("b", agent(Kind::Loop, &["a"])),
                ("bad name", agent(Kind::Assistant, &[])),
            ],
        );
        let errors = errors(&spec);
        let has = |start: &str| errors.iter().any(|e| e.starts_with(start));
        for start in [
            "team.termination.any[0].agents: `zed` is not a member of this chat (a, b)",
            "team.termination.any[1]: give exactly one of",
            "team.aggregate: only a chat inside another team aggregates",
            "agents.a.instructions: not a field of an agent of kind `executor`",
            "agents.a.redact[0]: not a regular expression",
            "agents.b.agents: `a` is already a member of `team`",
            "agents.b: a loop needs a way to stop",
            "agents.bad name: the name `bad name` must be 1 to 64 letters",
            "agents.bad name: not a member of any team",
        ] {
            assert!(has(start), "missing `{start}` in {errors:#?}");
        }
    }

    #[test]
    fn a_team_cannot_contain_itself() {
        let spec = team(
            agent(Kind::Sequence, &["a"]),
            vec![
                ("a", agent(Kind::Sequence, &["b"])),
                ("b", agent(Kind::Sequence, &["a"])),
            ],
        );
        let errors = errors(&spec);
        assert!(
            errors
                .iter()
                .any(|e| e.contains("a team cannot contain itself")
                    || e.contains("is already a member of")),
            "{errors:#?}"
        );
    }

    #[test]
    fn a_checked_team_is_a_tree_with_paths() {
        let mut critic = agent(Kind::Assistant, &[]);
        critic.escalate = Some("STOP".to_owned());
        let mut refine = agent(Kind::Loop, &["writer", "critic"]);
        refine.max_iterations = Some(3);
        let spec = team(
            agent(Kind::Sequence, &["refine", "summariser"]),
            vec![
                ("refine", refine),
                ("writer", agent(Kind::Assistant, &[])),
                ("critic", critic),
                ("summariser", agent(Kind::Assistant, &[])),
            ],
        );
        let tree = check(&spec).unwrap();
        let critic = &tree.members[0].members[1];
        assert_eq!(critic.path, "team/refine/critic");
        assert_eq!(
            tree.render(),
            "team (sequence)\n├─ refine (loop · at most 3 iterations)\n│  ├─ writer (assistant)\n│  └─ critic (assistant · escalates with STOP)\n└─ summariser (assistant)\n"
        );
    }
}
