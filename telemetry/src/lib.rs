//! Exports Tandem's spans ([`tandem_agent::trace`]) over OTLP, as `[telemetry]` and the
//! standard `OTEL_*` variables say. Export never holds up a task: finished spans go into a
//! bounded queue that one thread of its own drains; a full queue or a collector that cannot
//! take a batch drops spans, counted by [`tandem_agent::trace::dropped_spans`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter as _, SpanProcessor};
use tandem_agent::trace as spans;
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

/// `[telemetry]` in the config file. What it leaves out the `OTEL_*` variables give.
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Export (`true`) or not (`false`); unset, traces are exported when an endpoint is set
    /// here or in `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`.
    pub enabled: Option<bool>,
    /// The collector's base URL (`http://collector:4318` for HTTP, `http://collector:4317`
    /// for gRPC); HTTP export posts to `{endpoint}/v1/traces`.
    pub endpoint: Option<String>,
    /// `http/protobuf` (the default) or `grpc`.
    pub protocol: Option<String>,
    /// `service.name`; else `OTEL_SERVICE_NAME`, else `tandem`.
    pub service_name: Option<String>,
    /// More resource attributes, beside `OTEL_RESOURCE_ATTRIBUTES`'.
    #[serde(default)]
    pub resource_attributes: BTreeMap<String, String>,
    /// Headers sent with every export (an API key), beside `OTEL_EXPORTER_OTLP_HEADERS`'.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Put prompts, replies, code and output on spans; off unless the operator opts in here
    /// or with `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.
    pub capture_content: Option<bool>,
    /// Most finished spans waiting for export; more are dropped and counted (2048).
    pub queue_size: Option<usize>,
    /// Longest one export may take before its spans are dropped, in seconds (10).
    pub export_timeout_secs: Option<u64>,
}

/// How spans reach the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP over HTTP with protobuf bodies.
    HttpProtobuf,
    /// OTLP over gRPC.
    Grpc,
}

/// Why traces could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A setting has a value Tandem cannot use.
    #[error("{setting}: {message}")]
    Setting {
        /// Where it was set (`[telemetry] protocol`, `OTEL_EXPORTER_OTLP_PROTOCOL`).
        setting: String,
        /// What is wrong and what to set instead.
        message: String,
    },
    /// The exporter could not be built.
    #[error("cannot export traces to {endpoint}: {message}")]
    Exporter {
        /// Where spans were to go.
        endpoint: String,
        /// Why not.
        message: String,
    },
}

/// The settings [`TelemetryConfig`] and the environment come to.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// Where spans go: for HTTP the full URL they are posted to.
    pub endpoint: String,
    /// How.
    pub protocol: Protocol,
    /// `service.name`, when Tandem names it (else the environment's).
    pub service_name: Option<String>,
    /// Whether spans carry content.
    pub capture_content: bool,
    /// The export queue's length.
    pub queue_size: usize,
    /// One export's time limit.
    pub export_timeout: Duration,
}

