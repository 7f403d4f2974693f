//! The embedded model: a GGUF file loaded once (memory-mapped) and run by llama.cpp on a
//! worker thread of its own, which serves every request at once. Each request is the chat
//! rendered with the model's own template; the reply streams back as text. Each
//! conversation keeps its own sequence in one shared KV cache, so a turn reads only its new
//! tokens whatever else runs, and the replies being generated advance together, one batch
//! per step (see `engine`).

mod chat;
mod draft;
mod engine;
mod reply;
mod seq;

pub use chat::{DEFAULT_MAX_TOKENS, DEFAULT_SEED, EmbeddedChat};
pub use tandem_protocol::engine::EngineStats;

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaChatMessage, LlamaModel};
use llama_cpp_2::token::LlamaToken;
use tokio::sync::mpsc as async_mpsc;

/// How the model runs.
#[derive(Clone, Debug)]
pub struct EmbeddedConfig {
    /// CPU threads for prompt processing and generation.
    pub threads: i32,
    /// Context window in tokens: the most one conversation holds, prompt and reply together.
    pub context_tokens: u32,
    /// Tokens the KV cache holds over every conversation (at least `context_tokens`); its
    /// memory is set aside at load.
    pub cache_tokens: u32,
    /// Tokens decoded per batch.
    pub batch_tokens: u32,
    /// Most replies generated at once; more wait their turn, first come first served.
    pub parallel: u32,
    /// Conversations the cache keeps, live or idle.
    pub sequences: u32,
    /// A smaller model of the same vocabulary that guesses tokens for this one to check
    /// (speculative decoding); the replies are the same with it or without.
    pub draft: Option<PathBuf>,
    /// Most tokens the draft guesses for a reply in one step.
    pub draft_tokens: u32,
}

impl EmbeddedConfig {
    /// Defaults for a machine with `cores` CPU cores.
    pub fn for_cores(cores: usize) -> Self {
        Self {
            threads: i32::try_from(cores.clamp(1, 8)).unwrap_or(1),
            context_tokens: 8192,
            cache_tokens: 16384,
            batch_tokens: 512,
            parallel: 8,
            sequences: 32,
            draft: None,
            draft_tokens: 4,
        }
    }
}

/// One request: a chat and how to sample the reply.
#[derive(Clone, Debug)]
pub struct Generate {
    /// The chat as the OpenAI API shapes it (`role`, `content`, `tool_calls`,
    /// `tool_call_id`), the system message first.
    pub messages: Vec<serde_json::Value>,
    /// Functions offered (`{"type": "function", "function": {...}}`), given to the template.
    pub tools: Vec<serde_json::Value>,
    /// How a call must look, when one is to be constrained: [`tool_grammar`]'s grammar, and
    /// whether the reply must be one (`tool_choice: required`) or may start one at
    /// `<tool_call>`.
    pub grammar: Option<(String, bool)>,
    /// Most tokens of reply.
    pub max_tokens: u32,
    /// 0 (or less) samples greedily; above that, with this temperature.
    pub temperature: f32,
    /// The sampler's seed: the same seed, model and chat give the same reply.
    pub seed: u32,
    /// The reply ends before any of these (which is not part of it).
    pub stop: Vec<String>,
}

/// Why a reply ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model ended its turn, or a stop string came.
    Stop,
    /// `max_tokens` or the context window was reached.
    Length,
}

/// What the worker sends back for a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// More reply text.
    Text(String),
    /// The reply is complete.
    Done {
        /// Why it ended.
        finish: Finish,
        /// Tokens in the prompt.
        prompt_tokens: u32,
        /// Tokens of the prompt found in the cache (of an earlier turn, or a prefix another
        /// conversation shares).
        cached_tokens: u32,
        /// Tokens generated.
        completion_tokens: u32,
    },
    /// The request failed; the text says why.
    Failed(String),
}

