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
//! `otmp = optimizer_peak − F`. Groups map field for field. A loop that keeps autocast's
//! cache on adds each block's casts to `kg` and `kng` (not to `krec` and `out`: they die when
//! the loss is made) and splits the loss into its forward and backward ([`Casts`]).

use crate::chain_model::{self, BlockTerms, FusedTerms, GroupTerms, SelTerms, StepTerms};
use crate::problem::ConfigProblem;
use crate::profile::{ConfigProfile, RegimeProfile};
use crate::shard::{Measured, Parameter, ShardError, ShardOptimizer, ShardStep};

/// The chain model's terms of one memory regime of a profiled config.
pub fn step_terms(c: &ConfigProfile, r: &RegimeProfile) -> StepTerms {
    let n = r.blocks.len();
    let casts = Casts::of(c, r);
    StepTerms {
        fixed: r.fixed,
        lk: 0,
        lf: casts.lf,
        lb: casts.lb,
        otmp: c.optimizer_peak - r.fixed,
        base_seconds: c.seconds_none.median,
        blocks: r
            .blocks
            .iter()
            .zip(&c.recompute_seconds)
            .enumerate()
            .map(|(i, (b, &t))| BlockTerms {
                name: b.name.clone(),
                candidate: b.candidate,
                kg: b.kept_grad + casts.grad[i],
                fg: b.fwd_transient_grad,
                kng: b.kept_nograd + casts.nograd[i],
                fng: b.fwd_transient_nograd,
                out: b.kept_nograd,
                gout: b.carry,
                krec: b.kept_grad,
                frec: b.rec_transient,
                bta: b.bwd_transient,
                btb: b.kept_recompute + b.bwd_transient_ckpt - b.kept_grad,
                g: 0,
                recompute_seconds: t,
                sel: b
                    .selective
                    .iter()
                    .map(|s| SelTerms {
                        kf: s.kept + if c.config.autocast_cache { s.cache } else { 0 },
                        kb: s.kept,
                        fwd: s.fwd_transient,
                        frec: s.rec_transient,
                        btb: s.kept_recompute + s.bwd_transient - b.kept_grad,
                        held: s.held_output,
                        recompute_seconds: s.rec_seconds,
                    })
                    .collect(),
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
                cache: casts.sum(&casts.nograd, grp.first, grp.last + 1),
                fwd: casts.held_before(&grp.fwd_transient, &casts.nograd, grp.first),
                carry: grp.carry,
                rec: grp.rec_transient.clone(),
                bwd: grp.bwd_transient.clone(),
                recompute_seconds: c.recompute_seconds.get(n + g).copied().unwrap_or(0.0),
                fused: Some(FusedTerms {
                    kept: grp.fused_kept,
                    cache: casts.sum(&casts.grad, grp.first, grp.last + 1),
                    fwd: casts.held_before(&grp.fused_fwd_transient, &casts.grad, grp.first),
                    carry: grp.fused_carry,
                    bwd: grp.fused_bwd_transient,
                }),
            })
            .collect(),
    }
}

/// What autocast's cache adds in a loop that keeps it on over the forward and the loss
/// (`ConfigSpec::autocast_cache`; docs/memory-model.md, "Autocast's cache"): each block's
/// casts, measured as what its own region freed, stay until the loss is made, and the loss's
/// forward and backward are separate moments, the casts freed between them. With the cache
/// off, every cast is 0 and the loss is one window (`lf = loss_transient`, `lb = 0`).
struct Casts {
    grad: Vec<i64>,
    nograd: Vec<i64>,
    lf: i64,
    lb: i64,
}

impl Casts {
    fn of(c: &ConfigProfile, r: &RegimeProfile) -> Self {
        let n = r.blocks.len();
        if !c.config.autocast_cache {
            return Casts {
                grad: vec![0; n],
                nograd: vec![0; n],
                lf: r.loss_transient,
                lb: 0,
            };
        }
        Casts {
            grad: r.blocks.iter().map(|b| b.cache_grad.unwrap_or(0)).collect(),
            nograd: r.blocks.iter().map(|b| b.cache_nograd.unwrap_or(0)).collect(),
            lf: r.loss_forward_transient.unwrap_or(r.loss_transient),
            lb: r.loss_backward_transient.unwrap_or(r.loss_transient),
        }
    }

