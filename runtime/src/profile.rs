//! The one-pass profiler: a constant number of instrumented steps per config, whatever the
//! number of candidate blocks, yields every term of the chain memory model (DESIGN.md) and the
//! per-block recompute times.
//!
//! Steps per config: 2 warm-up steps (nothing checkpointed, then everything: optimizer state,
//! lazily allocated gradients and oneDNN's primitive caches exist afterwards), then `repeats`
//! steps with nothing checkpointed (step A; the first is instrumented) and `repeats` with every
//! candidate checkpointed (step B; the first is instrumented). Memory comes from the two
//! instrumented steps; times are medians over the repeats.
//!
//! Terms are differences of absolute meter levels, with the level before each moment taken
//! from the model itself, so the model reproduces steps A and B exactly by construction; what
//! the sweep checks is that blocks combine independently (they do on a clean chain).

use std::time::Instant;

use ckptune_kernels::meter;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::error::{Result, RuntimeError};
use crate::exec::{MicroTrace, Session, StepTrace};

/// Per-block terms for one memory regime (bytes are deltas; seconds per micro-step).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockProfile {
    pub name: String,
    pub candidate: bool,
    /// Kept after a grad-mode forward (output and saved activations), and the forward's peak
    /// above its start.
    pub kept_grad: i64,
    pub fwd_transient_grad: i64,
    /// Kept after a no-grad forward (output and the RNG state), and its peak above its start.
    pub kept_nograd: i64,
    pub fwd_transient_nograd: i64,
    /// Gradient bytes alive when this block's backward starts (its output's gradient, the
    /// parameter gradients accumulated so far, the loss head's), above what earlier blocks keep.
    pub carry: i64,
    /// Plain block: peak of its VJP above the VJP's start.
    pub bwd_transient: i64,
    /// Checkpointed block: recompute peak above the backward base, kept after recompute, and
    /// its VJP's peak above the VJP's start.
    pub rec_transient: i64,
    pub kept_recompute: i64,
    pub bwd_transient_ckpt: i64,
    /// Output bytes and input-gradient bytes (informational; computed from shapes).
    pub grad_in_bytes: i64,
    pub fwd_seconds: f64,
    pub fwd_nograd_seconds: f64,
    pub bwd_seconds: f64,
    pub rec_seconds: f64,
}

/// Terms of a group (a module over a run of blocks) checkpointed as a whole, from the step
/// with every group checkpointed (step C). Bytes are above the group's forward start, or in
/// backward above its base: what earlier blocks keep plus `carry`.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupProfile {
    pub name: String,
    pub first: usize,
    pub last: usize,
    /// Kept after the group's no-grad forward (its last block's output).
    pub kept: i64,
    /// Per block of the group, in order: forward peak above the group's start.
    pub fwd_transient: Vec<i64>,
    /// Gradient bytes alive when the group's recompute starts, above what earlier blocks keep.
    pub carry: i64,
    /// Per block: recompute peak and VJP peak above the group's backward base.
    pub rec_transient: Vec<i64>,
    pub bwd_transient: Vec<i64>,
    /// Run fused (nothing in it checkpointed: one graph, as PyTorch runs the module): kept
    /// after its forward, forward peak per block above its start, carry, and the peak of its
    /// single VJP above the VJP's start.
    pub fused_kept: i64,
    pub fused_fwd_transient: Vec<i64>,
    pub fused_carry: i64,
    pub fused_bwd_transient: i64,
}

/// The terms of one micro-step regime: the first micro-step of an optimizer step allocates
/// parameter gradients (with `set_to_none`); later micro-steps accumulate into existing ones.
#[derive(Debug, Clone, PartialEq)]
pub struct RegimeProfile {
    pub label: String,
    /// Level at the micro-step's start.
    pub fixed: i64,
    /// Loss forward+backward peak above the level the chain leaves.
    pub loss_transient: i64,
    pub blocks: Vec<BlockProfile>,
    /// The chain's groups (empty when it has none).
    pub groups: Vec<GroupProfile>,
}

/// Bytes of the step's fixed state, by category.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FixedBytes {
    pub parameters: i64,
    pub buffers: i64,
    pub gradients: i64,
    pub optimizer_state: i64,
    /// Always 0 today: no config keeps fp32 master copies of low-precision parameters.
    pub master_weights: i64,
    pub batch: i64,
    /// Level at step start minus the categories above (tensors the process held before,
    /// e.g. the loaded model's originals): counted, never guessed.
    pub other: i64,
}

