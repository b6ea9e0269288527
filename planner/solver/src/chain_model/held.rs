//! A selective block's output that its cache keeps (`SelTerms::held`). A plain block's `kg` and
//! `krec` are measured with its input let go after its forward (docs/memory-model.md, "When a
//! boundary's tensor dies"); when the block before it ran selective under a policy that saved
//! the operator making its output, that cache holds the output until the block's backward, so
//! the plain reader holds `held` more from its forward's end to its backward's end. That is a
//! product of two states (`s_kp · (1 − c_j)`, `c_j` the reader checkpointed or selective), so
//! it gets a variable of its own per reader, `h_j`, which the memory moments count and one
//! constraint moment forces on:
//!
//! ```text
//! window of reader j (every moment after its forward, up to its backward): + held_k · h_j
//! constraint: Σ_{p keeps} s_kp − x_j − Σ_q s_jq − h_j ≤ 0     (UNDECIDED per unit)
//! ```
//!
//! `h_j` costs no time and only adds bytes, so the solver sets it exactly when the product is 1,
//! and [`super::with_selective`] sets it so for a given choice.

use super::{Affine, Layout, StepTerms};
use crate::problem::{Moment, Occurs, UNDECIDED};

/// Per block `j`: the variable `h_j` (after every block, group and selective variable, in block
/// order) and the bytes it adds, when the block before `j` has a selective state whose cache
/// keeps its output.
pub(super) fn held_vars(step: &StepTerms, sel_var: &[Vec<usize>]) -> Vec<Option<(usize, i64)>> {
    let mut next = step.blocks.len() + 2 * step.groups.len() + sel_var.iter().map(Vec::len).sum::<usize>();
    (0..step.blocks.len())
        .map(|j| {
            let k = j.checked_sub(1)?;
            let bytes = held_bytes(step, sel_var, k)?;
            next += 1;
            Some((next - 1, bytes))
        })
        .collect()
}

/// The bytes of block `k`'s output one of its selective states keeps, if any does.
fn held_bytes(step: &StepTerms, sel_var: &[Vec<usize>], k: usize) -> Option<i64> {
    let sel = &step.blocks[k].sel[..sel_var[k].len()];
    sel.iter().map(|s| s.held).max().filter(|&b| b > 0)
}

/// Whether block `k` runs selective under a policy that keeps its output, in a choice where
/// `policy` gives its policy.
pub(super) fn keeps(step: &StepTerms, k: usize, policy: Option<usize>) -> bool {
    policy.is_some_and(|p| step.blocks[k].sel.get(p).is_some_and(|s| s.held > 0))
}

impl Layout<'_> {
    /// Adds reader `j`'s held bytes at `h_j`, in a moment after its forward.
    pub(super) fn held(&self, a: &mut Affine, j: usize) {
        if let Some((h, bytes)) = self.held_var[j] {
            a.coef_add(h, bytes);
        }
    }
}

/// Per reader `j` with `h_j`: the constraint moment (never a moment of the step) that makes
/// `h_j` on when block `j − 1` runs selective under a policy that keeps its output and `j` runs
/// plain.
pub(super) fn held_moments(l: &Layout<'_>, out: &mut Vec<Moment>) {
    let b = l.blocks();
    for (j, held) in l.held_var.iter().enumerate() {
        let Some((h, _)) = *held else { continue };
        let k = j - 1;
        let mut mo = Affine::new(l.nv, 0);
        for (&v, s) in l.sel_var[k].iter().zip(&b[k].sel) {
            if s.held > 0 {
                mo.coef_add(v, UNDECIDED);
            }
        }
        mo.coef_add(j, -UNDECIDED).coef_add(h, -UNDECIDED);
        for &v in &l.sel_var[j] {
            mo.coef_add(v, -UNDECIDED);
        }
        out.push(mo.moment(
            format!(
                "{}: plain after {} ran selective holds its output (h on)",
                b[j].name, b[k].name
            ),
            Occurs::Never,
        ));
    }
}
