//! The one-pass profiler: a constant number of instrumented steps per config, whatever the
//! number of candidate blocks, yields every term of the chain memory model (`docs/memory-model.md`) and
//! the per-block recompute times, as the solver crate's profile types.
//!
//! Steps per config: 2 warm-up steps (nothing checkpointed, then everything: optimizer state,
//! lazily allocated gradients and oneDNN's primitive caches exist afterwards), then `repeats`
//! steps with nothing checkpointed (step A; the first is instrumented) and `repeats` with every
//! candidate checkpointed (step B; the first is instrumented). Memory comes from the two
//! instrumented steps; times are medians over the repeats.
//!
//! Terms are differences of absolute meter levels, with the level before each moment taken
//! from the model itself, so the model reproduces steps A and B exactly by construction; what
//! the sweep checks is that blocks combine independently (they do on a clean chain).

use std::time::Instant;

use ckptune_kernels::meter;
pub use ckptune_solver::profile::{BlockProfile, ConfigProfile, FixedBytes, GroupProfile, RegimeProfile, Stats};

use crate::error::Result;
use crate::exec::{Session, StepTrace};
use crate::progress::progress_bar;

mod moments;
mod terms;

pub use moments::measured_moments;

/// Profiling settings.
#[derive(Debug, Clone)]
pub struct ProfileSettings {
    /// Timed repeats of each of steps A and B (≥ 1).
    pub repeats: usize,
    pub quiet: bool,
}

impl Default for ProfileSettings {
    fn default() -> Self {
        Self {
            repeats: 3,
            quiet: false,
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
    let mut group_secs: Vec<Vec<f64>> = vec![Vec::new(); session.chain.groups.len()];
    let mut trace_a = StepTrace::default();
    let mut trace_b = StepTrace::default();
    let mut secs_a = Vec::new();
    let mut secs_b = Vec::new();
    let mut fwd_ng: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut peak_none = 0;
    let mut peak_all = 0;
    for r in 0..repeats {
        let ra = session.step(&none, if r == 0 { Some(&mut trace_a) } else { None })?;
        pb.inc(1);
        secs_a.push(ra.seconds);
        if r == 0 {
            peak_none = ra.peak_bytes;
        }
        let mut tb = StepTrace::default();
        let rb = session.step(&all, Some(&mut tb))?;
        pb.inc(1);
        secs_b.push(rb.seconds);
        for (i, v) in fwd_ng.iter_mut().enumerate() {
            v.push(tb.micro.iter().map(|m| m.blocks[i].fwd_seconds).sum::<f64>());
        }
        if r == 0 {
            peak_all = rb.peak_bytes;
            trace_b = tb;
        }
        if let Some(c) = &grouped {
            let mut tc = StepTrace::default();
            session.step(c, Some(&mut tc))?;
            pb.inc(1);
            for (g, v) in session.chain.groups.iter().zip(group_secs.iter_mut()) {
                v.push(
                    tc.micro
                        .iter()
                        .map(|m| m.blocks[g.first..=g.last].iter().map(|b| b.fwd_seconds).sum::<f64>())
                        .sum(),
                );
            }
            if r == 0 {
                trace_c = tc;
            }
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
    // forward of a plain step).
    let recompute_seconds: Vec<f64> = fwd_ng
        .iter()
        .zip(&session.chain.blocks)
        .map(|(v, b)| if b.candidate { Stats::of(v).median } else { 0.0 })
        .chain(group_secs.iter().map(|v| Stats::of(v).median))
        .collect();

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
        seconds_none: Stats::of(&secs_a),
        seconds_all: Stats::of(&secs_b),
        recompute_seconds,
        steps_run: kinds + kinds * repeats + split_steps,
        wall_seconds: t0.elapsed().as_secs_f64(),
    })
}

fn batch_bytes(session: &mut Session) -> i64 {
    let b = session.make_batch();
    let mut n = crate::exec::nbytes(&b.input) + crate::exec::nbytes(&b.target);
    if let Some(m) = &b.attention_mask {
        n += crate::exec::nbytes(m);
    }
    n
}
