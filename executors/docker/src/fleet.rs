//! Many engines behind one executor. Each session goes to the healthy host with the most free
//! capacity among those whose labels include the task's; a host that stops answering is
//! marked down, probed again with a growing backoff, and when it answers again what Tandem
//! left on it is removed and its image and warm pool are brought back. A host that lacks the
//! image gets it from one that has it (export, then import), since many sites have no
//! registry.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use futures::StreamExt;
use tandem_executor::{BoxFuture, ExecError, Executor, HostStatus, Language, Session, SessionSpec};

use crate::{DockerConfig, DockerError, DockerExecutor, WorkspaceMode};

/// One engine of a fleet, as the operator describes it.
#[derive(Clone, Debug)]
pub struct HostSpec {
    /// How to reach it and how its sessions are made (`name`, `host`, `tls`, `workspace`,
    /// and the image and limits every host shares).
    pub config: DockerConfig,
    /// Most sessions open on it at once, warm-pool containers not counted.
    pub capacity: usize,
    /// What it offers (`gpu=yes`); a task's placement labels must all be among them.
    pub labels: BTreeMap<String, String>,
}

/// Longest wait between probes of a host that is down.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A host's health.
struct Health {
    up: bool,
    reason: Option<String>,
    failures: u32,
    retry_at: Instant,
}

struct Host {
    spec: HostSpec,
    /// `None` until it first answered.
    executor: RwLock<Option<DockerExecutor>>,
    health: Mutex<Health>,
    /// Sessions placed here and not yet closed.
    sessions: AtomicUsize,
}

impl Host {
    fn executor(&self) -> Option<DockerExecutor> {
        self.executor.read().ok().and_then(|e| e.clone())
    }

    fn up(&self) -> bool {
        self.health.lock().is_ok_and(|h| h.up)
    }

    fn mark_down(&self, reason: &str) {
        if let Ok(mut h) = self.health.lock() {
            if h.up {
                tracing::warn!(host = %self.spec.config.label(), reason, "a Docker host stopped answering; new sessions go elsewhere");
            }
            h.up = false;
            h.failures = h.failures.saturating_add(1);
            h.reason = Some(reason.to_owned());
            let backoff = Duration::from_secs(1u64 << h.failures.min(5)).min(MAX_BACKOFF);
            h.retry_at = Instant::now() + backoff;
        }
    }

    fn mark_up(&self) {
        if let Ok(mut h) = self.health.lock() {
            if !h.up {
                tracing::info!(host = %self.spec.config.label(), "a Docker host answers");
            }
            *h = Health {
                up: true,
                reason: None,
                failures: 0,
                retry_at: Instant::now(),
            };
        }
    }

    /// Whether this host can take a session of `spec` now: up, not full, carrying every
    /// placement label, and able to keep an interpreter when one is asked for.
    fn fits(&self, spec: &SessionSpec) -> Result<(), String> {
        if !self.up() {
            let reason = self.health.lock().ok().and_then(|h| h.reason.clone());
            return Err(format!("down ({})", reason.unwrap_or_default()));
        }
        let open = self.sessions.load(Ordering::SeqCst);
        if open >= self.spec.capacity {
            return Err(format!("full ({open} of {})", self.spec.capacity));
        }
        for (k, v) in &spec.placement {
            if self.spec.labels.get(k) != Some(v) {
                return Err(format!("no label {k}={v}"));
            }
        }
        if spec.keep_state && self.spec.config.workspace != WorkspaceMode::Bind {
            return Err(
                "its workspaces are volumes, and a kept interpreter needs a bind-mounted one"
                    .to_owned(),
            );
        }
        Ok(())
    }

    fn free(&self) -> usize {
        self.spec
            .capacity
            .saturating_sub(self.sessions.load(Ordering::SeqCst))
    }
}

