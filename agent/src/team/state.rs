//! What one run of a team keeps beside its history and its spending, shared by its parallel
//! branches: the drawing of replies to choose among, and the final answer.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Judging replies against the task's examples: whether the one drawing a task has was
/// taken, and what the examples printed against the code of the last reply told.
#[derive(Default)]
pub(super) struct Drawing {
    /// Replies were drawn to choose among: a task draws once, at its first reply whose code
    /// does not hold its examples.
    drew: AtomicBool,
    /// The code of the last reply told whose examples ran before it was, and what they
    /// printed: its executor reads that rather than run them again.
    checked: Mutex<Option<(String, String)>>,
}

impl Drawing {
    /// Whether the task's one drawing is still to come.
    pub(super) fn may_draw(&self) -> bool {
        !self.drew.load(Ordering::SeqCst)
    }

    /// Takes the task's one drawing; `false` when it was taken before.
    pub(super) fn take(&self) -> bool {
        !self.drew.swap(true, Ordering::SeqCst)
    }

    /// Keeps `verdict` (the code, what its examples printed) for the executor, in place of
    /// any kept before.
    pub(super) fn keep(&self, verdict: Option<(String, String)>) {
        if let Ok(mut checked) = self.checked.lock() {
            *checked = verdict;
        }
    }

    /// What was kept for `code`, taken.
    pub(super) fn kept_for(&self, code: &str) -> Option<String> {
        let kept = self.checked.lock().ok().and_then(|mut c| c.take())?;
        (kept.0 == code).then_some(kept.1)
    }
}

/// The task's final answer: the value it ended with, and whether the model was told once
/// that its answer disagrees with what its code printed.
#[derive(Default)]
pub(super) struct Answer {
    /// The value the final answer ended with, checked against the output schema.
    result: Mutex<Option<serde_json::Value>>,
    grounded: AtomicBool,
}

impl Answer {
    /// Keeps the final answer's value.
    pub(super) fn keep(&self, value: serde_json::Value) {
        if let Ok(mut r) = self.result.lock() {
            *r = Some(value);
        }
    }

    /// The final answer's value, taken.
    pub(super) fn take(&self) -> Option<serde_json::Value> {
        self.result.lock().ok().and_then(|mut r| r.take())
    }

    /// Whether the model was told its answer disagrees with its code.
    pub(super) fn told(&self) -> bool {
        self.grounded.load(Ordering::SeqCst)
    }

    /// Notes that the model was told.
    pub(super) fn tell(&self) {
        self.grounded.store(true, Ordering::SeqCst);
    }
}
