//! Training configs: precision × optimizer × micro-batch × gradient accumulation × set_to_none ×
//! loss chunks.

use ckptune_solver::profile::ConfigSpec;
use std::fmt;
use std::str::FromStr;

use tch::{Device, Kind};

use crate::error::RuntimeError;

/// How a step's arithmetic is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Precision {
    /// Everything in f32.
    Fp32,
    /// f32 parameters, gradients and optimizer state; the forward (and recompute) under bf16
    /// autocast.
    Bf16,
    /// f32 parameters; fp16 autocast with dynamic loss scaling. CUDA only: CPU autocast has no
    /// fp16 op list worth using, so it is refused there.
    Fp16,
    /// Parameters, gradients and optimizer state in bf16; no autocast, no master weights.
    Bf16Pure,
}

impl Precision {
    pub const ALL: [Precision; 4] = [Precision::Fp32, Precision::Bf16, Precision::Fp16, Precision::Bf16Pure];

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Bf16Pure => "bf16-pure",
        }
    }

    /// The autocast dtype, for the precisions that use autocast.
    pub fn autocast(self) -> Option<Kind> {
        match self {
            Precision::Bf16 => Some(Kind::BFloat16),
            Precision::Fp16 => Some(Kind::Half),
            Precision::Fp32 | Precision::Bf16Pure => None,
        }
    }

    /// The dtype parameters are stored in.
    pub fn param_kind(self) -> Kind {
        match self {
            Precision::Bf16Pure => Kind::BFloat16,
            _ => Kind::Float,
        }
    }

    /// Refuses combinations that cannot run on `device`.
    pub fn check_device(self, device: Device) -> Result<(), RuntimeError> {
        if self == Precision::Fp16 && device == Device::Cpu {
            return Err(RuntimeError::Config(
                "precision fp16 needs CUDA (fp16 autocast with loss scaling); on CPU use bf16 or bf16-pure".into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                RuntimeError::Config(format!(
                    "unknown precision {s:?}; expected one of fp32, bf16, fp16, bf16-pure"
                ))
            })
    }
}

/// Optimizer algorithms. Their state sizes differ (sgd: none; sgd-momentum: 1×; adam/adamw: 2×;
/// lion: 1× the parameters; adam8bit/adamw8bit: ¼ of adam's — two 8-bit codes per element plus
/// an f32 absmax per 2048-element block and moment, 32-bit below 4096 elements), which is
/// memory the planner trades against activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OptimizerKind {
    Sgd,
    SgdMomentum,
    Adam,
    AdamW,
    Lion,
    /// Adam with 8-bit block-wise quantized moments (Dettmers et al., 2022).
    Adam8bit,
    /// AdamW with 8-bit block-wise quantized moments.
    AdamW8bit,
}

impl OptimizerKind {
    pub const ALL: [OptimizerKind; 7] = [
        OptimizerKind::Sgd,
        OptimizerKind::SgdMomentum,
        OptimizerKind::Adam,
        OptimizerKind::AdamW,
        OptimizerKind::Lion,
        OptimizerKind::Adam8bit,
        OptimizerKind::AdamW8bit,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::SgdMomentum => "sgd-momentum",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Lion => "lion",
            OptimizerKind::Adam8bit => "adam8bit",
            OptimizerKind::AdamW8bit => "adamw8bit",
        }
    }

    /// The family a user's choice belongs to; by default the planner keeps the family.
    pub fn family(self) -> &'static str {
        match self {
            OptimizerKind::Sgd | OptimizerKind::SgdMomentum => "sgd",
            OptimizerKind::Adam | OptimizerKind::AdamW | OptimizerKind::Adam8bit | OptimizerKind::AdamW8bit => "adam",
            OptimizerKind::Lion => "lion",
        }
    }

    /// Whether `torch.optim` has it, and so offers the single/foreach/fused implementations.
    /// Lion and the 8-bit optimizers come from other packages, each with one implementation
    /// (the 8-bit step is one fused kernel).
    pub fn in_torch_optim(self) -> bool {
        matches!(
            self,
            OptimizerKind::Sgd | OptimizerKind::SgdMomentum | OptimizerKind::Adam | OptimizerKind::AdamW
        )
    }

    /// Whether the optimizer keeps 8-bit quantized state.
    pub fn is_8bit(self) -> bool {
        matches!(self, OptimizerKind::Adam8bit | OptimizerKind::AdamW8bit)
    }
}

