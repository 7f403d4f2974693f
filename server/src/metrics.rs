//! Metrics in the OpenMetrics text format (prometheus-client): executions, model latency,
//! tokens; task counts come from the store when scraped.

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use tandem_protocol::engine::EngineStats;
use tandem_protocol::{BlockResult, Usage};

use crate::store::TaskState;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 13] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The Content-Type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;

fn latency() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The daemon's counters and histograms.
pub struct Metrics {
    registry: Registry,
    tasks: Family<Labels, Gauge>,
    executions: Family<Labels, Counter>,
    execution_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    model_seconds: Histogram,
    tokens: Family<Labels, Counter>,
    cost: Family<Labels, Counter<f64, AtomicU64>>,
    budget_stops: Family<Labels, Counter>,
    sessions: Gauge,
    hosts: Hosts,
    pools: Pools,
    daemon_tasks: Family<Labels, Gauge>,
    engine: Engine,
    spans_dropped: Counter,
    net_connections: Family<Labels, Counter>,
    net_bytes: Family<Labels, Counter>,
    block_cpu: Family<Labels, Counter<f64, AtomicU64>>,
    block_disk: Family<Labels, Counter>,
    block_peak: Family<Labels, Histogram, fn() -> Histogram>,
}

/// Peaks of memory from 16 MB to 8 GB.
fn peaks() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        16e6, 2.0, 10,
    ))
}

/// What the embedded model's engine says, when the daemon serves one.
#[derive(Default)]
struct Engine {
    sequences: Family<Labels, Gauge>,
    batch: Family<Labels, Gauge>,
    tokens: Family<Labels, Counter>,
    rate: Family<Labels, Gauge<f64, AtomicU64>>,
    cache: Family<Labels, Gauge>,
    evictions: Counter,
    pauses: Counter,
    draft: Family<Labels, Counter>,
    /// The totals last seen, so the counters grow by what is new.
    seen: Mutex<EngineStats>,
}

/// Each warm pool, by executor and host: gauges that follow its containers, and counters
/// grown by what its totals add.
#[derive(Default)]
struct Pools {
    containers: Family<Labels, Gauge>,
    waiting: Family<Labels, Gauge>,
    closing: Family<Labels, Gauge>,
    hits: Family<Labels, Counter>,
    misses: Family<Labels, Counter>,
    wait_seconds: Family<Labels, Counter<f64, AtomicU64>>,
    /// The totals last seen, by executor and host.
    seen: Mutex<std::collections::HashMap<Labels, tandem_executor::PoolStatus>>,
}

/// What each executor's hosts say, by executor and host.
#[derive(Default)]
struct Hosts {
    up: Family<Labels, Gauge>,
    sessions: Family<Labels, Gauge>,
    capacity: Family<Labels, Gauge>,
}