struct Inner {
    hosts: Vec<Host>,
    languages: Vec<Language>,
    network: bool,
    keeps_state: bool,
    image: String,
    /// Which host holds the session whose workspace is this directory: a second session
    /// opened on it (a kept interpreter, a tool called from code) must share that host.
    placed: Mutex<HashMap<PathBuf, usize>>,
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Docker sessions spread over several engines.
#[derive(Clone)]
pub struct DockerFleet {
    inner: Arc<Inner>,
}

impl DockerFleet {
    /// Connects to every host (one that does not answer starts down and is probed again),
    /// gets the image onto each that answers, and probes them every `probe` from then on.
    /// Fails only when no host answers, naming each and why.
    pub async fn connect(hosts: Vec<HostSpec>, probe: Duration) -> Result<Self, DockerError> {
        let connected = futures::future::join_all(
            hosts
                .iter()
                .map(|h| DockerExecutor::connect(h.config.clone())),
        )
        .await;
        let mut reasons = Vec::new();
        let mut built = Vec::new();
        for (spec, result) in hosts.into_iter().zip(connected) {
            let (executor, health) = match result {
                Ok(e) => (
                    Some(e),
                    Health {
                        up: true,
                        reason: None,
                        failures: 0,
                        retry_at: Instant::now(),
                    },
                ),
                Err(e) => {
                    tracing::warn!(host = %spec.config.label(), error = %e, "a Docker host did not answer at start");
                    reasons.push(e.to_string());
                    (
                        None,
                        Health {
                            up: false,
                            reason: Some(e.cause()),
                            failures: 1,
                            retry_at: Instant::now() + Duration::from_secs(2),
                        },
                    )
                }
            };
            built.push(Host {
                spec,
                executor: RwLock::new(executor),
                health: Mutex::new(health),
                sessions: AtomicUsize::new(0),
            });
        }
        let Some(first) = built.iter().find_map(Host::executor) else {
            return Err(DockerError::Unreachable {
                host: "any engine of [[executors.docker.hosts]]".to_owned(),
                reason: if reasons.is_empty() {
                    "none is configured".to_owned()
                } else {
                    reasons.join("; ")
                },
            });
        };
        let base = &first.inner().config;
        let fleet = Self {
            inner: Arc::new(Inner {
                languages: base.languages.clone(),
                network: base.network,
                keeps_state: built
                    .iter()
                    .any(|h| h.spec.config.workspace == WorkspaceMode::Bind),
                image: first.image().to_owned(),
                hosts: built,
                placed: Mutex::default(),
                stop: tokio_util::sync::CancellationToken::new(),
            }),
        };
        for i in 0..fleet.inner.hosts.len() {
            if fleet.inner.hosts[i].up() {
                prepare(&fleet.inner, i).await;
            }
        }
        let weak = Arc::downgrade(&fleet.inner);
        let stop = fleet.inner.stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(probe) => {}
                }
                if !probe_all(&weak).await {
                    return;
                }
            }
        });
        Ok(fleet)
    }

    /// Each host's health and load.
    pub fn statuses(&self) -> Vec<HostStatus> {
        self.inner
            .hosts
            .iter()
            .map(|h| HostStatus {
                name: h.spec.config.label().to_owned(),
                url: h.spec.config.host.clone(),
                up: h.up(),
                reason: h.health.lock().ok().and_then(|s| s.reason.clone()),
                sessions: h.sessions.load(Ordering::SeqCst),
                capacity: h.spec.capacity,
                labels: h.spec.labels.clone(),
                workspace: match h.spec.config.workspace {
                    WorkspaceMode::Bind => "bind",
                    WorkspaceMode::Volume => "volume",
                },
            })
            .collect()
    }

    /// The image every host runs.
    pub fn image(&self) -> &str {
        &self.inner.image
    }

    /// Probes every host once now (the loop does this every `probe`).
    pub async fn probe(&self) {
        probe_all(&Arc::downgrade(&self.inner)).await;
    }

    /// Stops probing and shuts every host's executor down ([`DockerExecutor::shutdown`]),
    /// all at once, so that each has its whole deadline.
    pub async fn shutdown(&self) {
        self.inner.stop.cancel();
        let executors: Vec<_> = self
            .inner
            .hosts
            .iter()
            .filter_map(|h| h.executor())
            .collect();
        futures::future::join_all(executors.iter().map(DockerExecutor::shutdown)).await;
    }

    /// Host indexes to try for `spec`, best first; or why none fits.
    fn candidates(&self, spec: &SessionSpec) -> Result<Vec<usize>, ExecError> {
        if let Some(dir) = &spec.workdir
            && let Some(&i) = self
                .inner
                .placed
                .lock()
                .ok()
                .and_then(|p| p.get(dir).copied())
                .as_ref()
        {
            // A second session on a live session's workspace: only its host has that volume.
            return Ok(vec![i]);
        }
        let mut why = Vec::new();
        let mut fit: Vec<usize> = Vec::new();
        for (i, h) in self.inner.hosts.iter().enumerate() {
            match h.fits(spec) {
                Ok(()) => fit.push(i),
                Err(reason) => why.push(format!("{}: {reason}", h.spec.config.label())),
            }
        }
        if fit.is_empty() {
            let placement = if spec.placement.is_empty() {
                String::new()
            } else {
                let wanted: Vec<String> = spec
                    .placement
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                format!(" with labels {}", wanted.join(", "))
            };
            return Err(ExecError::Unavailable {
                what: format!("a Docker host for this session{placement}"),
                hint: format!(
                    "{}; wait for a host to come back or a session to end, or add capacity in [[executors.docker.hosts]]",
                    why.join("; ")
                ),
            });
        }
        // Most free capacity first; the order of the configuration breaks ties.
        fit.sort_by_key(|&i| std::cmp::Reverse(self.inner.hosts[i].free()));
        Ok(fit)
    }
}