/// A model that could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// The file is not there.
    #[error("no model file at {0}; `tandem model pull` downloads one")]
    Missing(PathBuf),
    /// llama.cpp refused the file or the context.
    #[error("cannot load the model {path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// llama.cpp's reason.
        reason: String,
    },
    /// The worker thread is gone.
    #[error("the embedded model's worker stopped")]
    Stopped,
}

/// llama.cpp's process-wide state, made once.
fn backend() -> Result<&'static LlamaBackend, String> {
    static BACKEND: OnceLock<Result<LlamaBackend, String>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            // llama.cpp logs every tensor it loads to stderr; Tandem's own log says what matters.
            llama_cpp_2::send_logs_to_tracing(
                llama_cpp_2::LogOptions::default().with_logs_enabled(false),
            );
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// A request with its prompt's tokens, as the worker takes it.
struct Job {
    tokens: Vec<LlamaToken>,
    request: Generate,
    events: async_mpsc::UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
}

/// A loaded model and its worker; cheap to share (`Arc`), dropped when the last user goes.
pub struct Embedded {
    model: Arc<LlamaModel>,
    path: PathBuf,
    jobs: mpsc::Sender<Job>,
    load_time: Duration,
    window: usize,
    stats: Arc<Mutex<EngineStats>>,
    /// Read when the figures are: an idle engine's rates fall to zero.
    rates: Mutex<Rates>,
    draft: Option<PathBuf>,
}

