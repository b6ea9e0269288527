//! The one-pass profiler: a constant number of instrumented steps per config, whatever the
//! number of candidate blocks, yields every term of the chain memory model (`docs/memory-model.md`) and
//! the per-block recompute times, as the solver crate's profile types.
//!
//! Steps per config: 2 warm-up steps (nothing checkpointed, then everything: optimizer state,
//! lazily allocated gradients and oneDNN's primitive caches exist afterwards), then `repeats`
//! steps with nothing checkpointed (step A; the first is instrumented) and `repeats` with every
//! candidate checkpointed (step B; the first is instrumented). Memory comes from the two
//! instrumented steps; times are medians over the repeats' quiet samples: a sample timed while
//! the rest of the machine was busy is re-timed after the instrumented steps (docs/timing.md).
//!
//! Terms are differences of absolute meter levels, with the level before each moment taken
//! from the model itself, so the model reproduces steps A and B exactly by construction; what
//! the sweep checks is that blocks combine independently (they do on a clean chain).

use std::time::Instant;

use ckptune_kernels::meter;
pub use ckptune_solver::profile::{
    BlockProfile, ConfigProfile, Contention, FixedBytes, GroupProfile, RegimeProfile, Stats,
};

use crate::error::Result;
use crate::exec::{Session, StepTrace};
use crate::progress::progress_bar;

mod moments;
mod terms;
pub mod timing;

pub use moments::measured_moments;
pub use timing::RetimePolicy;
use timing::{ContentionTally, Retimer, Sample};

/// Profiling settings.
#[derive(Debug, Clone)]
pub struct ProfileSettings {
    /// Timed repeats of each of steps A and B (≥ 1).
    pub repeats: usize,
    pub quiet: bool,
    /// How samples timed while the machine was busy are re-timed.
    pub retime: RetimePolicy,
}

impl Default for ProfileSettings {
    fn default() -> Self {
        Self {
            repeats: 3,
            quiet: false,
            retime: RetimePolicy::default(),
        }
    }
}

