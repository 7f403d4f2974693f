//! Tandem executors that run as separate programs: a plugin is any program that speaks the
//! executor protocol (JSON-RPC 2.0, one message per line on its stdin and stdout; see
//! docs/executor-protocol.md). Tandem supervises it: starts it on first use, starts it again
//! after it dies, enforces each block's timeout and cancellation from its own side (killing
//! the plugin if it does not stop the block), and bounds the output it keeps.
//!
//! ```no_run
//! # async fn f() -> Result<(), tandem_executor::ExecError> {
//! use tandem_executor_plugin::{PluginConfig, PluginExecutor};
//! let plugin = PluginExecutor::new(PluginConfig::new(
//!     "mine",
//!     vec!["python3".into(), "plugin.py".into()],
//! ))
//! .await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod rpc;
mod wire;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::json;
use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, ExitStatus, Language,
    Limits, Session, SessionSpec,
};
use tandem_executor_kit::process::{Bounded, bounded};
use tandem_executor_kit::scratch;
use tandem_executor_kit::scratch::TempTree;

use rpc::{CallError, Connection, RunOutput};
pub use wire::PROTOCOL_VERSION;

/// How long a plugin has to end a block after `$/cancel` before Tandem kills it.
const CANCEL_GRACE: Duration = Duration::from_secs(1);

/// How to start and talk to one plugin.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// The executor's name (`--executor NAME`).
    pub name: String,
    /// The program and its arguments.
    pub command: Vec<String>,
    /// The plugin's whole environment: nothing of Tandem's own is passed but this.
    pub env: Vec<(String, String)>,
    /// Its working directory; Tandem's when `None`.
    pub cwd: Option<PathBuf>,
    /// Languages it runs; when `None`, the plugin is started at once to ask it.
    pub languages: Option<Vec<Language>>,
    /// How long it may take to answer `initialize`.
    pub start_timeout: Duration,
    /// How long `session/open` and `session/close` may take.
    pub session_timeout: Duration,
    /// The longest line Tandem reads from it; longer messages are dropped.
    pub max_message_bytes: usize,
}

impl PluginConfig {
    /// A plugin called `name` started with `command`, with the default limits.
    pub fn new(name: impl Into<String>, command: Vec<String>) -> Self {
        Self {
            name: name.into(),
            command,
            env: Vec::new(),
            cwd: None,
            languages: None,
            start_timeout: Duration::from_secs(10),
            session_timeout: Duration::from_secs(10),
            max_message_bytes: 8 << 20,
        }
    }
}

/// What a plugin said about itself when it started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginInfo {
    /// The name it gives itself, if any.
    pub name: Option<String>,
    /// The languages it says it runs, if it says.
    pub languages: Option<Vec<Language>>,
    /// The limits it says it enforces itself (`wall`, `memory_bytes`, ...).
    pub enforces: Vec<String>,
}

/// An executor whose sessions live in a plugin process.
pub struct PluginExecutor {
    inner: Arc<Inner>,
}

struct Inner {
    config: PluginConfig,
    languages: OnceLock<Vec<Language>>,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    info: Mutex<Option<PluginInfo>>,
    starts: AtomicU64,
    /// Where temporary workspaces go.
    root: PathBuf,
}

/// Temporary workspaces live in `$TMPDIR/tandem-plugin-<pid>-<start-time>/`.
const ROOT_PREFIX: &str = "tandem-plugin-";

impl Inner {
    fn unavailable(&self, hint: String) -> ExecError {
        ExecError::Unavailable {
            what: format!(
                "executor plugin `{}` (`{}`)",
                self.config.name,
                self.config.command.join(" ")
            ),
            hint,
        }
    }

