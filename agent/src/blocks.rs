//! The executor agent's half of a turn: run a reply's blocks and report back to the model.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use tandem_executor::{
    CancellationToken, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, ExitStatus,
    Language, Session, SessionSpec, Stream, complete_utf8,
};
use tandem_protocol::{BlockResult, BlockStatus, EventMsg, OutputStream};

pub use crate::events::EventSink;
use crate::extract::CodeBlock;

/// A task's session, opened when its first block runs and closed exactly once.
pub struct SessionSlot {
    executor: Arc<dyn Executor>,
    spec: SessionSpec,
    allowed: Option<Vec<Language>>,
    session: Option<Box<dyn Session>>,
    /// The workspace's pictures after the last block, which are the next block's "before".
    pictures: Option<Pictures>,
    /// The latest tool calls run here (tool and arguments), newest last, to catch a loop.
    pub(crate) recent: Vec<String>,
    /// Sessions whose machine was lost. Each is kept until the slot closes: its workspace
    /// on this machine (its mirror) is where the session that carries on was opened.
    lost: Vec<Box<dyn Session>>,
    /// Tool calls the code of this slot's blocks made, in all (`[limits]
    /// code_calls_per_task`).
    code_calls: Arc<std::sync::atomic::AtomicU32>,
}

/// A copy of a slot's workspace at one moment, from which forks start; removed when dropped.
pub struct ForkPoint(tempfile::TempPath);

/// Most a fork point copies of a workspace: past it, there is no fork, and the code is not
/// judged.
const FORK_CAPS: tandem_executor_kit::archive::ArchiveCaps =
    tandem_executor_kit::archive::ArchiveCaps {
        max_bytes: 1 << 30,
        max_entries: 100_000,
    };

/// Most times one block moves to another machine after losing its sandbox.
const MOST_MOVES: u32 = 3;

impl SessionSlot {
    /// A slot that will open a session of `executor` with `spec` on first use.
    pub fn new(executor: Arc<dyn Executor>, spec: SessionSpec) -> Self {
        Self {
            executor,
            spec,
            allowed: None,
            session: None,
            pictures: None,
            recent: Vec::new(),
            lost: Vec::new(),
            code_calls: Arc::default(),
        }
    }

    /// Sets the session that was lost aside and has the next one opened on its workspace,
    /// which holds what the last finished block left (its task's files are in it already).
    fn carry_on(&mut self) {
        if let Some(lost) = self.session.take() {
            if let Some(dir) = lost.workspace() {
                self.spec.workdir = Some(dir.to_owned());
                self.spec.inputs = None;
            }
            self.lost.push(lost);
        }
    }

    /// The session's block timeout.
    pub fn block_timeout(&self) -> Duration {
        self.spec.limits.wall
    }

    /// Bytes of each output stream kept.
    pub fn output_cap(&self) -> usize {
        self.spec.limits.output_bytes
    }

    /// Runs only blocks in `languages` (`None`: every language the executor runs).
    pub fn only(mut self, languages: Option<Vec<Language>>) -> Self {
        self.allowed = languages;
        self
    }

    /// The languages blocks may run in here: the task's list, else the executor's.
    pub fn languages(&self) -> &[Language] {
        self.allowed
            .as_deref()
            .unwrap_or_else(|| self.executor.languages())
    }

