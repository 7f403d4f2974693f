//! The worker that owns llama.cpp's context and serves every request at once.
//!
//! Each conversation lives in a sequence of one KV cache shared by all (llama.cpp's unified
//! cache). A request is placed in the sequence whose cached tokens begin its prompt (its own
//! conversation, a turn ago), or in a fresh one that first borrows, by reference, the longest
//! prefix any sequence holds (the system prompt and tools every task shares). Every step
//! decodes one batch that carries the next token of each reply being generated and a chunk of
//! each prompt being read, so a long prompt never stalls the replies. When the cache is full,
//! the least recently used idle sequence is dropped; when none is idle, the newest reply is
//! paused (its cells dropped) and reads its conversation again once there is room, so nothing
//! fails for lack of cache.
//!
//! Invariants: a slot's `tokens` are exactly the tokens its sequence holds in the cache, at
//! positions `0..tokens.len()`; an active request's `fed` prompt-and-reply tokens are the
//! first `fed` of its slot's.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use llama_cpp_2::DecodeError;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::draft::{Ask, Drafter};
use crate::reply::{Next, ReplyState};
use crate::seq::{common_prefix, seq_id};
use crate::{EngineStats, Event, Job};

/// Most replies generated at once for which the draft still guesses.
const DRAFT_UP_TO: usize = 2;

/// Fewest shared tokens worth waiting for another request to read.
const BORROW_MIN: usize = 32;

/// A sequence of the cache.
#[derive(Default)]
struct Slot {
    /// The tokens it holds, from position 0.
    tokens: Vec<LlamaToken>,
    /// The length of the prompt it last served: a request that begins with all of it
    /// continues that conversation.
    prompt: usize,
    /// When it was last used (a step count), for choosing which to drop.
    used_at: u64,
    /// Serving a request now.
    busy: bool,
}

/// A request being served.
struct Active {
    job: Job,
    seq: usize,
    /// The prompt and then each decoded token of the reply: what the sequence must hold.
    want: Vec<LlamaToken>,
    /// How many of `want` the sequence holds.
    fed: usize,
    /// The sampled token that is decoded next, once `want` is all held.
    next: Option<LlamaToken>,
    /// The draft's guesses of the tokens after `next`, checked with it in this step.
    drafts: Vec<LlamaToken>,
    reply: ReplyState,
    /// Prompt tokens found in the cache when it was placed.
    reused: usize,
    /// Its cells were dropped for room; it reads again once there is room.
    paused: bool,
    /// Another request, arrived with it, reads the start they share: this one waits for
    /// that sequence (by its id) to hold so many tokens, then borrows them.
    borrow: Option<(usize, usize)>,
    prompt_len: usize,
}

/// One request's part of a batch.
struct Part {
    active: usize,
    tokens: usize,
    /// The batch index of its logits, when it samples after this step.
    logits: Option<i32>,
}

/// The worker's state.
pub(crate) struct Engine<'m> {
    model: &'m LlamaModel,
    ctx: LlamaContext<'m>,
    slots: Vec<Slot>,
    active: Vec<Active>,
    pending: VecDeque<Job>,
    batch: LlamaBatch<'static>,
    batch_tokens: usize,
    /// Prompt tokens read in a step in which replies are also generated.
    ride_along: usize,
    parallel: usize,
    window: usize,
    cache_tokens: usize,
    step: u64,
    stats: Arc<Mutex<EngineStats>>,
    drafter: Option<Drafter<'m>>,
    /// Most tokens drafted for a reply in one step.
    draft_tokens: usize,
}

/// Sizes the engine is built with.
pub(crate) struct Sizes {
    pub(crate) sequences: usize,
    pub(crate) parallel: usize,
    pub(crate) batch_tokens: usize,
    pub(crate) window: usize,
    pub(crate) cache_tokens: usize,
    pub(crate) draft_tokens: usize,
}

