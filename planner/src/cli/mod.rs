//! The CLI: thin glue from arguments to the runtime, the solver and the formats.

pub mod args;
pub mod commands;
pub mod plot_cmd;
pub mod run_cmds;
pub mod setup;

/// Bad input (exit code 2), as opposed to a failure of the work itself (exit code 1).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}
