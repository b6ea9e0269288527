//! The PyTorch side of `verify --pytorch`: a plan run in PyTorch eager on the built-in model's
//! plain-torch reference (`ckptune.pytorch-run/1`, written by `python -m ckptune_harness.eager`), and
//! the side-by-side report (`ckptune.verify-pytorch/1`); for a sharded plan, the FSDP2 run on N
//! processes (`ckptune.fsdp-run/1`, written by `python -m ckptune_harness.fsdp`) and the per-rank report
//! (`ckptune.verify-shard/1`).

use serde::{Deserialize, Serialize};

use super::run::{PredictedRun, TrainStepJson, VerifyJson};
use crate::profile::ConfigSpec;

/// What `python -m ckptune_harness.eager --plan` measured. Fields the report does not read (the
/// optimizer's hyper-parameters, the meter library's name) stay in the file for readers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PytorchRunJson {
    pub format: String,
    pub model: String,
    /// `torch.__version__` of the run.
    pub torch: String,
    pub threads: i32,
    pub precision: String,
    pub optimizer: String,
    /// The torch.optim class the run built (`torch.optim.adamw.AdamW`).
    pub optimizer_class: String,
    pub micro_batch: i64,
    pub grad_accum: i64,
    pub set_to_none: bool,
    /// The chunks the run computed the loss in (absent: whole, as in runs from before the choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_chunks: Option<i64>,
    /// Whether the run stepped each parameter in backward (`ckptune.optimizer_in_backward`;
    /// absent: after backward, as in runs from before the choice).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optimizer_in_backward: bool,
    pub regex: String,
    /// The modules `ckptune.apply` wrapped.
    pub modules: Vec<String>,
    /// Of `modules`, those `ckptune.apply` runs selective, grouped by policy
    /// (`ckptune.selective_policy` of each) as the plan's `checkpoint.selective`; absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "super::one_or_many")]
    pub selective: Vec<super::SelectiveJson>,
    pub warmup: usize,
    pub steps: Vec<TrainStepJson>,
    pub median_seconds: f64,
    /// The highest peak of the timed steps (after `warmup`).
    pub peak_bytes: i64,
    pub start_bytes: i64,
    /// The trainer that ran the step (`hf`, `lightning`, written by `python -m
    /// ckptune_harness.trainers`); absent for the documented loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer: Option<String>,
    /// What the trainer's loop holds that the documented loop does not, measured in the run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub explained: Vec<ExplainedBytes>,
}

/// Bytes a trainer's peak holds beyond the documented loop's, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExplainedBytes {
    pub bytes: i64,
    pub why: String,
}

/// `verify --pytorch`: the prediction, ckptune's run and PyTorch's run of one plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyPytorchJson {
    pub format: String,
    pub budget_bytes: i64,
    pub predicted: PredictedRun,
    /// ckptune's own run of the plan (what `verify` reports).
    pub ckptune: VerifyJson,
    pub pytorch: PytorchRunJson,
    /// PyTorch's peak − the predicted peak.
    pub pytorch_peak_error_bytes: i64,
    pub pytorch_within_budget: bool,
    /// `--trainer hf|lightning`: the plan run by that trainer through its emitted snippet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer: Option<TrainerRunJson>,
}

/// A trainer's run beside the documented loop's: its peak against the prediction, and how much of
/// its difference from the documented loop's peak the run's `explained` entries account for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerRunJson {
    pub run: PytorchRunJson,
    /// The trainer's peak − the predicted peak.
    pub peak_error_bytes: i64,
    /// The trainer's peak − the documented loop's − the explained bytes.
    pub unexplained_bytes: i64,
    pub within_budget: bool,
}

/// `python -m ckptune_harness.fsdp`: a real FSDP2 training step on N CPU processes (gloo), each rank's
/// peak measured with ckptune's counting allocator.
pub const FSDP_RUN_FORMAT: &str = "ckptune.fsdp-run/1";
/// `ckptune verify --pytorch` of a sharded plan: each rank's predicted and measured peak.
pub const VERIFY_SHARD_FORMAT: &str = "ckptune.verify-shard/1";

