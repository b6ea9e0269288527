//! The versioned JSON formats (profile, sweep, plan, verify report): the one place where
//! ckptune's data meets serde. Every document carries `"format": "ckptune.<kind>/1"`; readers
//! reject other kinds and versions with a message that says what was found and expected.

use std::fs;
use std::io::Write;
use std::path::Path;

use ckptune_runtime::profile as rt;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

pub const PROFILE_FORMAT: &str = "ckptune.profile/1";
pub const SWEEP_FORMAT: &str = "ckptune.sweep/1";
pub const PLAN_FORMAT: &str = "ckptune.plan/1";
pub const VERIFY_FORMAT: &str = "ckptune.verify/1";

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

/// A training config as it appears in every format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigJson {
    pub precision: String,
    pub optimizer: String,
    pub micro_batch: i64,
    pub grad_accum: i64,
    pub set_to_none: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockJson {
    pub name: String,
    pub candidate: bool,
}

/// A candidate module over blocks `first..=last` of the chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupJson {
    pub name: String,
    pub first: usize,
    pub last: usize,
}

impl ModelJson {
    /// Names of the checkpoint units: blocks, then groups.
    pub fn unit_names(&self) -> impl Iterator<Item = &str> {
        self.blocks
            .iter()
            .map(|b| b.name.as_str())
            .chain(self.groups.iter().map(|g| g.name.as_str()))
    }
}

