//! A chain prepared for training under one config: its optimizer, the buffers a recompute
//! restores, the memory probe, and what the rest of the step asks of them.

use std::cell::{Cell, OnceCell};

use ckptune_kernels::autocast::AutocastGuard;
use ckptune_kernels::fake::{self, FakeMode, GpuGeometry};
use ckptune_kernels::host_memory::HostMemoryHold;
use ckptune_kernels::sac::SacPolicy;
use ckptune_models::{Batch, Chain};
use tch::{Device, Kind, Tensor};

use super::in_backward::InBackward;
use super::select::select;
use crate::config::{Precision, TrainConfig};
use crate::error::{Result, RuntimeError};
use crate::memory::Probe;
use crate::optim::{self, Optimizer};

/// A chain prepared for training under one config.
pub struct Session {
    pub chain: Chain,
    pub cfg: TrainConfig,
    pub device: Device,
    pub(super) opt: Box<dyn Optimizer>,
    /// Per block: its buffers (BatchNorm statistics), restored after a recompute.
    pub(super) buffers: Vec<Vec<Tensor>>,
    /// fp16 dynamic loss scale.
    pub(super) scale: f64,
    /// Seed of the next batch, so runs are reproducible.
    next_seed: i64,
    pub(super) probe: Probe,
    /// Run a group none of whose units is checkpointed as one graph, without boundaries inside
    /// (what PyTorch does with the module: an output no later op saved dies with the module's
    /// locals, where a boundary would keep it until backward). On by default; the profiler
    /// turns it off once to measure the blocks' own terms.
    pub fuse_groups: bool,
    /// Hold autocast's cache of weight casts over the forward and the loss in one region, as a
    /// loop with the cache on does ([`TrainConfig::autocast_cache`]). On when the config says so;
    /// the profiler turns it off, so that each block's own region frees its casts and the
    /// meter sees them block by block (docs/memory-model.md, "Autocast's cache").
    pub hold_casts: bool,
    /// Per block: run it selective under this policy when the checkpoint mask checkpoints it
    /// on its own (not inside a checkpointed group): its forward keeps the outputs of the
    /// operators the policy saves and its recompute computes only the rest. Empty: every
    /// checkpointed block is checkpointed whole.
    pub selective: Vec<Option<SacPolicy>>,
    /// For a config that steps the optimizer in backward: the parameters' hooks are set, and
    /// this says when a gradient is complete.
    pub(super) in_backward: Option<InBackward>,
    /// Per block: whether its output's storage is held by more than the output itself when
    /// its grad-mode forward or recompute returns (its graph saved it), learned the first time
    /// it runs with grad. Such an output, or one not yet known, is held until the block's
    /// backward; another whose only reader is the next block is let go after that reader
    /// (docs/memory-model.md, "The execution scheme"): a property of the block, so that what
    /// a boundary holds is linear in the reader's choice.
    pub(super) output_saved: Vec<Cell<Option<bool>>>,
    /// Per block: whether its grad-mode forward or recompute keeps its input's storage (saved
    /// it, or a view of it), learned the first time it runs with grad on an input nothing else
    /// holds: a block that saves only casts of its input (bf16 BERT's query, key and value)
    /// does not. Only an output its reader does not keep is let go of: one it keeps would die
    /// inside the reader's backward where another holder (a selective block's cache) may keep
    /// it, so it is held until its block's backward, as before.
    pub(super) input_saved: Vec<Cell<Option<bool>>>,
    /// Per block: which of the Python numbers its operators take as tensors its graph saves, in
    /// the order they are made, learned the first time it runs with grad. A checkpointed or
    /// selective forward keeps those (all of them, before the block has run with grad) until
    /// its recompute is done, as `torch.utils.checkpoint`'s forward keeps the wrapped numbers
    /// its graph saves (`kernels::numbers`).
    pub(super) numbers_saved: Vec<OnceCell<Vec<bool>>>,
    /// Fake mode, for a session measured on the meta device ([`Session::new_fake`]): its
    /// tensors are fake, and so is everything its steps create. Declared last, so it ends after
    /// every tensor of the session is gone.
    fake: Option<FakeMode>,
    /// On the CPU, for real steps: freed host memory stays with the process, so that a step
    /// reuses its predecessor's pages as the CUDA caching allocator does (`host_memory`).
    /// Declared last, so that what the session freed is returned when it ends.
    _host_memory: Option<HostMemoryHold>,
}

