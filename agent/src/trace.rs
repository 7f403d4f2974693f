//! Tandem's spans, named and attributed after the OpenTelemetry GenAI semantic conventions
//! at [`SEMCONV_VERSION`]: `invoke_agent` for a task and each agent's turn, `chat` for a
//! model call, `execute_tool` for a tool call, and Tandem's own `run_block`, `approval` and
//! `queue`. They are `tracing` spans under [`TARGET`]; they cost next to nothing until a
//! binary installs the OpenTelemetry layer, which exports them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::SystemTime;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span as _, TraceContextExt, Tracer as _};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The version of the GenAI semantic conventions the spans follow.
pub const SEMCONV_VERSION: &str = "1.37.0";

/// The target every Tandem span is made under: logs leave it out, the exporter takes it.
pub const TARGET: &str = "tandem_trace";

/// The instrumentation scope the exporter's tracer is named after.
pub const SCOPE: &str = "tandem";

static CAPTURE_CONTENT: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Puts prompts, replies, code and outputs on spans (the operator opted in) or leaves them
/// out (the default).
pub fn set_capture_content(on: bool) {
    CAPTURE_CONTENT.store(on, Ordering::Relaxed);
}

/// Whether spans carry content.
pub fn capture_content() -> bool {
    CAPTURE_CONTENT.load(Ordering::Relaxed)
}

/// Counts `n` finished spans that were never delivered (the export queue was full, or the
/// collector could not take them).
pub fn count_dropped(n: u64) {
    DROPPED.fetch_add(n, Ordering::Relaxed);
}

/// Finished spans never delivered since the process started.
pub fn dropped_spans() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

// Whole numbers go on spans as `i64`: the exporter writes a `u64` field as text.

/// A task's span: `invoke_agent {agent}`, the conversation being the task.
pub fn task(id: &str, agent: &str) -> Span {
    tracing::info_span!(
        target: TARGET,
        "invoke_agent",
        otel.name = %format!("invoke_agent {agent}"),
        otel.kind = "internal",
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = %agent,
        gen_ai.conversation.id = %id,
    )
}

/// One agent's turn in a task: `invoke_agent {agent}`; `path` is where it sits in a team.
pub fn agent(name: &str, path: &str, turn: u32) -> Span {
    tracing::info_span!(
        target: TARGET,
        "invoke_agent",
        otel.name = %format!("invoke_agent {name}"),
        otel.kind = "internal",
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = %name,
        tandem.agent.path = %path,
        tandem.turn = i64::from(turn),
    )
}

/// A model call: `chat {model}`; `provider` is `openai` for an OpenAI-compatible server.
pub fn chat(model: &str, provider: &str) -> Span {
    tracing::info_span!(
        target: TARGET,
        "chat",
        otel.name = %format!("chat {model}"),
        otel.kind = if provider == EMBEDDED { "internal" } else { "client" },
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = %provider,
        gen_ai.request.model = %model,
    )
}

/// The provider name of a model run in this process.
pub const EMBEDDED: &str = "tandem.embedded";

/// A tool call: `execute_tool {tool}`.
pub fn tool(name: &str, call_id: &str) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "execute_tool",
        otel.name = %format!("execute_tool {name}"),
        otel.kind = "internal",
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %name,
        gen_ai.tool.call.id = %call_id,
    );
    // `type` is a keyword, so not a field name `tracing` takes.
    set(&span, "gen_ai.tool.type", "function");
    span
}

/// A code block run in a sandbox: `run_block {language}`.
pub fn block(executor: &str, language: &str, turn: u32, index: u32) -> Span {
    tracing::info_span!(
        target: TARGET,
        "run_block",
        otel.name = %format!("run_block {language}"),
        otel.kind = "internal",
        tandem.executor = %executor,
        tandem.block.language = %language,
        tandem.turn = i64::from(turn),
        tandem.block.index = i64::from(index),
    )
}

/// A wait for a person's decision on a block or a call.
pub fn approval(what: &str, rule: &str) -> Span {
    tracing::info_span!(
        target: TARGET,
        "approval",
        otel.name = %format!("approval {what}"),
        otel.kind = "internal",
        tandem.approval.subject = %what,
        tandem.approval.rule = %rule,
    )
}

/// Records, as a child of `task`, the time the task waited in the queue: from `since` to now.
pub fn queued(task: &Span, since: SystemTime) {
    let parent = task.context();
    if !parent.span().span_context().is_valid() {
        return;
    }
    let tracer = opentelemetry::global::tracer(SCOPE);
    let mut span = tracer
        .span_builder("queue")
        .with_start_time(since)
        .with_attributes([KeyValue::new("tandem.queue", "tasks")])
        .start_with_context(&tracer, &parent);
    span.end_with_timestamp(SystemTime::now().max(since));
}

