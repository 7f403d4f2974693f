//! One reply as it is generated: its own sampler and grammar, the text it has sent, and where
//! a stop string ends it. Nothing here is shared between sequences, so what one reply
//! samples never depends on what else runs.

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use tokio::sync::mpsc::UnboundedSender;

use crate::{Event, Finish, Generate};

/// What came of one sampled token.
pub(crate) enum Next {
    /// The reply goes on with this token, which is to be decoded next.
    Token(LlamaToken),
    /// The reply is complete.
    Done(Finish),
    /// The reply cannot go on; the text says why. Other replies are not affected.
    Failed(String),
}

/// Longest the grammar may take over one token. A grammar whose readings multiply doubles
/// its work with each bracket; past this the reply fails alone, so the engine, which steps
/// every sequence together, never waits long on one sequence's grammar.
const GRAMMAR_STEP_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A reply being generated.
pub(crate) struct ReplyState {
    sampler: LlamaSampler,
    grammar: Option<LlamaSampler>,
    decoder: encoding_rs::Decoder,
    text: String,
    sent: usize,
    piece: Vec<u8>,
    /// Tokens generated so far.
    pub(crate) generated: u32,
    longest_stop: usize,
}

impl ReplyState {
    /// A reply to `request`: greedy at temperature 0, else seeded sampling; the request's
    /// grammar loaded.
    pub(crate) fn new(model: &LlamaModel, request: &Generate) -> Result<Self, String> {
        let grammar = match &request.grammar {
            Some((gbnf, true)) => Some(LlamaSampler::grammar(model, gbnf, "root")),
            Some((gbnf, false)) => Some(LlamaSampler::grammar_lazy(
                model,
                gbnf,
                "root",
                ["<tool_call>"],
                &[],
            )),
            None => None,
        }
        .transpose()
        .map_err(|e| format!("the tool call grammar does not load: {e}"))?;
        let chain = if request.temperature > 0.0 {
            vec![
                LlamaSampler::top_k(40),
                LlamaSampler::top_p(0.95, 1),
                LlamaSampler::temp(request.temperature),
                LlamaSampler::dist(request.seed),
            ]
        } else {
            vec![LlamaSampler::greedy()]
        };
        Ok(Self {
            sampler: LlamaSampler::chain_simple(chain),
            grammar,
            decoder: encoding_rs::UTF_8.new_decoder(),
            text: String::new(),
            sent: 0,
            piece: Vec::new(),
            generated: 0,
            longest_stop: request.stop.iter().map(String::len).max().unwrap_or(0),
        })
    }

    /// Samples from the logits at batch index `at`, sends the text that can no longer become
    /// a stop string, and says whether the reply goes on. `room` is false when the reply may
    /// not grow (its `max_tokens` or the context window is reached).
    pub(crate) fn next(
        &mut self,
        model: &LlamaModel,
        ctx: &LlamaContext<'_>,
        at: i32,
        request: &Generate,
        events: &UnboundedSender<Event>,
        room: bool,
    ) -> Next {
        if self.generated >= request.max_tokens || !room {
            return Next::Done(Finish::Length);
        }
        let mut token = self.sampler.sample(ctx, at);
        if let Some(grammar) = self.grammar.as_mut() {
            let started = std::time::Instant::now();
            // As llama.cpp's own sampler does: the grammar judges the token chosen, and only
            // when it refuses is the whole vocabulary (150k tokens) put through it.
            let mut one =
                LlamaTokenDataArray::new(vec![LlamaTokenData::new(token, 0.0, 0.0)], false);
            grammar.apply(&mut one);
            if one
                .data
                .first()
                .is_none_or(|d| d.logit() == f32::NEG_INFINITY)
            {
                let mut all = ctx.token_data_array_ith(at);
                grammar.apply(&mut all);
                all.apply_sampler(&mut self.sampler);
                token = all.selected_token().unwrap_or(token);
            }
            grammar.accept(token);
            if started.elapsed() > GRAMMAR_STEP_LIMIT {
                return Next::Failed(format!(
                    "the tool call grammar took {:.1} s over one token (the limit is {} s): the tools' schemas nest alternatives too deeply; send simpler ones",
                    started.elapsed().as_secs_f64(),
                    GRAMMAR_STEP_LIMIT.as_secs()
                ));
            }
        }
        let vocab = model.vocab();
        if vocab.is_eog(token) {
            return Next::Done(Finish::Stop);
        }
        self.generated += 1;
        self.piece.clear();
        vocab.token_to_piece_into(token, &mut self.piece, false, None);
        // encoding_rs writes only into spare capacity; a split character waits in it.
        self.text.reserve(
            self.decoder
                .max_utf8_buffer_length(self.piece.len())
                .unwrap_or(self.piece.len() * 3 + 4),
        );
        let before = self.text.len();
        let _ = self
            .decoder
            .decode_to_string(&self.piece, &mut self.text, false);
        // A stop string that is new ends in this piece: only the tail is searched.
        let tail = self
            .text
            .floor_char_boundary(before.saturating_sub(self.longest_stop));
        if let Some(found) = request
            .stop
            .iter()
            .filter_map(|s| self.text[tail..].find(s.as_str()))
            .min()
        {
            self.text.truncate(tail + found);
            return Next::Done(Finish::Stop);
        }
        // Hold back what could still become a stop string.
        let safe = self
            .text
            .floor_char_boundary(self.text.len().saturating_sub(self.longest_stop));
        if safe > self.sent {
            let _ = events.send(Event::Text(self.text[self.sent..safe].to_owned()));
            self.sent = safe;
        }
        Next::Token(token)
    }

    /// Sends what is held back: the reply has ended.
    pub(crate) fn flush(&mut self, events: &UnboundedSender<Event>) {
        if self.text.len() > self.sent {
            let _ = events.send(Event::Text(self.text[self.sent..].to_owned()));
            self.sent = self.text.len();
        }
    }
}