/// The error for loss chunks on a model whose loss is not a language model's.
pub(super) fn chunks_refused(cfg: &TrainConfig, chain: &Chain) -> RuntimeError {
    RuntimeError::Config(format!(
        "loss chunks {}: model {}'s loss head is not a language model's (lm_head and cross entropy \
         over tokens); the chunked loss applies to GPT-2 and the Llama family, use --loss-chunks 1",
        cfg.loss_chunks, chain.name
    ))
}

/// Bytes of a tensor's elements.
pub fn nbytes(t: &Tensor) -> i64 {
    if !t.defined() {
        return 0;
    }
    t.numel() as i64 * t.kind().elt_size_in_bytes() as i64
}

impl Session {
    /// Block `i`'s failure in this step as the runtime reports it: a selective recompute that
    /// strays from its forward's calls, or a node of the program rejecting the step.
    pub(super) fn block_failed(&self, i: usize, failure: ckptune_models::BlockFailure) -> RuntimeError {
        let (model, block) = (self.chain.name.clone(), self.chain.blocks[i].name.clone());
        if failure.why.contains(ckptune_kernels::sac::REPLAY_MISMATCH) {
            let failure = Box::new(failure);
            return RuntimeError::Selective { model, block, failure };
        }
        RuntimeError::Block { model, block, failure }
    }

    pub fn new(chain: Chain, cfg: TrainConfig, device: Device) -> Result<Self> {
        cfg.validate(device)?;
        chain
            .validate()
            .map_err(|e| RuntimeError::Invalid(format!("model {}: {e}", chain.name)))?;
        if cfg.loss_chunks > 1 && chain.head.causal_lm().is_none() {
            return Err(chunks_refused(&cfg, &chain));
        }
        if cfg.precision == Precision::Bf16Pure {
            // In module order, not the var store's (`vs.bfloat16()` walks a HashMap): each cast
            // allocates, and the allocation trace a GPU plan is judged on must not change
            // between runs.
            for (_, mut v, _) in chain.variables_in_module_order() {
                if v.is_floating_point() {
                    v.set_data(&v.to_kind(Kind::BFloat16));
                }
            }
        }
        let vars = chain.vs.variables();
        let buffers = chain
            .blocks
            .iter()
            .map(|b| {
                let prefixes: Vec<String> = b.name.split('+').map(|n| format!("{n}.")).collect();
                let mut names: Vec<&String> = vars
                    .iter()
                    .filter(|(n, t)| !t.requires_grad() && prefixes.iter().any(|p| n.starts_with(p)))
                    .map(|(n, _)| n)
                    .collect();
                names.sort();
                names.into_iter().map(|n| vars[n].shallow_clone()).collect()
            })
            .collect();
        let opt = optim::build(
            cfg.optimizer,
            cfg.optimizer_impl,
            chain.vs.trainable_variables(),
            cfg.lr,
        );
        let in_backward = if cfg.optimizer_in_backward {
            Some(InBackward::new(&chain, opt.as_ref())?)
        } else {
            None
        };
        let probe = Probe::new(device)?;
        let hold_casts = cfg.autocast_cache;
        let output_saved = chain.blocks.iter().map(|_| Cell::new(None)).collect();
        let input_saved = chain.blocks.iter().map(|_| Cell::new(None)).collect();
        let numbers_saved = chain.blocks.iter().map(|_| OnceCell::new()).collect();
        let real_cpu = device == Device::Cpu && !fake::active();
        Ok(Self {
            chain,
            cfg,
            device,
            opt,
            buffers,
            scale: 65536.0,
            next_seed: 0,
            probe,
            fuse_groups: true,
            hold_casts,
            selective: Vec::new(),
            in_backward,
            output_saved,
            input_saved,
            numbers_saved,
            fake: None,
            _host_memory: real_cpu.then(HostMemoryHold::new),
        })
    }

    /// A session measured on the meta device: fake mode on this thread for the session's life,
    /// the chain `build` makes fake (every parameter a meta storage the meter counts), and every
    /// step fake too. Memory is what a real step on the CPU allocates (docs/memory-model.md, "Fake
    /// mode"); times are not measured. The session must stay on this thread.
    pub fn new_fake(build: impl FnOnce() -> Result<Chain>, cfg: TrainConfig, device: Device) -> Result<Self> {
        Self::new_fake_for(build, cfg, device, None)
    }

