//! `verify` and `train`: running plans and regexes for real.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use ckptune_runtime::profile::{measured_moments, Stats};
use ckptune_runtime::{Session, StepTrace, TrainConfig};
use serde::{Deserialize, Serialize};

use super::args::{ModelArgs, TrainArgs, VerifyArgs};
use super::commands::group_digits;
use super::setup::{config_from_json, config_json, Setup};
use super::UsageError;
use crate::budget::format_size;
use crate::formats::{self, ConfigJson, StatsJson};
use crate::plan_cli::PlanJson;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictedRun {
    pub peak_bytes: i64,
    pub step_seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredRun {
    pub peak_bytes: i64,
    pub step_seconds: StatsJson,
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
    pub config: ConfigJson,
    pub regex: String,
    pub modules: Vec<String>,
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
}

/// A setup that rebuilds the plan's model and config.
fn setup_for_plan(plan: &PlanJson, quiet: bool) -> Result<(Setup, TrainConfig)> {
    let args = ModelArgs {
        model: plan.shape.model.clone(),
        batch: vec![plan.config.micro_batch],
        global_batch: Some(plan.config.micro_batch * plan.config.grad_accum),
        image: plan.shape.image,
        seq: plan.shape.seq,
        classes: plan.shape.classes,
        // Not in ckptune.plan/1: a nested state dict is found again automatically.
        state_dict_key: None,
        granularity: plan.shape.granularity.clone(),
        precision: vec![plan.config.precision.clone()],
        optimizer: vec![plan.config.optimizer.clone()],
        zero_grad_in_place: !plan.config.set_to_none,
        allow_8bit: false,
        device: plan.device.device.split(':').next().unwrap_or("cpu").to_owned(),
        threads: Some(plan.device.threads),
        repeats: plan.shape.repeats,
        cache_dir: None,
        no_cache: true,
        quiet,
    };
    let setup = Setup::resolve(&args, &[])?;
    let cfg = config_from_json(&plan.config)?;
    Ok((setup, cfg))
}

/// Runs `plan` for real: one warm-up step, `steps` timed steps, and one instrumented step whose
/// every moment is compared with the model.
pub fn verify_plan(plan: &PlanJson, steps: usize, quiet: bool) -> Result<VerifyJson> {
    let (setup, cfg) = setup_for_plan(plan, quiet)?;
    tch::set_num_threads(setup.threads);
    ckptune_kernels::meter::install()?;
    let chain = setup.chain()?;
    let mut s = Session::new(chain, cfg.clone(), setup.device).map_err(|e| UsageError(e.to_string()))?;
    let mask = s
        .select(&plan.checkpoint.regex)
        .map_err(|e| UsageError(e.to_string()))?;
    let pb = ckptune_runtime::profile::progress_bar((steps + 2) as u64, "verifying plan", quiet);
    // Warm-up twice as the profiler does (nothing, everything checkpointed would differ from
    // the plan; what matters is optimizer state and caches existing), then the plan.
    s.step(&mask, None)?;
    pb.inc(1);
    let mut secs = Vec::new();
    let mut peak = 0;
    for _ in 0..steps.max(1) {
        let r = s.step(&mask, None)?;
        pb.inc(1);
        secs.push(r.seconds);
        peak = peak.max(r.peak_bytes);
    }
    let mut trace = StepTrace::default();
    let r = s.step(&mask, Some(&mut trace))?;
    pb.finish_and_clear();
    peak = peak.max(r.peak_bytes);

    let prof = formats::profile_from_json(&plan.profile);
    let predicted = prof.predict_moments(&mask);
    let measured = measured_moments(&trace, &s.chain, prof.regimes.len());
    let mut mismatches = Vec::new();
    for ((pl, pv), (ml, mv)) in predicted.iter().zip(&measured) {
        if pl != ml {
            bail!("verify: the model's moment {pl:?} does not line up with the run's {ml:?}");
        }
        if pv != mv {
            mismatches.push(MismatchJson {
                moment: pl.clone(),
                predicted_bytes: *pv,
                measured_bytes: *mv,
            });
        }
    }
    let peak_moment = measured
        .iter()
        .max_by_key(|(_, v)| *v)
        .map(|(l, _)| l.clone())
        .unwrap_or_default();
    let stats = Stats::of(&secs);
    let pred = PredictedRun {
        peak_bytes: plan.predicted.peak_bytes,
        step_seconds: plan.predicted.step_seconds,
    };
    Ok(VerifyJson {
        format: formats::VERIFY_FORMAT.into(),
        model: plan.model.name.clone(),
        device: plan.device.device.clone(),
        threads: setup.threads,
        budget_bytes: plan.budget_bytes,
        config: config_json(&cfg),
        regex: plan.checkpoint.regex.clone(),
        modules: plan.checkpoint.modules.clone(),
        peak_error_bytes: peak - pred.peak_bytes,
        peak_error_relative: (peak - pred.peak_bytes) as f64 / pred.peak_bytes.max(1) as f64,
        step_error_seconds: stats.median - pred.step_seconds,
        step_error_relative: (stats.median - pred.step_seconds) / pred.step_seconds.max(f64::MIN_POSITIVE),
        within_budget: peak <= plan.budget_bytes,
        predicted: pred,
        measured: MeasuredRun {
            peak_bytes: peak,
            step_seconds: (&stats).into(),
        },
        peak_moment,
        mismatches,
    })
}

pub fn print_verify(r: &VerifyJson) {
    println!(
        "verify {} ({} / {} / micro-batch {} × {}), checkpoint {}",
        r.model, r.config.precision, r.config.optimizer, r.config.micro_batch, r.config.grad_accum, r.regex
    );
    println!(
        "  peak: measured {} ({} B), predicted {} ({} B), error {} B ({:+.4}%)",
        format_size(r.measured.peak_bytes as u64),
        group_digits(r.measured.peak_bytes),
        format_size(r.predicted.peak_bytes as u64),
        group_digits(r.predicted.peak_bytes),
        r.peak_error_bytes,
        100.0 * r.peak_error_relative
    );
    println!(
        "  step: measured {:.3} s (median of {}), predicted {:.3} s, error {:+.1}%",
        r.measured.step_seconds.median,
        r.measured.step_seconds.n,
        r.predicted.step_seconds,
        100.0 * r.step_error_relative
    );
    if r.mismatches.is_empty() {
        println!("  every moment of the step matched the model to the byte");
    } else {
        println!("  MODEL DEFECT: {} moments differ from the model:", r.mismatches.len());
        for m in r.mismatches.iter().take(5) {
            println!(
                "    {}: predicted {} B, measured {} B ({:+} B)",
                m.moment,
                m.predicted_bytes,
                m.measured_bytes,
                m.measured_bytes - m.predicted_bytes
            );
        }
    }
    if r.within_budget {
        println!("  within budget {} ✓", format_size(r.budget_bytes as u64));
    } else {
        println!(
            "  OVER BUDGET: measured peak {} exceeds the budget {} by {} (at {})",
            format_size(r.measured.peak_bytes as u64),
            format_size(r.budget_bytes as u64),
            format_size((r.measured.peak_bytes - r.budget_bytes) as u64),
            r.peak_moment
        );
    }
}

pub fn verify_cmd(a: VerifyArgs) -> Result<ExitCode> {
    let plan: PlanJson = formats::read_tagged(&a.plan, formats::PLAN_FORMAT).map_err(|e| UsageError(e.to_string()))?;
    let steps = a.steps.unwrap_or(plan.shape.repeats);
    let r = verify_plan(&plan, steps, a.quiet).with_context(|| format!("verifying {}", a.plan.display()))?;
    if let Some(out) = &a.output {
        formats::write_atomic(out, &r)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_verify(&r);
    }
    if !r.within_budget {
        eprintln!(
            "error: verification failed: measured peak {} is over the budget {}",
            format_size(r.measured.peak_bytes as u64),
            format_size(r.budget_bytes as u64)
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainStepJson {
    pub step: usize,
    pub loss: f64,
    pub seconds: f64,
    pub peak_bytes: i64,
    /// Level when the step started (parameters, buffers, optimizer state, batch, …).
    pub start_bytes: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainJson {
    pub format: String,
    pub model: String,
    pub config: ConfigJson,
    pub regex: String,
    pub modules: Vec<String>,
    pub steps: Vec<TrainStepJson>,
}

pub fn train_cmd(a: TrainArgs) -> Result<ExitCode> {
    let (setup, mut cfg, regex) = match &a.plan {
        Some(p) => {
            let plan: PlanJson =
                formats::read_tagged(p, formats::PLAN_FORMAT).map_err(|e| UsageError(e.to_string()))?;
            let (setup, cfg) = setup_for_plan(&plan, a.model.quiet)?;
            (setup, cfg, plan.checkpoint.regex.clone())
        }
        None => {
            let setup = Setup::resolve(&a.model, &[ckptune_runtime::Precision::Fp32])?;
            if setup.configs.len() != 1 {
                bail!(UsageError(format!(
                    "train runs one config; --precision/--optimizer/--batch name {}",
                    setup.configs.len()
                )));
            }
            let cfg = setup.configs[0].clone();
            (setup, cfg, a.checkpoint.clone().unwrap_or_default())
        }
    };
    cfg.lr = a.lr;
    tch::set_num_threads(setup.threads);
    ckptune_kernels::meter::install()?;
    let chain = setup.chain()?;
    let mut s = Session::new(chain, cfg.clone(), setup.device).map_err(|e| UsageError(e.to_string()))?;
    let mask = if regex.is_empty() {
        vec![false; s.chain.units()]
    } else {
        s.select(&regex).map_err(|e| UsageError(e.to_string()))?
    };
    let modules = s.chain.names_of(&mask);
    if !a.json {
        println!(
            "training {} ({}), checkpointing {}",
            s.chain.name,
            cfg.label(),
            if modules.is_empty() {
                "nothing".to_owned()
            } else {
                modules.join(", ")
            }
        );
    }
    let mut steps = Vec::new();
    for i in 0..a.steps {
        let r = s.step(&mask, None)?;
        if !a.json {
            println!(
                "  step {:>4}  loss {:.6}  {:.3} s  peak {}",
                i + 1,
                r.loss,
                r.seconds,
                format_size(r.peak_bytes as u64)
            );
        }
        steps.push(TrainStepJson {
            step: i + 1,
            loss: r.loss,
            seconds: r.seconds,
            peak_bytes: r.peak_bytes,
            start_bytes: r.start_bytes,
        });
    }
    let out = TrainJson {
        format: "ckptune.train/1".into(),
        model: s.chain.name.clone(),
        config: config_json(&cfg),
        regex,
        modules,
        steps,
    };
    if let Some(o) = &a.output {
        formats::write_atomic(o, &out)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(ExitCode::SUCCESS)
}
