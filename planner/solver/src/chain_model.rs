//! The chain memory model (docs/memory-model.md, which defines every short name below), written as the
//! affine moments of one training step that the solver constrains.
//!
//! Every moment of the step is `constant + Σ coef_i · x_i` with `x_i = 1` when block `i` is
//! checkpointed, so peak memory is the maximum of a list of affine functions and the
//! solver never needs to know where the list came from. Other regimes (gradient
//! accumulation, `set_to_none = false`) can supply their own list.

use crate::problem::{peak_of, ties_by_name, ConfigProblem, Moment, Occurs, UNDECIDED};

mod held;
mod terms;
pub use terms::*;

/// Affine expression builder: `term(i, off, on)` adds a quantity that is `off` when block
/// `i` is not checkpointed and `on` when it is, i.e. `off + x_i (on − off)`.
#[derive(Clone)]
pub(crate) struct Affine {
    constant: i64,
    coef: Vec<i64>,
}

impl Affine {
    pub(crate) fn new(n: usize, constant: i64) -> Self {
        Affine {
            constant,
            coef: vec![0; n],
        }
    }

    pub(crate) fn add(&mut self, v: i64) -> &mut Self {
        self.constant = self.constant.saturating_add(v);
        self
    }

    pub(crate) fn term(&mut self, i: usize, off: i64, on: i64) -> &mut Self {
        self.constant = self.constant.saturating_add(off);
        self.coef[i] = self.coef[i].saturating_add(on.saturating_sub(off));
        self
    }

    pub(crate) fn coef_add(&mut self, i: usize, v: i64) -> &mut Self {
        self.coef[i] = self.coef[i].saturating_add(v);
        self
    }

    pub(crate) fn moment(&self, label: String, occurs: Occurs) -> Moment {
        Moment {
            label,
            constant: self.constant,
            coef: self.coef.clone(),
            occurs,
        }
    }
}

/// The moments of one training step, in execution order, as docs/memory-model.md derives them:
///
/// ```text
/// kf_i = x_i ? kng_i : kg_i          kb_i = x_i ? out_i : krec_i
/// forward j   : F + Σ_{i<j} kf_i + (x_j ? fng_j : fg_j)
/// loss        : F + Σ_i kf_i + lf ;  loss backward: F + Σ_i kb_i + lk + lb
/// backward j  : base_j = F + Σ_{i>j} g_i + Σ_{i<j} kb_i + gout_j
///   recompute : base_j + frec_j                       (only if x_j)
///   vjp       : base_j + krec_j + (x_j ? btb_j : bta_j)
/// optimizer   : F + Σ_i g_i + otmp
/// ```
///
/// with `held_{j−1} · h_j` more in every moment after block `j`'s forward up to its backward,
/// where the block before `j` has a selective state whose cache keeps its output ([`held`]).
///
/// Coefficients are filled for every block, candidate or not; whether a block may be
/// checkpointed is the solver's business ([`ConfigProblem::candidate`]).
///
/// Groups (nested candidates) add `z_g` (checkpointed whole) and `f_g` (fused) each, after the
/// blocks ([`GroupTerms`]). A checkpointed or fused group keeps its own bytes in place of its
/// blocks' `Σ kf`/`Σ kb`: a term in every later moment. Each site of a group (each block's
/// forward, recompute and backward) exists in the state that runs it, so it appears once per
/// state: a block copy (`z = f = 0`), a checkpointed copy and a fused copy (whose backward is
/// one site). A copy whose state is off is pushed below a present moment with the same
/// prefix: group copies sit 1 byte under the lowest value the other states' copies can take;
/// block copies drop by one shift per state and phase, enough to sit under that state's
/// highest site. One shift per phase (not per site) keeps the block copies of a group in one
/// class for the chain DP, and the group copies close at their variable, so the DP's state
/// stays a handful of sums when the group's variables come just before its blocks
/// ([`solver_order`]).
pub fn moments(step: &StepTerms) -> Vec<Moment> {
    let l = Layout::new(step);
    let mut out = Vec::with_capacity(3 * l.n + 3);
    forward_moments(&l, &mut out);
    loss_moments(&l, &mut out);
    let grads = backward_moments(&l, &mut out);
    let opt = Affine::new(l.nv, step.fixed.saturating_add(grads).saturating_add(step.otmp));
    out.push(opt.moment("optimizer".to_string(), Occurs::Always));
    covering_moments(&l, &mut out);
    held::held_moments(&l, &mut out);
    out
}

