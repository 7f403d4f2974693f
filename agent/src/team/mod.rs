//! Teams of agents: a group chat, a loop, a sequence or a parallel of assistants, executors
//! and other teams, as a [`TeamSpec`](tandem_protocol::team::TeamSpec) describes them.

mod answer;
mod build;
pub mod check;
mod drawing;
pub mod history;
pub mod run;
mod spend;
pub mod task;
mod termination;

pub use check::{Node, TeamErrors, check, check_within};
pub use history::{Replay, Said};
pub use run::{
    Agent, AgentReply, Ended, Hook, MOST_CANDIDATES, Run, Sample, Team, Turn, executor_slot,
    replay_of,
};
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
