//! `ckptune train`: training steps with a plan's or a regex's checkpoint set, reporting loss,
//! time and peak memory per step.

use std::process::ExitCode;

use anyhow::{bail, Result};
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, PlanJson, TrainJson, TrainStepJson};

use crate::cli::args::TrainArgs;
use crate::cli::error::UsageError;
use crate::cli::measure::check_step_fits;
use crate::cli::output::{outln, print_json};
use crate::cli::plan_run::{apply_plan, setup_for_plan};
use crate::cli::setup::Setup;

pub fn train_cmd(a: TrainArgs) -> Result<ExitCode> {
    let mut plan: Option<PlanJson> = None;
    let (setup, mut cfg, regex) = match &a.plan {
        Some(p) => {
            let read: PlanJson = formats::read_tagged(p, formats::PLAN_FORMAT)?;
            let (setup, cfg) = setup_for_plan(&read, a.model.quiet)?;
            let regex = read.checkpoint.regex.clone();
            plan = Some(read);
            (setup, cfg, regex)
        }
        None => {
            let mut setup = Setup::resolve(&a.model, &[ckptune_runtime::Precision::Fp32])?;
            setup.fit_threads_to_load_announced();
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
    check_step_fits(&setup, &cfg, &regex)?;
    let mut s = setup.session(&cfg)?;
    let mask = match &plan {
        // The plan's selective modules run selective.
        Some(plan) => apply_plan(plan, &mut s)?.0,
        None if regex.is_empty() => vec![false; s.chain.units()],
        None => s.select(&regex)?,
    };
    let modules = s.chain.names_of(&mask);
    if !a.json {
        outln!(
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
            outln!(
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
            other_cores: r.load.map(|l| l.other_cores()),
        });
    }
    let out = TrainJson {
        format: formats::TRAIN_FORMAT.into(),
        model: s.chain.name.clone(),
        config: cfg.spec(),
        regex,
        modules,
        steps,
    };
    if let Some(o) = &a.output {
        formats::write_atomic(o, &out)?;
    }
    if a.json {
        print_json(&out)?;
    }
    Ok(ExitCode::SUCCESS)
}