impl TelemetryConfig {
    /// What the settings come to with `env` (the process's variables); `None` when traces
    /// are off.
    pub fn resolve(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Resolved>, TelemetryError> {
        let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let truthy = |name: &str| var(name).is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let generic = var("OTEL_EXPORTER_OTLP_ENDPOINT");
        let signal = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
        let on = match self.enabled {
            Some(on) => on,
            None => {
                !truthy("OTEL_SDK_DISABLED")
                    && var("OTEL_TRACES_EXPORTER").is_none_or(|v| v.trim() != "none")
                    && (self.endpoint.is_some() || generic.is_some() || signal.is_some())
            }
        };
        if !on {
            return Ok(None);
        }
        let (setting, protocol) = match &self.protocol {
            Some(p) => ("[telemetry] protocol".to_owned(), Some(p.clone())),
            None => [
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ]
            .into_iter()
            .find_map(|name| Some((name.to_owned(), Some(var(name)?))))
            .unwrap_or_default(),
        };
        let protocol = match protocol.as_deref().map(str::trim) {
            None | Some("http/protobuf") => Protocol::HttpProtobuf,
            Some("grpc") => Protocol::Grpc,
            Some(other) => {
                return Err(TelemetryError::Setting {
                    setting,
                    message: format!(
                        "`{other}` is not a protocol Tandem exports with; use `http/protobuf` or `grpc`"
                    ),
                });
            }
        };
        let signal_path = |base: &str| {
            let base = base.trim().trim_end_matches('/');
            if base.ends_with("/v1/traces") {
                base.to_owned()
            } else {
                format!("{base}/v1/traces")
            }
        };
        let endpoint = match (protocol, &self.endpoint, signal, generic) {
            (Protocol::HttpProtobuf, Some(base), ..) => signal_path(base),
            (Protocol::HttpProtobuf, None, Some(url), _) => url.trim().to_owned(),
            (Protocol::HttpProtobuf, None, None, Some(base)) => signal_path(&base),
            (Protocol::HttpProtobuf, None, None, None) => "http://localhost:4318/v1/traces".into(),
            (Protocol::Grpc, Some(url), ..) => url.trim().to_owned(),
            (Protocol::Grpc, None, Some(url), _) | (Protocol::Grpc, None, None, Some(url)) => {
                url.trim().to_owned()
            }
            (Protocol::Grpc, None, None, None) => "http://localhost:4317".into(),
        };
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(TelemetryError::Setting {
                setting: "[telemetry] endpoint".to_owned(),
                message: format!(
                    "`{endpoint}` is not an http:// or https:// URL; give the collector's, as `http://localhost:4318`"
                ),
            });
        }
        let named = var("OTEL_SERVICE_NAME").is_some()
            || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
        let service_name = self
            .service_name
            .clone()
            .or_else(|| (!named).then(|| "tandem".to_owned()));
        Ok(Some(Resolved {
            endpoint,
            protocol,
            service_name,
            capture_content: self
                .capture_content
                .unwrap_or_else(|| truthy("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")),
            queue_size: self.queue_size.unwrap_or(2048).max(1),
            export_timeout: Duration::from_secs(self.export_timeout_secs.unwrap_or(10).max(1)),
        }))
    }
}

/// Traces being exported; [`Telemetry::shutdown`] sends what is left.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    settings: Resolved,
}

impl Telemetry {
    /// Starts exporting as `config` and the environment say; `None` when traces are off.
    pub fn start(config: &TelemetryConfig) -> Result<Option<Self>, TelemetryError> {
        let env = |name: &str| std::env::var(name).ok();
        let Some(settings) = config.resolve(&env)? else {
            return Ok(None);
        };
        let mut resource = Resource::builder().with_attributes(
            config
                .resource_attributes
                .iter()
                .map(|(k, v)| opentelemetry::KeyValue::new(k.clone(), v.clone())),
        );
        if let Some(name) = &settings.service_name {
            resource = resource.with_service_name(name.clone());
        }
        let resource = resource
            .with_attribute(opentelemetry::KeyValue::new(
                "service.version",
                env!("CARGO_PKG_VERSION"),
            ))
            .build();
        let processor = Queue::start(&settings, &config.headers, resource.clone())?;
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        spans::set_capture_content(settings.capture_content);
        Ok(Some(Self { provider, settings }))
    }

    /// What the settings came to.
    pub fn settings(&self) -> &Resolved {
        &self.settings
    }

    /// The layer that turns Tandem's spans into exported ones; every other target's spans
    /// stay out, and warnings inside a task's spans become events on them.
    pub fn layer<S>(&self) -> Box<dyn Layer<S> + Send + Sync>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        let filter = tracing_subscriber::filter::Targets::new()
            .with_target(spans::TARGET, tracing::Level::INFO)
            .with_default(tracing::Level::WARN);
        // Only the conventions' attributes and Tandem's own: no source locations, threads,
        // targets or busy/idle times, which are the code's and would cost every span. A span's
        // parent is found through `tracing`'s own context, so entering one (every poll of the
        // future it wraps) need not make its OpenTelemetry context current.
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer(spans::SCOPE))
            .with_context_activation(false)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            .with_tracked_inactivity(false)
            .with_filter(filter)
            .boxed()
    }

    /// Sends the spans still queued, waiting at most the export time limit.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::debug!(error = %e, "the trace exporter did not shut down cleanly");
        }
    }
}

/// What the export thread is told.
enum Work {
    Span(Box<SpanData>),
    Flush(SyncSender<()>),
    Stop(SyncSender<()>),
}