impl std::fmt::Debug for Embedded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedded")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Cancels its request when dropped: a caller that stops waiting stops the generation.
#[derive(Debug)]
pub struct Reply {
    /// The request's events, ending with `Done` or `Failed`.
    pub events: async_mpsc::UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl Drop for Reply {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Embedded {
    /// Loads `path` (memory-mapped, so a second process or a reload reads it from the page
    /// cache) and starts the worker. Blocks while loading: call it off the async runtime.
    pub fn load(path: &Path, config: EmbeddedConfig) -> Result<Arc<Self>, EmbeddedError> {
        if !path.is_file() {
            return Err(EmbeddedError::Missing(path.to_owned()));
        }
        let fail = |reason: String| EmbeddedError::Load {
            path: path.to_owned(),
            reason,
        };
        let started = Instant::now();
        let backend = backend().map_err(&fail)?;
        let model = Arc::new(
            LlamaModel::load_from_file(backend, path, &LlamaModelParams::default())
                .map_err(|e| fail(e.to_string()))?,
        );
        let draft = match &config.draft {
            None => None,
            Some(draft_path) => Some(Arc::new(load_draft(backend, &model, draft_path)?)),
        };
        let shared = model.clone();
        let shared_draft = draft.clone();
        let draft_path = config.draft.clone();
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let window = config.context_tokens.max(256);
        let stats = Arc::new(Mutex::new(EngineStats {
            cache_tokens: config.cache_tokens.max(window).into(),
            draft: draft.is_some(),
            ..EngineStats::default()
        }));
        let engine_stats = stats.clone();
        std::thread::Builder::new()
            .name("tandem-model".to_owned())
            .spawn(move || {
                let models = (shared.as_ref(), shared_draft.as_deref());
                worker(backend, models, &config, &rx, &ready_tx, engine_stats);
            })
            .map_err(|e| fail(format!("cannot start its thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(reason)) => return Err(fail(reason)),
            Err(_) => return Err(EmbeddedError::Stopped),
        }
        Ok(Arc::new(Self {
            model,
            path: path.to_owned(),
            jobs,
            load_time: started.elapsed(),
            window: window as usize,
            stats,
            rates: Mutex::new(Rates::new()),
            draft: draft_path,
        }))
    }

    /// What the engine is doing now.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats.lock().map(|s| s.clone()).unwrap_or_default();
        if let Ok(mut rates) = self.rates.lock() {
            (s.read_per_second, s.generated_per_second) =
                rates.update(s.prompt_tokens_read, s.tokens_generated);
        }
        s
    }

    /// The model file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The draft model's file, when one guesses tokens for this one.
    pub fn draft(&self) -> Option<&Path> {
        self.draft.as_deref()
    }

    /// How long loading took.
    pub fn load_time(&self) -> Duration {
        self.load_time
    }

    /// The prompt the model is given for `messages`: the chat rendered with the model's own
    /// template (from the GGUF file), ending where the assistant's reply begins.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: &[serde_json::Value],
    ) -> Result<String, String> {
        render(&self.model, messages, tools)
    }

    /// Queues a request; its events arrive on the reply, which cancels it when dropped. A
    /// chat that cannot be rendered, or is longer than the window, fails at once.
    pub fn generate(&self, request: Generate) -> Result<Reply, EmbeddedError> {
        let (events, rx) = async_mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let reply = Reply {
            events: rx,
            cancel: cancel.clone(),
        };
        let tokens = match self.tokens(&request) {
            Ok(tokens) => tokens,
            Err(reason) => {
                let _ = events.send(Event::Failed(reason));
                return Ok(reply);
            }
        };
        self.jobs
            .send(Job {
                tokens,
                request,
                events,
                cancel,
            })
            .map_err(|_| EmbeddedError::Stopped)?;
        Ok(reply)
    }

    /// The prompt's tokens, when it fits the window with room for a reply.
    fn tokens(&self, request: &Generate) -> Result<Vec<LlamaToken>, String> {
        let text = render(&self.model, &request.messages, &request.tools)?;
        let tokens = self.model.vocab().tokenize(text.as_bytes(), true, true);
        if tokens.is_empty() || tokens.len() + 1 >= self.window {
            return Err(format!(
                "the conversation is {} tokens, over the model's context window of {}; start a new task or raise [model] context_tokens",
                tokens.len(),
                self.window
            ));
        }
        Ok(tokens)
    }
}

/// The draft model at `path`, when its vocabulary is the main model's.
fn load_draft(
    backend: &'static LlamaBackend,
    main: &LlamaModel,
    path: &Path,
) -> Result<LlamaModel, EmbeddedError> {
    if !path.is_file() {
        return Err(EmbeddedError::Missing(path.to_owned()));
    }
    let fail = |reason: String| EmbeddedError::Load {
        path: path.to_owned(),
        reason,
    };
    let draft = LlamaModel::load_from_file(backend, path, &LlamaModelParams::default())
        .map_err(|e| fail(e.to_string()))?;
    let (a, b) = (main.vocab(), draft.vocab());
    if main.n_vocab() != draft.n_vocab() || a.eos() != b.eos() || a.bos() != b.bos() {
        return Err(fail(format!(
            "as a draft it must have the main model's vocabulary ({} tokens), and it has {}; pull a smaller model of the same family",
            main.n_vocab(),
            draft.n_vocab()
        )));
    }
    Ok(draft)
}

fn worker(
    backend: &'static LlamaBackend,
    (model, draft): (&LlamaModel, Option<&LlamaModel>),
    config: &EmbeddedConfig,
    jobs: &mpsc::Receiver<Job>,
    ready: &mpsc::Sender<Result<(), String>>,
    stats: Arc<Mutex<EngineStats>>,
) {
    let window = config.context_tokens.max(256);
    let cache = config.cache_tokens.max(window);
    let batch = config.batch_tokens.max(32);
    let sequences = config.sequences.clamp(1, 256);
    let ctx = match model.new_context(backend, params_for(config, cache, batch, sequences)) {
        Ok(ctx) => ctx,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot make a context: {e}")));
            return;
        }
    };
    let drafter = match draft {
        None => None,
        Some(draft) => {
            match draft.new_context(backend, params_for(config, cache, batch, sequences)) {
                Ok(dctx) => Some(draft::Drafter::new(
                    draft,
                    dctx,
                    sequences as usize,
                    batch as usize,
                )),
                Err(e) => {
                    let _ = ready.send(Err(format!("cannot make the draft model's context: {e}")));
                    return;
                }
            }
        }
    };
    let _ = ready.send(Ok(()));
    let sizes = engine::Sizes {
        sequences: sequences as usize,
        parallel: config.parallel.max(1) as usize,
        batch_tokens: batch as usize,
        window: window as usize,
        cache_tokens: cache as usize,
        draft_tokens: config.draft_tokens as usize,
    };
    engine::Engine::new(model, ctx, &sizes, stats, drafter).run(jobs);
}

/// One cache for every sequence (unified), so a conversation may grow to the whole window
/// whatever the others hold, and a shared prefix is held once.
fn params_for(
    config: &EmbeddedConfig,
    cache: u32,
    batch: u32,
    sequences: u32,
) -> LlamaContextParams {
    LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(cache))
        .with_n_batch(batch)
        .with_n_ubatch(batch)
        .with_n_seq_max(sequences)
        .with_kv_unified(true)
        .with_n_threads(config.threads)
        .with_n_threads_batch(config.threads)
}