/// Probes every host of the fleet behind `weak`; false once the fleet is gone.
async fn probe_all(weak: &Weak<Inner>) -> bool {
    let Some(inner) = weak.upgrade() else {
        return false;
    };
    for i in 0..inner.hosts.len() {
        let host = &inner.hosts[i];
        let due = host
            .health
            .lock()
            .is_ok_and(|h| h.up || Instant::now() >= h.retry_at);
        if !due {
            continue;
        }
        let was_up = host.up();
        let answered = match host.executor() {
            Some(e) => e.answers().await,
            None => match DockerExecutor::connect(host.spec.config.clone()).await {
                Ok(e) => {
                    if let Ok(mut slot) = host.executor.write() {
                        *slot = Some(e);
                    }
                    Ok(())
                }
                Err(e) => Err(e.cause()),
            },
        };
        match answered {
            Ok(()) if !was_up => {
                host.mark_up();
                prepare(&inner, i).await;
            }
            Ok(()) => {}
            Err(reason) => host.mark_down(&reason),
        }
    }
    true
}

/// Gets host `i` ready for sessions: nothing left from before, the image (from another
/// host when it lacks it), and its warm pool filling.
async fn prepare(inner: &Inner, i: usize) {
    let host = &inner.hosts[i];
    let Some(executor) = host.executor() else {
        return;
    };
    match executor.reap_lost().await {
        Ok(0) => {}
        Ok(n) => {
            tracing::info!(host = %executor.label(), removed = n, "removed what lost sessions left on a host")
        }
        Err(e) => {
            tracing::warn!(host = %executor.label(), error = %e, "looking for what lost sessions left failed")
        }
    }
    match executor.image_present().await {
        Ok(true) => {}
        Ok(false) => {
            let source = inner
                .hosts
                .iter()
                .enumerate()
                .filter(|(j, h)| *j != i && h.up())
                .find_map(|(_, h)| h.executor());
            let copied = match source {
                Some(from) => executor.load_image_from(&from).await,
                None => Err(DockerError::ImageUnavailable {
                    image: executor.image().to_owned(),
                    reason: "no other host has it to copy".to_owned(),
                }),
            };
            if let Err(e) = copied {
                tracing::warn!(host = %executor.label(), error = %e, "the host lacks the image");
            }
        }
        Err(e) => {
            tracing::warn!(host = %executor.label(), error = %e, "asking a host for its image failed")
        }
    }
    executor.warm_up();
}

impl Executor for DockerFleet {
    fn name(&self) -> &str {
        "docker"
    }

    fn languages(&self) -> &[Language] {
        &self.inner.languages
    }

    fn keeps_state(&self) -> bool {
        self.inner.keeps_state
    }

    fn carries_tool_calls(&self) -> bool {
        true
    }

    fn carries_egress(&self) -> bool {
        // Every host can: bound in on this machine's engine, relayed on the others.
        true
    }

    fn mounts_volumes(&self) -> bool {
        // A volume with a quota is refused by a host it cannot reach, when the session opens.
        true
    }

    fn network(&self) -> bool {
        self.inner.network
    }

    fn hosts(&self) -> Vec<HostStatus> {
        self.statuses()
    }

    fn pools(&self) -> Vec<tandem_executor::PoolStatus> {
        self.inner
            .hosts
            .iter()
            .filter_map(|h| h.executor())
            .flat_map(|e| e.pools())
            .collect()
    }

    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let hosts = self.statuses();
            if hosts.iter().any(|h| h.up) {
                return Ok(());
            }
            let why: Vec<String> = hosts
                .iter()
                .map(|h| format!("{}: {}", h.name, h.reason.clone().unwrap_or_default()))
                .collect();
            Err(format!("no Docker host answers ({})", why.join("; ")))
        })
    }

    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        Box::pin(async move {
            let mut last = None;
            for i in self.candidates(&spec)? {
                let host = &self.inner.hosts[i];
                let Some(executor) = host.executor() else {
                    continue;
                };
                host.sessions.fetch_add(1, Ordering::SeqCst);
                match executor.open(spec.clone()).await {
                    Ok(session) => {
                        let workspace = session.workspace().map(Path::to_owned);
                        if let (Some(dir), Ok(mut placed)) = (&workspace, self.inner.placed.lock())
                        {
                            placed.entry(dir.clone()).or_insert(i);
                        }
                        return Ok(Box::new(Placed {
                            inner: Some(session),
                            fleet: self.inner.clone(),
                            host: i,
                            workspace,
                        }) as Box<dyn Session>);
                    }
                    Err(e) => {
                        host.sessions.fetch_sub(1, Ordering::SeqCst);
                        if let Err(reason) = executor.answers().await {
                            host.mark_down(&reason);
                        }
                        tracing::warn!(host = %executor.label(), error = %e, "opening a session failed; trying the next host");
                        last = Some(e);
                    }
                }
            }
            Err(last.unwrap_or_else(|| ExecError::Unavailable {
                what: "a Docker host for this session".to_owned(),
                hint: "no host has connected yet".to_owned(),
            }))
        })
    }
}

