//! What the embedded model's engine is doing, as `/metrics`, `/v1/engine` and the page show it.

use serde::{Deserialize, Serialize};

/// What the engine is doing, for `/metrics` and the page.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Requests being read or generated now.
    pub sequences_live: u64,
    /// Requests waiting for a turn.
    pub sequences_waiting: u64,
    /// Idle conversations whose tokens the cache keeps for their next turn.
    pub sequences_kept: u64,
    /// Requests in the last batch.
    pub batch_sequences: u64,
    /// Tokens in the last batch.
    pub batch_tokens: u64,
    /// Batches decoded.
    pub steps: u64,
    /// Prompt tokens read (decoded), since load.
    pub prompt_tokens_read: u64,
    /// Prompt tokens found in the cache instead, since load.
    pub prompt_tokens_reused: u64,
    /// Reply tokens generated, since load.
    pub tokens_generated: u64,
    /// Prompt tokens read per second over the last seconds.
    pub read_per_second: f64,
    /// Reply tokens generated per second over the last seconds.
    pub generated_per_second: f64,
    /// Cells of the cache in use.
    pub cache_tokens_used: u64,
    /// Cells of the cache.
    pub cache_tokens: u64,
    /// Idle conversations dropped from the cache for room.
    pub evictions: u64,
    /// Replies paused for room, to read their conversation again later.
    pub pauses: u64,
    /// Seconds spent decoding.
    pub busy_seconds: f64,
    /// Whether a draft model guesses tokens for the main one to check.
    pub draft: bool,
    /// Tokens the draft guessed, since load.
    pub draft_proposed: u64,
    /// Guessed tokens the main model kept, since load.
    pub draft_accepted: u64,
}