/// A span processor that never blocks the code that ends a span: a bounded queue, drained by
/// a thread with a runtime of its own that exports in batches.
#[derive(Debug)]
struct Queue {
    tx: SyncSender<Work>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    timeout: Duration,
}

/// Most spans in one export.
const BATCH: usize = 512;
/// How long a span may wait for others to fill its batch.
const LINGER: Duration = Duration::from_millis(500);

impl Queue {
    fn start(
        settings: &Resolved,
        headers: &BTreeMap<String, String>,
        resource: Resource,
    ) -> Result<Self, TelemetryError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(settings.queue_size);
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let (settings, headers) = (settings.clone(), headers.clone());
        let timeout = settings.export_timeout;
        let worker = std::thread::Builder::new()
            .name("tandem-otlp".to_owned())
            .spawn(move || export_loop(&settings, &headers, resource, &rx, &ready_tx))
            .map_err(|e| TelemetryError::Exporter {
                endpoint: String::new(),
                message: format!("cannot start the export thread: {e}"),
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self {
                tx,
                worker: Mutex::new(Some(worker)),
                timeout,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TelemetryError::Exporter {
                endpoint: String::new(),
                message: "the export thread ended as it started".to_owned(),
            }),
        }
    }

    /// Asks the thread for `work` and waits for its answer, within the export time limit
    /// (twice: one export may be under way).
    fn ask(&self, work: impl FnOnce(SyncSender<()>) -> Work) -> OTelSdkResult {
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel(1);
        self.tx
            .send(work(done_tx))
            .map_err(|_| OTelSdkError::AlreadyShutdown)?;
        done_rx
            .recv_timeout(self.timeout * 2)
            .map_err(|_| OTelSdkError::Timeout(self.timeout * 2))
    }
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        match self.tx.try_send(Work::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => spans::count_dropped(1),
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.ask(Work::Flush)
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        let asked = self.ask(Work::Stop);
        if let Ok(mut worker) = self.worker.lock()
            && let Some(worker) = worker.take()
            && asked.is_ok()
        {
            let _ = worker.join();
        }
        asked
    }
}

/// The export thread: builds the exporter (telling `ready` whether it could), then sends
/// batches until told to stop or every sender is gone.
fn export_loop(
    settings: &Resolved,
    headers: &BTreeMap<String, String>,
    resource: Resource,
    rx: &Receiver<Work>,
    ready: &SyncSender<Result<(), TelemetryError>>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(TelemetryError::Exporter {
                endpoint: settings.endpoint.clone(),
                message: format!("cannot start the export runtime: {e}"),
            }));
            return;
        }
    };
    // gRPC's channel belongs to the runtime it is made in.
    let mut exporter = match runtime.block_on(async { exporter(settings, headers) }) {
        Ok(exporter) => exporter,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    exporter.set_resource(&resource);
    let _ = ready.send(Ok(()));
    let mut batch: Vec<SpanData> = Vec::new();
    let mut warned = false;
    let mut send = |batch: &mut Vec<SpanData>| {
        if batch.is_empty() {
            return;
        }
        let spans = std::mem::take(batch);
        let n = spans.len() as u64;
        let sent = runtime.block_on(async {
            tokio::time::timeout(settings.export_timeout, exporter.export(spans)).await
        });
        let failure = match sent {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {} s", settings.export_timeout.as_secs()),
        };
        spans::count_dropped(n);
        // Once at warn: a collector that is down would otherwise say so every batch.
        if warned {
            tracing::debug!(endpoint = %settings.endpoint, error = %failure, dropped = n, "spans not exported");
        } else {
            warned = true;
            tracing::warn!(endpoint = %settings.endpoint, error = %failure, dropped = n, "spans not exported; the collector did not take them (dropped spans are counted in /metrics)");
        }
    };
    loop {
        match rx.recv_timeout(LINGER) {
            Ok(Work::Span(span)) => {
                batch.push(*span);
                if batch.len() >= BATCH {
                    send(&mut batch);
                }
            }
            Ok(Work::Flush(done)) => {
                while let Ok(Work::Span(span)) = rx.try_recv() {
                    batch.push(*span);
                }
                send(&mut batch);
                let _ = done.send(());
            }
            Ok(Work::Stop(done)) => {
                send(&mut batch);
                let _ = done.send(());
                break;
            }
            Err(RecvTimeoutError::Timeout) => send(&mut batch),
            Err(RecvTimeoutError::Disconnected) => {
                send(&mut batch);
                break;
            }
        }
    }
}

