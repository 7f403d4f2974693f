//! What this daemon holds of each task it runs: what cancels it, the lease epoch its writes
//! carry, whether one of its blocks runs now, and whether another daemon took it. One owner
//! and one lock, so the four never disagree: a task is held from its claim to its end, and
//! everything about it goes when it ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tandem_executor::CancellationToken;

/// The tasks running here; cloning shares them.
#[derive(Clone, Default)]
pub(crate) struct RunningTasks(Arc<Mutex<HashMap<String, Holding>>>);

/// One task running here.
struct Holding {
    /// Cancels it.
    token: CancellationToken,
    /// The lease's fencing number: every write of the task carries it.
    epoch: u64,
    /// Whether one of its blocks runs now.
    in_block: bool,
    /// Whether another daemon took its lease: it runs nothing more here.
    lost: bool,
}

impl RunningTasks {
    /// Holds task `id` under lease `epoch`, cancelled by `token`; a task claimed again
    /// replaces what was held of it.
    pub(crate) fn take(&self, id: &str, epoch: u64, token: CancellationToken) {
        self.with(|h| {
            h.insert(
                id.to_owned(),
                Holding {
                    token,
                    epoch,
                    in_block: false,
                    lost: false,
                },
            );
        });
    }

    /// Task `id` ended here.
    pub(crate) fn release(&self, id: &str) {
        self.with(|h| h.remove(id));
    }

    /// The lease epoch task `id`'s writes carry, while it is held.
    pub(crate) fn epoch(&self, id: &str) -> Option<u64> {
        self.with(|h| h.get(id).map(|t| t.epoch)).flatten()
    }

    /// Whether task `id` runs here.
    pub(crate) fn holds(&self, id: &str) -> bool {
        self.with(|h| h.contains_key(id)).unwrap_or(false)
    }

    /// The tasks held, by id.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.with(|h| h.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Each held task's lease, to renew: (task, epoch).
    pub(crate) fn leases(&self) -> Vec<(String, u64)> {
        self.with(|h| h.iter().map(|(id, t)| (id.clone(), t.epoch)).collect())
            .unwrap_or_default()
    }

    /// How many tasks run here.
    pub(crate) fn len(&self) -> usize {
        self.with(|h| h.len()).unwrap_or(0)
    }

    /// Cancels task `id` if it runs here; whether it did.
    pub(crate) fn cancel(&self, id: &str) -> bool {
        self.with(|h| h.get(id).map(|t| t.token.cancel()).is_some())
            .unwrap_or(false)
    }

    /// Marks the tasks of `ids` (each with the epoch its daemon lost) as taken by another
    /// daemon and stops them here: at once, or when the block running now ends (the daemon
    /// that took the task does not run that block again, so it must not be cut short).
    /// Either way no further block starts. A task claimed here again since, under a newer
    /// epoch, is left alone. Whether any was running here.
    pub(crate) fn lose(&self, ids: &[(String, u64)]) -> bool {
        self.with(|h| {
            let mut any = false;
            for (id, epoch) in ids {
                let Some(t) = h.get_mut(id).filter(|t| t.epoch == *epoch) else {
                    continue;
                };
                any = true;
                t.lost = true;
                if !t.in_block {
                    t.token.cancel();
                }
            }
            any
        })
        .unwrap_or(false)
    }

    /// Whether task `id` was taken by another daemon while it ran here.
    pub(crate) fn is_lost(&self, id: &str) -> bool {
        self.with(|h| h.get(id).is_some_and(|t| t.lost))
            .unwrap_or(false)
    }

    /// One of task `id`'s blocks starts.
    pub(crate) fn block_started(&self, id: &str) {
        self.with(|h| h.get_mut(id).map(|t| t.in_block = true));
    }

    /// Task `id`'s block ended; a task lost meanwhile stops now.
    pub(crate) fn block_ended(&self, id: &str) {
        self.with(|h| {
            if let Some(t) = h.get_mut(id) {
                t.in_block = false;
                if t.lost {
                    t.token.cancel();
                }
            }
        });
    }

    /// `f` on the map; `None` only when a panic elsewhere poisoned the lock, which this
    /// daemon then treats as holding nothing.
    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, Holding>) -> T) -> Option<T> {
        self.0.lock().ok().map(|mut h| f(&mut h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(ids: &[(&str, u64)]) -> (RunningTasks, Vec<CancellationToken>) {
        let held = RunningTasks::default();
        let tokens = ids
            .iter()
            .map(|(id, epoch)| {
                let token = CancellationToken::new();
                held.take(id, *epoch, token.clone());
                token
            })
            .collect();
        (held, tokens)
    }

    #[test]
    fn a_lost_task_stops_at_once_when_no_block_runs() {
        let (held, tokens) = held(&[("a", 1), ("b", 1)]);
        assert!(held.lose(&[("a".into(), 1)]));
        assert!(tokens[0].is_cancelled() && held.is_lost("a"));
        assert!(!tokens[1].is_cancelled() && !held.is_lost("b"));
    }

    #[test]
    fn a_lost_task_lets_its_running_block_end_then_stops() {
        let (held, tokens) = held(&[("a", 1)]);
        held.block_started("a");
        assert!(held.lose(&[("a".into(), 1)]));
        assert!(held.is_lost("a"));
        assert!(!tokens[0].is_cancelled(), "the block was cut short");
        held.block_ended("a");
        assert!(tokens[0].is_cancelled());
    }

    #[test]
    fn a_loss_of_an_older_lease_or_of_an_ended_task_changes_nothing() {
        let (held, tokens) = held(&[("a", 2)]);
        assert!(!held.lose(&[("a".into(), 1), ("gone".into(), 1)]));
        assert!(!tokens[0].is_cancelled() && !held.is_lost("a"));
        assert_eq!(held.epoch("a"), Some(2));
        held.release("a");
        assert_eq!(
            (held.epoch("a"), held.len(), held.holds("a")),
            (None, 0, false)
        );
    }

    #[test]
    fn a_task_claimed_again_starts_afresh() {
        let (held, _) = held(&[("a", 1)]);
        held.lose(&[("a".into(), 1)]);
        held.take("a", 3, CancellationToken::new());
        assert!(!held.is_lost("a"));
        assert_eq!(held.leases(), [("a".to_owned(), 3)]);
        assert!(held.cancel("a"));
        assert!(!held.cancel("b"));
    }
}