/// The chat rendered as the model was trained to read it: the GGUF's own Jinja template,
/// with the tools; where the template cannot be rendered, llama.cpp's built-in rendering of
/// its family (which knows no tools).
fn render(
    model: &LlamaModel,
    messages: &[serde_json::Value],
    tools: &[serde_json::Value],
) -> Result<String, String> {
    let template = model
        .chat_template(None)
        .map_err(|e| format!("the model has no chat template: {e}"))?;
    let jinja = template.to_string().unwrap_or_default();
    let vocab = model.vocab();
    let special = |t| String::from_utf8_lossy(&vocab.token_to_piece(t, true, None)).into_owned();
    match render_jinja(
        &jinja,
        messages,
        tools,
        &special(vocab.bos()),
        &special(vocab.eos()),
    ) {
        Ok(text) => return Ok(text),
        Err(e) => {
            tracing::warn!(error = %e, "the model's chat template did not render; using llama.cpp's built-in one")
        }
    }
    let chat = messages
        .iter()
        .map(|m| {
            let role = match m["role"].as_str().unwrap_or("user") {
                "tool" => "user",
                other => other,
            };
            LlamaChatMessage::new(
                role.to_owned(),
                m["content"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("a message cannot be passed to the model: {e}"))?;
    model
        .apply_chat_template(&template, &chat, true)
        .map_err(|e| format!("cannot render the chat: {e}"))
}

/// Renders a Hugging Face chat template (`template`) as `transformers` does: `messages`,
/// `tools` (when any), `add_generation_prompt`, the BOS and EOS tokens, and
/// `raise_exception`; Python's string methods work as templates expect.
pub fn render_jinja(
    template: &str,
    messages: &[serde_json::Value],
    tools: &[serde_json::Value],
    bos: &str,
    eos: &str,
) -> Result<String, String> {
    let mut env = minijinja::Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                message,
            ))
        },
    );
    // As `transformers` renders it (Python's json.dumps): `, ` and `: ` between items, the
    // shape the model saw its calls in when it was trained.
    env.add_filter(
        "tojson",
        |value: minijinja::Value| -> Result<minijinja::Value, minijinja::Error> {
            let json = serde_json::to_value(&value).map_err(|e| {
                minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
            })?;
            Ok(minijinja::Value::from_safe_string(python_json(&json)))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| format!("the chat template does not parse: {e}"))?;
    let tmpl = env.get_template("chat").map_err(|e| e.to_string())?;
    let tools = (!tools.is_empty()).then_some(tools);
    tmpl.render(minijinja::context! {
        messages => messages,
        tools => tools,
        add_generation_prompt => true,
        bos_token => bos,
        eos_token => eos,
    })
    .map_err(|e| format!("the chat template failed: {e}"))
}

