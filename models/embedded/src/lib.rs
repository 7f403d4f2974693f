//! The embedded model: a GGUF file loaded once (memory-mapped) and run by llama.cpp on a
//! worker thread of its own, which serves one request at a time in arrival order. Each
//! request is the chat rendered with the model's own template; the reply streams back as
//! text. The worker keeps the last prompt's KV cache, so a conversation that grows by a turn
//! only pays for the new tokens.

mod chat;

pub use chat::{DEFAULT_MAX_TOKENS, DEFAULT_SEED, EmbeddedChat};

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::time::{Duration, Instant};

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaChatMessage, LlamaModel};
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use tokio::sync::mpsc as async_mpsc;

/// How the model runs.
#[derive(Clone, Debug)]
pub struct EmbeddedConfig {
    /// CPU threads for prompt processing and generation.
    pub threads: i32,
    /// Context window in tokens (prompt and reply together).
    pub context_tokens: u32,
    /// Tokens decoded per batch while reading a prompt.
    pub batch_tokens: u32,
}

impl EmbeddedConfig {
    /// Defaults for a machine with `cores` CPU cores.
    pub fn for_cores(cores: usize) -> Self {
        Self {
            threads: i32::try_from(cores.clamp(1, 8)).unwrap_or(1),
            context_tokens: 8192,
            batch_tokens: 512,
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
        /// Tokens of the prompt read from the cache of the previous request.
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

struct Job {
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
        let shared = model.clone();
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("tandem-model".to_owned())
            .spawn(move || worker(backend, &shared, config, rx, ready_tx))
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
        }))
    }

    /// The model file.
    pub fn path(&self) -> &Path {
        &self.path
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

    /// Queues a request; its events arrive on the reply, which cancels it when dropped.
    pub fn generate(&self, request: Generate) -> Result<Reply, EmbeddedError> {
        let (events, rx) = async_mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        self.jobs
            .send(Job {
                request,
                events,
                cancel: cancel.clone(),
            })
            .map_err(|_| EmbeddedError::Stopped)?;
        Ok(Reply { events: rx, cancel })
    }
}

fn worker(
    backend: &'static LlamaBackend,
    model: &LlamaModel,
    config: EmbeddedConfig,
    jobs: mpsc::Receiver<Job>,
    ready: mpsc::Sender<Result<(), String>>,
) {
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(config.context_tokens.max(256)))
        .with_n_batch(config.batch_tokens.max(32))
        .with_n_ubatch(config.batch_tokens.max(32))
        .with_n_threads(config.threads)
        .with_n_threads_batch(config.threads);
    let ctx = match model.new_context(backend, params) {
        Ok(ctx) => ctx,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot make a context: {e}")));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut state = Worker {
        model,
        ctx,
        cached: Vec::new(),
        batch_tokens: config.batch_tokens.max(32) as usize,
    };
    while let Ok(job) = jobs.recv() {
        if job.cancel.load(Ordering::Relaxed) {
            continue;
        }
        let done = state.run(&job);
        let _ = job.events.send(match done {
            Ok(done) => done,
            Err(reason) => Event::Failed(reason),
        });
    }
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
    let gbnf = llama_cpp_2::json_schema_to_grammar(&schema.to_string())
        .map_err(|e| format!("the tools' parameters cannot be made a grammar: {e}"))?;
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

struct Worker<'m> {
    model: &'m LlamaModel,
    ctx: LlamaContext<'m>,
    /// The tokens whose keys and values are in the context's cache, in order.
    cached: Vec<LlamaToken>,
    batch_tokens: usize,
}

