//! The `torch.nn` layers the model families are made of, with PyTorch's parameter names,
//! shapes, initialisation and — what matters for memory — the same ATen ops in the same
//! order as the Python modules' `forward`, so autograd saves the same tensors.
//!
//! tch's own `nn` layers are not used: they lack BatchNorm's `num_batches_tracked`, GPT-2's
//! `Conv1D`, padding indices and the reference initialisations.

use ckptune_kernels::autocast;
use tch::{nn, Device, Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::trace_kernels::TraceKernels;

/// How a parameter is initialised, named after the reference code that does it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Init {
    Zeros,
    Ones,
    /// `nn.init.normal_(std=…)`: Hugging Face `_init_weights` with `initializer_range`.
    Normal {
        std: f64,
    },
    /// `nn.init.kaiming_normal_(mode="fan_out", nonlinearity="relu")`: torchvision's conv init.
    KaimingNormalFanOut,
    /// `U(-1/sqrt(fan_in), 1/sqrt(fan_in))`: `nn.Linear.reset_parameters` for the weight
    /// (`kaiming_uniform_(a=sqrt(5))` reduces to this bound) and for the bias.
    UniformFanIn {
        fan_in: i64,
    },
}

/// Element kind and device of the floating-point variables being created, and the attention
/// kernels the model's layers call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spec {
    pub kind: Kind,
    pub device: Device,
    pub trace_kernels: TraceKernels,
}

impl Spec {
    /// Whether dropout runs as CUDA's fused kernel (a step traced for a GPU).
    pub fn fused_dropout(&self) -> bool {
        self.trace_kernels == TraceKernels::Cuda
    }
}

fn create(op: &str, shape: &[i64], init: Init, spec: Spec) -> Result<Tensor> {
    let opts = (spec.kind, spec.device);
    let err = |e| ModelError::torch(format!("{op} (shape {shape:?}, {:?})", spec.kind), e);
    let mut t = match init {
        Init::Zeros => return Tensor::f_zeros(shape, opts).map_err(err),
        Init::Ones => return Tensor::f_ones(shape, opts).map_err(err),
        _ => Tensor::f_empty(shape, opts).map_err(err)?,
    };
    let _ = match init {
        Init::Normal { std } => t.f_normal_(0.0, std),
        Init::KaimingNormalFanOut => {
            let fan_out = shape[0] * shape[2..].iter().product::<i64>();
            t.f_normal_(0.0, (2.0 / fan_out as f64).sqrt())
        }
        Init::UniformFanIn { fan_in } => {
            let bound = 1.0 / (fan_in as f64).sqrt();
            t.f_uniform_(-bound, bound)
        }
        Init::Zeros | Init::Ones => unreachable!("returned above"),
    }
    .map_err(err)?;
    Ok(t)
}

/// A trainable parameter `name` under `path`, created initialised (before autograd sees it).
pub(crate) fn param(path: &nn::Path<'_>, name: &str, shape: &[i64], init: Init, spec: Spec) -> Result<Tensor> {
    let full = path.path(name);
    let t = create(&format!("creating parameter {full}"), shape, init, spec)?;
    Ok(add(path, name, t, true))
}

/// A buffer (in `state_dict`, not trainable) `name` under `path`.
pub(crate) fn buffer(path: &nn::Path<'_>, name: &str, t: Tensor) -> Tensor {
    add(path, name, t, false)
}

fn add(path: &nn::Path<'_>, name: &str, t: Tensor, trainable: bool) -> Tensor {
    // `Path::add` silently renames a duplicate to `name__N`, which would break the
    // state_dict-name contract: a duplicate is a bug in a model definition.
    assert!(path.get(name).is_none(), "variable {} created twice", path.path(name));
    path.add(name, t, trainable)
}

/// `nn.Conv2d(bias=False)` as torchvision's `conv3x3`/`conv1x1`/stem use it.
pub(crate) struct Conv2d {
    weight: Tensor,
    stride: i64,
    padding: i64,
    groups: i64,
}

