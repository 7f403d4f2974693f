//! The planner: the one place a [`TaskSpec`] becomes a task ready to run (its model, its
//! executor or team, its limits and its approval gate), checked against the policy the same
//! way whether the daemon, MCP or `tandem run` in the user's own process asked for it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_agent::chat::LocalModel;
use tandem_agent::team::{Node, Said, TaskLabel, Team, TeamErrors, executor_slot, run_team_task};
use tandem_agent::{
    ApprovalGate, Approver, ChatModel, EventSink, ModelConfig, TaskSettings, allowed_languages,
    render_system_prompt, run_task,
};
use tandem_executor::{
    CancellationToken, ExecError, ExecRequest, Executor, Language, Limits, Registry, SessionSpec,
};
use tandem_protocol::team::{Kind, TeamBounds, TeamSpec};
use tandem_protocol::{
    ApprovalPolicy, ErrorCode, ErrorInfo, Event, EventMsg, Message, Role, StopReason, TaskSpec,
};

use crate::error::{Invalid, Refusal, TaskError};
use crate::policy::{Policy, Refused};

/// The largest block without a task that any road runs.
pub const MAX_BLOCK_BYTES: usize = 1 << 20;

/// Defaults for what a [`TaskSpec`] leaves out.
#[derive(Clone, Debug)]
pub struct TaskDefaults {
    /// Executor name.
    pub executor: String,
    /// Most turns, when the operator set it; else a pair gets
    /// [`DEFAULT_MAX_TURNS`](tandem_agent::DEFAULT_MAX_TURNS) and a team
    /// [`DEFAULT_TEAM_TURNS`](tandem_agent::DEFAULT_TEAM_TURNS).
    pub max_turns: Option<u32>,
    /// Wall-clock limit per task.
    pub timeout: Option<Duration>,
    /// Termination string.
    pub termination: String,
    /// System prompt.
    pub system_prompt: String,
    /// Per-block limits.
    pub limits: Limits,
    /// How the assistant's code reaches the executor unless a task says.
    pub code_via: tandem_protocol::CodeVia,
    /// Budgets for a task that sets none of its own.
    pub budget: tandem_agent::budget::Budget,
}

impl Default for TaskDefaults {
    fn default() -> Self {
        Self {
            executor: "local".to_owned(),
            max_turns: None,
            timeout: None,
            termination: tandem_agent::DEFAULT_TERMINATION.to_owned(),
            system_prompt: tandem_agent::DEFAULT_SYSTEM_PROMPT.to_owned(),
            limits: Limits::default(),
            code_via: tandem_protocol::CodeVia::Blocks,
            budget: tandem_agent::budget::Budget::default(),
        }
    }
}

/// What the planner plans with, resolved once by the binary.
pub struct PlannerConfig {
    /// The model server and its settings; a task may override the URL and model.
    pub model: ModelConfig,
    /// The embedded model, loaded once, for every task that names no model server.
    pub local_model: Option<Arc<dyn LocalModel>>,
    /// The executors tasks can name.
    pub executors: Registry,
    /// Defaults for task settings.
    pub defaults: TaskDefaults,
    /// What a task may ask for.
    pub policy: Policy,
    /// The operator's approval policy; a task's can only tighten it.
    pub approval: ApprovalPolicy,
    /// How large a team may be.
    pub teams: TeamBounds,
    /// The operator's tools (`[tools.NAME]`, MCP servers started), the only ones a task can
    /// name.
    pub tools: tandem_agent::tools::Offered,
    /// What a million tokens of each model cost (`[model.prices]`), by model name.
    pub prices: std::collections::BTreeMap<String, tandem_agent::budget::Price>,
    /// The egress proxy and how a task's `network` meets `[network]` and the policy.
    pub network: NetworkConfig,
    /// The volumes tasks may mount; `None` on a road that keeps none.
    pub volumes: Option<tandem_volumes::Volumes>,
}

/// The egress proxy sandboxes with a network policy go behind, and the settings a task's
/// `network` request meets.
#[derive(Clone, Default)]
pub struct NetworkConfig {
    /// The proxy; `None` when it could not start, which leaves no task a network.
    pub egress: Option<tandem_egress::Egress>,
    /// Why the proxy could not start, when it could not: told to every task that asks for a
    /// network, and shown by `/v1/executors`.
    pub egress_down: Option<String>,
    /// `[network]`, `[policy] network_allow`, and whose road this is.
    pub rules: tandem_egress::Network,
    /// Each executor's `network` setting, by name; an executor not named here goes behind
    /// the proxy when a task has a policy, or is refused when it cannot.
    pub switches: HashMap<String, tandem_egress::Switch>,
}

impl NetworkConfig {
    /// The proxy and policy a sandbox without a task is held to: its `network` within what
    /// the operator allows, else `[network]`; `None` is no network.
    pub fn for_block(
        &self,
        asked: Option<&tandem_protocol::net::NetworkRequest>,
        executor: &dyn Executor,
    ) -> Result<Option<(tandem_egress::Egress, tandem_egress::Policy)>, Refusal> {
        let switched = self
            .switched_off(asked.is_some(), executor)
            .map_err(|problem| {
                Refusal::of_task(&TaskError::from(crate::error::Unavailable::Executor {
                    name: executor.name().to_owned(),
                    problem,
                }))
            })?;
        if switched {
            return Ok(None);
        }
        let policy = match self.rules.for_task(asked.map(|n| n.allow.as_slice())) {
            Ok(Some(policy)) => policy,
            Ok(None) => return Ok(None),
            Err(tandem_egress::NotGiven::Entry(e)) => return Err(Refusal::invalid(e.to_string())),
            Err(tandem_egress::NotGiven::Outside(why)) => {
                return Err(Refusal::of_task(&TaskError::NotAllowed(Refused(why))));
            }
        };
        let egress = self.proxy_for(executor).map_err(|problem| {
            Refusal::of_task(&TaskError::from(crate::error::Unavailable::Executor {
                name: executor.name().to_owned(),
                problem,
            }))
        })?;
        Ok(Some((egress, policy)))
    }

    /// The proxy a sandbox of `executor` with a network policy goes behind, or why it
    /// cannot: every road asks this one question.
    pub(crate) fn proxy_for(
        &self,
        executor: &dyn Executor,
    ) -> Result<tandem_egress::Egress, String> {
        let Some(egress) = self.egress.clone() else {
            let why = self
                .egress_down
                .as_deref()
                .map(|why| format!(" ({why})"))
                .unwrap_or_default();
            return Err(format!(
                "the egress proxy is not running{why}, and a sandbox with a network policy goes only through it (see `tandem doctor`)"
            ));
        };
        if !executor.carries_egress() {
            return Err("its sandboxes cannot be put behind Tandem's egress proxy, which a network policy needs; use the docker, kubernetes or confined local executor, or leave network out".to_owned());
        }
        Ok(egress)
    }

