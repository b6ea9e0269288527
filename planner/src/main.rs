//! The `ckptune` binary: parses arguments, runs a command, maps errors to exit codes by their
//! type (0 success, 1 the work failed — e.g. no plan fits, a verification exceeded its
//! budget —, 2 bad input; see `cli::error`).

use std::process::ExitCode;

use clap::Parser;

use ckptune::cli::{self, args::Cli, error, output::write_failure};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error::message(&e));
            error::exit_code(&e)
        }
    };
    match write_failure() {
        Some(message) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
        None => code,
    }
}
