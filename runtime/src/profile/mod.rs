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
use ckptune_kernels::sac::SacPolicy;
use ckptune_solver::model;
pub use ckptune_solver::profile::{
    BlockProfile, ConfigProfile, Contention, FixedBytes, GroupProfile, RegimeProfile, ReservedPeaks, Stats,
};

use crate::error::Result;
use crate::exec::{Session, StepTrace};
use crate::progress::progress_bar;

mod estimated;
mod moments;
mod one_step;
mod selective;
mod terms;
pub mod timing;

pub use estimated::times_from_fake_step;
pub use moments::measured_moments;
pub use one_step::{times_from_steps, FirstStep, StagedSteps, StepTimes};
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
    /// Also measure every candidate block run selective under each of these policies (one step
    /// S per policy), choices per block beside keep and checkpoint.
    pub selective: Vec<SacPolicy>,
}

impl Default for ProfileSettings {
    fn default() -> Self {
        Self {
            repeats: 3,
            quiet: false,
            retime: RetimePolicy::default(),
            selective: Vec::new(),
        }
    }
}

/// Profiles `session`'s config. The session's model must be fresh or in the same regime
/// (profiling trains it for a few steps; its weights change).
pub fn profile(session: &mut Session, settings: &ProfileSettings) -> Result<ConfigProfile> {
    // A loop that keeps autocast's cache on holds each block's casts until the loss; measured
    // with the cache released block by block, each block's casts are a term of their own
    // (`cache_grad`, `cache_nograd`) the memory model adds back.
    let held = std::mem::replace(&mut session.hold_casts, false);
    let profiled = profile_released(session, settings);
    session.hold_casts = held;
    let mut p = profiled?;
    if p.config.autocast_cache {
        let units = session.chain.units();
        p.peak_none = model::peak_at(&p, &vec![false; units]).0;
        p.peak_all = model::peak_at(&p, &StepKinds::of(&session.chain).all).0;
    }
    Ok(p)
}

fn profile_released(session: &mut Session, settings: &ProfileSettings) -> Result<ConfigProfile> {
    meter::install()?;
    let t0 = Instant::now();
    let plan = StepKinds::of(&session.chain);
    let repeats = settings.repeats.max(1);
    let steps = measured_steps(session, &plan, repeats, settings)?;
    // With groups, A is the fused step and A′ gives the blocks' plain terms.
    let plain = steps.trace_split.as_ref().unwrap_or(&steps.trace_a);
    let fused = steps.trace_split.as_ref().map(|_| &steps.trace_a);
    let mut regimes = Vec::new();
    for (k, label) in ["first micro-step", "accumulating micro-step"]
        .into_iter()
        .enumerate()
        .take(steps.trace_a.micro.len().min(2))
    {
        regimes.push(terms::regime(
            label,
            &plain.micro[k],
            &steps.trace_b.micro[k],
            steps.trace_c.micro.get(k).zip(fused.map(|f| &f.micro[k])),
            &session.chain,
        )?);
    }
    // Every sample of S is instrumented: memory and recompute times come from the trace.
    let mut selective_steps = 0;
    for &policy in &settings.selective {
        selective_steps += selective::measure(session, policy, &plan.all, repeats, plain, &mut regimes)?;
    }
    let recompute_class = work_classes(session, &regimes);
    let recompute_spread = recompute_estimates(session, &steps, &recompute_class);
    let mut tally = ContentionTally::default();
    tally.add(&steps.samples_a);
    tally.add(&steps.samples_b);
    tally.add(&steps.samples_c);
    let fixed = fixed_bytes(session, steps.trace_a.micro[0].start);
    Ok(ConfigProfile {
        config: session.cfg.spec(),
        fixed,
        regimes,
        optimizer_peak: steps.trace_a.opt_peak,
        peak_none: steps.peak_none,
        peak_all: steps.peak_all,
        seconds_none: timing::seconds(&steps.samples_a),
        seconds_all: timing::seconds(&steps.samples_b),
        recompute_seconds: recompute_spread.iter().map(|s| s.median).collect(),
        steps_run: plan.kinds + plan.kinds * repeats + plan.split_steps + steps.retimed + selective_steps,
        wall_seconds: t0.elapsed().as_secs_f64(),
        recompute_spread,
        recompute_class,
        contention: tally.finish(steps.retimed),
        estimated: None,
        reserved: steps
            .reserved_none
            .zip(steps.reserved_all)
            .map(|(none, all)| ReservedPeaks { none, all }),
    })
}