/// Where the blocks sit among the groups, and which variables are the groups': what every
/// phase of [`moments`] looks up.
struct Layout<'a> {
    step: &'a StepTerms,
    /// Blocks, groups, and variables (blocks, then `z`, then `f`, then `s`).
    n: usize,
    m: usize,
    nv: usize,
    group_of: Vec<Option<usize>>,
    /// Per block: the variable of each policy it may run selective under (`BlockTerms::sel`'s
    /// order); empty when it has none.
    sel_var: Vec<Vec<usize>>,
    /// Per block: its `h_j` and the bytes it adds ([`held`]).
    held_var: Vec<Option<(usize, i64)>>,
}

impl<'a> Layout<'a> {
    fn new(step: &'a StepTerms) -> Self {
        let n = step.blocks.len();
        let m = step.groups.len();
        let mut group_of: Vec<Option<usize>> = vec![None; n];
        for (g, grp) in step.groups.iter().enumerate() {
            for slot in &mut group_of[grp.first..=grp.last] {
                *slot = Some(g);
            }
        }
        let sel_var = selective_vars(step);
        let held_var = held::held_vars(step, &sel_var);
        Layout {
            step,
            n,
            m,
            nv: n + 2 * m + sel_var.iter().map(Vec::len).sum::<usize>() + held_var.iter().flatten().count(),
            group_of,
            sel_var,
            held_var,
        }
    }

    /// Adds `on − off` at each of block `j`'s selective variables: `off` is what the plain or
    /// checkpointed terms already put there, `on` that policy's selective term.
    fn sel(&self, a: &mut Affine, j: usize, off: i64, on: impl Fn(&SelTerms) -> i64) {
        for (&v, s) in self.sel_var[j].iter().zip(&self.blocks()[j].sel) {
            a.coef_add(v, on(s) - off);
        }
    }

    fn blocks(&self) -> &'a [BlockTerms] {
        &self.step.blocks
    }

    /// The variable of group `g` checkpointed whole, and of `g` fused.
    fn zv(&self, g: usize) -> usize {
        self.n + g
    }

    fn fv(&self, g: usize) -> usize {
        self.n + self.m + g
    }

    /// The group whose first (last) block is `j`.
    fn starts(&self, j: usize) -> Option<usize> {
        self.step.groups.iter().position(|grp| grp.first == j)
    }

    fn ends(&self, j: usize) -> Option<usize> {
        self.step.groups.iter().position(|grp| grp.last == j)
    }

    /// A block's own sites happen when its group (if any) is neither checkpointed nor fused.
    fn in_blocks(&self, j: usize, extra: &[(usize, bool)]) -> Occurs {
        let mut conds = extra.to_vec();
        if let Some(g) = self.group_of[j] {
            conds.extend([(self.zv(g), false), (self.fv(g), false)]);
        }
        if conds.is_empty() {
            Occurs::Always
        } else {
            Occurs::When(conds)
        }
    }

    /// Pushes block `j`'s copy `a` of a site under its group's other copies: down by the
    /// group's `shift` when `z` is on, and when `f` is.
    fn shifted(&self, a: &mut Affine, j: usize, shift: &[(i64, i64)]) {
        if let Some(g) = self.group_of[j] {
            a.coef_add(self.zv(g), -shift[g].0).coef_add(self.fv(g), -shift[g].1);
        }
    }

    /// While the forward's autocast region is open, a checkpointed or fused group keeps its
    /// kept bytes and its casts in place of its blocks' `kf`.
    fn group_kf(&self, a: &mut Affine, g: usize) {
        let grp = &self.step.groups[g];
        let inner: i64 = self.blocks()[grp.first..=grp.last].iter().map(|k| k.kg).sum();
        a.coef_add(self.zv(g), grp.kept + grp.cache - inner);
        if let Some(f) = &grp.fused {
            a.coef_add(self.fv(g), f.kept + f.cache - inner);
        }
    }

    /// After the forward's autocast region closes, a checkpointed or fused group keeps its
    /// kept bytes in place of its blocks' `kb`.
    fn group_kb(&self, a: &mut Affine, g: usize) {
        let grp = &self.step.groups[g];
        let inner: i64 = self.blocks()[grp.first..=grp.last].iter().map(|k| k.krec).sum();
        a.coef_add(self.zv(g), grp.kept - inner);
        if let Some(f) = &grp.fused {
            a.coef_add(self.fv(g), f.kept - inner);
        }
    }
}

