//! The `ckptune` binary: parses arguments, runs a command, maps errors to exit codes
//! (0 success, 1 the work failed — e.g. no plan fits, a verification exceeded its budget —,
//! 2 bad input).

use std::process::ExitCode;

use clap::Parser;

use ckptune::cli::{args::Cli, commands, UsageError};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match commands::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.chain().any(|c| c.is::<UsageError>()) {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
