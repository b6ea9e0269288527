//! `plan --target cuda[:NAME]` from a CPU or meta profile: a plan is judged on what the card
//! will hold, not on its tensors' bytes. The chosen plan's step trace is recorded on the meta
//! device, cuBLAS's workspaces put in front of it, and replayed through the simulation of
//! PyTorch's CUDA caching allocator under each candidate `PYTORCH_CUDA_ALLOC_CONF`; the best
//! setting's reserved peak plus the CUDA context must fit the budget. When it does not, the
//! plan is solved again with the excess taken off the planning budget (below the plan's own
//! allocated peak, so every round chooses a smaller step), until it fits
//! (docs/cuda-allocator.md, "Planning for a GPU").

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use ckptune_kernels::alloc_log::Recording;
use ckptune_kernels::meter;
use ckptune_runtime::alloc_trace::{record_steps, trace_events};
use ckptune_solver::budget::format_size;
use ckptune_solver::caching_allocator::{peaks_by_conf, ConfPeaks, TraceEvent, CANDIDATE_CONFS};
use ckptune_solver::cuda_overheads::{CudaOverheads, WORKSPACES_PER_STEP};
use ckptune_solver::formats::{
    self, AllocConfPeaksJson, AllocTraceJson, CudaMemoryJson, CudaRoundJson, PlanJson, ProfileJson, ShapeJson,
};

use super::solve::{plan_from_profile, PlanFailure};
use crate::cli::error::UsageError;
use crate::cli::plan_run::{apply_plan, setup_for_plan};

/// Solves after this many plans whose reserved peak did not fit are given up (each round
/// lowers the allocated peak by at least the last excess, or tries the smallest one).
const MAX_ROUNDS: usize = 8;

/// The plan's step could not be recorded on the meta device (a model only `--measure run`
/// measures): the caller keeps a fixed reserve instead.
#[derive(Debug, thiserror::Error)]
#[error("the plan's step could not be recorded on the meta device to simulate the CUDA caching allocator: {0}")]
pub(super) struct NotRecorded(String);

/// The chosen plan's trace and its peaks under each candidate setting.
struct Simulated {
    events: Vec<TraceEvent>,
    peaks: Vec<ConfPeaks>,
    best: usize,
}

