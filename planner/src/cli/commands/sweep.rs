//! `ckptune sweep`: real training steps for given checkpoint subsets (the ground truth), with
//! the memory model's prediction for each where a profile is given.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use ckptune_models::Chain;
use ckptune_runtime::profile::timing::{self, timed_steps};
use ckptune_runtime::profile::RetimePolicy;
use ckptune_runtime::progress::progress_bar;
use ckptune_runtime::{Precision, Session};
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, ProfileJson, SweepConfigJson, SweepJson, SweepPointJson};
use ckptune_solver::model::{peak_at, seconds_at, seconds_range_at};
use ckptune_solver::profile::ConfigProfile;

use crate::cli::args::SweepArgs;
use crate::cli::error::UsageError;
use crate::cli::output::{outln, print_json};
use crate::cli::setup::{model_json, Setup};

/// Every allowed choice of candidates (blocks and groups, never a group with one of its
/// blocks), as masks over the chain's units. A candidate is a name: the calls of a module called
/// several times are checkpointed together, as a plan's regex checkpoints them.
fn all_subsets(chain: &Chain) -> Result<Vec<Vec<bool>>> {
    let names = chain.candidates();
    if names.len() > 10 {
        return Err(UsageError(format!(
            "--all-subsets: {} candidates would be up to {} subsets; pass --checkpoint regexes instead",
            names.len(),
            1u64 << names.len().min(63)
        ))
        .into());
    }
    let of: Vec<Option<usize>> = (0..chain.units())
        .map(|i| {
            let name = chain.unit_name(i);
            (chain.unit_candidate(i))
                .then(|| names.iter().position(|n| *n == name))
                .flatten()
        })
        .collect();
    Ok((0..1u32 << names.len())
        .map(|m| {
            of.iter()
                .map(|k| k.is_some_and(|k| m >> k & 1 == 1))
                .collect::<Vec<bool>>()
        })
        .filter(|mask| chain.nested_conflict(mask).is_none())
        .collect())
}

pub fn sweep_cmd(a: SweepArgs) -> Result<ExitCode> {
    let mut setup = Setup::resolve(&a.model, &[Precision::Fp32])?;
    setup.fit_threads_to_load_announced();
    if a.checkpoints.is_empty() && !a.all_subsets {
        bail!(UsageError(
            "sweep needs --checkpoint REGEX (repeatable) or --all-subsets".into()
        ));
    }
    tch::set_num_threads(setup.threads);
    ckptune_kernels::meter::install()?;
    let prof: Option<ProfileJson> = a
        .profile
        .as_deref()
        .map(|p| formats::read_tagged(p, formats::PROFILE_FORMAT))
        .transpose()?;
    let mut model = None;
    let mut configs = Vec::new();
    for cfg in &setup.configs {
        let mut s = setup.session(cfg)?;
        let mut masks = Vec::new();
        for re in &a.checkpoints {
            masks.push(s.select(re)?);
        }
        if a.all_subsets {
            for m in all_subsets(&s.chain)? {
                if !masks.contains(&m) {
                    masks.push(m);
                }
            }
        }
        let cp = prof
            .as_ref()
            .and_then(|p| p.configs.iter().find(|c| c.config.same_as(&cfg.spec())));
        let points = sweep(&mut s, &masks, setup.repeats, setup.quiet, cp)?;
        model.get_or_insert_with(|| model_json(&s.chain));
        configs.push(SweepConfigJson {
            config: cfg.spec(),
            points,
        });
    }
    let out = SweepJson {
        format: formats::SWEEP_FORMAT.into(),
        ckptune_version: env!("CARGO_PKG_VERSION").into(),
        model: model.context("no config swept")?,
        device: setup.device_json(),
        repeats: setup.repeats,
        configs,
    };
    if let Some(o) = &a.output {
        formats::write_atomic(o, &out)?;
    }
    if a.json {
        print_json(&out)?;
    } else {
        print_sweep(&out);
    }
    Ok(ExitCode::SUCCESS)
}

/// Measures each mask: one warm-up step, then `repeats` timed steps, contended ones re-timed
/// (docs/timing.md); the peak is the first timed step's (identical across steps on CPU, which
/// the sweep checks).
pub fn sweep(
    s: &mut Session,
    masks: &[Vec<bool>],
    repeats: usize,
    quiet: bool,
    prof: Option<&ConfigProfile>,
) -> Result<Vec<SweepPointJson>> {
    let pb = progress_bar(
        (masks.len() * (repeats + 1)) as u64,
        &format!("sweeping {}", s.cfg.label()),
        quiet,
    );
    let mut points = Vec::new();
    for mask in masks {
        s.step(mask, None)?;
        pb.inc(1);
        let mut secs = Vec::new();
        let mut peaks = Vec::new();
        let mut loss = 0.0;
        let mut timed = 0;
        let (samples, contention) = timed_steps(s, mask, repeats, RetimePolicy::default(), |r| {
            timed += 1;
            if timed > repeats {
                pb.inc_length(1);
            }
            pb.inc(1);
            secs.push(r.seconds);
            peaks.push(r.peak_bytes);
            loss = r.loss;
        })?;
        if s.device == tch::Device::Cpu && peaks.iter().any(|p| *p != peaks[0]) {
            bail!(
                "sweep of {} {:?}: the peak differed between identical steps ({peaks:?})",
                s.chain.name,
                mask
            );
        }
        let names = s.chain.names_of(mask);
        let pred = prof.map(|p| peak_at(p, mask));
        points.push(SweepPointJson {
            regex: ckptune_solver::regex_emit::checkpoint_regex(&names, &s.chain.modules)?,
            modules: names,
            peak_bytes: peaks[0],
            step_seconds: timing::seconds(&samples),
            step_samples: secs,
            contention,
            loss,
            predicted_peak_bytes: pred.as_ref().map(|p| p.0),
            predicted_step_seconds: prof.map(|p| seconds_at(p, mask)),
            predicted_step_range: prof.and_then(|p| seconds_range_at(p, mask)).map(|(lo, hi)| [lo, hi]),
            predicted_moment: pred.map(|p| p.1),
        });
    }
    pb.finish_and_clear();
    Ok(points)
}

fn print_sweep(s: &SweepJson) {
    for c in &s.configs {
        let cfg = &c.config;
        outln!(
            "{} / {} / micro-batch {} × {}:",
            cfg.precision,
            cfg.optimizer_label(),
            cfg.micro_batch,
            cfg.grad_accum
        );
        outln!(
            "  {:<40} {:>12} {:>12} {:>10} {:>10}",
            "checkpointed",
            "peak",
            "predicted",
            "step s",
            "predicted"
        );
        for p in &c.points {
            let what = if p.modules.is_empty() {
                "(nothing)".to_owned()
            } else {
                p.modules.join(",")
            };
            outln!(
                "  {:<40} {:>12} {:>12} {:>10.3} {:>10}",
                what,
                format_size(p.peak_bytes as u64),
                p.predicted_peak_bytes
                    .map(|b| format_size(b as u64))
                    .unwrap_or_else(|| "-".into()),
                p.step_seconds.median,
                p.predicted_step_seconds
                    .map(|t| format!("{t:.3}"))
                    .unwrap_or_else(|| "-".into())
            );
        }
    }
}