    /// The running plugin, started (or started again after it died) as needed.
    async fn connection(&self) -> Result<Arc<Connection>, ExecError> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            if c.alive() {
                return Ok(c.clone());
            }
            let ended = c.how_it_ended().await;
            tracing::warn!(plugin = %self.config.name, "executor plugin `{}` {ended}; starting it again", self.config.name);
        }
        *slot = None;
        self.starts.fetch_add(1, Ordering::Relaxed);
        let connection = Connection::spawn(&self.config).map_err(|e| {
            self.unavailable(format!(
                "starting it failed: {e}; check `command` in [executors.{}]",
                self.config.name
            ))
        })?;
        let mark = connection.fault_mark();
        let answer = connection
            .call(
                "initialize",
                json!({
                    "protocol_version": PROTOCOL_VERSION,
                    "client": {"name": "tandem", "version": env!("CARGO_PKG_VERSION")},
                }),
                self.config.start_timeout,
            )
            .await;
        let since = |c: &Connection| {
            c.faults_since(mark)
                .map_or(String::new(), |f| format!("; it {f}"))
        };
        let info = match answer {
            Ok(value) => match serde_json::from_value::<wire::Initialized>(value) {
                Ok(i) if i.protocol_version == PROTOCOL_VERSION => i,
                Ok(i) => {
                    connection.kill("speaks another protocol version");
                    return Err(self.unavailable(format!(
                        "it speaks executor protocol version {}, and this Tandem speaks {PROTOCOL_VERSION}",
                        i.protocol_version
                    )));
                }
                Err(e) => {
                    connection.kill("gave an initialize answer Tandem cannot read");
                    return Err(
                        self.unavailable(format!("its answer to initialize cannot be read: {e}"))
                    );
                }
            },
            Err(CallError::TimedOut(t)) => {
                let faults = since(&connection);
                connection.kill("did not answer initialize");
                return Err(self.unavailable(format!(
                    "it did not answer initialize within {} s{faults}; is it a Tandem executor plugin?",
                    t.as_secs_f64()
                )));
            }
            Err(e) => {
                let ended = match e {
                    CallError::Rpc { code, message } => {
                        format!("it refused initialize: {message} (error {code})")
                    }
                    _ => format!(
                        "it {} before answering initialize",
                        connection.how_it_ended().await
                    ),
                };
                let faults = since(&connection);
                connection.kill("failed to start");
                return Err(self.unavailable(format!("{ended}{faults}")));
            }
        };
        let said = PluginInfo {
            name: info.name,
            languages: info
                .languages
                .map(|l| l.iter().map(|s| Language::new(s.as_str())).collect()),
            enforces: info.enforces,
        };
        if let (Some(said), Some(configured)) = (&said.languages, &self.config.languages)
            && said != configured
        {
            tracing::warn!(
                plugin = %self.config.name,
                "executor plugin `{}` says it runs {}, but its configuration says {}; the configuration is used",
                self.config.name,
                tandem_executor::join_languages(said),
                tandem_executor::join_languages(configured)
            );
        }
        if let Ok(mut slot) = self.info.lock() {
            *slot = Some(said);
        }
        let connection = Arc::new(connection);
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// Opens a session for `workspace` on `connection`; returns the plugin's session id.
    async fn open_on(
        &self,
        connection: &Connection,
        workspace: &Path,
        limits: &Limits,
    ) -> Result<String, ExecError> {
        let value = self
            .call(
                connection,
                "session/open",
                json!({"workdir": workspace, "limits": limits}),
            )
            .await?;
        serde_json::from_value::<wire::Opened>(value)
            .map(|o| o.session)
            .map_err(|e| {
                ExecError::Backend(format!(
                    "executor plugin `{}` answered session/open with something Tandem cannot read: {e}",
                    self.config.name
                ))
            })
    }

    /// A session request answered within the configured time, its failure said in full.
    async fn call(
        &self,
        connection: &Connection,
        method: &str,
        params: serde_json::Value,
    ) -> Result<serde_json::Value, ExecError> {
        let mark = connection.fault_mark();
        connection
            .call(method, params, self.config.session_timeout)
            .await
            .map_err(|e| self.failed(method, connection, mark, e))
    }

    /// The error for `method` failing with `e`, with the protocol violations after `mark`.
    fn failed(&self, method: &str, connection: &Connection, mark: u64, e: CallError) -> ExecError {
        let name = &self.config.name;
        ExecError::Backend(match e {
            CallError::Rpc { code, message } => {
                format!("executor plugin `{name}` refused {method}: {message} (error {code})")
            }
            CallError::Gone => format!(
                "executor plugin `{name}` stopped before it answered {method}; it is started again on next use"
            ),
            CallError::TimedOut(t) => {
                let faults = connection
                    .faults_since(mark)
                    .map_or(String::new(), |f| format!(" (it {f})"));
                format!(
                    "executor plugin `{name}` did not answer {method} within {} s{faults}",
                    t.as_secs_f64()
                )
            }
            CallError::Write(e) => {
                connection.kill("cannot be written to");
                format!("executor plugin `{name}` cannot be written to: {e}")
            }
        })
    }
}