    /// The executor behind this slot.
    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.executor
    }

    /// Why a block in `language` will not run here, if it will not.
    pub(crate) fn refusal(&self, language: &Language) -> Option<String> {
        if let Some(allowed) = &self.allowed
            && !allowed.contains(language)
        {
            return Some(format!(
                "language `{language}` is not allowed in this task; allowed: {}",
                tandem_executor::join_languages(allowed)
            ));
        }
        if self.executor.supports(language) {
            return None;
        }
        let e = ExecError::unsupported(language, self.executor.name(), self.executor.languages());
        Some(e.to_string())
    }

    /// Most blocks of one reply that run in this session.
    pub fn blocks_per_reply(&self) -> usize {
        self.spec.limits.blocks_per_reply.max(1)
    }

    /// The machine the session was placed on, when its executor has several.
    pub fn host(&self) -> Option<String> {
        self.session
            .as_ref()
            .and_then(|s| s.host().map(str::to_owned))
    }

    /// The session, opened on first use; `None` when `cancel` fired while it waited for a
    /// free sandbox (the block is then cancelled, like one stopped while it ran).
    async fn session(
        &mut self,
        cancel: &CancellationToken,
    ) -> Result<Option<&mut Box<dyn Session>>, ExecError> {
        if self.session.is_none() {
            let mut opened = tokio::select! {
                opened = self.executor.open(self.spec.clone()) => opened?,
                () = cancel.cancelled() => return Ok(None),
            };
            // The task's files are there before its first block runs; they were checked
            // against the caps when they were given.
            let caps = tandem_executor_kit::archive::ArchiveCaps {
                max_bytes: u64::MAX,
                max_entries: usize::MAX,
            };
            if let Some(inputs) = &self.spec.inputs
                && let Err(e) = opened.put_archive(inputs, caps).await
            {
                let _ = opened.close().await;
                return Err(e);
            }
            if self.spec.keep_state {
                opened = Box::new(tandem_executor_kit::kept::KeptSession::new(
                    opened,
                    self.executor.clone(),
                    self.spec.clone(),
                ));
            }
            self.session = Some(opened);
        }
        Ok(self.session.as_mut())
    }

    /// Runs `code` in the session with its limits, telling no one: the task's examples. `None`
    /// when `cancel` fired.
    pub async fn run_quiet(
        &mut self,
        language: &Language,
        code: &str,
        cancel: &CancellationToken,
    ) -> Result<Option<ExecOutcome>, ExecError> {
        self.quiet(ExecRequest::new(language.clone(), code.to_owned()), cancel)
            .await
    }

    /// The workspace as it is now, from which forks start (the session opened first if it
    /// was not); `None` when its executor's sessions have no workspace Tandem can read.
    pub async fn fork_point(
        &mut self,
        cancel: &CancellationToken,
    ) -> Result<Option<ForkPoint>, ExecError> {
        let Some(session) = self.session(cancel).await? else {
            return Ok(None);
        };
        let Some(workspace) = session.workspace().map(std::path::Path::to_owned) else {
            return Ok(None);
        };
        let packed = tokio::task::spawn_blocking(move || {
            let mut file = tempfile::NamedTempFile::new()?;
            tandem_executor_kit::archive::pack(&workspace, "", &mut file, FORK_CAPS)
                .map_err(std::io::Error::other)?;
            Ok::<_, std::io::Error>(file.into_temp_path())
        })
        .await
        .map_err(|e| ExecError::Backend(format!("copying the workspace for a fork: {e}")))?
        .map_err(|source| ExecError::Io {
            context: "copying the workspace for a fork".to_owned(),
            source,
        })?;
        Ok(Some(ForkPoint(packed)))
    }

    /// Runs `code` quietly in a fork: a new session of the slot's executor whose workspace
    /// starts as `at`, closed after. What the code does there stays there; the slot's own
    /// session is not touched. `None` when `cancel` fired.
    pub async fn run_on_fork(
        &mut self,
        at: &ForkPoint,
        language: &Language,
        code: &str,
        cancel: &CancellationToken,
    ) -> Result<Option<ExecOutcome>, ExecError> {
        let mut spec = self.spec.clone();
        // A fork of its own: not the task's directory, no interpreter kept, its files only
        // those of the fork point.
        spec.workdir = None;
        spec.inputs = None;
        spec.keep_state = false;
        // A reply being judged must not change what outlives the task.
        for v in &mut spec.volumes {
            v.read_only = true;
        }
        let mut fork = tokio::select! {
            opened = self.executor.open(spec) => opened?,
            () = cancel.cancelled() => return Ok(None),
        };
        let ran = async {
            fork.put_archive(&at.0, FORK_CAPS).await?;
            let ctx = ExecContext::new(cancel.child_token());
            fork.run(ExecRequest::new(language.clone(), code.to_owned()), ctx)
                .await
        }
        .await;
        if let Err(e) = fork.close().await {
            tracing::warn!(error = %e, "closing a fork failed");
        }
        let ran = ran?;
        Ok((ran.status != ExitStatus::Cancelled).then_some(ran))
    }

    /// [`SessionSlot::run_quiet`] in a fresh process that runs nothing the task's blocks left
    /// for an interpreter's start, nor in the interpreter they kept: a task's check.
    pub async fn run_apart(
        &mut self,
        language: &Language,
        code: &str,
        cancel: &CancellationToken,
    ) -> Result<Option<ExecOutcome>, ExecError> {
        self.quiet(
            ExecRequest::new(language.clone(), code.to_owned()).isolated(),
            cancel,
        )
        .await
    }

    async fn quiet(
        &mut self,
        req: ExecRequest,
        cancel: &CancellationToken,
    ) -> Result<Option<ExecOutcome>, ExecError> {
        let ctx = ExecContext::new(cancel.child_token());
        let Some(session) = self.session(cancel).await? else {
            return Ok(None);
        };
        let ran = session.run(req, ctx).await?;
        Ok((ran.status != ExitStatus::Cancelled).then_some(ran))
    }

    /// Closes the session if one was opened.
    pub async fn close(mut self) -> Result<(), ExecError> {
        let closed = match self.session.take() {
            Some(s) => s.close().await,
            None => Ok(()),
        };
        // After the session that used their workspaces: dropping them removes what is left
        // of them, wherever their engines now answer.
        self.lost.clear();
        closed
    }
}

/// Why a task's list of languages cannot be used with its executor.
#[derive(Debug, thiserror::Error)]
pub enum LanguageListError {
    /// The list names no language.
    #[error("languages is empty; leave it out to allow every language the executor runs")]
    Empty,
    /// A name in the list is a data format (`json`, `text`), which is shown, never run.
    #[error(
        "language `{language}` is a data format that is shown, never run; the {executor} executor runs: {runs}"
    )]
    Data {
        /// The name given.
        language: Language,
        /// Executor name.
        executor: String,
        /// Comma-separated languages it runs.
        runs: String,
    },
    /// The executor does not run a language in the list.
    #[error(transparent)]
    Unsupported(#[from] ExecError),
}

