//! What a task may spend on its model calls: tokens sent, tokens written and money. Checked
//! before every call, so a task stops at the first call it cannot afford, with its work kept;
//! the tokens still allowed cap the next reply's length, so `max_output_tokens` is never passed.

use tandem_protocol::{BudgetReached, Usage};

/// What a million tokens of one model cost, in the operator's currency.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// A million prompt tokens.
    pub input: f64,
    /// A million completion tokens.
    pub output: f64,
}

impl Price {
    /// What `usage` costs at this price.
    pub fn cost(&self, usage: Usage) -> f64 {
        (usage.prompt_tokens as f64 * self.input + usage.completion_tokens as f64 * self.output)
            / 1_000_000.0
    }

    /// Whether both figures are finite and not negative.
    pub fn is_valid(&self) -> bool {
        [self.input, self.output]
            .iter()
            .all(|p| p.is_finite() && *p >= 0.0)
    }
}

/// `so_far` with a call's `usage` at `price` added; unknown once a call has no price.
pub fn add_cost(so_far: Option<f64>, price: Option<&Price>, usage: Usage) -> Option<f64> {
    Some(so_far? + price?.cost(usage))
}

/// Bytes counted as one token where a server reports no usage: about what English text and
/// code come to in the common BPE tokenizers, so an estimate is near the truth, not far below
/// it.
pub const BYTES_PER_TOKEN: usize = 4;

/// The usage of a call whose answer carried none, from what was sent (`prompt_bytes`: the
/// messages' text and calls, and the tools offered) and what came back (`reply_bytes`: the
/// reply's text and calls): a token per [`BYTES_PER_TOKEN`] bytes, rounded up, so any text is
/// at least one token. Marked as an estimate.
pub fn estimate(prompt_bytes: usize, reply_bytes: usize) -> Usage {
    let tokens = |bytes: usize| bytes.div_ceil(BYTES_PER_TOKEN) as u64;
    Usage {
        prompt_tokens: tokens(prompt_bytes),
        completion_tokens: tokens(reply_bytes),
        estimated: true,
    }
}

/// A task's budgets; each one left out is no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Budget {
    /// Most prompt tokens, all calls together.
    pub max_input_tokens: Option<u64>,
    /// Most completion tokens, all calls together.
    pub max_output_tokens: Option<u64>,
    /// Most money, all calls together.
    pub max_cost: Option<f64>,
}

impl Budget {
    /// Whether no budget is set.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The first budget that `spent` and `cost` have reached: a task that has reached one
    /// makes no further call.
    pub fn reached(&self, spent: Usage, cost: f64) -> Option<BudgetReached> {
        let hit = |budget: &str, limit: f64, spent: f64| {
            (spent >= limit).then(|| BudgetReached {
                budget: budget.to_owned(),
                limit,
                spent,
            })
        };
        let tokens = |limit: Option<u64>, spent: u64| limit.map(|l| (l as f64, spent as f64));
        tokens(self.max_input_tokens, spent.prompt_tokens)
            .and_then(|(l, s)| hit("max_input_tokens", l, s))
            .or_else(|| {
                tokens(self.max_output_tokens, spent.completion_tokens)
                    .and_then(|(l, s)| hit("max_output_tokens", l, s))
            })
            .or_else(|| self.max_cost.and_then(|l| hit("max_cost", l, cost)))
    }

    /// Most tokens the next reply may have, when `max_output_tokens` is set: what is left.
    pub fn output_left(&self, spent: Usage) -> Option<u64> {
        self.max_output_tokens
            .map(|l| l.saturating_sub(spent.completion_tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used(prompt_tokens: u64, completion_tokens: u64) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            estimated: false,
        }
    }

    #[test]
    fn each_budget_is_reached_at_its_limit_and_not_before() {
        let b = Budget {
            max_input_tokens: Some(100),
            max_output_tokens: Some(10),
            max_cost: Some(0.5),
        };
        assert_eq!(b.reached(used(99, 9), 0.49), None);
        let hit = b.reached(used(100, 0), 0.0).unwrap();
        assert_eq!(
            (hit.budget.as_str(), hit.limit, hit.spent),
            ("max_input_tokens", 100.0, 100.0)
        );
        assert_eq!(
            b.reached(used(0, 12), 0.0).unwrap().budget,
            "max_output_tokens"
        );
        assert_eq!(b.reached(used(0, 0), 0.5).unwrap().budget, "max_cost");
        assert_eq!(b.output_left(used(0, 7)), Some(3));
        assert_eq!(b.output_left(used(0, 70)), Some(0));
        assert!(
            Budget::default()
                .reached(used(u64::MAX, u64::MAX), f64::MAX)
                .is_none()
        );
    }

    #[test]
    fn an_estimate_is_a_token_per_four_bytes_rounded_up_and_says_so() {
        let e = estimate(401, 4);
        assert_eq!(
            (e.prompt_tokens, e.completion_tokens, e.estimated),
            (101, 1, true)
        );
        assert_eq!(estimate(1, 0).prompt_tokens, 1);
        assert_eq!(estimate(0, 0).completion_tokens, 0);
        let mut sum = used(1, 1);
        sum.add(e);
        assert!(sum.estimated);
    }

    #[test]
    fn a_price_is_per_million_tokens() {
        let p = Price {
            input: 2.0,
            output: 8.0,
        };
        assert!((p.cost(used(500_000, 250_000)) - 3.0).abs() < 1e-9);
        assert!(p.is_valid());
        assert!(
            !Price {
                input: -1.0,
                output: 0.0
            }
            .is_valid()
        );
        assert!(
            !Price {
                input: f64::NAN,
                output: 0.0
            }
            .is_valid()
        );
    }
}