    fn sum(&self, of: &[i64], from: usize, to: usize) -> i64 {
        of[from..to].iter().sum()
    }

    /// A group's per-block forward peaks above its start, measured with each block's casts
    /// freed as it ended, with the casts of the group's earlier blocks still held.
    fn held_before(&self, peaks: &[i64], of: &[i64], first: usize) -> Vec<i64> {
        peaks
            .iter()
            .enumerate()
            .map(|(k, &p)| p + self.sum(of, first, first + k))
            .collect()
    }
}

/// The per-rank FSDP2 model of a profiled config ([`crate::shard`]): its first regime's chain
/// terms (a sharded plan has one micro-step per optimizer step) with the terms FSDP's root
/// hooks see, its FSDP units the blocks `is_unit` accepts.
pub fn shard_step(
    c: &ConfigProfile,
    parameters: &[Parameter],
    is_unit: impl Fn(&str) -> bool,
    model: &str,
) -> Result<ShardStep, ShardError> {
    let r = &c.regimes[0];
    let missing =
        |what: &str| ShardError::Missing(format!("the profile of {model} ({}) has no {what}", c.config.label()));
    let optimizer = ShardOptimizer::from_name(&c.config.optimizer)
        .filter(|_| c.config.optimizer_impl.as_deref().is_none_or(|i| i == "single"))
        .ok_or_else(|| {
            ShardError::Unsupported(format!(
                "optimizer {}: sharded plans model adamw and sgd-momentum with torch.optim's single-tensor loop",
                c.config.optimizer_label()
            ))
        })?;
    if c.config.precision != "fp32" {
        return Err(ShardError::Unsupported(format!(
            "precision {}: sharded plans model fp32 (under bf16 autocast, eager PyTorch with FSDP2 keeps \
             about a layer's bf16 weight casts more per layer than the single-process profile: measured, \
             not yet modelled; docs/fsdp.md)",
            c.config.precision
        )));
    }
    if c.config.grad_accum != 1 || !c.config.set_to_none || c.regimes.len() != 1 {
        return Err(ShardError::Unsupported(format!(
            "config {}: sharded plans model one micro-step per optimizer step with zero_grad(set_to_none=True) \
             (raise --batch instead of accumulating; FSDP reduce-scatters every micro-step)",
            c.config.label()
        )));
    }
    let measured = Measured {
        parameters_bytes: c.fixed.parameters,
        optimizer_state_bytes: c.fixed.optimizer_state,
        loss_forward: r.loss_forward_transient.ok_or_else(|| missing("loss forward term"))?,
        loss_kept: r.loss_kept.ok_or_else(|| missing("loss head's kept bytes"))?,
        after_backward: r.after_backward.ok_or_else(|| missing("end-of-backward level"))?,
        optimizer,
        released: r
            .blocks
            .iter()
            .map(|b| b.out_released.zip(b.out_released_ckpt))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| missing("outputs released at the backward's start"))?,
    };
    ShardStep::new(step_terms(c, r), parameters, is_unit, model, measured)
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
/// Each block's selective variables (one per policy), where it has them, come just after the
/// block.
pub fn unit_order(c: &ConfigProfile) -> Vec<usize> {
    chain_model::step_order(&step_terms(c, &c.regimes[0]))
}

/// [`problem`] in the solver's variable order ([`unit_order`]).
pub fn solver_problem(key: String, c: &ConfigProfile) -> ConfigProblem {
    chain_model::permute(problem(key, c), &unit_order(c))
}

/// Every moment the step passes through under checkpoint mask `x` (blocks in chain order,
/// then groups; a shorter mask leaves the rest off), in execution order, labelled as the
/// runtime labels the moments of an instrumented step: `first micro-step: forward layer1`,
/// `accumulating micro-step: backward layer1`, …, `optimizer step`. A group none of whose
/// parts is checkpointed runs fused, as the runtime runs it.
pub fn moments_at(c: &ConfigProfile, x: &[bool]) -> Vec<(String, i64)> {
    moments_at_selective(c, x, &[])
}