fn minmax(v: &[i64]) -> (i64, i64) {
    (
        v.iter().copied().min().unwrap_or(0),
        v.iter().copied().max().unwrap_or(0),
    )
}

// ---- forward: the prefix of kept bytes grows block by block ---------------------------------

fn forward_moments(l: &Layout<'_>, out: &mut Vec<Moment>) {
    let (step, b) = (l.step, l.blocks());
    let mut kept_fwd = Affine::new(l.nv, step.fixed);
    // Per group: block copies' shifts when z = 1 and when f = 1.
    let mut shift_fwd = vec![(0i64, 0i64); l.m];
    for (j, blk) in b.iter().enumerate() {
        if let Some(g) = l.starts(j) {
            shift_fwd[g] = forward_group_copies(l, g, &kept_fwd, out);
        }
        let mut mo = kept_fwd.clone();
        mo.term(j, blk.fg, blk.fng);
        l.sel(&mut mo, j, blk.fg, |s| s.fwd);
        l.shifted(&mut mo, j, &shift_fwd);
        out.push(mo.moment(format!("forward {}", blk.name), l.in_blocks(j, &[])));
        kept_fwd.term(j, blk.kg, blk.kng);
        l.sel(&mut kept_fwd, j, blk.kg, |s| s.kf);
        l.held(&mut kept_fwd, j);
        if let Some(g) = l.ends(j) {
            l.group_kf(&mut kept_fwd, g);
        }
    }
}

/// Group `g`'s checkpointed and fused forward sites above `kept_fwd` (the level before the
/// group); returns the shifts (z, f) that push its block copies under them.
fn forward_group_copies(l: &Layout<'_>, g: usize, kept_fwd: &Affine, out: &mut Vec<Moment>) -> (i64, i64) {
    let b = l.blocks();
    let grp = &l.step.groups[g];
    let (mut acc, mut acc_lo) = (0i64, 0i64);
    let (mut flat_max, mut lo_min) = (i64::MIN, i64::MAX);
    for k in &b[grp.first..=grp.last] {
        flat_max = flat_max.max(acc + k.fg);
        lo_min = lo_min.min(acc_lo + k.fg.min(k.fng));
        acc += k.kg;
        acc_lo += k.kg.min(k.kng);
    }
    let (low_c, top_c) = minmax(&grp.fwd);
    let fused = grp.fused.as_ref().map(|f| minmax(&f.fwd));
    let shift = (
        (flat_max - top_c + 1).max(0),
        fused.map_or(0, |(_, top_f)| (flat_max - top_f + 1).max(0)),
    );
    let off_c = lo_min.min(fused.map_or(i64::MAX, |(low_f, _)| low_f)) - 1;
    for (k, &v) in (grp.first..=grp.last).zip(&grp.fwd) {
        let mut mo = kept_fwd.clone();
        mo.add(off_c).coef_add(l.zv(g), v - off_c);
        out.push(mo.moment(format!("forward {}", b[k].name), Occurs::When(vec![(l.zv(g), true)])));
    }
    if let Some(f) = &grp.fused {
        let off_f = lo_min.min(low_c) - 1;
        for (k, &v) in (grp.first..=grp.last).zip(&f.fwd) {
            let mut mo = kept_fwd.clone();
            mo.add(off_f).coef_add(l.fv(g), v - off_f);
            out.push(mo.moment(format!("forward {}", b[k].name), Occurs::When(vec![(l.fv(g), true)])));
        }
    }
    shift
}

