//! A plan run by ckptune's runtime: its model and config rebuilt from the plan, one warm-up
//! step, timed steps, and one instrumented step whose every moment is compared with the memory
//! model to the byte. What `verify`, `plan --verify` and `train --plan` share.

use anyhow::{bail, Result};
use ckptune_kernels::sac::SacPolicy;
use ckptune_runtime::profile::timing::{self, timed_steps};
use ckptune_runtime::profile::{measured_moments, RetimePolicy};
use ckptune_runtime::progress::progress_bar;
use ckptune_runtime::{Session, StepTrace, TrainConfig};
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, MeasuredRun, MismatchJson, PlanJson, PredictedRun, SelectiveJson, VerifyJson};
use ckptune_solver::model::{moments_at_selective, policy_index};
use ckptune_solver::profile::ConfigSpec;

use crate::cli::args::{Measure, ModelArgs};
use crate::cli::error::UsageError;
use crate::cli::measure::check_fits_here;
use crate::cli::output::{group_digits, outln};
use crate::cli::setup::{step_name, Setup};
use crate::cli::timing::{contention_note, range_text};

/// A setup that rebuilds the plan's model and config.
pub fn setup_for_plan(plan: &PlanJson, quiet: bool) -> Result<(Setup, TrainConfig)> {
    let args = ModelArgs {
        model: plan.shape.model.clone(),
        batch: vec![plan.config.micro_batch],
        global_batch: Some(plan.config.micro_batch * plan.config.grad_accum),
        image: plan.shape.image,
        seq: plan.shape.seq,
        classes: plan.shape.classes,
        granularity: plan.shape.granularity.clone(),
        candidates: plan.shape.candidates.clone(),
        state_dict_key: plan.shape.state_dict_key.clone(),
        heads: plan.shape.heads,
        attention: plan.shape.attention.clone(),
        precision: vec![plan.config.precision.clone()],
        optimizer: vec![plan.config.optimizer.clone()],
        optimizer_impl: plan.config.optimizer_impl.iter().cloned().collect(),
        zero_grad_in_place: !plan.config.set_to_none,
        autocast_cache: plan.config.autocast_cache,
        loss_chunks: vec![plan.config.chunks()],
        optimizer_step: vec![step_name(plan.config.optimizer_in_backward).to_owned()],
        allow_8bit: false,
        device: plan.device.device.split(':').next().unwrap_or("cpu").to_owned(),
        threads: Some(plan.device.threads),
        // A plan is run for real; verify checks the memory it measures against the model.
        measure: Measure::Run,
        repeats: plan.shape.repeats,
        cache_dir: None,
        no_cache: true,
        quiet,
    };
    let setup = Setup::resolve(&args, &[])?;
    let cfg = TrainConfig::from_spec(&plan.config)?;
    Ok((setup, cfg))
}

/// The checkpoint mask of `plan` on `s`'s chain, with `s` set to run the plan's selective
/// modules selective under each one's policy (`checkpoint.selective`); per block, the index of
/// its policy among those its profile measured ([`ckptune_solver::model::Policies`]).
pub fn apply_plan(plan: &PlanJson, s: &mut Session) -> Result<(Vec<bool>, Vec<Option<usize>>)> {
    let mask = s.select(&plan.checkpoint.regex)?;
    s.selective = vec![None; s.chain.blocks.len()];
    let mut policies = vec![None; s.chain.blocks.len()];
    for sel in &plan.checkpoint.selective {
        let policy = SacPolicy::from_name(&sel.policy).ok_or_else(|| {
            UsageError(format!(
                "the plan runs modules selective under policy {:?}, which this ckptune does not know \
                 (it knows {}); re-plan with this ckptune",
                sel.policy,
                SacPolicy::ALL.map(SacPolicy::name).join(", ")
            ))
        })?;
        for m in &sel.modules {
            let i = s.chain.blocks.iter().position(|b| &b.name == m).ok_or_else(|| {
                UsageError(format!(
                    "the plan runs {m} selective, but that is not a block of {}; re-plan with this ckptune",
                    s.chain.name
                ))
            })?;
            s.selective[i] = Some(policy);
            // `plan_check` made sure the profile measured it.
            policies[i] = policy_index(&plan.profile, i, &sel.policy);
        }
    }
    Ok((mask, policies))
}