/// A task's language allowlist, normalised (`py` → python) and checked against `executor`.
pub fn allowed_languages(
    asked: &[String],
    executor: &dyn Executor,
) -> Result<Vec<Language>, LanguageListError> {
    let mut allowed = Vec::with_capacity(asked.len());
    for raw in asked {
        let language = Language::new(raw);
        if language.is_data() {
            return Err(LanguageListError::Data {
                language,
                executor: executor.name().to_owned(),
                runs: tandem_executor::join_languages(executor.languages()),
            });
        }
        if !executor.supports(&language) {
            return Err(
                ExecError::unsupported(&language, executor.name(), executor.languages()).into(),
            );
        }
        if !allowed.contains(&language) {
            allowed.push(language);
        }
    }
    if allowed.is_empty() {
        return Err(LanguageListError::Empty);
    }
    Ok(allowed)
}

/// Words that start a shell command line rather than a Python statement.
const SHELL_WORDS: &[&str] = &[
    "pip", "pip3", "python", "python3", "node", "npm", "npx", "ls", "cd", "echo", "cat", "mkdir",
    "rm", "cp", "mv", "touch", "chmod", "grep", "find", "head", "tail", "wc", "curl", "wget",
    "git", "export", "apt", "apt-get", "sudo", "sh", "bash", "set", "uname", "pwd", "which", "env",
    "sleep", "sort", "uniq", "sed", "awk", "tar", "unzip", "make", "cargo", "go",
];

/// The language of an untagged block: its shebang, a shell command, or else Python.
pub fn guess_language(code: &str) -> Language {
    let first = code
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    if let Some(shebang) = first.strip_prefix("#!") {
        return if shebang.contains("python") {
            Language::python()
        } else if shebang.contains("node") {
            Language::javascript()
        } else {
            Language::sh()
        };
    }
    let first = first.strip_prefix("$ ").unwrap_or(first);
    let word = first.split_whitespace().next().unwrap_or("");
    if SHELL_WORDS.contains(&word) && !first.contains('(') {
        Language::sh()
    } else {
        Language::python()
    }
}

/// One block of a reply with what happened to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRun {
    /// Position in the reply, from 1.
    pub index: u32,
    /// The language it ran as (guessed when untagged).
    pub language: Language,
    /// The outcome.
    pub result: BlockResult,
    /// What the block says the code printed, when it is the model's own output block
    /// (```` ```output ````, or an untagged value): a claim to compare, never run.
    pub claim: Option<String>,
}

/// How blocks are run.
#[derive(Clone)]
pub struct RunOptions {
    /// Turn number for events.
    pub turn: u32,
    /// Per-block timeout override.
    pub timeout: Option<Duration>,
    /// Cancels the running block.
    pub cancel: CancellationToken,
    /// Where events go.
    pub events: EventSink,
    /// Checks each block before it runs; `None` runs every block.
    pub approval: Option<std::sync::Arc<crate::approval::ApprovalGate>>,
    /// Lets the blocks' code call tools, where the executor carries the calls: made for each
    /// block, from its index, its executor and a session spec on its workspace.
    pub code_tools: Option<CodeTools>,
}

/// Makes the tool handler of one block: `(index, executor, spec on its workspace, options,
/// the task's count of calls from code)`.
pub type CodeTools = Arc<
    dyn Fn(
            u32,
            Arc<dyn Executor>,
            SessionSpec,
            &RunOptions,
            Arc<std::sync::atomic::AtomicU32>,
        ) -> tandem_executor_kit::toolchannel::ToolHandler
        + Send
        + Sync,
>;

/// Runs `blocks` in order in one session; the first failure stops the rest, which are
/// reported as not run. Blocks past the session's `blocks_per_reply` are left out, with no
/// event each ([`report`] tells the model how many). `Err` means the sandbox broke, not the
/// program.
pub async fn run_blocks(
    slot: &mut SessionSlot,
    blocks: &[CodeBlock],
    opts: &RunOptions,
) -> Result<Vec<BlockRun>, ExecError> {
    let blocks = &blocks[..blocks.len().min(slot.blocks_per_reply())];
    let mut runs = Vec::with_capacity(blocks.len());
    let mut failed = false;
    for (i, block) in blocks.iter().enumerate() {
        let index = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let run = run_block(slot, block, index, failed, opts).await?;
        failed |= !run.result.succeeded();
        runs.push(run);
    }
    Ok(runs)
}

/// Runs one block as the `index`th of its reply, telling its events; `after_failure` reports
/// it as not run. `Err` means the sandbox broke, not the program.
pub async fn run_block(
    slot: &mut SessionSlot,
    block: &CodeBlock,
    index: u32,
    after_failure: bool,
    opts: &RunOptions,
) -> Result<BlockRun, ExecError> {
    let language = match block.language.as_deref() {
        Some(language) => Language::new(language),
        // An untagged value is what the model expects its code to print.
        None if crate::grounding::is_literal(&block.code) => Language::new("output"),
        None => guess_language(&block.code),
    };
    let span = crate::trace::block(slot.executor().name(), language.as_str(), opts.turn, index);
    let ran = run_block_traced(slot, block, language, index, after_failure, opts)
        .instrument(span.clone())
        .await;
    if !span.is_disabled() {
        trace_block(&span, slot, block, &ran);
    }
    ran
}

