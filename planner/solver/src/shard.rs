//! Each rank's step under PyTorch FSDP2 (`fully_shard` on every unit, then on the root), as
//! affine moments of the checkpoint choice: the single-process chain model
//! ([`crate::chain_model`]) with FSDP's sharding rules added at every moment. docs/fsdp.md
//! measures the rules on real multi-process runs and derives each term used here.
//!
//! Per unit `u` (a candidate block; the root holds every other parameter) over N ranks:
//! `P_u` its padded unsharded bytes (each parameter's dim 0 padded to a multiple of N), the
//! size of its all-gather buffer `F_u`, its unsharded parameters `U_u` and its reduce-scatter
//! input `RS_u`; `S_u = P_u / N` its shard, also the size of its sharded gradients; `L_u(r)`
//! rank r's unpadded chunk, what the optimizer state covers; `G_u` its unsharded gradients.

use crate::chain_model::Affine;
use crate::problem::{ConfigProblem, Moment, Occurs};

/// The FSDP units `plan --shard` wraps unless told otherwise: the candidate blocks whose names
/// end in their index, a model's repeated layers (`layer3`, `encoder.layer.11`, `h.5`,
/// `model.layers.7`).
pub fn is_default_unit(name: &str, candidate: bool) -> bool {
    candidate && name.ends_with(|c: char| c.is_ascii_digit())
}

/// One trainable parameter as FSDP2 shards it: on its own, along dim 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parameter {
    /// Qualified name, as `model.named_parameters()` gives it (`layer1.0.conv1.weight`).
    pub name: String,
    pub shape: Vec<i64>,
    pub element_bytes: i64,
}

impl Parameter {
    fn dim0(&self) -> i64 {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Bytes of one dim-0 row (the whole tensor for a scalar).
    fn row_bytes(&self) -> i64 {
        self.shape.iter().skip(1).product::<i64>() * self.element_bytes
    }

    /// Unsharded bytes.
    pub fn bytes(&self) -> i64 {
        self.dim0() * self.row_bytes()
    }

    /// Rows of each rank's chunk (`torch.chunk`: ceil-sized chunks, the last ones short or
    /// empty) and the padded rows every rank allocates.
    fn rows(&self, ranks: i64, rank: i64) -> (i64, i64) {
        let per = (self.dim0() + ranks - 1) / ranks;
        ((self.dim0() - rank * per).clamp(0, per), per)
    }

    /// Rank `rank`'s unpadded chunk and its padded shard, in bytes.
    pub fn shard_bytes(&self, ranks: i64, rank: i64) -> (i64, i64) {
        let (own, padded) = self.rows(ranks, rank);
        (own * self.row_bytes(), padded * self.row_bytes())
    }
}

/// Whose collectives run the all-gathers and reduce-scatters: gloo (CPU) allocates a temporary
/// of the all-gather's output and of the reduce-scatter's input (plus 12 bytes); NCCL (CUDA)
/// works in FSDP's own buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    Gloo,
    Nccl,
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::Gloo => "gloo",
            Collective::Nccl => "nccl",
        }
    }
}

/// How a plan shards: N ranks, `reshard_after_forward` of every unit, the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    pub ranks: i64,
    pub reshard_after_forward: bool,
    pub collective: Collective,
}

/// The optimizers a sharded plan models: `torch.optim`'s single-tensor loops
/// (`foreach=False`), run on each rank's local chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardOptimizer {
    AdamW,
    SgdMomentum,
}

impl ShardOptimizer {
    /// The CLI name's optimizer, if a sharded plan models it.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "adamw" => Some(ShardOptimizer::AdamW),
            "sgd-momentum" => Some(ShardOptimizer::SgdMomentum),
            _ => None,
        }
    }

    /// State bytes over local chunks `chunks` (one per parameter): AdamW's `exp_avg` and
    /// `exp_avg_sq` of each chunk and a float32 `step` per parameter (empty chunks included);
    /// SGD's momentum buffer of each chunk.
    fn state(self, chunks: &[i64]) -> i64 {
        let own: i64 = chunks.iter().sum();
        match self {
            ShardOptimizer::AdamW => 2 * own + 4 * chunks.len() as i64,
            ShardOptimizer::SgdMomentum => own,
        }
    }

    /// Peak of the step above its start: AdamW's single-tensor loop allocates two temporaries
    /// of the parameter it updates while the previous parameter's `denom` is still bound, plus
    /// 12 bytes (docs/fsdp.md, section 1); SGD with momentum updates its buffer and the
    /// parameter in place, and allocates the same 12 bytes (measured: `optimizer_peak` −
    /// `after_backward` of `python -m ckptune_harness.fsdp --optimizer sgd-momentum`).
    fn transient(self, chunks: &[i64]) -> i64 {
        match self {
            ShardOptimizer::AdamW => {
                (0..chunks.len())
                    .map(|k| 2 * chunks[k] + if k > 0 { chunks[k - 1] } else { 0 })
                    .max()
                    .unwrap_or(0)
                    + 12
            }
            ShardOptimizer::SgdMomentum => 12,
        }
    }
}

