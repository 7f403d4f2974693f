//! Speculative decoding: a small model of the same vocabulary guesses the next few tokens of
//! each reply, greedily, and the main model checks them all in one batch (see `engine`).
//!
//! The draft keeps a cache of its own with the same sequence ids as the main one. It is not
//! kept in step with every change of the main cache: before it drafts, a sequence is brought
//! up to what the main one holds (`catch_up`), so eviction, pauses and borrowed prefixes on
//! the main side need only `forget` here. Invariant: `tokens[seq]` are exactly the tokens the
//! draft's cache holds for `seq`, at positions `0..len`.

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::seq::{common_prefix, seq_id};

/// Fewest tokens worth borrowing from another sequence instead of reading.
const BORROW_MIN: usize = 32;

/// One reply to draft for.
pub(crate) struct Ask<'a> {
    /// Its sequence id.
    pub(crate) seq: usize,
    /// Every token the main cache holds for it, in order.
    pub(crate) held: &'a [LlamaToken],
    /// The token sampled last, not yet decoded: the draft continues from it.
    pub(crate) next: LlamaToken,
    /// Most tokens to draft (fewer near the end of the window).
    pub(crate) most: usize,
}

/// The draft model and its cache.
pub(crate) struct Drafter<'m> {
    model: &'m LlamaModel,
    ctx: LlamaContext<'m>,
    tokens: Vec<Vec<LlamaToken>>,
    batch: LlamaBatch<'static>,
    batch_tokens: usize,
}

impl<'m> Drafter<'m> {
    pub(crate) fn new(
        model: &'m LlamaModel,
        ctx: LlamaContext<'m>,
        sequences: usize,
        batch_tokens: usize,
    ) -> Self {
        Self {
            model,
            ctx,
            tokens: vec![Vec::new(); sequences],
            batch: LlamaBatch::new(batch_tokens, 1),
            batch_tokens,
        }
    }

    /// Drops what the draft holds for `seq`.
    pub(crate) fn forget(&mut self, seq: usize) {
        if let Some(held) = self.tokens.get_mut(seq)
            && !held.is_empty()
        {
            held.clear();
            let _ = self.ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
        }
    }

    /// Up to `most` guessed tokens for each ask, in order; none for an ask the draft could
    /// not read (its cache is full: the reply is then decoded without a draft).
    pub(crate) fn propose(&mut self, asks: &[Ask<'_>]) -> Vec<Vec<LlamaToken>> {
        let mut out = vec![Vec::new(); asks.len()];
        let mut live: Vec<bool> = asks
            .iter()
            .map(|a| a.most > 0 && self.catch_up(a.seq, a.held))
            .collect();
        let mut last: Vec<LlamaToken> = asks.iter().map(|a| a.next).collect();
        let most = asks.iter().map(|a| a.most).max().unwrap_or(0);
        for j in 0..most {
            self.batch.clear();
            let mut at = vec![None; asks.len()];
            for (i, ask) in asks.iter().enumerate() {
                if !live[i] || j >= ask.most {
                    continue;
                }
                let index = self.batch.n_tokens();
                if self
                    .batch
                    .add(
                        last[i],
                        (ask.held.len() + j) as i32,
                        &[seq_id(ask.seq)],
                        true,
                    )
                    .is_ok()
                {
                    at[i] = Some(index);
                }
            }
            if self.batch.n_tokens() == 0 || self.ctx.decode(&mut self.batch).is_err() {
                break;
            }
            for (i, ask) in asks.iter().enumerate() {
                let Some(index) = at[i] else { continue };
                self.tokens[ask.seq].push(last[i]);
                let guess = argmax(self.ctx.get_logits_ith(index));
                out[i].push(guess);
                last[i] = guess;
                if self.model.vocab().is_eog(guess) {
                    live[i] = false;
                }
            }
        }
        out
    }

    /// Brings the draft's cache for `seq` to `held`: what differs is dropped, a long start
    /// another sequence holds is borrowed, the rest read. False when it cannot be read.
    fn catch_up(&mut self, seq: usize, held: &[LlamaToken]) -> bool {
        let common = |t: &[LlamaToken]| common_prefix(t, held);
        let mut have = common(&self.tokens[seq]);
        if have < self.tokens[seq].len() {
            let cut = self
                .ctx
                .clear_kv_cache_seq(Some(seq as u32), u32::try_from(have).ok(), None)
                .unwrap_or(false);
            if cut {
                self.tokens[seq].truncate(have);
            } else {
                self.forget(seq);
                have = 0;
            }
        }
        let lender = (0..self.tokens.len())
            .filter(|&s| s != seq)
            .map(|s| (s, common(&self.tokens[s])))
            .max_by_key(|&(_, n)| n)
            .filter(|&(_, n)| n >= have + BORROW_MIN);
        if let Some((lender, n)) = lender {
            self.forget(seq);
            // In a unified cache this shares the cells; nothing is copied.
            let _ = self.ctx.kv_cache_seq_cp(
                seq_id(lender),
                seq_id(seq),
                Some(0),
                u32::try_from(n).ok(),
            );
            self.tokens[seq] = held[..n].to_vec();
            have = n;
        }
        for chunk in held[have..].chunks(self.batch_tokens) {
            self.batch.clear();
            for (k, &token) in chunk.iter().enumerate() {
                if self
                    .batch
                    .add(token, (have + k) as i32, &[seq_id(seq)], false)
                    .is_err()
                {
                    return false;
                }
            }
            if self.ctx.decode(&mut self.batch).is_err() {
                // Full: drop every other sequence's draft cache, which is cheap to read
                // again, and draft nothing for this one now.
                for s in 0..self.tokens.len() {
                    if s != seq {
                        self.forget(s);
                    }
                }
                return false;
            }
            self.tokens[seq].extend_from_slice(chunk);
            have += chunk.len();
        }
        true
    }
}

fn argmax(logits: &[f32]) -> LlamaToken {
    let best = logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0;
    LlamaToken(i32::try_from(best).unwrap_or(0))
}