/// The checkpoint masks of the profiler's kinds of step: A (nothing checkpointed), B (every
/// candidate block), and for chains with groups C (every group whole).
struct StepKinds {
    none: Vec<bool>,
    all: Vec<bool>,
    grouped: Option<Vec<bool>>,
    kinds: usize,
    /// One more step with groups: A′, instrumented once with fusing off.
    split_steps: usize,
}

impl StepKinds {
    fn of(chain: &ckptune_models::Chain) -> Self {
        let n = chain.blocks.len();
        let none = vec![false; chain.units()];
        let all: Vec<bool> = (0..chain.units()).map(|i| i < n && chain.unit_candidate(i)).collect();
        // Chains with groups: step C checkpoints every group whole, and step A (nothing
        // checkpointed) runs them fused as in production, so one more step, instrumented once
        // and with fusing off, measures the blocks' own plain terms (A′).
        let grouped: Option<Vec<bool>> =
            (!chain.groups.is_empty()).then(|| (0..chain.units()).map(|i| i >= n).collect());
        let kinds = 2 + usize::from(grouped.is_some());
        let split_steps = usize::from(grouped.is_some());
        StepKinds {
            none,
            all,
            grouped,
            kinds,
            split_steps,
        }
    }
}

/// What the profiler's steps measured: the instrumented traces of A, B, C and A′, the timed
/// samples of each kind, the peaks of A and B, and how many samples were re-timed.
struct MeasuredSteps {
    trace_a: StepTrace,
    trace_b: StepTrace,
    trace_c: StepTrace,
    trace_split: Option<StepTrace>,
    samples_a: Vec<Sample<()>>,
    samples_b: Vec<UnitSample>,
    samples_c: Vec<UnitSample>,
    peak_none: i64,
    peak_all: i64,
    /// CUDA: the reserved peaks of the steps `peak_none` and `peak_all` come from.
    reserved_none: Option<i64>,
    reserved_all: Option<i64>,
    retimed: usize,
}

/// Warm-up steps, then `repeats` steps of each kind, the first of each instrumented, then A′,
/// then contended samples re-timed after all the instrumented steps, so the steps memory comes
/// from run exactly as they would on a quiet machine.
fn measured_steps(
    session: &mut Session,
    plan: &StepKinds,
    repeats: usize,
    settings: &ProfileSettings,
) -> Result<MeasuredSteps> {
    let pb = progress_bar(
        (plan.kinds + plan.kinds * repeats + plan.split_steps) as u64,
        &format!("profiling {}", session.cfg.label()),
        settings.quiet,
    );
    session.step(&plan.none, None)?;
    pb.inc(1);
    session.step(&plan.all, None)?;
    pb.inc(1);
    if let Some(c) = &plan.grouped {
        session.step(c, None)?;
        pb.inc(1);
    }
    let mut m = MeasuredSteps {
        trace_a: StepTrace::default(),
        trace_b: StepTrace::default(),
        trace_c: StepTrace::default(),
        trace_split: None,
        samples_a: Vec::new(),
        samples_b: Vec::new(),
        samples_c: Vec::new(),
        peak_none: 0,
        peak_all: 0,
        reserved_none: None,
        reserved_all: None,
        retimed: 0,
    };
    // Timed samples per kind of step: A (nothing checkpointed), B (every candidate block
    // checkpointed; with each block's no-grad forward time), C (every group checkpointed; with
    // each group's). The first of each is instrumented.
    for r in 0..repeats {
        let ra = session.step(&plan.none, if r == 0 { Some(&mut m.trace_a) } else { None })?;
        pb.inc(1);
        m.samples_a.push(Sample::of(&ra, ()));
        if r == 0 {
            m.peak_none = ra.peak_bytes;
            m.reserved_none = ra.reserved_peak_bytes;
        }
        let (sb, tb, peak, reserved) = step_b(session, &plan.all)?;
        pb.inc(1);
        if r == 0 {
            m.peak_all = peak;
            m.reserved_all = reserved;
            m.trace_b = tb;
        }
        m.samples_b.push(sb);
        if let Some(c) = &plan.grouped {
            let (sc, tc) = step_c(session, c)?;
            pb.inc(1);
            if r == 0 {
                m.trace_c = tc;
            }
            m.samples_c.push(sc);
        }
    }
    // A′: the blocks' plain terms, with boundaries inside groups.
    if plan.grouped.is_some() {
        let mut t = StepTrace::default();
        session.fuse_groups = false;
        let r = session.step(&plan.none, Some(&mut t));
        session.fuse_groups = true;
        r?;
        pb.inc(1);
        m.trace_split = Some(t);
    }
    let mut retimer = Retimer::new(settings.retime);
    retimer.retime(&mut m.samples_a, || {
        Ok(Sample::of(&session.step(&plan.none, None)?, ()))
    })?;
    retimer.retime(&mut m.samples_b, || Ok(step_b(session, &plan.all)?.0))?;
    if let Some(c) = &plan.grouped {
        retimer.retime(&mut m.samples_c, || Ok(step_c(session, c)?.0))?;
    }
    m.retimed = retimer.retimed;
    pb.inc_length(m.retimed as u64);
    pb.inc(m.retimed as u64);
    pb.finish_and_clear();
    Ok(m)
}

