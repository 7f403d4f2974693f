//! The warm pool: containers started ahead of the sessions that will take them, as many as
//! demand asks for between `pool_size` and `pool_max`.
//!
//! A session that finds one ready takes it (a hit). One that finds none (a miss) raises the
//! pool's target and waits in line for the next container the pool starts: each container
//! goes to the session that has waited longest, so a burst larger than the pool is served in
//! the order it came, none refused and none starting a container of its own beside the
//! pool's (which, on a small machine, slows every start at once). After `pool_idle_secs`
//! without a miss, the target falls back to `pool_size`, and containers beyond it that sat
//! unused that long are removed.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tandem_executor::PoolStatus;
use tokio::sync::oneshot;

use crate::DockerExecutor;
use crate::session::{self, Warm};

/// Containers the pool starts at once: more only slows each start on a small machine.
const STARTS_AT_ONCE: usize = 4;

/// The most closed containers left for later at once; past it a removal runs at once.
const MOST_DEFERRED: usize = 64;

/// How long a closed container may wait for the sessions in line to be served.
const MOST_DEFERRED_FOR: Duration = Duration::from_secs(30);

/// A closed session's removal (its container, volume and workspace), put off.
type Removal = tandem_executor::BoxFuture<'static, Result<(), tandem_executor::ExecError>>;

/// A container ready in the pool, and since when.
struct Ready {
    warm: Warm,
    since: Instant,
}

/// What a waiting session is handed: a container, or why none came (it then starts its own).
type Handed = Result<Warm, String>;

/// The pool of one engine.
#[derive(Default)]
pub(crate) struct Pool {
    ready: Mutex<Vec<Ready>>,
    /// Sessions waiting for a container, the longest waiting first.
    waiting: Mutex<VecDeque<oneshot::Sender<Handed>>>,
    pub(crate) starting: AtomicUsize,
    /// How many containers the pool aims to hold ready or starting now.
    target: AtomicUsize,
    pub(crate) closed: AtomicBool,
    /// Fired at shutdown: the shrinking ends at once rather than at its next tick.
    pub(crate) stop: tokio_util::sync::CancellationToken,
    /// The containers being started, so that shutdown can wait for them to be removed.
    pub(crate) tasks: tokio_util::task::TaskTracker,
    /// When a session last found the pool empty.
    last_miss: Mutex<Option<Instant>>,
    shrinking: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
    waited_ms: AtomicU64,
    /// Removals of closed sessions put off while others waited, oldest first.
    deferred: Mutex<VecDeque<(Instant, Removal)>>,
    /// Whether a task is running the put-off removals.
    flushing: AtomicBool,
    /// Told when the line of waiting sessions empties: the put-off removals may run.
    served: tokio::sync::Notify,
}

impl Pool {
    /// Takes the pool's containers out (shutdown).
    pub(crate) fn drain(&self) -> Vec<Warm> {
        let ready = match self.ready.lock() {
            Ok(mut ready) => std::mem::take(&mut *ready),
            Err(_) => Vec::new(),
        };
        // Those waiting start containers of their own, or are refused as the executor closes.
        if let Ok(mut waiting) = self.waiting.lock() {
            for w in waiting.drain(..) {
                let _ = w.send(Err("the executor is shutting down".into()));
            }
        }
        ready.into_iter().map(|r| r.warm).collect()
    }

    /// Ids of the containers ready now.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.ready.lock().map_or_else(
            |_| Vec::new(),
            |r| r.iter().map(|w| w.warm.id().to_owned()).collect(),
        )
    }

    /// What it holds and has done, as `host`'s.
    pub(crate) fn status(&self, host: &str) -> PoolStatus {
        PoolStatus {
            host: host.to_owned(),
            ready: self.ready.lock().map_or(0, |r| r.len()),
            starting: self.starting.load(Ordering::SeqCst),
            waiting: self.waiting.lock().map_or(0, |w| w.len()),
            target: self.target.load(Ordering::SeqCst),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            waited_ms: self.waited_ms.load(Ordering::Relaxed),
            closing: self.deferred.lock().map_or(0, |d| d.len()),
        }
    }
}

impl DockerExecutor {
    fn pool(&self) -> &Pool {
        &self.inner().pool
    }