    /// [`Session::new_fake`] for a step traced as `gpu` runs it: its reductions take the
    /// staging buffers CUDA's take there (`FakeMode::enter_for`).
    pub fn new_fake_for(
        build: impl FnOnce() -> Result<Chain>,
        cfg: TrainConfig,
        device: Device,
        gpu: Option<GpuGeometry>,
    ) -> Result<Self> {
        let mode = FakeMode::enter_for(gpu)?;
        let chain = build()?;
        let mut s = Session::new(chain, cfg, device)?;
        s.fake = Some(mode);
        Ok(s)
    }

    /// Whether the session runs on fake tensors (measured on the meta device).
    pub fn is_fake(&self) -> bool {
        self.fake.is_some()
    }

    /// Bytes of optimizer state now allocated.
    pub fn optimizer_state_bytes(&self) -> i64 {
        self.opt.state_bytes()
    }

    /// Bytes of parameters and of buffers.
    pub fn param_and_buffer_bytes(&self) -> (i64, i64) {
        let mut p = 0;
        let mut b = 0;
        for t in self.chain.vs.variables().values() {
            if t.requires_grad() {
                p += nbytes(t);
            } else {
                b += nbytes(t);
            }
        }
        (p, b)
    }

    /// Bytes of parameter gradients now allocated.
    pub fn grad_bytes(&self) -> i64 {
        self.opt.params().iter().map(|p| nbytes(&p.grad())).sum()
    }

    /// Which blocks a regex selects: it must match (the whole name, as Python's `re.fullmatch`
    /// of the emitted anchored regexes) only candidate blocks.
    pub fn select(&self, pattern: &str) -> Result<Vec<bool>> {
        select(&self.chain, pattern)
    }

    /// A fresh batch of the config's micro-batch size.
    pub fn make_batch(&mut self) -> Batch {
        let seed = self.next_seed;
        self.next_seed += 1;
        let mut batch = self.chain.make_batch(self.cfg.micro_batch, self.device, seed);
        if self.cfg.precision == Precision::Bf16Pure && batch.input.is_floating_point() {
            batch.input = batch.input.to_kind(Kind::BFloat16);
        }
        batch
    }

    /// The region around a micro-step's forward and loss that holds autocast's weight casts
    /// (`with torch.autocast(...)` with the cache on), when the session holds them: opening it
    /// allocates nothing, and the blocks' own regions nest inside it, so no cast is freed
    /// before it closes.
    pub(super) fn cast_region(&self) -> Result<Option<AutocastGuard>> {
        match self.cfg.precision.autocast() {
            Some(k) if self.hold_casts => Ok(Some(AutocastGuard::new(self.device, k, true)?)),
            _ => Ok(None),
        }
    }

    pub(super) fn loss_scale(&self) -> f64 {
        if self.cfg.precision == Precision::Fp16 {
            self.scale
        } else {
            1.0
        }
    }

    pub(super) fn check_mask(&self, checkpoint: &[bool]) -> Result<()> {
        let chain = &self.chain;
        if checkpoint.len() != chain.units() {
            return Err(RuntimeError::Invalid(format!(
                "checkpoint mask has {} entries but {} has {} blocks and {} groups",
                checkpoint.len(),
                chain.name,
                chain.blocks.len(),
                chain.groups.len()
            )));
        }
        for (i, &c) in checkpoint.iter().enumerate() {
            if c && !chain.unit_candidate(i) {
                return Err(RuntimeError::Invalid(format!(
                    "block {} of {} is not a checkpoint candidate",
                    chain.unit_name(i),
                    chain.name
                )));
            }
        }
        if let Some((g, k)) = chain.nested_conflict(checkpoint) {
            return Err(RuntimeError::Invalid(format!(
                "{} and its child {} of {} are both checkpointed; checkpoint one or the other",
                chain.groups[g].name, chain.blocks[k].name, chain.name
            )));
        }
        Ok(())
    }

    /// Waits for queued device work (CUDA), so wall-clock times are honest.
    pub fn sync(&self) {
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
    }

    /// All parameters with their names, for comparing runs.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = self.chain.vs.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Parameter gradients by name (undefined tensors for parameters without one).
    pub fn named_grads(&self) -> Vec<(String, Tensor)> {
        self.named_parameters()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(n, t)| {
                let g = t.grad();
                (n, if g.defined() { g.copy() } else { g })
            })
            .collect()
    }
}
