//! One module per subcommand. They share [`crate::cli::setup`]; `plan --verify` and
//! `train --plan` use `verify`'s plan runner, and nothing else crosses between commands.

pub mod emit;
pub mod models;
pub mod plan;
pub mod plot;
pub mod profile;
pub mod simulate_allocator;
pub mod sweep;
pub mod train;
pub mod verify;