impl Worker<'_> {
    fn run(&mut self, job: &Job) -> Result<Event, String> {
        let r = &job.request;
        let text = render(self.model, &r.messages, &r.tools)?;
        let vocab = self.model.vocab();
        let tokens = vocab.tokenize(text.as_bytes(), true, true);
        let window = self.ctx.n_ctx() as usize;
        if tokens.is_empty() || tokens.len() + 1 >= window {
            return Err(format!(
                "the conversation is {} tokens, over the model's context window of {window}; start a new task or raise [model] context_tokens",
                tokens.len()
            ));
        }
        // Reuse the cache for the prefix this prompt shares with the last one; at least the
        // last token is decoded again, for its logits.
        let mut keep = self
            .cached
            .iter()
            .zip(&tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(tokens.len() - 1);
        if !self
            .ctx
            .clear_kv_cache_seq(Some(0), u32::try_from(keep).ok(), None)
            .unwrap_or(false)
        {
            self.ctx.clear_kv_cache();
            keep = 0;
        }
        self.cached.truncate(keep);
        let mut batch = LlamaBatch::new(self.batch_tokens, 1);
        let mut pos = keep;
        for chunk in tokens[keep..].chunks(self.batch_tokens) {
            if job.cancel.load(Ordering::Relaxed) {
                return Err("cancelled".to_owned());
            }
            batch.clear();
            for (i, t) in chunk.iter().enumerate() {
                let last = pos + i == tokens.len() - 1;
                batch
                    .add(*t, (pos + i) as i32, &[0], last)
                    .map_err(|e| e.to_string())?;
            }
            self.ctx
                .decode(&mut batch)
                .map_err(|e| format!("llama.cpp failed reading the prompt: {e}"))?;
            self.cached.extend_from_slice(chunk);
            pos += chunk.len();
        }
        let mut grammar = match &r.grammar {
            Some((gbnf, true)) => Some(LlamaSampler::grammar(self.model, gbnf, "root")),
            Some((gbnf, false)) => Some(LlamaSampler::grammar_lazy(
                self.model,
                gbnf,
                "root",
                ["<tool_call>"],
                &[],
            )),
            None => None,
        }
        .transpose()
        .map_err(|e| format!("the tool call grammar does not load: {e}"))?;
        let mut chain = Vec::new();
        if r.temperature > 0.0 {
            chain.extend([
                LlamaSampler::top_k(40),
                LlamaSampler::top_p(0.95, 1),
                LlamaSampler::temp(r.temperature),
                LlamaSampler::dist(r.seed),
            ]);
        } else {
            chain.push(LlamaSampler::greedy());
        }
        let mut sampler = LlamaSampler::chain_simple(chain);
        let mut decoder = encoding_rs::UTF_8.new_decoder();
        let mut reply = String::new();
        let mut sent = 0;
        let mut piece = Vec::new();
        let mut generated = 0u32;
        let longest_stop = r.stop.iter().map(String::len).max().unwrap_or(0);
        let finish = loop {
            if job.cancel.load(Ordering::Relaxed) || job.events.is_closed() {
                return Err("cancelled".to_owned());
            }
            if generated >= r.max_tokens || pos + 1 >= window {
                break Finish::Length;
            }
            let at = batch.n_tokens() - 1;
            let mut token = sampler.sample(&self.ctx, at);
            if let Some(grammar) = grammar.as_mut() {
                // As llama.cpp's own sampler does: the grammar judges the token chosen, and
                // only when it refuses is the whole vocabulary (150k tokens) put through it.
                let mut one =
                    LlamaTokenDataArray::new(vec![LlamaTokenData::new(token, 0.0, 0.0)], false);
                grammar.apply(&mut one);
                if one
                    .data
                    .first()
                    .is_none_or(|d| d.logit() == f32::NEG_INFINITY)
                {
                    let mut all = self.ctx.token_data_array_ith(at);
                    grammar.apply(&mut all);
                    all.apply_sampler(&mut sampler);
                    token = all.selected_token().unwrap_or(token);
                }
                grammar.accept(token);
            }
            if vocab.is_eog(token) {
                break Finish::Stop;
            }
            generated += 1;
            piece.clear();
            vocab.token_to_piece_into(token, &mut piece, false, None);
            // encoding_rs writes only into spare capacity; a split character waits in it.
            reply.reserve(
                decoder
                    .max_utf8_buffer_length(piece.len())
                    .unwrap_or(piece.len() * 3 + 4),
            );
            let before = reply.len();
            let _ = decoder.decode_to_string(&piece, &mut reply, false);
            // A stop string that is new ends in this piece: only the tail is searched.
            let tail = reply.floor_char_boundary(before.saturating_sub(longest_stop));
            if let Some(at) = r
                .stop
                .iter()
                .filter_map(|s| reply[tail..].find(s.as_str()))
                .min()
            {
                reply.truncate(tail + at);
                break Finish::Stop;
            }
            // Hold back what could still become a stop string.
            let safe = reply.floor_char_boundary(reply.len().saturating_sub(longest_stop));
            if safe > sent {
                let _ = job.events.send(Event::Text(reply[sent..safe].to_owned()));
                sent = safe;
            }
            batch.clear();
            batch
                .add(token, pos as i32, &[0], true)
                .map_err(|e| e.to_string())?;
            self.ctx
                .decode(&mut batch)
                .map_err(|e| format!("llama.cpp failed generating: {e}"))?;
            self.cached.push(token);
            pos += 1;
        };
        if reply.len() > sent {
            let _ = job.events.send(Event::Text(reply[sent..].to_owned()));
        }
        Ok(Event::Done {
            finish,
            prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            cached_tokens: u32::try_from(keep).unwrap_or(u32::MAX),
            completion_tokens: generated,
        })
    }
}