// ---- loss: made inside the forward's autocast region (block i keeps kf_i), differentiated ----
// ---- after it closes (kb_i) ----------------------------------------------------------------

fn loss_moments(l: &Layout<'_>, out: &mut Vec<Moment>) {
    let step = l.step;
    let mut kept_open = Affine::new(l.nv, step.fixed);
    let mut kept_all = Affine::new(l.nv, step.fixed);
    for (i, blk) in l.blocks().iter().enumerate() {
        kept_open.term(i, blk.kg, blk.kng);
        l.sel(&mut kept_open, i, blk.kg, |s| s.kf);
        kept_all.term(i, blk.krec, blk.out);
        l.sel(&mut kept_all, i, blk.krec, |s| s.kb);
        l.held(&mut kept_open, i);
        l.held(&mut kept_all, i);
    }
    for g in 0..l.m {
        l.group_kf(&mut kept_open, g);
        l.group_kb(&mut kept_all, g);
    }
    out.push(kept_open.add(step.lf).moment("loss".to_string(), Occurs::Always));
    out.push(
        kept_all
            .add(step.lk)
            .add(step.lb)
            .moment("loss backward".to_string(), Occurs::Always),
    );
}

// ---- backward, last block first -------------------------------------------------------------

/// "recompute j" exists only when x_j = 1. Affine encoding: value base_j + frec_j when
/// x_j = 1 and base_j + c with c = min(0, krec_j + bta_j) − 1 when x_j = 0. With x_j = 0
/// the vjp moment is base_j + krec_j + bta_j ≥ base_j + c + 1, so the phantom is strictly
/// below a real moment and can neither raise the peak nor tie it (so it is never reported
/// as the binding moment) — whatever the signs of the measured terms. A block that can also
/// run selective (`s_jp`, one per policy) gets a recompute moment per policy, its phantom the
/// same value.
pub(crate) fn phantom(blk: &BlockTerms) -> i64 {
    // A block with selective states has a phantom per recompute moment (the checkpointed
    // recompute's when it runs selective, each policy's when it runs otherwise): each stays
    // under the backward moment of every state.
    let sel = blk
        .sel
        .iter()
        .map(|s| blk.krec.saturating_add(s.btb.min(blk.btb)))
        .min()
        .unwrap_or(0);
    blk.krec.saturating_add(blk.bta).min(sel).min(0).saturating_sub(1)
}

/// Per block: the variables of its selective states (one per policy, in `BlockTerms::sel`'s
/// order), after every block and group variable, for the candidate blocks outside groups that
/// have selective terms.
fn selective_vars(step: &StepTerms) -> Vec<Vec<usize>> {
    let base = step.blocks.len() + 2 * step.groups.len();
    let in_group = |j: usize| step.groups.iter().any(|g| (g.first..=g.last).contains(&j));
    let mut next = base;
    step.blocks
        .iter()
        .enumerate()
        .map(|(j, b)| {
            let count = if b.candidate && !in_group(j) { b.sel.len() } else { 0 };
            next += count;
            (next - count..next).collect()
        })
        .collect()
}