    /// What a task on `executor` that asks for hosts gets: `None` when it would be behind
    /// the proxy; else why not, as `/v1/executors` shows it.
    pub fn network_problem(&self, executor: &dyn Executor) -> Option<String> {
        match self.switches.get(executor.name()) {
            Some(tandem_egress::Switch::Off) => {
                Some("network = false: no sandbox has a network".to_owned())
            }
            Some(tandem_egress::Switch::Open) => {
                Some("network = true: the open network, unguarded".to_owned())
            }
            _ => self.proxy_for(executor).err(),
        }
    }

    /// Whether `executor`'s `network` setting decides alone: `true` when its sandboxes get
    /// no policy (off, or the open network), an error when a task `asked` for one it cannot
    /// give; `false` when the policy applies.
    pub(crate) fn switched_off(
        &self,
        asked: bool,
        executor: &dyn Executor,
    ) -> Result<bool, String> {
        let name = executor.name();
        match self.switches.get(name) {
            Some(tandem_egress::Switch::Off) if asked => Err(format!(
                "it has network = false in its config ([executors.{name}]), which never gives a network; an operator sets network = \"policy\" to put its sandboxes behind Tandem's egress proxy"
            )),
            Some(tandem_egress::Switch::Open) if asked => Err(format!(
                "it has network = true in its config ([executors.{name}]): the open network, which a task's network policy cannot narrow; an operator sets network = \"policy\" to put its sandboxes behind Tandem's egress proxy"
            )),
            Some(tandem_egress::Switch::Off | tandem_egress::Switch::Open) => Ok(true),
            Some(tandem_egress::Switch::Policy) | None => Ok(false),
        }
    }
}

