//! The assistant's model: any OpenAI-compatible chat completions API, through async-openai.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::middleware::ReqwestService;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;
use tandem_protocol::{ErrorCode, ErrorInfo, Message, ToolCall, Usage};
use tracing::Instrument;

use crate::tools::calls::Assembler;

/// Where the model is and how to talk to it.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// API base URL, such as `https://api.openai.com/v1` or `http://127.0.0.1:8080/v1`.
    pub base_url: String,
    /// Bearer token; local servers usually need none.
    pub api_key: Option<String>,
    /// Model name.
    pub model: String,
    /// Stream tokens as they are generated.
    pub stream: bool,
    /// Retries after a 429, 5xx or connection error.
    pub max_retries: u32,
    /// Delay before the first retry; doubled for each next one.
    pub retry_base: Duration,
    /// Time allowed to connect.
    pub connect_timeout: Duration,
    /// Longest silence allowed while waiting for the server.
    pub idle_timeout: Duration,
    /// Sampling temperature, when set.
    pub temperature: Option<f32>,
    /// Reply length cap, when set.
    pub max_tokens: Option<u32>,
    /// Sampling seed, when set: the same seed and conversation give the same reply where the
    /// model honours it (the embedded one does).
    pub seed: Option<u32>,
    /// The reply ends before any of these.
    pub stop: Vec<String>,
    /// Most bytes of one reply that are kept: a server that never stops streaming is cut
    /// off here, and the reply ends as if it had hit its length limit.
    pub max_reply_bytes: usize,
    /// Every reply offered tools must call one (`tool_choice: required`).
    pub tool_required: bool,
}

/// Default for [`ModelConfig::max_reply_bytes`]: far above any real reply (a 32k-token reply
/// is about 128 KiB).
pub const DEFAULT_MAX_REPLY_BYTES: usize = 1 << 20;

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            base_url: "https://api.openai.com/v1".to_owned(),
            api_key: None,
            model: "gpt-4o-mini".to_owned(),
            stream: true,
            max_retries: 3,
            retry_base: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            temperature: None,
            max_tokens: None,
            seed: None,
            stop: Vec::new(),
            max_reply_bytes: DEFAULT_MAX_REPLY_BYTES,
            tool_required: false,
        }
    }
}

/// A model call that failed for good.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ModelError {
    /// Kind, for clients and exit codes.
    pub code: ErrorCode,
    /// One line: what failed, with the URL and model, and what to check.
    pub message: String,
    retryable: bool,
}

impl ModelError {
    /// A failure that a retry would not mend.
    pub fn new(code: ErrorCode, message: String) -> Self {
        Self {
            code,
            message,
            retryable: false,
        }
    }
}

impl From<ModelError> for ErrorInfo {
    fn from(e: ModelError) -> Self {
        ErrorInfo {
            code: e.code,
            message: e.message,
        }
    }
}

/// Progress of a call, for live rendering.
#[derive(Debug)]
pub enum ModelProgress<'a> {
    /// New reply text.
    Delta(&'a str),
    /// The attempt failed and will be retried; text streamed so far is void.
    Retry {
        /// Retry number, starting at 1.
        attempt: u32,
        /// Wait before it.
        delay: Duration,
        /// What failed.
        reason: &'a str,
    },
}

/// A finished reply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// The reply text.
    pub text: String,
    /// Tokens, when the server reported them.
    pub usage: Option<Usage>,
    /// Why the model stopped (`stop`, `length`, `tool_calls`, ...).
    pub finish_reason: Option<String>,
    /// The tools it called natively, in order.
    pub tool_calls: Vec<ToolCall>,
    /// The model that answered, as the server named it.
    pub model: Option<String>,
    /// The server's id for the reply.
    pub id: Option<String>,
}

/// The tools offered to the model with a request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolOffer {
    /// Each tool as the chat API takes it (`{"type": "function", "function": {...}}`).
    pub tools: Vec<serde_json::Value>,
    /// The model must call one (`tool_choice: required`).
    pub required: bool,
    /// A server that refuses tools is asked again without them, and never offered them again
    /// (`code_via = auto`), instead of failing.
    pub optional: bool,
}