/// Pushes every backward moment; returns `Σ_i g_i`, the gradients alive when it ends.
fn backward_moments(l: &Layout<'_>, out: &mut Vec<Moment>) -> i64 {
    let (step, b) = (l.step, l.blocks());
    // base_j needs Σ_{i<j} kb_i (prefix) and Σ_{i>j} g_i (suffix); build the prefixes once
    // and walk them backwards.
    let mut prefix_kb = Vec::with_capacity(l.n);
    let mut acc = Affine::new(l.nv, 0);
    for (i, blk) in b.iter().enumerate() {
        prefix_kb.push(acc.clone());
        acc.term(i, blk.krec, blk.out);
        l.sel(&mut acc, i, blk.krec, |s| s.kb);
        l.held(&mut acc, i);
        if let Some(g) = l.ends(i) {
            l.group_kb(&mut acc, g);
        }
    }
    let mut shift_bwd = vec![(0i64, 0i64); l.m];
    // Per group: the lowest block-copy value and Σ_{i>last} g_i.
    let mut group_base = vec![(0i64, 0i64); l.m];
    let mut grads_after: i64 = 0;
    for j in (0..l.n).rev() {
        let blk = &b[j];
        if let Some(g) = l.ends(j) {
            let (shift, lo_min) = backward_shifts(l, g);
            shift_bwd[g] = shift;
            group_base[g] = (lo_min, grads_after);
        }
        let mut base = prefix_kb[j].clone();
        base.add(step.fixed).add(grads_after).add(blk.gout);
        l.shifted(&mut base, j, &shift_bwd);
        // A plain block holds what it reads through its own backward.
        l.held(&mut base, j);

        let mut rec = base.clone();
        rec.term(j, phantom(blk), blk.frec);
        out.push(rec.moment(format!("recompute {}", blk.name), l.in_blocks(j, &[(j, true)])));
        for (&v, s) in l.sel_var[j].iter().zip(&blk.sel) {
            let mut rec = base.clone();
            rec.add(phantom(blk)).coef_add(v, s.frec - phantom(blk));
            out.push(rec.moment(format!("recompute {}", blk.name), Occurs::When(vec![(v, true)])));
        }

        base.add(blk.krec).term(j, blk.bta, blk.btb);
        l.sel(&mut base, j, blk.bta, |s| s.btb);
        out.push(base.moment(format!("backward {}", blk.name), l.in_blocks(j, &[])));

        grads_after = grads_after.saturating_add(blk.g);

        if let Some(g) = l.starts(j) {
            let grp = &step.groups[g];
            let (lo_min, later) = group_base[g];
            let mut p = prefix_kb[grp.first].clone();
            p.add(step.fixed).add(later);
            backward_group_copies(l, g, &p, lo_min, out);
        }
    }
    grads_after
}

/// Group `g`'s block copies in backward, with the group's blocks off, above the group's
/// prefix: the shifts (z, f) that push them under the checkpointed and fused sites, and the
/// lowest value any choice of the blocks gives.
fn backward_shifts(l: &Layout<'_>, g: usize) -> ((i64, i64), i64) {
    let b = l.blocks();
    let grp = &l.step.groups[g];
    let (mut flat_max, mut lo_min) = (i64::MIN, i64::MAX);
    let mut later_g = 0i64;
    for k in (grp.first..=grp.last).rev() {
        let before: i64 = b[grp.first..k].iter().map(|i| i.krec).sum();
        let before_lo: i64 = b[grp.first..k].iter().map(|i| i.krec.min(i.out)).sum();
        let bk = &b[k];
        let base = later_g + before + bk.gout;
        let base_lo = later_g + before_lo + bk.gout;
        flat_max = flat_max.max(base + phantom(bk)).max(base + bk.krec + bk.bta);
        lo_min = lo_min
            .min(base_lo + phantom(bk).min(bk.frec))
            .min(base_lo + bk.krec + bk.bta.min(bk.btb));
        later_g += bk.g;
    }
    let top_c = grp.rec.iter().chain(&grp.bwd).copied().max().unwrap_or(0) + grp.carry;
    let fused = fused_backward(grp);
    let shift = (
        (flat_max - top_c + 1).max(0),
        fused.map_or(0, |v| (flat_max - v + 1).max(0)),
    );
    (shift, lo_min)
}

/// A fused group's one backward site above its backward base.
fn fused_backward(grp: &GroupTerms) -> Option<i64> {
    grp.fused.as_ref().map(|f| f.carry + f.kept + f.bwd)
}

