//! The moments of an instrumented step, labelled as the memory model labels them
//! (`ckptune_solver::model::moments_at`), so the two compare moment by moment.

use crate::exec::StepTrace;

/// The moments of an instrumented step, labelled and ordered as `ckptune_solver::model::moments_at`
/// predicts them for a step with `regimes` regimes (1, or 2 with gradient accumulation): the
/// first micro-step, and the second as the accumulating one.
pub fn measured_moments(trace: &StepTrace, chain: &ckptune_models::Chain, regimes: usize) -> Vec<(String, i64)> {
    let labels = ["first micro-step", "accumulating micro-step"];
    let mut out = Vec::new();
    for (m, label) in trace.micro.iter().zip(labels).take(regimes) {
        for (b, cb) in m.blocks.iter().zip(&chain.blocks) {
            out.push((format!("{label}: forward {}", cb.name), b.fwd_peak));
        }
        if m.casts_held {
            out.push((format!("{label}: loss"), m.loss_fwd_peak));
            out.push((format!("{label}: loss backward"), m.loss_bwd_peak));
        } else {
            out.push((format!("{label}: loss"), m.loss_peak));
        }
        for (j, (b, cb)) in m.blocks.iter().zip(&chain.blocks).enumerate().rev() {
            if b.fused {
                // A fused group has one backward, recorded on its last block.
                if let Some(g) = chain.groups.iter().find(|g| g.last == j) {
                    out.push((format!("{label}: backward {}", g.name), b.bwd_peak));
                }
                continue;
            }
            if b.checkpointed {
                out.push((format!("{label}: recompute {}", cb.name), b.rec_peak));
            }
            out.push((format!("{label}: backward {}", cb.name), b.bwd_peak));
        }
    }
    out.push(("optimizer step".to_owned(), trace.opt_peak));
    out
}