/// What a block's run says about it, on its span.
fn trace_block(
    span: &tracing::Span,
    slot: &SessionSlot,
    block: &CodeBlock,
    ran: &Result<BlockRun, ExecError>,
) {
    use crate::trace::set;
    let run = match ran {
        Ok(run) => run,
        Err(e) => return crate::trace::fail(span, "sandbox", &e.to_string()),
    };
    let r = &run.result;
    set(span, "tandem.block.status", r.status.as_str());
    if let Some(code) = r.exit_code {
        set(span, "process.exit.code", i64::from(code));
    }
    let bytes = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    set(span, "tandem.block.stdout_bytes", bytes(r.stdout.len()));
    set(span, "tandem.block.stderr_bytes", bytes(r.stderr.len()));
    set(
        span,
        "tandem.block.duration_ms",
        i64::try_from(r.duration_ms).unwrap_or(i64::MAX),
    );
    if let Some(used) = &r.resources {
        if let Some(cpu) = used.cpu_secs {
            set(span, "tandem.block.cpu_secs", cpu);
        }
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for (key, value) in [
            ("tandem.block.peak_memory_bytes", used.peak_memory_bytes),
            ("tandem.block.disk_written_bytes", used.disk_written_bytes),
            ("tandem.block.net_bytes_in", used.net_bytes_in),
            ("tandem.block.net_bytes_out", used.net_bytes_out),
        ] {
            if let Some(v) = value {
                set(span, key, count(v));
            }
        }
    }
    if let Some(host) = slot.host() {
        set(span, "tandem.sandbox.host", host);
    }
    if crate::trace::capture_content() {
        set(span, "tandem.block.code", block.code.clone());
        set(span, "tandem.block.stdout", r.stdout.clone());
        set(span, "tandem.block.stderr", r.stderr.clone());
    }
    if !r.succeeded() && r.status != BlockStatus::Skipped {
        crate::trace::fail(span, r.status.as_str(), "the block did not exit cleanly");
    }
}

async fn run_block_traced(
    slot: &mut SessionSlot,
    block: &CodeBlock,
    language: Language,
    index: u32,
    after_failure: bool,
    opts: &RunOptions,
) -> Result<BlockRun, ExecError> {
    let mut pictures = Vec::new();
    (opts.events)(EventMsg::CodeBlock {
        turn: opts.turn,
        index,
        language: Some(language.to_string()),
        code: block.code.clone(),
    });
    let result = if after_failure {
        not_run(&language, BlockStatus::NotRun, "")
    } else if block.unterminated {
        not_run(&language, BlockStatus::Incomplete, "")
    } else if language.is_data() {
        not_run(&language, BlockStatus::Skipped, "")
    } else if let Some(why) = slot.refusal(&language) {
        not_run(&language, BlockStatus::Unsupported, &why)
    } else {
        let code = match &opts.approval {
            None => Some(Ok(block.code.clone())),
            Some(gate) => {
                let executor = slot.executor().clone();
                let at = crate::approval::BlockAt {
                    turn: opts.turn,
                    index,
                    events: &opts.events,
                    cancel: &opts.cancel,
                };
                gate.decide(&language, executor.as_ref(), &block.code, &at)
                    .await
            }
        };
        match code {
            // Stopped while it waited: no one decided, so it is not declined.
            None => not_run(
                &language,
                BlockStatus::Cancelled,
                "the task stopped while the block waited for approval",
            ),
            Some(Err(why)) => not_run(&language, BlockStatus::Declined, &why),
            Some(Ok(code)) => match run_one(slot, &language, &code, index, opts).await {
                Ok((outcome, drawn)) => {
                    pictures = drawn;
                    to_result(&language, outcome)
                }
                Err(e @ ExecError::UnsupportedLanguage { .. }) => {
                    not_run(&language, BlockStatus::Unsupported, &e.to_string())
                }
                Err(e) => return Err(e),
            },
        }
    };
    (opts.events)(EventMsg::ExecResult {
        turn: opts.turn,
        index,
        result: result.clone(),
    });
    tell_pictures(pictures, index, opts);
    let claim = (result.status == BlockStatus::Skipped
        && crate::grounding::is_claim_language(&language))
    .then(|| block.code.clone());
    Ok(BlockRun {
        index,
        language,
        result,
        claim,
    })
}

/// Tells an `artifact` event for each picture a block (or a tool) drew.
pub(crate) fn tell_pictures(pictures: Vec<Picture>, index: u32, opts: &RunOptions) {
    for picture in pictures {
        (opts.events)(EventMsg::Artifact {
            turn: opts.turn,
            index,
            file: picture.path.to_string_lossy().into_owned(),
            mime: picture.mime.to_owned(),
            bytes: picture.bytes,
            href: None,
        });
    }
}

/// A picture a block wrote into the workspace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Picture {
    /// Its path in the workspace.
    pub path: std::path::PathBuf,
    /// Its media type.
    pub mime: &'static str,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Most workspace entries looked at to find what a block drew; a larger workspace gets no