impl Conv2d {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        path: &nn::Path<'_>,
        in_ch: i64,
        out_ch: i64,
        kernel: i64,
        stride: i64,
        padding: i64,
        groups: i64,
        spec: Spec,
    ) -> Result<Self> {
        let weight = param(
            path,
            "weight",
            &[out_ch, in_ch / groups, kernel, kernel],
            Init::KaimingNormalFanOut,
            spec,
        )?;
        Ok(Conv2d {
            weight,
            stride,
            padding,
            groups,
        })
    }

    pub fn forward(&self, xs: &Tensor) -> Tensor {
        xs.conv2d(
            &self.weight,
            None::<&Tensor>,
            [self.stride, self.stride],
            [self.padding, self.padding],
            [1, 1],
            self.groups,
        )
    }
}

/// `nn.BatchNorm2d(eps=1e-5, momentum=0.1)` with its three buffers.
pub(crate) struct BatchNorm2d {
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor,
}

impl BatchNorm2d {
    const EPS: f64 = 1e-5;
    const MOMENTUM: f64 = 0.1;

    /// `weight_init` is `Ones`, or `Zeros` for torchvision's `zero_init_residual`.
    pub fn new(path: &nn::Path<'_>, channels: i64, weight_init: Init, spec: Spec) -> Result<Self> {
        let weight = param(path, "weight", &[channels], weight_init, spec)?;
        let bias = param(path, "bias", &[channels], Init::Zeros, spec)?;
        let running_mean = buffer(
            path,
            "running_mean",
            create("creating running_mean", &[channels], Init::Zeros, spec)?,
        );
        let running_var = buffer(
            path,
            "running_var",
            create("creating running_var", &[channels], Init::Ones, spec)?,
        );
        // An int64 scalar in PyTorch's state_dict, whatever the floating kind of the model.
        let nbt = Tensor::f_zeros([], (Kind::Int64, spec.device))
            .map_err(|e| ModelError::torch("creating num_batches_tracked", e))?;
        let num_batches_tracked = buffer(path, "num_batches_tracked", nbt);
        Ok(BatchNorm2d {
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
        })
    }

    pub fn forward(&self, xs: &Tensor, train: bool) -> Tensor {
        if train {
            // `self.num_batches_tracked.add_(1)` of `_BatchNorm.forward`; with a fixed
            // momentum it only counts, but it is state_dict state and recompute repeats it,
            // exactly as torch.utils.checkpoint does.
            tch::no_grad(|| {
                let _ = self.num_batches_tracked.shallow_clone().g_add_scalar_(1);
            });
        }
        // F.batch_norm → torch.batch_norm(..., torch.backends.cudnn.enabled), which is true.
        Tensor::batch_norm(
            xs,
            Some(&self.weight),
            Some(&self.bias),
            Some(&self.running_mean),
            Some(&self.running_var),
            train,
            Self::MOMENTUM,
            Self::EPS,
            true,
        )
    }
}

/// `nn.Linear`; `F.linear` is `at::linear`, which tch calls too.
pub(crate) struct Linear {
    pub weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Weight `[out, in]` and bias `[out]` initialised by `weight_init` / `bias_init`.
    pub fn new(
        path: &nn::Path<'_>,
        in_dim: i64,
        out_dim: i64,
        weight_init: Init,
        bias_init: Option<Init>,
        spec: Spec,
    ) -> Result<Self> {
        let weight = param(path, "weight", &[out_dim, in_dim], weight_init, spec)?;
        let bias = match bias_init {
            Some(init) => Some(param(path, "bias", &[out_dim], init, spec)?),
            None => None,
        };
        Ok(Linear { weight, bias })
    }

    /// `nn.Linear`'s own `reset_parameters`.
    pub fn torch_default(path: &nn::Path<'_>, in_dim: i64, out_dim: i64, spec: Spec) -> Result<Self> {
        let init = Init::UniformFanIn { fan_in: in_dim };
        Self::new(path, in_dim, out_dim, init, Some(init), spec)
    }

    /// Hugging Face `_init_weights`: `normal_(0, initializer_range)`, zero bias.
    pub fn hf(path: &nn::Path<'_>, in_dim: i64, out_dim: i64, std: f64, spec: Spec) -> Result<Self> {
        Self::new(path, in_dim, out_dim, Init::Normal { std }, Some(Init::Zeros), spec)
    }

    pub fn forward(&self, xs: &Tensor) -> Tensor {
        xs.linear(&self.weight, self.bias.as_ref())
    }
}