/// Group `g`'s checkpointed recompute and backward sites and its fused backward, above `p`
/// (the group's backward base), 1 byte under the lowest other copy when off.
fn backward_group_copies(l: &Layout<'_>, g: usize, p: &Affine, lo_min: i64, out: &mut Vec<Moment>) {
    let grp = &l.step.groups[g];
    let ckpt: Vec<i64> = grp.rec.iter().chain(&grp.bwd).map(|v| grp.carry + v).collect();
    let low_c = ckpt.iter().copied().min().unwrap_or(0);
    let fused = fused_backward(grp);
    let off_c = lo_min.min(fused.unwrap_or(i64::MAX)) - 1;
    for k in (grp.first..=grp.last).rev() {
        let q = k - grp.first;
        let name = &l.blocks()[k].name;
        for (label, v) in [
            ("recompute", grp.carry + grp.rec[q]),
            ("backward", grp.carry + grp.bwd[q]),
        ] {
            let mut mo = p.clone();
            mo.add(off_c).coef_add(l.zv(g), v - off_c);
            out.push(mo.moment(format!("{label} {name}"), Occurs::When(vec![(l.zv(g), true)])));
        }
    }
    if let Some(v) = fused {
        let off_f = lo_min.min(low_c) - 1;
        let mut mo = p.clone();
        mo.add(off_f).coef_add(l.fv(g), v - off_f);
        out.push(mo.moment(format!("backward {}", grp.name), Occurs::When(vec![(l.fv(g), true)])));
    }
}

// ---- covering: every group in one of its states ---------------------------------------------

/// A group with nothing on (neither checkpointed, fused, nor any block checkpointed) is not a
/// state the runtime runs: the covering moment puts it above any budget.
fn covering_moments(l: &Layout<'_>, out: &mut Vec<Moment>) {
    let b = l.blocks();
    for (g, grp) in l.step.groups.iter().enumerate() {
        if grp.fused.is_none() {
            continue;
        }
        let mut mo = Affine::new(l.nv, UNDECIDED);
        mo.coef_add(l.zv(g), -UNDECIDED).coef_add(l.fv(g), -UNDECIDED);
        for k in (grp.first..=grp.last).filter(|&k| b[k].candidate) {
            mo.coef_add(k, -UNDECIDED);
        }
        out.push(mo.moment(
            format!("{}: checkpointed, fused or split (one must hold)", grp.name),
            Occurs::Never,
        ));
    }
}

/// The full choice (blocks, `z`, then `f`) for a runtime checkpoint mask over blocks and
/// groups: `f_g` is on exactly when the runtime fuses the group.
pub fn with_fused(x: &[bool], n: usize, groups: &[(usize, usize)]) -> Vec<bool> {
    let mut out = x.to_vec();
    for (g, &(first, last)) in groups.iter().enumerate() {
        out.push(!x[n + g] && !x[first..=last].contains(&true));
    }
    out
}

/// Peak bytes of the step under `x` and the label of the moment that attains it.
pub fn peak(step: &StepTerms, x: &[bool]) -> (i64, String) {
    let ms = moments(step);
    // moments() always yields at least the loss and optimizer moments.
    let (v, k) = peak_of(&ms, x).unwrap_or((step.fixed, 0));
    (v, ms[k].label.clone())
}

/// Predicted step time under `x`: `time(∅) + Σ_{i∈S} recompute_seconds_i`.
pub fn step_seconds(step: &StepTerms, x: &[bool]) -> f64 {
    step.base_seconds
        + step
            .blocks
            .iter()
            .zip(x)
            .filter(|(_, &on)| on)
            .map(|(b, _)| b.recompute_seconds)
            .sum::<f64>()
}