/// A model that runs inside this process (the embedded provider) instead of behind an API.
pub trait LocalModel: Send + Sync {
    /// Generates the reply to `messages` under `config`'s sampling settings, streaming its
    /// text through `progress`; dropping the future stops the generation.
    fn complete<'a>(
        &'a self,
        messages: &'a [Message],
        tools: Option<&'a ToolOffer>,
        config: &'a ModelConfig,
        progress: &'a mut (dyn FnMut(ModelProgress<'_>) + Send),
    ) -> futures::future::BoxFuture<'a, Result<Completion, ModelError>>;

    /// What to call it in the transcript header and `tandem doctor`.
    fn describe(&self) -> String;

    /// What its engine is doing, when it has one that says.
    fn stats(&self) -> Option<tandem_protocol::engine::EngineStats> {
        None
    }
}

/// How a [`ChatModel`] reaches its model.
#[derive(Clone)]
enum Transport {
    Http(Client<OpenAIConfig>),
    Local(std::sync::Arc<dyn LocalModel>),
}

/// The assistant's chat model: behind an OpenAI-compatible API, or run in this process.
#[derive(Clone)]
pub struct ChatModel {
    transport: Transport,
    config: ModelConfig,
    quirks: std::sync::Arc<Quirks>,
}

/// What a server was found to refuse, learnt once for every clone of a model.
#[derive(Debug, Default)]
struct Quirks {
    /// It answered 400 to `parallel_tool_calls`.
    no_parallel_calls: std::sync::atomic::AtomicBool,
    /// It answered 400 to `tools`.
    no_tools: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for ChatModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatModel")
            .field("location", &self.location())
            .field("model", &self.config.model)
            .finish_non_exhaustive()
    }
}