/// Hugging Face's GPT-2 `Conv1D`: a linear layer with the weight stored transposed,
/// `[in, out]`, computed as `addmm(bias, x.view(-1, in), weight).view(..., out)`.
pub(crate) struct Conv1D {
    weight: Tensor,
    bias: Tensor,
    nf: i64,
}

impl Conv1D {
    /// `Conv1D(nf, nx)`: `nf` outputs, `nx` inputs (HF's argument order).
    pub fn new(path: &nn::Path<'_>, nf: i64, nx: i64, std: f64, spec: Spec) -> Result<Self> {
        let weight = param(path, "weight", &[nx, nf], Init::Normal { std }, spec)?;
        let bias = param(path, "bias", &[nf], Init::Zeros, spec)?;
        Ok(Conv1D { weight, bias, nf })
    }

    pub fn forward(&self, xs: &Tensor) -> Tensor {
        let mut size_out = xs.size();
        let nx = *size_out.last().expect("Conv1D input has at least one dimension");
        *size_out.last_mut().expect("non-empty") = self.nf;
        self.bias
            .addmm(&xs.view([-1, nx]), &self.weight)
            .view(size_out.as_slice())
    }
}

/// `nn.LayerNorm(dim, eps)`.
pub(crate) struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    dim: i64,
    eps: f64,
}

impl LayerNorm {
    pub fn new(path: &nn::Path<'_>, dim: i64, eps: f64, spec: Spec) -> Result<Self> {
        let weight = param(path, "weight", &[dim], Init::Ones, spec)?;
        let bias = param(path, "bias", &[dim], Init::Zeros, spec)?;
        Ok(LayerNorm { weight, bias, dim, eps })
    }

    pub fn forward(&self, xs: &Tensor) -> Tensor {
        // F.layer_norm → torch.layer_norm(..., torch.backends.cudnn.enabled).
        xs.layer_norm([self.dim], Some(&self.weight), Some(&self.bias), self.eps, true)
    }
}

/// `nn.Embedding(num, dim, padding_idx)`.
pub(crate) struct Embedding {
    pub weight: Tensor,
    /// `-1` for none, as `F.embedding` passes it.
    padding_idx: i64,
}

impl Embedding {
    /// Hugging Face init: `normal_(0, std)`, then the padding row zeroed.
    pub fn hf(path: &nn::Path<'_>, num: i64, dim: i64, padding_idx: Option<i64>, std: f64, spec: Spec) -> Result<Self> {
        let w = create(
            &format!("creating parameter {}", path.path("weight")),
            &[num, dim],
            Init::Normal { std },
            spec,
        )?;
        if let Some(idx) = padding_idx {
            let _ = w
                .f_get(idx)
                .and_then(|mut row| row.f_zero_())
                .map_err(|e| ModelError::torch(format!("zeroing padding row {idx} of {}", path.path("weight")), e))?;
        }
        let weight = add(path, "weight", w, true);
        Ok(Embedding {
            weight,
            padding_idx: padding_idx.unwrap_or(-1),
        })
    }

    pub fn forward(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.weight, ids, self.padding_idx, false, false)
    }
}

/// Activation functions by their Hugging Face `ACT2FN` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `"gelu"`: exact erf GELU (`nn.functional.gelu`).
    Gelu,
    /// `"gelu_new"`: `NewGELUActivation`, the tanh approximation written out in Python
    /// (`0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`) — not the fused
    /// `gelu(approximate="tanh")`: the written-out form saves several activations.
    GeluNew,
    /// `"relu"`.
    Relu,
}

impl Activation {
    pub fn hf_name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::GeluNew => "gelu_new",
            Activation::Relu => "relu",
        }
    }

    /// `cuda`: the step is traced for a GPU ([`TraceKernels::Cuda`]), whose autocast differs.
    pub(crate) fn forward(self, xs: &Tensor, cuda: bool) -> Tensor {
        match self {
            Activation::Gelu => xs.gelu("none"),
            Activation::GeluNew => {
                // Python evaluates `0.5 * input * (1.0 + torch.tanh(...))` left to right and
                // frees each temporary as soon as the next op has consumed it. Same order and
                // lifetimes here: the by-value operators drop their left operand.
                let half = xs * 0.5;
                let cube = if cuda {
                    cuda_autocast_fp32(xs)
                } else {
                    xs.shallow_clone()
                }
                .pow_tensor_scalar(3.0);
                let inner = (xs + cube * 0.044715) * (2.0 / std::f64::consts::PI).sqrt();
                let tanh = inner.tanh();
                drop(inner);
                half * (tanh + 1.0)
            }
            Activation::Relu => xs.relu(),
        }
    }
}