/// A per-block choice of selective policy: `Some(p)` runs the block, when checkpointed,
/// selective under its `p`-th measured policy (an index into `BlockProfile::selective`; see
/// [`policy_index`]); `None` checkpoints it whole. Shorter than the chain: the rest `None`.
pub type Policies = [Option<usize>];

/// The index among block `block`'s measured selective policies of the one named `name`.
pub fn policy_index(c: &ConfigProfile, block: usize, name: &str) -> Option<usize> {
    c.regimes
        .first()?
        .blocks
        .get(block)?
        .selective
        .iter()
        .position(|s| s.policy == name)
}

/// The name of block `block`'s `p`-th measured selective policy.
pub fn policy_name(c: &ConfigProfile, block: usize, p: usize) -> Option<&str> {
    Some(c.regimes.first()?.blocks.get(block)?.selective.get(p)?.policy.as_str())
}

/// [`moments_at`] with the checkpointed blocks `selective` gives a policy run selective.
pub fn moments_at_selective(c: &ConfigProfile, x: &[bool], selective: &Policies) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for r in &c.regimes {
        let n = r.blocks.len();
        let units = n + r.groups.len();
        let mask: Vec<bool> = (0..units).map(|i| x.get(i) == Some(&true)).collect();
        let step = step_terms(c, r);
        let full = chain_model::with_selective(&step, &mask, selective);
        for m in chain_model::moments(&step) {
            // The runtime records the loss head's forward and backward as one window (the
            // mapping's `lk = lb = 0`) unless the casts are freed between them, and the
            // optimizer once, after the last micro-step.
            let one_loss_window = !c.config.autocast_cache;
            if (m.label == "loss backward" && one_loss_window) || m.label == "optimizer" || !m.occurs.under(&full) {
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
    peak_at_selective(c, x, &[])
}

/// [`peak_at`] with the checkpointed blocks `selective` gives a policy run selective.
pub fn peak_at_selective(c: &ConfigProfile, x: &[bool], selective: &Policies) -> (i64, String) {
    let mut best = (i64::MIN, String::new());
    for (label, v) in moments_at_selective(c, x, selective) {
        if v > best.0 {
            best = (v, label);
        }
    }
    best
}

/// The runtime's choice for a solver's choice `full` (unit order, every variable of
/// [`problem`]): the checkpoint mask over blocks and groups, a selective block checkpointed, and
/// per block the policy it runs selective under ([`Policies`]). [`peak_at_selective`] and
/// [`seconds_at_selective`] take them.
pub fn runtime_choice(c: &ConfigProfile, full: &[bool]) -> (Vec<bool>, Vec<Option<usize>>) {
    chain_model::split_selective(&step_terms(c, &c.regimes[0]), full)
}

/// Predicted seconds per optimizer step under checkpoint mask `x` (blocks, then groups): the
/// median step with nothing checkpointed plus each checkpointed unit's median recompute.
pub fn seconds_at(c: &ConfigProfile, x: &[bool]) -> f64 {
    seconds_at_selective(c, x, &[])
}

/// [`seconds_at`] with the checkpointed blocks `selective` gives a policy run selective: theirs
/// is that policy's selective recompute time (`SelectiveProfile::rec_seconds`), as the solver
/// counts it.
pub fn seconds_at_selective(c: &ConfigProfile, x: &[bool], selective: &Policies) -> f64 {
    c.seconds_none.median + unit_seconds(c, x, selective, |u| c.recompute_seconds[u]).sum::<f64>()
}

/// Per checkpointed unit of `x`, its recompute time (`plain` of its index) or, for a block
/// `selective` gives a policy, that policy's selective recompute's.
fn unit_seconds<'a>(
    c: &'a ConfigProfile,
    x: &'a [bool],
    selective: &'a Policies,
    plain: impl Fn(usize) -> f64 + 'a,
) -> impl Iterator<Item = f64> + 'a {
    let sel = move |u: usize| {
        let p = selective.get(u).copied().flatten()?;
        c.regimes.first()?.blocks.get(u)?.selective.get(p)
    };
    x.iter()
        .enumerate()
        .filter(|(u, on)| **on && *u < c.recompute_seconds.len())
        .map(move |(u, _)| sel(u).map_or_else(|| plain(u), |s| s.rec_seconds))
}