/// picture events, so a block that writes a million files does not cost a million stats
/// after every block.
const PICTURE_SCAN: usize = 10_000;

/// The pictures in a workspace, by path: their size and when they were written.
pub type Pictures = std::collections::HashMap<std::path::PathBuf, (u64, u64)>;

/// The pictures in `workspace` now (none when there is no workspace, or it is too large to
/// look through).
pub async fn pictures_in(workspace: Option<std::path::PathBuf>) -> Pictures {
    let Some(workspace) = workspace else {
        return Default::default();
    };
    tokio::task::spawn_blocking(move || {
        tandem_executor_kit::archive::list(&workspace, PICTURE_SCAN)
            .unwrap_or_default()
            .into_iter()
            .filter(|f| tandem_executor_kit::archive::picture_type(&f.path).is_some())
            .map(|f| (f.path, (f.bytes, f.modified_ms)))
            .collect()
    })
    .await
    .unwrap_or_default()
}

/// The pictures of `after` that are new or changed since `before`, in path order.
pub fn drawn_since(before: &Pictures, after: Pictures) -> Vec<Picture> {
    let mut drawn: Vec<Picture> = after
        .into_iter()
        .filter(|(path, seen)| before.get(path) != Some(seen))
        .filter_map(|(path, (bytes, _))| {
            let mime = tandem_executor_kit::archive::picture_type(&path)?;
            Some(Picture { path, mime, bytes })
        })
        .collect();
    drawn.sort_by(|a, b| a.path.cmp(&b.path));
    drawn
}

/// Runs one block; its outcome, and the pictures it wrote (new or changed files).
pub(crate) async fn run_one(
    slot: &mut SessionSlot,
    language: &Language,
    code: &str,
    index: u32,
    opts: &RunOptions,
) -> Result<(ExecOutcome, Vec<Picture>), ExecError> {
    let events = opts.events.clone();
    let turn = opts.turn;
    // A read can end inside a character; its first bytes wait for the rest, so live output
    // shows `é`, not two replacement characters.
    let pending = Arc::new(std::sync::Mutex::new([Vec::new(), Vec::new()]));
    let emit = move |stream: OutputStream, bytes: &[u8], end: bool| {
        let Ok(mut pending) = pending.lock() else {
            return;
        };
        let buf = &mut pending[stream as usize];
        buf.extend_from_slice(bytes);
        let cut = if end { buf.len() } else { complete_utf8(buf) };
        if cut == 0 {
            return;
        }
        let text = String::from_utf8_lossy(&buf[..cut]).into_owned();
        buf.drain(..cut);
        events(EventMsg::ExecOutput {
            turn,
            index,
            stream,
            text,
        });
    };
    let sink = {
        let emit = emit.clone();
        move |stream, bytes: &[u8]| {
            let stream = match stream {
                Stream::Stdout => OutputStream::Stdout,
                Stream::Stderr => OutputStream::Stderr,
            };
            emit(stream, bytes, false);
        }
    };
    let base = ExecContext::new(opts.cancel.child_token()).with_sink(Arc::new(sink));
    let mut req = ExecRequest::new(language.clone(), code.to_owned());
    req.timeout = opts.timeout;
    let mut workspace = None;
    let mut before = slot.pictures.take();
    let code_tools = opts
        .code_tools
        .clone()
        .filter(|_| slot.executor.carries_tool_calls());
    let mut moves = 0;
    let outcome = loop {
        let (slot_executor, slot_spec) = (slot.executor.clone(), slot.spec.clone());
        let counted = slot.code_calls.clone();
        let mut ctx = base.clone();
        let ran = match slot.session(&ctx.cancel).await? {
            Some(session) => {
                workspace = session.workspace().map(std::path::Path::to_owned);
                if before.is_none() {
                    before = Some(pictures_in(workspace.clone()).await);
                }
                if let (Some(make), Some(dir)) = (&code_tools, &workspace) {
                    let spec = SessionSpec {
                        workdir: Some(dir.clone()),
                        inputs: None,
                        keep_state: false,
                        ..slot_spec
                    };
                    ctx = ctx.with_tools(make(index, slot_executor, spec, opts, counted));
                }
                session.run(req.clone(), ctx).await
            }
            None => Ok(ExecOutcome {
                status: ExitStatus::Cancelled,
                stdout: Default::default(),
                stderr: Default::default(),
                duration: Duration::ZERO,
                resources: None,
            }),
        };
        match ran {
            Err(ExecError::Lost { host, reason }) if moves < MOST_MOVES => {
                moves += 1;
                tracing::warn!(%host, %reason, "a block's sandbox was lost; running it again on another host");
                (opts.events)(EventMsg::SandboxLost {
                    turn,
                    index,
                    host,
                    reason,
                });
                slot.carry_on();
            }
            other => break other,
        }
    };
    // One look at the workspace per block: what it holds now is the next block's before.
    let after = pictures_in(workspace).await;
    let drawn = drawn_since(&before.unwrap_or_default(), after.clone());
    slot.pictures = Some(after);
    // Bytes left of a character at the end of the live head are the program's unfinished
    // character only when nothing came after them; otherwise the character continues past
    // the head, in the text the result carries.
    for (stream, continues) in [
        (
            OutputStream::Stdout,
            outcome
                .as_ref()
                .is_ok_and(|o| o.stdout.continues_past_head()),
        ),
        (
            OutputStream::Stderr,
            outcome
                .as_ref()
                .is_ok_and(|o| o.stderr.continues_past_head()),
        ),
    ] {
        emit(stream, &[], !continues);
    }
    Ok((outcome?, drawn))
}