/// Runs `plan` for real: one warm-up step, `steps` timed steps, and one instrumented step whose
/// every moment is compared with the model.
pub fn verify_plan(plan: &PlanJson, steps: usize, quiet: bool) -> Result<VerifyJson> {
    let (setup, cfg) = setup_for_plan(plan, quiet)?;
    check_fits_here(
        plan.predicted.peak_bytes,
        &format!("running the plan of {} for real", plan.shape.model),
        "it can be verified on a machine with more memory, or on the GPU it is for",
    )?;
    tch::set_num_threads(setup.threads);
    ckptune_kernels::meter::install()?;
    let mut s = setup.session(&cfg)?;
    let (mask, selective) = apply_plan(plan, &mut s)?;
    let steps = steps.max(1);
    let pb = progress_bar((steps + 2) as u64, "verifying plan", quiet);
    // One warm-up step (optimizer state and caches come to exist), then the timed steps,
    // contended ones re-timed (docs/timing.md).
    s.step(&mask, None)?;
    pb.inc(1);
    let mut peak = 0;
    let mut reserved: Option<i64> = None;
    let mut timed = 0;
    let (samples, contention) = timed_steps(&mut s, &mask, steps, RetimePolicy::default(), |r| {
        timed += 1;
        if timed > steps {
            pb.inc_length(1);
        }
        pb.inc(1);
        peak = peak.max(r.peak_bytes);
        reserved = reserved.max(r.reserved_peak_bytes);
    })?;
    let mut trace = StepTrace::default();
    let r = s.step(&mask, Some(&mut trace))?;
    pb.finish_and_clear();
    peak = peak.max(r.peak_bytes);
    reserved = reserved.max(r.reserved_peak_bytes);

    let predicted = moments_at_selective(&plan.profile, &mask, &selective);
    let measured = measured_moments(&trace, &s.chain, plan.profile.regimes.len());
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
    let stats = timing::seconds(&samples);
    let pred = PredictedRun {
        peak_bytes: plan.predicted.peak_bytes,
        step_seconds: plan.predicted.step_seconds,
        step_seconds_range: plan.predicted.step_seconds_range,
    };
    let notes = contention_note("the plan's profile", &plan.profile.contention)
        .into_iter()
        .chain(contention_note("this verification", &contention))
        .collect();
    Ok(VerifyJson {
        format: formats::VERIFY_FORMAT.into(),
        model: plan.model.name.clone(),
        device: plan.device.device.clone(),
        threads: setup.threads,
        budget_bytes: plan.budget_bytes,
        config: cfg.spec(),
        regex: plan.checkpoint.regex.clone(),
        modules: plan.checkpoint.modules.clone(),
        selective: plan.checkpoint.selective.clone(),
        peak_error_bytes: peak - pred.peak_bytes,
        peak_error_relative: (peak - pred.peak_bytes) as f64 / pred.peak_bytes.max(1) as f64,
        step_error_seconds: stats.median - pred.step_seconds,
        step_error_relative: (stats.median - pred.step_seconds) / pred.step_seconds.max(f64::MIN_POSITIVE),
        // On CUDA the card runs out at the allocator's reserved bytes.
        within_budget: reserved.unwrap_or(peak) <= plan.budget_bytes,
        predicted: pred,
        measured: MeasuredRun {
            peak_bytes: peak,
            step_seconds: stats.clone(),
            contention,
            reserved_peak_bytes: reserved,
        },
        peak_moment,
        mismatches,
        notes,
    })
}