/// The spread around [`seconds_at`] the profile's samples allow: the fastest step with nothing
/// checkpointed plus each checkpointed unit's fastest recompute, and the same with the
/// slowest. `None` for a profile without its recompute samples (written before ckptune kept
/// them).
pub fn seconds_range_at(c: &ConfigProfile, x: &[bool]) -> Option<(f64, f64)> {
    seconds_range_at_selective(c, x, &[])
}

/// [`seconds_range_at`] with the blocks `selective` gives a policy run selective (their
/// recompute's median at both ends: a profile keeps no spread of it).
pub fn seconds_range_at_selective(c: &ConfigProfile, x: &[bool], selective: &Policies) -> Option<(f64, f64)> {
    if c.recompute_spread.len() != c.recompute_seconds.len() {
        return None;
    }
    Some((
        c.seconds_none.min + unit_seconds(c, x, selective, |u| c.recompute_spread[u].min).sum::<f64>(),
        c.seconds_none.max + unit_seconds(c, x, selective, |u| c.recompute_spread[u].max).sum::<f64>(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{ConfigSpec, Contention, FixedBytes, Stats};

    fn stats(min: f64, median: f64, max: f64) -> Stats {
        Stats { median, min, max, n: 3 }
    }

    fn profile(spread: Vec<Stats>) -> ConfigProfile {
        ConfigProfile {
            config: ConfigSpec {
                precision: "fp32".into(),
                optimizer: "adamw".into(),
                optimizer_impl: None,
                micro_batch: 1,
                grad_accum: 1,
                set_to_none: true,
                autocast_cache: false,
                loss_chunks: None,
                optimizer_in_backward: false,
            },
            fixed: FixedBytes::default(),
            regimes: Vec::new(),
            optimizer_peak: 0,
            peak_none: 0,
            peak_all: 0,
            seconds_none: stats(0.9, 1.0, 1.2),
            seconds_all: stats(1.5, 1.6, 1.8),
            recompute_seconds: spread.iter().map(|s| s.median).collect(),
            steps_run: 8,
            wall_seconds: 10.0,
            recompute_spread: spread,
            recompute_class: Vec::new(),
            contention: Contention::default(),
            estimated: None,
            reserved: None,
        }
    }

    #[test]
    fn the_predicted_range_adds_the_chosen_units_extremes_around_the_median_estimate() {
        let c = profile(vec![stats(0.1, 0.2, 0.25), stats(0.3, 0.3, 0.5), stats(0.05, 0.1, 0.1)]);
        let x = [true, false, true];
        assert!((seconds_at(&c, &x) - 1.3).abs() < 1e-12);
        let (lo, hi) = seconds_range_at(&c, &x).unwrap();
        assert!((lo - (0.9 + 0.1 + 0.05)).abs() < 1e-12, "{lo}");
        assert!((hi - (1.2 + 0.25 + 0.1)).abs() < 1e-12, "{hi}");
        let (lo, hi) = seconds_range_at(&c, &[false; 3]).unwrap();
        assert_eq!((lo, hi), (0.9, 1.2));
        // A profile without its recompute samples has no range.
        let mut old = c.clone();
        old.recompute_spread.clear();
        assert_eq!(seconds_range_at(&old, &x), None);
    }

    fn block(name: &str, seconds: f64) -> crate::profile::BlockProfile {
        crate::profile::BlockProfile {
            name: name.into(),
            candidate: true,
            kept_grad: 100,
            fwd_transient_grad: 10,
            kept_nograd: 5,
            fwd_transient_nograd: 10,
            carry: 0,
            bwd_transient: 20,
            rec_transient: 10,
            kept_recompute: 100,
            bwd_transient_ckpt: 20,
            grad_in_bytes: 5,
            fwd_seconds: seconds,
            fwd_nograd_seconds: 0.9 * seconds,
            bwd_seconds: 2.0 * seconds,
            rec_seconds: 0.9 * seconds,
            out_released: None,
            out_released_ckpt: None,
            cache_grad: None,
            cache_nograd: None,
            selective: vec![crate::profile::SelectiveProfile {
                policy: "matmul".into(),
                kept: 50,
                fwd_transient: 10,
                cache: 0,
                rec_transient: 5,
                kept_recompute: 50,
                bwd_transient: 20,
                out_released: 0,
                held_output: 0,
                rec_seconds: 0.4 * seconds,
            }],
        }
    }

    #[test]
    fn an_estimate_brought_to_a_pace_predicts_every_choice_at_that_pace() {
        use crate::profile::{BlockEstimate, Estimate, RegimeProfile};
        let mut c = profile(vec![stats(0.1, 0.2, 0.25), stats(0.3, 0.3, 0.5), stats(0.05, 0.1, 0.1)]);
        c.regimes = vec![RegimeProfile {
            label: "first".into(),
            fixed: 0,
            loss_transient: 0,
            loss_forward_transient: None,
            loss_kept: None,
            loss_backward_transient: None,
            after_backward: None,
            blocks: vec![block("a", 0.2), block("b", 0.3), block("c", 0.1)],
            groups: Vec::new(),
        }];
        // A measured profile is left as it is.
        let measured = c.clone();
        c.to_pace(2.5, "why".into());
        assert_eq!(c, measured);
        c.estimated = Some(Estimate {
            traced_on: "meta".into(),
            rates: crate::gpus::gpu("h100").unwrap().rates(),
            blocks: vec![
                BlockEstimate {
                    forward: 0.2,
                    nograd_forward: 0.2,
                    backward: 0.4,
                    selective_recompute: vec![0.1],
                };
                3
            ],
            pace: None,
        });
        let before = c.clone();
        c.to_pace(2.5, "config b's measured step took 2.50x its estimate".into());
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        // Every choice, plain or selective, at 2.5 times its step and its spread.
        for mask in 0..8 {
            let x: Vec<bool> = (0..3).map(|i| mask >> i & 1 == 1).collect();
            for sel in [vec![], vec![Some(0), None, Some(0)]] {
                let (was, now) = (
                    seconds_at_selective(&before, &x, &sel),
                    seconds_at_selective(&c, &x, &sel),
                );
                assert!(close(now, 2.5 * was), "{x:?} {sel:?}: {now} against {was}");
            }
            let ((lo0, hi0), (lo, hi)) = (
                seconds_range_at(&before, &x).unwrap(),
                seconds_range_at(&c, &x).unwrap(),
            );
            assert!(close(lo, 2.5 * lo0) && close(hi, 2.5 * hi0), "{x:?}");
        }
        // Every other time the profile holds, and the label says by how much and why.
        assert!(close(c.seconds_all.median, 2.5 * before.seconds_all.median));
        let (b0, b) = (&before.regimes[0].blocks[1], &c.regimes[0].blocks[1]);
        for (now, was) in [
            (b.fwd_seconds, b0.fwd_seconds),
            (b.fwd_nograd_seconds, b0.fwd_nograd_seconds),
            (b.bwd_seconds, b0.bwd_seconds),
            (b.rec_seconds, b0.rec_seconds),
        ] {
            assert!(close(now, 2.5 * was), "{now} against {was}");
        }
        let e = c.estimated.as_ref().unwrap();
        assert!(close(e.blocks[0].backward, 1.0) && close(e.blocks[0].selective_recompute[0], 0.25));
        assert!(
            e.describe()
                .ends_with("scaled by 2.50 as config b's measured step took 2.50x its estimate"),
            "{}",
            e.describe()
        );
        // The bytes are not touched.
        assert_eq!(c.regimes[0].blocks[1].kept_grad, 100);
        assert_eq!(c.peak_none, before.peak_none);
    }
}