/// A session on one host of the fleet; it gives its place back when it ends.
struct Placed {
    inner: Option<Box<dyn Session>>,
    fleet: Arc<Inner>,
    host: usize,
    workspace: Option<PathBuf>,
}

impl Placed {
    fn release(&mut self) {
        if self.inner.is_none() {
            return;
        }
        self.fleet.hosts[self.host]
            .sessions
            .fetch_sub(1, Ordering::SeqCst);
        self.unplace();
    }

    /// Forgets that this session's workspace is on its host.
    fn unplace(&mut self) {
        if let (Some(dir), Ok(mut placed)) = (self.workspace.take(), self.fleet.placed.lock())
            && placed.get(&dir) == Some(&self.host)
        {
            placed.remove(&dir);
        }
    }
}

impl Session for Placed {
    fn run(
        &mut self,
        req: tandem_executor::ExecRequest,
        ctx: tandem_executor::ExecContext,
    ) -> BoxFuture<'_, Result<tandem_executor::ExecOutcome, ExecError>> {
        Box::pin(async move {
            let Some(session) = self.inner.as_mut() else {
                return Err(ExecError::Backend("the session is closed".to_owned()));
            };
            let ran = session.run(req, ctx).await;
            if let Err(ExecError::Lost { reason, .. }) = &ran {
                self.fleet.hosts[self.host].mark_down(reason);
                // The session that carries on is opened on this one's workspace, and must be
                // free to go to another host.
                self.unplace();
            }
            ran
        })
    }

    fn workspace(&self) -> Option<&Path> {
        self.inner.as_ref().and_then(|s| s.workspace())
    }

    fn host(&self) -> Option<&str> {
        Some(self.fleet.hosts[self.host].spec.config.label())
    }

    fn pool_wait(&self) -> Option<std::time::Duration> {
        self.inner.as_ref().and_then(|s| s.pool_wait())
    }

    fn put_archive(
        &mut self,
        archive: &Path,
        caps: tandem_executor_kit::archive::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<tandem_executor_kit::archive::ArchivedFile>, ExecError>> {
        match self.inner.as_mut() {
            Some(s) => s.put_archive(archive, caps),
            None => Box::pin(async { Err(ExecError::Backend("the session is closed".to_owned())) }),
        }
    }

    fn ports(&self) -> Option<std::sync::Arc<dyn tandem_executor::Ports>> {
        self.inner.as_ref().and_then(|s| s.ports())
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        Box::pin(async move {
            self.release();
            match self.inner.take() {
                Some(s) => s.close().await,
                None => Ok(()),
            }
        })
    }
}

impl Drop for Placed {
    fn drop(&mut self) {
        self.release();
    }
}

impl DockerExecutor {
    /// Copies this engine's image from `from`, which has it: exported there, imported here.
    pub async fn load_image_from(&self, from: &DockerExecutor) -> Result<(), DockerError> {
        let image = self.image().to_owned();
        tracing::info!(image = %image, from = %from.label(), to = %self.label(), "copying the sandbox image between hosts");
        let exported = from.inner().docker.export_image(&image);
        let mut loaded = self.inner().docker.import_image_stream(
            bollard::query_parameters::ImportImageOptionsBuilder::default()
                .quiet(true)
                .build(),
            exported,
            None,
        );
        while let Some(step) = loaded.next().await {
            let info = step.map_err(|e| DockerError::ImageUnavailable {
                image: image.clone(),
                reason: format!("copying it from {}: {e}", from.label()),
            })?;
            if let Some(message) = info.error_detail.and_then(|d| d.message) {
                return Err(DockerError::ImageUnavailable {
                    image,
                    reason: format!("copying it from {}: {message}", from.label()),
                });
            }
        }
        if self.image_present().await? {
            Ok(())
        } else {
            Err(DockerError::ImageUnavailable {
                image,
                reason: format!("the copy from {} ended without it", from.label()),
            })
        }
    }
}
