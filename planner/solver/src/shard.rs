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

use crate::chain_model::{phantom, Affine, BlockTerms, StepTerms};
use crate::problem::{ties_by_name, ConfigProblem, Moment, Occurs};

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

/// The backward's seed: `loss.backward()`'s float32 `ones_like(loss)` (the loss is float32 under
/// every precision a sharded plan models). The profile's `after_backward` counts it; it is
/// freed when `backward()` returns, before the optimizer step.
const SEED_BYTES: i64 = 4;

/// Everything the per-rank model needs: the chain's terms of the unsharded step (its
/// `fixed` holds the unsharded parameters and optimizer state), which blocks are FSDP units and
/// what each holds, and the measured levels FSDP's root hooks see.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardStep {
    pub chain: StepTerms,
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
        chain: StepTerms,
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
        let r = RankStep::new(self, spec, rank);
        let mut out = Vec::new();
        let fwd = r.forward(&mut out);
        r.loss(&fwd, &mut out);
        let scattered = r.backward(&mut out);
        r.end(&scattered, &mut out);
        out
    }
}

/// One rank's step: the sizes every phase of [`ShardStep::moments`] reads, and the rules of
/// FSDP's buffers.
struct RankStep<'a> {
    step: &'a ShardStep,
    spec: ShardSpec,
    /// Each unit's sizes, then the root's (last); the rank's local chunk of every parameter.
    sz: Vec<Sizes>,
    chunks: Vec<i64>,
    root: Sizes,
    /// Σ S over the units and the root.
    sum_s: i64,
    /// The step's start: the chain's, with the unsharded parameters and optimizer state
    /// replaced by this rank's shards and their state, and the device mesh's rank tensor.
    fixed: i64,
    /// `fixed` less the chain's.
    shift: i64,
}

/// Where the forward leaves FSDP's buffers.
struct AfterForward {
    /// Units left unsharded so far (`reshard_after_forward = false`).
    kept_units: i64,
    /// The all-gather buffer alive.
    cur_f: i64,
}

/// FSDP's parameter buffers alive while a block runs backward.
struct Held {
    /// Unsharded parameters: the block's unit's (reshard after forward), else every unit's
    /// up to the block.
    unsharded: i64,
    /// The all-gather buffer of the unit before, prefetched (reshard after forward).
    f_pending: i64,
}

/// FSDP's gradient bytes beside the chain's as backward goes.
#[derive(Default)]
struct Scattered {
    /// Σ (S_v − G_v) over the units reduce-scattered.
    sharded_grads: i64,
    /// The last reduce-scatter input.
    rs_prev: i64,
}

impl<'a> RankStep<'a> {
    fn new(step: &'a ShardStep, spec: ShardSpec, rank: i64) -> Self {
        let chain = &step.chain;
        let nn = spec.ranks;
        let (sz, chunks) = step.sizes(nn, rank);
        let root = sz[step.units.len()];
        let sum_s: i64 = sz.iter().map(|z| z.s).sum();
        let fixed = chain.fixed - step.measured.parameters_bytes - step.measured.optimizer_state_bytes
            + sum_s
            + step.measured.optimizer.state(&chunks)
            + 4 * nn;
        RankStep {
            step,
            spec,
            sz,
            chunks,
            root,
            sum_s,
            fixed,
            shift: fixed - chain.fixed,
        }
    }

