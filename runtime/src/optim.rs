//! Optimizers. `torch.optim`'s SGD, Adam and AdamW run as PyTorch runs them: the single-tensor
//! loop (`_single_tensor_adam`), the `foreach` path (`_multi_tensor_adam`) or the fused kernel
//! (`_fused_adamw_`), calling the same operators in the same order through libtorch's
//! dispatcher, with a Python number passed where Python passes one (a 0-dim "wrapped number"
//! tensor for `Tensor` arguments, a `Scalar` otherwise). Their state and every temporary then
//! equal PyTorch's to the byte, and the optimizer step is the peak of many plans (BERT-base at
//! batch 8: the single-tensor AdamW holds two temporaries the size of the 94 MB word embedding).
//!
//! State is allocated lazily on the first step, as in PyTorch (Adam's per-parameter `step` is a
//! 0-dim f32 tensor, as `torch.optim` keeps it); the profiler's warm-up step makes it exist
//! before anything is measured.

use ckptune_kernels::adam8bit::{Adam8bit as Adam8bitKernel, AdamHyper};
use ckptune_kernels::autograd;
use ckptune_kernels::ops::{self, Arg, Value};
use tch::{Device, Kind, Tensor};

use crate::config::{OptimizerImpl, OptimizerKind};
use crate::error::{torch, Result, RuntimeError};

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
    /// The same update for the parameters `idx` alone, as an optimizer over just those
    /// parameters would make it (torchtune's optimizer in backward: one optimizer per
    /// parameter, stepped in its post-accumulate-grad hook). Each parameter's update is the
    /// same arithmetic as in [`Optimizer::step`], so the weights after a step are equal bit for
    /// bit; what differs is the temporaries alive at once.
    fn step_params(&mut self, idx: &[usize]) -> Result<()>;
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

