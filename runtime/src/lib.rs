//! Everything that runs a model: checkpointed chain execution, precision and optimizer configs,
//! the one-pass profiler, sweeps and training.

pub mod alloc_trace;
pub mod config;
pub mod cost;
mod error;
pub mod exec;
pub mod load;
pub mod memory;
pub mod optim;
pub mod profile;
pub mod progress;

pub use config::{OptimizerImpl, OptimizerKind, Precision, TrainConfig};
pub use error::{Result, RuntimeError};
pub use exec::{select, Session, StepReport, StepTrace};
