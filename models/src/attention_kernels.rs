//! The choice of kernels a transformer's attention is traced with.

/// Which kernels a transformer's SDPA calls: what libtorch chooses on the device the model runs
/// on (on the CPU, and on the meta device that reports the CPU, the CPU's), or, for a model
/// traced on the meta device for a GPU, CUDA's memory-efficient attention, which PyTorch runs
/// there for fp32 with or without a mask or dropout (results/gpu/README.md). The two keep
/// different tensors: with dropout the CPU's math path keeps `[batch, heads, seq, seq]`
/// probabilities and a dropout mask, CUDA's kernel neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionKernels {
    #[default]
    Device,
    /// Only on the meta device: no CPU kernel exists.
    CudaEfficient,
}
