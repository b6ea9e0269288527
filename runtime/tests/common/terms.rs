//! Every memory term of a profile, named, and a report of those that differ: what the tests of
//! fake mode compare between a profile measured on the meta device and one measured on the CPU.

use ckptune_runtime::profile::ConfigProfile;

/// A memory term: bytes held (exact in fake mode) or a transient peak (short by scratch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Term {
    Kept,
    Transient,
}

/// Every memory term of a profile, named.
pub fn memory_terms(p: &ConfigProfile) -> Vec<(String, Term, i64)> {
    use Term::{Kept, Transient};
    let mut out: Vec<(String, Term, i64)> = vec![
        ("fixed.parameters".into(), Kept, p.fixed.parameters),
        ("fixed.buffers".into(), Kept, p.fixed.buffers),
        ("fixed.gradients".into(), Kept, p.fixed.gradients),
        ("fixed.optimizer_state".into(), Kept, p.fixed.optimizer_state),
        ("fixed.batch".into(), Kept, p.fixed.batch),
        ("fixed.other".into(), Kept, p.fixed.other),
        ("optimizer_peak".into(), Transient, p.optimizer_peak),
        ("peak_none".into(), Transient, p.peak_none),
        ("peak_all".into(), Transient, p.peak_all),
    ];
    for r in &p.regimes {
        let l = &r.label;
        out.push((format!("{l}: fixed"), Kept, r.fixed));
        out.push((format!("{l}: loss_transient"), Transient, r.loss_transient));
        out.extend(
            r.loss_forward_transient
                .map(|v| (format!("{l}: loss_forward_transient"), Transient, v)),
        );
        out.extend(r.loss_kept.map(|v| (format!("{l}: loss_kept"), Kept, v)));
        out.extend(
            r.loss_backward_transient
                .map(|v| (format!("{l}: loss_backward_transient"), Transient, v)),
        );
        out.extend(r.after_backward.map(|v| (format!("{l}: after_backward"), Kept, v)));
        for b in &r.blocks {
            for (term, kind, v) in [
                ("kept_grad", Kept, b.kept_grad),
                ("fwd_transient_grad", Transient, b.fwd_transient_grad),
                ("kept_nograd", Kept, b.kept_nograd),
                ("fwd_transient_nograd", Transient, b.fwd_transient_nograd),
                ("carry", Kept, b.carry),
                ("bwd_transient", Transient, b.bwd_transient),
                ("rec_transient", Transient, b.rec_transient),
                ("kept_recompute", Kept, b.kept_recompute),
                ("bwd_transient_ckpt", Transient, b.bwd_transient_ckpt),
                ("grad_in_bytes", Kept, b.grad_in_bytes),
            ] {
                out.push((format!("{l}: {}.{term}", b.name), kind, v));
            }
            for (term, v) in [("cache_grad", b.cache_grad), ("cache_nograd", b.cache_nograd)] {
                out.extend(v.map(|v| (format!("{l}: {}.{term}", b.name), Kept, v)));
            }
        }
        for g in &r.groups {
            let n = &g.name;
            for (term, kind, v) in [
                ("kept", Kept, g.kept),
                ("carry", Kept, g.carry),
                ("fused_kept", Kept, g.fused_kept),
                ("fused_carry", Kept, g.fused_carry),
                ("fused_bwd_transient", Transient, g.fused_bwd_transient),
            ] {
                out.push((format!("{l}: group {n}.{term}"), kind, v));
            }
            for (term, values) in [
                ("fwd_transient", &g.fwd_transient),
                ("rec_transient", &g.rec_transient),
                ("bwd_transient", &g.bwd_transient),
            ] {
                for (k, v) in values.iter().enumerate() {
                    out.push((format!("{l}: group {n}.{term}[{k}]"), Transient, *v));
                }
            }
        }
    }
    out
}

/// Rows `(term, kind, cpu, meta)` as lines, for an assertion's message.
pub fn report(rows: &[(String, Term, i64, i64)]) -> String {
    rows.iter()
        .map(|(n, _, a, b)| format!("  {n}: cpu {a}, meta {b} ({:+})", b - a))
        .collect::<Vec<_>>()
        .join("\n")
}
