//! Teams of agents: a group chat, a loop, a sequence or a parallel of assistants, executors
//! and other teams, as a [`TeamSpec`](tandem_protocol::team::TeamSpec) describes them.

mod agent;
mod answer;
mod ask;
mod build;
pub mod check;
mod code;
mod drawing;
pub mod history;
mod members;
mod run;
mod spend;
mod state;
pub mod task;
mod termination;
mod view;

pub use agent::{Agent, AgentReply, Hook, Sample, Turn};
pub use check::{Node, TeamErrors, check, check_within};
pub use history::{Replay, Said, replay_of};
pub use members::{Team, executor_slot};
pub use run::{Ended, MOST_CANDIDATES, Run};
pub use task::{TaskLabel, run_team_task};

/// `path: message` for a deserialisation error, the way [`check()`] names fields.
pub fn path_error<E: std::fmt::Display>(e: &serde_path_to_error::Error<E>) -> String {
    let path = e.path().to_string();
    // `.` is the whole document, `?` a place a syntax error left unknown.
    if path == "." || path == "?" {
        e.inner().to_string()
    } else {
        format!("{path}: {}", e.inner())
    }
}
