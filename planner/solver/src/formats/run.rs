//! Documents of runs: `verify` (`ckptune.verify/1`) and `train` (`ckptune.train/1`).

use serde::{Deserialize, Serialize};

use crate::profile::{ConfigSpec, Contention, Stats};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictedRun {
    pub peak_bytes: i64,
    pub step_seconds: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_seconds_range: Option<[f64; 2]>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredRun {
    pub peak_bytes: i64,
    /// Over the quiet timed steps (all of them when none was quiet); docs/timing.md.
    pub step_seconds: Stats,
    /// How busy the rest of the machine was during the timed steps.
    #[serde(default)]
    pub contention: Contention,
    /// On CUDA: the caching allocator's highest reserved bytes over the run's steps
    /// (`max_memory_reserved()`), which the budget is judged against there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_peak_bytes: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MismatchJson {
    pub moment: String,
    pub predicted_bytes: i64,
    pub measured_bytes: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyJson {
    pub format: String,
    pub model: String,
    pub device: String,
    pub threads: i32,
    pub budget_bytes: i64,
    pub config: ConfigSpec,
    pub regex: String,
    pub modules: Vec<String>,
    /// Of `modules`, those the run ran selective, by policy (the plan's `checkpoint.selective`).
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "super::one_or_many")]
    pub selective: Vec<super::SelectiveJson>,
    pub predicted: PredictedRun,
    pub measured: MeasuredRun,
    /// measured − predicted, and that over predicted.
    pub peak_error_bytes: i64,
    pub peak_error_relative: f64,
    pub step_error_seconds: f64,
    pub step_error_relative: f64,
    pub within_budget: bool,
    /// Where the measured step's peak occurred.
    pub peak_moment: String,
    /// Every moment where the measurement differs from the model (empty: byte-exact). A
    /// difference is a defect of the model, reported with the moment where it occurred.
    pub mismatches: Vec<MismatchJson>,
    /// What the reader should know about the step times: steps timed on a busy machine, here or
    /// in the plan's profile.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainStepJson {
    pub step: usize,
    pub loss: f64,
    pub seconds: f64,
    pub peak_bytes: i64,
    /// Level when the step started (parameters, buffers, optimizer state, batch, …).
    pub start_bytes: i64,
    /// CPU the rest of the machine took while the step ran, in cores (absent where it cannot
    /// be read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_cores: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainJson {
    pub format: String,
    pub model: String,
    pub config: ConfigSpec,
    pub regex: String,
    pub modules: Vec<String>,
    pub steps: Vec<TrainStepJson>,
}