/// Why a profile cannot be planned sharded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    #[error("--shard {0}: the number of ranks must be at least 1")]
    Ranks(i64),
    #[error(
        "--shard: {0} has no layer to wrap with fully_shard (no candidate block is a numbered layer); \
         name the units with --shard-units REGEX"
    )]
    NoUnits(String),
    #[error(
        "--shard: the profile has nested candidates ({0}); FSDP units are layers: plan with \
         --granularity layer"
    )]
    Nested(String),
    #[error("--shard: {0}; profile the model again with this ckptune (the profile predates sharded plans)")]
    Missing(String),
    #[error("--shard: {0}")]
    Unsupported(String),
    #[error("--shard: unit {0:?} owns no parameter (fully_shard needs parameters to shard)")]
    EmptyUnit(String),
}

/// The loss: a float32 scalar under every precision a sharded plan models (fp32, and bf16
/// autocast, where cross-entropy runs in float32). It lives from the loss forward through the
/// optimizer step, as the `loss` variable of a training loop does.
const LOSS_BYTES: i64 = 4;

/// Everything the per-rank model needs: the chain's terms of the unsharded step (its
/// `fixed` holds the unsharded parameters and optimizer state), which blocks are FSDP units and
/// what each holds, and the measured levels FSDP's root hooks see.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardStep {
    pub chain: crate::chain_model::StepTerms,
    /// Block index of each unit, ascending.
    pub units: Vec<usize>,
    /// Every trainable parameter in `model.parameters()` order, with its owner: `Some(u)` for
    /// unit `u`, `None` for the root.
    pub params: Vec<(Parameter, Option<usize>)>,
    /// The measured terms besides the chain's.
    pub measured: Measured,
}

/// Byte sizes of one unit (or the root) on one rank.
#[derive(Debug, Clone, Copy, Default)]
struct Sizes {
    /// Padded unsharded (`P`), padded shard (`S`), unsharded gradients (`G`), the gradient of
    /// the last parameter (kept alive through the reduce-scatter).
    p: i64,
    s: i64,
    g: i64,
    last: i64,
}

impl ShardStep {
    /// The FSDP units: blocks whose names `is_unit` accepts; each parameter belongs to the unit
    /// whose name prefixes it (`layer1.` for `layer1.0.conv1.weight`), else to the root.
    pub fn new(
        chain: crate::chain_model::StepTerms,
        parameters: &[Parameter],
        is_unit: impl Fn(&str) -> bool,
        model: &str,
        measured: Measured,
    ) -> Result<Self, ShardError> {
        if let Some(g) = chain.groups.first() {
            return Err(ShardError::Nested(g.name.clone()));
        }
        if parameters.is_empty() {
            return Err(ShardError::Missing(format!(
                "the profile of {model} has no parameter shapes"
            )));
        }
        let units: Vec<usize> = (0..chain.blocks.len())
            .filter(|&j| is_unit(&chain.blocks[j].name))
            .collect();
        if units.is_empty() {
            return Err(ShardError::NoUnits(model.to_owned()));
        }
        let params: Vec<(Parameter, Option<usize>)> = parameters
            .iter()
            .map(|p| {
                let owner = units.iter().position(|&j| {
                    let name = &chain.blocks[j].name;
                    p.name.len() > name.len()
                        && p.name.starts_with(name.as_str())
                        && p.name.as_bytes()[name.len()] == b'.'
                });
                (p.clone(), owner)
            })
            .collect();
        for (u, &j) in units.iter().enumerate() {
            if !params.iter().any(|(_, o)| *o == Some(u)) {
                return Err(ShardError::EmptyUnit(chain.blocks[j].name.clone()));
            }
        }
        Ok(ShardStep {
            chain,
            units,
            params,
            measured,
        })
    }

    /// Names of the units, in forward order.
    pub fn unit_names(&self) -> Vec<String> {
        self.units.iter().map(|&j| self.chain.blocks[j].name.clone()).collect()
    }

