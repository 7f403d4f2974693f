//! How many sandboxes may be open at once, across every executor and per executor.
//!
//! A [`Registry`](tandem_executor::Registry) given a budget hands out only budgeted executors, so
//! every road that opens a session through it (a task, a team's executor agents, a
//! `parallel`, MCP `execute_code`, a plugin) waits for the same permits: a new road cannot
//! skip the cap by accident. A session holds its permits until it is closed or dropped.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, Language, Session,
    SessionSpec,
};

/// The operator's caps on open sessions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetConfig {
    /// Most sessions open at once, all executors together.
    pub total: usize,
    /// Most sessions of one executor open at once, by executor name; an executor not named
    /// here is bounded by `total` alone.
    pub per_executor: BTreeMap<String, usize>,
    /// Longest an open waits for a free permit before it fails with [`ExecError::Busy`].
    pub wait: Duration,
    /// Most sessions open at once that no task holds (labelled [`WITHOUT_TASK`]: HTTP
    /// sessions, `/v1/exec`, MCP `execute_code`), so that clients holding sandboxes, idle or
    /// not, leave the rest of `total` to tasks. `None` leaves them bounded by `total` alone.
    pub without_task: Option<usize>,
}

/// The label of a session no task holds; its value names the road that opened it.
pub const WITHOUT_TASK: &str = "tandem.without-task";

impl BudgetConfig {
    /// `total` sessions at once, no executor capped apart, waiting up to `wait`.
    pub fn new(total: usize, wait: Duration) -> Self {
        Self {
            total,
            per_executor: BTreeMap::new(),
            wait,
            without_task: None,
        }
    }
}

/// The shared permits behind a [`BudgetConfig`]; cloning shares them.
#[derive(Clone, Debug)]
pub struct Budget {
    total: Arc<Semaphore>,
    total_cap: usize,
    per_executor: BTreeMap<String, (Arc<Semaphore>, usize)>,
    without_task: Option<(Arc<Semaphore>, usize)>,
    wait: Duration,
}

impl Budget {
    /// Permits for `config` (a cap of 0 is taken as 1: a daemon that can open nothing is a
    /// configuration mistake, refused where the config is read).
    pub fn new(config: &BudgetConfig) -> Self {
        let semaphore = |n: usize| (Arc::new(Semaphore::new(n.max(1))), n.max(1));
        let (total, total_cap) = semaphore(config.total);
        Self {
            total,
            total_cap,
            per_executor: config
                .per_executor
                .iter()
                .map(|(name, n)| (name.clone(), semaphore(*n)))
                .collect(),
            without_task: config.without_task.map(semaphore),
            wait: config.wait,
        }
    }

    /// Sessions open now that no task holds.
    pub fn in_use_without_task(&self) -> usize {
        self.without_task
            .as_ref()
            .map_or(0, |(s, cap)| cap - s.available_permits())
    }

    /// Sessions open now, all executors together.
    pub fn in_use(&self) -> usize {
        self.total_cap - self.total.available_permits()
    }

    /// `executor` wrapped so that each of its sessions holds permits from this budget.
    pub fn wrap(&self, executor: Arc<dyn Executor>) -> Arc<dyn Executor> {
        let own = self.per_executor.get(executor.name()).cloned();
        Arc::new(Budgeted {
            inner: executor,
            total: (self.total.clone(), self.total_cap),
            own,
            without_task: self.without_task.clone(),
            wait: self.wait,
        })
    }
}

/// An executor whose sessions each hold a permit of the whole budget and, when the operator
/// capped it, one of its own.
struct Budgeted {
    inner: Arc<dyn Executor>,
    total: (Arc<Semaphore>, usize),
    own: Option<(Arc<Semaphore>, usize)>,
    without_task: Option<(Arc<Semaphore>, usize)>,
    wait: Duration,
}

impl tandem_executor::Wrap for Budget {
    fn wrap(&self, executor: Arc<dyn Executor>) -> Arc<dyn Executor> {
        Budget::wrap(self, executor)
    }
}

/// A [`Registry`](tandem_executor::Registry) whose executors open sessions within a budget.
pub trait RegistryBudget {
    /// Every executor, registered now or later, opens sessions only within `budget`. Applied
    /// once: a registry already under a budget keeps it.
    #[must_use]
    fn with_budget(self, budget: Budget) -> Self;
    /// The budget its sessions are opened within, if one was given.
    fn budget(&self) -> Option<&Budget>;
}

