//! Optimizers, written as PyTorch's single-tensor (CPU default, `foreach=False`) loops with the
//! same in-place ops, so their state and transient memory equal PyTorch's.
//!
//! State is allocated lazily on the first step, as in PyTorch; the profiler's warm-up step
//! makes it exist before anything is measured.

use ckptune_kernels::adam8bit::{Adam8bit as Adam8bitKernel, AdamHyper};
use ckptune_kernels::autograd;
use tch::Tensor;

use crate::config::OptimizerKind;
use crate::error::{torch, Result};

/// Hyper-parameters; defaults are PyTorch's (AdamW weight decay 1e-2, Lion's paper's 1e-4 lr
/// scale is the caller's business).
#[derive(Debug, Clone, Copy)]
pub struct Hyper {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
}

impl Hyper {
    pub fn for_kind(kind: OptimizerKind, lr: f64) -> Self {
        let (betas, weight_decay) = match kind {
            OptimizerKind::AdamW | OptimizerKind::AdamW8bit => ((0.9, 0.999), 1e-2),
            OptimizerKind::Lion => ((0.9, 0.99), 0.0),
            _ => ((0.9, 0.999), 0.0),
        };
        Self {
            lr,
            betas,
            eps: 1e-8,
            weight_decay,
            momentum: 0.9,
        }
    }
}

/// An optimizer over a fixed list of parameters. New algorithms (8-bit AdamW) implement this.
pub trait Optimizer: Send {
    /// Applies one update from the parameters' `.grad` (parameters without a gradient are
    /// skipped, as in PyTorch).
    fn step(&mut self) -> Result<()>;
    /// Bytes of optimizer state currently allocated.
    fn state_bytes(&self) -> i64;
    /// The parameters it updates.
    fn params(&self) -> &[Tensor];
    /// `zero_grad(set_to_none)`.
    fn zero_grad(&mut self, set_to_none: bool) -> Result<()> {
        for p in self.params() {
            if set_to_none {
                autograd::clear_grad(p)?;
            } else {
                let mut g = p.grad();
                if g.defined() {
                    let _ = tch::no_grad(|| g.f_zero_()).map_err(torch("zeroing a gradient"))?;
                }
            }
        }
        Ok(())
    }
}

pub fn build(kind: OptimizerKind, params: Vec<Tensor>, lr: f64) -> Box<dyn Optimizer> {
    let h = Hyper::for_kind(kind, lr);
    let n = params.len();
    let state = || (0..n).map(|_| None).collect::<Vec<Option<Tensor>>>();
    match kind {
        OptimizerKind::Sgd => Box::new(Sgd {
            params,
            h,
            momentum: None,
        }),
        OptimizerKind::SgdMomentum => Box::new(Sgd {
            params,
            h,
            momentum: Some(state()),
        }),
        OptimizerKind::Adam | OptimizerKind::AdamW => Box::new(Adam {
            params,
            h,
            decoupled: kind == OptimizerKind::AdamW,
            exp_avg: state(),
            exp_avg_sq: state(),
            step: 0,
        }),
        OptimizerKind::Lion => Box::new(Lion {
            params,
            h,
            exp_avg: state(),
        }),
        OptimizerKind::Adam8bit | OptimizerKind::AdamW8bit => Box::new(Adam8bit(Adam8bitKernel::new(
            params,
            AdamHyper {
                lr: h.lr,
                betas: h.betas,
                eps: h.eps,
                weight_decay: h.weight_decay,
                decoupled: kind == OptimizerKind::AdamW8bit,
            },
        ))),
    }
}

fn bytes(t: &Tensor) -> i64 {
    t.numel() as i64 * t.kind().elt_size_in_bytes() as i64
}

fn state_bytes(states: &[Option<Tensor>]) -> i64 {
    states.iter().flatten().map(bytes).sum()
}

struct Sgd {
    params: Vec<Tensor>,
    h: Hyper,
    momentum: Option<Vec<Option<Tensor>>>,
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let h = self.h;
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let mut p = p.shallow_clone();
                match &mut self.momentum {
                    None => {
                        let _ = p.f_add_(&(g * -h.lr)).map_err(torch("sgd step"))?;
                    }
                    Some(bufs) => {
                        // torch.optim.SGD: buf = clone(grad) on the first step, then
                        // buf.mul_(momentum).add_(grad); param.add_(buf, alpha=-lr).
                        let buf = match &mut bufs[i] {
                            Some(buf) => {
                                let _ = buf.f_mul_scalar_(h.momentum).map_err(torch("sgd momentum"))?;
                                let _ = buf.f_add_(&g).map_err(torch("sgd momentum"))?;
                                buf.shallow_clone()
                            }
                            slot @ None => {
                                let buf = g.f_detach_copy().map_err(torch("sgd momentum buffer"))?;
                                *slot = Some(buf.shallow_clone());
                                buf
                            }
                        };
                        let _ = p.f_sub_(&(&buf * h.lr)).map_err(torch("sgd step"))?;
                    }
                }
            }
            Ok(())
        })
    }
    fn state_bytes(&self) -> i64 {
        self.momentum.as_deref().map(state_bytes).unwrap_or(0)
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
}