    /// Sizes of each unit, then the root (last), on rank `rank` of `ranks`; and the rank's
    /// local chunk of every parameter, in parameters() order.
    fn sizes(&self, ranks: i64, rank: i64) -> (Vec<Sizes>, Vec<i64>) {
        let k = self.units.len();
        let mut out = vec![Sizes::default(); k + 1];
        let mut chunks = Vec::with_capacity(self.params.len());
        for (p, owner) in &self.params {
            let (own, padded) = p.shard_bytes(ranks, rank);
            let z = &mut out[owner.unwrap_or(k)];
            z.p += padded * ranks;
            z.s += padded;
            z.g += p.bytes();
            z.last = p.bytes();
            chunks.push(own);
        }
        (out, chunks)
    }

    /// Per rank, the lowest rank with the same local chunks: ranks whose chunks are equal have
    /// the same moments (only the optimizer state over the chunks tells ranks apart).
    fn rank_classes(&self, ranks: i64) -> Vec<i64> {
        let chunks: Vec<Vec<i64>> = (0..ranks).map(|r| self.sizes(ranks, r).1).collect();
        (0..chunks.len())
            .map(|r| chunks.iter().position(|c| *c == chunks[r]).unwrap_or(r) as i64)
            .collect()
    }

    /// Ranks whose moments differ: one representative per class, the lowest rank.
    pub fn distinct_ranks(&self, ranks: i64) -> Vec<i64> {
        let classes = self.rank_classes(ranks);
        (0..ranks).filter(|&r| classes[r as usize] == r).collect()
    }