/// `value` with the separators Python's `json.dumps` writes by default: `, ` and `: `.
fn python_json(value: &serde_json::Value) -> String {
    struct Spaced;
    fn between<W: ?Sized + std::io::Write>(w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    impl serde_json::ser::Formatter for Spaced {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            between(w, first)
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            between(w, first)
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Spaced);
    if serde::Serialize::serialize(value, &mut ser).is_err() {
        return value.to_string();
    }
    String::from_utf8(out).unwrap_or_else(|_| value.to_string())
}

/// A grammar (GBNF, root `root`) that lets the model write exactly one call of one of
/// `tools` (`{"type": "function", "function": {name, parameters}}`) as Qwen and Hermes
/// models write them: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, its
/// arguments held to the tool's schema by llama.cpp's JSON-Schema-to-grammar.
pub fn tool_grammar(tools: &[serde_json::Value]) -> Result<String, String> {
    for (i, t) in tools.iter().enumerate() {
        if let Some(parameters) = t["function"].get("parameters") {
            tandem_agent::schema::bounded(parameters)
                .map_err(|e| format!("tools[{i}].function.parameters {e}"))?;
        }
    }
    let choices: Vec<serde_json::Value> = tools
        .iter()
        .map(|t| {
            let f = &t["function"];
            let parameters = match &f["parameters"] {
                serde_json::Value::Null => serde_json::json!({"type": "object"}),
                p => p.clone(),
            };
            serde_json::json!({
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = if let [one] = choices.as_slice() {
        one.clone()
    } else {
        serde_json::json!({"oneOf": choices})
    };
    let gbnf = grammar_of(schema.to_string())?;
    let renamed: Vec<String> = gbnf
        .lines()
        .map(|line| match line.strip_prefix("root ::=") {
            Some(rest) => format!("tool-call-json ::={rest}"),
            None => line.to_owned(),
        })
        .collect();
    Ok(format!(
        "root ::= \"<tool_call>\\n\" tool-call-json \"\\n</tool_call>\"\n{}\n",
        renamed.join("\n")
    ))
}

/// The stack llama.cpp's JSON-Schema-to-grammar runs on: it recurses with the schema.
const GRAMMAR_STACK: usize = 64 << 20;
/// Longest making one grammar may take; the schema's bounds keep it far below.
const GRAMMAR_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// `schema` (JSON text) as GBNF, made on a thread of its own with a large stack, given up
/// past the deadline (the thread then ends on its own: its input is bounded).
fn grammar_of(schema: String) -> Result<String, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("tool-grammar".to_owned())
        .stack_size(GRAMMAR_STACK)
        .spawn(move || {
            let _ =
                tx.send(llama_cpp_2::json_schema_to_grammar(&schema).map_err(|e| e.to_string()));
        })
        .map_err(|e| format!("the tools' grammar could not be made: {e}"))?;
    match rx.recv_timeout(GRAMMAR_DEADLINE) {
        Ok(made) => {
            made.map_err(|e| format!("the tools' parameters cannot be made a grammar: {e}"))
        }
        Err(_) => Err(format!(
            "the tools' parameters could not be made a grammar within {} s; send simpler schemas",
            GRAMMAR_DEADLINE.as_secs()
        )),
    }
}

/// Tokens per second over the last few seconds, from the running totals.
pub(crate) struct Rates {
    marks: VecDeque<(Instant, u64, u64)>,
}

impl Rates {
    const WINDOW_SECS: f64 = 10.0;

    pub(crate) fn new() -> Self {
        Self {
            marks: VecDeque::new(),
        }
    }

    pub(crate) fn update(&mut self, read: u64, generated: u64) -> (f64, f64) {
        let now = Instant::now();
        if self
            .marks
            .back()
            .is_none_or(|m| now.duration_since(m.0).as_secs_f64() >= 0.5)
        {
            self.marks.push_back((now, read, generated));
        }
        while self.marks.len() > 2
            && now.duration_since(self.marks[0].0).as_secs_f64() > Self::WINDOW_SECS
        {
            self.marks.pop_front();
        }
        let Some(&(then, r0, g0)) = self.marks.front() else {
            return (0.0, 0.0);
        };
        let secs = now.duration_since(then).as_secs_f64();
        if secs <= 0.0 {
            return (0.0, 0.0);
        }
        ((read - r0) as f64 / secs, (generated - g0) as f64 / secs)
    }
}
