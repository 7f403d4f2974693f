use std::collections::BTreeMap;
use std::sync::Arc;

use crate::{ExecError, Executor};

/// What every executor of a registry is wrapped in as it is registered (a budget that bounds
/// the sessions they open, say).
pub trait Wrap: std::any::Any + Send + Sync {
    /// `executor`, wrapped.
    fn wrap(&self, executor: Arc<dyn Executor>) -> Arc<dyn Executor>;
}

/// Executors by name; the daemon and CLI pick one per task from here.
#[derive(Clone, Default)]
pub struct Registry {
    executors: BTreeMap<String, Arc<dyn Executor>>,
    wrap: Option<Arc<dyn Wrap>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an executor under its own name, replacing one of the same name.
    pub fn register(&mut self, executor: Arc<dyn Executor>) -> &mut Self {
        let executor = match &self.wrap {
            Some(wrap) => wrap.wrap(executor),
            None => executor,
        };
        self.executors.insert(executor.name().to_owned(), executor);
        self
    }

    /// Every executor, registered now or later, is wrapped in `wrap`. Applied once: a
    /// registry already wrapped keeps its wrap.
    pub fn wrapped(mut self, wrap: Arc<dyn Wrap>) -> Self {
        if self.wrap.is_some() {
            return self;
        }
        self.executors = std::mem::take(&mut self.executors)
            .into_iter()
            .map(|(name, executor)| (name, wrap.wrap(executor)))
            .collect();
        self.wrap = Some(wrap);
        self
    }

    /// What its executors are wrapped in, if it is a `W`.
    pub fn wrap<W: Wrap>(&self) -> Option<&W> {
        let wrap: &dyn std::any::Any = self.wrap.as_deref()?;
        wrap.downcast_ref()
    }

    /// Looks an executor up, with an error that lists what is registered.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Executor>, ExecError> {
        self.executors
            .get(name)
            .cloned()
            .ok_or_else(|| ExecError::UnknownExecutor {
                name: name.to_owned(),
                available: self.names().join(", "),
            })
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.executors.keys().map(String::as_str).collect()
    }

    /// Every registered executor, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Executor>> {
        self.executors.values()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.executors.keys()).finish()
    }
}