/// Median, min and max of repeated measurements.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Stats {
    pub fn of(xs: &[f64]) -> Stats {
        if xs.is_empty() {
            return Stats::default();
        }
        let mut v = xs.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 {
            v[mid]
        } else {
            0.5 * (v[mid - 1] + v[mid])
        };
        Stats {
            median,
            min: v[0],
            max: v[v.len() - 1],
            n: v.len(),
        }
    }
}

/// Everything measured for one config.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigProfile {
    pub regimes: Vec<RegimeProfile>,
    /// Absolute level at the optimizer step's peak.
    pub optimizer_peak: i64,
    pub fixed: FixedBytes,
    /// Measured whole-step peaks (absolute) with nothing and with everything checkpointed.
    pub peak_none: i64,
    pub peak_all: i64,
    /// Step times (whole optimizer step, all micro-steps) with nothing / everything checkpointed.
    pub seconds_none: Stats,
    pub seconds_all: Stats,
    /// Extra seconds per optimizer step if the block (then, after the blocks, the group) is
    /// checkpointed: its no-grad forward, once per micro-step.
    pub recompute_seconds: Vec<f64>,
    pub steps_run: usize,
    pub wall_seconds: f64,
}

/// Profiling settings.
#[derive(Debug, Clone)]
pub struct ProfileSettings {
    /// Timed repeats of each of steps A and B (≥ 1).
    pub repeats: usize,
    pub quiet: bool,
}

impl Default for ProfileSettings {
    fn default() -> Self {
        Self {
            repeats: 3,
            quiet: false,
        }
    }
}

pub fn progress_bar(len: u64, msg: &str, quiet: bool) -> ProgressBar {
    let target = if quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    };
    let pb = ProgressBar::with_draw_target(Some(len), target);
    if let Ok(style) = ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len} steps ({elapsed})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(msg.to_owned());
    pb
}