impl fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OptimizerKind {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        OptimizerKind::ALL.into_iter().find(|o| o.name() == s).ok_or_else(|| {
            let names: Vec<&str> = OptimizerKind::ALL.iter().map(|o| o.name()).collect();
            RuntimeError::Config(format!("unknown optimizer {s:?}; expected one of {}", names.join(", ")))
        })
    }
}

/// Which of `torch.optim`'s implementations of an optimizer runs the step. They compute the
/// same update but allocate differently, and the optimizer step is the peak of many plans:
/// the single-tensor loop holds two temporaries the size of the parameter it is updating
/// (Adam's `exp_avg_sq.sqrt() / bias_correction2_sqrt`), `foreach` holds one per parameter of
/// the whole group at once, `fused` none. ckptune runs the same ops in the same order, so its
/// measured optimizer peak is PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OptimizerImpl {
    /// `foreach=False, fused=False`: PyTorch's default on CPU.
    Single,
    /// `foreach=True`: PyTorch's default on CUDA.
    Foreach,
    /// `fused=True`.
    Fused,
}

impl OptimizerImpl {
    pub const ALL: [OptimizerImpl; 3] = [OptimizerImpl::Single, OptimizerImpl::Foreach, OptimizerImpl::Fused];

    pub fn name(self) -> &'static str {
        match self {
            OptimizerImpl::Single => "single",
            OptimizerImpl::Foreach => "foreach",
            OptimizerImpl::Fused => "fused",
        }
    }

    /// What `torch.optim` picks when neither `foreach` nor `fused` is given
    /// (`_default_to_fused_or_foreach`: foreach kernels exist for CUDA tensors, not for CPU).
    pub fn default_for(device: Device) -> Self {
        match device {
            Device::Cpu => OptimizerImpl::Single,
            _ => OptimizerImpl::Foreach,
        }
    }
}

impl fmt::Display for OptimizerImpl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OptimizerImpl {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        OptimizerImpl::ALL.into_iter().find(|o| o.name() == s).ok_or_else(|| {
            RuntimeError::Config(format!(
                "unknown optimizer implementation {s:?}; expected one of single, foreach, fused"
            ))
        })
    }
}

/// One training configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    pub precision: Precision,
    pub optimizer: OptimizerKind,
    /// The `torch.optim` implementation; only meaningful where [`OptimizerKind::in_torch_optim`].
    pub optimizer_impl: OptimizerImpl,
    pub micro_batch: i64,
    pub grad_accum: i64,
    /// `zero_grad(set_to_none=true)`: gradients are freed after the optimizer step (and
    /// re-allocated by the next backward) instead of zeroed in place.
    pub set_to_none: bool,
    /// The loop keeps autocast's weight-cast cache on over one region around the forward and
    /// the loss (the Hugging Face `Trainer`); off, the loop passes
    /// `torch.autocast(..., cache_enabled=False)`. Only meaningful under autocast.
    pub autocast_cache: bool,
    /// A language model's loss in this many chunks of tokens (1: whole), each chunk's logits
    /// and their gradient freed before the next (`exec/chunked_loss.rs`).
    pub loss_chunks: i64,
    /// Step each parameter in backward, in its post-accumulate-grad hook, and free its gradient
    /// there ([`ConfigSpec::optimizer_in_backward`]); [`TrainConfig::validate`] refuses what
    /// cannot run so.
    pub optimizer_in_backward: bool,
    pub lr: f64,
}

impl TrainConfig {
    pub fn new(precision: Precision, optimizer: OptimizerKind, micro_batch: i64) -> Self {
        Self {
            precision,
            optimizer,
            optimizer_impl: OptimizerImpl::Single,
            micro_batch,
            grad_accum: 1,
            set_to_none: true,
            autocast_cache: false,
            loss_chunks: 1,
            optimizer_in_backward: false,
            lr: 1e-3,
        }
    }

    /// Samples per optimizer step.
    pub fn global_batch(&self) -> i64 {
        self.micro_batch * self.grad_accum
    }

    /// The config as every format names it.
    pub fn spec(&self) -> ConfigSpec {
        ConfigSpec {
            precision: self.precision.name().into(),
            optimizer: self.optimizer.name().into(),
            optimizer_impl: self
                .optimizer
                .in_torch_optim()
                .then(|| self.optimizer_impl.name().into()),
            micro_batch: self.micro_batch,
            grad_accum: self.grad_accum,
            set_to_none: self.set_to_none,
            autocast_cache: self.autocast_cache && self.precision.autocast().is_some(),
            loss_chunks: (self.loss_chunks > 1).then_some(self.loss_chunks),
            optimizer_in_backward: self.optimizer_in_backward,
        }
    }

