//! ckptune: finds the fastest PyTorch training configuration that fits a memory budget.
//!
//! The solver modules ([`chain_model`], [`solver`], [`regex_emit`], [`budget`]) take plain
//! structs and return plain structs: no I/O, no libtorch. [`formats`] is the one serde
//! boundary; [`plot`] draws plain structs to SVG and PNG; [`cli`] is the glue.

pub mod budget;
pub mod chain_model;
pub mod cli;
pub mod formats;
pub mod plan_cli;
pub mod plot;
pub mod regex_emit;
pub mod solver;