impl RegistryBudget for tandem_executor::Registry {
    fn with_budget(self, budget: Budget) -> Self {
        self.wrapped(Arc::new(budget))
    }

    fn budget(&self) -> Option<&Budget> {
        self.wrap::<Budget>()
    }
}

impl Budgeted {
    /// The share of sessions without a task first (for such a session), then the executor's
    /// own permit, then the shared one: every open takes them in this order, so two opens
    /// cannot each hold the permit the other waits for.
    async fn permits(&self, spec: &SessionSpec) -> Result<Permits, ExecError> {
        let share = self
            .without_task
            .as_ref()
            .filter(|_| spec.labels.iter().any(|(k, _)| k == WITHOUT_TASK));
        let acquire = async {
            let without_task = match share {
                Some((semaphore, _)) => Some(semaphore.clone().acquire_owned().await.ok()?),
                None => None,
            };
            let own = match &self.own {
                Some((semaphore, _)) => Some(semaphore.clone().acquire_owned().await.ok()?),
                None => None,
            };
            let total = self.total.0.clone().acquire_owned().await.ok()?;
            Some(Permits {
                _without_task: without_task,
                _own: own,
                _total: total,
            })
        };
        let busy = || {
            let (cap, which) = match (&self.own, share) {
                (_, Some((semaphore, cap))) if semaphore.available_permits() == 0 => {
                    (*cap, "[sessions] without_task".to_owned())
                }
                (Some((semaphore, cap)), _) if semaphore.available_permits() == 0 => {
                    (*cap, format!("[sessions.executors] {}", self.inner.name()))
                }
                _ => (self.total.1, "[sessions] max".to_owned()),
            };
            let open = self.total.1 - self.total.0.available_permits();
            let held = match &self.without_task {
                Some((semaphore, cap)) => {
                    let without = cap - semaphore.available_permits();
                    format!(
                        "{open} open: {} by tasks, {without} by clients' sessions without a task (sessions, /v1/exec, MCP execute_code)",
                        open.saturating_sub(without)
                    )
                }
                None => format!("{open} open"),
            };
            ExecError::Busy {
                executor: self.inner.name().to_owned(),
                cap,
                which,
                waited: self.wait,
                held,
            }
        };
        match tokio::time::timeout(self.wait, acquire).await {
            Ok(Some(permits)) => Ok(permits),
            // A closed semaphore is never made here; treat it as a full one.
            Ok(None) | Err(_) => Err(busy()),
        }
    }
}

/// What an open session holds; dropping it frees the permits.
struct Permits {
    _without_task: Option<OwnedSemaphorePermit>,
    _own: Option<OwnedSemaphorePermit>,
    _total: OwnedSemaphorePermit,
}

impl Executor for Budgeted {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn languages(&self) -> &[Language] {
        self.inner.languages()
    }

    /// The open itself runs to its end on a task of its own, whoever waits for it: an
    /// executor's open need not be cancel-safe (a caller that goes away between a sandbox's
    /// making and its session's owning it, such as a client hanging up, would leak the
    /// sandbox), and a session nobody is left to take is closed.
    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        Box::pin(async move {
            let permits = self.permits(&spec).await?;
            let inner = self.inner.clone();
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let opened = inner.open(spec).await.map(|session| {
                    Box::new(PermittedSession {
                        session,
                        _permits: permits,
                    }) as Box<dyn Session>
                });
                if let Err(Ok(session)) = tx.send(opened) {
                    // Nobody to tell how the close went; a failed one is the executor's to
                    // reap, as for any session dropped unclosed.
                    let _ = session.close().await;
                }
            });
            rx.await.map_err(|_| {
                ExecError::Backend(format!(
                    "opening a {} sandbox stopped before it ended (the daemon is stopping, or the executor panicked); try again",
                    self.inner.name()
                ))
            })?
        })
    }

    fn supports(&self, language: &Language) -> bool {
        self.inner.supports(language)
    }

    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        self.inner.health()
    }

    fn network(&self) -> bool {
        self.inner.network()
    }

    fn keeps_state(&self) -> bool {
        self.inner.keeps_state()
    }

    fn carries_tool_calls(&self) -> bool {
        self.inner.carries_tool_calls()
    }

    fn carries_egress(&self) -> bool {
        self.inner.carries_egress()
    }

    fn mounts_volumes(&self) -> bool {
        self.inner.mounts_volumes()
    }

    fn pools(&self) -> Vec<tandem_executor::PoolStatus> {
        self.inner.pools()
    }

    fn hosts(&self) -> Vec<tandem_executor::HostStatus> {
        self.inner.hosts()
    }
}