impl<'m> Engine<'m> {
    pub(crate) fn new(
        model: &'m LlamaModel,
        ctx: LlamaContext<'m>,
        sizes: &Sizes,
        stats: Arc<Mutex<EngineStats>>,
        drafter: Option<Drafter<'m>>,
    ) -> Self {
        Self {
            model,
            ctx,
            slots: (0..sizes.sequences).map(|_| Slot::default()).collect(),
            active: Vec::new(),
            pending: VecDeque::new(),
            batch: LlamaBatch::new(sizes.batch_tokens, 1),
            batch_tokens: sizes.batch_tokens,
            ride_along: (sizes.batch_tokens / 4).max(16),
            parallel: sizes.parallel.clamp(1, sizes.sequences),
            window: sizes.window,
            cache_tokens: sizes.cache_tokens,
            step: 0,
            stats,
            drafter,
            draft_tokens: sizes.draft_tokens,
        }
    }

    /// Serves requests until every sender is gone and nothing is left to do.
    pub(crate) fn run(mut self, jobs: &mpsc::Receiver<Job>) {
        loop {
            if self.active.is_empty() && self.pending.is_empty() {
                self.publish();
                match jobs.recv() {
                    Ok(job) => self.pending.push_back(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = jobs.try_recv() {
                self.pending.push_back(job);
            }
            self.drop_cancelled();
            self.admit();
            if !self.active.is_empty() {
                self.step();
            }
            self.publish();
        }
    }

    /// Ends requests whose caller stopped waiting, and frees their sequences at once.
    fn drop_cancelled(&mut self) {
        self.pending.retain(|job| !job.gone());
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].job.gone() {
                let a = self.active.remove(i);
                self.clear(a.seq);
                let _ = a.job.events.send(Event::Failed("cancelled".to_owned()));
            } else {
                i += 1;
            }
        }
    }

    /// Places waiting requests, first come first served, while fewer than `parallel` run.
    fn admit(&mut self) {
        while self.active.len() < self.parallel {
            let Some(job) = self.pending.pop_front() else {
                return;
            };
            let Some((seq, reused)) = self.place(&job.tokens) else {
                self.pending.push_front(job);
                return;
            };
            let reply = match ReplyState::new(self.model, &job.request) {
                Ok(reply) => reply,
                Err(reason) => {
                    self.slots[seq].busy = false;
                    let _ = job.events.send(Event::Failed(reason));
                    continue;
                }
            };
            self.slots[seq].busy = true;
            let want = job.tokens.clone();
            // A start it shares with a prompt still being read is read once, by that one.
            let shared = self
                .active
                .iter()
                .filter(|a| !a.paused && a.fed < a.want.len())
                .map(|a| {
                    let n = common_prefix(&a.want, &want);
                    (a.seq, n.min(want.len() - 1))
                })
                .max_by_key(|&(_, n)| n)
                .filter(|&(_, n)| n >= reused + BORROW_MIN);
            self.active.push(Active {
                prompt_len: want.len(),
                want,
                fed: reused,
                next: None,
                drafts: Vec::new(),
                paused: false,
                borrow: shared,
                reply,
                reused,
                seq,
                job,
            });
        }
    }

    /// A sequence for `prompt` and how many of its tokens it already holds; `None` when
    /// every sequence is busy.
    fn place(&mut self, prompt: &[LlamaToken]) -> Option<(usize, usize)> {
        let common = |s: &Slot| common_prefix(&s.tokens, prompt);
        // Its own conversation: an idle sequence whose last prompt this one begins with. Only
        // the reply may differ (trimmed by the caller, or cut at a stop string); it is cut
        // back in place.
        let own = (0..self.slots.len())
            .map(|i| (i, common(&self.slots[i])))
            .filter(|&(i, n)| {
                let s = &self.slots[i];
                !s.busy && n > 0 && n >= s.prompt
            })
            .max_by_key(|&(_, n)| n)
            .map(|(i, _)| i);
        let seq = match own {
            Some(seq) => seq,
            None => {
                // An empty sequence, else the one idle longest.
                let seq = (0..self.slots.len())
                    .filter(|&i| !self.slots[i].busy)
                    .min_by_key(|&i| (!self.slots[i].tokens.is_empty(), self.slots[i].used_at))?;
                let (donor, shared) = (0..self.slots.len())
                    .map(|i| (i, common(&self.slots[i])))
                    .max_by_key(|&(i, n)| (n, i == seq))
                    .unwrap_or((seq, 0));
                if donor != seq {
                    if !self.slots[seq].tokens.is_empty() {
                        self.stat(|s| s.evictions += 1);
                    }
                    self.clear(seq);
                    if shared > 0 {
                        // In a unified cache this shares the cells; nothing is copied.
                        let _ = self.ctx.kv_cache_seq_cp(
                            seq_id(donor),
                            seq_id(seq),
                            Some(0),
                            u32::try_from(shared).ok(),
                        );
                        self.slots[seq].tokens = prompt[..shared].to_vec();
                    }
                }
                seq
            }
        };
        // At least the prompt's last token is decoded again, for its logits.
        let keep = common(&self.slots[seq]).min(prompt.len().saturating_sub(1));
        self.truncate(seq, keep);
        let slot = &mut self.slots[seq];
        slot.busy = true;
        slot.used_at = self.step;
        slot.prompt = prompt.len();
        Some((seq, keep))
    }

    /// Drops a sequence's cells from `keep` on.
    fn truncate(&mut self, seq: usize, keep: usize) {
        if keep >= self.slots[seq].tokens.len() {
            return;
        }
        let partial = self
            .ctx
            .clear_kv_cache_seq(Some(seq as u32), u32::try_from(keep).ok(), None)
            .unwrap_or(false);
        if partial {
            self.slots[seq].tokens.truncate(keep);
        } else {
            self.clear(seq);
        }
    }

    /// Empties a sequence and makes it free.
    fn clear(&mut self, seq: usize) {
        let _ = self.ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
        let slot = &mut self.slots[seq];
        slot.tokens.clear();
        slot.prompt = 0;
        slot.busy = false;
        if let Some(d) = self.drafter.as_mut() {
            d.forget(seq);
        }
    }

    /// Decodes one batch: the next token of every reply and chunks of prompts, then samples.
    fn step(&mut self) {
        self.step += 1;
        self.propose();
        let parts = loop {
            let parts = self.fill();
            if parts.is_empty() {
                return;
            }
            let needed = self.batch.n_tokens() as usize;
            if self.cache_used() + needed <= self.cache_tokens || !self.make_room() {
                break parts;
            }
        };
        let started = Instant::now();
        match self.ctx.decode(&mut self.batch) {
            Ok(()) => {}
            Err(DecodeError::NoKvCacheSlot) => {
                if !self.make_room() {
                    // One request alone and still no room: the window exceeds the cache.
                    let a = self.active.remove(0);
                    self.clear(a.seq);
                    let _ = a.job.events.send(Event::Failed(format!(
                        "the model's cache of {} tokens cannot hold this conversation of {}; raise [model] cache_tokens",
                        self.cache_tokens,
                        a.want.len()
                    )));
                }
                return;
            }
            Err(e) => {
                let reason = format!("llama.cpp failed: {e}");
                for a in std::mem::take(&mut self.active) {
                    self.clear(a.seq);
                    let _ = a.job.events.send(Event::Failed(reason.clone()));
                }
                return;
            }
        }
        let elapsed = started.elapsed();
        let (mut read, mut generated, mut proposed, mut accepted) = (0u64, 0u64, 0u64, 0u64);
        let mut finished = Vec::new();
        for part in &parts {
            let a = &mut self.active[part.active];
            let slot = &mut self.slots[a.seq];
            if a.fed < a.want.len() {
                // A chunk of what it reads.
                slot.tokens
                    .extend_from_slice(&a.want[a.fed..a.fed + part.tokens]);
                a.fed += part.tokens;
                read += part.tokens as u64;
            } else if let (Some(token), Some(at)) = (a.next.take(), part.logits) {
                // The sampled token and the draft's guesses were decoded; each guess the
                // model itself samples is kept, and the first it does not ends the check.
                // Sampling goes token by token as without a draft, so the reply is the same.
                let drafts = std::mem::take(&mut a.drafts);
                let mut kept = 1;
                let mut outcome = Next::Done(crate::Finish::Length);
                for j in 0..=drafts.len() {
                    let room = a.fed + j + 2 < self.window;
                    match a.reply.next(
                        self.model,
                        &self.ctx,
                        at + j as i32,
                        &a.job.request,
                        &a.job.events,
                        room,
                    ) {
                        Next::Token(t) if drafts.get(j) == Some(&t) => kept += 1,
                        other => {
                            outcome = other;
                            break;
                        }
                    }
                }
                let held: Vec<LlamaToken> = std::iter::once(token)
                    .chain(drafts[..kept - 1].iter().copied())
                    .collect();
                slot.tokens.extend_from_slice(&held);
                a.want.extend_from_slice(&held);
                a.fed += kept;
                generated += kept as u64;
                if kept <= drafts.len() {
                    // The refused guesses' cells.
                    let _ = self.ctx.clear_kv_cache_seq(
                        Some(a.seq as u32),
                        u32::try_from(a.fed).ok(),
                        None,
                    );
                }
                proposed += drafts.len() as u64;
                accepted += (kept - 1) as u64;
                slot.used_at = self.step;
                match outcome {
                    Next::Token(t) => a.next = Some(t),
                    Next::Done(finish) => finished.push((part.active, Ok(finish))),
                    Next::Failed(why) => finished.push((part.active, Err(why))),
                }
                continue;
            }
            slot.used_at = self.step;
            let Some(at) = part.logits else { continue };
            let room = a.fed + 1 < self.window;
            match a.reply.next(
                self.model,
                &self.ctx,
                at,
                &a.job.request,
                &a.job.events,
                room,
            ) {
                Next::Token(token) => a.next = Some(token),
                Next::Done(finish) => finished.push((part.active, Ok(finish))),
                Next::Failed(why) => finished.push((part.active, Err(why))),
            }
        }
        let sequences = parts.len() as u64;
        let tokens = self.batch.n_tokens() as u64;
        self.stat(|s| {
            s.steps += 1;
            s.batch_sequences = sequences;
            s.batch_tokens = tokens;
            s.prompt_tokens_read += read;
            s.tokens_generated += generated;
            s.draft_proposed += proposed;
            s.draft_accepted += accepted;
            s.busy_seconds += elapsed.as_secs_f64();
        });
        // Highest index first, so the others keep theirs.
        finished.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        let mut done = Vec::new();
        for (i, finish) in finished {
            let a = self.active.remove(i);
            // Its sequence stays in the cache for the conversation's next turn.
            let slot = &mut self.slots[a.seq];
            slot.busy = false;
            slot.used_at = self.step;
            let reused = a.reused as u64;
            self.stat(|s| s.prompt_tokens_reused += reused);
            done.push((a, finish));
        }
        // The figures say the reply has ended before its caller hears it.
        self.publish();
        for (mut a, finish) in done {
            let finish = match finish {
                Ok(finish) => finish,
                Err(why) => {
                    // A failed reply's sequence is not kept for a next turn.
                    self.clear(a.seq);
                    let _ = a.job.events.send(Event::Failed(why));
                    continue;
                }
            };
            a.reply.flush(&a.job.events);
            let _ = a.job.events.send(Event::Done {
                finish,
                prompt_tokens: u32::try_from(a.prompt_len).unwrap_or(u32::MAX),
                cached_tokens: u32::try_from(a.reused).unwrap_or(u32::MAX),
                completion_tokens: a.reply.generated,
            });
        }
    }

    /// Has the draft guess the next tokens of each reply being generated, while few are: a
    /// batch of several replies already keeps the CPU busy, and guesses would only add to it.
    fn propose(&mut self) {
        let Some(drafter) = self.drafter.as_mut() else {
            return;
        };
        let generating: Vec<usize> = (0..self.active.len())
            .filter(|&i| {
                let a = &self.active[i];
                a.next.is_some() && a.fed == a.want.len() && !a.paused
            })
            .collect();
        if generating.is_empty() || generating.len() > DRAFT_UP_TO {
            return;
        }
        let asks: Vec<Ask<'_>> = generating
            .iter()
            .map(|&i| {
                let a = &self.active[i];
                let left = a.job.request.max_tokens.saturating_sub(a.reply.generated) as usize;
                Ask {
                    seq: a.seq,
                    held: &a.want,
                    next: a.next.unwrap_or(LlamaToken(0)),
                    // Within the window, and no more than the reply may still grow.
                    most: self
                        .draft_tokens
                        .min(self.window.saturating_sub(a.fed + 3))
                        .min(left.saturating_sub(1)),
                }
            })
            .collect();
        let drafts = drafter.propose(&asks);
        drop(asks);
        for (i, d) in generating.into_iter().zip(drafts) {
            self.active[i].drafts = d;
        }
    }

    /// Fills the batch: each reply's next token, then prompt chunks in arrival order.
    fn fill(&mut self) -> Vec<Part> {
        self.resume();
        self.borrow();
        self.batch.clear();
        let mut parts = Vec::new();
        for (i, a) in self.active.iter().enumerate() {
            if let (Some(token), true) = (a.next, a.fed == a.want.len()) {
                let at = self.batch.n_tokens();
                // The sampled token, then the draft's guesses after it, each with logits.
                let tokens: Vec<LlamaToken> = std::iter::once(token)
                    .chain(a.drafts.iter().copied())
                    .collect();
                let added = tokens.iter().enumerate().all(|(k, &t)| {
                    self.batch
                        .add(t, (a.fed + k) as i32, &[seq_id(a.seq)], true)
                        .is_ok()
                });
                if added {
                    parts.push(Part {
                        active: i,
                        tokens: tokens.len(),
                        logits: Some(at),
                    });
                }
            }
        }
        let mut budget = if parts.is_empty() {
            self.batch_tokens
        } else {
            self.ride_along
        }
        .min(
            self.batch_tokens
                .saturating_sub(self.batch.n_tokens() as usize),
        );
        for (i, a) in self.active.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if a.fed >= a.want.len() || a.paused || a.borrow.is_some() {
                continue;
            }
            let take = (a.want.len() - a.fed).min(budget);
            // Its logits are needed at the end of what it reads, unless a sampled token
            // (of a reply paused and read again) is waiting to be decoded.
            let ends = a.fed + take == a.want.len() && a.next.is_none();
            let mut logits = None;
            for (k, &token) in a.want[a.fed..a.fed + take].iter().enumerate() {
                let last = ends && k + 1 == take;
                if last {
                    logits = Some(self.batch.n_tokens());
                }
                if self
                    .batch
                    .add(token, (a.fed + k) as i32, &[seq_id(a.seq)], last)
                    .is_err()
                {
                    break;
                }
            }
            budget -= take;
            parts.push(Part {
                active: i,
                tokens: take,
                logits,
            });
        }
        parts
    }

