//! ckptune: finds the fastest PyTorch training configuration that fits a memory budget.
//!
//! This crate is the binary's glue: [`cli`] (arguments, one module per subcommand, exit
//! codes) and [`plot`] (plain structs to SVG and PNG). The planning core — profile data, the
//! memory model, the exact solver, regex emission, sizes and every JSON format — is the
//! `ckptune-solver` crate, which has no libtorch.

pub mod cli;
pub mod plot;