struct Adam {
    params: Vec<Tensor>,
    h: Hyper,
    decoupled: bool,
    exp_avg: Vec<Option<Tensor>>,
    exp_avg_sq: Vec<Option<Tensor>>,
    step: i32,
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        let h = self.h;
        self.step += 1;
        let step = self.step;
        let decoupled = self.decoupled;
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let mut g = p.grad();
                if !g.defined() {
                    continue;
                }
                let mut p = p.shallow_clone();
                let m = self.exp_avg[i].get_or_insert_with(|| p.zeros_like());
                let v = self.exp_avg_sq[i].get_or_insert_with(|| p.zeros_like());
                if h.weight_decay != 0.0 {
                    if decoupled {
                        let _ = p
                            .f_mul_scalar_(1.0 - h.lr * h.weight_decay)
                            .map_err(torch("adamw decay"))?;
                    } else {
                        g = g.f_add(&(&p * h.weight_decay)).map_err(torch("adam decay"))?;
                    }
                }
                // exp_avg.lerp_(grad, 1 - beta1)
                let _ = m.f_lerp_(&g, 1.0 - h.betas.0).map_err(torch("adam first moment"))?;
                // exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad²; tch's addcmul_ has no
                // `value`, so scale around it in place rather than allocating (1 - beta2) * grad.
                let c = 1.0 - h.betas.1;
                let _ = v.f_mul_scalar_(h.betas.1 / c).map_err(torch("adam second moment"))?;
                let _ = v.f_addcmul_(&g, &g).map_err(torch("adam second moment"))?;
                let _ = v.f_mul_scalar_(c).map_err(torch("adam second moment"))?;
                let bc1 = 1.0 - h.betas.0.powi(step);
                let bc2_sqrt = (1.0 - h.betas.1.powi(step)).sqrt();
                // param -= lr / bc1 * exp_avg / (sqrt(exp_avg_sq) / sqrt(bc2) + eps), with one
                // temporary of the parameter's size (PyTorch's loop has two at its peak).
                let mut denom = v.f_sqrt().map_err(torch("adam denominator"))?;
                let _ = denom.f_div_scalar_(bc2_sqrt).map_err(torch("adam denominator"))?;
                let _ = denom.f_add_scalar_(h.eps).map_err(torch("adam denominator"))?;
                let _ = denom.f_reciprocal_().map_err(torch("adam denominator"))?;
                let _ = denom.f_mul_scalar_(-h.lr / bc1).map_err(torch("adam denominator"))?;
                let _ = p.f_addcmul_(m, &denom).map_err(torch("adam update"))?;
            }
            Ok(())
        })
    }
    fn state_bytes(&self) -> i64 {
        state_bytes(&self.exp_avg) + state_bytes(&self.exp_avg_sq)
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
}

/// Lion (Chen et al., 2023): sign of an interpolated momentum; one state tensor.
struct Lion {
    params: Vec<Tensor>,
    h: Hyper,
    exp_avg: Vec<Option<Tensor>>,
}

impl Optimizer for Lion {
    fn step(&mut self) -> Result<()> {
        let h = self.h;
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let mut p = p.shallow_clone();
                let m = self.exp_avg[i].get_or_insert_with(|| p.zeros_like());
                if h.weight_decay != 0.0 {
                    let _ = p
                        .f_mul_scalar_(1.0 - h.lr * h.weight_decay)
                        .map_err(torch("lion decay"))?;
                }
                let update = m.f_lerp(&g, 1.0 - h.betas.0).map_err(torch("lion update"))?.sign();
                let _ = p.f_sub_(&(update * h.lr)).map_err(torch("lion update"))?;
                let _ = m.f_lerp_(&g, 1.0 - h.betas.1).map_err(torch("lion momentum"))?;
            }
            Ok(())
        })
    }
    fn state_bytes(&self) -> i64 {
        state_bytes(&self.exp_avg)
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
}

/// 8-bit block-wise Adam/AdamW (Dettmers et al., 2022): the fused update and its quantized state
/// live in `ckptune_kernels::adam8bit` (CPU, and CUDA with the kernels' `cuda` feature); this is
/// the runtime's handle on it. A steady-state step allocates nothing on the CPU path (f32
/// contiguous parameters), so the profiler's optimizer transient is 0 bytes.
struct Adam8bit(Adam8bitKernel);

impl Optimizer for Adam8bit {
    fn step(&mut self) -> Result<()> {
        Ok(self.0.step()?)
    }
    fn state_bytes(&self) -> i64 {
        self.0.state_bytes()
    }
    fn params(&self) -> &[Tensor] {
        self.0.params()
    }
}
