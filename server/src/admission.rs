//! Admission: whether a task may be queued (it checks, and its executor can run now), and
//! the execution slots that bound how much runs at once, handed out in FIFO order to tasks
//! and to MCP's `execute_code` calls alike.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_executor::CancellationToken;
use tandem_protocol::TaskSpec;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Conflict, TaskError, Unavailable};
use crate::plan::Planner;

/// An executor's health: `Err` says what is wrong and how to fix it.
type Health = Result<(), String>;

/// How long an executor's health answer is reused by submits.
const HEALTH_TTL: Duration = Duration::from_secs(2);

/// Who gets in, and when.
pub(crate) struct Admission {
    slots: Arc<Semaphore>,
    max_concurrent: usize,
    /// Longest an execution that is not a task waits for a slot.
    wait: Duration,
    /// Each executor's last health answer and when it came.
    health: Mutex<HashMap<String, (Instant, Health)>>,
}

impl Admission {
    /// `max_concurrent` slots; a call waits for one at most `wait`.
    pub(crate) fn new(max_concurrent: usize, wait: Duration) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_concurrent.max(1))),
            max_concurrent,
            wait,
            health: Mutex::new(HashMap::new()),
        }
    }

    /// The slots, for the approvals that give a waiting task's back.
    pub(crate) fn slots(&self) -> Arc<Semaphore> {
        self.slots.clone()
    }

    /// Whether `spec` may be queued: it checks, and its executor can run now (a task for a
    /// sandbox that cannot run, an image that is not there, would spend a model turn before
    /// failing; it is refused now, with the fix).
    pub(crate) async fn admit(&self, planner: &Planner, spec: &TaskSpec) -> Result<(), TaskError> {
        planner.check(spec)?;
        let name = planner.executor_name(spec);
        if let Err(problem) = self.health(planner, name).await {
            return Err(Unavailable::Executor {
                name: name.to_owned(),
                problem,
            }
            .into());
        }
        Ok(())
    }

    /// A task's slot, when its turn comes (the semaphore is fair: tasks start in the order
    /// they were queued); `None` when `cancel` fires first or the daemon closed the slots.
    pub(crate) async fn task_slot(
        &self,
        cancel: &CancellationToken,
    ) -> Option<OwnedSemaphorePermit> {
        tokio::select! {
            permit = self.slots.clone().acquire_owned() => permit.ok(),
            () = cancel.cancelled() => None,
        }
    }

    /// A slot for an execution that is not a task (an MCP `execute_code` call): it waits
    /// behind queued tasks like one, until `cancel` fires or the wait runs out.
    pub(crate) async fn execution_slot(
        &self,
        cancel: &CancellationToken,
    ) -> Result<OwnedSemaphorePermit, TaskError> {
        let busy = || Unavailable::NoSlot {
            wait_secs: self.wait.as_secs(),
            max: self.max_concurrent,
        };
        tokio::select! {
            permit = tokio::time::timeout(self.wait, self.slots.clone().acquire_owned()) => {
                permit.map_err(|_| busy())?.map_err(|_| TaskError::ShuttingDown)
            }
            () = cancel.cancelled() => Err(Conflict::CallCancelled.into()),
        }
    }

    /// An executor's health, checked at most every [`HEALTH_TTL`] (a submit must not wait
    /// on the engine each time).
    async fn health(&self, planner: &Planner, name: &str) -> Health {
        let cached = self.health.lock().ok().and_then(|h| {
            h.get(name)
                .filter(|(at, _)| at.elapsed() < HEALTH_TTL)
                .map(|(_, health)| health.clone())
        });
        if let Some(health) = cached {
            return health;
        }
        let Ok(executor) = planner.config().executors.get(name) else {
            return Ok(());
        };
        let health = executor.health().await;
        if let Ok(mut h) = self.health.lock() {
            h.insert(name.to_owned(), (Instant::now(), health.clone()));
        }
        health
    }
}