    /// Gives each waiting request the shared start its lender now holds; a lender that
    /// went away or was paused leaves it to read for itself.
    fn borrow(&mut self) {
        for i in 0..self.active.len() {
            let Some((lender, n)) = self.active[i].borrow else {
                continue;
            };
            let ready = self
                .active
                .iter()
                .find(|a| a.seq == lender)
                .filter(|a| !a.paused)
                .map(|a| a.fed >= n);
            match ready {
                Some(false) => continue,
                Some(true) => {
                    let seq = self.active[i].seq;
                    let _ = self.ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
                    // In a unified cache this shares the cells; nothing is copied.
                    let _ = self.ctx.kv_cache_seq_cp(
                        seq_id(lender),
                        seq_id(seq),
                        Some(0),
                        u32::try_from(n).ok(),
                    );
                    let a = &mut self.active[i];
                    self.slots[seq].tokens = a.want[..n].to_vec();
                    a.fed = n;
                    a.reused = n;
                }
                None => {}
            }
            self.active[i].borrow = None;
        }
    }

    /// Lets the oldest paused request read again when the busy sequences leave room for it
    /// and a batch beside it, or when nothing else runs.
    fn resume(&mut self) {
        let Some(i) = self.active.iter().position(|a| a.paused) else {
            return;
        };
        let alone = self.active.iter().all(|a| a.paused);
        let busy = self.cells(|s| s.busy);
        if alone || busy + self.active[i].want.len() + self.batch_tokens <= self.cache_tokens {
            self.active[i].paused = false;
        }
    }

