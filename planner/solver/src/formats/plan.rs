//! The plan document (`ckptune.plan/1`) and its failure report (`ckptune.plan-failure/1`).

use serde::{Deserialize, Serialize};

use super::{DeviceJson, ModelJson};
use crate::profile::{ConfigProfile, ConfigSpec};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointJson {
    pub regex: String,
    pub modules: Vec<String>,
    /// Of `modules`, those run selective (`plan --selective`), one entry per policy used, in
    /// the order `--selective` named the policies: written as one object when the plan uses one
    /// policy (as before a plan could mix them), as an array when it uses several; absent when
    /// every checkpointed module is checkpointed whole.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "super::one_or_many")]
    pub selective: Vec<SelectiveJson>,
}

impl CheckpointJson {
    /// The policy `module` runs selective under, if the plan runs it selective.
    pub fn policy_of(&self, module: &str) -> Option<&str> {
        self.selective
            .iter()
            .find(|s| s.modules.iter().any(|m| m == module))
            .map(|s| s.policy.as_str())
    }
}

/// The checkpointed modules run selective under one policy: `torch.utils.checkpoint` with
/// `context_fn=partial(create_selective_checkpoint_contexts, policy)` (`ckptune.apply`), the
/// runtime's `kernels::sac`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectiveJson {
    /// The policy's name (`matmul`, `attention`): which operators' outputs the forward keeps.
    pub policy: String,
    /// In execution order.
    pub modules: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictedJson {
    pub peak_bytes: i64,
    /// The median-based estimate, and the spread the profile's samples allow around it
    /// (fastest, slowest; absent for profiles without recompute samples). docs/timing.md.
    pub step_seconds: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_seconds_range: Option<[f64; 2]>,
    /// Fraction of this config's throughput lost to recompute: 1 − t(nothing) / t(plan).
    pub throughput_loss: f64,
    /// The moment of the step where the peak occurs.
    pub peak_moment: String,
    /// Set when the step times are the cost model's estimate, not measurements: how they were
    /// estimated (`Estimate::describe`). Absent for measured times.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_seconds_estimated: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlternativeJson {
    pub config: ConfigSpec,
    pub feasible: bool,
    pub checkpoint: CheckpointJson,
    pub predicted: PredictedJson,
    /// Peak and time of this config with nothing checkpointed.
    pub baseline_peak_bytes: i64,
    pub baseline_step_seconds: f64,
    /// Sharded plans (`plan --shard N`): FSDP2's `reshard_after_forward` for every unit in this
    /// alternative; absent for unsharded plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reshard_after_forward: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SolverJson {
    pub status: String,
    pub backend: String,
    pub seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanJson {
    pub format: String,
    pub ckptune_version: String,
    pub model: ModelJson,
    pub device: DeviceJson,
    pub budget_bytes: i64,
    /// A budget given as a share (`--budget 80%`): the share, and the two peaks it lies between.
    /// Absent for a budget given as a size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_share: Option<BudgetShareJson>,
    pub config: ConfigSpec,
    pub checkpoint: CheckpointJson,
    pub predicted: PredictedJson,
    /// budget − predicted peak.
    pub margin_bytes: i64,
    pub solver: SolverJson,
    /// The best plan for every config considered, the chosen one included.
    pub alternatives: Vec<AlternativeJson>,
    /// Model shape options the plan was measured with, so `verify` rebuilds the same model.
    pub shape: ShapeJson,
    /// The chosen config's profile, so `verify` can compare every moment of the step.
    pub profile: ConfigProfile,
    /// Budget reductions `plan --verify` applied after measuring a plan over budget.
    #[serde(default)]
    pub corrections: Vec<CorrectionJson>,
    /// The device the plan is for, and the bytes kept out of the budget for what the profile's
    /// device cannot see (0 when planning for the device measured on).
    #[serde(default)]
    pub target_device: String,
    #[serde(default)]
    pub reserve_bytes: i64,
    #[serde(default)]
    pub notes: Vec<String>,
    /// `plan --shard N`: how the plan shards the model over N ranks with FSDP2, and each rank's
    /// predicted peak (`predicted.peak_bytes` is the highest of them). Absent for one device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardJson>,
    /// A CUDA plan made from a CPU or meta profile: the chosen plan's step trace replayed
    /// through the caching allocator's simulation, the card's overheads, and the tightenings
    /// that made the reserved peak fit. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_memory: Option<CudaMemoryJson>,
}

/// How a CUDA plan was judged on reserved memory (docs/cuda-allocator.md, "Planning for a
/// GPU"): `context_bytes` + `predicted_reserved_peak_bytes` must fit the budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CudaMemoryJson {
    /// The `--target cuda:<name>` the overheads are for (`cuda` when not named).
    pub gpu: String,
    /// The CUDA context, outside the caching allocator (an estimate: docs/cuda-allocator.md).
    pub context_bytes: i64,
    /// cuBLAS workspaces, allocated through the caching allocator before the step's trace.
    pub workspace_bytes: Vec<u64>,
    /// Where the trace was recorded (`meta` or `cpu`), and its events.
    pub traced_on: String,
    pub trace_events: usize,
    /// The recommended `PYTORCH_CUDA_ALLOC_CONF` ("" for PyTorch's defaults): the candidate
    /// with the lowest reserved peak, or `expandable_segments:True` within
    /// `caching_allocator::EXPANDABLE_MARGIN_PERCENT` of it.
    pub alloc_conf: String,
    /// Peaks of the chosen plan's trace under `alloc_conf` (workspaces included).
    pub predicted_allocated_peak_bytes: i64,
    pub predicted_reserved_peak_bytes: i64,
    /// Every candidate setting's peaks on the chosen plan's trace.
    pub candidates: Vec<AllocConfPeaksJson>,
    /// Each plan solved on the way, the chosen one last: the budget its solve had and its
    /// simulated peaks under its best setting.
    pub rounds: Vec<CudaRoundJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocConfPeaksJson {
    pub alloc_conf: String,
    pub allocated_peak_bytes: i64,
    pub reserved_peak_bytes: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CudaRoundJson {
    pub planning_budget_bytes: i64,
    pub regex: String,
    pub config: String,
    pub predicted_peak_bytes: i64,
    pub allocated_peak_bytes: i64,
    pub reserved_peak_bytes: i64,
    pub alloc_conf: String,
}

/// A plan for N ranks, each running FSDP2 (`fully_shard` on every unit, then on the root). The
/// config's micro-batch is each rank's; the global batch is `ranks` times it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardJson {
    pub ranks: i64,
    /// `reshard_after_forward` of every unit (the root is never resharded after forward, as
    /// FSDP2 does by default).
    pub reshard_after_forward: bool,
    /// `gloo` (CPU: its collectives allocate a temporary of their output's or input's size) or
    /// `nccl` (CUDA: collectives work in FSDP's buffers).
    pub collective: String,
    /// The modules wrapped with `fully_shard`, in forward order; every other parameter is the
    /// root's.
    pub units: Vec<String>,
    /// Per rank, in rank order: the predicted peak and the moment it occurs.
    pub per_rank: Vec<RankPredictionJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankPredictionJson {
    pub rank: i64,
    pub peak_bytes: i64,
    pub peak_moment: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetShareJson {
    pub percent: f64,
    /// The config the unconstrained plan runs (the fastest), whose peaks the share lies between.
    pub config: String,
    /// Its smallest peak with checkpointing (0%) and its peak with nothing checkpointed (100%).
    pub smallest_peak_bytes: i64,
    pub unconstrained_peak_bytes: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CorrectionJson {
    pub regex: String,
    pub predicted_peak_bytes: i64,
    pub measured_peak_bytes: i64,
    pub moment: String,
    /// The budget the next round planned with: the previous one minus the measured excess.
    pub planning_budget_bytes: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShapeJson {
    pub model: String,
    pub image: Option<i64>,
    pub seq: Option<i64>,
    pub classes: Option<i64>,
    pub granularity: String,
    pub repeats: usize,
    /// `--candidates`: the regex that chose the candidate modules outright, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidates: Option<String>,
    /// `--state-dict-key`: where in a training checkpoint the state dict was, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_dict_key: Option<String>,
    /// `--heads`: the attention heads of a transformer read from a state dict, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<i64>,
    /// The attention implementation of a transformer the plan was made for (`eager`, `sdpa`:
    /// `--attention`, else the model's config or default, as the profile recorded it). Absent
    /// for other models; a plan of a transformer without it predates the choice and was eager.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
}

/// `plan --json` when nothing fits: the failure as data, for scripts. Fields are in
/// alphabetical order, as the document has always been written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanFailureJson {
    pub budget_bytes: i64,
    /// The checkpoint set attaining the smallest peak.
    pub checkpoint_regex: String,
    /// The config whose smallest peak is lowest.
    pub config: String,
    pub format: String,
    pub message: String,
    pub min_peak_bytes: i64,
    pub peak_moment: String,
    pub reserve_bytes: i64,
}
