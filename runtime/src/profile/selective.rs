//! Step S, for a profile that offers selective checkpointing (`ProfileSettings::selective`),
//! once per policy: every candidate block selective under the policy, `repeats` times after
//! one warm-up, the
//! first instrumented. A selective block runs as a checkpointed one does, so its terms are a
//! checkpointed block's terms read from step S instead of step B (`terms::regime` with S in
//! B's place), against step A's plain terms as every other term is; its recompute time is the
//! median of its recompute in the S steps (what it adds to a plain step: its forward runs once
//! either way, the recompute of the cheap operators is extra).

use ckptune_kernels::sac::SacPolicy;
use ckptune_solver::profile::{RegimeProfile, SelectiveProfile, Stats};

use super::terms;
use crate::error::{Result, RuntimeError};
use crate::exec::{Session, StepTrace};

/// Runs step S under `policy` on `session` (1 warm-up and `repeats` steps) and appends each
/// candidate block's selective terms under it to `regimes`, measured against `plain` (step
/// A's, or A′'s, trace).
pub(super) fn measure(
    session: &mut Session,
    policy: SacPolicy,
    all: &[bool],
    repeats: usize,
    plain: &StepTrace,
    regimes: &mut [RegimeProfile],
) -> Result<usize> {
    if !session.chain.groups.is_empty() {
        return Err(RuntimeError::Invalid(format!(
            "selective checkpointing of {}: a layer runs selective as one block; profile it with \
             --granularity layer (nested candidates cannot be selective)",
            session.chain.name
        )));
    }
    let (trace, seconds) = selective_steps(session, policy, all, repeats)?;
    for (k, regime) in regimes.iter_mut().enumerate() {
        let s = terms::regime(&regime.label, &plain.micro[k], &trace.micro[k], None, &session.chain)?;
        for (i, (b, t)) in regime.blocks.iter_mut().zip(&s.blocks).enumerate() {
            if !b.candidate {
                continue;
            }
            b.selective.push(SelectiveProfile {
                policy: policy.name().to_owned(),
                kept: t.kept_nograd,
                fwd_transient: t.fwd_transient_nograd,
                cache: t.cache_nograd.unwrap_or(0),
                rec_transient: t.rec_transient,
                kept_recompute: t.kept_recompute,
                bwd_transient: t.bwd_transient_ckpt,
                out_released: t.out_released_ckpt.unwrap_or(0),
                held_output: trace.micro[k].blocks[i].sel_held,
                rec_seconds: Stats::of(&seconds[i]).median,
            });
        }
    }
    Ok(1 + repeats)
}

/// Per block, its recompute seconds as a selective block (the median of `repeats` real steps S
/// after a warm-up), for a profile whose memory was measured on the meta device
/// ([`super::times_from_steps`]); the steps run.
pub(super) fn real_seconds(
    session: &mut Session,
    policy: SacPolicy,
    all: &[bool],
    repeats: usize,
) -> Result<(Vec<f64>, usize)> {
    let (_, seconds) = selective_steps(session, policy, all, repeats)?;
    Ok((seconds.iter().map(|s| Stats::of(s).median).collect(), 1 + repeats))
}

/// [`steps`] with every block of `session` selective under `policy`.
fn selective_steps(
    session: &mut Session,
    policy: SacPolicy,
    all: &[bool],
    repeats: usize,
) -> Result<(StepTrace, Vec<Vec<f64>>)> {
    let n = session.chain.blocks.len();
    let before = std::mem::replace(&mut session.selective, vec![Some(policy); n]);
    let measured = steps(session, all, repeats);
    session.selective = before;
    measured
}

/// The instrumented S step and, per block, its recompute seconds in each S step.
fn steps(session: &mut Session, all: &[bool], repeats: usize) -> Result<(StepTrace, Vec<Vec<f64>>)> {
    session.step(all, None)?;
    let mut first = StepTrace::default();
    let mut seconds = vec![Vec::new(); session.chain.blocks.len()];
    for r in 0..repeats {
        let mut t = StepTrace::default();
        session.step(all, Some(&mut t))?;
        for (i, s) in seconds.iter_mut().enumerate() {
            s.push(t.micro.iter().map(|m| m.blocks[i].rec_seconds).sum());
        }
        if r == 0 {
            first = t;
        }
    }
    Ok((first, seconds))
}
