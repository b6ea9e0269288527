//! The kernels a model's step is traced with where the device's own would differ from the GPU's.

/// Which kernels a model calls where the CPU's and CUDA's keep different tensors: what libtorch
/// chooses on the device the model runs on (on the CPU, and on the meta device that reports the
/// CPU, the CPU's), or, for a model traced on the meta device for a GPU, what PyTorch runs there
/// (results/gpu/README.md):
/// - SDPA: CUDA's memory-efficient attention, for fp32 with or without a mask or dropout. With
///   dropout the CPU's math path keeps `[batch, heads, seq, seq]` probabilities and a dropout
///   mask; CUDA's kernel neither.
/// - Dropout: CUDA's fused `native_dropout`, which keeps a bool mask; the CPU's `at::dropout`
///   draws a mask in the input's dtype (`bernoulli_`, then a multiply) and keeps that.
/// - Autocast: CUDA's runs `pow` in fp32 (GPT-2's `gelu_new`), the CPU's leaves it in the
///   region's dtype.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TraceKernels {
    #[default]
    Device,
    /// Only on the meta device: no CPU kernel exists for CUDA's attention.
    Cuda,
}