fn exporter(
    settings: &Resolved,
    headers: &BTreeMap<String, String>,
) -> Result<opentelemetry_otlp::SpanExporter, TelemetryError> {
    let failed = |message: String| TelemetryError::Exporter {
        endpoint: settings.endpoint.clone(),
        message,
    };
    let built = match settings.protocol {
        Protocol::HttpProtobuf => {
            let https = settings.endpoint.starts_with("https://");
            let tls = tandem_agent::chat::tls_config(https).map_err(|e| failed(e.message))?;
            let client = reqwest::Client::builder()
                .use_preconfigured_tls(tls)
                .timeout(settings.export_timeout)
                .build()
                .map_err(|e| failed(e.to_string()))?;
            opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(settings.endpoint.clone())
                .with_timeout(settings.export_timeout)
                .with_http_client(client)
                .with_headers(headers.clone().into_iter().collect::<HashMap<_, _>>())
                .build()
        }
        Protocol::Grpc => {
            let mut map = http::HeaderMap::new();
            for (k, v) in headers {
                match (k.parse::<http::HeaderName>(), v.parse()) {
                    (Ok(key), Ok(value)) => {
                        map.insert(key, value);
                    }
                    _ => return Err(failed(format!("`{k}` is not a header gRPC can send"))),
                }
            }
            let metadata =
                opentelemetry_otlp::tonic_types::metadata::MetadataMap::from_headers(map);
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(settings.endpoint.clone())
                .with_timeout(settings.export_timeout)
                .with_metadata(metadata)
                .build()
        }
    };
    built.map_err(|e| failed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(
        config: &TelemetryConfig,
        vars: &[(&str, &str)],
    ) -> Result<Option<Resolved>, TelemetryError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        config.resolve(&|name| vars.get(name).cloned())
    }

    #[test]
    fn the_file_wins_and_the_environment_fills_in() {
        let none = TelemetryConfig::default();
        assert_eq!(resolve(&none, &[]).ok().flatten(), None);
        let env = resolve(&none, &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")])
            .ok()
            .flatten()
            .expect("on");
        assert_eq!(env.endpoint, "http://c:4318/v1/traces");
        assert_eq!(env.protocol, Protocol::HttpProtobuf);
        assert_eq!(env.service_name.as_deref(), Some("tandem"));
        let grpc = resolve(
            &none,
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_SERVICE_NAME", "mine"),
            ],
        )
        .ok()
        .flatten()
        .expect("on");
        assert_eq!(
            (grpc.endpoint.as_str(), grpc.protocol),
            ("http://c:4317", Protocol::Grpc)
        );
        assert_eq!(grpc.service_name, None, "the environment names the service");
        let file = TelemetryConfig {
            endpoint: Some("http://file:4318".into()),
            service_name: Some("svc".into()),
            ..TelemetryConfig::default()
        };
        let both = resolve(&file, &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318")])
            .ok()
            .flatten()
            .expect("on");
        assert_eq!(both.endpoint, "http://file:4318/v1/traces");
        assert_eq!(both.service_name.as_deref(), Some("svc"));
        assert_eq!(
            resolve(&file, &[("OTEL_SDK_DISABLED", "true")])
                .ok()
                .flatten(),
            None
        );
    }

    #[test]
    fn a_protocol_or_endpoint_it_cannot_use_is_named() {
        let on = |protocol: &str| TelemetryConfig {
            enabled: Some(true),
            protocol: Some(protocol.to_owned()),
            ..TelemetryConfig::default()
        };
        let e = resolve(&on("http/json"), &[]).err().map(|e| e.to_string());
        assert_eq!(
            e.as_deref(),
            Some(
                "[telemetry] protocol: `http/json` is not a protocol Tandem exports with; use `http/protobuf` or `grpc`"
            )
        );
        let e = resolve(
            &TelemetryConfig::default(),
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")],
        )
        .err()
        .map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("not an http:// or https:// URL")));
    }
}