/// Profiles `session`'s config. The session's model must be fresh or in the same regime
/// (profiling trains it for a few steps; its weights change).
pub fn profile(session: &mut Session, settings: &ProfileSettings) -> Result<ConfigProfile> {
    meter::install()?;
    let t0 = Instant::now();
    let repeats = settings.repeats.max(1);
    let n = session.chain.blocks.len();
    let chain = &session.chain;
    let none = vec![false; chain.units()];
    let all: Vec<bool> = (0..chain.units()).map(|i| i < n && chain.unit_candidate(i)).collect();
    // Chains with groups: step C checkpoints every group whole, and step A (nothing
    // checkpointed) runs them fused as in production, so one more step, instrumented once
    // and with fusing off, measures the blocks' own plain terms (A′).
    let grouped: Option<Vec<bool>> = (!chain.groups.is_empty()).then(|| (0..chain.units()).map(|i| i >= n).collect());
    let kinds = 2 + usize::from(grouped.is_some());
    let split_steps = usize::from(grouped.is_some());
    let pb = progress_bar(
        (kinds + kinds * repeats + split_steps) as u64,
        &format!("profiling {}", session.cfg.label()),
        settings.quiet,
    );

    session.step(&none, None)?;
    pb.inc(1);
    session.step(&all, None)?;
    pb.inc(1);
    if let Some(c) = &grouped {
        session.step(c, None)?;
        pb.inc(1);
    }

    let mut trace_c = StepTrace::default();
    let mut group_secs: Vec<Vec<f64>> = vec![Vec::new(); session.chain.groups.len()];
    let mut trace_a = StepTrace::default();
    let mut trace_b = StepTrace::default();
    let mut secs_a = Vec::new();
    let mut secs_b = Vec::new();
    let mut fwd_ng: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut peak_none = 0;
    let mut peak_all = 0;
    for r in 0..repeats {
        let ra = session.step(&none, if r == 0 { Some(&mut trace_a) } else { None })?;
        pb.inc(1);
        secs_a.push(ra.seconds);
        if r == 0 {
            peak_none = ra.peak_bytes;
        }
        let mut tb = StepTrace::default();
        let rb = session.step(&all, Some(&mut tb))?;
        pb.inc(1);
        secs_b.push(rb.seconds);
        for (i, v) in fwd_ng.iter_mut().enumerate() {
            v.push(tb.micro.iter().map(|m| m.blocks[i].fwd_seconds).sum::<f64>());
        }
        if r == 0 {
            peak_all = rb.peak_bytes;
            trace_b = tb;
        }
        if let Some(c) = &grouped {
            let mut tc = StepTrace::default();
            session.step(c, Some(&mut tc))?;
            pb.inc(1);
            for (g, v) in session.chain.groups.iter().zip(group_secs.iter_mut()) {
                v.push(
                    tc.micro
                        .iter()
                        .map(|m| m.blocks[g.first..=g.last].iter().map(|b| b.fwd_seconds).sum::<f64>())
                        .sum(),
                );
            }
            if r == 0 {
                trace_c = tc;
            }
        }
    }
    // A′: the blocks' plain terms, with boundaries inside groups.
    let trace_split = match &grouped {
        None => None,
        Some(_) => {
            let mut t = StepTrace::default();
            session.fuse_groups = false;
            let r = session.step(&none, Some(&mut t));
            session.fuse_groups = true;
            r?;
            pb.inc(1);
            Some(t)
        }
    };
    pb.finish_and_clear();

    // With groups, A is the fused step and A′ gives the blocks' plain terms.
    let plain = trace_split.as_ref().unwrap_or(&trace_a);
    let fused = trace_split.as_ref().map(|_| &trace_a);
    let mut regimes = Vec::new();
    for (k, label) in ["first micro-step", "accumulating micro-step"]
        .into_iter()
        .enumerate()
        .take(trace_a.micro.len().min(2))
    {
        regimes.push(regime(
            label,
            &plain.micro[k],
            &trace_b.micro[k],
            trace_c.micro.get(k).zip(fused.map(|f| &f.micro[k])),
            &session.chain,
        )?);
    }
    // The no-grad forward is what checkpointing adds (the recompute replaces the grad-mode
    // forward of a plain step).
    let recompute_seconds: Vec<f64> = fwd_ng
        .iter()
        .zip(&session.chain.blocks)
        .map(|(v, b)| if b.candidate { Stats::of(v).median } else { 0.0 })
        .chain(group_secs.iter().map(|v| Stats::of(v).median))
        .collect();

    let (parameters, buffers) = session.param_and_buffer_bytes();
    let start = trace_a.micro[0].start;
    let batch = batch_bytes(session);
    let gradients = if session.cfg.set_to_none {
        0
    } else {
        session.grad_bytes()
    };
    let optimizer_state = session.optimizer_state_bytes();
    let fixed = FixedBytes {
        parameters,
        buffers,
        gradients,
        optimizer_state,
        master_weights: 0,
        batch,
        other: start - parameters - buffers - gradients - optimizer_state - batch,
    };
    Ok(ConfigProfile {
        regimes,
        optimizer_peak: trace_a.opt_peak,
        fixed,
        peak_none,
        peak_all,
        seconds_none: Stats::of(&secs_a),
        seconds_all: Stats::of(&secs_b),
        recompute_seconds,
        steps_run: kinds + kinds * repeats + split_steps,
        wall_seconds: t0.elapsed().as_secs_f64(),
    })
}

fn batch_bytes(session: &mut Session) -> i64 {
    let b = session.make_batch();
    let mut n = crate::exec::nbytes(&b.input) + crate::exec::nbytes(&b.target);
    if let Some(m) = &b.attention_mask {
        n += crate::exec::nbytes(m);
    }
    n
}

/// Terms of one regime from the instrumented micro-steps of steps A (plain blocks), B (all
/// candidate blocks checkpointed) and, for chains with groups, C (all groups checkpointed)
/// with D (all groups fused).
fn regime(
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
        blocks,
        groups,
    })
}

