//! Following one task's events: what the store holds after a point, then the live ones, in
//! order and without a gap, until the task's last event. The one follower behind the SSE API
//! and MCP's `run_task`; it reads the store off the async workers.

use std::collections::VecDeque;
use std::sync::Arc;

use tandem_executor::CancellationToken;
use tandem_protocol::{Event, EventMsg};
use tokio::sync::broadcast;

use crate::store::TaskState;
use crate::supervisor::Supervisor;

/// How long a follower waits on a quiet live feed before it reads the store itself.
const QUIET: std::time::Duration = std::time::Duration::from_secs(2);

/// The live feed of every task's events, as [`Supervisor::subscribe`] gives it.
pub type Live = broadcast::Receiver<Arc<(String, Event)>>;

/// One task's events, stored then live.
pub struct Follower {
    sup: Arc<Supervisor>,
    id: String,
    last: u64,
    /// `None`: only what is stored (or the end was seen).
    live: Option<Live>,
    pending: VecDeque<Event>,
    started: bool,
    stopping: CancellationToken,
    /// When the feed has been quiet for this task long enough to look at the store.
    quiet_at: tokio::time::Instant,
}

impl Follower {
    /// Task `id`'s events after seq `after`; then, with `live` (subscribed before the store
    /// is read, so nothing falls between the two), the live ones until the task ends or
    /// `stopping` fires, when what the store then holds is the rest.
    pub fn new(
        sup: Arc<Supervisor>,
        id: String,
        after: u64,
        live: Option<Live>,
        stopping: CancellationToken,
    ) -> Self {
        Self {
            sup,
            id,
            last: after,
            live,
            pending: VecDeque::new(),
            started: false,
            stopping,
            quiet_at: tokio::time::Instant::now() + QUIET,
        }
    }

    /// The next event; `None` after the task's last one, when the store cannot be read, or
    /// when the live feed closed.
    pub async fn next(&mut self) -> Option<Event> {
        if !self.started {
            self.started = true;
            self.catch_up().await?;
            let ended = self
                .pending
                .iter()
                .any(|e| matches!(e.msg, EventMsg::TaskFinished { .. }));
            if ended {
                self.live = None;
            } else if self.live.is_some() && self.is_finished().await {
                // It finished after the read above: its last events are stored by now (a
                // task is finished only with its last event), so they are read, not lost.
                self.catch_up().await?;
                self.live = None;
            }
        }
        loop {
            if let Some(e) = self.pending.pop_front() {
                if matches!(e.msg, EventMsg::TaskFinished { .. }) {
                    self.live = None;
                    self.pending.clear();
                }
                return Some(e);
            }
            let live = self.live.as_mut()?;
            let received = tokio::select! {
                r = live.recv() => r,
                () = self.stopping.cancelled() => {
                    // Every event is stored before the daemon closes: the rest is there.
                    self.live = None;
                    self.catch_up().await?;
                    continue;
                }
                // Another daemon's events arrive through the store's notices, which a lost
                // connection can miss: when this task's feed is quiet (other tasks' events do
                // not count), the store is looked at now and then.
                () = tokio::time::sleep_until(self.quiet_at) => {
                    self.quiet_at = tokio::time::Instant::now() + QUIET;
                    self.catch_up().await?;
                    if self.pending.is_empty() && self.is_finished().await {
                        self.catch_up().await?;
                        if self.pending.is_empty() {
                            self.live = None;
                        }
                    }
                    continue;
                }
            };
            match received {
                Ok(item) if item.0 == self.id && item.1.seq == self.last + 1 => {
                    self.quiet_at = tokio::time::Instant::now() + QUIET;
                    self.last = item.1.seq;
                    self.pending.push_back(item.1.clone());
                }
                Ok(item) if item.0 == self.id && item.1.seq > self.last + 1 => {
                    self.catch_up().await?;
                }
                Ok(_) => {}
                // Too slow to keep up with the live feed: the store has everything.
                Err(broadcast::error::RecvError::Lagged(_)) => self.catch_up().await?,
                Err(broadcast::error::RecvError::Closed) => self.live = None,
            }
        }
    }

    /// Queues the stored events after the last one seen. While the database cannot be
    /// reached it waits and reads again (the task's daemon keeps its events meanwhile), so a
    /// follower outlasts an outage; any other failure ends the feed.
    async fn catch_up(&mut self) -> Option<()> {
        let events = loop {
            let (id, after) = (self.id.clone(), self.last);
            match self
                .sup
                .off_thread(move |sup| sup.store().events_after(&id, after))
                .await
                .ok()?
            {
                Ok(events) => break events,
                Err(e) if e.unreachable() => {
                    tokio::select! {
                        () = self.stopping.cancelled() => return None,
                        () = tokio::time::sleep(QUIET) => {}
                    }
                }
                Err(_) => return None,
            }
        };
        if let Some(e) = events.last() {
            self.last = e.seq;
        }
        self.pending.extend(events);
        Some(())
    }

    async fn is_finished(&self) -> bool {
        let id = self.id.clone();
        self.sup
            .off_thread(move |sup| sup.store().get(&id))
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
            .is_some_and(|t| t.state == TaskState::Finished)
    }
}
