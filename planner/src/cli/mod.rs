//! The CLI: thin glue from arguments to the runtime, the solver and the formats. One file per
//! subcommand under [`commands`]; [`setup`] resolves flags and builds the sessions every
//! command that runs a model starts from; [`error`] decides exit codes by error type;
//! [`output`] prints to stdout without panicking on a closed pipe; [`timing`] words what
//! commands say about step times timed on a busy machine.

pub mod args;
pub mod commands;
pub mod companion;
pub mod device;
pub mod error;
pub mod measure;
pub mod output;
pub mod plan_check;
pub mod plan_run;
pub mod setup;
pub mod snippets;
pub mod timing;

use std::process::ExitCode;

use anyhow::Result;

use args::{Cli, Command};

/// Runs one subcommand.
pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Models { json } => commands::models::models(json),
        Command::Profile(a) => commands::profile::profile_cmd(a),
        Command::Sweep(a) => commands::sweep::sweep_cmd(a),
        Command::Plan(a) => commands::plan::plan_cmd(a),
        Command::Verify(a) => commands::verify::verify_cmd(a),
        Command::Train(a) => commands::train::train_cmd(a),
        Command::Plot(a) => commands::plot::plot_cmd(a),
        Command::Emit(a) => commands::emit::emit_cmd(a),
        Command::SimulateAllocator(a) => commands::simulate_allocator::simulate_allocator_cmd(a),
    }
}