/// The optimizer `kind` over `params`, in `torch.optim`'s implementation `imp` where it has
/// one (lion and the 8-bit optimizers have a single implementation each; `imp` is ignored).
pub fn build(kind: OptimizerKind, imp: OptimizerImpl, params: Vec<Tensor>, lr: f64) -> Box<dyn Optimizer> {
    let h = Hyper::for_kind(kind, lr);
    let n = params.len();
    let state = || (0..n).map(|_| None).collect::<Vec<Option<Tensor>>>();
    match kind {
        OptimizerKind::Sgd | OptimizerKind::SgdMomentum => Box::new(Sgd {
            params,
            h,
            imp,
            momentum: (kind == OptimizerKind::SgdMomentum).then(state),
        }),
        OptimizerKind::Adam | OptimizerKind::AdamW => Box::new(Adam {
            params,
            h,
            imp,
            decoupled: kind == OptimizerKind::AdamW,
            exp_avg: state(),
            exp_avg_sq: state(),
            step: state(),
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

/// What holds a session's optimizer while its parameters' hooks own the real one (the step in
/// backward): no parameters, and a step is a bug.
struct Placeholder;

impl Optimizer for Placeholder {
    fn step(&mut self) -> Result<()> {
        Err(RuntimeError::Invalid(
            "the optimizer stepped while its hooks held it".into(),
        ))
    }
    fn step_params(&mut self, _idx: &[usize]) -> Result<()> {
        self.step()
    }
    fn state_bytes(&self) -> i64 {
        0
    }
    fn params(&self) -> &[Tensor] {
        &[]
    }
}

/// The stand-in for an optimizer lent to the hooks of a step in backward.
pub(crate) fn placeholder() -> Box<dyn Optimizer> {
    Box::new(Placeholder)
}

fn bytes(t: &Tensor) -> i64 {
    t.numel() as i64 * t.kind().elt_size_in_bytes() as i64
}

fn state_bytes(states: &[Option<Tensor>]) -> i64 {
    states.iter().flatten().map(bytes).sum()
}

/// One operator call by schema name (`aten::add_`, overload `Tensor`), as the Python binding
/// makes it; the results are dropped (in-place ops return their `self`).
fn call(name: &str, overload: &str, args: &[(&str, Arg<'_>)]) -> Result<Vec<Value>> {
    Ok(ops::call(name, overload, args)?)
}

/// A call whose result is one tensor.
fn call_tensor(name: &str, overload: &str, args: &[(&str, Arg<'_>)]) -> Result<Tensor> {
    match call(name, overload, args)?.into_iter().next() {
        Some(Value::Tensor(t)) => Ok(t),
        other => Err(RuntimeError::Invalid(format!(
            "{name}.{overload} returned {} where a tensor was expected",
            other.as_ref().map_or("nothing", Value::describe)
        ))),
    }
}

/// A call whose result is a tensor list (`_foreach_sqrt`).
fn call_tensors(name: &str, overload: &str, args: &[(&str, Arg<'_>)]) -> Result<Vec<Tensor>> {
    match call(name, overload, args)?.into_iter().next() {
        Some(Value::List(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::Tensor(t) => Ok(t),
                other => Err(RuntimeError::Invalid(format!(
                    "{name}.{overload} returned a list holding {}",
                    other.describe()
                ))),
            })
            .collect(),
        other => Err(RuntimeError::Invalid(format!(
            "{name}.{overload} returned {} where a tensor list was expected",
            other.as_ref().map_or("nothing", Value::describe)
        ))),
    }
}

fn list<'a>(ts: &'a [Tensor]) -> Arg<'a> {
    Arg::Tensors(ts.iter().map(Some).collect())
}

/// `Optimizer._group_tensors_by_device_and_dtype`: the foreach and fused paths run once per
/// (device, dtype) group, in order of first appearance, each group in parameter order.
fn groups(params: &[Tensor], with_grad: &[usize]) -> Vec<Vec<usize>> {
    let mut keys: Vec<(Device, Kind)> = Vec::new();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for &i in with_grad {
        let key = (params[i].device(), params[i].kind());
        match keys.iter().position(|k| *k == key) {
            Some(g) => out[g].push(i),
            None => {
                keys.push(key);
                out.push(vec![i]);
            }
        }
    }
    out
}

/// The tensors of one group, in its order.
fn pick(ts: &[Tensor], group: &[usize]) -> Vec<Tensor> {
    group.iter().map(|&i| ts[i].shallow_clone()).collect()
}

/// Indices of the parameters that have a gradient (`_init_group` skips the others).
fn with_grad(params: &[Tensor]) -> Vec<usize> {
    (0..params.len()).filter(|&i| params[i].grad().defined()).collect()
}

/// `torch.optim.SGD` (dampening 0, no Nesterov, no weight decay: PyTorch's defaults).
struct Sgd {
    params: Vec<Tensor>,
    h: Hyper,
    imp: OptimizerImpl,
    /// The momentum buffers, for SGD with momentum.
    momentum: Option<Vec<Option<Tensor>>>,
}

impl Sgd {
    /// `_single_tensor_sgd`: `buf = grad.detach().clone()` on the first step, then
    /// `buf.mul_(momentum).add_(grad)`; `param.add_(buf, alpha=-lr)`. No temporaries.
    fn single(&mut self, idx: &[usize]) -> Result<()> {
        let h = self.h;
        for &i in idx {
            let p = &self.params[i];
            let g = p.grad();
            let d = match &mut self.momentum {
                None => g,
                Some(bufs) => momentum_buffer(&mut bufs[i], &g, h)?,
            };
            call(
                "aten::add_",
                "Tensor",
                &[
                    ("self", Arg::Tensor(p)),
                    ("other", Arg::Tensor(&d)),
                    ("alpha", Arg::Float(-h.lr)),
                ],
            )?;
        }
        Ok(())
    }

    /// `_multi_tensor_sgd`: per group, the buffers updated with `_foreach_mul_`/`_foreach_add_`
    /// (or cloned one by one on the first step), then `_foreach_add_(params, bufs, alpha=-lr)`.
    fn foreach(&mut self, idx: &[usize]) -> Result<()> {
        let h = self.h;
        for group in groups(&self.params, idx) {
            let params = pick(&self.params, &group);
            let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
            let d = match &mut self.momentum {
                None => grads,
                Some(bufs) => {
                    if group.iter().all(|&i| bufs[i].is_some()) {
                        let b: Vec<Tensor> = group
                            .iter()
                            .map(|&i| bufs[i].as_ref().unwrap().shallow_clone())
                            .collect();
                        call(
                            "aten::_foreach_mul_",
                            "Scalar",
                            &[("self", list(&b)), ("scalar", Arg::Float(h.momentum))],
                        )?;
                        call(
                            "aten::_foreach_add_",
                            "List",
                            &[("self", list(&b)), ("other", list(&grads)), ("alpha", Arg::Float(1.0))],
                        )?;
                        b
                    } else {
                        group
                            .iter()
                            .zip(&grads)
                            .map(|(&i, g)| momentum_buffer(&mut bufs[i], g, h))
                            .collect::<Result<Vec<_>>>()?
                    }
                }
            };
            call(
                "aten::_foreach_add_",
                "List",
                &[
                    ("self", list(&params)),
                    ("other", list(&d)),
                    ("alpha", Arg::Float(-h.lr)),
                ],
            )?;
        }
        Ok(())
    }

    /// `_fused_sgd`: on the first step every momentum buffer is `empty_like(grad)` (the kernel
    /// fills it), then one `_fused_sgd_` per group.
    fn fused(&mut self, idx: &[usize]) -> Result<()> {
        let h = self.h;
        // `_fused_sgd`'s first step: no momentum buffer yet among the parameters it updates.
        let first = self
            .momentum
            .as_ref()
            .is_some_and(|b| idx.iter().all(|&i| b[i].is_none()));
        if first {
            let bufs = self.momentum.as_mut().expect("momentum buffers");
            for &i in idx {
                let g = self.params[i].grad();
                bufs[i] = Some(g.f_empty_like().map_err(torch("sgd momentum buffer"))?);
            }
        }
        for group in groups(&self.params, idx) {
            let params = pick(&self.params, &group);
            let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
            let bufs: Vec<Tensor> = match &self.momentum {
                Some(b) => group
                    .iter()
                    .map(|&i| b[i].as_ref().expect("momentum buffer").shallow_clone())
                    .collect(),
                None => Vec::new(),
            };
            call(
                "aten::_fused_sgd_",
                "",
                &[
                    ("self", list(&params)),
                    ("grads", list(&grads)),
                    ("momentum_buffer_list", list(&bufs)),
                    ("weight_decay", Arg::Float(0.0)),
                    (
                        "momentum",
                        Arg::Float(if self.momentum.is_some() { h.momentum } else { 0.0 }),
                    ),
                    ("lr", Arg::Float(h.lr)),
                    ("dampening", Arg::Float(0.0)),
                    ("nesterov", Arg::Bool(false)),
                    ("maximize", Arg::Bool(false)),
                    ("is_first_step", Arg::Bool(first)),
                ],
            )?;
        }
        Ok(())
    }
}

/// One parameter's momentum buffer after this step, as `_single_tensor_sgd` (and foreach's
/// fallback before every buffer exists) updates it: `grad.detach().clone()` on the first step,
/// then `buf.mul_(momentum).add_(grad)` in place.
fn momentum_buffer(slot: &mut Option<Tensor>, g: &Tensor, h: Hyper) -> Result<Tensor> {
    match slot {
        Some(buf) => {
            call(
                "aten::mul_",
                "Tensor",
                &[("self", Arg::Tensor(buf)), ("other", Arg::Float(h.momentum))],
            )?;
            call(
                "aten::add_",
                "Tensor",
                &[
                    ("self", Arg::Tensor(buf)),
                    ("other", Arg::Tensor(g)),
                    ("alpha", Arg::Float(1.0)),
                ],
            )?;
            Ok(buf.shallow_clone())
        }
        None => {
            let buf = g.f_detach_copy().map_err(torch("sgd momentum buffer"))?;
            *slot = Some(buf.shallow_clone());
            Ok(buf)
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let idx = with_grad(&self.params);
        self.step_params(&idx)
    }
    fn step_params(&mut self, idx: &[usize]) -> Result<()> {
        tch::no_grad(|| match self.imp {
            OptimizerImpl::Single => self.single(idx),
            OptimizerImpl::Foreach => self.foreach(idx),
            OptimizerImpl::Fused => self.fused(idx),
        })
    }
    fn state_bytes(&self) -> i64 {
        self.momentum.as_deref().map(state_bytes).unwrap_or(0)
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
}

/// `torch.optim.Adam` / `AdamW` (no amsgrad, no maximize, not capturable: PyTorch's defaults).
struct Adam {
    params: Vec<Tensor>,
    h: Hyper,
    imp: OptimizerImpl,
    decoupled: bool,
    exp_avg: Vec<Option<Tensor>>,
    exp_avg_sq: Vec<Option<Tensor>>,
    /// Per parameter, the step count as a 0-dim f32 tensor (`state["step"]`).
    step: Vec<Option<Tensor>>,
}

impl Adam {
    /// `_init_group`'s lazy state: `step` (on the host unless fused), `exp_avg`, `exp_avg_sq`.
    fn init_state(&mut self, idx: &[usize]) -> Result<()> {
        for &i in idx {
            if self.step[i].is_some() {
                continue;
            }
            let p = &self.params[i];
            let device = if self.imp == OptimizerImpl::Fused {
                p.device()
            } else {
                Device::Cpu
            };
            let zeros = |what| p.f_zeros_like().map_err(torch(what));
            // A host step count is a real tensor in fake mode too: the step reads its value.
            let _real = (device == Device::Cpu).then(ckptune_kernels::fake::real).transpose()?;
            self.step[i] =
                Some(Tensor::f_zeros(Vec::<i64>::new(), (Kind::Float, device)).map_err(torch("adam step count"))?);
            drop(_real);
            self.exp_avg[i] = Some(zeros("adam first moment")?);
            self.exp_avg_sq[i] = Some(zeros("adam second moment")?);
        }
        Ok(())
    }

    /// A group's `step`, `exp_avg` and `exp_avg_sq` lists, as `_init_group` hands them over.
    fn group_state(&self, group: &[usize]) -> (Vec<Tensor>, Vec<Tensor>, Vec<Tensor>) {
        let (mut steps, mut ms, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for &i in group {
            let (s, m, v) = self.state_of(i);
            steps.push(s.shallow_clone());
            ms.push(m.shallow_clone());
            vs.push(v.shallow_clone());
        }
        (steps, ms, vs)
    }

    fn state_of(&self, i: usize) -> (&Tensor, &Tensor, &Tensor) {
        fn get(s: &Option<Tensor>) -> &Tensor {
            s.as_ref().expect("state initialized by init_state")
        }
        (get(&self.step[i]), get(&self.exp_avg[i]), get(&self.exp_avg_sq[i]))
    }

    /// `_single_tensor_adam`, parameter by parameter. Its peak is while computing
    /// `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: two temporaries of the
    /// parameter's size (and the 8-byte wrapped number), plus the previous parameter's `denom`,
    /// which the Python loop's variable keeps alive until the new one is assigned.
    fn single(&self, idx: &[usize]) -> Result<()> {
        let h = self.h;
        let mut denom_var: Option<Tensor> = None;
        for &i in idx {
            let p = &self.params[i];
            let (step_t, m, v) = self.state_of(i);
            let mut g = p.grad();
            call(
                "aten::add_",
                "Tensor",
                &[("self", Arg::Tensor(step_t)), ("other", Arg::Int(1))],
            )?;
            if h.weight_decay != 0.0 {
                if self.decoupled {
                    call(
                        "aten::mul_",
                        "Tensor",
                        &[
                            ("self", Arg::Tensor(p)),
                            ("other", Arg::Float(1.0 - h.lr * h.weight_decay)),
                        ],
                    )?;
                } else {
                    g = call_tensor(
                        "aten::add",
                        "Tensor",
                        &[
                            ("self", Arg::Tensor(&g)),
                            ("other", Arg::Tensor(p)),
                            ("alpha", Arg::Float(h.weight_decay)),
                        ],
                    )?;
                }
            }
            call(
                "aten::lerp_",
                "Scalar",
                &[
                    ("self", Arg::Tensor(m)),
                    ("end", Arg::Tensor(&g)),
                    ("weight", Arg::Float(1.0 - h.betas.0)),
                ],
            )?;
            call(
                "aten::mul_",
                "Tensor",
                &[("self", Arg::Tensor(v)), ("other", Arg::Float(h.betas.1))],
            )?;
            call(
                "aten::addcmul_",
                "",
                &[
                    ("self", Arg::Tensor(v)),
                    ("tensor1", Arg::Tensor(&g)),
                    ("tensor2", Arg::Tensor(&g)),
                    ("value", Arg::Float(1.0 - h.betas.1)),
                ],
            )?;
            let step = step_t.f_double_value(&[]).map_err(torch("adam step count"))?;
            let (step_size, bc2_sqrt) = bias_corrections(h, step);
            let denom = {
                let sqrt = call_tensor("aten::sqrt", "", &[("self", Arg::Tensor(v))])?;
                call_tensor(
                    "aten::div",
                    "Tensor",
                    &[("self", Arg::Tensor(&sqrt)), ("other", Arg::Float(bc2_sqrt))],
                )?
            };
            call(
                "aten::add_",
                "Tensor",
                &[("self", Arg::Tensor(&denom)), ("other", Arg::Float(h.eps))],
            )?;
            let denom = denom_var.insert(denom);
            call(
                "aten::addcdiv_",
                "",
                &[
                    ("self", Arg::Tensor(p)),
                    ("tensor1", Arg::Tensor(m)),
                    ("tensor2", Arg::Tensor(denom)),
                    ("value", Arg::Float(-step_size)),
                ],
            )?;
        }
        Ok(())
    }

    /// `_multi_tensor_adam` per (device, dtype) group. Its peak is `_foreach_sqrt` of every
    /// second moment of the group at once.
    fn foreach(&self, idx: &[usize]) -> Result<()> {
        let h = self.h;
        for group in groups(&self.params, idx) {
            let params = pick(&self.params, &group);
            let mut grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
            let (steps, ms, vs) = self.group_state(&group);
            {
                // Host steps: one f32 `torch.tensor(1.0)` added to all (the Tensor overload).
                // Real in fake mode too, as the step counts it is added to: its bytes are
                // written from the host.
                let one = {
                    let _real = ckptune_kernels::fake::real()?;
                    Tensor::f_from_slice(&[1.0f32])
                        .and_then(|t| t.f_reshape(Vec::<i64>::new()))
                        .map_err(torch("adam step count"))?
                };
                call(
                    "aten::_foreach_add_",
                    "Tensor",
                    &[
                        ("self", list(&steps)),
                        ("other", Arg::Tensor(&one)),
                        ("alpha", Arg::Float(1.0)),
                    ],
                )?;
            }
            if h.weight_decay != 0.0 {
                if self.decoupled {
                    call(
                        "aten::_foreach_mul_",
                        "Scalar",
                        &[
                            ("self", list(&params)),
                            ("scalar", Arg::Float(1.0 - h.lr * h.weight_decay)),
                        ],
                    )?;
                } else {
                    grads = call_tensors(
                        "aten::_foreach_add",
                        "List",
                        &[
                            ("self", list(&grads)),
                            ("other", list(&params)),
                            ("alpha", Arg::Float(h.weight_decay)),
                        ],
                    )?;
                }
            }
            call(
                "aten::_foreach_lerp_",
                "Scalar",
                &[
                    ("self", list(&ms)),
                    ("tensors1", list(&grads)),
                    ("weight", Arg::Float(1.0 - h.betas.0)),
                ],
            )?;
            call(
                "aten::_foreach_mul_",
                "Scalar",
                &[("self", list(&vs)), ("scalar", Arg::Float(h.betas.1))],
            )?;
            call(
                "aten::_foreach_addcmul_",
                "Scalar",
                &[
                    ("self", list(&vs)),
                    ("tensor1", list(&grads)),
                    ("tensor2", list(&grads)),
                    ("value", Arg::Float(1.0 - h.betas.1)),
                ],
            )?;
            drop(grads);
            let mut step_size = Vec::with_capacity(steps.len());
            let mut bc2_sqrt = Vec::with_capacity(steps.len());
            for s in &steps {
                let (a, b) = bias_corrections(h, s.f_double_value(&[]).map_err(torch("adam step count"))?);
                step_size.push(-a);
                bc2_sqrt.push(b);
            }
            let sqrt = call_tensors("aten::_foreach_sqrt", "", &[("self", list(&vs))])?;
            call(
                "aten::_foreach_div_",
                "ScalarList",
                &[("self", list(&sqrt)), ("scalars", Arg::Floats(bc2_sqrt))],
            )?;
            call(
                "aten::_foreach_add_",
                "Scalar",
                &[("self", list(&sqrt)), ("scalar", Arg::Float(h.eps))],
            )?;
            call(
                "aten::_foreach_addcdiv_",
                "ScalarList",
                &[
                    ("self", list(&params)),
                    ("tensor1", list(&ms)),
                    ("tensor2", list(&sqrt)),
                    ("scalars", Arg::Floats(step_size)),
                ],
            )?;
        }
        Ok(())
    }

    /// `_fused_adam`: the step counts incremented, then one `_fused_adam(w)_` per group.
    fn fused(&self, idx: &[usize]) -> Result<()> {
        let h = self.h;
        for group in groups(&self.params, idx) {
            let params = pick(&self.params, &group);
            let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
            let (steps, ms, vs) = self.group_state(&group);
            call(
                "aten::_foreach_add_",
                "Scalar",
                &[("self", list(&steps)), ("scalar", Arg::Int(1))],
            )?;
            let op = if self.decoupled {
                "aten::_fused_adamw_"
            } else {
                "aten::_fused_adam_"
            };
            call(
                op,
                "",
                &[
                    ("self", list(&params)),
                    ("grads", list(&grads)),
                    ("exp_avgs", list(&ms)),
                    ("exp_avg_sqs", list(&vs)),
                    ("max_exp_avg_sqs", list(&[])),
                    ("state_steps", list(&steps)),
                    ("lr", Arg::Float(h.lr)),
                    ("beta1", Arg::Float(h.betas.0)),
                    ("beta2", Arg::Float(h.betas.1)),
                    ("weight_decay", Arg::Float(h.weight_decay)),
                    ("eps", Arg::Float(h.eps)),
                    ("amsgrad", Arg::Bool(false)),
                    ("maximize", Arg::Bool(false)),
                ],
            )?;
        }
        Ok(())
    }
}

/// `(lr / (1 - beta1^step), sqrt(1 - beta2^step))`, in f64 as Python computes them.
fn bias_corrections(h: Hyper, step: f64) -> (f64, f64) {
    let bc1 = 1.0 - h.betas.0.powf(step);
    let bc2 = 1.0 - h.betas.1.powf(step);
    (h.lr / bc1, bc2.powf(0.5))
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        let idx = with_grad(&self.params);
        self.step_params(&idx)
    }
    fn step_params(&mut self, idx: &[usize]) -> Result<()> {
        tch::no_grad(|| {
            self.init_state(idx)?;
            match self.imp {
                OptimizerImpl::Single => self.single(idx),
                OptimizerImpl::Foreach => self.foreach(idx),
                OptimizerImpl::Fused => self.fused(idx),
            }
        })
    }
    fn state_bytes(&self) -> i64 {
        state_bytes(&self.exp_avg) + state_bytes(&self.exp_avg_sq) + state_bytes(&self.step)
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
        let all: Vec<usize> = (0..self.params.len()).collect();
        self.step_params(&all)
    }
    fn step_params(&mut self, idx: &[usize]) -> Result<()> {
        let h = self.h;
        tch::no_grad(|| -> Result<()> {
            for &i in idx {
                let p = &self.params[i];
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
    fn step_params(&mut self, _idx: &[usize]) -> Result<()> {
        Err(RuntimeError::Config(
            "the 8-bit optimizers update their parameters as one list; the optimizer step in backward \
             is not modelled for them"
                .into(),
        ))
    }
    fn state_bytes(&self) -> i64 {
        self.0.state_bytes()
    }
    fn params(&self) -> &[Tensor] {
        self.0.params()
    }
}
