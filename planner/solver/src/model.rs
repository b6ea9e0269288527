//! The memory model of a profiled config: the one mapping from a profile's measured terms to
//! the chain model's ([`chain_model`]), and what the rest of ckptune asks of it. The planner
//! solves [`solver_problem`]; `verify`, `sweep` and the runtime's exactness tests compare
//! [`moments_at`] with a measured step, moment by moment. Both come from the same affine
//! moments, so there is one model, not two kept equal by a test.
//!
//! The mapping (`docs/memory-model.md` derives it): in this runtime a block keeps, after its
//! forward, what it keeps until its backward (each block's forward has its own autocast
//! region), so `krec = kg = kept_grad` and `out = kng = kept_nograd`; the carry holds every
//! gradient alive when a block's backward starts, so `gout = carry` with `g = 0`; a
//! checkpointed block's VJP starts from `kept_recompute`, so
//! `btb = kept_recompute + bwd_transient_ckpt − kept_grad`; the loss is one window (forward
//! and backward of the loss head), so `lf = loss_transient`, `lk = lb = 0`; and
//! `otmp = optimizer_peak − F`. Groups map field for field.

use crate::chain_model::{self, BlockTerms, FusedTerms, GroupTerms, StepTerms};
use crate::profile::{ConfigProfile, RegimeProfile};
use crate::solver::ConfigProblem;

/// The chain model's terms of one memory regime of a profiled config.
pub fn step_terms(c: &ConfigProfile, r: &RegimeProfile) -> StepTerms {
    let n = r.blocks.len();
    StepTerms {
        fixed: r.fixed,
        lk: 0,
        lf: r.loss_transient,
        lb: 0,
        otmp: c.optimizer_peak - r.fixed,
        base_seconds: c.seconds_none.median,
        blocks: r
            .blocks
            .iter()
            .zip(&c.recompute_seconds)
            .map(|(b, &t)| BlockTerms {
                name: b.name.clone(),
                candidate: b.candidate,
                kg: b.kept_grad,
                fg: b.fwd_transient_grad,
                kng: b.kept_nograd,
                fng: b.fwd_transient_nograd,
                out: b.kept_nograd,
                gout: b.carry,
                krec: b.kept_grad,
                frec: b.rec_transient,
                bta: b.bwd_transient,
                btb: b.kept_recompute + b.bwd_transient_ckpt - b.kept_grad,
                g: 0,
                recompute_seconds: t,
            })
            .collect(),
        groups: r
            .groups
            .iter()
            .enumerate()
            .map(|(g, grp)| GroupTerms {
                name: grp.name.clone(),
                first: grp.first,
                last: grp.last,
                kept: grp.kept,
                fwd: grp.fwd_transient.clone(),
                carry: grp.carry,
                rec: grp.rec_transient.clone(),
                bwd: grp.bwd_transient.clone(),
                recompute_seconds: c.recompute_seconds.get(n + g).copied().unwrap_or(0.0),
                fused: Some(FusedTerms {
                    kept: grp.fused_kept,
                    fwd: grp.fused_fwd_transient.clone(),
                    carry: grp.fused_carry,
                    bwd: grp.fused_bwd_transient,
                }),
            })
            .collect(),
    }
}

/// The chain problem of one profiled config: the moments of every regime (first micro-step,
/// accumulating micro-steps), a regime's label appended to its moments' labels when there
/// are several. Variables are in unit order (blocks, groups checkpointed, groups fused); see
/// [`solver_problem`] for the order the solver gets.
pub fn problem(key: String, c: &ConfigProfile) -> ConfigProblem {
    let mut moments = Vec::new();
    let mut first: Option<ConfigProblem> = None;
    for r in &c.regimes {
        let p = chain_model::config_problem(key.clone(), &step_terms(c, r));
        for mut m in p.moments.iter().cloned() {
            if c.regimes.len() > 1 {
                m.label = format!("{} ({})", m.label, r.label);
            }
            moments.push(m);
        }
        first.get_or_insert(p);
    }
    let first = first.expect("a profile has at least one regime");
    ConfigProblem { moments, ..first }
}

/// Solver variable `v` is unit `order[v]`: each group just before its first block, which
/// keeps the chain DP's state small (see [`chain_model::moments`]).
pub fn unit_order(c: &ConfigProfile) -> Vec<usize> {
    let r = &c.regimes[0];
    chain_model::solver_order(r.blocks.len(), &group_spans(r))
}

/// [`problem`] in the solver's variable order ([`unit_order`]).
pub fn solver_problem(key: String, c: &ConfigProfile) -> ConfigProblem {
    chain_model::permute(problem(key, c), &unit_order(c))
}

fn group_spans(r: &RegimeProfile) -> Vec<(usize, usize)> {
    r.groups.iter().map(|g| (g.first, g.last)).collect()
}

/// Every moment the step passes through under checkpoint mask `x` (blocks in chain order,
/// then groups; a shorter mask leaves the rest off), in execution order, labelled as the
/// runtime labels the moments of an instrumented step: `first micro-step: forward layer1`,
/// `accumulating micro-step: backward layer1`, …, `optimizer step`. A group none of whose
/// parts is checkpointed runs fused, as the runtime runs it.
pub fn moments_at(c: &ConfigProfile, x: &[bool]) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for r in &c.regimes {
        let n = r.blocks.len();
        let units = n + r.groups.len();
        let mask: Vec<bool> = (0..units).map(|i| x.get(i) == Some(&true)).collect();
        let full = chain_model::with_fused(&mask, n, &group_spans(r));
        for m in chain_model::moments(&step_terms(c, r)) {
            // The runtime records the loss head's forward and backward as one window (the
            // mapping's `lk = lb = 0`), and the optimizer once, after the last micro-step.
            if m.label == "loss backward" || m.label == "optimizer" || !m.occurs.under(&full) {
                continue;
            }
            out.push((format!("{}: {}", r.label, m.label), m.eval(&full)));
        }
    }
    out.push(("optimizer step".to_owned(), c.optimizer_peak));
    out
}

/// The whole-step peak under checkpoint mask `x` (as in [`moments_at`]) and the first moment
/// where it occurs.
pub fn peak_at(c: &ConfigProfile, x: &[bool]) -> (i64, String) {
    let mut best = (i64::MIN, String::new());
    for (label, v) in moments_at(c, x) {
        if v > best.0 {
            best = (v, label);
        }
    }
    best
}

/// Predicted seconds per optimizer step under checkpoint mask `x` (blocks, then groups).
pub fn seconds_at(c: &ConfigProfile, x: &[bool]) -> f64 {
    c.seconds_none.median
        + x.iter()
            .zip(&c.recompute_seconds)
            .filter(|(on, _)| **on)
            .map(|(_, s)| s)
            .sum::<f64>()
}
