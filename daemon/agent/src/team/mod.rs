//! Teams of agents: a group chat, a loop, a sequence or a parallel of assistants, executors
//! and other teams, as a [`TeamSpec`] describes them.

pub mod check;
pub mod run;

pub use check::{Node, TeamErrors, check};
pub use run::{Ended, Hook, Said, TaskLabel, Team, executor_slot, replay_of, run_team_task};
use tandem_protocol::team::TeamSpec;

/// A team from its JSON form (`TaskSpec.team`), with the path of a bad field in the error.
pub fn from_json(value: serde_json::Value) -> Result<TeamSpec, TeamErrors> {
    serde_path_to_error::deserialize(value).map_err(|e| TeamErrors(vec![path_error(&e)]))
}

/// `path: message` for a deserialisation error, the way [`check`] names fields.
pub fn path_error<E: std::fmt::Display>(e: &serde_path_to_error::Error<E>) -> String {
    let path = e.path().to_string();
    if path == "." {
        e.inner().to_string()
    } else {
        format!("{path}: {}", e.inner())
    }
}