fn not_run(language: &Language, status: BlockStatus, stderr: &str) -> BlockResult {
    BlockResult {
        language: Some(language.to_string()),
        status,
        exit_code: None,
        stdout: String::new(),
        stderr: stderr.to_owned(),
        truncated: false,
        duration_ms: 0,
        resources: None,
    }
}

/// Converts an executor outcome into the wire result.
pub fn to_result(language: &Language, outcome: ExecOutcome) -> BlockResult {
    let (status, exit_code) = match outcome.status {
        ExitStatus::Exited(c) => (BlockStatus::Exited, Some(c)),
        ExitStatus::Signaled(_) => (BlockStatus::Killed, None),
        ExitStatus::TimedOut => (BlockStatus::TimedOut, None),
        ExitStatus::OutOfMemory => (BlockStatus::OutOfMemory, None),
        ExitStatus::Cancelled => (BlockStatus::Cancelled, None),
    };
    let killed_by = match outcome.status {
        ExitStatus::Signaled(sig) => Some(sig),
        _ => None,
    };
    let mut stderr = outcome.stderr.to_text();
    if let Some(sig) = killed_by {
        let why = match sig {
            24 => " (CPU time limit exceeded)",
            25 => " (file size limit exceeded)",
            9 => " (SIGKILL)",
            _ => "",
        };
        let _ = writeln!(stderr, "{}killed by signal {sig}{why}", sep(&stderr));
    }
    let peak = outcome
        .resources
        .as_ref()
        .and_then(|r| r.peak_memory_bytes)
        .map(|p| format!("; its peak was {:.1} MB", p as f64 / 1e6))
        .unwrap_or_default();
    if outcome.status == ExitStatus::OutOfMemory {
        let _ = writeln!(
            stderr,
            "{}killed: over the sandbox's memory limit (limits.memory_bytes){peak}",
            sep(&stderr)
        );
    } else if matches!(outcome.status, ExitStatus::Exited(code) if code != 0)
        && stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .is_some_and(|l| l.starts_with("MemoryError"))
    {
        // Where the limit bounds what a block may allocate (a local block's address space, a
        // WASM guest's memory) an allocation past it fails in the block, which ends with
        // Python's MemoryError rather than being killed.
        let _ = writeln!(
            stderr,
            "{}out of memory: an allocation failed at the sandbox's memory limit (limits.memory_bytes){peak}",
            sep(&stderr)
        );
    }
    BlockResult {
        language: Some(language.to_string()),
        status,
        exit_code,
        truncated: outcome.stdout.truncated() || outcome.stderr.truncated(),
        stdout: outcome.stdout.to_text(),
        stderr,
        duration_ms: u64::try_from(outcome.duration.as_millis()).unwrap_or(u64::MAX),
        resources: outcome.resources.map(Box::new),
    }
}

fn sep(s: &str) -> &'static str {
    if s.is_empty() || s.ends_with('\n') {
        ""
    } else {
        "\n"
    }
}

/// The conventional exit code for a result (124 on timeout, 128+n when killed).
pub fn exit_code_of(result: &BlockResult) -> i32 {
    match result.status {
        BlockStatus::Exited => result.exit_code.unwrap_or(1),
        BlockStatus::TimedOut => 124,
        BlockStatus::Killed | BlockStatus::OutOfMemory => 137,
        BlockStatus::Cancelled => 130,
        BlockStatus::Skipped => 0,
        _ => 1,
    }
}

/// What a report's output follows.
const OUTPUT_HEAD: &str = "Your code printed: ";
/// How a report of blocks that all succeeded begins.
const CLEAN_HEAD: &str = "exitcode: 0 (execution succeeded)\n";

/// The note on blocks that all ran cleanly and printed nothing.
const PRINTED_NOTHING: &str =
    "The code ran without error but printed nothing: print() the results you need to see.";

/// What a clean report says its code printed, read back from its text (a resumed run's
/// reports keep no more): the output up to the first note.
pub fn printed_in(report: &str) -> Option<String> {
    if !clean_report(report) || report.contains(CLAIM_MARK) {
        return None;
    }
    let output = report.strip_prefix(CLEAN_HEAD)?.strip_prefix(OUTPUT_HEAD)?;
    let notes = [
        "If this answers the task, write the answer",
        "Note: the output of block",
        "Your reply had ",
        "Block ",
    ];
    let end = notes
        .iter()
        .filter_map(|n| output.find(&format!("\n{n}")))
        .min()
        .unwrap_or(output.len());
    Some(output[..end].to_owned()).filter(|o| !o.trim().is_empty())
}

/// What ends the note on an output block of the model's that its code's output contradicts.
pub const CLAIM_MARK: &str = "Answer from what your code printed.";

