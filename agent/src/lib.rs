//! Tandem's assistant and executor agents.
//!
//! - [`chat`]: the assistant's model, any OpenAI-compatible chat API (async-openai).
//! - [`extract`]: fenced code blocks out of a markdown reply (pulldown-cmark).
//! - [`termination`]: whether the assistant said it is done.
//! - [`blocks`]: the executor agent: run a reply's blocks in one session and report back.
//! - [`task`]: the turn loop that ties them together until termination or a limit.
//! - [`events`]: where a task's events go.

pub mod approval;
pub mod blocks;
pub mod budget;
pub mod chat;
pub mod check;
pub mod events;
pub mod examples;
pub mod extract;
pub mod grounding;
pub mod schema;
pub mod task;
pub mod team;
pub mod termination;
pub mod tools;
pub mod trace;
pub mod traceback;

pub use approval::{ApprovalError, ApprovalGate, Approver, Ask, Ruling};
pub use blocks::{LanguageListError, SessionSlot, allowed_languages};
pub use chat::{ChatModel, ModelConfig, ModelError};
pub use events::EventSink;
pub use extract::{CodeBlock, extract_code_blocks};
pub use task::{
    LateNet, TaskNetwork, TaskOutcome, TaskSettings, pair, render_system_prompt, run_task,
};

/// The termination string used unless configured otherwise.
pub const DEFAULT_TERMINATION: &str = "TERMINATE";

/// Most assistant turns of the two-agent pair unless configured otherwise.
pub const DEFAULT_MAX_TURNS: u32 = 10;

/// Replies to choose among, the model's own with them, when a reply first fails the task's
/// examples.
pub const DEFAULT_CANDIDATES: u32 = 4;

/// Most turns of a team's agents together unless the task or the config says.
pub const DEFAULT_TEAM_TURNS: u32 = 50;

/// The default system prompt, in the spirit of AutoGen's coding assistant. `{languages}` is
/// replaced by the fences of exactly the languages the task can run (see
/// [`render_system_prompt`]); a custom prompt may use it too.
pub const DEFAULT_SYSTEM_PROMPT: &str = "\
You are a helpful AI assistant who solves tasks by writing code that really runs.
Your code is executed for you, and you see its output in the next message.
- Solve the task with complete code in {languages} blocks. Do not write code for the user to edit or fill in.
- Each block runs as a new process in the same working directory: files persist across blocks, variables do not. To save a file, put `# filename: <path>` on the block's first line.
- Print the results you need with print(); do not ask the user to copy or run anything.
- If the code fails, read the error, fix it, and send the whole corrected code again, not a diff.
- If you cannot solve the task by running code, explain why.
- When the task is done and you have checked the answer, give it briefly and end your reply with TERMINATE.";