    fn blocks(&self) -> &'a [BlockTerms] {
        &self.step.chain.blocks
    }

    fn n(&self) -> usize {
        self.step.chain.blocks.len()
    }

    /// A flat all-gather buffer exists with more than one rank; gloo's temporaries too.
    fn flat(&self, p: i64) -> i64 {
        if self.spec.ranks > 1 {
            p
        } else {
            0
        }
    }

    fn temp(&self, p: i64) -> i64 {
        if self.spec.ranks > 1 && self.spec.collective == Collective::Gloo {
            p
        } else {
            0
        }
    }

    fn unit_at(&self, j: usize) -> Option<usize> {
        self.step.units.iter().position(|&u| u == j)
    }

    /// The unit before block j in forward order: its prefetched buffer is alive while j's
    /// backward runs (reshard after forward only).
    fn unit_before(&self, j: usize) -> Option<usize> {
        self.step.units.iter().rposition(|&u| u < j)
    }

    // ---- forward: the root's parameters stay unsharded throughout --------------------------

    fn forward(&self, out: &mut Vec<Moment>) -> AfterForward {
        let (fixed, n, r) = (self.fixed, self.n(), self.root.p);
        out.push(
            Affine::new(n, fixed + self.flat(r) + self.temp(r)).moment("all-gather <root>".into(), Occurs::Always),
        );
        out.push(Affine::new(n, fixed + self.flat(r) + r).moment("copy-out <root>".into(), Occurs::Always));
        let mut kept = Affine::new(n, fixed);
        let mut cur_f = self.flat(r);
        let mut kept_units = 0i64;
        for (j, blk) in self.blocks().iter().enumerate() {
            let mut here = kept.clone();
            here.add(r + kept_units);
            if let Some(u) = self.unit_at(j) {
                let p = self.sz[u].p;
                let name = &blk.name;
                let mut gather = here.clone();
                gather.add(cur_f + self.flat(p) + self.temp(p));
                out.push(gather.moment(format!("all-gather {name}"), Occurs::Always));
                let mut copy_out = here.clone();
                copy_out.add(self.flat(p) + p);
                out.push(copy_out.moment(format!("copy-out {name}"), Occurs::Always));
                let mut m = here.clone();
                m.add(self.flat(p) + p).term(j, blk.fg, blk.fng);
                out.push(m.moment(format!("forward {name}"), Occurs::Always));
                cur_f = self.flat(p);
                if !self.spec.reshard_after_forward {
                    kept_units += p;
                }
            } else {
                let mut m = here.clone();
                m.add(cur_f).term(j, blk.fg, blk.fng);
                out.push(m.moment(format!("forward {}", blk.name), Occurs::Always));
            }
            kept.term(j, blk.kg, blk.kng);
        }
        AfterForward { kept_units, cur_f }
    }

    // ---- loss: the root's forward ends with it; its post-forward frees the last buffer, and
    // its pre-backward prefetches the last unit (reshard after forward) ------------------------

    fn loss(&self, fwd: &AfterForward, out: &mut Vec<Moment>) {
        let (chain, measured) = (&self.step.chain, &self.step.measured);
        let (r, raf) = (self.root.p, self.spec.reshard_after_forward);
        let k = self.step.units.len();
        let mut kept_all = Affine::new(self.n(), self.fixed);
        for (i, blk) in self.blocks().iter().enumerate() {
            kept_all.term(i, blk.krec, blk.out);
        }
        let last = self.sz[k - 1].p;
        let prefetched = if raf { self.flat(last) } else { 0 };
        let mut forward = kept_all.clone();
        forward.add(measured.loss_forward + r + fwd.kept_units + fwd.cur_f);
        out.push(forward.moment("loss forward".into(), Occurs::Always));
        if raf {
            let mut prefetch = kept_all.clone();
            prefetch.add(measured.loss_kept + r + self.flat(last) + self.temp(last));
            let name = &self.blocks()[self.step.units[k - 1]].name;
            out.push(prefetch.moment(format!("prefetch {name} (root pre-backward)"), Occurs::Always));
        }
        let mut loss = kept_all;
        loss.add(chain.lf.max(chain.lk + chain.lb) + r + fwd.kept_units + prefetched);
        out.push(loss.moment("loss".into(), Occurs::Always));
    }

    // ---- backward, last block first --------------------------------------------------------

    fn backward(&self, out: &mut Vec<Moment>) -> Scattered {
        let b = self.blocks();
        let levels = ChainLevels::new(self.step);
        let mut s = Scattered::default();
        for j in (0..self.n()).rev() {
            let blk = &b[j];
            let unit = self.unit_at(j);
            let held = self.held(j, unit);
            // FSDP bytes beside the chain's: reduce-scattered units' shards for their
            // unsharded gradients, the last reduce-scatter input, and unsharded parameters.
            let fsdp = self.shift + self.root.p + s.sharded_grads + s.rs_prev;
            if let (Some(u), true) = (unit, self.spec.reshard_after_forward) {
                self.pre_backward(&levels, j, u, fsdp, out);
            }
            let mut base = levels.prefix_kb[j].clone();
            base.add(self.step.chain.fixed + levels.grads_after(j) + blk.gout + fsdp + held.unsharded + held.f_pending);
            let mut rec = base.clone();
            rec.term(j, phantom(blk), blk.frec);
            out.push(rec.moment(format!("recompute {}", blk.name), Occurs::When(vec![(j, true)])));
            base.add(blk.krec).term(j, blk.bta, blk.btb);
            out.push(base.moment(format!("backward {}", blk.name), Occurs::Always));
            if let Some(u) = unit {
                let after = self.post_backward(&levels, j, u, &s, &held);
                out.push(after.moment(format!("reduce-scatter {}", blk.name), Occurs::Always));
                let z = self.sz[u];
                s.sharded_grads += z.s - z.g;
                s.rs_prev = z.p;
            }
        }
        s
    }

    /// FSDP's parameter buffers alive while block `j` (unit `unit`, if one) runs backward.
    fn held(&self, j: usize, unit: Option<usize>) -> Held {
        if self.spec.reshard_after_forward {
            Held {
                unsharded: unit.map_or(0, |u| self.sz[u].p),
                f_pending: self.unit_before(j).map_or(0, |v| self.flat(self.sz[v].p)),
            }
        } else {
            Held {
                unsharded: self
                    .step
                    .units
                    .iter()
                    .enumerate()
                    .filter(|&(_, &uj)| uj <= j)
                    .map(|(v, _)| self.sz[v].p)
                    .sum(),
                f_pending: 0,
            }
        }
    }

    /// Unit `u`'s (block `j`'s) pre-backward with reshard after forward: its parameters
    /// copied out of their all-gather, and the unit before it prefetched.
    fn pre_backward(&self, levels: &ChainLevels<'_>, j: usize, u: usize, fsdp: i64, out: &mut Vec<Moment>) {
        let p = self.sz[u].p;
        let name = &self.blocks()[j].name;
        let copy_out = levels
            .at_backward_start(j)
            .add(fsdp + p + self.flat(p))
            .moment(format!("copy-out {name} (pre-backward)"), Occurs::Always);
        out.push(copy_out);
        if let Some(v) = self.unit_before(j) {
            let q = self.sz[v].p;
            let before = &self.blocks()[self.step.units[v]].name;
            let prefetch = levels
                .at_backward_start(j)
                .add(fsdp + p + self.flat(q) + self.temp(q))
                .moment(format!("prefetch {before} ({name} pre-backward)"), Occurs::Always);
            out.push(prefetch);
        }
    }

    /// Post-backward of unit `u` (block `j`): the unit's parameters resharded, the previous
    /// reduce-scatter input freed; its gradients copied into one flat input (all but the last
    /// one freed) and reduce-scattered into its sharded gradients.
    fn post_backward(&self, levels: &ChainLevels<'_>, j: usize, u: usize, s: &Scattered, held: &Held) -> Affine {
        let z = self.sz[u];
        let mut after = if j > 0 {
            levels.at_backward_start(j - 1)
        } else {
            Affine::new(self.n(), self.step.chain.fixed + self.step.measured.after_backward)
        };
        after.add(
            self.shift + self.root.p + s.sharded_grads + held.unsharded - z.p + held.f_pending - z.g
                + z.last
                + z.p
                + z.s
                + self.temp(z.p + 12),
        );
        after
    }

    // ---- end of backward: the root's post-backward, in FSDP's final callback; then the
    // optimizer, on the local chunks with the sharded gradients --------------------------------

    fn end(&self, s: &Scattered, out: &mut Vec<Moment>) {
        let (n, r, root) = (self.n(), self.root.p, self.root);
        let measured = &self.step.measured;
        let end = self.fixed + measured.after_backward + s.sharded_grads + r + s.rs_prev;
        out.push(Affine::new(n, end).moment("end of backward".into(), Occurs::Always));
        let rs_root = end - r - s.rs_prev + r - root.g + root.last + root.s + self.temp(r + 12);
        out.push(Affine::new(n, rs_root).moment("reduce-scatter <root>".into(), Occurs::Always));
        // The single process's level after backward holds the loss but no longer the
        // micro-step's attention masks and shared inputs, which `fixed` counts: the optimizer
        // starts from it, less the seed, with the unsharded gradients replaced by the shards.
        let grads: i64 = self.sz.iter().map(|z| z.g).sum();
        let after = self.fixed + measured.after_backward - grads - SEED_BYTES + self.sum_s;
        let opt = after + measured.optimizer.transient(&self.chunks);
        out.push(Affine::new(n, opt).moment("optimizer".into(), Occurs::Always));
    }
}