    /// A started container for a session the pool can serve, and how long it waited for it:
    /// one ready now, else the next one the pool starts. `None` when the pool is off, or no
    /// container came (the session then starts its own).
    pub(crate) async fn take_warm(&self) -> Option<(Warm, Duration)> {
        let c = &self.inner().config;
        if c.pool_size == 0 && c.pool_max == 0 {
            return None;
        }
        let pool = self.pool();
        let asked = Instant::now();
        let waiter = {
            let mut ready = pool.ready.lock().ok()?;
            while let Some(mut r) = ready.pop() {
                // One that died in the pool is dropped, which removes it.
                if r.warm.alive() {
                    drop(ready);
                    pool.hits.fetch_add(1, Ordering::Relaxed);
                    self.warm_up();
                    return Some((r.warm, Duration::ZERO));
                }
            }
            let (tx, rx) = oneshot::channel();
            pool.waiting.lock().ok()?.push_back(tx);
            rx
        };
        pool.misses.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut last) = pool.last_miss.lock() {
            *last = Some(Instant::now());
        }
        // Demand: one more than the pool holds, within pool_max.
        let most = c.pool_max.max(c.pool_size);
        let _ = pool
            .target
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some((t + 1).min(most))
            });
        self.warm_up();
        let handed = waiter.await;
        let waited = asked.elapsed();
        pool.waited_ms.fetch_add(
            u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        match handed {
            Ok(Ok(warm)) => Some((warm, waited)),
            Ok(Err(why)) => {
                tracing::debug!(%why, "no warm container came; starting one for the session");
                None
            }
            Err(_) => None,
        }
    }

    /// Starts containers until the pool holds its target, ready or starting, a few at a time;
    /// starts the shrinking of an idle pool on first use.
    pub fn warm_up(&self) {
        let c = &self.inner().config;
        let pool = self.pool();
        if (c.pool_size == 0 && c.pool_max == 0) || pool.closed.load(Ordering::SeqCst) {
            return;
        }
        let _ = pool
            .target
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                (t < c.pool_size).then_some(c.pool_size)
            });
        if !pool.shrinking.swap(true, Ordering::SeqCst) {
            let executor = self.clone();
            pool.tasks
                .spawn(async move { executor.shrink_when_idle().await });
        }
        let want = {
            let Ok(ready) = pool.ready.lock() else { return };
            let waiting = pool.waiting.lock().map_or(0, |w| w.len());
            let starting = pool.starting.load(Ordering::SeqCst);
            let target = pool.target.load(Ordering::SeqCst).max(waiting);
            let short = target.saturating_sub(ready.len() + starting);
            let room = STARTS_AT_ONCE.saturating_sub(starting);
            let want = short.min(room);
            pool.starting.fetch_add(want, Ordering::SeqCst);
            want
        };
        for _ in 0..want {
            let executor = self.clone();
            pool.tasks.spawn(async move {
                let started = session::DockerSession::prestart(&executor).await;
                let pool = executor.pool();
                pool.starting.fetch_sub(1, Ordering::SeqCst);
                match started {
                    Ok(warm) if !pool.closed.load(Ordering::SeqCst) => executor.hand(warm),
                    Ok(warm) => warm.remove().await,
                    // Refused, or cut off by the sweep: nothing is wrong.
                    Err(_) if pool.closed.load(Ordering::SeqCst) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "starting a container for the warm pool failed");
                        // Those waiting start their own, each hearing the engine's own error.
                        executor.fail_waiting(&e.to_string());
                        return;
                    }
                }
                executor.warm_up();
            });
        }
    }

    /// Gives a started container to the session that waited longest, else keeps it ready.
    fn hand(&self, mut warm: Warm) {
        let pool = self.pool();
        loop {
            let Some((waiter, last)) = pool.waiting.lock().ok().and_then(|mut w| {
                let next = w.pop_front()?;
                Some((next, w.is_empty()))
            }) else {
                pool.served.notify_one();
                break;
            };
            match waiter.send(Ok(warm)) {
                Ok(()) => {
                    if last {
                        pool.served.notify_one();
                    }
                    return;
                }
                // Its open was cancelled: the next in line.
                Err(Ok(back)) => warm = back,
                Err(Err(_)) => return,
            }
        }
        // Containers started for sessions that stopped waiting are kept only up to the
        // pool's bound; the rest are removed now rather than when the pool next shrinks.
        let c = &self.inner().config;
        let most = c.pool_max.max(c.pool_size);
        let Ok(mut ready) = pool.ready.lock() else {
            return;
        };
        if ready.len() < most {
            ready.push(Ready {
                warm,
                since: Instant::now(),
            });
        } else {
            drop(ready);
            pool.tasks.spawn(warm.remove());
        }
    }

    /// Runs a closed session's `removal` now, or, while other sessions wait in line for the
    /// pool, once none wait (or after [`MOST_DEFERRED_FOR`]): on a small machine a removal
    /// slows every start beside it. Only for a session whose processes were all killed: a
    /// container left for later runs nothing of its user's. Its errors are the caller's when
    /// it runs now, logged when later.
    pub(crate) async fn remove_when_served(
        &self,
        removal: Removal,
    ) -> Result<(), tandem_executor::ExecError> {
        let pool = self.pool();
        let removal = {
            let waiting = pool.waiting.lock().map_or(0, |w| w.len());
            match pool.deferred.lock() {
                Ok(mut deferred)
                    if waiting > 0
                        && deferred.len() < MOST_DEFERRED
                        && !pool.closed.load(Ordering::SeqCst) =>
                {
                    deferred.push_back((Instant::now(), removal));
                    None
                }
                _ => Some(removal),
            }
        };
        match removal {
            Some(removal) => removal.await,
            None => {
                if !pool.flushing.swap(true, Ordering::SeqCst) {
                    let executor = self.clone();
                    pool.tasks
                        .spawn(async move { executor.remove_deferred().await });
                }
                Ok(())
            }
        }
    }

    /// Runs the put-off removals once no session waits for the pool, the executor closes,
    /// or they have waited [`MOST_DEFERRED_FOR`]; ends when none are left.
    async fn remove_deferred(&self) {
        let pool = self.pool();
        loop {
            let due: Vec<Removal> = {
                let quiet = pool.closed.load(Ordering::SeqCst)
                    || pool.waiting.lock().map_or(true, |w| w.is_empty());
                let Ok(mut deferred) = pool.deferred.lock() else {
                    pool.flushing.store(false, Ordering::SeqCst);
                    return;
                };
                if deferred.is_empty() {
                    pool.flushing.store(false, Ordering::SeqCst);
                    return;
                }
                let mut due = Vec::new();
                while let Some((since, _)) = deferred.front() {
                    if !quiet && since.elapsed() < MOST_DEFERRED_FOR {
                        break;
                    }
                    if let Some((_, removal)) = deferred.pop_front() {
                        due.push(removal);
                    }
                }
                due
            };
            if due.is_empty() {
                // The oldest is due at its deadline, or all are once the line empties.
                let oldest = pool
                    .deferred
                    .lock()
                    .ok()
                    .and_then(|d| d.front().map(|(since, _)| *since))
                    .unwrap_or_else(Instant::now);
                tokio::select! {
                    () = tokio::time::sleep_until((oldest + MOST_DEFERRED_FOR).into()) => {}
                    () = pool.served.notified() => {}
                    () = pool.stop.cancelled() => {}
                }
                continue;
            }
            use futures::StreamExt as _;
            futures::stream::iter(due)
                .for_each_concurrent(STARTS_AT_ONCE, |removal| async move {
                    if let Err(e) = removal.await {
                        tracing::warn!(error = %e, "removing a closed session's sandbox failed");
                    }
                })
                .await;
        }
    }

    fn fail_waiting(&self, why: &str) {
        if let Ok(mut waiting) = self.pool().waiting.lock() {
            for w in waiting.drain(..) {
                let _ = w.send(Err(why.to_owned()));
            }
        }
        self.pool().served.notify_one();
    }

    /// Every so often, once no session has missed for `pool_idle_secs`: the target back to
    /// `pool_size`, and the containers beyond it that sat unused that long removed.
    async fn shrink_when_idle(&self) {
        let c = &self.inner().config;
        let idle = Duration::from_secs(c.pool_idle_secs.max(1));
        let every = (idle / 4).clamp(Duration::from_millis(250), Duration::from_secs(15));
        let pool = self.pool();
        while !pool.closed.load(Ordering::SeqCst) {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = pool.stop.cancelled() => return,
            }
            let quiet = pool
                .last_miss
                .lock()
                .map_or(true, |l| l.is_none_or(|t| t.elapsed() >= idle));
            if !quiet {
                continue;
            }
            pool.target.store(c.pool_size, Ordering::SeqCst);
            let stale: Vec<Warm> = match pool.ready.lock() {
                Ok(mut ready) => {
                    let mut out = Vec::new();
                    // The oldest go first; pool_size of them stay however long they sat.
                    ready.sort_by_key(|r| std::cmp::Reverse(r.since));
                    while ready.len() > c.pool_size
                        && ready.last().is_some_and(|r| r.since.elapsed() >= idle)
                    {
                        if let Some(r) = ready.pop() {
                            out.push(r.warm);
                        }
                    }
                    out
                }
                Err(_) => Vec::new(),
            };
            for warm in stale {
                warm.remove().await;
            }
        }
    }
}
