//! The sweep document (`ckptune.sweep/1`): measured peak and step time of checkpoint subsets,
//! with the model's prediction for each.

use serde::{Deserialize, Serialize};

use super::{DeviceJson, ModelJson};
use crate::profile::{ConfigSpec, Contention, Stats};

/// One measured checkpoint subset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepPointJson {
    pub regex: String,
    pub modules: Vec<String>,
    pub peak_bytes: i64,
    /// Over the quiet timed steps (all of them when none was quiet); docs/timing.md.
    pub step_seconds: Stats,
    /// Every timed step's seconds, in order, re-timings included.
    #[serde(default)]
    pub step_samples: Vec<f64>,
    /// How busy the rest of the machine was during the steps behind `step_seconds`.
    #[serde(default)]
    pub contention: Contention,
    pub loss: f64,
    /// The profile's prediction for this subset, where a profile was available.
    pub predicted_peak_bytes: Option<i64>,
    pub predicted_step_seconds: Option<f64>,
    /// The spread the profile's samples allow around `predicted_step_seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_step_range: Option<[f64; 2]>,
    pub predicted_moment: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepConfigJson {
    pub config: ConfigSpec,
    pub points: Vec<SweepPointJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepJson {
    pub format: String,
    pub ckptune_version: String,
    pub model: ModelJson,
    pub device: DeviceJson,
    pub repeats: usize,
    pub configs: Vec<SweepConfigJson>,
}
