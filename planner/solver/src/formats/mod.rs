//! The versioned JSON formats: every document ckptune reads or writes, and the one place
//! where its data meets serde (the profile's measured terms, [`crate::profile`], derive serde
//! behind the same `serde` feature so that the profile format embeds them unchanged). Every
//! document carries `"format": "ckptune.<kind>/1"`; readers reject other kinds and versions
//! with a message that says what was found and expected. A field added with a default keeps
//! the version (older documents read with the default, older ckptune ignores the field: the
//! timing fields of docs/timing.md); a changed or removed field bumps it. Writes are atomic.

use std::fs;
use std::io::Write;
use std::path::Path;

use serde::{de::DeserializeOwned, Serialize};

mod alloc_trace;
mod bench;
mod cache;
pub mod one_or_many;
mod plan;
mod profile;
mod python;
mod pytorch;
mod rates;
mod run;
mod sweep;

pub use alloc_trace::{
    replay_text, write_replay, write_trace, AllocReplayJson, AllocSnapshotJson, AllocSpanJson, AllocStatsJson,
    AllocStopJson, AllocTraceJson, EveryEventJson, StatJson, EVERY_EVENT_COLUMNS,
};
pub use bench::SolverBenchRow;
pub use cache::CachedConfig;
pub use plan::{
    AllocConfPeaksJson, AlternativeJson, BudgetShareJson, CheckpointJson, CorrectionJson, CudaMemoryJson,
    CudaRoundJson, PlanFailureJson, PlanJson, PredictedJson, RankPredictionJson, SelectiveJson, ShapeJson, ShardJson,
    SolverJson,
};
pub use profile::{backbone_of, BlockJson, DeviceJson, GroupJson, ModelJson, ModelListing, ProfileJson};
pub use python::python_literal;
pub use pytorch::{
    ExplainedBytes, FsdpParamJson, FsdpRankJson, FsdpRunJson, PytorchRunJson, RankVerifyJson, TrainerRunJson,
    VerifyPytorchJson, VerifyShardJson, FSDP_RUN_FORMAT, VERIFY_SHARD_FORMAT,
};
pub use rates::CachedRates;
pub use run::{MeasuredRun, MismatchJson, PredictedRun, TrainJson, TrainStepJson, VerifyJson};
pub use sweep::{SweepConfigJson, SweepJson, SweepPointJson};

/// `ckptune profile`'s output and `plan --profile`'s input.
pub const PROFILE_FORMAT: &str = "ckptune.profile/1";
/// `ckptune sweep`: measured (and predicted) peak and time of checkpoint subsets.
pub const SWEEP_FORMAT: &str = "ckptune.sweep/1";
/// `ckptune plan`: the chosen config and checkpoint regex, with the evidence.
pub const PLAN_FORMAT: &str = "ckptune.plan/1";
/// `plan --json` when no config fits the budget.
pub const PLAN_FAILURE_FORMAT: &str = "ckptune.plan-failure/1";
/// `ckptune verify`: a plan run for real, every moment compared with the model.
pub const VERIFY_FORMAT: &str = "ckptune.verify/1";
/// `python -m ckptune_harness.eager`: a plan run in PyTorch eager on the built-in model's reference.
pub const PYTORCH_RUN_FORMAT: &str = "ckptune.pytorch-run/1";
/// `ckptune verify --pytorch`: predicted, ckptune's and PyTorch's run side by side.
pub const VERIFY_PYTORCH_FORMAT: &str = "ckptune.verify-pytorch/1";
/// `ckptune train`: per-step loss, time and memory.
pub const TRAIN_FORMAT: &str = "ckptune.train/1";
/// One cached config profile (the profile cache's files).
pub const CACHE_FORMAT: &str = "ckptune.profile-cache/1";
/// A CPU's calibrated cost-model rates (the runtime's calibration cache).
pub const RATES_FORMAT: &str = "ckptune.cpu-rates/1";
/// An allocation trace for `ckptune simulate-allocator`.
pub const ALLOC_TRACE_FORMAT: &str = "ckptune.alloc-trace/1";
/// `ckptune simulate-allocator`: a trace replayed through the caching-allocator simulation.
pub const ALLOC_REPLAY_FORMAT: &str = "ckptune.alloc-replay/1";

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("writing {path}: {source}")]
    Write { path: String, source: std::io::Error },
    #[error("{path} is not valid {expected} JSON: {message}")]
    Parse {
        path: String,
        expected: &'static str,
        message: String,
    },
    #[error("{path} has format {found:?}, expected {expected:?}{hint}")]
    Version {
        path: String,
        found: String,
        expected: &'static str,
        hint: &'static str,
    },
}

/// Writes `value` as pretty JSON to `path` atomically: a temporary file in the same directory,
/// synced, then renamed over the target, so a reader never sees half a file and an interrupted
/// write loses nothing that was there before.
pub fn write_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), FormatError> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| FormatError::Write {
        path: path.display().to_string(),
        source: std::io::Error::other(e),
    })?;
    text.push('\n');
    write_bytes_atomic(path, text.as_bytes())
}

/// Writes `bytes` to `path` atomically (see [`write_atomic`]); for files that are not JSON,
/// such as plots.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<(), FormatError> {
    let shown = path.display().to_string();
    let werr = |source| FormatError::Write {
        path: shown.clone(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    fs::create_dir_all(&dir).map_err(werr)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(werr)
}

/// Anything the formats can write: lets callers ask for a document without naming serde.
pub trait Document: Serialize {}
impl<T: Serialize> Document for T {}

/// A document as pretty JSON text (what `--json` prints).
pub fn to_pretty<T: Serialize>(value: &T) -> Result<String, FormatError> {
    serde_json::to_string_pretty(value).map_err(|e| FormatError::Write {
        path: "standard output".into(),
        source: std::io::Error::other(e),
    })
}

/// The `format` tag of a JSON document (empty when it has none), for commands that accept
/// several kinds of document and dispatch on the kind.
pub fn read_format_tag(path: &Path, expected: &'static str) -> Result<String, FormatError> {
    let shown = path.display().to_string();
    let text = fs::read_to_string(path).map_err(|source| FormatError::Read {
        path: shown.clone(),
        source,
    })?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| FormatError::Parse {
        path: shown,
        expected,
        message: e.to_string(),
    })?;
    Ok(value.get("format").and_then(|f| f.as_str()).unwrap_or("").to_owned())
}

/// Reads a JSON document of the given format tag.
pub fn read_tagged<T: DeserializeOwned>(path: &Path, expected: &'static str) -> Result<T, FormatError> {
    let shown = path.display().to_string();
    let text = fs::read_to_string(path).map_err(|source| FormatError::Read {
        path: shown.clone(),
        source,
    })?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| FormatError::Parse {
        path: shown.clone(),
        expected,
        message: e.to_string(),
    })?;
    let found = value.get("format").and_then(|f| f.as_str()).unwrap_or("").to_owned();
    if found != expected {
        let hint = if found.split('/').next() == expected.split('/').next() {
            "; it was written by another ckptune version: regenerate it with this one"
        } else {
            ""
        };
        return Err(FormatError::Version {
            path: shown,
            found,
            expected,
            hint,
        });
    }
    serde_json::from_value(value).map_err(|e| FormatError::Parse {
        path: shown,
        expected,
        message: e.to_string(),
    })
}
