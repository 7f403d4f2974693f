//! Approvals on the daemon: a block that waits for a person parks its task in
//! `awaiting_approval` (its execution slot freed) until `POST /v1/tasks/{id}/approvals/{n}`,
//! the timeout or a cancel decides it. Every request and decision is an event in the store,
//! so a decision survives a restart: a task resumed at that block finds it there.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tandem_agent::{Approver, Ask, Ruling};
use tandem_executor::CancellationToken;
use tandem_protocol::{Decision, Event, EventMsg};
use tokio::sync::{OwnedSemaphorePermit, oneshot};

use crate::error::{Conflict, Invalid, MissingApproval, TaskError, Unavailable};
use crate::store::{TaskState, TaskStore};
use crate::writer::Writes;

pub use tandem_protocol::task::{ApprovalRequest, DecisionBody};

/// A block that asked, as the stored events tell it, and its decision once made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requested {
    /// What it asked, as clients see it.
    pub asked: ApprovalRequest,
    /// The decision, once made.
    pub ruling: Option<Ruling>,
}

impl std::ops::Deref for Requested {
    type Target = ApprovalRequest;

    fn deref(&self) -> &ApprovalRequest {
        &self.asked
    }
}

/// Every approval a task asked for, with its decision when one was stored.
pub fn requested(events: &[Event]) -> Vec<Requested> {
    let mut asked: Vec<Requested> = Vec::new();
    for e in events {
        match &e.msg {
            EventMsg::ApprovalRequested {
                turn,
                index,
                n,
                language,
                code,
                rule,
                reason,
            } => asked.push(Requested {
                asked: ApprovalRequest {
                    n: *n,
                    turn: *turn,
                    index: *index,
                    language: language.clone(),
                    code: code.clone(),
                    rule: rule.clone(),
                    reason: reason.clone(),
                },
                ruling: None,
            }),
            EventMsg::ApprovalDecided {
                n,
                decision,
                by,
                code,
                reason,
                ..
            } if *n > 0 => {
                if let Some(r) = asked.iter_mut().find(|r| r.n == *n) {
                    r.ruling = Some(Ruling {
                        decision: *decision,
                        code: code.clone(),
                        reason: reason.clone(),
                        by: by.clone(),
                    });
                }
            }
            _ => {}
        }
    }
    asked
}

/// The live side of approvals: who waits for which decision, and deciding them. It owns its
/// state; the store, the writer and the tasks' execution slots are handed to it.
pub(crate) struct Approvals {
    slots: Mutex<HashMap<(String, u32), Slot>>,
    store: Arc<dyn TaskStore>,
    writer: Writes,
    /// Live subscribers: a decision is stored here, not through the writer, and sent to them.
    live: tokio::sync::broadcast::Sender<Arc<(String, Event)>>,
    /// The daemon's execution slots, which a waiting task gives back.
    execution: Arc<tokio::sync::Semaphore>,
}

enum Slot {
    /// A running task waits.
    Waiting(oneshot::Sender<Ruling>),
    /// Decided while its task was not waiting for it (before a resume reached the block).
    Decided(Ruling),
}

impl Approvals {
    /// Approvals over `store`, writing through `writer`; a task that waits gives its slot of
    /// `execution` back.
    pub(crate) fn new(
        store: Arc<dyn TaskStore>,
        writer: Writes,
        live: tokio::sync::broadcast::Sender<Arc<(String, Event)>>,
        execution: Arc<tokio::sync::Semaphore>,
    ) -> Self {
        Self {
            slots: Mutex::default(),
            store,
            writer,
            live,
            execution,
        }
    }

