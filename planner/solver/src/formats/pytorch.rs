//! The PyTorch side of `verify --pytorch`: a plan run in PyTorch eager on the built-in model's
//! plain-torch reference (`ckptune.pytorch-run/1`, written by `python -m ckptune.eager`), and
//! the side-by-side report (`ckptune.verify-pytorch/1`).

use serde::{Deserialize, Serialize};

use super::run::{PredictedRun, TrainStepJson, VerifyJson};

/// What `python -m ckptune.eager --plan` measured. Fields the report does not read (the
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
    pub regex: String,
    /// The modules `ckptune.apply` wrapped.
    pub modules: Vec<String>,
    pub warmup: usize,
    pub steps: Vec<TrainStepJson>,
    pub median_seconds: f64,
    /// The highest peak of the timed steps (after `warmup`).
    pub peak_bytes: i64,
    pub start_bytes: i64,
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
}