/// What `python -m ckptune_harness.fsdp` measured: the parts the sharded report reads and keeps. The
/// harness's levels, unit sizes, traces and per-step records stay in its own file
/// (docs/fsdp.md reads them); this is the run's identity and each rank's peak.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FsdpRunJson {
    pub format: String,
    /// The reference name (`tiny-resnet`).
    pub model: String,
    /// `torch.__version__` of the run.
    pub torch: String,
    pub world_size: i64,
    pub precision: String,
    pub optimizer: String,
    /// The torch.optim class every rank built (`torch.optim.adamw.AdamW`).
    pub optimizer_class: String,
    pub micro_batch: i64,
    pub reshard_after_forward: bool,
    /// Whether autocast ran with its weight-cast cache (absent from runs before the choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autocast_cache: Option<bool>,
    /// The checkpoint regex (empty: nothing checkpointed) and the modules it wrapped.
    pub regex: String,
    pub checkpointed: Vec<String>,
    /// The FSDP units' regex and the modules wrapped with `fully_shard`, in forward order.
    pub shard_regex: Option<String>,
    pub units: Vec<String>,
    /// Steps in all and warm-up steps among them; peaks are of the steps after the warm-up.
    pub steps: usize,
    pub warmup: usize,
    /// The rendezvous port on 127.0.0.1.
    pub port: i64,
    /// The model's parameters as the ranks built them, in `parameters()` order (names of the
    /// backbone; the task head's prefixed `<head>.`).
    pub params: Vec<FsdpParamJson>,
    /// Each rank's highest timed-step peak, in rank order.
    pub peak_bytes: Vec<i64>,
    pub ranks: Vec<FsdpRankJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FsdpParamJson {
    pub name: String,
    pub shape: Vec<i64>,
    /// `<root>` or the unit the parameter belongs to.
    pub unit: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FsdpRankJson {
    pub rank: i64,
    pub pid: i64,
    pub peak_bytes: i64,
    /// Whether the rank tore its process group down before it exited.
    pub process_group_destroyed: bool,
    /// The timed steps' peaks, present only when they were not all equal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_varies: Option<Vec<i64>>,
}

/// `verify --pytorch` of a plan with a `shard` section: the plan run with FSDP2 on its N ranks,
/// each rank's measured peak beside the plan's prediction for that rank. ckptune's own runtime
/// does not run it: it runs one unsharded process, whose peak is not any rank's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyShardJson {
    pub format: String,
    pub model: String,
    pub device: String,
    pub config: ConfigSpec,
    pub regex: String,
    pub modules: Vec<String>,
    /// The plan's shard section: ranks, `reshard_after_forward`, collective and units.
    pub ranks: i64,
    pub reshard_after_forward: bool,
    pub collective: String,
    pub units: Vec<String>,
    pub budget_bytes: i64,
    pub reserve_bytes: i64,
    /// What each rank's measured peak must stay within: the budget less the reserve (the bytes
    /// the plan keeps for what the measuring device cannot see; 0 for a CPU plan).
    pub limit_bytes: i64,
    /// The plan's `predicted.peak_bytes` (its highest rank) and the highest measured rank.
    pub predicted_peak_bytes: i64,
    pub measured_peak_bytes: i64,
    pub per_rank: Vec<RankVerifyJson>,
    /// Every rank's measured peak is within `limit_bytes`.
    pub within_budget: bool,
    pub notes: Vec<String>,
    pub fsdp: FsdpRunJson,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankVerifyJson {
    pub rank: i64,
    pub predicted_peak_bytes: i64,
    pub predicted_peak_moment: String,
    pub measured_peak_bytes: i64,
    /// Measured − predicted.
    pub error_bytes: i64,
    pub within_budget: bool,
}