/// What a profile, sweep or plan was measured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelJson {
    pub name: String,
    /// Parameters of the whole trained chain (loss head included) and of the reference model.
    pub params: i64,
    pub reference_params: i64,
    pub input: String,
    pub blocks: Vec<BlockJson>,
    /// Candidate modules spanning several blocks (`--granularity nested`); a checkpoint
    /// choice covers the blocks, then these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupJson>,
    /// Every qualified module name (the universe a checkpoint regex is checked against).
    pub modules: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceJson {
    pub device: String,
    pub threads: i32,
    pub memory: String,
    /// The CPU (model name and vector extensions): on CPU, kernels and so memory depend on it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cpu: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsJson {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FixedJson {
    pub parameters: i64,
    pub buffers: i64,
    pub gradients: i64,
    pub optimizer_state: i64,
    pub master_weights: i64,
    pub batch: i64,
    pub other: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockProfileJson {
    pub name: String,
    pub candidate: bool,
    pub kept_grad: i64,
    pub fwd_transient_grad: i64,
    pub kept_nograd: i64,
    pub fwd_transient_nograd: i64,
    pub carry: i64,
    pub bwd_transient: i64,
    pub rec_transient: i64,
    pub kept_recompute: i64,
    pub bwd_transient_ckpt: i64,
    pub grad_in_bytes: i64,
    pub fwd_seconds: f64,
    pub fwd_nograd_seconds: f64,
    pub bwd_seconds: f64,
    pub rec_seconds: f64,
}

/// A group's terms when checkpointed as a whole (see the runtime's `GroupProfile`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupProfileJson {
    pub name: String,
    pub first: usize,
    pub last: usize,
    pub kept: i64,
    pub fwd_transient: Vec<i64>,
    pub carry: i64,
    pub rec_transient: Vec<i64>,
    pub bwd_transient: Vec<i64>,
    pub fused_kept: i64,
    pub fused_fwd_transient: Vec<i64>,
    pub fused_carry: i64,
    pub fused_bwd_transient: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegimeJson {
    pub label: String,
    pub fixed: i64,
    pub loss_transient: i64,
    pub blocks: Vec<BlockProfileJson>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupProfileJson>,
}

/// One config's measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigProfileJson {
    pub config: ConfigJson,
    pub fixed: FixedJson,
    pub regimes: Vec<RegimeJson>,
    pub optimizer_peak: i64,
    pub peak_none: i64,
    pub peak_all: i64,
    pub seconds_none: StatsJson,
    pub seconds_all: StatsJson,
    pub recompute_seconds: Vec<f64>,
    pub steps_run: usize,
    pub wall_seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileJson {
    pub format: String,
    pub ckptune_version: String,
    pub model: ModelJson,
    pub device: DeviceJson,
    pub repeats: usize,
    pub configs: Vec<ConfigProfileJson>,
}

/// One measured checkpoint subset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepPointJson {
    pub regex: String,
    pub modules: Vec<String>,
    pub peak_bytes: i64,
    pub step_seconds: StatsJson,
    /// Every timed step's seconds, in order.
    #[serde(default)]
    pub step_samples: Vec<f64>,
    pub loss: f64,
    /// The profile's prediction for this subset, where a profile was available.
    pub predicted_peak_bytes: Option<i64>,
    pub predicted_step_seconds: Option<f64>,
    pub predicted_moment: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepConfigJson {
    pub config: ConfigJson,
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

impl From<&rt::Stats> for StatsJson {
    fn from(s: &rt::Stats) -> Self {
        Self {
            median: s.median,
            min: s.min,
            max: s.max,
            n: s.n,
        }
    }
}
impl From<&StatsJson> for rt::Stats {
    fn from(s: &StatsJson) -> Self {
        Self {
            median: s.median,
            min: s.min,
            max: s.max,
            n: s.n,
        }
    }
}

/// Converts a runtime profile to its JSON form (and back with [`profile_from_json`]); the two
/// are field-for-field the same, kept apart so that the runtime's types carry no serde.
pub fn profile_to_json(config: ConfigJson, p: &rt::ConfigProfile) -> ConfigProfileJson {
    let f = &p.fixed;
    ConfigProfileJson {
        config,
        fixed: FixedJson {
            parameters: f.parameters,
            buffers: f.buffers,
            gradients: f.gradients,
            optimizer_state: f.optimizer_state,
            master_weights: f.master_weights,
            batch: f.batch,
            other: f.other,
        },
        regimes: p
            .regimes
            .iter()
            .map(|r| RegimeJson {
                label: r.label.clone(),
                fixed: r.fixed,
                loss_transient: r.loss_transient,
                blocks: r
                    .blocks
                    .iter()
                    .map(|b| BlockProfileJson {
                        name: b.name.clone(),
                        candidate: b.candidate,
                        kept_grad: b.kept_grad,
                        fwd_transient_grad: b.fwd_transient_grad,
                        kept_nograd: b.kept_nograd,
                        fwd_transient_nograd: b.fwd_transient_nograd,
                        carry: b.carry,
                        bwd_transient: b.bwd_transient,
                        rec_transient: b.rec_transient,
                        kept_recompute: b.kept_recompute,
                        bwd_transient_ckpt: b.bwd_transient_ckpt,
                        grad_in_bytes: b.grad_in_bytes,
                        fwd_seconds: b.fwd_seconds,
                        fwd_nograd_seconds: b.fwd_nograd_seconds,
                        bwd_seconds: b.bwd_seconds,
                        rec_seconds: b.rec_seconds,
                    })
                    .collect(),
                groups: r
                    .groups
                    .iter()
                    .map(|g| GroupProfileJson {
                        name: g.name.clone(),
                        first: g.first,
                        last: g.last,
                        kept: g.kept,
                        fwd_transient: g.fwd_transient.clone(),
                        carry: g.carry,
                        rec_transient: g.rec_transient.clone(),
                        bwd_transient: g.bwd_transient.clone(),
                        fused_kept: g.fused_kept,
                        fused_fwd_transient: g.fused_fwd_transient.clone(),
                        fused_carry: g.fused_carry,
                        fused_bwd_transient: g.fused_bwd_transient,
                    })
                    .collect(),
            })
            .collect(),
        optimizer_peak: p.optimizer_peak,
        peak_none: p.peak_none,
        peak_all: p.peak_all,
        seconds_none: (&p.seconds_none).into(),
        seconds_all: (&p.seconds_all).into(),
        recompute_seconds: p.recompute_seconds.clone(),
        steps_run: p.steps_run,
        wall_seconds: p.wall_seconds,
    }
}

pub fn profile_from_json(c: &ConfigProfileJson) -> rt::ConfigProfile {
    let f = &c.fixed;
    rt::ConfigProfile {
        regimes: c
            .regimes
            .iter()
            .map(|r| rt::RegimeProfile {
                label: r.label.clone(),
                fixed: r.fixed,
                loss_transient: r.loss_transient,
                blocks: r
                    .blocks
                    .iter()
                    .map(|b| rt::BlockProfile {
                        name: b.name.clone(),
                        candidate: b.candidate,
                        kept_grad: b.kept_grad,
                        fwd_transient_grad: b.fwd_transient_grad,
                        kept_nograd: b.kept_nograd,
                        fwd_transient_nograd: b.fwd_transient_nograd,
                        carry: b.carry,
                        bwd_transient: b.bwd_transient,
                        rec_transient: b.rec_transient,
                        kept_recompute: b.kept_recompute,
                        bwd_transient_ckpt: b.bwd_transient_ckpt,
                        grad_in_bytes: b.grad_in_bytes,
                        fwd_seconds: b.fwd_seconds,
                        fwd_nograd_seconds: b.fwd_nograd_seconds,
                        bwd_seconds: b.bwd_seconds,
                        rec_seconds: b.rec_seconds,
                    })
                    .collect(),
                groups: r
                    .groups
                    .iter()
                    .map(|g| rt::GroupProfile {
                        name: g.name.clone(),
                        first: g.first,
                        last: g.last,
                        kept: g.kept,
                        fwd_transient: g.fwd_transient.clone(),
                        carry: g.carry,
                        rec_transient: g.rec_transient.clone(),
                        bwd_transient: g.bwd_transient.clone(),
                        fused_kept: g.fused_kept,
                        fused_fwd_transient: g.fused_fwd_transient.clone(),
                        fused_carry: g.fused_carry,
                        fused_bwd_transient: g.fused_bwd_transient,
                    })
                    .collect(),
            })
            .collect(),
        optimizer_peak: c.optimizer_peak,
        fixed: rt::FixedBytes {
            parameters: f.parameters,
            buffers: f.buffers,
            gradients: f.gradients,
            optimizer_state: f.optimizer_state,
            master_weights: f.master_weights,
            batch: f.batch,
            other: f.other,
        },
        peak_none: c.peak_none,
        peak_all: c.peak_all,
        seconds_none: (&c.seconds_none).into(),
        seconds_all: (&c.seconds_all).into(),
        recompute_seconds: c.recompute_seconds.clone(),
        steps_run: c.steps_run,
        wall_seconds: c.wall_seconds,
    }
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