/// The solver's input for one configuration measured as `step`, over blocks, then groups
/// checkpointed, then groups fused (unit order). Within a group, `z`, `f` and each candidate
/// block exclude each other pairwise, except blocks among themselves.
pub fn config_problem(key: impl Into<String>, step: &StepTerms) -> ConfigProblem {
    let n = step.blocks.len();
    let m = step.groups.len();
    let mut exclusive = Vec::new();
    for (g, grp) in step.groups.iter().enumerate() {
        let fused = grp.fused.is_some();
        if fused {
            exclusive.push(vec![n + g, n + m + g]);
        }
        for k in (grp.first..=grp.last).filter(|&k| step.blocks[k].candidate) {
            exclusive.push(vec![n + g, k]);
            if fused {
                exclusive.push(vec![n + m + g, k]);
            }
        }
    }
    let sel_var = selective_vars(step);
    let held = held::held_vars(step, &sel_var);
    let selective = || {
        step.blocks
            .iter()
            .zip(&sel_var)
            .flat_map(|(b, vs)| b.sel.iter().take(vs.len()))
    };
    // One state per block: kept, checkpointed or selective under one of its policies.
    exclusive.extend(
        sel_var
            .iter()
            .enumerate()
            .filter(|(_, vs)| !vs.is_empty())
            .map(|(j, vs)| std::iter::once(j).chain(vs.iter().copied()).collect()),
    );
    // A module's calls share its name and so its decision: blocks, groups checkpointed, groups
    // fused and the calls' selective variables (per policy), each class on its own.
    let name = |j: usize| step.blocks[j].name.as_str();
    let mut tied = ties_by_name((0..n).filter(|&j| step.blocks[j].candidate).map(|j| (j, name(j))));
    tied.extend(ties_by_name(
        step.groups
            .iter()
            .enumerate()
            .map(|(g, grp)| (n + g, grp.name.as_str())),
    ));
    tied.extend(ties_by_name(
        step.groups
            .iter()
            .enumerate()
            .map(|(g, grp)| (n + m + g, grp.name.as_str())),
    ));
    let sel_names: Vec<(usize, String)> = sel_var
        .iter()
        .enumerate()
        .flat_map(|(j, vs)| {
            vs.iter()
                .enumerate()
                .map(move |(p, &v)| (v, format!("{}\u{0}{p}", name(j))))
        })
        .collect();
    tied.extend(ties_by_name(sel_names.iter().map(|(v, k)| (*v, k.as_str()))));
    ConfigProblem {
        key: key.into(),
        moments: moments(step),
        seconds_base: step.base_seconds,
        seconds_coef: step
            .blocks
            .iter()
            .map(|b| b.recompute_seconds)
            .chain(step.groups.iter().map(|g| g.recompute_seconds))
            .chain(step.groups.iter().map(|_| 0.0))
            .chain(selective().map(|s| s.recompute_seconds))
            .chain(held.iter().flatten().map(|_| 0.0))
            .collect(),
        candidate: step
            .blocks
            .iter()
            .map(|b| b.candidate)
            .chain(step.groups.iter().map(|_| true))
            .chain(step.groups.iter().map(|g| g.fused.is_some()))
            .chain(selective().map(|_| true))
            .chain(held.iter().flatten().map(|_| true))
            .collect(),
        exclusive,
        tied,
    }
}

/// The order in which the solver should see the variables of a chain of `n` blocks with
/// `groups` (`(first, last)` each; variables as in [`config_problem`]): execution order with
/// each group's `z` and `f` just before its first block. Entry `v` is the unit index of
/// solver variable `v`.
pub fn solver_order(n: usize, groups: &[(usize, usize)]) -> Vec<usize> {
    let m = groups.len();
    let mut order = Vec::with_capacity(n + 2 * m);
    for j in 0..n {
        for (g, _) in groups.iter().enumerate().filter(|(_, &(first, _))| first == j) {
            order.extend([n + g, n + m + g]);
        }
        order.push(j);
    }
    order
}

/// [`solver_order`] for `step`, each block's selective variables just after it.
pub fn step_order(step: &StepTerms) -> Vec<usize> {
    let groups: Vec<(usize, usize)> = step.groups.iter().map(|g| (g.first, g.last)).collect();
    let sel_var = selective_vars(step);
    let held = held::held_vars(step, &sel_var);
    let mut order = Vec::new();
    for u in solver_order(step.blocks.len(), &groups) {
        order.push(u);
        order.extend(sel_var.get(u).into_iter().flatten());
        // `h` of the next block right after this block's states: the next block's own sites
        // then close at its variables, as without `h`.
        order.extend(held.get(u + 1).copied().flatten().map(|(h, _)| h));
    }
    order
}