/// Profiles `session`'s config. The session's model must be fresh or in the same regime
/// (profiling trains it for a few steps; its weights change).
pub fn profile(session: &mut Session, settings: &ProfileSettings) -> Result<ConfigProfile> {
    meter::install()?;
    let t0 = Instant::now();
    let repeats = settings.repeats.max(1);
    let n = session.chain.blocks.len();
    let chain = &session.chain;
    let none = vec![false; chain.units()];
    let all: Vec<bool> = (0..chain.units()).map(|i| i < n && chain.unit_candidate(i)).collect();
    // Chains with groups: step C checkpoints every group whole, and step A (nothing
    // checkpointed) runs them fused as in production, so one more step, instrumented once
    // and with fusing off, measures the blocks' own plain terms (A′).
    let grouped: Option<Vec<bool>> = (!chain.groups.is_empty()).then(|| (0..chain.units()).map(|i| i >= n).collect());
    let kinds = 2 + usize::from(grouped.is_some());
    let split_steps = usize::from(grouped.is_some());
    let pb = progress_bar(
        (kinds + kinds * repeats + split_steps) as u64,
        &format!("profiling {}", session.cfg.label()),
        settings.quiet,
    );

    session.step(&none, None)?;
    pb.inc(1);
    session.step(&all, None)?;
    pb.inc(1);
    if let Some(c) = &grouped {
        session.step(c, None)?;
        pb.inc(1);
    }

    let mut trace_c = StepTrace::default();
    let mut trace_a = StepTrace::default();
    let mut trace_b = StepTrace::default();
    // Timed samples per kind of step: A (nothing checkpointed), B (every candidate block
    // checkpointed; with each block's no-grad forward time), C (every group checkpointed; with
    // each group's). The first of each is instrumented.
    let mut samples_a: Vec<Sample<()>> = Vec::new();
    let mut samples_b: Vec<UnitSample> = Vec::new();
    let mut samples_c: Vec<UnitSample> = Vec::new();
    let mut peak_none = 0;
    let mut peak_all = 0;
    for r in 0..repeats {
        let ra = session.step(&none, if r == 0 { Some(&mut trace_a) } else { None })?;
        pb.inc(1);
        samples_a.push(Sample::of(&ra, ()));
        if r == 0 {
            peak_none = ra.peak_bytes;
        }
        let (sb, tb, peak) = step_b(session, &all)?;
        pb.inc(1);
        if r == 0 {
            peak_all = peak;
            trace_b = tb;
        }
        samples_b.push(sb);
        if let Some(c) = &grouped {
            let (sc, tc) = step_c(session, c)?;
            pb.inc(1);
            if r == 0 {
                trace_c = tc;
            }
            samples_c.push(sc);
        }
    }
    // A′: the blocks' plain terms, with boundaries inside groups.
    let trace_split = match &grouped {
        None => None,
        Some(_) => {
            let mut t = StepTrace::default();
            session.fuse_groups = false;
            let r = session.step(&none, Some(&mut t));
            session.fuse_groups = true;
            r?;
            pb.inc(1);
            Some(t)
        }
    };
    // Contended samples are re-timed after the instrumented steps, so the steps memory comes
    // from run exactly as they would on a quiet machine.
    let mut retimer = Retimer::new(settings.retime);
    retimer.retime(&mut samples_a, || Ok(Sample::of(&session.step(&none, None)?, ())))?;
    retimer.retime(&mut samples_b, || Ok(step_b(session, &all)?.0))?;
    if let Some(c) = &grouped {
        retimer.retime(&mut samples_c, || Ok(step_c(session, c)?.0))?;
    }
    let retimed = retimer.retimed;
    pb.inc_length(retimed as u64);
    pb.inc(retimed as u64);
    pb.finish_and_clear();

    // With groups, A is the fused step and A′ gives the blocks' plain terms.
    let plain = trace_split.as_ref().unwrap_or(&trace_a);
    let fused = trace_split.as_ref().map(|_| &trace_a);
    let mut regimes = Vec::new();
    for (k, label) in ["first micro-step", "accumulating micro-step"]
        .into_iter()
        .enumerate()
        .take(trace_a.micro.len().min(2))
    {
        regimes.push(terms::regime(
            label,
            &plain.micro[k],
            &trace_b.micro[k],
            trace_c.micro.get(k).zip(fused.map(|f| &f.micro[k])),
            &session.chain,
        )?);
    }
    // The no-grad forward is what checkpointing adds (the recompute replaces the grad-mode
    // forward of a plain step), from the samples the estimates use.
    // Units doing the same work share one estimate over all their samples.
    let recompute_class = work_classes(session, &regimes);
    let (used_b, used_c) = (timing::used(&samples_b), timing::used(&samples_c));
    let unit_samples: Vec<Vec<f64>> = (0..recompute_class.len())
        .map(|u| {
            let (used, i) = if u < n { (&used_b, u) } else { (&used_c, u - n) };
            used.iter().map(|s| s.extra[i]).collect()
        })
        .collect();
    let recompute_spread: Vec<Stats> = (0..recompute_class.len())
        .map(|u| {
            if u < n && !session.chain.blocks[u].candidate {
                return Stats::default();
            }
            let pooled: Vec<f64> = (0..recompute_class.len())
                .filter(|&v| recompute_class[v] == recompute_class[u])
                .flat_map(|v| unit_samples[v].iter().copied())
                .collect();
            Stats::of(&pooled)
        })
        .collect();
    let recompute_seconds = recompute_spread.iter().map(|s| s.median).collect();
    let mut tally = ContentionTally::default();
    tally.add(&samples_a);
    tally.add(&samples_b);
    tally.add(&samples_c);

    let (parameters, buffers) = session.param_and_buffer_bytes();
    let start = trace_a.micro[0].start;
    let batch = batch_bytes(session);
    let gradients = if session.cfg.set_to_none {
        0
    } else {
        session.grad_bytes()
    };
    let optimizer_state = session.optimizer_state_bytes();
    let fixed = FixedBytes {
        parameters,
        buffers,
        gradients,
        optimizer_state,
        master_weights: 0,
        batch,
        other: start - parameters - buffers - gradients - optimizer_state - batch,
    };
    Ok(ConfigProfile {
        config: session.cfg.spec(),
        fixed,
        regimes,
        optimizer_peak: trace_a.opt_peak,
        peak_none,
        peak_all,
        seconds_none: timing::seconds(&samples_a),
        seconds_all: timing::seconds(&samples_b),
        recompute_seconds,
        steps_run: kinds + kinds * repeats + split_steps + retimed,
        wall_seconds: t0.elapsed().as_secs_f64(),
        recompute_spread,
        recompute_class,
        contention: tally.finish(retimed),
    })
}