impl Pools {
    fn set(&self, pools: &[(String, tandem_executor::PoolStatus)]) {
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        for (executor, pool) in pools {
            let labels = vec![("executor", executor.clone()), ("host", pool.host.clone())];
            let n = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
            self.containers
                .get_or_create(&labels)
                .set(n(pool.ready + pool.starting));
            self.waiting.get_or_create(&labels).set(n(pool.waiting));
            self.closing.get_or_create(&labels).set(n(pool.closing));
            let last = seen.entry(labels.clone()).or_default();
            self.hits
                .get_or_create(&labels)
                .inc_by(pool.hits.saturating_sub(last.hits));
            self.misses
                .get_or_create(&labels)
                .inc_by(pool.misses.saturating_sub(last.misses));
            self.wait_seconds
                .get_or_create(&labels)
                .inc_by(pool.waited_ms.saturating_sub(last.waited_ms) as f64 / 1000.0);
            *last = pool.clone();
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Self {
            registry: Registry::default(),
            tasks: Family::default(),
            executions: Family::default(),
            execution_seconds: Family::new_with_constructor(latency),
            model_seconds: latency(),
            tokens: Family::default(),
            cost: Family::default(),
            budget_stops: Family::default(),
            sessions: Gauge::default(),
            hosts: Hosts::default(),
            pools: Pools::default(),
            daemon_tasks: Family::default(),
            engine: Engine::default(),
            spans_dropped: Counter::default(),
            net_connections: Family::default(),
            net_bytes: Family::default(),
            block_cpu: Family::default(),
            block_disk: Family::default(),
            block_peak: Family::new_with_constructor(peaks),
        };
        let mut registry = Registry::default();
        registry.register("tandem_tasks", "Tasks by state", m.tasks.clone());
        registry.register(
            "tandem_trace_spans_dropped",
            "Finished spans never exported: the export queue was full or the collector did not take them",
            m.spans_dropped.clone(),
        );
        registry.register(
            "tandem_net_connections",
            "Connections sandboxes made through the egress proxy, by executor and verdict (with brokered ones counted apart)",
            m.net_connections.clone(),
        );
        registry.register(
            "tandem_net_bytes",
            "Bytes the egress proxy carried for sandboxes, by executor and direction",
            m.net_bytes.clone(),
        );
        registry.register(
            "tandem_block_cpu_seconds",
            "CPU time code blocks used, by executor",
            m.block_cpu.clone(),
        );
        registry.register(
            "tandem_block_disk_written_bytes",
            "Bytes code blocks wrote to storage, by executor",
            m.block_disk.clone(),
        );
        registry.register(
            "tandem_block_peak_memory_bytes",
            "Each measured code block's peak of memory, by executor",
            m.block_peak.clone(),
        );
        registry.register(
            "tandem_executions",
            "Code blocks run, by executor and outcome",
            m.executions.clone(),
        );
        registry.register(
            "tandem_execution_seconds",
            "Time to run one code block",
            m.execution_seconds.clone(),
        );
        registry.register(
            "tandem_model_seconds",
            "Time for one model call",
            m.model_seconds.clone(),
        );
        registry.register(
            "tandem_tokens",
            "Tokens used, by direction, model and executor",
            m.tokens.clone(),
        );
        registry.register(
            "tandem_cost",
            "What finished tasks' model calls cost at [model.prices], by model and executor",
            m.cost.clone(),
        );
        registry.register(
            "tandem_budget_stops",
            "Tasks stopped by a budget, by the budget",
            m.budget_stops.clone(),
        );
        registry.register(
            "tandem_sessions_open",
            "Sandbox sessions open now, every executor and road together",
            m.sessions.clone(),
        );
        registry.register(
            "tandem_host_up",
            "Whether an executor's host answered its last probe (1) or is down (0)",
            m.hosts.up.clone(),
        );
        registry.register(
            "tandem_host_sessions",
            "Sessions open on an executor's host now",
            m.hosts.sessions.clone(),
        );
        registry.register(
            "tandem_host_capacity",
            "Most sessions an executor's host takes",
            m.hosts.capacity.clone(),
        );
        registry.register(
            "tandem_pool_containers",
            "Started sandboxes an executor's warm pool holds now (ready or starting), by executor and host",
            m.pools.containers.clone(),
        );
        registry.register(
            "tandem_pool_waiting",
            "Sessions waiting now for a sandbox from an executor's warm pool",
            m.pools.waiting.clone(),
        );
        registry.register(
            "tandem_pool_closing",
            "Closed sessions' sandboxes whose removal waits until no session waits for the warm pool",
            m.pools.closing.clone(),
        );
        registry.register(
            "tandem_pool_hits",
            "Sessions that found a started sandbox ready in the warm pool",
            m.pools.hits.clone(),
        );
        registry.register(
            "tandem_pool_misses",
            "Sessions that found the warm pool empty and waited for its next sandbox",
            m.pools.misses.clone(),
        );
        registry.register(
            "tandem_pool_wait_seconds",
            "Time sessions waited for a sandbox from the warm pool, all together",
            m.pools.wait_seconds.clone(),
        );
        registry.register(
            "tandem_daemon_tasks",
            "Tasks this daemon runs now (running or waiting for approval), by its name on the store",
            m.daemon_tasks.clone(),
        );
        let e = &m.engine;
        registry.register(
            "tandem_engine_sequences",
            "The embedded model's requests by state: live (read or generated now), waiting, kept (idle conversations in its cache)",
            e.sequences.clone(),
        );
        registry.register(
            "tandem_engine_batch",
            "The embedded model's last batch: sequences and tokens in it",
            e.batch.clone(),
        );
        registry.register(
            "tandem_engine_tokens",
            "The embedded model's tokens: prompt read, prompt reused from its cache, generated",
            e.tokens.clone(),
        );
        registry.register(
            "tandem_engine_tokens_per_second",
            "The embedded model's tokens per second over the last seconds, read and generated",
            e.rate.clone(),
        );
        registry.register(
            "tandem_engine_cache_tokens",
            "The embedded model's KV cache: cells used and cells in all",
            e.cache.clone(),
        );
        registry.register(
            "tandem_engine_evictions",
            "Idle conversations the embedded model dropped from its cache for room",
            e.evictions.clone(),
        );
        registry.register(
            "tandem_engine_pauses",
            "Replies the embedded model paused for room, to read again later",
            e.pauses.clone(),
        );
        registry.register(
            "tandem_engine_draft_tokens",
            "Tokens the embedded model's draft guessed (proposed) and the model kept (accepted)",
            e.draft.clone(),
        );
        Self { registry, ..m }
    }
}

impl Engine {
    fn set(&self, now: &EngineStats) {
        let gauge =
            |family: &Family<Labels, Gauge>, label: &'static str, value: &'static str, n: u64| {
                family
                    .get_or_create(&vec![(label, value.to_owned())])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            };
        gauge(&self.sequences, "state", "live", now.sequences_live);
        gauge(&self.sequences, "state", "waiting", now.sequences_waiting);
        gauge(&self.sequences, "state", "kept", now.sequences_kept);
        gauge(&self.batch, "of", "sequences", now.batch_sequences);
        gauge(&self.batch, "of", "tokens", now.batch_tokens);
        gauge(&self.cache, "state", "used", now.cache_tokens_used);
        gauge(&self.cache, "state", "total", now.cache_tokens);
        for (kind, n) in [
            ("read", now.read_per_second),
            ("generated", now.generated_per_second),
        ] {
            self.rate
                .get_or_create(&vec![("kind", kind.to_owned())])
                .set(n);
        }
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        let grow = |n: u64, before: u64| n.saturating_sub(before);
        for (kind, n, before) in [
            ("read", now.prompt_tokens_read, seen.prompt_tokens_read),
            (
                "reused",
                now.prompt_tokens_reused,
                seen.prompt_tokens_reused,
            ),
            ("generated", now.tokens_generated, seen.tokens_generated),
        ] {
            self.tokens
                .get_or_create(&vec![("kind", kind.to_owned())])
                .inc_by(grow(n, before));
        }
        for (kind, n, before) in [
            ("proposed", now.draft_proposed, seen.draft_proposed),
            ("accepted", now.draft_accepted, seen.draft_accepted),
        ] {
            self.draft
                .get_or_create(&vec![("kind", kind.to_owned())])
                .inc_by(grow(n, before));
        }
        self.evictions.inc_by(grow(now.evictions, seen.evictions));
        self.pauses.inc_by(grow(now.pauses, seen.pauses));
        *seen = now.clone();
    }
}

impl Metrics {
    /// Counts a finished block by executor and status, and its duration.
    pub fn execution(&self, executor: &str, result: &BlockResult) {
        let status = result.status.as_str().to_owned();
        self.executions
            .get_or_create(&vec![("executor", executor.to_owned()), ("status", status)])
            .inc();
        self.execution_seconds
            .get_or_create(&vec![("executor", executor.to_owned())])
            .observe(result.duration_ms as f64 / 1000.0);
        if let Some(r) = &result.resources {
            self.resources(executor, r);
        }
    }