/// Per unit, the spread of its recompute time: the no-grad forward, which is what
/// checkpointing adds (the recompute replaces the grad-mode forward of a plain step), from the
/// samples the estimates use. Units doing the same work (`recompute_class`) share one estimate
/// over all their samples.
fn recompute_estimates(session: &Session, steps: &MeasuredSteps, recompute_class: &[usize]) -> Vec<Stats> {
    let n = session.chain.blocks.len();
    let (used_b, used_c) = (timing::used(&steps.samples_b), timing::used(&steps.samples_c));
    let unit_samples: Vec<Option<Vec<f64>>> = (0..recompute_class.len())
        .map(|u| {
            if u < n && !session.chain.blocks[u].candidate {
                return None;
            }
            let (used, i) = if u < n { (&used_b, u) } else { (&used_c, u - n) };
            Some(used.iter().map(|s| s.extra[i]).collect())
        })
        .collect();
    pooled_by_class(&unit_samples, recompute_class)
}

/// Per unit (blocks, then groups), its no-grad forward seconds in each of `samples`, each a step
/// with every candidate block checkpointed given as its blocks' no-grad forward seconds; `None`
/// for a block that is not a candidate. Such a step runs no group as one piece, so a group's is
/// its blocks' sum.
fn unit_forwards(chain: &ckptune_models::Chain, samples: &[&[f64]]) -> Vec<Option<Vec<f64>>> {
    let n = chain.blocks.len();
    (0..chain.units())
        .map(|u| match chain.blocks.get(u) {
            Some(b) => b.candidate.then(|| samples.iter().map(|s| s[u]).collect()),
            None => {
                let g = &chain.groups[u - n];
                Some(samples.iter().map(|s| s[g.first..=g.last].iter().sum()).collect())
            }
        })
        .collect()
}

/// Per unit, the spread of its class's samples pooled (units of one `class` share one estimate);
/// an empty spread for a unit without samples (a block that is not a candidate).
fn pooled_by_class(unit_samples: &[Option<Vec<f64>>], class: &[usize]) -> Vec<Stats> {
    let class_of = |u: usize| class.get(u).copied().unwrap_or(u);
    (0..unit_samples.len())
        .map(|u| match unit_samples[u] {
            None => Stats::default(),
            Some(_) => {
                let pooled: Vec<f64> = (0..unit_samples.len())
                    .filter(|&v| class_of(v) == class_of(u))
                    .filter_map(|v| unit_samples[v].as_ref())
                    .flatten()
                    .copied()
                    .collect();
                Stats::of(&pooled)
            }
        })
        .collect()
}

/// The bytes alive when a step starts (`start`, the meter's level), by what they are.
fn fixed_bytes(session: &mut Session, start: i64) -> FixedBytes {
    let (parameters, buffers) = session.param_and_buffer_bytes();
    let batch = batch_bytes(session);
    let gradients = if session.cfg.set_to_none {
        0
    } else {
        session.grad_bytes()
    };
    let optimizer_state = session.optimizer_state_bytes();
    FixedBytes {
        parameters,
        buffers,
        gradients,
        optimizer_state,
        master_weights: 0,
        batch,
        other: start - parameters - buffers - gradients - optimizer_state - batch,
    }
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
/// no-grad forward seconds (summed over micro-steps), its trace, its peak and (CUDA) its reserved peak.
fn step_b(session: &mut Session, all: &[bool]) -> Result<(UnitSample, StepTrace, i64, Option<i64>)> {
    let mut tb = StepTrace::default();
    let rb = session.step(all, Some(&mut tb))?;
    let fwd_ng = (0..session.chain.blocks.len())
        .map(|i| tb.micro.iter().map(|m| m.blocks[i].fwd_seconds).sum::<f64>())
        .collect();
    Ok((Sample::of(&rb, fwd_ng), tb, rb.peak_bytes, rb.reserved_peak_bytes))
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