impl PluginExecutor {
    /// A plugin executor; starts the plugin now only when `config.languages` is `None`, to
    /// ask which languages it runs.
    pub async fn new(config: PluginConfig) -> Result<Self, ExecError> {
        let inner = Arc::new(Inner {
            root: scratch::process_root(ROOT_PREFIX),
            languages: OnceLock::new(),
            connection: tokio::sync::Mutex::new(None),
            info: Mutex::new(None),
            starts: AtomicU64::new(0),
            config,
        });
        if inner.config.command.is_empty() {
            return Err(inner.unavailable(format!(
                "its command is empty; set command = [\"program\", \"arg\", ...] in [executors.{}]",
                inner.config.name
            )));
        }
        let languages = match &inner.config.languages {
            Some(l) => l.clone(),
            None => {
                inner.connection().await?;
                inner
                    .info
                    .lock()
                    .ok()
                    .and_then(|i| i.as_ref().and_then(|i| i.languages.clone()))
                    .ok_or_else(|| {
                        inner.unavailable(format!(
                            "it names no languages when it starts; add languages = [...] to [executors.{}]",
                            inner.config.name
                        ))
                    })?
            }
        };
        let _ = inner.languages.set(languages);
        Ok(Self { inner })
    }

    /// What the plugin says about itself; starts it if it is not running.
    pub async fn info(&self) -> Result<PluginInfo, ExecError> {
        self.inner.connection().await?;
        self.inner
            .info
            .lock()
            .ok()
            .and_then(|i| i.clone())
            .ok_or_else(|| ExecError::Backend("the plugin's answer was lost".to_owned()))
    }

    /// How many times the plugin process has been started.
    pub fn starts(&self) -> u64 {
        self.inner.starts.load(Ordering::Relaxed)
    }

    /// The running plugin's pid, if it is running.
    pub async fn pid(&self) -> Option<u32> {
        let slot = self.inner.connection.lock().await;
        slot.as_ref().filter(|c| c.alive()).map(|c| c.pid())
    }

    /// Asks the plugin to shut down, waits for its answer (briefly), then lets it go: it
    /// exits on its own or its process group is killed.
    pub async fn shutdown(&self) {
        let connection = self.inner.connection.lock().await.take();
        if let Some(c) = connection
            && c.alive()
        {
            let _ = c.call("shutdown", json!({}), rpc::EXIT_GRACE).await;
        }
    }

    /// Kills temporary workspaces that a Tandem which has since died left behind.
    pub fn reap_orphans() -> usize {
        scratch::reap_dead_roots(ROOT_PREFIX)
    }
}

impl Executor for PluginExecutor {
    fn name(&self) -> &str {
        &self.inner.config.name
    }

    fn languages(&self) -> &[Language] {
        self.inner.languages.get().map_or(&[], Vec::as_slice)
    }

    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        Box::pin(async move {
            let (workspace, owned) =
                scratch::open_workspace(spec.workdir, &self.inner.root, "ws-")?;
            let connection = self.inner.connection().await?;
            let id = self
                .inner
                .open_on(&connection, &workspace, &spec.limits)
                .await?;
            Ok(Box::new(PluginSession {
                inner: self.inner.clone(),
                connection,
                id,
                workspace,
                owned,
                limits: spec.limits,
                closed: false,
            }) as Box<dyn Session>)
        })
    }

    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            self.inner
                .connection()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }
}

struct PluginSession {
    inner: Arc<Inner>,
    connection: Arc<Connection>,
    /// The plugin's id for this session.
    id: String,
    workspace: PathBuf,
    /// Owns the workspace when Tandem made it.
    owned: Option<TempTree>,
    limits: Limits,
    closed: bool,
}

impl PluginSession {
    /// The session's connection, reopened on a new start of the plugin if the old one died
    /// (files in the workspace are kept: the workspace is Tandem's).
    async fn connection(&mut self) -> Result<Arc<Connection>, ExecError> {
        if !self.connection.alive() {
            let connection = self.inner.connection().await?;
            self.id = self
                .inner
                .open_on(&connection, &self.workspace, &self.limits)
                .await?;
            self.connection = connection;
        }
        Ok(self.connection.clone())
    }