    /// Counts what a block used: its CPU time, bytes written and peak, where measured.
    pub fn resources(&self, executor: &str, r: &tandem_protocol::Resources) {
        let labels = vec![("executor", executor.to_owned())];
        if let Some(cpu) = r.cpu_secs {
            self.block_cpu.get_or_create(&labels).inc_by(cpu);
        }
        if let Some(disk) = r.disk_written_bytes {
            self.block_disk.get_or_create(&labels).inc_by(disk);
        }
        if let Some(peak) = r.peak_memory_bytes {
            self.block_peak.get_or_create(&labels).observe(peak as f64);
        }
    }

    /// What counts connections through the egress proxy, for a sandbox without a task.
    pub fn net_counter(&self) -> NetCounter {
        NetCounter {
            connections: self.net_connections.clone(),
            bytes: self.net_bytes.clone(),
        }
    }

    /// Counts one connection through the egress proxy and the bytes it carried.
    pub fn net(&self, executor: &str, net: &tandem_protocol::net::NetEvent) {
        self.net_counter().count(executor, net);
    }
}

/// The `/metrics` families a connection through the egress proxy is counted in.
#[derive(Clone)]
pub struct NetCounter {
    connections: Family<Labels, Counter>,
    bytes: Family<Labels, Counter>,
}

impl NetCounter {
    /// Counts one connection and the bytes it carried, by executor.
    pub fn count(&self, executor: &str, net: &tandem_protocol::net::NetEvent) {
        let verdict = match net.verdict {
            tandem_protocol::net::NetVerdict::Allowed if net.brokered => "brokered",
            tandem_protocol::net::NetVerdict::Allowed => "allowed",
            tandem_protocol::net::NetVerdict::Denied => "denied",
        };
        self.connections
            .get_or_create(&vec![
                ("executor", executor.to_owned()),
                ("verdict", verdict.to_owned()),
            ])
            .inc();
        for (direction, n) in [("out", net.bytes_out), ("in", net.bytes_in)] {
            self.bytes
                .get_or_create(&vec![
                    ("executor", executor.to_owned()),
                    ("direction", direction.to_owned()),
                ])
                .inc_by(n);
        }
    }
}

impl Metrics {
    /// Records how long a model call took.
    pub fn model_latency(&self, took: Duration) {
        self.model_seconds.observe(took.as_secs_f64());
    }