/// The full choice ([`with_fused`], the selective variables, then each `h_j`, on where block
/// `j` runs plain after a selective block whose cache keeps its output) for a runtime checkpoint
/// mask `x` over blocks and groups where each checkpointed block `selective` gives a policy
/// (an index into its `BlockTerms::sel`) runs selective under it (the caller checks that the
/// block has that policy's terms).
pub fn with_selective(step: &StepTerms, x: &[bool], selective: &[Option<usize>]) -> Vec<bool> {
    let n = step.blocks.len();
    let groups: Vec<(usize, usize)> = step.groups.iter().map(|g| (g.first, g.last)).collect();
    let sel_var = selective_vars(step);
    let policy = |j: usize| {
        selective
            .get(j)
            .copied()
            .flatten()
            .filter(|&p| j < n && x[j] && p < sel_var[j].len())
    };
    let plain: Vec<bool> = x.iter().enumerate().map(|(j, &c)| c && policy(j).is_none()).collect();
    let mut full = with_fused(&plain, n, &groups);
    for (j, vs) in sel_var.iter().enumerate() {
        full.extend((0..vs.len()).map(|p| policy(j) == Some(p)));
    }
    for (j, h) in held::held_vars(step, &sel_var).iter().enumerate() {
        if h.is_some() {
            full.push(held::keeps(step, j - 1, policy(j - 1)) && !x[j]);
        }
    }
    full
}

/// The inverse of [`with_selective`]: for a full choice (unit order, every variable of
/// [`config_problem`]), the runtime's checkpoint mask over blocks and groups (a selective block
/// is checkpointed) and, per block, the policy it runs selective under (an index into its
/// `BlockTerms::sel`).
pub fn split_selective(step: &StepTerms, full: &[bool]) -> (Vec<bool>, Vec<Option<usize>>) {
    let n = step.blocks.len();
    let units = n + step.groups.len();
    let sel_var = selective_vars(step);
    let selective: Vec<Option<usize>> = sel_var
        .iter()
        .map(|vs| vs.iter().position(|&v| full.get(v) == Some(&true)))
        .collect();
    let mask = (0..units)
        .map(|u| full.get(u) == Some(&true) || selective.get(u).is_some_and(Option::is_some))
        .collect();
    (mask, selective)
}

/// `p` with its variables reordered: variable `v` of the result is unit `order[v]` of `p`.
pub fn permute(p: ConfigProblem, order: &[usize]) -> ConfigProblem {
    let mut inverse = vec![0; order.len()];
    for (v, &u) in order.iter().enumerate() {
        inverse[u] = v;
    }
    ConfigProblem {
        key: p.key,
        moments: p
            .moments
            .into_iter()
            .map(|m| Moment {
                label: m.label,
                constant: m.constant,
                coef: order.iter().map(|&u| m.coef[u]).collect(),
                occurs: match m.occurs {
                    Occurs::When(conds) => Occurs::When(conds.into_iter().map(|(u, on)| (inverse[u], on)).collect()),
                    other => other,
                },
            })
            .collect(),
        seconds_base: p.seconds_base,
        seconds_coef: order.iter().map(|&u| p.seconds_coef[u]).collect(),
        candidate: order.iter().map(|&u| p.candidate[u]).collect(),
        exclusive: p
            .exclusive
            .into_iter()
            .map(|g| g.into_iter().map(|u| inverse[u]).collect())
            .collect(),
        tied: p
            .tied
            .into_iter()
            .map(|c| c.into_iter().map(|u| inverse[u]).collect())
            .collect(),
    }
}

/// A choice over solver variables back in unit order.
pub fn unpermute(x: &[bool], order: &[usize]) -> Vec<bool> {
    let mut out = vec![false; x.len()];
    for (v, &u) in order.iter().enumerate() {
        out[u] = x[v];
    }
    out
}

#[cfg(test)]
mod tests;
