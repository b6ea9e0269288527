//! The terms of one memory regime from the instrumented steps: differences of absolute meter
//! levels, with the level before each moment taken from the model itself, so the model
//! reproduces the instrumented steps exactly by construction.

use ckptune_solver::profile::{BlockProfile, GroupProfile, RegimeProfile};

use crate::error::{Result, RuntimeError};
use crate::exec::MicroTrace;

/// Terms of one regime from the instrumented micro-steps of steps A (plain blocks), B (all
/// candidate blocks checkpointed) and, for chains with groups, C (all groups checkpointed)
/// with D (all groups fused).
pub(super) fn regime(
    label: &str,
    a: &MicroTrace,
    b: &MicroTrace,
    cd: Option<(&MicroTrace, &MicroTrace)>,
    chain: &ckptune_models::Chain,
) -> Result<RegimeProfile> {
    if a.start != b.start || cd.is_some_and(|(c, d)| c.start != a.start || d.start != a.start) {
        return Err(RuntimeError::Invalid(format!(
            "profile of {}: the {label} started at {} bytes with nothing checkpointed but at {} with \
             everything checkpointed; the step is not in a steady state (another thread allocating?)",
            chain.name, a.start, b.start
        )));
    }
    let f = a.start;
    let n = a.blocks.len();
    let kept_grad: Vec<i64> = a.blocks.iter().map(|t| t.fwd_after - t.fwd_before).collect();
    let kept_b: Vec<i64> = b.blocks.iter().map(|t| t.fwd_after - t.fwd_before).collect();
    let mut blocks = Vec::with_capacity(n);
    for i in 0..n {
        let (ta, tb) = (&a.blocks[i], &b.blocks[i]);
        let before_a: i64 = kept_grad[..=i].iter().sum();
        let carry = ta.bwd_before - f - before_a;
        let (rec_transient, kept_recompute, bwd_transient_ckpt) = if tb.checkpointed {
            let base = f + kept_b[..i].iter().sum::<i64>() + carry;
            (tb.rec_peak - base, tb.bwd_before - base, tb.bwd_peak - tb.bwd_before)
        } else {
            (0, kept_grad[i], ta.bwd_peak - ta.bwd_before)
        };
        blocks.push(BlockProfile {
            name: chain.blocks[i].name.clone(),
            candidate: chain.blocks[i].candidate,
            kept_grad: kept_grad[i],
            fwd_transient_grad: ta.fwd_peak - ta.fwd_before,
            kept_nograd: if tb.checkpointed { kept_b[i] } else { kept_grad[i] },
            fwd_transient_nograd: if tb.checkpointed {
                tb.fwd_peak - tb.fwd_before
            } else {
                ta.fwd_peak - ta.fwd_before
            },
            carry,
            bwd_transient: ta.bwd_peak - ta.bwd_before,
            rec_transient,
            kept_recompute,
            bwd_transient_ckpt,
            grad_in_bytes: ta.grad_in_bytes,
            fwd_seconds: ta.fwd_seconds,
            fwd_nograd_seconds: tb.fwd_seconds,
            bwd_seconds: ta.bwd_seconds,
            rec_seconds: tb.rec_seconds,
            out_released: Some(ta.out_released),
            out_released_ckpt: Some(if tb.checkpointed {
                tb.ckpt_out_released
            } else {
                ta.out_released
            }),
            cache_grad: Some(ta.fwd_open - ta.fwd_after),
            cache_nograd: Some(if tb.checkpointed {
                tb.fwd_open - tb.fwd_after
            } else {
                ta.fwd_open - ta.fwd_after
            }),
            selective: Vec::new(),
        });
    }
    let groups = match cd {
        None => Vec::new(),
        Some((c, d)) => chain
            .groups
            .iter()
            .map(|g| {
                let fb = &d.blocks[g.first..=g.last];
                let fstart = fb[0].fwd_before;
                let fused_kept = fb[fb.len() - 1].fwd_after - fstart;
                let vjp = &fb[fb.len() - 1];
                let blocks = &c.blocks[g.first..=g.last];
                // Level at the group's forward start: what earlier blocks keep. The same bytes
                // are below the group in backward, so its base there is that plus the carry.
                let start = blocks[0].fwd_before;
                let base = blocks[0].rec_before;
                GroupProfile {
                    name: g.name.clone(),
                    first: g.first,
                    last: g.last,
                    kept: blocks[blocks.len() - 1].fwd_after - start,
                    fwd_transient: blocks.iter().map(|t| t.fwd_peak - start).collect(),
                    carry: base - start,
                    rec_transient: blocks.iter().map(|t| t.rec_peak - base).collect(),
                    bwd_transient: blocks.iter().map(|t| t.bwd_peak - base).collect(),
                    fused_kept,
                    fused_fwd_transient: fb.iter().map(|t| t.fwd_peak - fstart).collect(),
                    // Level at the VJP's start, less what earlier blocks and the group keep.
                    fused_carry: vjp.bwd_before - fstart - fused_kept,
                    fused_bwd_transient: vjp.bwd_peak - vjp.bwd_before,
                }
            })
            .collect(),
    };
    Ok(RegimeProfile {
        label: label.to_owned(),
        fixed: f,
        loss_transient: a.loss_peak - a.loss_before,
        loss_forward_transient: Some(a.loss_fwd_peak - a.loss_before),
        loss_kept: Some(a.loss_seeded - a.loss_before),
        loss_backward_transient: Some(a.loss_bwd_peak - a.loss_before),
        after_backward: Some(a.bwd_end - f),
        blocks,
        groups,
    })
}
