use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Resource policy for every block in a session; each backend enforces it its own way.
/// Network access and process counts are the container executor's own settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Wall-clock limit per block.
    #[serde(with = "secs")]
    pub wall: Duration,
    /// Memory (address space for local processes), bytes.
    pub memory_bytes: Option<u64>,
    /// CPU seconds per block.
    pub cpu_secs: Option<u64>,
    /// Largest file a block may write, bytes.
    pub file_size_bytes: Option<u64>,
    /// Most open files per process.
    pub open_files: Option<u64>,
    /// Bytes of each output stream kept for the model (head and tail kept, middle cut).
    pub output_bytes: usize,
    /// Most code blocks of one reply that run; the model is told the rest were not run.
    pub blocks_per_reply: usize,
    /// Most tool calls one block's code may make; past it each call fails at once, told.
    pub code_calls_per_block: u32,
    /// Most tool calls all the blocks of one task may make together.
    pub code_calls_per_task: u32,
}

/// Code blocks of one reply that run unless the operator says otherwise: more than a model
/// writes to solve a step, far fewer than a reply built to keep a session busy.
const DEFAULT_BLOCKS_PER_REPLY: usize = 16;

impl Default for Limits {
    fn default() -> Self {
        Self {
            wall: Duration::from_secs(60),
            memory_bytes: Some(4 << 30),
            cpu_secs: Some(120),
            file_size_bytes: Some(1 << 30),
            open_files: Some(1024),
            output_bytes: 64 << 10,
            blocks_per_reply: DEFAULT_BLOCKS_PER_REPLY,
            code_calls_per_block: 100,
            code_calls_per_task: 1000,
        }
    }
}

mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}
