use std::collections::BTreeMap;
use std::sync::Arc;

use crate::{Budget, ExecError, Executor};

/// Executors by name; the daemon and CLI pick one per task from here.
#[derive(Clone, Default)]
pub struct Registry {
    executors: BTreeMap<String, Arc<dyn Executor>>,
    budget: Option<Budget>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an executor under its own name, replacing one of the same name.
    pub fn register(&mut self, executor: Arc<dyn Executor>) -> &mut Self {
        let executor = match &self.budget {
            Some(budget) => budget.wrap(executor),
            None => executor,
        };
        self.executors.insert(executor.name().to_owned(), executor);
        self
    }

    /// Every executor, registered now or later, opens sessions only within `budget`. Applied
    /// once: a registry already under a budget keeps it.
    pub fn with_budget(mut self, budget: Budget) -> Self {
        if self.budget.is_some() {
            return self;
        }
        self.executors = std::mem::take(&mut self.executors)
            .into_iter()
            .map(|(name, executor)| (name, budget.wrap(executor)))
            .collect();
        self.budget = Some(budget);
        self
    }

    /// The budget its sessions are opened within, if one was given.
    pub fn budget(&self) -> Option<&Budget> {
        self.budget.as_ref()
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
