//! Times from the cost model (docs/cost-model.md) instead of timed steps: one step with every
//! candidate checkpointed is traced (on the meta device, a fake session computes nothing), and
//! each operator's work over a device's rates gives each block's no-grad forward (its recompute
//! estimate), the whole step (with everything checkpointed) and, less those forwards, the step
//! with nothing checkpointed — the same decomposition [`super::profile`] measures.

use std::time::Instant;

use ckptune_kernels::sac::SacPolicy;
use ckptune_solver::profile::{BlockEstimate, Contention, Estimate, Stats};
use ckptune_solver::rates::DeviceRates;

use super::{pooled_by_class, unit_forwards, StepTimes};
use crate::cost::{self, PhaseSeconds};
use crate::error::Result;
use crate::exec::Session;

/// Estimates `session`'s times over `rates` from a trace of one step with every candidate
/// checkpointed (after a step that creates the optimizer's state). `recompute_class` is the
/// profile's: per unit (blocks, then groups), the first unit doing the same work; units of a
/// class share one estimate, as measured ones do. A group's recompute is its blocks' no-grad
/// forwards. The estimate says where the operators were traced (`meta` for a fake session) and
/// over which rates, with each block's forward, no-grad forward and backward.
///
/// With `selective`, a profile offering selective checkpointing under those policies, one more
/// step per policy is traced with every candidate block selective (step S), and each block's selective
/// recompute is the work of the operators its recompute runs, those the policy saves taken
/// from the forward's cache at a call's overhead ([`cost::selective_phase_seconds`]).
pub fn times_from_fake_step(
    session: &mut Session,
    recompute_class: &[usize],
    rates: &DeviceRates,
    selective: &[SacPolicy],
) -> Result<(StepTimes, Estimate)> {
    let t0 = Instant::now();
    let all = session.chain.every_candidate();
    let events = session.op_trace(&all)?;
    let phases = cost::phase_seconds(&events, session.chain.blocks.len(), rates);
    let selective_seconds = selective
        .iter()
        .map(|&policy| selective_recomputes(session, policy, &all, rates, &phases))
        .collect::<Result<Vec<_>>>()?;
    let mut times = step_times(session, recompute_class, &phases, t0.elapsed().as_secs_f64());
    times.selective_seconds = selective_seconds.clone();
    let chain = &session.chain;
    let blocks = (0..chain.blocks.len())
        .map(|i| {
            let candidate = chain.blocks[i].candidate;
            BlockEstimate {
                // A checkpointed block's grad-mode forward is its recompute.
                forward: if candidate {
                    phases.recompute[i]
                } else {
                    phases.forward[i]
                },
                nograd_forward: if candidate { phases.forward[i] } else { 0.0 },
                backward: phases.backward[i],
                selective_recompute: match candidate {
                    true => selective_seconds.iter().map(|s| s[i]).collect(),
                    false => Vec::new(),
                },
            }
        })
        .collect();
    let estimate = Estimate {
        traced_on: if session.is_fake() { "meta" } else { "cpu" }.into(),
        rates: rates.clone(),
        blocks,
        pace: None,
    };
    Ok((times, estimate))
}

/// Per block, its recompute's estimated seconds in a step with every candidate block of
/// `session` selective under `policy` (0 for a block that is not a candidate): the full
/// checkpoint's recompute estimate (its no-grad forward, in `full`, the step with every
/// candidate checkpointed) less what the selective recompute saves against the full one. On the
/// same basis as the full estimate, so that a block whose policy saves nothing costs what its
/// full checkpoint does (a recompute's runtime time around the block differs from a no-grad
/// forward's; docs/cost-model.md).
fn selective_recomputes(
    session: &mut Session,
    policy: SacPolicy,
    all: &[bool],
    rates: &DeviceRates,
    full: &PhaseSeconds,
) -> Result<Vec<f64>> {
    let n = session.chain.blocks.len();
    let selective: Vec<Option<SacPolicy>> = (0..n)
        .map(|i| session.chain.blocks[i].candidate.then_some(policy))
        .collect();
    let before = std::mem::replace(&mut session.selective, selective.clone());
    let traced = session.op_trace(all);
    session.selective = before;
    let recompute = cost::selective_phase_seconds(&traced?, &selective, rates).recompute;
    let blocks = &session.chain.blocks;
    Ok((0..n)
        .map(|i| match blocks[i].candidate {
            true => (full.forward[i] - (full.recompute[i] - recompute[i])).max(0.0),
            false => 0.0,
        })
        .collect())
}

/// The profile's times from a step's estimated parts (every candidate block checkpointed).
fn step_times(session: &Session, recompute_class: &[usize], phases: &PhaseSeconds, wall_seconds: f64) -> StepTimes {
    let unit_seconds = unit_forwards(&session.chain, &[&phases.forward]);
    let recompute_spread = pooled_by_class(&unit_seconds, recompute_class);
    let all = phases.total();
    let blocks = session.chain.blocks.len();
    let forwards: f64 = unit_seconds[..blocks].iter().flatten().flatten().sum();
    StepTimes {
        seconds_none: Stats::of(&[all - forwards]),
        seconds_all: Stats::of(&[all]),
        recompute_spread,
        contention: Contention::default(),
        // Nothing was timed.
        steps_run: 0,
        wall_seconds,
        selective_seconds: Vec::new(),
    }
}
