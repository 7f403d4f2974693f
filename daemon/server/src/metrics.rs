//! Prometheus text metrics: executions, model latency, tokens; task counts come from the store.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use tandem_protocol::{BlockResult, Usage};

use crate::store::TaskState;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    total: u64,
}

impl Histogram {
    fn observe(&mut self, secs: f64) {
        for (bound, count) in BUCKETS.iter().zip(&mut self.counts) {
            if secs <= *bound {
                *count += 1;
            }
        }
        self.sum += secs;
        self.total += 1;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bound, count) in BUCKETS.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.total
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.total);
    }
}

#[derive(Default)]
struct Inner {
    executions: BTreeMap<(String, String), u64>,
    execution_seconds: BTreeMap<String, Histogram>,
    model_seconds: Histogram,
    prompt_tokens: u64,
    completion_tokens: u64,
}

/// The daemon's counters and histograms.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    /// Counts a finished block by executor and status, and its duration.
    pub fn execution(&self, executor: &str, result: &BlockResult) {
        if let Ok(mut m) = self.inner.lock() {
            *m.executions
                .entry((executor.to_owned(), result.status.as_str().to_owned()))
                .or_default() += 1;
            m.execution_seconds
                .entry(executor.to_owned())
                .or_default()
                .observe(result.duration_ms as f64 / 1000.0);
        }
    }

    /// Records how long a model call took.
    pub fn model_latency(&self, took: Duration) {
        if let Ok(mut m) = self.inner.lock() {
            m.model_seconds.observe(took.as_secs_f64());
        }
    }

    /// Adds a model call's tokens.
    pub fn tokens(&self, usage: Usage) {
        if let Ok(mut m) = self.inner.lock() {
            m.prompt_tokens += usage.prompt_tokens;
            m.completion_tokens += usage.completion_tokens;
        }
    }

    /// The Prometheus text exposition, with task counts by state.
    pub fn render(&self, tasks_by_state: &[(TaskState, u64)]) -> String {
        let mut out = String::new();
        out.push_str("# HELP tandem_tasks Tasks by state.\n# TYPE tandem_tasks gauge\n");
        for (state, n) in tasks_by_state {
            let _ = writeln!(out, "tandem_tasks{{state=\"{}\"}} {n}", state.as_str());
        }
        let Ok(m) = self.inner.lock() else {
            return out;
        };
        out.push_str("# HELP tandem_executions_total Code blocks run, by executor and outcome.\n# TYPE tandem_executions_total counter\n");
        for ((executor, status), n) in &m.executions {
            let _ = writeln!(
                out,
                "tandem_executions_total{{executor=\"{executor}\",status=\"{status}\"}} {n}"
            );
        }
        out.push_str("# HELP tandem_execution_seconds Time to run one code block.\n# TYPE tandem_execution_seconds histogram\n");
        for (executor, h) in &m.execution_seconds {
            h.render(
                &mut out,
                "tandem_execution_seconds",
                &format!("executor=\"{executor}\""),
            );
        }
        out.push_str("# HELP tandem_model_seconds Time for one model call.\n# TYPE tandem_model_seconds histogram\n");
        m.model_seconds.render(&mut out, "tandem_model_seconds", "");
        out.push_str("# HELP tandem_tokens_total Tokens used, by direction.\n# TYPE tandem_tokens_total counter\n");
        let _ = writeln!(
            out,
            "tandem_tokens_total{{kind=\"prompt\"}} {}",
            m.prompt_tokens
        );
        let _ = writeln!(
            out,
            "tandem_tokens_total{{kind=\"completion\"}} {}",
            m.completion_tokens
        );
        out
    }
}
