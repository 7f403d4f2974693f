//! The team's shared history, message by message.

/// One message of the team's shared history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Said {
    /// Who said it: an agent's name, or `user` for the task.
    pub speaker: String,
    /// What was said.
    pub text: String,
    /// Whether it is an executor's report of program output.
    pub output: bool,
}