    /// Adds a model call's tokens, by the task's model and executor.
    pub fn tokens(&self, usage: Usage, model: &str, executor: &str) {
        for (kind, n) in [
            ("prompt", usage.prompt_tokens),
            ("completion", usage.completion_tokens),
        ] {
            self.tokens
                .get_or_create(&vec![
                    ("kind", kind.to_owned()),
                    ("model", model.to_owned()),
                    ("executor", executor.to_owned()),
                ])
                .inc_by(n);
        }
    }

    /// Adds what a finished task cost, and the budget that stopped it.
    pub fn finished(&self, cost: Option<f64>, budget: Option<&str>, model: &str, executor: &str) {
        if let Some(cost) = cost.filter(|c| c.is_finite() && *c > 0.0) {
            self.cost
                .get_or_create(&vec![
                    ("model", model.to_owned()),
                    ("executor", executor.to_owned()),
                ])
                .inc_by(cost);
        }
        if let Some(budget) = budget {
            self.budget_stops
                .get_or_create(&vec![("budget", budget.to_owned())])
                .inc();
        }
    }

    /// The text exposition ([`CONTENT_TYPE`]), with task counts by state and the sandbox
    /// sessions open.
    pub fn render(
        &self,
        tasks_by_state: &[(TaskState, u64)],
        sessions_open: usize,
        hosts: &[(String, tandem_executor::HostStatus)],
        pools: &[(String, tandem_executor::PoolStatus)],
        daemon: (&str, usize),
        engine: Option<&EngineStats>,
    ) -> String {
        self.pools.set(pools);
        if let Some(stats) = engine {
            self.engine.set(stats);
        }
        self.daemon_tasks
            .get_or_create(&vec![("daemon", daemon.0.to_owned())])
            .set(i64::try_from(daemon.1).unwrap_or(i64::MAX));
        self.sessions
            .set(i64::try_from(sessions_open).unwrap_or(i64::MAX));
        let dropped = tandem_agent::trace::dropped_spans();
        if let Some(new) = dropped.checked_sub(self.spans_dropped.get()) {
            self.spans_dropped.inc_by(new);
        }
        for (executor, host) in hosts {
            let labels = vec![("executor", executor.clone()), ("host", host.name.clone())];
            let n = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
            self.hosts.up.get_or_create(&labels).set(i64::from(host.up));
            self.hosts
                .sessions
                .get_or_create(&labels)
                .set(n(host.sessions));
            self.hosts
                .capacity
                .get_or_create(&labels)
                .set(n(host.capacity));
        }
        for (state, n) in tasks_by_state {
            self.tasks
                .get_or_create(&vec![("state", state.as_str().to_owned())])
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_has_every_family_with_its_labels() {
        let m = Metrics::default();
        m.tokens(
            Usage {
                prompt_tokens: 7,
                completion_tokens: 3,
                estimated: false,
            },
            "m",
            "docker",
        );
        m.finished(Some(0.25), Some("max_cost"), "m", "docker");
        m.finished(Some(0.5), None, "m", "docker");
        m.finished(None, None, "m", "docker");
        m.model_latency(Duration::from_millis(20));
        m.net(
            "docker",
            &tandem_protocol::net::NetEvent {
                host: "files.test".to_owned(),
                port: 80,
                verdict: tandem_protocol::net::NetVerdict::Allowed,
                rule: "files.test".to_owned(),
                reason: None,
                bytes_out: 90,
                bytes_in: 160,
                ms: 3,
                brokered: false,
            },
        );
        let host = tandem_executor::HostStatus {
            name: "b".to_owned(),
            url: "tcp://10.0.0.2:2376".to_owned(),
            up: false,
            reason: Some("no answer".to_owned()),
            sessions: 1,
            capacity: 4,
            labels: Default::default(),
            workspace: "volume",
        };
        let text = m.render(
            &[(TaskState::Queued, 2)],
            3,
            &[("docker".to_owned(), host)],
            &[(
                "docker".to_owned(),
                tandem_executor::PoolStatus {
                    host: "unix:///var/run/docker.sock".to_owned(),
                    ready: 3,
                    starting: 1,
                    waiting: 2,
                    target: 6,
                    hits: 10,
                    misses: 4,
                    waited_ms: 1500,
                    closing: 5,
                },
            )],
            ("d1", 1),
            Some(&EngineStats {
                sequences_live: 2,
                tokens_generated: 40,
                cache_tokens_used: 900,
                cache_tokens: 16384,
                generated_per_second: 12.5,
                evictions: 1,
                draft: true,
                draft_proposed: 8,
                draft_accepted: 5,
                ..EngineStats::default()
            }),
        );
        for line in [
            "# TYPE tandem_tasks gauge",
            "tandem_tasks{state=\"queued\"} 2",
            "tandem_tokens_total{kind=\"prompt\",model=\"m\",executor=\"docker\"} 7",
            "tandem_tokens_total{kind=\"completion\",model=\"m\",executor=\"docker\"} 3",
            "tandem_cost_total{model=\"m\",executor=\"docker\"} 0.75",
            "tandem_budget_stops_total{budget=\"max_cost\"} 1",
            "tandem_model_seconds_bucket{le=\"0.025\"} 1",
            "tandem_model_seconds_count 1",
            "tandem_sessions_open 3",
            "tandem_net_connections_total{executor=\"docker\",verdict=\"allowed\"} 1",
            "tandem_net_bytes_total{executor=\"docker\",direction=\"in\"} 160",
            "tandem_host_up{executor=\"docker\",host=\"b\"} 0",
            "tandem_host_sessions{executor=\"docker\",host=\"b\"} 1",
            "tandem_host_capacity{executor=\"docker\",host=\"b\"} 4",
            "tandem_pool_containers{executor=\"docker\",host=\"unix:///var/run/docker.sock\"} 4",
            "tandem_pool_waiting{executor=\"docker\",host=\"unix:///var/run/docker.sock\"} 2",
            "tandem_pool_closing{executor=\"docker\",host=\"unix:///var/run/docker.sock\"} 5",
            "tandem_pool_hits_total{executor=\"docker\",host=\"unix:///var/run/docker.sock\"} 10",
            "tandem_pool_misses_total{executor=\"docker\",host=\"unix:///var/run/docker.sock\"} 4",
            "tandem_pool_wait_seconds_total{executor=\"docker\",host=\"unix:///var/run/docker.sock\"} 1.5",
            "tandem_daemon_tasks{daemon=\"d1\"} 1",
            "tandem_engine_sequences{state=\"live\"} 2",
            "tandem_engine_tokens_total{kind=\"generated\"} 40",
            "tandem_engine_cache_tokens{state=\"used\"} 900",
            "tandem_engine_cache_tokens{state=\"total\"} 16384",
            "tandem_engine_tokens_per_second{kind=\"generated\"} 12.5",
            "tandem_engine_evictions_total 1",
            "tandem_engine_draft_tokens_total{kind=\"accepted\"} 5",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
        }
    }
}