/// The single process's levels in backward that FSDP's moments add their buffers to.
struct ChainLevels<'a> {
    chain: &'a StepTerms,
    /// Per block: its output bytes its backward frees as it starts ([`Measured::released`]).
    released: &'a [(i64, i64)],
    /// Σ_{i<j} kb_i, per block j.
    prefix_kb: Vec<Affine>,
}

impl<'a> ChainLevels<'a> {
    fn new(step: &'a ShardStep) -> Self {
        let chain = &step.chain;
        let n = chain.blocks.len();
        let mut prefix_kb = Vec::with_capacity(n + 1);
        let mut acc = Affine::new(n, 0);
        for (i, blk) in chain.blocks.iter().enumerate() {
            prefix_kb.push(acc.clone());
            acc.term(i, blk.krec, blk.out);
        }
        ChainLevels {
            chain,
            released: &step.measured.released,
            prefix_kb,
        }
    }

    fn grads_after(&self, j: usize) -> i64 {
        self.chain.blocks[j + 1..].iter().map(|x| x.g).sum::<i64>()
    }

    /// The level before block j's VJP: the chain's backward base plus the block's own kept
    /// bytes (its saved tensors, or its output when checkpointed).
    fn pre_vjp(&self, j: usize) -> Affine {
        let b = &self.chain.blocks;
        let mut a = self.prefix_kb[j].clone();
        a.add(self.chain.fixed + self.grads_after(j) + b[j].gout)
            .term(j, b[j].krec, b[j].out);
        a
    }