    /// Stores decision `ruling` of approval `n` of task `id` unless one is stored already
    /// (decided on another daemon, or by the timeout); whether this one was.
    fn store_decision(
        &self,
        id: &str,
        n: u32,
        at: (u32, u32),
        ruling: &Ruling,
    ) -> Result<bool, TaskError> {
        let msg = ruling.decided(at.0, at.1, n);
        match self.store.decide(id, n, &msg, crate::writer::now_ms())? {
            Some(event) => {
                let _ = self.live.send(Arc::new((id.to_owned(), event)));
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// A decision another daemon stored for a task of this one's: handed to it if it waits.
    pub(crate) fn heard(&self, id: &str, event: &Event) {
        let EventMsg::ApprovalDecided {
            n,
            decision,
            by,
            code,
            reason,
            ..
        } = &event.msg
        else {
            return;
        };
        let ruling = Ruling {
            decision: *decision,
            code: code.clone(),
            reason: reason.clone(),
            by: by.clone(),
        };
        if let Ok(mut slots) = self.slots.lock() {
            let key = (id.to_owned(), *n);
            if let Some(Slot::Waiting(tx)) = slots.remove(&key) {
                let _ = tx.send(ruling.clone());
            }
            slots.insert(key, Slot::Decided(ruling));
        }
    }

    /// The tasks that wait for a decision now.
    pub(crate) fn waiting(&self) -> Vec<String> {
        self.slots.lock().map_or_else(
            |_| Vec::new(),
            |slots| {
                slots
                    .iter()
                    .filter(|(_, slot)| matches!(slot, Slot::Waiting(_)))
                    .map(|((id, _), _)| id.clone())
                    .collect()
            },
        )
    }

    /// The stored decision of approval `n` of task `id`, if one is stored.
    fn stored_ruling(&self, id: &str, n: u32) -> Option<Ruling> {
        let events = self.store.events_after(id, 0).ok()?;
        requested(&events)
            .into_iter()
            .find(|r| r.n == n)
            .and_then(|r| r.ruling)
    }

    /// Forgets task `id`'s approvals once it has stopped.
    pub(crate) fn forget(&self, id: &str) {
        if let Ok(mut slots) = self.slots.lock() {
            slots.retain(|(task, _), _| task != id);
        }
    }
}

impl Approvals {
    /// Whether `body` can decide an approval of task `id`: the task exists and has not
    /// finished, and the body says one thing.
    fn decidable(&self, id: &str, body: &DecisionBody) -> Result<(), TaskError> {
        let record = self
            .store
            .get(id)?
            .ok_or_else(|| TaskError::NotFound(id.to_owned()))?;
        if record.state == TaskState::Finished {
            return Err(Conflict::NothingToApprove(id.to_owned()).into());
        }
        if body.decision == Decision::Deny && body.code.is_some() {
            return Err(Invalid::Decision(
                "`code` goes with `approve` (run this instead); a denial takes only a `reason`",
            )
            .into());
        }
        if body.code.as_deref().is_some_and(|c| c.trim().is_empty()) {
            return Err(Invalid::Decision(
                "`code` is empty; leave it out to run the block as it is, or deny it",
            )
            .into());
        }
        Ok(())
    }

    /// Decides approval `n` of task `id`: the decision is stored before this returns, then
    /// handed to the task if it is waiting.
    pub(crate) fn decide(
        &self,
        id: &str,
        n: u32,
        body: DecisionBody,
    ) -> Result<ApprovalRequest, TaskError> {
        self.decidable(id, &body)?;
        self.writer.flush();
        let asked = requested(&self.store.events_after(id, 0)?);
        let Some(request) = asked.iter().find(|r| r.n == n).cloned() else {
            let waiting = asked
                .iter()
                .filter(|r| r.ruling.is_none())
                .map(|r| r.n)
                .collect();
            return Err(MissingApproval {
                id: id.to_owned(),
                n,
                waiting,
            }
            .into());
        };
        let already = |r: &Ruling| {
            TaskError::from(Conflict::Decided {
                id: id.to_owned(),
                n,
                decision: r.decision.as_str(),
                by: r.by.clone(),
            })
        };
        if let Some(r) = &request.ruling {
            return Err(already(r));
        }
        let ruling = Ruling {
            decision: body.decision,
            code: body.code,
            reason: body.reason.filter(|r| !r.trim().is_empty()),
            by: "user".to_owned(),
        };
        // Taken and told to the writer under the lock, so the timeout and a second decision
        // see it taken, and it is stored before any event of the block it lets run.
        let waiting = {
            let mut slots = self
                .slots
                .lock()
                .map_err(|_| Unavailable::Poisoned("approvals"))?;
            let key = (id.to_owned(), n);
            let waiting = match slots.remove(&key) {
                Some(Slot::Decided(r)) => {
                    let e = already(&r);
                    slots.insert(key, Slot::Decided(r));
                    return Err(e);
                }
                Some(Slot::Waiting(tx)) => Some(tx),
                None => None,
            };
            // Stored before the answer, and before a waiting task acts on it; only if no
            // other decision (another daemon's, the timeout's) was stored first. A task that
            // is not waiting finds it in `slots`, in the store after a restart, or hears of
            // it from the store when it runs on another daemon.
            match self.store_decision(id, n, (request.turn, request.index), &ruling) {
                Ok(true) => {}
                Ok(false) => {
                    if let Some(tx) = waiting {
                        slots.insert(key, Slot::Waiting(tx));
                    }
                    let stored = requested(&self.store.events_after(id, 0)?);
                    return Err(
                        match stored
                            .iter()
                            .find(|r| r.n == n)
                            .and_then(|r| r.ruling.as_ref())
                        {
                            Some(r) => already(r),
                            None => Conflict::NothingToApprove(id.to_owned()).into(),
                        },
                    );
                }
                Err(e) => {
                    if let Some(tx) = waiting {
                        slots.insert(key, Slot::Waiting(tx));
                    }
                    return Err(e);
                }
            }
            slots.insert(key, Slot::Decided(ruling.clone()));
            waiting
        };
        if let Some(tx) = waiting {
            // An error means the task stopped waiting (cancelled) meanwhile.
            let _ = tx.send(ruling);
        }
        Ok(request.asked)
    }
}

/// One task's approver: asks through the store and the API, and gives up the task's
/// execution slot while it waits.
pub(crate) struct TaskApprover {
    pub(crate) approvals: Arc<Approvals>,
    pub(crate) id: String,
    /// The task's execution slot; `None` while it waits for a decision.
    pub(crate) permit: Arc<tokio::sync::Mutex<Option<OwnedSemaphorePermit>>>,
    /// What the store held when the task (re)started.
    pub(crate) stored: Vec<Requested>,
    pub(crate) next: AtomicU32,
}

impl TaskApprover {
    pub(crate) fn new(
        approvals: Arc<Approvals>,
        id: &str,
        permit: Arc<tokio::sync::Mutex<Option<OwnedSemaphorePermit>>>,
        events: &[Event],
    ) -> Self {
        let stored = requested(events);
        let next = stored.iter().map(|r| r.n).max().unwrap_or(0) + 1;
        Self {
            approvals,
            id: id.to_owned(),
            permit,
            stored,
            next: AtomicU32::new(next),
        }
    }

    /// The request `ask` is: the same block asked before a restart keeps its number, and
    /// its decision if made (`Err`); a new one is numbered and stored.
    fn request_for(&self, ask: &Ask) -> Result<Requested, Ruling> {
        let before = self
            .stored
            .iter()
            .find(|r| r.turn == ask.turn && r.index == ask.index && r.code == ask.code);
        if let Some(r) = before {
            return match &r.ruling {
                Some(ruling) => Err(ruling.clone()),
                None => Ok(r.clone()),
            };
        }
        let request = Requested {
            asked: ApprovalRequest {
                n: self.next.fetch_add(1, Ordering::SeqCst),
                turn: ask.turn,
                index: ask.index,
                language: ask.language.to_string(),
                code: ask.code.clone(),
                rule: ask.rule.clone(),
                reason: ask.reason.clone(),
            },
            ruling: None,
        };
        self.approvals
            .writer
            .record(&self.id, ask.requested(request.n));
        Ok(request)
    }

    async fn wait(
        &self,
        ask: Ask,
        timeout: Duration,
        cancel: &CancellationToken,
    ) -> Option<Ruling> {
        let request = match self.request_for(&ask) {
            Ok(request) => request,
            Err(ruling) => return Some(ruling),
        };
        let key = (self.id.clone(), request.n);
        let (tx, mut rx) = oneshot::channel();
        {
            let mut slots = self.approvals.slots.lock().ok()?;
            if let Some(Slot::Decided(ruling)) = slots.get(&key) {
                return Some(ruling.clone());
            }
            slots.insert(key.clone(), Slot::Waiting(tx));
        }
        // Decided on another daemon before this one waited for it (it resumed meanwhile).
        let (approvals, id, n) = (self.approvals.clone(), self.id.clone(), request.n);
        let stored = tokio::task::spawn_blocking(move || {
            approvals.writer.flush();
            approvals.stored_ruling(&id, n)
        })
        .await
        .ok()
        .flatten();
        if let Some(ruling) = stored {
            if let Ok(mut slots) = self.approvals.slots.lock() {
                slots.insert(key, Slot::Decided(ruling.clone()));
            }
            return Some(ruling);
        }
        self.approvals
            .writer
            .set_state(&self.id, TaskState::AwaitingApproval);
        self.permit.lock().await.take();
        let ruling = tokio::select! {
            r = &mut rx => r.ok(),
            () = tokio::time::sleep(timeout) => {
                let timed_out = self.approvals.slots.lock().ok().and_then(|mut slots| {
                    match slots.remove(&key) {
                        Some(Slot::Waiting(tx)) => {
                            let ruling = Ruling::timed_out(timeout);
                            let at = (request.turn, request.index);
                            let ruling = match self.approvals.store_decision(&self.id, request.n, at, &ruling) {
                                Ok(true) => ruling,
                                // Decided elsewhere first (or the store is down): the stored
                                // decision, when there is one, is the one that holds.
                                _ => match self.approvals.stored_ruling(&self.id, request.n) {
                                    Some(stored) => stored,
                                    None => {
                                        slots.insert(key.clone(), Slot::Waiting(tx));
                                        return None;
                                    }
                                },
                            };
                            slots.insert(key.clone(), Slot::Decided(ruling.clone()));
                            Some(ruling)
                        }
                        other => {
                            if let Some(slot) = other {
                                slots.insert(key.clone(), slot);
                            }
                            None
                        }
                    }
                });
                match timed_out {
                    Some(ruling) => Some(ruling),
                    // A person's decision won the race and is on its way, or the timeout's
                    // could not be stored (the database away): the wait goes on, and a
                    // cancel still ends it.
                    None => tokio::select! {
                        r = &mut rx => r.ok(),
                        () = cancel.cancelled() => None,
                    },
                }
            }
            () = cancel.cancelled() => None,
        };
        if ruling.is_none()
            && let Ok(mut slots) = self.approvals.slots.lock()
            && matches!(slots.get(&key), Some(Slot::Waiting(_)))
        {
            slots.remove(&key);
        }
        let ruling = ruling?;
        // Back in line for a slot, behind the tasks queued meanwhile.
        let permit = tokio::select! {
            p = self.approvals.execution.clone().acquire_owned() => p.ok()?,
            () = cancel.cancelled() => return None,
        };
        *self.permit.lock().await = Some(permit);
        self.approvals
            .writer
            .set_state(&self.id, TaskState::Running);
        Some(ruling)
    }
}

impl Approver for TaskApprover {
    fn decide<'a>(
        &'a self,
        ask: Ask,
        timeout: Duration,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Option<Ruling>> {
        Box::pin(self.wait(ask, timeout, cancel))
    }
}