/// Records, as a child of `parent`, one connection a sandbox made through the egress proxy:
/// `egress {host}`, from its start to now, with its verdict, rule and bytes.
pub fn net(parent: &Span, net: &tandem_protocol::net::NetEvent) {
    let parent = parent.context();
    if !parent.span().span_context().is_valid() {
        return;
    }
    let now = SystemTime::now();
    let since = now
        .checked_sub(std::time::Duration::from_millis(net.ms))
        .unwrap_or(now);
    let verdict = match net.verdict {
        tandem_protocol::net::NetVerdict::Allowed => "allowed",
        tandem_protocol::net::NetVerdict::Denied => "denied",
    };
    let tracer = opentelemetry::global::tracer(SCOPE);
    let mut span = tracer
        .span_builder(format!("egress {}", net.host))
        .with_kind(opentelemetry::trace::SpanKind::Client)
        .with_start_time(since)
        .with_attributes([
            KeyValue::new("server.address", net.host.clone()),
            KeyValue::new("server.port", i64::from(net.port)),
            KeyValue::new("tandem.net.verdict", verdict),
            KeyValue::new("tandem.net.rule", net.rule.clone()),
            KeyValue::new(
                "tandem.net.bytes_out",
                i64::try_from(net.bytes_out).unwrap_or(i64::MAX),
            ),
            KeyValue::new(
                "tandem.net.bytes_in",
                i64::try_from(net.bytes_in).unwrap_or(i64::MAX),
            ),
            KeyValue::new("tandem.net.brokered", net.brokered),
        ])
        .start_with_context(&tracer, &parent);
    span.end_with_timestamp(now);
}

/// Sets attribute `key` on `span` (nothing when no exporter is installed).
pub fn set(span: &Span, key: &'static str, value: impl Into<Value>) {
    span.set_attribute(key, value);
}

/// Sets a string-array attribute.
pub fn set_strings(span: &Span, key: &'static str, values: Vec<String>) {
    let values = values.into_iter().map(Into::into).collect();
    span.set_attribute(key, Value::Array(opentelemetry::Array::String(values)));
}

/// Marks `span` failed: `error.type` (a short, low-cardinality class) and the message.
pub fn fail(span: &Span, error_type: &str, message: &str) {
    span.set_attribute("error.type", error_type.to_owned());
    span.set_status(opentelemetry::trace::Status::error(message.to_owned()));
}

/// Longest `traceparent` kept from a caller (the header is 55 characters).
const MAX_TRACEPARENT: usize = 128;

/// A caller's `traceparent` as it is kept with its task: trimmed, and dropped unless it is
/// one (W3C: `version-traceid-spanid-flags` in lowercase hex, ids not all zero, version not
/// `ff`; a later version may add fields after a `-`).
pub fn caller(value: &str) -> Option<String> {
    let value = value.trim();
    if value.is_empty() || value.len() > MAX_TRACEPARENT {
        return None;
    }
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut parts = value.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let rest_ok = match version {
        "00" => parts.next().is_none(),
        _ => parts.all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric())),
    };
    let ok = hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(span, 16)
        && span.bytes().any(|b| b != b'0')
        && hex(flags, 2)
        && rest_ok;
    ok.then(|| value.to_owned())
}

/// Makes `span` a child of the W3C `traceparent`; a malformed one is ignored (logged at
/// debug). Returns whether it took.
pub fn set_parent(span: &Span, traceparent: &str) -> bool {
    match context_of(traceparent) {
        Some(cx) => span.set_parent(cx).is_ok(),
        None => {
            tracing::debug!(%traceparent, "a malformed traceparent is ignored");
            false
        }
    }
}

/// Links `span` to the span `traceparent` names (an earlier run of the same task).
pub fn link(span: &Span, traceparent: &str) {
    if let Some(cx) = context_of(traceparent) {
        span.add_link(cx.span().span_context().clone());
    }
}

/// `span`'s own context as a W3C `traceparent`; `None` when it is not exported.
pub fn traceparent(span: &Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// The trace id in a W3C `traceparent`.
pub fn trace_id(traceparent: &str) -> Option<String> {
    context_of(traceparent).map(|cx| cx.span().span_context().trace_id().to_string())
}

/// The remote context a well-formed `traceparent` names.
fn context_of(traceparent: &str) -> Option<opentelemetry::Context> {
    let carrier = HashMap::from([("traceparent".to_owned(), traceparent.trim().to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_read_or_ignored() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            trace_id(good).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        for bad in [
            "",
            "00-zz-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            &"9".repeat(100_000),
        ] {
            assert_eq!(trace_id(bad), None, "{bad:.40}");
            assert!(!set_parent(&Span::none(), bad));
            assert_eq!(caller(bad), None, "{bad:.40}");
        }
    }

    #[test]
    fn a_callers_traceparent_is_kept_only_when_it_is_one() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(caller(&format!(" {good}\n")).as_deref(), Some(good));
        for junk in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736\n-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "junk",
        ] {
            assert_eq!(caller(junk), None, "{junk}");
        }
        // A later version may carry more.
        assert!(caller("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x1").is_some());
    }
}