impl ChatModel {
    /// Whether `config` names a server [`ChatModel::new`] can talk to, without building a
    /// client (which costs milliseconds at a command's start).
    pub fn check(config: &ModelConfig) -> Result<(), ModelError> {
        let url = &config.base_url;
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ModelError {
                code: ErrorCode::InvalidRequest,
                message: format!(
                    "model base URL `{url}` must start with http:// or https:// (for example http://127.0.0.1:8080/v1)"
                ),
                retryable: false,
            });
        }
        Ok(())
    }

    /// Builds the HTTP client; fails only on an unusable URL or TLS setup.
    pub fn new(mut config: ModelConfig) -> Result<Self, ModelError> {
        config.base_url = config.base_url.trim_end_matches('/').to_owned();
        Self::check(&config)?;
        let url = &config.base_url;
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .read_timeout(config.idle_timeout)
            .tls_backend_preconfigured(tls_config(url.starts_with("https://"))?)
            .build()
            .map_err(|e| ModelError {
                code: ErrorCode::Internal,
                message: format!("cannot build the HTTP client: {e}"),
                retryable: false,
            })?;
        // async-openai builds a default reqwest client before ours replaces it, and with
        // `rustls-no-provider` that needs a process-wide provider; installing twice is a no-op.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let openai = OpenAIConfig::new()
            .with_api_base(config.base_url.clone())
            .with_api_key(config.api_key.clone().unwrap_or_default());
        // async-openai retries 429/5xx/connect errors itself, invisibly and a fixed number of
        // times; its plain transport leaves the retry policy (and its events) to `complete`.
        let client = Client::with_config(openai).with_http_service(ReqwestService::new(http));
        Ok(Self {
            transport: Transport::Http(client),
            config,
            quirks: Default::default(),
        })
    }

    /// A chat model run in this process; `config` gives the sampling settings and limits.
    pub fn local(model: std::sync::Arc<dyn LocalModel>, config: ModelConfig) -> Self {
        Self {
            transport: Transport::Local(model),
            config,
            quirks: Default::default(),
        }
    }

    /// Where the model is, for people: the server's URL, or the local model's description.
    pub fn location(&self) -> String {
        match &self.transport {
            Transport::Http(_) => self.config.base_url.clone(),
            Transport::Local(model) => model.describe(),
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Whether the model runs in this process (and so costs nothing per token).
    pub fn is_embedded(&self) -> bool {
        matches!(self.transport, Transport::Local(_))
    }

    /// This model with replies cut at `max_tokens`, or sooner where its own cap is lower.
    pub fn capped(&self, max_tokens: u32) -> Self {
        let mut capped = self.clone();
        capped.config.max_tokens = Some(
            self.config
                .max_tokens
                .map_or(max_tokens, |own| own.min(max_tokens)),
        );
        capped
    }

    /// This model sampling at `temperature` from `seed`.
    pub fn sampled(&self, temperature: f32, seed: u32) -> Self {
        let mut sampled = self.clone();
        sampled.config.temperature = Some(temperature);
        sampled.config.seed = Some(seed);
        sampled
    }

    /// Sends the conversation and returns the reply, retrying transient failures.
    pub async fn complete(
        &self,
        messages: &[Message],
        progress: &mut (dyn FnMut(ModelProgress<'_>) + Send),
    ) -> Result<Completion, ModelError> {
        self.complete_with(messages, None, progress).await
    }

    /// Whether this model's server was found to refuse tools.
    pub fn refuses_tools(&self) -> bool {
        self.quirks.no_tools.load(Ordering::Relaxed)
    }

    /// Sends the conversation with `tools` offered and returns the reply, retrying transient
    /// failures. A 400 to `parallel_tool_calls` is asked again without it, and so is a 400 to
    /// optional tools without them; the server is not offered either again.
    pub async fn complete_with(
        &self,
        messages: &[Message],
        tools: Option<&ToolOffer>,
        progress: &mut (dyn FnMut(ModelProgress<'_>) + Send),
    ) -> Result<Completion, ModelError> {
        let span = self.span(messages);
        let started = std::time::Instant::now();
        let mut first = None;
        let result = {
            let mut timed = |p: ModelProgress<'_>| {
                match &p {
                    ModelProgress::Delta(_) if first.is_none() => {
                        first = Some(started.elapsed());
                    }
                    ModelProgress::Retry { .. } => first = None,
                    ModelProgress::Delta(_) => {}
                }
                progress(p);
            };
            self.complete_traced(messages, tools, &mut timed)
                .instrument(span.clone())
                .await
        };
        // A call the server says nothing of is still spent: counted by estimate, so budgets
        // and costs hold against servers and proxies that send no `usage`.
        let result = result.map(|mut done| {
            if done.usage.is_none() {
                done.usage = Some(estimated_usage(messages, tools, &done));
            }
            done
        });
        match &result {
            Ok(done) => {
                if let Some(ttft) = first {
                    crate::trace::set(&span, "tandem.time_to_first_token", ttft.as_secs_f64());
                }
                self.record(&span, done);
            }
            Err(e) => crate::trace::fail(&span, e.code.as_str(), &e.message),
        }
        result
    }

    /// The span of one call, with what is known before it is made.
    fn span(&self, messages: &[Message]) -> tracing::Span {
        let provider = if self.is_embedded() {
            crate::trace::EMBEDDED
        } else {
            "openai"
        };
        let span = crate::trace::chat(&self.config.model, provider);
        // With no exporter the span records nothing: the rest is not worked out for it.
        if span.is_disabled() {
            return span;
        }
        if let Some(url) = (!self.is_embedded())
            .then(|| reqwest::Url::parse(&self.config.base_url).ok())
            .flatten()
            && let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default())
        {
            crate::trace::set(&span, "server.address", host.to_owned());
            crate::trace::set(&span, "server.port", i64::from(port));
        }
        if let Some(n) = self.config.max_tokens {
            crate::trace::set(&span, "gen_ai.request.max_tokens", i64::from(n));
        }
        if let Some(t) = self.config.temperature {
            crate::trace::set(&span, "gen_ai.request.temperature", f64::from(t));
        }
        if crate::trace::capture_content() {
            crate::trace::set(&span, "gen_ai.input.messages", content_of(messages));
        }
        span
    }

    /// What the reply says about itself, on its span.
    fn record(&self, span: &tracing::Span, done: &Completion) {
        if span.is_disabled() {
            return;
        }
        if let Some(usage) = done.usage {
            if usage.estimated {
                crate::trace::set(span, "tandem.usage.estimated", true);
            }
            let tokens = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
            crate::trace::set(
                span,
                "gen_ai.usage.input_tokens",
                tokens(usage.prompt_tokens),
            );
            crate::trace::set(
                span,
                "gen_ai.usage.output_tokens",
                tokens(usage.completion_tokens),
            );
        }
        crate::trace::set(
            span,
            "gen_ai.response.model",
            done.model
                .clone()
                .unwrap_or_else(|| self.config.model.clone()),
        );
        if let Some(id) = &done.id {
            crate::trace::set(span, "gen_ai.response.id", id.clone());
        }
        if let Some(reason) = &done.finish_reason {
            crate::trace::set_strings(span, "gen_ai.response.finish_reasons", vec![reason.clone()]);
        }
        if crate::trace::capture_content() {
            let reply = [Message::new(
                tandem_protocol::Role::Assistant,
                done.text.clone(),
            )];
            crate::trace::set(span, "gen_ai.output.messages", content_of(&reply));
        }
    }

    async fn complete_traced(
        &self,
        messages: &[Message],
        tools: Option<&ToolOffer>,
        progress: &mut (dyn FnMut(ModelProgress<'_>) + Send),
    ) -> Result<Completion, ModelError> {
        let forced;
        let tools = match tools {
            Some(offer) if self.config.tool_required && !offer.required => {
                forced = ToolOffer {
                    required: true,
                    ..offer.clone()
                };
                Some(&forced)
            }
            other => other,
        };
        let client = match &self.transport {
            Transport::Http(client) => client,
            Transport::Local(model) => {
                return model
                    .complete(messages, tools, &self.config, progress)
                    .await;
            }
        };
        let mut attempt = 0;
        // What this call learnt a server refuses; unlearnt if asking without it fails alike
        // (the 400 was for something else).
        let mut learnt: Vec<&std::sync::atomic::AtomicBool> = Vec::new();
        loop {
            let body = self.request(messages, tools, self.config.stream);
            let result = if self.config.stream {
                self.complete_streaming(client, body.clone(), progress)
                    .await
            } else {
                self.complete_once(client, body.clone()).await
            };
            if let Err(e) = &result
                && e.code == ErrorCode::ModelRequest
            {
                let refused = if body.get("parallel_tool_calls").is_some() {
                    Some((&self.quirks.no_parallel_calls, "parallel_tool_calls"))
                } else if body.get("tools").is_some() && tools.is_some_and(|t| t.optional) {
                    Some((
                        &self.quirks.no_tools,
                        "tools (code_via auto: fenced blocks)",
                    ))
                } else {
                    None
                };
                if let Some((quirk, what)) = refused {
                    tracing::info!(error = %e.message, "the model server refused the request; asking again without {what}");
                    quirk.store(true, Ordering::Relaxed);
                    learnt.push(quirk);
                    continue;
                }
                for quirk in learnt.drain(..) {
                    quirk.store(false, Ordering::Relaxed);
                }
            }
            match result {
                Err(e) if e.retryable && attempt < self.config.max_retries => {
                    attempt += 1;
                    let delay = self.config.retry_base * 2u32.saturating_pow(attempt - 1);
                    // The caller shows the retry (a transcript line, an event): once is enough.
                    tracing::debug!(attempt, ?delay, error = %e.message, "model call failed; retrying");
                    progress(ModelProgress::Retry {
                        attempt,
                        delay,
                        reason: &e.message,
                    });
                    tokio::time::sleep(delay).await;
                }
                other => return other,
            }
        }
    }

    fn request(
        &self,
        messages: &[Message],
        tools: Option<&ToolOffer>,
        stream: bool,
    ) -> serde_json::Value {
        let mut body = json!({
            "model": self.config.model,
            "messages": messages,
            "stream": stream,
        });
        if stream {
            body["stream_options"] = json!({ "include_usage": true });
        }
        if let Some(t) = self.config.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(n) = self.config.max_tokens {
            body["max_tokens"] = json!(n);
        }
        if let Some(seed) = self.config.seed {
            body["seed"] = json!(seed);
        }
        if !self.config.stop.is_empty() {
            body["stop"] = json!(self.config.stop);
        }
        if let Some(offer) = tools.filter(|t| !t.tools.is_empty())
            && !(offer.optional && self.refuses_tools())
        {
            body["tools"] = json!(offer.tools);
            body["tool_choice"] = json!(if offer.required { "required" } else { "auto" });
            if offer.tools.len() > 1 && !self.quirks.no_parallel_calls.load(Ordering::Relaxed) {
                body["parallel_tool_calls"] = json!(true);
            }
        }
        body
    }

    async fn complete_streaming(
        &self,
        client: &Client<OpenAIConfig>,
        body: serde_json::Value,
        progress: &mut (dyn FnMut(ModelProgress<'_>) + Send),
    ) -> Result<Completion, ModelError> {
        let mut stream = client
            .chat()
            .create_stream_byot::<_, Chunk>(body)
            .await
            .map_err(|e| self.classify(e))?;
        let mut done = Completion::default();
        let mut calls = Assembler::default();
        let max = self.config.max_reply_bytes;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.classify(e))?;
            if let Some(u) = chunk.usage {
                done.usage = Some(u.into());
            }
            if done.model.is_none() {
                done.model = chunk.model;
            }
            if done.id.is_none() {
                done.id = chunk.id;
            }
            for choice in chunk.choices {
                let (content, pieces) = choice
                    .delta
                    .map(|d| (d.content, d.tool_calls))
                    .unwrap_or_default();
                for piece in pieces.into_iter().flatten() {
                    calls.push(piece);
                }
                if let Some(text) = content {
                    let text =
                        &text[..text.floor_char_boundary(max.saturating_sub(done.text.len()))];
                    if !text.is_empty() {
                        progress(ModelProgress::Delta(text));
                        done.text.push_str(text);
                    }
                }
                if choice.finish_reason.is_some() {
                    done.finish_reason = choice.finish_reason;
                }
            }
            if done.text.len() + calls.bytes() + 4 > max {
                // Dropping the stream closes the connection: the server stops generating.
                tracing::warn!(
                    bytes = done.text.len(),
                    "the model's reply reached max_reply_bytes; it is cut off there"
                );
                done.finish_reason = Some("length".to_owned());
                break;
            }
        }
        done.tool_calls = calls.finish();
        Ok(done)
    }

    async fn complete_once(
        &self,
        client: &Client<OpenAIConfig>,
        body: serde_json::Value,
    ) -> Result<Completion, ModelError> {
        let reply: Reply = client
            .chat()
            .create_byot(body)
            .await
            .map_err(|e| self.classify(e))?;
        let choice = reply.choices.into_iter().next();
        let mut text = choice
            .as_ref()
            .and_then(|c| c.message.content.clone())
            .unwrap_or_default();
        text.truncate(text.floor_char_boundary(self.config.max_reply_bytes));
        let tool_calls = choice
            .as_ref()
            .map(|c| crate::tools::calls::whole(&c.message.tool_calls))
            .unwrap_or_default();
        Ok(Completion {
            text,
            usage: reply.usage.map(Into::into),
            finish_reason: choice.and_then(|c| c.finish_reason),
            tool_calls,
            model: reply.model,
            id: reply.id,
        })
    }

    /// Turns a client error into one line that names the URL and model and what to check.
    fn classify(&self, e: OpenAIError) -> ModelError {
        let url = &self.config.base_url;
        let model = &self.config.model;
        let (code, retryable, message) = match e {
            // A name that does not resolve will not resolve on a retry either.
            OpenAIError::Reqwest(e) if e.is_connect() && is_dns_failure(&e) => (
                ErrorCode::ModelUnreachable,
                false,
                format!(
                    "cannot resolve the model server's host in {url} ({}); check --base-url or OPENAI_BASE_URL",
                    root_cause(&e)
                ),
            ),
            OpenAIError::Reqwest(e) if e.is_connect() => (
                ErrorCode::ModelUnreachable,
                true,
                format!(
                    "cannot connect to the model server at {url} ({}); is it running? Check --base-url or OPENAI_BASE_URL",
                    root_cause(&e)
                ),
            ),
            OpenAIError::Reqwest(e) if e.is_timeout() => (
                ErrorCode::ModelUnavailable,
                true,
                format!("the model server at {url} did not answer in time (model `{model}`)"),
            ),
            OpenAIError::Reqwest(e) => (
                ErrorCode::ModelUnreachable,
                true,
                format!(
                    "talking to the model server at {url} failed: {}",
                    root_cause(&e)
                ),
            ),
            OpenAIError::ApiError(resp) => {
                let status = resp.status_code.as_u16();
                let detail = one_line(&resp.api_error.message);
                match status {
                    401 | 403 => (
                        ErrorCode::ModelAuth,
                        false,
                        format!(
                            "the model server at {url} rejected the API key ({status}: {detail}); check OPENAI_API_KEY"
                        ),
                    ),
                    404 => (
                        ErrorCode::ModelNotFound,
                        false,
                        format!(
                            "model `{model}` or its endpoint was not found at {url} (404: {detail}); check --model/TANDEM_MODEL and that the base URL ends in /v1"
                        ),
                    ),
                    408 | 409 | 429 | 500..=599 => (
                        ErrorCode::ModelUnavailable,
                        true,
                        format!(
                            "the model server at {url} answered {status} for model `{model}`: {detail}"
                        ),
                    ),
                    _ => (
                        ErrorCode::ModelRequest,
                        false,
                        format!(
                            "the model server at {url} refused the request for model `{model}` ({status}: {detail})"
                        ),
                    ),
                }
            }
            OpenAIError::JSONDeserialize(_, body) => match ollama_style_error(&body) {
                Some(msg) if msg.contains("not found") => (
                    ErrorCode::ModelNotFound,
                    false,
                    format!(
                        "model `{model}` was not found at {url}: {msg}; check --model/TANDEM_MODEL"
                    ),
                ),
                Some(msg) => (
                    ErrorCode::ModelRequest,
                    false,
                    format!(
                        "the model server at {url} refused the request for model `{model}`: {msg}"
                    ),
                ),
                None => (
                    ErrorCode::ModelProtocol,
                    false,
                    format!(
                        "the server at {url} did not answer like an OpenAI-compatible API (got `{}`); check that the base URL ends in /v1",
                        one_line(&body)
                    ),
                ),
            },
            OpenAIError::StreamError(e) => (
                ErrorCode::ModelUnavailable,
                true,
                format!(
                    "the reply stream from {url} broke off: {}",
                    one_line(&e.to_string())
                ),
            ),
            other => (
                ErrorCode::Internal,
                false,
                format!(
                    "calling the model at {url} failed: {}",
                    one_line(&other.to_string())
                ),
            ),
        };
        // The key itself, however the server wrapped it.
        let message = match self.config.api_key.as_deref().filter(|k| k.len() >= 4) {
            Some(key) => message.replace(key, "[redacted]"),
            None => message,
        };
        ModelError {
            code,
            message,
            retryable,
        }
    }
}

/// TLS settings: the system's CA certificates for an `https://` server, none for plain HTTP.
///
/// Loading the CA bundle costs ~100 ms of start-up with OpenSSL, and a local model server on
/// plain HTTP never needs it, so only HTTPS pays (and rustls parses it faster).
pub fn tls_config(https: bool) -> Result<rustls::ClientConfig, ModelError> {
    let fail = |message: String| ModelError {
        code: ErrorCode::Internal,
        message,
        retryable: false,
    };
    let mut roots = rustls::RootCertStore::empty();
    if https {
        let found = rustls_native_certs::load_native_certs();
        for cert in found.certs {
            let _ = roots.add(cert);
        }
        if roots.is_empty() {
            return Err(fail(
                "no CA certificates found for HTTPS; install the ca-certificates package or set SSL_CERT_FILE".to_owned(),
            ));
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| fail(format!("cannot set up TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Whether a connect error is a failed name lookup (hyper's resolver says "dns error").
fn is_dns_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if text.contains("dns error") || text.contains("failed to lookup address") {
            return true;
        }
        cur = err.source();
    }
    false
}

/// The innermost cause, which for reqwest is the useful part ("Connection refused").
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    one_line(&cur.to_string())
}

/// What a server said, as one line of at most 200 characters with anything that looks like
/// a credential replaced: it is stored with the task and shown to API clients, and a server
/// (or a proxy before it) may echo the request's headers into its error.
fn one_line(s: &str) -> String {
    let flat = s.split_whitespace().collect::<Vec<_>>().join(" ");
    // Scrubbed whole, before the cut, so that no prefix of a key survives at the edge.
    let flat = scrub_credentials(&flat);
    match flat.char_indices().nth(200) {
        Some((at, _)) => format!("{}…", &flat[..at]),
        None => flat,
    }
}

/// `text` with bearer tokens, `sk-` keys and the values of key-, token-, secret-, password-
/// and authorization-named fields replaced by `[redacted]`.
fn scrub_credentials(text: &str) -> String {
    static PATTERNS: std::sync::LazyLock<Vec<(regex::Regex, &'static str)>> =
        std::sync::LazyLock::new(|| {
            [
                (r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=:-]{4,}", "$1 [redacted]"),
                (
                    r#"(?i)([A-Za-z0-9_-]*(?:authorization|api[-_ ]?key|token|secret|password|passwd|credential)[A-Za-z0-9_-]*["']?\s*[:=]\s*["']?)(?:bearer\s+|basic\s+)?[^\s"',;}&]{4,}"#,
                    "${1}[redacted]",
                ),
                (r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{8,}", "[redacted]"),
            ]
            .into_iter()
            .filter_map(|(pattern, with)| regex::Regex::new(pattern).ok().map(|r| (r, with)))
            .collect()
        });
    let mut out = text.to_owned();
    for (pattern, with) in PATTERNS.iter() {
        out = pattern.replace_all(&out, *with).into_owned();
    }
    out
}

/// Ollama and some proxies answer `{"error": "text"}` instead of an error object.
fn ollama_style_error(body: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct E {
        error: String,
    }
    serde_json::from_str::<E>(body)
        .ok()
        .map(|e| one_line(&e.error))
}

// Lenient wire types: servers differ in which fields they send, and we need only these.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    id: Option<String>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<crate::tools::calls::Piece>>,
}

#[derive(Deserialize)]
struct Reply {
    #[serde(default)]
    choices: Vec<ReplyChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    id: Option<String>,
}

#[derive(Deserialize)]
struct ReplyChoice {
    message: ReplyMessage,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct ReplyMessage {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<crate::tools::calls::WholeCall>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            estimated: false,
        }
    }
}

/// The usage of a call whose answer carried none, estimated from its bytes
/// ([`crate::budget::estimate`]): the prompt is the messages' text, names and calls and the
/// tools offered; the reply its text and calls.
fn estimated_usage(messages: &[Message], tools: Option<&ToolOffer>, done: &Completion) -> Usage {
    let calls = |calls: &[ToolCall]| -> usize {
        calls.iter().map(|c| c.name.len() + c.arguments.len()).sum()
    };
    let sent: usize = messages
        .iter()
        .map(|m| m.content.len() + m.name.as_ref().map_or(0, String::len) + calls(&m.tool_calls))
        .sum::<usize>()
        + tools.map_or(0, |t| {
            t.tools
                .iter()
                .map(|tool| tool.to_string().len())
                .sum::<usize>()
        });
    crate::budget::estimate(sent, done.text.len() + calls(&done.tool_calls))
}

/// Messages in the conventions' shape (`role` and text `parts`), as one JSON string.
fn content_of(messages: &[Message]) -> String {
    let shaped: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| json!({"role": m.role, "parts": [{"type": "text", "content": m.content}]}))
        .collect();
    serde_json::Value::Array(shaped).to_string()
}