/// A session and the permits it holds until it is closed (or dropped, when its own drop
/// cleans up).
struct PermittedSession {
    session: Box<dyn Session>,
    _permits: Permits,
}

impl Session for PermittedSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        self.session.run(req, ctx)
    }

    fn workspace(&self) -> Option<&Path> {
        self.session.workspace()
    }

    fn pool_wait(&self) -> Option<std::time::Duration> {
        self.session.pool_wait()
    }

    // Forwarded, not left to the default: a session places files its own way (owned by its
    // blocks' user, or copied into a volume).
    fn put_archive(
        &mut self,
        archive: &Path,
        caps: crate::archive::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<crate::archive::ArchivedFile>, ExecError>> {
        self.session.put_archive(archive, caps)
    }

    fn ports(&self) -> Option<std::sync::Arc<dyn tandem_executor::Ports>> {
        self.session.ports()
    }

    fn save_state(
        &mut self,
        dest: &Path,
        max_bytes: u64,
        wait: std::time::Duration,
    ) -> BoxFuture<'_, Result<Option<tandem_executor::SavedState>, ExecError>> {
        self.session.save_state(dest, max_bytes, wait)
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        let PermittedSession {
            session,
            _permits: permits,
        } = *self;
        Box::pin(async move {
            // The permits go back only once the sandbox is gone.
            let closed = session.close().await;
            drop(permits);
            closed
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_executor::Registry;

    use super::RegistryBudget;

    /// An executor whose sessions hold nothing.
    struct Empty(&'static str);

    struct Nothing;

    impl Session for Nothing {
        fn run(
            &mut self,
            _: ExecRequest,
            _: ExecContext,
        ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
            Box::pin(async { Ok(ExecOutcome::refused("nothing runs here")) })
        }
        fn workspace(&self) -> Option<&Path> {
            None
        }
        fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
            Box::pin(async { Ok(()) })
        }
    }

    impl Executor for Empty {
        fn name(&self) -> &str {
            self.0
        }
        fn languages(&self) -> &[Language] {
            &[]
        }
        fn open(&self, _: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
            Box::pin(async { Ok(Box::new(Nothing) as Box<dyn Session>) })
        }
    }

    fn registry(total: usize, a: Option<usize>) -> Registry {
        let mut config = BudgetConfig::new(total, Duration::from_millis(100));
        if let Some(a) = a {
            config.per_executor.insert("a".to_owned(), a);
        }
        let mut registry = Registry::new();
        registry.register(Arc::new(Empty("a")));
        // One registered before the budget and one after are both under it.
        let mut registry = registry.with_budget(Budget::new(&config));
        registry.register(Arc::new(Empty("b")));
        registry
    }

    async fn open(registry: &Registry, name: &str) -> Result<Box<dyn Session>, ExecError> {
        registry.get(name)?.open(SessionSpec::default()).await
    }

    #[tokio::test]
    async fn sessions_past_the_total_wait_then_fail_naming_the_cap() {
        let registry = registry(2, None);
        let first = open(&registry, "a").await.unwrap();
        let _second = open(&registry, "b").await.unwrap();
        assert_eq!(registry.budget().map(Budget::in_use), Some(2));
        let busy = open(&registry, "a").await.err().unwrap().to_string();
        assert_eq!(
            busy,
            "no a sandbox was free within 100ms: 2 may be open at once ([sessions] max in the daemon's config), 2 open; try again when a task ends, or raise the cap"
        );
        // Closing one gives its place back; so does dropping one.
        first.close().await.unwrap();
        let third = open(&registry, "a").await.unwrap();
        drop(third);
        assert_eq!(registry.budget().map(Budget::in_use), Some(1));
        open(&registry, "b").await.unwrap();
    }

    #[tokio::test]
    async fn an_executors_own_cap_leaves_the_others_free() {
        let registry = registry(3, Some(1));
        let _a = open(&registry, "a").await.unwrap();
        let busy = open(&registry, "a").await.err().unwrap().to_string();
        assert!(
            busy.contains("1 may be open at once ([sessions.executors] a"),
            "{busy}"
        );
        let _b1 = open(&registry, "b").await.unwrap();
        let _b2 = open(&registry, "b").await.unwrap();
        assert_eq!(registry.budget().map(Budget::in_use), Some(3));
    }

    /// Sandboxes made and not yet removed, by an executor whose open is not cancel-safe:
    /// it makes the sandbox, then waits (as for an engine's answer) before a session owns it.
    struct Slow(Arc<std::sync::atomic::AtomicUsize>);

    struct Made(Arc<std::sync::atomic::AtomicUsize>);

    impl Session for Made {
        fn run(
            &mut self,
            _: ExecRequest,
            _: ExecContext,
        ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
            Box::pin(async { Ok(ExecOutcome::refused("nothing runs here")) })
        }
        fn workspace(&self) -> Option<&Path> {
            None
        }
        fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
            let made = self.0.clone();
            Box::pin(async move {
                made.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                Ok(())
            })
        }
    }

    impl Executor for Slow {
        fn name(&self) -> &str {
            "slow"
        }
        fn languages(&self) -> &[Language] {
            &[]
        }
        fn open(&self, _: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
            let made = self.0.clone();
            Box::pin(async move {
                made.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok(Box::new(Made(made)) as Box<dyn Session>)
            })
        }
    }

    #[tokio::test]
    async fn an_open_its_caller_drops_midway_is_closed_and_gives_its_place_back() {
        let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut registry = Registry::new()
            .with_budget(Budget::new(&BudgetConfig::new(1, Duration::from_secs(30))));
        registry.register(Arc::new(Slow(made.clone())));
        let dropped =
            tokio::time::timeout(Duration::from_millis(50), open(&registry, "slow")).await;
        assert!(dropped.is_err(), "the open should still be under way");
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 1);
        // The one permit comes back once the sandbox the dropped open made is closed.
        let next = open(&registry, "slow").await.unwrap();
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 1);
        next.close().await.unwrap();
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn sessions_without_a_task_take_their_share_and_leave_the_rest_to_tasks() {
        let mut config = BudgetConfig::new(3, Duration::from_millis(100));
        config.without_task = Some(2);
        let mut registry = Registry::new().with_budget(Budget::new(&config));
        registry.register(Arc::new(Empty("a")));
        let client = || SessionSpec {
            labels: vec![(WITHOUT_TASK.to_owned(), "session".to_owned())],
            ..SessionSpec::default()
        };
        let a = registry.get("a").unwrap();
        let _c1 = a.open(client()).await.unwrap();
        let _c2 = a.open(client()).await.unwrap();
        let refused = a.open(client()).await.err().unwrap().to_string();
        assert_eq!(
            refused,
            "no a sandbox was free within 100ms: 2 may be open at once ([sessions] without_task in the daemon's config), 2 open: 0 by tasks, 2 by clients' sessions without a task (sessions, /v1/exec, MCP execute_code); try again when a task ends, or raise the cap"
        );
        // A task's session still finds its place, and then the whole budget is full.
        let _task = a.open(SessionSpec::default()).await.unwrap();
        let busy = a
            .open(SessionSpec::default())
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(
            busy.contains("3 open: 1 by tasks, 2 by clients' sessions without a task"),
            "{busy}"
        );
        assert_eq!(registry.budget().map(Budget::in_use_without_task), Some(2));
    }

    #[tokio::test]
    async fn a_waiting_open_gets_the_place_a_close_frees() {
        let mut config = BudgetConfig::new(1, Duration::from_secs(30));
        config.per_executor.insert("a".to_owned(), 1);
        let mut registry = Registry::new().with_budget(Budget::new(&config));
        registry.register(Arc::new(Empty("a")));
        let held = open(&registry, "a").await.unwrap();
        let waiting = tokio::spawn({
            let registry = registry.clone();
            async move { open(&registry, "a").await.map(|_| ()) }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        held.close().await.unwrap();
        waiting.await.unwrap().unwrap();
    }
}