/// A unit's byte terms in every regime, and its parameters (name under the unit, shape,
/// element bytes).
type WorkKey = (Vec<i64>, Vec<(String, Vec<i64>, i64)>);

/// Per unit (blocks, then groups), the first unit doing the same work: the same byte terms in
/// every regime (position aside, [`BlockProfile::work_key`]) and the same parameter shapes under
/// its module. Blocks that are not candidates are their own class.
fn work_classes(session: &Session, regimes: &[RegimeProfile]) -> Vec<usize> {
    let chain = &session.chain;
    let params = chain.parameter_shapes();
    let shapes_under = |module: &str| -> Vec<(String, Vec<i64>, i64)> {
        let prefix = format!("{module}.");
        params
            .iter()
            .filter_map(|(name, shape, e)| {
                name.strip_prefix(&prefix)
                    .map(|rest| (rest.to_owned(), shape.clone(), *e))
            })
            .collect()
    };
    let n = chain.blocks.len();
    let keys: Vec<Option<WorkKey>> = (0..n + chain.groups.len())
        .map(|u| {
            if u < n {
                let b = &chain.blocks[u];
                b.candidate.then(|| {
                    let terms = regimes.iter().flat_map(|r| r.blocks[u].work_key()).collect();
                    (terms, shapes_under(&b.name))
                })
            } else {
                let g = &chain.groups[u - n];
                let terms = regimes.iter().flat_map(|r| r.groups[u - n].work_key()).collect();
                Some((terms, shapes_under(&g.name)))
            }
        })
        .collect();
    (0..keys.len())
        .map(|u| match &keys[u] {
            None => u,
            // A group and a block never share a class: their samples come from different steps.
            Some(k) => (0..u)
                .find(|&v| (v < n) == (u < n) && keys[v].as_ref() == Some(k))
                .unwrap_or(u),
        })
        .collect()
}

/// A timed step with the seconds of each block or group in it.
type UnitSample = Sample<Vec<f64>>;

/// Step B (every candidate block checkpointed), instrumented: its sample with each block's
/// no-grad forward seconds (summed over micro-steps), its trace and its peak.
fn step_b(session: &mut Session, all: &[bool]) -> Result<(UnitSample, StepTrace, i64)> {
    let mut tb = StepTrace::default();
    let rb = session.step(all, Some(&mut tb))?;
    let fwd_ng = (0..session.chain.blocks.len())
        .map(|i| tb.micro.iter().map(|m| m.blocks[i].fwd_seconds).sum::<f64>())
        .collect();
    Ok((Sample::of(&rb, fwd_ng), tb, rb.peak_bytes))
}

/// Step C (every group checkpointed whole), instrumented: its sample with each group's no-grad
/// forward seconds, and its trace.
fn step_c(session: &mut Session, groups: &[bool]) -> Result<(UnitSample, StepTrace)> {
    let mut tc = StepTrace::default();
    let rc = session.step(groups, Some(&mut tc))?;
    let secs = session
        .chain
        .groups
        .iter()
        .map(|g| {
            tc.micro
                .iter()
                .map(|m| m.blocks[g.first..=g.last].iter().map(|b| b.fwd_seconds).sum::<f64>())
                .sum()
        })
        .collect();
    Ok((Sample::of(&rc, secs), tc))
}

fn batch_bytes(session: &mut Session) -> i64 {
    let b = session.make_batch();
    let mut n = crate::exec::nbytes(&b.input) + crate::exec::nbytes(&b.target);
    if let Some(m) = &b.attention_mask {
        n += crate::exec::nbytes(m);
    }
    n
}
