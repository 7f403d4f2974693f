//! [`Collector`]: a real OTLP trace receiver, over HTTP/protobuf (`POST /v1/traces`) and
//! gRPC (`TraceService/Export`), whose requests are decoded with the official protobuf
//! definitions (`opentelemetry-proto`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use prost::Message as _;
use serde_json::Value;

/// One span as the collector received it.
#[derive(Clone, Debug)]
pub struct Received {
    /// `http` or `grpc`.
    pub via: &'static str,
    /// The resource's attributes (`service.name`, ...).
    pub resource: BTreeMap<String, Value>,
    /// The span's name.
    pub name: String,
    /// Its trace, in hex.
    pub trace_id: String,
    /// Its id, in hex.
    pub span_id: String,
    /// Its parent's id, in hex; `None` for a root.
    pub parent: Option<String>,
    /// `SpanKind` as the protocol numbers it (1 internal, 2 server, 3 client).
    pub kind: i32,
    /// Its attributes, as JSON values.
    pub attributes: BTreeMap<String, Value>,
    /// The spans it links to: trace and span ids, in hex.
    pub links: Vec<(String, String)>,
    /// When it started and ended, ns since the epoch.
    pub start_ns: u64,
    /// See `start_ns`.
    pub end_ns: u64,
    /// Status code: 0 unset, 1 ok, 2 error.
    pub status: i32,
}

impl Received {
    /// Attribute `key` as text.
    pub fn text(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).and_then(Value::as_str)
    }

    /// Attribute `key` as a whole number.
    pub fn int(&self, key: &str) -> Option<i64> {
        self.attributes.get(key).and_then(Value::as_i64)
    }
}

/// A collector on loopback that keeps every span it is sent.
pub struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
    http: SocketAddr,
    grpc: SocketAddr,
}

impl Collector {
    /// Listens on two free loopback ports, one per protocol.
    pub async fn start() -> Self {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (http_addr, grpc_addr) = (http.local_addr().unwrap(), grpc.local_addr().unwrap());
        let kept = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: axum::http::HeaderMap, body: Bytes| {
                let kept = kept.clone();
                async move {
                    let protobuf = headers
                        .get("content-type")
                        .is_some_and(|v| v.as_bytes() == b"application/x-protobuf");
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) if protobuf => {
                            keep(&kept, "http", request);
                            (
                                axum::http::StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                ExportTraceServiceResponse::default().encode_to_vec(),
                            )
                        }
                        _ => (
                            axum::http::StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            b"not an OTLP protobuf export".to_vec(),
                        ),
                    }
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(http, app).await;
        });
        let service = TraceServiceServer::new(Grpc {
            spans: spans.clone(),
        });
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc))
                .await;
        });
        Self {
            spans,
            http: http_addr,
            grpc: grpc_addr,
        }
    }

    /// The base URL for OTLP over HTTP (spans are posted to `{it}/v1/traces`).
    pub fn http_endpoint(&self) -> String {
        format!("http://{}", self.http)
    }

    /// The URL for OTLP over gRPC.
    pub fn grpc_endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of trace `trace_id`, once `done` says they are all there, within `limit`.
    pub async fn trace(
        &self,
        trace_id: &str,
        limit: Duration,
        done: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let deadline = Instant::now() + limit;
        loop {
            let spans: Vec<Received> = self
                .spans()
                .into_iter()
                .filter(|s| s.trace_id == trace_id)
                .collect();
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "trace {trace_id} did not arrive whole within {limit:?}; got:\n{}",
                tree(&spans)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The spans as an indented tree, children in start order: for failure messages and
/// snapshots.
pub fn tree(spans: &[Received]) -> String {
    fn walk(spans: &[Received], parent: Option<&str>, depth: usize, out: &mut String) {
        let mut children: Vec<&Received> = spans
            .iter()
            .filter(|s| s.parent.as_deref() == parent)
            .collect();
        children.sort_by_key(|s| s.start_ns);
        for s in children {
            out.push_str(&format!("{}{}\n", "  ".repeat(depth), s.name));
            walk(spans, Some(&s.span_id), depth + 1, out);
        }
    }
    let ids: Vec<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut out = String::new();
    // Roots: no parent, or a parent that is not among them (the caller's).
    let mut roots: Vec<Option<&str>> = spans
        .iter()
        .filter(|s| s.parent.as_deref().is_none_or(|p| !ids.contains(&p)))
        .map(|s| s.parent.as_deref())
        .collect();
    roots.sort_unstable();
    roots.dedup();
    for root in roots {
        walk(spans, root, 0, &mut out);
    }
    out
}

struct Grpc {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        keep(&self.spans, "grpc", request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn keep(spans: &Mutex<Vec<Received>>, via: &'static str, request: ExportTraceServiceRequest) {
    let mut kept = spans.lock().unwrap();
    for rs in request.resource_spans {
        let resource = rs
            .resource
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                let parent = (!s.parent_span_id.is_empty()).then(|| hex(&s.parent_span_id));
                kept.push(Received {
                    via,
                    resource: resource.clone(),
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent,
                    kind: s.kind,
                    attributes: attributes(&s.attributes),
                    links: s
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                    start_ns: s.start_time_unix_nano,
                    end_ns: s.end_time_unix_nano,
                    status: s.status.map_or(0, |st| st.code),
                });
            }
        }
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, Value> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), kv.value.as_ref().map_or(Value::Null, value)))
        .collect()
}

fn value(v: &AnyValue) -> Value {
    match &v.value {
        Some(Any::StringValue(s)) => Value::String(s.clone()),
        Some(Any::BoolValue(b)) => Value::Bool(*b),
        Some(Any::IntValue(i)) => Value::from(*i),
        Some(Any::DoubleValue(d)) => Value::from(*d),
        Some(Any::ArrayValue(a)) => Value::Array(a.values.iter().map(value).collect()),
        Some(other) => Value::String(format!("{other:?}")),
        None => Value::Null,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