    /// Frees cells: drops the idle sequence used longest ago, else pauses the newest of
    /// several requests. False when there is nothing left to free.
    fn make_room(&mut self) -> bool {
        if let Some(seq) = (0..self.slots.len())
            .filter(|&i| !self.slots[i].busy && !self.slots[i].tokens.is_empty())
            .min_by_key(|&i| self.slots[i].used_at)
        {
            self.clear(seq);
            self.stat(|s| s.evictions += 1);
            return true;
        }
        if let Some(a) = self.active.iter_mut().skip(1).rev().find(|a| a.fed > 0) {
            // It reads its conversation (and its reply so far) again when there is room.
            a.fed = 0;
            a.paused = true;
            a.drafts.clear();
            let seq = a.seq;
            let _ = self.ctx.clear_kv_cache_seq(Some(seq as u32), None, None);
            self.slots[seq].tokens.clear();
            if let Some(d) = self.drafter.as_mut() {
                d.forget(seq);
            }
            self.stat(|s| s.pauses += 1);
            return true;
        }
        false
    }

    /// Cells in use: every token of every sequence, a prefix shared by several counted once.
    fn cache_used(&self) -> usize {
        self.cells(|_| true)
    }

    /// Cells held by the sequences `of` selects.
    fn cells(&self, of: impl Fn(&Slot) -> bool) -> usize {
        let mut held: Vec<&[LlamaToken]> = self
            .slots
            .iter()
            .filter(|s| of(s))
            .map(|s| s.tokens.as_slice())
            .filter(|t| !t.is_empty())
            .collect();
        held.sort_unstable();
        let mut used = 0;
        let mut previous: &[LlamaToken] = &[];
        for t in held {
            let shared = common_prefix(t, previous);
            used += t.len() - shared;
            previous = t;
        }
        used
    }

    fn stat(&self, f: impl FnOnce(&mut EngineStats)) {
        if let Ok(mut s) = self.stats.lock() {
            f(&mut s);
        }
    }

    /// Puts the gauges where `Embedded::stats` reads them.
    fn publish(&mut self) {
        let live = self.active.len() as u64;
        let waiting = self.pending.len() as u64;
        let kept = self
            .slots
            .iter()
            .filter(|s| !s.busy && !s.tokens.is_empty())
            .count() as u64;
        let used = self.cache_used() as u64;
        let Ok(mut s) = self.stats.lock() else { return };
        s.sequences_live = live;
        s.sequences_waiting = waiting;
        s.sequences_kept = kept;
        s.cache_tokens_used = used;
        if live == 0 {
            s.batch_sequences = 0;
            s.batch_tokens = 0;
        }
    }
}

impl Job {
    /// The caller stopped waiting.
    fn gone(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.events.is_closed()
    }
}