/// Whether `report` tells of blocks that all ran cleanly and printed something.
pub fn clean_report(report: &str) -> bool {
    !report.contains(PRINTED_NOTHING)
        && !report.contains(crate::examples::FAILED_MARK)
        && report
            .strip_prefix(CLEAN_HEAD)
            .and_then(|rest| rest.strip_prefix(OUTPUT_HEAD))
            .is_some_and(|output| !output.trim().is_empty())
}

/// Whether `report` tells of blocks that all exited 0, whatever they printed, with the
/// task's examples holding where they were run.
/// An output block the run contradicts keeps the reply that wrote it from ending the task:
/// its words were written beside a guess.
pub fn ran_clean(report: &str) -> bool {
    report.starts_with(CLEAN_HEAD)
        && !report.contains(crate::examples::FAILED_MARK)
        && !report.contains(CLAIM_MARK)
}

/// `report` with the note on the task's examples: they are output the model reads, so the
/// note on a run that printed nothing goes.
pub fn with_examples(report: String, note: &str) -> String {
    let mut report = match report.find(PRINTED_NOTHING) {
        Some(at) => {
            let mut cut = report;
            cut.replace_range(at..at + PRINTED_NOTHING.len(), "");
            cut.trim_end().to_owned()
        }
        None => report,
    };
    if !report.ends_with('\n') {
        report.push('\n');
    }
    report.push_str(note);
    report
}

/// The distribution to install for the first module a block could not import, when one
/// could not: `import yaml` wants `pyyaml`.
pub fn missing_module(runs: &[BlockRun]) -> Option<String> {
    const MARK: &str = "ModuleNotFoundError: No module named '";
    let stderr = runs.iter().find_map(|r| {
        let at = r.result.stderr.rfind(MARK)?;
        Some(&r.result.stderr[at + MARK.len()..])
    })?;
    let module = stderr.split('\'').next()?.split('.').next()?;
    if module.is_empty()
        || !module
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return None;
    }
    let known = [
        ("yaml", "pyyaml"),
        ("cv2", "opencv-python-headless"),
        ("sklearn", "scikit-learn"),
        ("PIL", "pillow"),
        ("bs4", "beautifulsoup4"),
        ("dateutil", "python-dateutil"),
    ];
    Some(
        known
            .iter()
            .find(|(m, _)| *m == module)
            .map_or(module, |(_, d)| d)
            .to_owned(),
    )
}

/// What the executor agent tells the model after running a reply's blocks, in AutoGen's
/// `exitcode: N (execution succeeded|failed)\nYour code printed: ...` shape plus notes; `no_code`
/// when none of them was a program.
pub fn report(
    runs: &[BlockRun],
    left_out: usize,
    block_timeout: Duration,
    output_cap: usize,
    no_code: &str,
) -> String {
    let ran: Vec<&BlockRun> = runs
        .iter()
        .filter(|r| !matches!(r.result.status, BlockStatus::Skipped | BlockStatus::NotRun))
        .collect();
    let mut output = String::new();
    let mut notes = Vec::new();
    for r in &ran {
        let res = &r.result;
        output.push_str(&res.stdout);
        output.push_str(sep(&output));
        output.push_str(&crate::traceback::trim(&res.stderr));
        output.push_str(sep(&output));
        let i = r.index;
        match res.status {
            BlockStatus::TimedOut => notes.push(format!(
                "Timeout: block {i} ran longer than {} s and was killed; the output above is what it printed before that.",
                block_timeout.as_secs_f64()
            )),
            BlockStatus::OutOfMemory => {
                notes.push(format!("Out of memory: block {i} was killed for using too much memory."));
            }
            BlockStatus::Unsupported => notes.push(format!(
                "Block {i} is in a language this task cannot run; rewrite it in an allowed language."
            )),
            BlockStatus::Incomplete => notes.push(format!(
                "Your reply was cut off inside code block {i}, so it was not run. Send the complete code again, in one block."
            )),
            BlockStatus::Declined => notes.push(format!(
                "Block {i} was not run: it was declined, for the reason above. Do not send it again unchanged; take another way or explain."
            )),
            _ => {}
        }
        if res.truncated {
            notes.push(format!(
                "Note: the output of block {i} was longer than {} KiB per stream; the middle was cut.",
                output_cap / 1024
            ));
        }
    }
    let all_clean = !ran.is_empty() && ran.iter().all(|r| r.result.succeeded());
    for r in runs {
        match r.result.status {
            // The model's own output block is compared with what ran, once the code ran
            // cleanly; beside a failure, the failure is what matters.
            BlockStatus::Skipped if r.claim.is_some() => {
                if let (true, Some(claim)) = (all_clean, &r.claim) {
                    let printed: String = ran
                        .iter()
                        .filter(|b| b.index < r.index)
                        .map(|b| b.result.stdout.as_str())
                        .collect();
                    let printed = if printed.trim().is_empty() {
                        ran.iter().map(|b| b.result.stdout.as_str()).collect()
                    } else {
                        printed
                    };
                    if let Some(differs) = crate::grounding::claim_differs(claim, &printed) {
                        notes.push(format!(
                            "Block {} (`{}`) is what your reply says the code printed, not what it printed. {differs} {CLAIM_MARK}",
                            r.index, r.language
                        ));
                    }
                }
            }
            BlockStatus::Skipped => notes.push(format!(
                "Block {} (`{}`) was not run: it is data or prose, not a program.",
                r.index, r.language
            )),
            BlockStatus::NotRun => notes.push(format!(
                "Block {} was not run because an earlier block failed.",
                r.index
            )),
            _ => {}
        }
    }
    if left_out > 0 {
        notes.push(format!(
            "Your reply had {} code blocks; at most {} are taken from one reply, so the last {left_out} were not run. Send fewer blocks: put steps that belong together in one.",
            runs.len() + left_out,
            runs.len()
        ));
    }
    let last = ran
        .iter()
        .rev()
        .find(|r| !r.result.succeeded())
        .or(ran.last());
    // A clean run that printed nothing leaves a small model guessing what happened.
    if ran.iter().all(|r| r.result.succeeded()) && !ran.is_empty() && output.trim().is_empty() {
        notes.push(PRINTED_NOTHING.to_owned());
    }
    let mut text = match last {
        Some(r) => {
            let code = exit_code_of(&r.result);
            let verdict = if r.result.succeeded() {
                "execution succeeded"
            } else {
                "execution failed"
            };
            format!("exitcode: {code} ({verdict})\n{OUTPUT_HEAD}{output}")
        }
        None => no_code.to_owned(),
    };
    for note in notes {
        if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&note);
    }
    text
}