    /// Every moment of rank `rank`'s step, affine in the checkpoint choice over the chain's
    /// blocks, in execution order (docs/fsdp.md, "For the Rust model", derives each one).
    pub fn moments(&self, spec: ShardSpec, rank: i64) -> Vec<Moment> {
        let step = &self.chain;
        let b = &step.blocks;
        let n = b.len();
        let nn = spec.ranks;
        let (sz, chunks) = self.sizes(nn, rank);
        let k = self.units.len();
        let root = sz[k];
        let sum_s: i64 = sz.iter().map(|z| z.s).sum();
        // A flat all-gather buffer exists with more than one rank; gloo's temporaries too.
        let flat = |p: i64| if nn > 1 { p } else { 0 };
        let temp = |p: i64| {
            if nn > 1 && spec.collective == Collective::Gloo {
                p
            } else {
                0
            }
        };
        let unit_at = |j: usize| self.units.iter().position(|&u| u == j);
        // The unit before block j in forward order: its prefetched buffer is alive while j's
        // backward runs (reshard after forward only).
        let unit_before = |j: usize| self.units.iter().rposition(|&u| u < j);
        let raf = spec.reshard_after_forward;
        // The step's start: the chain's, with the unsharded parameters and optimizer state
        // replaced by this rank's shards and their state, and the device mesh's rank tensor.
        let fixed = step.fixed - self.measured.parameters_bytes - self.measured.optimizer_state_bytes
            + sum_s
            + self.measured.optimizer.state(&chunks)
            + 4 * nn;
        let shift = fixed - step.fixed;
        let mut out = Vec::new();
        let push = |out: &mut Vec<Moment>, a: &Affine, label: String, occurs: Occurs| {
            out.push(a.moment(label, occurs));
        };

        // ---- forward: the root's parameters stay unsharded throughout ----------------------
        let r = root.p;
        push(
            &mut out,
            &Affine::new(n, fixed + flat(r) + temp(r)),
            "all-gather <root>".into(),
            Occurs::Always,
        );
        push(
            &mut out,
            &Affine::new(n, fixed + flat(r) + r),
            "copy-out <root>".into(),
            Occurs::Always,
        );
        let mut kept = Affine::new(n, fixed);
        let mut cur_f = flat(r);
        let mut kept_units = 0i64; // reshard_after_forward = false: units unsharded so far
        for (j, blk) in b.iter().enumerate() {
            let mut here = kept.clone();
            here.add(r + kept_units);
            if let Some(u) = unit_at(j) {
                let p = sz[u].p;
                let name = &blk.name;
                push(
                    &mut out,
                    here.clone().add(cur_f + flat(p) + temp(p)),
                    format!("all-gather {name}"),
                    Occurs::Always,
                );
                push(
                    &mut out,
                    here.clone().add(flat(p) + p),
                    format!("copy-out {name}"),
                    Occurs::Always,
                );
                let mut m = here.clone();
                m.add(flat(p) + p).term(j, blk.fg, blk.fng);
                push(&mut out, &m, format!("forward {name}"), Occurs::Always);
                cur_f = flat(p);
                if !raf {
                    kept_units += p;
                }
            } else {
                let mut m = here.clone();
                m.add(cur_f).term(j, blk.fg, blk.fng);
                push(&mut out, &m, format!("forward {}", blk.name), Occurs::Always);
            }
            kept.term(j, blk.kg, blk.kng);
        }

        // ---- loss: the root's forward ends with it; its post-forward frees the last buffer,
        // and its pre-backward prefetches the last unit (reshard after forward) ----------------
        let mut kept_all = Affine::new(n, fixed);
        for (i, blk) in b.iter().enumerate() {
            kept_all.term(i, blk.krec, blk.out);
        }
        let last = sz[k - 1].p;
        let prefetched = if raf { flat(last) } else { 0 };
        push(
            &mut out,
            kept_all
                .clone()
                .add(self.measured.loss_forward + r + kept_units + cur_f),
            "loss forward".into(),
            Occurs::Always,
        );
        if raf {
            push(
                &mut out,
                kept_all
                    .clone()
                    .add(self.measured.loss_kept + r + flat(last) + temp(last)),
                format!("prefetch {} (root pre-backward)", b[self.units[k - 1]].name),
                Occurs::Always,
            );
        }
        push(
            &mut out,
            kept_all
                .clone()
                .add(step.lf.max(step.lk + step.lb) + r + kept_units + prefetched),
            "loss".into(),
            Occurs::Always,
        );

        // ---- backward, last block first --------------------------------------------------
        let mut prefix_kb = Vec::with_capacity(n + 1);
        let mut acc = Affine::new(n, 0);
        for (i, blk) in b.iter().enumerate() {
            prefix_kb.push(acc.clone());
            acc.term(i, blk.krec, blk.out);
        }
        // The level before block j's VJP: the chain's backward base plus the block's own kept
        // bytes (its saved tensors, or its output when checkpointed).
        let grads_after = |j: usize| b[j + 1..].iter().map(|x| x.g).sum::<i64>();
        let pre_vjp = |j: usize| {
            let mut a = prefix_kb[j].clone();
            a.add(step.fixed + grads_after(j) + b[j].gout)
                .term(j, b[j].krec, b[j].out);
            a
        };
        // What eager PyTorch holds when block j's backward is about to start (its pre-backward
        // hook), and so also right after block j + 1's backward: the single process's level
        // before j's VJP without the output nothing saved.
        let at_backward_start = |j: usize| {
            let mut a = pre_vjp(j);
            let (plain, ckpt) = self.measured.released[j];
            a.term(j, -plain, -ckpt);
            a
        };
        let phantom = |blk: &crate::chain_model::BlockTerms| blk.krec.saturating_add(blk.bta).min(0).saturating_sub(1);
        // FSDP bytes beside the chain's: reduce-scattered units' shards for their unsharded
        // gradients, the last reduce-scatter input, and unsharded parameters.
        let mut sharded_grads = 0i64; // Σ (S_v − G_v) over units done
        let mut rs_prev = 0i64;
        for j in (0..n).rev() {
            let blk = &b[j];
            let unit = unit_at(j);
            let f_pending = if raf {
                unit_before(j).map_or(0, |v| flat(sz[v].p))
            } else {
                0
            };
            let unsharded = if raf {
                unit.map_or(0, |u| sz[u].p)
            } else {
                self.units
                    .iter()
                    .enumerate()
                    .filter(|&(_, &uj)| uj <= j)
                    .map(|(v, _)| sz[v].p)
                    .sum()
            };
            let fsdp = shift + r + sharded_grads + rs_prev;
            if let (Some(u), true) = (unit, raf) {
                let p = sz[u].p;
                let name = &blk.name;
                push(
                    &mut out,
                    at_backward_start(j).add(fsdp + p + flat(p)),
                    format!("copy-out {name} (pre-backward)"),
                    Occurs::Always,
                );
                if let Some(v) = unit_before(j) {
                    let q = sz[v].p;
                    push(
                        &mut out,
                        at_backward_start(j).add(fsdp + p + flat(q) + temp(q)),
                        format!("prefetch {} ({name} pre-backward)", b[self.units[v]].name),
                        Occurs::Always,
                    );
                }
            }
            let mut base = prefix_kb[j].clone();
            base.add(step.fixed + grads_after(j) + blk.gout + fsdp + unsharded + f_pending);
            let mut rec = base.clone();
            rec.term(j, phantom(blk), blk.frec);
            push(
                &mut out,
                &rec,
                format!("recompute {}", blk.name),
                Occurs::When(vec![(j, true)]),
            );
            base.add(blk.krec).term(j, blk.bta, blk.btb);
            push(&mut out, &base, format!("backward {}", blk.name), Occurs::Always);
            if let Some(u) = unit {
                // Post-backward: the unit's parameters resharded, the previous reduce-scatter
                // input freed; its gradients copied into one flat input (all but the last one
                // freed) and reduce-scattered into its sharded gradients.
                let z = sz[u];
                let mut after = if j > 0 {
                    at_backward_start(j - 1)
                } else {
                    Affine::new(n, step.fixed + self.measured.after_backward)
                };
                after.add(
                    shift + r + sharded_grads + unsharded - z.p + f_pending - z.g + z.last + z.p + z.s + temp(z.p + 12),
                );
                push(&mut out, &after, format!("reduce-scatter {}", blk.name), Occurs::Always);
                sharded_grads += z.s - z.g;
                rs_prev = z.p;
            }
        }

        // ---- end of backward: the root's post-backward, in FSDP's final callback ------------
        let end = fixed + self.measured.after_backward + sharded_grads + r + rs_prev;
        push(&mut out, &Affine::new(n, end), "end of backward".into(), Occurs::Always);
        let rs_root = end - r - rs_prev + r - root.g + root.last + root.s + temp(r + 12);
        push(
            &mut out,
            &Affine::new(n, rs_root),
            "reduce-scatter <root>".into(),
            Occurs::Always,
        );

        // ---- optimizer: on the local chunks, with the sharded gradients ----------------------
        let opt = fixed + LOSS_BYTES + sum_s + self.measured.optimizer.transient(&chunks);
        push(&mut out, &Affine::new(n, opt), "optimizer".into(), Occurs::Always);
        out
    }
}

