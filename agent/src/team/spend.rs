//! What a task may spend on model calls and what a run of it has spent: the budget, each
//! model's price by the path of its agent, and the tokens and cost so far, an interrupted
//! run's included.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use tandem_protocol::{BudgetReached, StopReason, Usage};

use crate::budget::{Budget, Price, add_cost};

/// A task's budget and prices, set when its team is made.
#[derive(Debug)]
pub(super) struct Spend {
    budget: Budget,
    /// Each model's price, by the path of its agent; one without a price makes the task's
    /// cost unknown.
    prices: HashMap<String, Price>,
    /// What an interrupted run of the task already spent: its tokens, and their cost when
    /// every model it called has a price.
    before: (Usage, Option<f64>),
}

impl Default for Spend {
    fn default() -> Self {
        Self {
            budget: Budget::default(),
            prices: HashMap::new(),
            before: (Usage::default(), Some(0.0)),
        }
    }
}

impl Spend {
    /// Holds the calls to `budget`, each model priced by its name in `prices`; `models` are
    /// each agent's model name and whether it runs in this process (which costs nothing).
    pub(super) fn set_budget(
        &mut self,
        budget: Budget,
        prices: &BTreeMap<String, Price>,
        models: &HashMap<String, (String, bool)>,
    ) {
        self.budget = budget;
        self.prices = models
            .iter()
            .filter_map(|(path, (name, embedded))| {
                let price = if *embedded {
                    Some(Price::default())
                } else {
                    prices.get(name).copied()
                };
                price.map(|p| (path.clone(), p))
            })
            .collect();
    }

    /// Counts what an interrupted run spent, a call's usage by its agent's path, at the
    /// prices set by [`Spend::set_budget`].
    pub(super) fn set_spent(&mut self, calls: &[(String, Usage)]) {
        let (mut usage, mut cost) = (Usage::default(), Some(0.0));
        for (path, used) in calls {
            usage.add(*used);
            cost = add_cost(cost, self.prices.get(path), *used);
        }
        self.before = (usage, cost);
    }

    /// A new run's count, from what was spent before it.
    pub(super) fn start(&self) -> Spending {
        Spending {
            usage: Mutex::new(self.before.0),
            cost: Mutex::new(self.before.1),
            reached: Mutex::new(None),
        }
    }
}

/// What one run has spent so far, shared by its branches.
pub(super) struct Spending {
    usage: Mutex<Usage>,
    /// What the calls cost so far; `None` once a model without a price was called.
    cost: Mutex<Option<f64>>,
    /// The budget that stopped the run.
    reached: Mutex<Option<BudgetReached>>,
}

impl Spending {
    /// Counts a call the agent at `path` made.
    pub(super) fn record(&self, spend: &Spend, path: &str, used: Option<Usage>) {
        if let (Some(u), Ok(mut usage)) = (used, self.usage.lock()) {
            usage.add(u);
        }
        if let Ok(mut cost) = self.cost.lock() {
            *cost = add_cost(*cost, spend.prices.get(path), used.unwrap_or_default());
        }
    }

    /// The tokens spent so far.
    pub(super) fn spent(&self) -> Usage {
        self.usage.lock().map(|u| *u).unwrap_or_default()
    }

    /// What the calls cost so far, when every model called has a price.
    pub(super) fn cost(&self) -> Option<f64> {
        self.cost.lock().ok().and_then(|c| *c)
    }

    /// The completion tokens the budget leaves, if it bounds them.
    pub(super) fn output_left(&self, spend: &Spend) -> Option<u64> {
        spend.budget.output_left(self.spent())
    }

    /// Whether the task has reached a budget: then no further model call is made, and the
    /// budget is kept for the run's end.
    pub(super) fn over(&self, spend: &Spend) -> Option<StopReason> {
        let reached = spend
            .budget
            .reached(self.spent(), self.cost().unwrap_or(0.0))?;
        tracing::info!(budget = %reached.budget, limit = reached.limit, spent = reached.spent, "the task reached a budget");
        if let Ok(mut r) = self.reached.lock()
            && r.is_none()
        {
            *r = Some(reached);
        }
        Some(StopReason::Budget)
    }

    /// The budget that stopped the run, taken for its end.
    pub(super) fn take_reached(&self) -> Option<BudgetReached> {
        self.reached.lock().ok().and_then(|mut r| r.take())
    }
}