/// What the model is told of its sandbox's network: the hosts, never a credential.
fn network_note(policy: &tandem_egress::Policy, egress: &tandem_egress::Egress) -> String {
    let hosts = policy.allowed_hosts();
    let mut note = if hosts.is_empty() {
        "Your code can reach no host on the network".to_owned()
    } else {
        format!(
            "Your code can reach these hosts over HTTP and HTTPS, and nothing else on the network: {}",
            hosts.join(", ")
        )
    };
    note.push_str(". Requests go through a proxy already set in the sandbox's environment (HTTP_PROXY, HTTPS_PROXY), so curl, pip, urllib and requests need no extra settings; a refused request answers 403 and names the rule.");
    if let Some(broker) = egress.broker() {
        let hosts: Vec<String> = broker
            .hosts()
            .into_iter()
            .map(|(name, host)| format!("{host} ({name})"))
            .collect();
        if !hosts.is_empty() {
            note.push_str(&format!(
                " Requests to {} carry credentials that the proxy adds on the way out: send them without any, and never ask for or print a token; your code cannot see the values.",
                hosts.join(", ")
            ));
        }
    }
    let kinds: Vec<tandem_egress::packages::Kind> =
        egress.packages().iter().map(|p| p.kind()).collect();
    if kinds.contains(&tandem_egress::packages::Kind::Python) {
        note.push_str(" You may install Python packages: `pip install NAME` (or `subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", NAME])` from Python) fetches them from a package index already configured, into your home; a module that is missing can be installed that way before it is imported.");
    }
    if kinds.contains(&tandem_egress::packages::Kind::Npm) {
        note.push_str(" You may install Node.js packages: `npm install NAME` fetches them from a registry already configured, into the working directory's node_modules.");
    }

    note
}

/// Turns task specs into runnable tasks; one per daemon, or per `tandem run`.
pub struct Planner {
    config: PlannerConfig,
    models: Mutex<HashMap<(String, String), ChatModel>>,
}

/// Where a planned task runs and what it already did.
#[derive(Default)]
pub struct Start<'a> {
    /// Labels every sandbox session of the task carries (for reaping and `docker ps`).
    pub labels: Vec<(String, String)>,
    /// A workspace of the caller's own to use and keep (only `tandem run` in-process).
    pub workdir: Option<PathBuf>,
    /// The task's stored events, when it resumes; empty for a new task.
    pub events: &'a [Event],
    /// Files the task was given, placed in every session it opens.
    pub inputs: Option<Inputs>,
}

/// Files a task was given: a tar archive on this host, and what the model is told of them.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// The archive, placed in each session's workspace when it opens; `None` when they are
    /// there already (a resumed task's workspace).
    pub archive: Option<PathBuf>,
    /// Their names, sizes and first lines, added to the task as the model reads it.
    pub listing: String,
}

/// What checking a task works out, so that planning it works out none of it again.
struct Checked {
    network: Option<tandem_egress::Policy>,
    output_schema: Option<Arc<tandem_agent::schema::OutputSchema>>,
    languages: Option<Vec<Language>>,
    team: Option<Node>,
    limits: Limits,
    gate: ApprovalGate,
    tools: Vec<tandem_agent::tools::Tool>,
}

/// A task ready to run.
pub struct Planned {
    settings: TaskSettings,
    gate: Option<ApprovalGate>,
    work: Work,
    executor: String,
    /// The task's model, by name (a team's default).
    model: String,
    /// What a resumed task tells the model of code its cut-off reply started: stored as the
    /// executor's message before it goes on, so the transcript says what the model read.
    told: Option<EventMsg>,
    /// The task's volumes, counted as mounted while the task runs.
    _volumes: Vec<tandem_volumes::Held>,
}

enum Work {
    Pair {
        model: Box<ChatModel>,
        executor: Arc<dyn Executor>,
    },
    Team {
        team: Box<Team>,
        label: TaskLabel,
        replay: tandem_agent::team::Replay,
        /// Where its sandboxes' connections are told, once the task's sink is known.
        net: Option<Arc<tandem_agent::LateNet>>,
        /// Where its sandboxes' ports are published, once the task's id is known.
        ports: Arc<crate::ports::LateBook>,
    },
}

impl Planner {
    /// A planner over `config`.
    pub fn new(config: PlannerConfig) -> Self {
        Self {
            config,
            models: Mutex::new(HashMap::new()),
        }
    }

    /// Every task that names no model server is answered by `local`, called `name`.
    pub fn with_local_model(mut self, local: Arc<dyn LocalModel>, name: String) -> Self {
        self.config.local_model = Some(local);
        self.config.model.model = name;
        self
    }

    /// What it plans with.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// The executors tasks can name.
    pub(crate) fn executors_mut(&mut self) -> &mut Registry {
        &mut self.config.executors
    }

    /// The executor a task runs on: the one it names, else the default.
    pub fn executor_name<'a>(&'a self, spec: &'a TaskSpec) -> &'a str {
        spec.executor
            .as_deref()
            .unwrap_or(&self.config.defaults.executor)
    }

    /// Executor `name`, when there is one and the policy offers it: the one check every road
    /// makes (a task, a team's agents, a restart, MCP).
    pub fn offered(&self, name: &str) -> Result<Arc<dyn Executor>, TaskError> {
        let executor = self.config.executors.get(name).map_err(Invalid::Executor)?;
        let policy = &self.config.policy;
        if !policy.offers(name) {
            return Err(Refused(policy.not_offered(name, &self.config.executors)).into());
        }
        Ok(executor)
    }

    /// The executor a block without a task runs on (`name`, else the default), when the
    /// policy offers it.
    pub fn block_executor(
        &self,
        name: Option<&str>,
    ) -> Result<(String, Arc<dyn Executor>), Refusal> {
        let name = name.unwrap_or(&self.config.defaults.executor).to_owned();
        let sandbox = self.offered(&name).map_err(|e| Refusal::of_task(&e))?;
        Ok((name, sandbox))
    }

    /// A block without a task, checked the one way every road checks it (a session's block,
    /// `POST /v1/exec`, MCP's `execute_code`): its size, its language on `sandbox`, its
    /// timeout within the operator's cap (refused above it, never quietly lowered), and the
    /// approval policy, which no one can be asked under in the middle of a call.
    pub fn check_block(
        &self,
        sandbox: &dyn Executor,
        language: &str,
        code: String,
        timeout_secs: Option<f64>,
    ) -> Result<ExecRequest, Refusal> {
        if code.len() > MAX_BLOCK_BYTES {
            return Err(Refusal::invalid(format!(
                "code is {} bytes; a block may hold at most {MAX_BLOCK_BYTES}",
                code.len()
            )));
        }
        let language = Language::new(language);
        if !sandbox.supports(&language) {
            return Err(Refusal::invalid(
                ExecError::unsupported(&language, sandbox.name(), sandbox.languages()).to_string(),
            ));
        }
        let mut request = ExecRequest::new(language, code);
        if let Some(secs) = timeout_secs {
            if !secs.is_finite() || secs <= 0.0 {
                return Err(Refusal::invalid(
                    "timeout_secs must be a positive number of seconds",
                ));
            }
            let cap = self.config.policy.max_block_timeout;
            match std::time::Duration::try_from_secs_f64(secs) {
                Ok(asked) if asked <= cap => request.timeout = Some(asked),
                _ => {
                    return Err(Refusal::not_allowed(format!(
                        "timeout_secs {secs} is above this daemon's block timeout cap of {} s; ask for less, or raise max_block_timeout_secs under [policy] in the daemon's config",
                        cap.as_secs()
                    )));
                }
            }
        }
        let gate = ApprovalGate::new(&self.config.approval, None).map_err(|e| {
            Refusal::new(
                tandem_protocol::ApiErrorCode::Internal,
                format!("approval: {e}"),
            )
        })?;
        if let Some(why) = gate.unattended(&request.language, sandbox, &request.code) {
            return Err(Refusal::declined(&why));
        }
        Ok(request)
    }

    /// Checks a team within the bounds.
    pub fn check_team_spec(&self, team: &TeamSpec) -> Result<Node, TeamErrors> {
        tandem_agent::team::check_within(team, &self.config.teams)
    }

    /// Everything about `spec` that can be checked before it runs.
    pub fn check(&self, spec: &TaskSpec) -> Result<(), TaskError> {
        if spec.task.trim().is_empty() {
            return Err(Invalid::EmptyTask.into());
        }
        let executor = self.offered(self.executor_name(spec))?;
        self.check_offered(spec, executor.as_ref()).map(|_| ())
    }

    /// [`Planner::check`] past the executor; what it worked out, for a plan to use.
    fn check_offered(
        &self,
        spec: &TaskSpec,
        executor: &dyn Executor,
    ) -> Result<Checked, TaskError> {
        // Past the most any daemon allows is the request's fault, whatever this one's cap.
        if let Some(k) = spec.candidates
            && !(1..=tandem_agent::team::MOST_CANDIDATES).contains(&k)
        {
            return Err(Invalid::Candidates(k).into());
        }
        let policy = &self.config.policy;
        policy.check(spec, &self.config.model.base_url)?;
        let network = self.check_network(spec, executor)?;
        self.check_volumes(&spec.volumes, executor)?;
        let languages = spec
            .languages
            .as_deref()
            .map(|asked| allowed_languages(asked, executor))
            .transpose()
            .map_err(Invalid::Languages)?;
        let team = spec
            .team
            .as_ref()
            .map(|team| self.check_team(spec, team))
            .transpose()?;
        let limits = crate::policy::task_limits(&self.config.defaults.limits, &spec.limits)
            .map_err(Invalid::Limits)?;
        let gate = ApprovalGate::new(&self.config.approval, spec.approval.as_ref())
            .map_err(Invalid::Approval)?;
        let tools = tandem_agent::tools::resolve(spec.tools.as_deref(), &self.config.tools)
            .map_err(Invalid::Tools)?;
        denied_commands(&gate, spec.tools.as_deref()).map_err(Invalid::Tools)?;
        let mut agents: Vec<&Node> = team.iter().collect();
        while let Some(node) = agents.pop() {
            denied_commands(&gate, node.spec.tools.as_deref()).map_err(|e| Invalid::Agent {
                at: format!("team: {}.tools", node.path.replace('/', ".")),
                source: Box::new(Invalid::Tools(e)),
            })?;
            agents.extend(&node.members);
        }
        if spec.max_turns == Some(0) {
            return Err(Invalid::NoTurns.into());
        }
        self.check_budget(spec)?;
        let output_schema = match &spec.output_schema {
            Some(_) if spec.team.is_some() => {
                return Err(Invalid::OutputSchema(
                    "output_schema: a team's task cannot have one yet; ask the assistant and executor pair, or leave it out".to_owned(),
                )
                .into());
            }
            Some(schema) => Some(Arc::new(
                tandem_agent::schema::OutputSchema::new(schema).map_err(Invalid::OutputSchema)?,
            )),
            None => None,
        };
        if let Some(check) = &spec.check {
            if let Some(problem) = check.problem() {
                return Err(Invalid::Check(problem).into());
            }
            if spec.team.is_some() {
                return Err(Invalid::Check(
                    "check: runs in the assistant and executor pair's session; a team's task cannot have one",
                )
                .into());
            }
            // A check's program (and a file check's) runs in the sandbox with no person asked:
            // where blocks wait for approval, only `expect`, which runs nothing, is taken.
            if (check.program.is_some() || check.file.is_some()) && !gate.blocks_open() {
                return Err(Invalid::Check(
                    "check: a program or file check runs code unasked, and this task's blocks wait for approval; use expect, or a task without approval",
                )
                .into());
            }
        }
        if spec.keep_state && !executor.keeps_state() {
            return Err(Invalid::KeepState(executor.name().to_owned()).into());
        }
        placement_fits(&spec.placement, executor)?;
        if spec.timeout_secs == Some(0) || spec.block_timeout_secs == Some(0) {
            return Err(Invalid::NoTime.into());
        }
        if spec
            .termination
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(Invalid::EmptyTermination.into());
        }
        Ok(Checked {
            network,
            output_schema,
            languages,
            team,
            limits,
            gate,
            tools,
        })
    }

    /// The proxy and policy a sandbox without a task is held to: its `network` within what
    /// the operator allows, else `[network]`; `None` is no network.
    pub fn block_network(
        &self,
        asked: Option<&tandem_protocol::net::NetworkRequest>,
        executor: &dyn Executor,
    ) -> Result<Option<(tandem_egress::Egress, tandem_egress::Policy)>, Refusal> {
        self.config.network.for_block(asked, executor)
    }

    /// Checks that each of `volumes` exists and can be mounted where asked, on `executor`.
    pub fn check_volumes(
        &self,
        volumes: &[tandem_protocol::volume::VolumeMount],
        executor: &dyn Executor,
    ) -> Result<(), TaskError> {
        if volumes.is_empty() {
            return Ok(());
        }
        if !executor.mounts_volumes() {
            return Err(Invalid::Volumes(format!(
                "the {} executor cannot mount volumes; use docker, local or kubernetes",
                executor.name()
            ))
            .into());
        }
        let Some(store) = &self.config.volumes else {
            return Err(Invalid::Volumes(
                "volumes are kept by a daemon (or `tandem run` on its machine), and this road has none".into(),
            )
            .into());
        };
        let mut paths = std::collections::HashSet::new();
        for m in volumes {
            m.check().map_err(Invalid::Volumes)?;
            store.get(&m.name)?;
            if !paths.insert(m.path.trim_end_matches('/')) {
                return Err(Invalid::Volumes(format!(
                    "two volumes are mounted at `{}`; give each a path of its own",
                    m.path
                ))
                .into());
            }
        }
        Ok(())
    }

    /// Holds each of `volumes` for a sandbox: what its executor mounts, and the counts of
    /// users that last until the answer's second part is dropped.
    pub fn hold_volumes(
        &self,
        volumes: &[tandem_protocol::volume::VolumeMount],
    ) -> Result<
        (
            Vec<tandem_executor::VolumeBinding>,
            Vec<tandem_volumes::Held>,
        ),
        TaskError,
    > {
        let (Some(store), false) = (&self.config.volumes, volumes.is_empty()) else {
            return Ok((Vec::new(), Vec::new()));
        };
        let held = volumes
            .iter()
            .map(|m| store.hold(m))
            .collect::<Result<Vec<_>, _>>()?;
        let bindings = held
            .iter()
            .map(|h| tandem_executor::VolumeBinding {
                name: h.name.clone(),
                host_dir: h.dir.clone(),
                path: h.path.clone(),
                read_only: h.read_only,
                max_mb: h.max_mb,
            })
            .collect();
        Ok((bindings, held))
    }

    /// The policy `spec`'s sandboxes are held to: its own `network` within what the operator
    /// allows, else `[network]`; `None` is no network.
    fn check_network(
        &self,
        spec: &TaskSpec,
        executor: &dyn Executor,
    ) -> Result<Option<tandem_egress::Policy>, TaskError> {
        let asked = spec.network.as_ref().map(|n| n.allow.as_slice());
        let unavailable = |problem: String| {
            TaskError::from(crate::error::Unavailable::Executor {
                name: executor.name().to_owned(),
                problem,
            })
        };
        if self
            .config
            .network
            .switched_off(asked.is_some(), executor)
            .map_err(unavailable)?
        {
            return Ok(None);
        }
        let policy = match self.config.network.rules.for_task(asked) {
            Ok(policy) => policy,
            Err(tandem_egress::NotGiven::Entry(e)) => return Err(Invalid::Network(e).into()),
            Err(tandem_egress::NotGiven::Outside(why)) => return Err(Refused(why).into()),
        };
        let Some(policy) = policy else {
            return Ok(None);
        };
        self.config
            .network
            .proxy_for(executor)
            .map_err(unavailable)?;
        Ok(Some(policy))
    }

    /// Budgets that can be reached: token budgets of at least 1, a cost budget above 0, and
    /// a price for every model a cost budget counts.
    fn check_budget(&self, spec: &TaskSpec) -> Result<(), TaskError> {
        for (key, asked) in [
            ("max_input_tokens", spec.max_input_tokens),
            ("max_output_tokens", spec.max_output_tokens),
        ] {
            if asked == Some(0) {
                return Err(Invalid::Budget(format!("{key} must be at least 1")).into());
            }
        }
        let Some(cost) = spec.max_cost else {
            return Ok(());
        };
        if !(cost.is_finite() && cost > 0.0) {
            return Err(
                Invalid::Budget(format!("max_cost must be a number above 0, not {cost}")).into(),
            );
        }
        let mut named = vec![(spec.model.as_deref(), spec.base_url.as_deref())];
        if let Some(team) = &spec.team {
            for agent in std::iter::once(&team.team).chain(team.agents.values()) {
                if agent.model.is_some() || agent.base_url.is_some() {
                    named.push((
                        agent.model.as_deref().or(spec.model.as_deref()),
                        agent.base_url.as_deref().or(spec.base_url.as_deref()),
                    ));
                }
                // An `llm` selector with a model of its own is a model the task pays for.
                if let Some(tandem_protocol::team::Selection::Table(table)) = &agent.selection
                    && let Some(model) = &table.model
                {
                    named.push((
                        Some(model.as_str()),
                        agent.base_url.as_deref().or(spec.base_url.as_deref()),
                    ));
                }
            }
        }
        for (model, base_url) in named {
            let Ok(made) = self.model(model, base_url) else {
                continue;
            };
            let name = &made.config().model;
            if !made.is_embedded() && !self.config.prices.contains_key(name) {
                return Err(Invalid::Budget(format!(
                    "max_cost: model `{name}` has no price, so its cost cannot be counted; leave max_cost out, or have the operator set [model.prices.\"{name}\"] input and output (per million tokens)"
                ))
                .into());
            }
        }
        Ok(())
    }

    /// A team must check, and each of its agents stay within the policy: an executor that is
    /// offered, a model server that is allowed.
    fn check_team(&self, spec: &TaskSpec, team: &TeamSpec) -> Result<Node, TaskError> {
        let root = self.check_team_spec(team).map_err(Invalid::Team)?;
        let policy = &self.config.policy;
        let mut stack = vec![&root];
        while let Some(node) = stack.pop() {
            let at = |field: &str| format!("team: {}.{field}", node.path.replace('/', "."));
            if node.spec.kind == Kind::Executor {
                let name = node
                    .spec
                    .executor
                    .as_deref()
                    .unwrap_or_else(|| self.executor_name(spec));
                let executor = self.offered(name).map_err(|e| match e {
                    TaskError::NotAllowed(m) => Refused(format!("{}: {m}", at("executor"))).into(),
                    TaskError::Invalid(source) => TaskError::from(Invalid::Agent {
                        at: at("executor"),
                        source: Box::new(source),
                    }),
                    other => other,
                })?;
                if node.spec.keep_state.unwrap_or(spec.keep_state) && !executor.keeps_state() {
                    return Err(Invalid::Agent {
                        at: at("executor"),
                        source: Box::new(Invalid::KeepState(executor.name().to_owned())),
                    }
                    .into());
                }
                if let Some(asked) = &node.spec.languages {
                    allowed_languages(asked, executor.as_ref()).map_err(|e| Invalid::Agent {
                        at: at("languages"),
                        source: Box::new(Invalid::Languages(e)),
                    })?;
                }
            }
            if node.spec.tools.is_some() {
                tandem_agent::tools::resolve(node.spec.tools.as_deref(), &self.config.tools)
                    .map_err(|e| Invalid::Agent {
                        at: at("tools"),
                        source: Box::new(Invalid::Tools(e)),
                    })?;
            }
            if let Some(url) = &node.spec.base_url {
                policy
                    .endpoint(url, &self.config.model.base_url)
                    .map_err(|e| Refused(format!("{}: {}", at("base_url"), e.0)))?;
            }
            stack.extend(&node.members);
        }
        Ok(root)
    }

    /// `spec` as a task ready to run, checked again: a task stored under an older policy
    /// (queued or interrupted across a restart) runs only if today's still allows it.
    pub fn plan(&self, spec: &TaskSpec, start: Start<'_>) -> Result<Planned, ErrorInfo> {
        let d = &self.config.defaults;
        let name = self.executor_name(spec).to_owned();
        let executor = self.offered(&name).map_err(|e| ErrorInfo {
            code: match e {
                TaskError::NotAllowed(_) => ErrorCode::InvalidRequest,
                _ => ErrorCode::Executor,
            },
            message: e.to_string(),
        })?;
        let invalid = |message| ErrorInfo {
            code: ErrorCode::InvalidRequest,
            message,
        };
        let checked = self
            .check_offered(spec, executor.as_ref())
            .map_err(|e| invalid(e.to_string()))?;
        let (volumes, held) = self
            .hold_volumes(&spec.volumes)
            .map_err(|e| invalid(e.to_string()))?;
        let mut settings = TaskSettings::new(spec.task.clone());
        settings.system_prompt = spec
            .system_prompt
            .clone()
            .unwrap_or_else(|| d.system_prompt.clone());
        settings.termination = spec
            .termination
            .clone()
            .unwrap_or_else(|| d.termination.clone());
        let default_turns = match spec.team {
            None => tandem_agent::DEFAULT_MAX_TURNS,
            Some(_) => tandem_agent::DEFAULT_TEAM_TURNS,
        };
        settings.max_turns = spec
            .max_turns
            .or(d.max_turns)
            .unwrap_or(default_turns.min(self.config.policy.max_turns));
        settings.timeout = spec.timeout_secs.map(Duration::from_secs).or(d.timeout);
        let mut limits = checked.limits;
        if let Some(secs) = spec.block_timeout_secs {
            limits.wall = Duration::from_secs(secs);
        }
        settings.languages = checked.languages;
        settings.code_via = spec.code_via.unwrap_or(d.code_via);
        settings.candidates = spec
            .candidates
            .unwrap_or(settings.candidates.min(self.config.policy.max_candidates));
        settings.tools = checked.tools;
        settings.check = spec.check.clone();
        let caps = &self.config.policy.budget;
        settings.budget = tandem_agent::budget::Budget {
            max_input_tokens: spec
                .max_input_tokens
                .or(d.budget.max_input_tokens)
                .or(caps.max_input_tokens),
            max_output_tokens: spec
                .max_output_tokens
                .or(d.budget.max_output_tokens)
                .or(caps.max_output_tokens),
            max_cost: spec.max_cost.or(d.budget.max_cost).or(caps.max_cost),
        };
        settings.prices = self.config.prices.clone();
        if let Some(inputs) = &start.inputs {
            settings.task = format!("{}\n\n{}", spec.task, inputs.listing);
        }
        // An instruction of the system prompt: the task stays the user's words.
        if let Some(schema) = &checked.output_schema {
            settings.system_prompt = format!(
                "{}\n\n{}",
                settings.system_prompt.trim_end(),
                schema.instructions()
            );
        }
        settings.output_schema = checked.output_schema;
        if let (Some(policy), Some(egress)) = (checked.network, &self.config.network.egress) {
            settings.system_prompt = format!(
                "{}\n\n{}",
                settings.system_prompt.trim_end(),
                network_note(&policy, egress)
            );
            settings.network = Some(tandem_agent::TaskNetwork {
                egress: egress.clone(),
                policy: Arc::new(policy),
                carried: Arc::default(),
            });
        }
        settings.session = SessionSpec {
            workdir: start.workdir,
            limits,
            labels: start.labels,
            inputs: start.inputs.and_then(|i| i.archive),
            keep_state: spec.keep_state,
            placement: spec
                .placement
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            egress: None,
            volumes,
        };
        let gate = (!checked.gate.is_open()).then_some(checked.gate);
        let model = self.model(spec.model.as_deref(), spec.base_url.as_deref())?;
        let model_name = model.config().model.clone();
        let mut told = None;
        let work = match checked.team {
            None => {
                let (history, report) = history(start.events);
                settings.history = history;
                settings.drew = start
                    .events
                    .iter()
                    .any(|e| matches!(e.msg, EventMsg::RepliesDrawn { .. }));
                settings.spent = start
                    .events
                    .iter()
                    .filter_map(|e| match &e.msg {
                        EventMsg::AssistantMessage { usage: Some(u), .. } => Some(*u),
                        _ => None,
                    })
                    .collect();
                told = report;
                // A kept interpreter does not outlive the daemon that ran it: the model is
                // told, with the report it reads next, that its variables are gone.
                if spec.keep_state
                    && let Some(last) = settings.history.last_mut().filter(|m| {
                        matches!(m.role, Role::User | Role::Tool) && !start.events.is_empty()
                    })
                {
                    last.content.push_str(RESUMED_FRESH);
                }
                Work::Pair {
                    model: Box::new(model),
                    executor,
                }
            }
            Some(root) => self.team(spec, root, &settings, model, executor, start.events)?,
        };
        Ok(Planned {
            settings,
            gate,
            work,
            executor: name,
            model: model_name,
            told,
            _volumes: held,
        })
    }

    /// A team task's team: its agents' models and sessions within the policy, and what its
    /// stored events say each agent already said.
    fn team(
        &self,
        spec: &TaskSpec,
        root: Node,
        settings: &TaskSettings,
        model: ChatModel,
        executor: Arc<dyn Executor>,
        events: &[Event],
    ) -> Result<Work, ErrorInfo> {
        let msgs: Vec<EventMsg> = events.iter().map(|e| e.msg.clone()).collect();
        let replay = tandem_agent::team::replay_of(&msgs);
        let net = settings
            .network
            .as_ref()
            .map(|_| Arc::new(tandem_agent::LateNet::default()));
        let models = |node: &Node| {
            self.model(
                node.spec.model.as_deref().or(spec.model.as_deref()),
                node.spec.base_url.as_deref().or(spec.base_url.as_deref()),
            )
        };
        let ports = Arc::new(crate::ports::LateBook::default());
        let slots = |node: &Node| {
            let name = node
                .spec
                .executor
                .as_deref()
                .unwrap_or_else(|| self.executor_name(spec));
            let executor = self.config.executors.get(name).map_err(|e| ErrorInfo {
                code: ErrorCode::Executor,
                message: e.to_string(),
            })?;
            let executor = match (&settings.network, &net) {
                (Some(network), Some(late)) => {
                    if let Err(why) = self.config.network.proxy_for(&*executor) {
                        return Err(ErrorInfo {
                            code: ErrorCode::Executor,
                            message: format!(
                                "{}: the {name} executor cannot run it: {why}",
                                node.path
                            ),
                        });
                    }
                    network.wrap_late(executor, late.clone())
                }
                _ => executor,
            };
            let executor = crate::ports::PortBook::publishing_late(executor, ports.clone());
            executor_slot(node, executor, settings.session.clone())
        };
        let label = TaskLabel {
            model: model.config().model.clone(),
            base_url: model.location(),
            executor: "team".to_owned(),
        };
        let mut team = Team::new(
            root.clone(),
            model,
            models,
            slots,
            settings.max_turns,
            &settings.session.limits,
        )?;
        // A team's events name the agent that made each call.
        let spent: Vec<(String, tandem_protocol::Usage)> = events
            .iter()
            .filter_map(|e| match (&e.path, &e.msg) {
                (Some(path), EventMsg::AssistantMessage { usage: Some(u), .. }) => {
                    Some((path.clone(), *u))
                }
                _ => None,
            })
            .collect();
        team = team
            .with_budget(settings.budget, &settings.prices)
            .with_spent(&spent);
        if let Some(network) = &settings.network {
            team = team.with_note(network_note(&network.policy, &network.egress));
        }
        // Each assistant's tools: its own list, else the task's; its code goes to the
        // task's executor's languages.
        let mut stack = vec![&root];
        while let Some(node) = stack.pop() {
            if node.spec.kind == Kind::Assistant {
                let tools = match &node.spec.tools {
                    Some(refs) => tandem_agent::tools::resolve(Some(refs), &self.config.tools)
                        .map_err(|e| ErrorInfo {
                            code: ErrorCode::InvalidRequest,
                            message: format!("{}.tools: {e}", node.path),
                        })?,
                    None => settings.tools.clone(),
                };
                let via = node.spec.code_via.unwrap_or(settings.code_via);
                let languages = settings
                    .languages
                    .clone()
                    .unwrap_or_else(|| executor.languages().to_vec());
                team = team.with_tools(
                    &node.path,
                    tandem_agent::tools::ToolBox::new(tools, via, &languages),
                )?;
            }
            stack.extend(&node.members);
        }
        Ok(Work::Team {
            team: Box::new(team),
            label,
            replay,
            net,
            ports,
        })
    }

    /// The chat model for a URL and model name, built once per pair. A task's URL gets the
    /// key configured for that endpoint, never the daemon's own.
    fn model(&self, model: Option<&str>, base_url: Option<&str>) -> Result<ChatModel, ErrorInfo> {
        let mut config = self.config.model.clone();
        if let (Some(local), None) = (&self.config.local_model, base_url) {
            return Ok(ChatModel::local(local.clone(), config));
        }
        if let Some(url) = base_url {
            let endpoint = self
                .config
                .policy
                .endpoint(url, &self.config.model.base_url)
                .map_err(|e| ErrorInfo {
                    code: ErrorCode::InvalidRequest,
                    message: e.0,
                })?;
            if let Some(endpoint) = endpoint {
                config.base_url = endpoint.base_url;
                config.api_key = endpoint.api_key;
            }
        }
        if let Some(model) = model {
            config.model = model.to_owned();
        }
        let key = (config.base_url.clone(), config.model.clone());
        if let Some(m) = self.models.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(m);
        }
        let model = ChatModel::new(config).map_err(ErrorInfo::from)?;
        if let Ok(mut models) = self.models.lock() {
            // Model names are the client's to choose; the cache must not grow with them.
            if models.len() >= MODEL_CACHE {
                models.clear();
            }
            models.insert(key, model.clone());
        }
        Ok(model)
    }

    /// The conversation of a pair task so far, rebuilt from its stored `events`, as the model
    /// was sent it.
    pub fn transcript(&self, spec: &TaskSpec, events: &[Event]) -> Vec<Message> {
        let template = spec
            .system_prompt
            .as_deref()
            .unwrap_or(&self.config.defaults.system_prompt);
        // The prompt names the languages the task's executor runs.
        let system = match self.config.executors.get(self.executor_name(spec)) {
            Ok(executor) => {
                let allowed = spec
                    .languages
                    .as_deref()
                    .and_then(|asked| allowed_languages(asked, executor.as_ref()).ok());
                render_system_prompt(template, executor.languages(), allowed.as_deref())
            }
            Err(_) => template.to_owned(),
        };
        let mut messages = vec![
            Message::new(Role::System, system),
            Message::new(Role::User, spec.task.clone()),
        ];
        messages.extend(conversation(events));
        messages
    }
}

impl Planned {
    /// The executor's message a resumed task stores before it goes on, when its last reply
    /// was cut off after some of its code started.
    pub fn take_told(&mut self) -> Option<EventMsg> {
        self.told.take()
    }

    /// Whether some block may need a verdict: the policy does not let every block through.
    pub fn gated(&self) -> bool {
        self.gate.is_some()
    }

    /// Whether the policy may want a person asked about a block.
    pub fn may_ask(&self) -> bool {
        self.gate.as_ref().is_some_and(ApprovalGate::may_ask)
    }

    /// Its model's name (a team's default model).
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The executor it runs on (a team's default executor).
    pub fn executor(&self) -> &str {
        &self.executor
    }

    /// Its sandboxes' ports can be reached through `book` under `task` while they are open.
    pub fn publishing(mut self, book: &crate::ports::PortBook, task: &str) -> Self {
        match &mut self.work {
            Work::Pair { executor, .. } => *executor = book.publishing(executor.clone(), task),
            Work::Team { ports, .. } => ports.set(book, task),
        }
        self
    }

    /// Names what runs a team task in its start event (`team review.toml`).
    pub fn team_label(mut self, label: String) -> Self {
        if let Work::Team { label: l, .. } = &mut self.work {
            l.executor = label;
        }
        self
    }

    /// Runs it to its end with `approver` asked about the blocks the policy wants a person
    /// for (`None` declines them, and the model is told why); every event goes to `sink`.
    pub async fn run(
        self,
        approver: Option<Arc<dyn Approver>>,
        guard: Option<tandem_agent::approval::Guard>,
        sink: EventSink,
        cancel: CancellationToken,
    ) -> StopReason {
        let mut settings = self.settings;
        // A guard needs a gate to stand in: an open one lets every block through to it.
        let gate = match (self.gate, &guard) {
            (None, Some(_)) => {
                ApprovalGate::new(&tandem_protocol::ApprovalPolicy::default(), None).ok()
            }
            (gate, _) => gate,
        };
        settings.approval = gate.map(|gate| {
            let gate = match approver {
                Some(approver) => gate.with_approver(approver),
                None => gate,
            };
            Arc::new(match guard {
                Some(guard) => gate.with_guard(guard),
                None => gate,
            })
        });
        match self.work {
            Work::Pair { model, executor } => {
                run_task(settings, &model, executor, sink, cancel)
                    .await
                    .stop_reason
            }
            Work::Team {
                team,
                label,
                replay,
                net,
                ..
            } => {
                let sink = match net {
                    Some(net) => {
                        let sink = tandem_agent::events::counting_net(sink);
                        net.set(&sink);
                        sink
                    }
                    None => sink,
                };
                let team = team.with_approval(settings.approval.clone());
                run_team_task(
                    team,
                    &settings.task,
                    label,
                    sink,
                    cancel,
                    settings.timeout,
                    replay,
                )
                .await
            }
        }
    }
}

/// Most chat clients kept for reuse (one per endpoint and model name).
const MODEL_CACHE: usize = 32;

/// What the assistant and the executor said, in order, from the stored events.
fn conversation(events: &[Event]) -> Vec<Message> {
    events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::AssistantMessage {
                text, tool_calls, ..
            } => Some(
                Said {
                    text: text.clone(),
                    calls: tool_calls.clone(),
                    ..Said::default()
                }
                .to_messages(true),
            ),
            EventMsg::ExecutorMessage {
                text, tool_results, ..
            } => Some(
                Said {
                    text: text.clone(),
                    results: tool_results.clone(),
                    ..Said::default()
                }
                .to_messages(false),
            ),
            _ => None,
        })
        .flatten()
        .collect()
}

/// Told to the model when a task with a kept interpreter resumes.
const RESUMED_FRESH: &str = "\n\n(tandem: this task was interrupted and resumed. Its files are kept, but its Python interpreter is new: variables, imports and open files of earlier blocks are gone.)";

/// The turns an interrupted task completed. A last reply that its report never answered is
/// asked for again when none of its code started; when some did, the model is told what
/// ([`cut_off`]); when one of its blocks waits for approval, its code runs again, and the
/// approval is found where it was.
fn history(events: &[Event]) -> (Vec<Message>, Option<EventMsg>) {
    let mut messages = conversation(events);
    let mut told = None;
    if messages.last().is_some_and(|m| m.role == Role::Assistant) && !waits_for_approval(events) {
        match cut_off(events) {
            Some(report) => {
                told = Some(report.event);
                messages.extend(report.messages);
            }
            None => {
                messages.pop();
            }
        }
    }
    (messages, told)
}

/// What the model is told of a cut-off reply: the messages, and the event that stores them.
struct CutOff {
    messages: Vec<Message>,
    event: EventMsg,
}

/// What the model is told of its last reply when the task was cut off (its daemon died, was
/// stopped, or lost the task to another) after some of the reply's code started: that code
/// is not run again, since it may have done its work already (at most once: a block appends
/// to a file once, not twice). `None` when none of it started; the reply is asked for again.
/// A block starts only after its `code_block` event is stored, so the events tell.
fn cut_off(events: &[Event]) -> Option<CutOff> {
    let at = events
        .iter()
        .rposition(|e| matches!(e.msg, EventMsg::AssistantMessage { .. }))?;
    let EventMsg::AssistantMessage {
        tool_calls, turn, ..
    } = &events[at].msg
    else {
        return None;
    };
    let mut blocks: Vec<(u32, Option<&tandem_protocol::BlockResult>)> = Vec::new();
    let mut answered: Vec<(&str, &str)> = Vec::new();
    let mut called = false;
    for e in &events[at..] {
        match &e.msg {
            EventMsg::CodeBlock { index, .. } => blocks.push((*index, None)),
            EventMsg::ExecResult { index, result, .. } => {
                if let Some(b) = blocks.iter_mut().find(|(i, _)| i == index) {
                    b.1 = Some(result);
                }
            }
            EventMsg::ToolCall { .. } => called = true,
            EventMsg::ToolResult { id, result, .. } => answered.push((id, result)),
            _ => {}
        }
    }
    if blocks.is_empty() && !called {
        return None;
    }
    let mut lines = Vec::new();
    for (index, result) in &blocks {
        lines.push(match result {
            Some(r) => match r.exit_code {
                Some(code) => format!("block {index} ended with exit code {code}"),
                None => format!("block {index} ended: {}", r.status.as_str()),
            },
            None => format!(
                "block {index} was running: it may have run in part or in full, and its output is lost"
            ),
        });
    }
    let report = format!(
        "(tandem: this task was cut off while the code of your last reply ran, and has resumed. That code is not run again, since it may have done its work already{}{}. Check what it did (files, state) before you go on.)",
        if lines.is_empty() { "" } else { ": " },
        lines.join("; ")
    );
    if tool_calls.is_empty() {
        return Some(CutOff {
            messages: vec![Message::new(Role::User, report.clone())],
            event: EventMsg::ExecutorMessage {
                turn: *turn,
                text: report,
                tool_results: Vec::new(),
            },
        });
    }
    let replies: Vec<tandem_protocol::ToolReply> = tool_calls
        .iter()
        .map(|call| tandem_protocol::ToolReply {
            id: call.id.clone(),
            name: call.name.clone(),
            content: answered
                .iter()
                .find(|(id, _)| *id == call.id)
                .map_or_else(|| report.clone(), |(_, result)| (*result).to_owned()),
        })
        .collect();
    Some(CutOff {
        messages: replies.iter().map(Message::tool).collect(),
        event: EventMsg::ExecutorMessage {
            turn: *turn,
            text: String::new(),
            tool_results: replies,
        },
    })
}

/// Whether the task's last reply asked for an approval and was never answered by a report.
pub(crate) fn waits_for_approval(events: &[Event]) -> bool {
    let last_reply = events
        .iter()
        .rposition(|e| matches!(e.msg, EventMsg::AssistantMessage { .. }));
    last_reply.is_some_and(|at| {
        let after = &events[at..];
        after
            .iter()
            .any(|e| matches!(e.msg, EventMsg::ApprovalRequested { .. }))
            && !after.iter().any(|e| {
                matches!(
                    e.msg,
                    EventMsg::ExecutorMessage { .. } | EventMsg::TaskFinished { .. }
                )
            })
    })
}

/// The first command tool among `refs` (those a client defines) whose program a deny rule of
/// `gate` refuses: it could never run, and a client must not get a program past the rules that
/// its blocks meet. Each call is judged again with its arguments before it runs.
fn denied_commands(
    gate: &ApprovalGate,
    refs: Option<&[tandem_protocol::ToolRef]>,
) -> Result<(), tandem_agent::tools::ToolError> {
    for r in refs.unwrap_or_default() {
        if let tandem_protocol::ToolRef::Def(named) = r
            && let Some(argv) = &named.command
            && let Some(rule) = gate.denies_command(argv, None)
        {
            return Err(tandem_agent::tools::ToolError::Invalid {
                name: named.name.clone(),
                why: format!(
                    "its command matches the approval deny rule `{rule}`, so it may not run here; define a command the approval policy allows"
                ),
            });
        }
    }
    Ok(())
}

/// Whether some host of `executor` carries every label of `placement` (none asked: yes). A
/// host that is down or full now still counts: placement waits for nothing, but the task can
/// run once it is back.
fn placement_fits(
    placement: &std::collections::BTreeMap<String, String>,
    executor: &dyn tandem_executor::Executor,
) -> Result<(), Invalid> {
    if placement.is_empty() {
        return Ok(());
    }
    let hosts = executor.hosts();
    if hosts.is_empty() {
        return Err(Invalid::Placement(format!(
            "the {} executor runs every session in one place; placement picks among the hosts of a docker executor with [[executors.docker.hosts]]",
            executor.name()
        )));
    }
    if hosts
        .iter()
        .any(|h| placement.iter().all(|(k, v)| h.labels.get(k) == Some(v)))
    {
        return Ok(());
    }
    let offered: Vec<String> = hosts
        .iter()
        .map(|h| {
            let labels: Vec<String> = h.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!(
                "{} ({})",
                h.name,
                if labels.is_empty() {
                    "no labels".to_owned()
                } else {
                    labels.join(", ")
                }
            )
        })
        .collect();
    let asked: Vec<String> = placement.iter().map(|(k, v)| format!("{k}={v}")).collect();
    Err(Invalid::Placement(format!(
        "no host of the {} executor carries {}; its hosts: {}",
        executor.name(),
        asked.join(", "),
        offered.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use futures::future::BoxFuture;
    use tandem_executor::{ExecError, Language, Session};

    use super::*;

    /// An executor that is only planned with, never opened.
    struct Paper(&'static str, Vec<Language>);

    impl Executor for Paper {
        fn name(&self) -> &str {
            self.0
        }

        fn languages(&self) -> &[Language] {
            &self.1
        }

        fn open(&self, _: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
            Box::pin(async {
                Err(ExecError::Unavailable {
                    what: "a sandbox".to_owned(),
                    hint: "this executor is only planned with".to_owned(),
                })
            })
        }
    }

    fn planner(policy: Policy, defaults: TaskDefaults) -> Planner {
        let mut executors = Registry::new();
        for name in ["local", "wasm"] {
            executors.register(Arc::new(Paper(name, vec![Language::python()])));
        }
        Planner::new(PlannerConfig {
            model: ModelConfig {
                base_url: "http://127.0.0.1:9/v1".to_owned(),
                ..ModelConfig::default()
            },
            local_model: None,
            executors,
            defaults,
            policy,
            approval: ApprovalPolicy::default(),
            teams: TeamBounds::default(),
            tools: Default::default(),
            prices: Default::default(),
            network: Default::default(),
            volumes: None,
        })
    }

    fn spec(task: &str) -> TaskSpec {
        TaskSpec {
            task: task.to_owned(),
            ..TaskSpec::default()
        }
    }

    fn team() -> TeamSpec {
        let text = include_str!("../../examples/teams/review.toml");
        toml::from_str(text).unwrap()
    }

    fn turns(planner: &Planner, spec: &TaskSpec) -> u32 {
        planner
            .plan(spec, Start::default())
            .unwrap()
            .settings
            .max_turns
    }

    #[test]
    fn every_road_gets_one_default_of_turns_for_a_pair_and_one_for_a_team() {
        let own = planner(
            Policy::own(vec!["local".to_owned()]),
            TaskDefaults::default(),
        );
        let mut pair = spec("t");
        assert_eq!(turns(&own, &pair), tandem_agent::DEFAULT_MAX_TURNS);
        let mut teamed = spec("t");
        teamed.team = Some(team());
        assert_eq!(turns(&own, &teamed), tandem_agent::DEFAULT_TEAM_TURNS);
        // The operator's default holds for both; the task's own number wins over it.
        let set = planner(
            Policy::own(vec!["local".to_owned()]),
            TaskDefaults {
                max_turns: Some(7),
                ..TaskDefaults::default()
            },
        );
        assert_eq!((turns(&set, &pair), turns(&set, &teamed)), (7, 7));
        pair.max_turns = Some(3);
        teamed.max_turns = Some(3);
        assert_eq!((turns(&set, &pair), turns(&set, &teamed)), (3, 3));
    }

    #[test]
    fn the_one_check_names_the_problem_for_the_task_and_for_each_agent() {
        let shared = planner(
            Policy::default(),
            TaskDefaults {
                executor: "wasm".to_owned(),
                ..TaskDefaults::default()
            },
        );
        let refused = |s: &TaskSpec| shared.check(s).unwrap_err().to_string();
        assert_eq!(
            refused(&spec(" ")),
            "the task is empty; say what to do in `task`"
        );
        let mut local = spec("t");
        local.executor = Some("local".to_owned());
        assert!(matches!(
            shared.check(&local),
            Err(TaskError::NotAllowed(_))
        ));
        let mut unknown = spec("t");
        unknown.executor = Some("dockr".to_owned());
        assert!(matches!(
            shared.check(&unknown),
            Err(TaskError::Invalid(Invalid::Executor(_)))
        ));
        // An agent's executor is checked where it is named.
        let mut teamed = spec("t");
        let mut t = team();
        t.agents.get_mut("runner").unwrap().executor = Some("local".to_owned());
        teamed.team = Some(t);
        assert!(
            refused(&teamed)
                .starts_with("team: team.runner.executor: executor `local` is not offered"),
            "{}",
            refused(&teamed)
        );
        // A plan is checked again: a task stored under a looser policy does not run.
        let info = shared.plan(&local, Start::default()).err().unwrap();
        assert_eq!(info.code, ErrorCode::InvalidRequest);
        // A model server the policy does not list is refused; one's own machine allows it.
        let mut elsewhere = spec("t");
        elsewhere.base_url = Some("http://127.0.0.1:1/v1".to_owned());
        assert!(matches!(
            shared.check(&elsewhere),
            Err(TaskError::NotAllowed(_))
        ));
        let own = planner(
            Policy::own(vec!["wasm".to_owned()]),
            TaskDefaults::default(),
        );
        elsewhere.executor = Some("wasm".to_owned());
        assert!(own.check(&elsewhere).is_ok());
    }
}