impl ConfigProfile {
    /// Every moment of the step predicted for checkpoint mask `x` (blocks in chain order), in
    /// execution order, labelled as [`measured_moments`] labels the same moments of a trace:
    /// DESIGN.md's chain model in this runtime's terms. With per-block autocast regions, what a
    /// block keeps during the forward is also what it keeps until its backward, so one "kept"
    /// term per mode suffices.
    ///
    /// `x` covers the blocks, then the groups ([`ckptune_models::Chain::units`]); a shorter
    /// mask leaves the groups off. A checkpointed group replaces its blocks' terms by its own.
    pub fn predict_moments(&self, x: &[bool]) -> Vec<(String, i64)> {
        /// How a run of the chain executes.
        enum Unit<'g> {
            Block(usize),
            Checkpointed(&'g GroupProfile),
            Fused(&'g GroupProfile),
        }
        let mut out = Vec::new();
        for r in &self.regimes {
            let n = r.blocks.len();
            let on = |i: usize| x.get(i) == Some(&true);
            let mut units: Vec<Unit<'_>> = Vec::new();
            let mut j = 0;
            while j < n {
                let found = r.groups.iter().enumerate().find(|(_, grp)| grp.first == j);
                match found {
                    Some((g, grp)) if on(n + g) => {
                        units.push(Unit::Checkpointed(grp));
                        j = grp.last + 1;
                    }
                    Some((_, grp)) if !(grp.first..=grp.last).any(on) => {
                        units.push(Unit::Fused(grp));
                        j = grp.last + 1;
                    }
                    _ => {
                        units.push(Unit::Block(j));
                        j += 1;
                    }
                }
            }
            let kept = |u: &Unit<'_>| match *u {
                Unit::Block(i) if on(i) => r.blocks[i].kept_nograd,
                Unit::Block(i) => r.blocks[i].kept_grad,
                Unit::Checkpointed(g) => g.kept,
                Unit::Fused(g) => g.fused_kept,
            };
            let mut level = r.fixed;
            for u in &units {
                let (first, fwd) = match *u {
                    Unit::Block(j) => {
                        let b = &r.blocks[j];
                        let t = if on(j) {
                            b.fwd_transient_nograd
                        } else {
                            b.fwd_transient_grad
                        };
                        out.push((format!("{}: forward {}", r.label, b.name), level + t));
                        level += kept(u);
                        continue;
                    }
                    Unit::Checkpointed(g) => (g.first, &g.fwd_transient),
                    Unit::Fused(g) => (g.first, &g.fused_fwd_transient),
                };
                for (k, t) in (first..).zip(fwd) {
                    out.push((format!("{}: forward {}", r.label, r.blocks[k].name), level + t));
                }
                level += kept(u);
            }
            out.push((format!("{}: loss", r.label), level + r.loss_transient));
            let mut below = level;
            for u in units.iter().rev() {
                below -= kept(u);
                match *u {
                    Unit::Block(j) => {
                        let b = &r.blocks[j];
                        let base = below + b.carry;
                        if on(j) {
                            out.push((format!("{}: recompute {}", r.label, b.name), base + b.rec_transient));
                            out.push((
                                format!("{}: backward {}", r.label, b.name),
                                base + b.kept_recompute + b.bwd_transient_ckpt,
                            ));
                        } else {
                            out.push((
                                format!("{}: backward {}", r.label, b.name),
                                base + b.kept_grad + b.bwd_transient,
                            ));
                        }
                    }
                    Unit::Checkpointed(g) => {
                        let base = below + g.carry;
                        for k in (g.first..=g.last).rev() {
                            let name = &r.blocks[k].name;
                            let q = k - g.first;
                            out.push((format!("{}: recompute {name}", r.label), base + g.rec_transient[q]));
                            out.push((format!("{}: backward {name}", r.label), base + g.bwd_transient[q]));
                        }
                    }
                    Unit::Fused(g) => out.push((
                        format!("{}: backward {}", r.label, g.name),
                        below + g.fused_carry + g.fused_kept + g.fused_bwd_transient,
                    )),
                }
            }
        }
        out.push(("optimizer step".to_owned(), self.optimizer_peak));
        out
    }

    /// The whole-step peak predicted for checkpoint mask `x`, with the (first) moment where it
    /// occurs.
    pub fn predict_peak(&self, x: &[bool]) -> (i64, String) {
        let mut best = (i64::MIN, String::new());
        for (label, v) in self.predict_moments(x) {
            if v > best.0 {
                best = (v, label);
            }
        }
        best
    }

    /// Predicted seconds per optimizer step for checkpoint mask `x`.
    pub fn predict_seconds(&self, x: &[bool]) -> f64 {
        self.seconds_none.median
            + x.iter()
                .zip(&self.recompute_seconds)
                .filter(|(c, _)| **c)
                .map(|(_, s)| s)
                .sum::<f64>()
    }
}

/// The moments of an instrumented step, labelled and ordered as [`ConfigProfile::predict_moments`]
/// predicts them for a step with `regimes` regimes (1, or 2 with gradient accumulation): the
/// first micro-step, and the second as the accumulating one.
pub fn measured_moments(trace: &StepTrace, chain: &ckptune_models::Chain, regimes: usize) -> Vec<(String, i64)> {
    let labels = ["first micro-step", "accumulating micro-step"];
    let mut out = Vec::new();
    for (m, label) in trace.micro.iter().zip(labels).take(regimes) {
        for (b, cb) in m.blocks.iter().zip(&chain.blocks) {
            out.push((format!("{label}: forward {}", cb.name), b.fwd_peak));
        }
        out.push((format!("{label}: loss"), m.loss_peak));
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