/// `h.0, h.1 selective under matmul; h.2 selective under attention` for a run with selective
/// modules; empty otherwise.
pub fn selective_text(sel: &[SelectiveJson]) -> String {
    let parts: Vec<String> = sel
        .iter()
        .map(|s| format!("{} selective under {}", s.modules.join(", "), s.policy))
        .collect();
    parts.join("; ")
}

/// `fp32 / adamw / micro-batch 2 × 1`, with the loss's chunks and the step in backward when the
/// config has them: how `verify` names the config it ran.
pub fn config_text(c: &ConfigSpec) -> String {
    format!(
        "{} / {} / micro-batch {} × {}{}{}",
        c.precision,
        c.optimizer,
        c.micro_batch,
        c.grad_accum,
        match c.chunks() {
            1 => String::new(),
            n => format!(" / loss in {n} chunks"),
        },
        if c.optimizer_in_backward {
            " / optimizer step in backward"
        } else {
            ""
        }
    )
}

/// `verify MODEL (CONFIG), checkpoint REGEX`: the first line of every verification's report.
pub fn print_verify_heading(r: &VerifyJson) {
    let selective = match selective_text(&r.selective) {
        t if t.is_empty() => t,
        t => format!(" ({t})"),
    };
    outln!(
        "verify {} ({}), checkpoint {}{selective}",
        r.model,
        config_text(&r.config),
        r.regex
    );
}

pub fn print_verify(r: &VerifyJson) {
    print_verify_heading(r);
    outln!(
        "  peak: measured {} ({} B), predicted {} ({} B), error {} B ({:+.4}%)",
        format_size(r.measured.peak_bytes as u64),
        group_digits(r.measured.peak_bytes),
        format_size(r.predicted.peak_bytes as u64),
        group_digits(r.predicted.peak_bytes),
        r.peak_error_bytes,
        100.0 * r.peak_error_relative
    );
    if let Some(reserved) = r.measured.reserved_peak_bytes {
        outln!(
            "  reserved by the CUDA caching allocator: {} ({} B), {} above the allocated peak",
            format_size(reserved.max(0) as u64),
            group_digits(reserved),
            format_size((reserved - r.measured.peak_bytes).max(0) as u64)
        );
    }
    let m = &r.measured.step_seconds;
    let c = &r.measured.contention;
    let which = if c.contended() {
        format!("{} steps, {} of them contended", m.n, c.contended)
    } else if c.recorded() && c.unchecked == 0 {
        format!("{} quiet steps", m.n)
    } else {
        format!("{} steps", m.n)
    };
    outln!(
        "  step: measured {:.3} s (median of {which}, {}), predicted {:.3} s{}, error {:+.1}%",
        m.median,
        range_text([m.min, m.max]),
        r.predicted.step_seconds,
        r.predicted
            .step_seconds_range
            .map(|p| format!(" ({})", range_text(p)))
            .unwrap_or_default(),
        100.0 * r.step_error_relative
    );
    for n in &r.notes {
        outln!("  note: {n}");
    }
    if r.mismatches.is_empty() {
        outln!("  every moment of the step matched the model to the byte");
    } else {
        outln!("  MODEL DEFECT: {} moments differ from the model:", r.mismatches.len());
        for m in r.mismatches.iter().take(5) {
            outln!(
                "    {}: predicted {} B, measured {} B ({:+} B)",
                m.moment,
                m.predicted_bytes,
                m.measured_bytes,
                m.measured_bytes - m.predicted_bytes
            );
        }
    }
    if r.within_budget {
        outln!("  within budget {} ✓", format_size(r.budget_bytes as u64));
    } else {
        outln!(
            "  OVER BUDGET: measured peak {} exceeds the budget {} by {} (at {})",
            format_size(r.measured.peak_bytes as u64),
            format_size(r.budget_bytes as u64),
            format_size((r.measured.peak_bytes - r.budget_bytes) as u64),
            r.peak_moment
        );
    }
}