/// The fastest plan whose simulated reserved peak plus the CUDA context fits `budget`, and how
/// it was judged. `trace_out`: where to write the chosen plan's trace.
pub(super) fn plan_within_reserved(
    profile: &ProfileJson,
    budget: i64,
    ov: CudaOverheads,
    shape: &ShapeJson,
    quiet: bool,
    trace_out: Option<&Path>,
) -> Result<(PlanJson, CudaMemoryJson)> {
    let context = ov.context_bytes as i64;
    let workspaces = vec![ov.workspace_bytes; WORKSPACES_PER_STEP];
    let fixed = ov.fixed_bytes();
    if fixed >= budget {
        return Err(UsageError(format!(
            "--budget {} does not hold the CUDA context and cuBLAS workspaces of {} (docs/cuda-allocator.md)",
            format_size(budget.max(0) as u64),
            format_size(fixed as u64)
        ))
        .into());
    }
    // cuBLAS's workspaces are tensors on the card beside the step's: the solve leaves room.
    let mut planning = budget - fixed;
    let mut rounds = Vec::new();
    for _ in 0..MAX_ROUNDS {
        let plan = solve_or_smallest(profile, planning, shape, !rounds.is_empty())?;
        let seen = |r: &CudaRoundJson| r.regex == plan.checkpoint.regex && r.config == plan.config.label();
        if rounds.iter().any(seen) {
            break;
        }
        let sim = simulate(&plan, &ov, quiet).map_err(|e| NotRecorded(format!("{e:#}")))?;
        let best = &sim.peaks[sim.best];
        rounds.push(CudaRoundJson {
            planning_budget_bytes: planning,
            regex: plan.checkpoint.regex.clone(),
            config: plan.config.label(),
            predicted_peak_bytes: plan.predicted.peak_bytes,
            allocated_peak_bytes: best.allocated_peak as i64,
            reserved_peak_bytes: best.reserved_peak as i64,
            alloc_conf: best.conf.clone(),
        });
        let excess = best.reserved_peak as i64 + context - budget;
        if excess <= 0 {
            if let Some(path) = trace_out {
                let doc = AllocTraceJson {
                    format: formats::ALLOC_TRACE_FORMAT.into(),
                    alloc_conf: best.conf.clone(),
                    capacity_bytes: None,
                    events: sim.events.clone(),
                };
                formats::write_trace(path, &doc).context("--alloc-trace")?;
            }
            let json = CudaMemoryJson {
                gpu: ov.key.into(),
                context_bytes: context,
                workspace_bytes: workspaces,
                traced_on: "meta".into(),
                trace_events: sim.events.len(),
                alloc_conf: best.conf.clone(),
                predicted_allocated_peak_bytes: best.allocated_peak as i64,
                predicted_reserved_peak_bytes: best.reserved_peak as i64,
                candidates: sim.peaks.iter().map(peaks_json).collect(),
                rounds,
            };
            return Ok((plan, json));
        }
        planning = planning.min(plan.predicted.peak_bytes) - excess;
        if planning < 0 {
            // Not even an empty step's tensors fit beside the reserve: no plan can.
            break;
        }
    }
    let last = rounds.last().expect("one round ran");
    Err(anyhow!(
        "no plan fits the budget {} on the GPU: the last plan ({}, checkpoint {}) allocates {} but the caching \
         allocator would reserve {} (PYTORCH_CUDA_ALLOC_CONF {:?}), plus {} of CUDA context, after {} plans; \
         give a larger budget, a smaller batch, or --reserve to plan with a fixed reserve instead",
        format_size(budget as u64),
        last.config,
        last.regex,
        format_size(last.allocated_peak_bytes as u64),
        format_size(last.reserved_peak_bytes as u64),
        last.alloc_conf,
        format_size(context as u64),
        rounds.len()
    ))
}

/// The fastest plan within `planning`; after a tightening (`tightened`), a lowered budget that
/// nothing fits falls back to the smallest peak checkpointing reaches, whose reserved memory may
/// still fit (the budget only bounds the tensors).
fn solve_or_smallest(profile: &ProfileJson, planning: i64, shape: &ShapeJson, tightened: bool) -> Result<PlanJson> {
    match plan_from_profile(profile, planning, shape.clone(), None) {
        Ok(p) => Ok(p),
        Err(e) if !tightened => Err(e),
        Err(e) => match e.downcast_ref::<PlanFailure>() {
            Some(f) if f.min_peak > planning => plan_from_profile(profile, f.min_peak, shape.clone(), None),
            _ => Err(e),
        },
    }
}

/// Records two steps of `plan` on the meta device (the second the steady state, the first
/// making the optimizer state), puts `workspaces` in front, and replays the trace under
/// every candidate setting.
fn simulate(plan: &PlanJson, ov: &CudaOverheads, quiet: bool) -> Result<Simulated> {
    let workspaces = &[ov.workspace_bytes; WORKSPACES_PER_STEP];
    let (mut setup, cfg) = setup_for_plan(plan, quiet)?;
    setup.for_cuda_on(ov);
    let _lock = meter::exclusive();
    // Started before the model is built, so its parameters are in the trace.
    let rec = Recording::start()?;
    let mut s = setup
        .fake_session(&cfg)
        .context("recording the plan's step on the meta device")?;
    let (mask, _) = apply_plan(plan, &mut s)?;
    let (log, _) = record_steps(&mut s, &mask, rec).context("recording the plan's step on the meta device")?;
    drop(s);
    let events = trace_events(&log, workspaces);
    let (peaks, best) = peaks_by_conf(&events, &CANDIDATE_CONFS).map_err(|e| anyhow!("{e}"))?;
    Ok(Simulated { events, peaks, best })
}

fn peaks_json(p: &ConfPeaks) -> AllocConfPeaksJson {
    AllocConfPeaksJson {
        alloc_conf: p.conf.clone(),
        allocated_peak_bytes: p.allocated_peak as i64,
        reserved_peak_bytes: p.reserved_peak as i64,
    }
}