    /// What eager PyTorch holds when block j's backward is about to start (its pre-backward
    /// hook), and so also right after block j + 1's backward: the single process's level
    /// before j's VJP without the output nothing saved.
    fn at_backward_start(&self, j: usize) -> Affine {
        let mut a = self.pre_vjp(j);
        let (plain, ckpt) = self.released[j];
        a.term(j, -plain, -ckpt);
        a
    }
}

/// The measured terms [`ShardStep::new`] takes besides the chain's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    /// Of the chain's `fixed`: the unsharded parameters and the optimizer state.
    pub parameters_bytes: i64,
    pub optimizer_state_bytes: i64,
    /// Above the level the chain leaves: the loss head's forward peak, and its level with
    /// backward's seed made. Above `fixed`: the level when the last block's backward is done
    /// (the loss and the seed alive, the micro-step's attention masks and shared inputs, which
    /// `fixed` counts, freed).
    pub loss_forward: i64,
    pub loss_kept: i64,
    pub after_backward: i64,
    pub optimizer: ShardOptimizer,
    /// Per block: the bytes of its output its backward frees as it starts, plain and
    /// checkpointed (the single process holds the output until then, unless it let go of it
    /// after its only reader, which kept none of it: 0 then; eager PyTorch frees an output
    /// nothing saved once its readers' backward ran).
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
            tied: ties_by_name(
                (self.chain.blocks.iter().enumerate())
                    .filter(|(_, b)| b.candidate)
                    .map(|(j, b)| (j, b.name.as_str())),
            ),
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