/// What CUDA's autocast hands an operator of its fp32 list (`pow`, `exp`, `log`, ...; the
/// CPU's list has none of these) for `xs`: inside an autocast region, a reduced-precision `xs`
/// cast to fp32, so the operator and whatever is computed from its output run in fp32. GPT-2's
/// `gelu_new` keeps three fp32 tensors per layer for backward on an H200 where the CPU keeps
/// bf16 ones (results/gpu/README.md).
fn cuda_autocast_fp32(xs: &Tensor) -> Tensor {
    let device = xs.device();
    let reduced = matches!(xs.kind(), Kind::BFloat16 | Kind::Half);
    if autocast::is_enabled(device) && reduced {
        xs.to_kind(Kind::Float)
    } else {
        xs.shallow_clone()
    }
}

/// `nn.Dropout(p)`: `F.dropout` is `at::dropout`, a no-op outside training. `fused`: as it runs
/// on CUDA (`is_fused_kernel_acceptable`), `native_dropout`'s output, its bool mask saved for
/// backward; for a step traced for a GPU ([`TraceKernels::Cuda`]).
pub(crate) fn dropout(xs: &Tensor, p: f64, train: bool, fused: bool) -> Tensor {
    if fused && train && p > 0.0 && p < 1.0 && xs.numel() > 0 {
        return Tensor::native_dropout(xs, p, true).0;
    }
    xs.dropout(p, train)
}

/// `xs / x` with `x` a Python float, as PyTorch runs it: `div.Tensor` with a 0-dim "wrapped
/// number" tensor, which its backward saves (8 bytes per use until that backward runs).
/// tch's `xs / x` is `div.Scalar`, which saves nothing: BERT-base's twelve attention scalings
/// would hold 96 bytes fewer than PyTorch's.
pub(crate) fn div_by_python_float(xs: &Tensor, x: f64) -> Tensor {
    use ckptune_kernels::ops::{call, Arg, Value};
    match call(
        "aten::div",
        "Tensor",
        &[("self", Arg::Tensor(xs)), ("other", Arg::Float(x))],
    )
    .map(|mut v| v.swap_remove(0))
    {
        Ok(Value::Tensor(t)) => t,
        Ok(other) => panic!("aten::div.Tensor returned {}", other.describe()),
        Err(e) => panic!("aten::div.Tensor of a {:?} tensor by {x}: {e}", xs.size()),
    }
}

/// `torch.finfo(kind).min`: the additive mask value Hugging Face uses.
pub(crate) fn finfo_min(kind: Kind) -> f64 {
    match kind {
        Kind::Half => -65504.0,
        Kind::BFloat16 => -3.389_531_389_251_535_5e38,
        Kind::Double => f64::MIN,
        _ => f32::MIN as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckptune_kernels::autocast::AutocastGuard;

    #[test]
    fn gelu_new_traced_for_a_gpu_computes_from_its_cube_in_fp32_under_autocast_as_cuda_does() {
        let xs = Tensor::randn([4, 8], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let on = |cuda| {
            let _autocast = AutocastGuard::new(Device::Cpu, Kind::BFloat16, true).expect("autocast");
            Activation::GeluNew.forward(&xs, cuda)
        };
        // CUDA's autocast runs `pow` in fp32, and fp32 spreads to the activation's output.
        assert_eq!(on(true).kind(), Kind::Float);
        assert_eq!(on(false).kind(), Kind::BFloat16);
        let diff = (on(true) - on(false).to_kind(Kind::Float))
            .abs()
            .max()
            .double_value(&[]);
        assert!(diff < 0.05, "the two precisions differ by {diff}");
        // Outside autocast nothing is cast.
        assert_eq!(Activation::GeluNew.forward(&xs, true).kind(), Kind::BFloat16);
        assert_eq!(Activation::Gelu.forward(&xs, true).kind(), Kind::BFloat16);
    }
}