    /// The config a format names; an unknown precision or optimizer, or sizes below 1, are
    /// errors naming the value.
    pub fn from_spec(c: &ConfigSpec) -> Result<Self, RuntimeError> {
        if c.micro_batch < 1 || c.grad_accum < 1 || c.chunks() < 1 {
            return Err(RuntimeError::Config(format!(
                "config {}: micro_batch, grad_accum and loss_chunks must be at least 1",
                c.label()
            )));
        }
        let mut t = TrainConfig::new(c.precision.parse()?, c.optimizer.parse()?, c.micro_batch);
        if let Some(i) = &c.optimizer_impl {
            if !t.optimizer.in_torch_optim() {
                return Err(RuntimeError::Config(format!(
                    "config {}: optimizer {} has one implementation; optimizer_impl {i:?} applies \
                     to torch.optim's sgd, sgd-momentum, adam and adamw",
                    c.label(),
                    t.optimizer
                )));
            }
            t.optimizer_impl = i.parse()?;
        }
        t.grad_accum = c.grad_accum;
        t.set_to_none = c.set_to_none;
        if c.autocast_cache && t.precision.autocast().is_none() {
            return Err(RuntimeError::Config(format!(
                "config {}: autocast_cache applies to the autocast precisions (bf16, fp16), not {}",
                c.label(),
                t.precision
            )));
        }
        t.autocast_cache = c.autocast_cache;
        t.loss_chunks = c.chunks();
        t.optimizer_in_backward = c.optimizer_in_backward;
        Ok(t)
    }

    /// A stable label, used as a cache key and in reports.
    pub fn label(&self) -> String {
        let chunks = match self.loss_chunks {
            1 => String::new(),
            n => format!("/loss{n}"),
        };
        format!(
            "{}/{}/mb{}x{}/{}{}{chunks}{}",
            self.precision,
            self.spec().optimizer_label(),
            self.micro_batch,
            self.grad_accum,
            if self.set_to_none { "none" } else { "zero" },
            if self.spec().autocast_cache { "/cache" } else { "" },
            if self.optimizer_in_backward { "/in-bwd" } else { "" }
        )
    }

    pub fn validate(&self, device: Device) -> Result<(), RuntimeError> {
        self.precision.check_device(device)?;
        if self.micro_batch < 1 {
            return Err(RuntimeError::Config(format!(
                "micro-batch {} must be at least 1",
                self.micro_batch
            )));
        }
        if self.grad_accum < 1 {
            return Err(RuntimeError::Config(format!(
                "gradient accumulation steps {} must be at least 1",
                self.grad_accum
            )));
        }
        if self.loss_chunks < 1 {
            return Err(RuntimeError::Config(format!(
                "loss chunks {} must be at least 1 (1 computes the loss whole)",
                self.loss_chunks
            )));
        }
        if self.optimizer_in_backward {
            self.check_in_backward()?;
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(RuntimeError::Config(format!(
                "learning rate {} must be a positive number",
                self.lr
            )));
        }
        Ok(())
    }
}

impl TrainConfig {
    /// Why this config cannot step its optimizer in backward, if it cannot: the step then runs
    /// on each parameter as soon as its gradient is complete, so anything that must see every
    /// gradient first (or sum several backwards into one) rules it out.
    pub fn in_backward_refusal(&self) -> Option<String> {
        if self.grad_accum > 1 {
            return Some(format!(
                "gradient accumulation {} sums {} backwards into each gradient before the step, and the step in \
                 backward runs after each one; use gradient accumulation 1",
                self.grad_accum, self.grad_accum
            ));
        }
        if self.precision == Precision::Fp16 {
            return Some(
                "fp16's loss scaling unscales every gradient and checks all of them for inf/nan before any step \
                 (a global operation over all gradients); use bf16 or fp32"
                    .into(),
            );
        }
        if self.optimizer.is_8bit() {
            return Some(format!(
                "optimizer {} updates its parameters as one list; the step per parameter is not modelled for it \
                 (sgd, sgd-momentum, adam, adamw and lion step per parameter)",
                self.optimizer
            ));
        }
        if !self.set_to_none {
            return Some(
                "the step in backward frees each gradient after its update (zero_grad(set_to_none=True)); \
                 set_to_none=false keeps them all"
                    .into(),
            );
        }
        None
    }

    fn check_in_backward(&self) -> Result<(), RuntimeError> {
        match self.in_backward_refusal() {
            Some(why) => Err(RuntimeError::Config(format!(
                "config {}: the optimizer step in backward cannot run: {why}",
                self.label()
            ))),
            None => Ok(()),
        }
    }
}
