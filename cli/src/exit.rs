//! `tandem`'s exit codes, one per way a command or a task ends (README: exit codes).

/// The task ended with its work done: the termination string said, an answer given
/// after a clean run, or the task's examples held.
pub const DONE: u8 = 0;
/// The model server, the sandbox or Tandem failed.
pub const FAILED: u8 = 1;
/// Bad usage or configuration.
pub const USAGE: u8 = 2;
/// The turn limit was reached.
pub const MAX_TURNS: u8 = 3;
/// The task timeout was reached.
pub const TIMEOUT: u8 = 4;
/// The task was done, but a file it made could not be kept (`tandem run --out`).
pub const NOT_KEPT: u8 = 5;
/// A budget of the task was reached (`--max-input-tokens`, ...).
pub const BUDGET: u8 = 6;
/// The model sent the same code again, and it ran as before.
pub const REPEATED: u8 = 7;
/// Cancelled (Ctrl-C).
pub const CANCELLED: u8 = 130;

/// The exit code for how a task ended, whether it ran here or on the daemon.
pub fn for_stop(reason: tandem_protocol::StopReason) -> u8 {
    use tandem_protocol::StopReason;
    match reason {
        StopReason::Terminated | StopReason::Answered | StopReason::ExamplesHeld => DONE,
        StopReason::MaxTurns => MAX_TURNS,
        StopReason::Timeout => TIMEOUT,
        StopReason::Budget => BUDGET,
        StopReason::Cancelled => CANCELLED,
        StopReason::Error => FAILED,
        StopReason::Repeated => REPEATED,
    }
}