/// The measured terms [`ShardStep::new`] takes besides the chain's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    /// Of the chain's `fixed`: the unsharded parameters and the optimizer state.
    pub parameters_bytes: i64,
    pub optimizer_state_bytes: i64,
    /// Above the level the chain leaves: the loss head's forward peak, and its level with
    /// backward's seed made. Above `fixed`: the level when the last block's backward is done.
    pub loss_forward: i64,
    pub loss_kept: i64,
    pub after_backward: i64,
    pub optimizer: ShardOptimizer,
    /// Per block: the bytes of its output its backward frees as it starts, plain and
    /// checkpointed (the single process holds the output until then; eager PyTorch frees an
    /// output nothing saved once its readers' backward ran).
    pub released: Vec<(i64, i64)>,
}

impl ShardStep {
    /// The solver's input for this step sharded as `spec`: the moments of every rank whose
    /// moments differ (labelled `rank r: …`), so the solved peak is the highest rank's.
    /// Step time is the single process's: FSDP's collectives are not timed.
    pub fn config_problem(&self, key: impl Into<String>, spec: ShardSpec) -> ConfigProblem {
        let mut moments = Vec::new();
        for r in self.distinct_ranks(spec.ranks) {
            for mut m in self.moments(spec, r) {
                m.label = format!("rank {r}: {}", m.label);
                moments.push(m);
            }
        }
        ConfigProblem {
            key: key.into(),
            moments,
            seconds_base: self.chain.base_seconds,
            seconds_coef: self.chain.blocks.iter().map(|b| b.recompute_seconds).collect(),
            candidate: self.chain.blocks.iter().map(|b| b.candidate).collect(),
            exclusive: Vec::new(),
        }
    }

    /// Each rank's peak under checkpoint choice `x` (over the chain's blocks) and the moment
    /// it occurs, in rank order.
    pub fn rank_peaks(&self, spec: ShardSpec, x: &[bool]) -> Vec<(i64, String)> {
        let mut peaks: Vec<(i64, String)> = Vec::new();
        // A rank's class is itself or a lower rank, whose peak is already there.
        for (r, c) in self.rank_classes(spec.ranks).into_iter().enumerate() {
            let peak = if c as usize == r {
                let ms = self.moments(spec, c);
                let (v, k) = crate::problem::peak_of(&ms, x).expect("a step has moments");
                (v, ms[k].label.clone())
            } else {
                peaks[c as usize].clone()
            };
            peaks.push(peak);
        }
        peaks
    }
}