/// What the model hears when its reply had nothing to run and did not end the task; it
/// names the languages that run here.
pub fn no_code_nudge(termination: &str, languages: &[Language]) -> String {
    let fences: Vec<String> = languages.iter().map(|l| format!("```{l}")).collect();
    let fences = match fences.as_slice() {
        [] => "fenced code".to_owned(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    };
    format!(
        "No code to run was found in your reply. If the task is done, reply with {termination}. Otherwise, send the complete code in a {fences} block."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_untagged_languages() {
        assert_eq!(guess_language("pip install x\n"), Language::sh());
        assert_eq!(guess_language("$ ls -la"), Language::sh());
        assert_eq!(
            guess_language("#!/usr/bin/env node\nconsole.log(1)"),
            Language::javascript()
        );
        assert_eq!(guess_language("print(1)"), Language::python());
        assert_eq!(guess_language("import os\n"), Language::python());
        assert_eq!(guess_language("set(x)"), Language::python());
    }

    #[test]
    fn a_character_split_across_reads_waits_for_its_end() {
        let cafe = "café ✓ 🎉".as_bytes();
        for split in 0..=cafe.len() {
            let head = &cafe[..split];
            let cut = complete_utf8(head);
            assert!(std::str::from_utf8(&head[..cut]).is_ok(), "split {split}");
            assert!(head.len() - cut < 4, "split {split}");
        }
        assert_eq!(complete_utf8(b"caf\xc3"), 3);
        assert_eq!(complete_utf8(b"\xf0\x9f\x8e"), 0);
        assert_eq!(complete_utf8(b"\xf0\x9f\x8e\x89"), 4);
        // Bytes that can never be completed are passed on (and shown as U+FFFD).
        assert_eq!(complete_utf8(b"ab\x80"), 3);
        assert_eq!(complete_utf8(b"ab\xff"), 3);
    }

    fn ran(exit_code: i32, stdout: &str, stderr: &str) -> BlockRun {
        BlockRun {
            claim: None,
            index: 1,
            language: Language::python(),
            result: BlockResult {
                language: Some("python".into()),
                status: BlockStatus::Exited,
                exit_code: Some(exit_code),
                stdout: stdout.into(),
                stderr: stderr.into(),
                truncated: false,
                duration_ms: 1,
                resources: None,
            },
        }
    }

    #[test]
    fn the_report_says_when_a_clean_run_printed_nothing_and_cuts_library_frames() {
        let said = |runs: &[BlockRun]| report(runs, 0, Duration::from_secs(1), 1024, "none");
        let silent = said(&[ran(0, "", "")]);
        assert!(silent.contains("printed nothing"), "{silent}");
        assert!(!clean_report(&silent), "{silent}");
        let spoke = said(&[ran(0, "42\n", "")]);
        assert!(
            !spoke.contains("printed nothing") && clean_report(&spoke),
            "{spoke}"
        );
        let failed = said(&[ran(
            1,
            "",
            "Traceback (most recent call last):\n  File \"/w/.tandem-block-1.py\", line 2, in <module>\n    json.loads(x)\n  File \"/usr/lib/python3.11/json/__init__.py\", line 346, in loads\n    return _default_decoder.decode(s)\njson.decoder.JSONDecodeError: Expecting value\n",
        )]);
        assert!(!clean_report(&failed), "{failed}");
        assert!(!failed.contains("_default_decoder"), "{failed}");
        assert!(
            failed.contains("1 frame inside libraries left out"),
            "{failed}"
        );
        assert!(
            failed.contains("JSONDecodeError: Expecting value"),
            "{failed}"
        );
    }
}