    async fn run_block(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> Result<ExecOutcome, ExecError> {
        let name = self.inner.config.name.clone();
        let languages = self.inner.languages.get().map_or(&[][..], Vec::as_slice);
        if !languages.contains(&req.language) {
            return Err(ExecError::unsupported(&req.language, &name, languages));
        }
        let connection = self.connection().await?;
        let timeout = req.timeout.unwrap_or(self.limits.wall);
        let output = Arc::new(Mutex::new(RunOutput::new(
            self.limits.output_bytes,
            ctx.sink.clone(),
        )));
        let mark = connection.fault_mark();
        let started = Instant::now();
        let (id, mut answer) = connection
            .begin(
                "session/run",
                json!({
                    "session": self.id,
                    "language": req.language.as_str(),
                    "code": req.code,
                    "timeout_secs": timeout.as_secs_f64(),
                }),
                Some(output.clone()),
            )
            .await
            .map_err(|e| self.inner.failed("session/run", &connection, mark, e))?;
        let reply = match bounded(&mut answer, timeout, &ctx.cancel).await {
            Bounded::Finished(reply) => Ok(reply),
            stopped => {
                let status = if matches!(stopped, Bounded::TimedOut) {
                    ExitStatus::TimedOut
                } else {
                    ExitStatus::Cancelled
                };
                let _ = connection.notify("$/cancel", json!({"id": id})).await;
                match tokio::time::timeout(CANCEL_GRACE, &mut answer).await {
                    // Its own account of the end is kept for the output, not the status:
                    // Tandem's clock decided.
                    Ok(Ok(Ok(_))) => Err(status),
                    _ => {
                        connection.kill(&format!(
                            "did not end a block within {} s of $/cancel",
                            CANCEL_GRACE.as_secs()
                        ));
                        if let Some(faults) = connection.faults_since(mark) {
                            return Err(ExecError::Backend(format!(
                                "executor plugin `{name}` never answered the block: it {faults}; it was killed and starts again for the next block"
                            )));
                        }
                        Err(status)
                    }
                }
            }
        };
        connection.forget(id);
        let (status, ran) = match reply {
            Err(status) => (status, None),
            Ok(Ok(Ok(value))) => match serde_json::from_value::<wire::Ran>(value) {
                Ok(ran) => (ran.status.into(), Some(ran)),
                Err(e) => {
                    return Err(ExecError::Backend(format!(
                        "executor plugin `{name}` answered session/run with something Tandem cannot read: {e}"
                    )));
                }
            },
            Ok(Ok(Err((code, message)))) => {
                return Err(ExecError::Backend(format!(
                    "executor plugin `{name}` could not run the block: {message} (error {code})"
                )));
            }
            Ok(Err(_)) => {
                let ended = connection.how_it_ended().await;
                return Err(ExecError::Backend(format!(
                    "executor plugin `{name}` {ended} while running the block; it starts again for the next block"
                )));
            }
        };
        let elapsed = started.elapsed();
        let mut output = match Arc::try_unwrap(output) {
            Ok(m) => m.into_inner().ok(),
            Err(shared) => shared
                .lock()
                .ok()
                .map(|mut o| std::mem::replace(&mut *o, RunOutput::new(0, Arc::new(|_, _| {})))),
        }
        .ok_or_else(|| ExecError::Backend("a block's output was lost".to_owned()))?;
        let duration = match &ran {
            Some(r) => {
                output.push(tandem_executor::Stream::Stdout, r.stdout.as_bytes(), 0);
                output.push(tandem_executor::Stream::Stderr, r.stderr.as_bytes(), 0);
                r.duration_secs
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                    .filter(|d| *d <= elapsed)
                    .unwrap_or(elapsed)
            }
            None => elapsed,
        };
        // A figure the plugin did not give is missing, with the reason, never zero.
        let resources = ran
            .and_then(|r| r.resources)
            .unwrap_or_else(|| {
                tandem_executor::Resources::unavailable(format!(
                    "executor plugin `{name}` did not say what the block used (`resources` in its answer to session/run)"
                ))
            });
        Ok(ExecOutcome {
            status,
            stdout: output.stdout.finish(),
            stderr: output.stderr.finish(),
            duration,
            resources: Some(resources),
        })
    }
}

impl Session for PluginSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(self.run_block(req, ctx))
    }

    fn workspace(&self) -> Option<&Path> {
        Some(&self.workspace)
    }

    fn put_archive(
        &mut self,
        archive: &Path,
        caps: tandem_executor::files::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<tandem_executor::files::ArchivedFile>, ExecError>> {
        tandem_executor_kit::put_in_workspace(self.workspace(), archive, caps)
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        Box::pin(async move {
            self.closed = true;
            let closed = if self.connection.alive() {
                self.inner
                    .call(
                        &self.connection,
                        "session/close",
                        json!({"session": self.id}),
                    )
                    .await
                    .map(|_| ())
            } else {
                Ok(())
            };
            let dirs = self.owned.take().into_iter().collect();
            let removed = scratch::remove_dirs(dirs, self.inner.root.clone()).await;
            closed.and(removed)
        })
    }
}

impl Drop for PluginSession {
    fn drop(&mut self) {
        if self.closed || !self.connection.alive() {
            return;
        }
        // Dropped without close (a cancelled task): tell the plugin, without waiting.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let connection = self.connection.clone();
            let id = self.id.clone();
            let timeout = self.inner.config.session_timeout;
            handle.spawn(async move {
                let _ = connection
                    .call("session/close", json!({"session": id}), timeout)
                    .await;
            });
        }
    }
}
