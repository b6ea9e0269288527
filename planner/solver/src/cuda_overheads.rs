//! What a CUDA training step holds on the card besides its tensors, per GPU
//! (docs/cuda-allocator.md, "What the card holds besides the tensors", gives each figure's
//! source): the CUDA context, outside the caching allocator, and cuBLAS's workspaces, which
//! PyTorch allocates through the caching allocator and so are replayed with the step's trace.

/// The overheads of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOverheads {
    /// The `--target cuda:<name>` key, or `cuda` for a GPU not named.
    pub key: &'static str,
    /// Compute capability major version (what PyTorch sizes the cuBLAS workspace by).
    pub sm_major: u32,
    /// The CUDA context with PyTorch's kernels loaded lazily, and the kernels a training step
    /// loads into it (cuBLAS's, cuDNN's).
    pub context_bytes: u64,
    /// Where `context_bytes` comes from, as the plan's notes say it.
    pub context_source: &'static str,
    /// One cuBLAS workspace (PyTorch's `parseChosenWorkspaceSize` default for `sm_major`).
    pub workspace_bytes: u64,
    /// Multiprocessors and the threads one holds (`cudaDeviceProp`): how CUDA's reductions split
    /// across thread blocks, and so the staging buffer they allocate (kernels/csrc/
    /// cuda_reductions.cpp). The H200's were read on one; the others are NVIDIA's published figures.
    pub multiprocessors: u32,
    pub threads_per_multiprocessor: u32,
}

impl CudaOverheads {
    /// What the card holds beside a step's tensors before planning starts: the context and
    /// the step's cuBLAS workspaces.
    pub fn fixed_bytes(&self) -> i64 {
        (self.context_bytes + self.workspace_bytes * WORKSPACES_PER_STEP as u64) as i64
    }
}

/// `parseChosenWorkspaceSize`'s default (aten/src/ATen/cuda/CublasHandlePool.cpp): 32 MiB on
/// compute capability 9, 10 and 12, else `:4096:2:16:8` (two 4 MiB and eight 16 KiB chunks).
pub const fn cublas_workspace_bytes(sm_major: u32) -> u64 {
    match sm_major {
        9 | 10 | 12 => 4096 * 8 * 1024,
        _ => 4096 * 1024 * 2 + 16 * 1024 * 8,
    }
}

/// What an H200 held outside the caching allocator once a process had created its context and
/// run its first cuBLAS product and cuDNN convolution (results/gpu/steps.md: torch 2.11, CUDA
/// 13.0, driver 580). Hopper GPUs and a GPU not named take it; the kernels loaded are the same.
pub const CONTEXT_MEASURED_H200_BYTES: u64 = 734_855_168;

/// The CUDA context of GPUs not measured here (docs/cuda-allocator.md: a published range).
pub const CONTEXT_ESTIMATE_BYTES: u64 = 512 << 20;

const MEASURED: &str = "measured on an H200, results/gpu/steps.md";
const ESTIMATED: &str = "an estimate, docs/cuda-allocator.md";

/// A training step runs its forward on the main thread's cuBLAS handle and its backward on
/// the autograd engine's device thread, whose handle has a workspace of its own.
pub const WORKSPACES_PER_STEP: usize = 2;

pub const OVERHEADS: &[CudaOverheads] = &[
    overheads("h100", 9, CONTEXT_MEASURED_H200_BYTES, MEASURED, (132, 2048)),
    overheads("h200", 9, CONTEXT_MEASURED_H200_BYTES, MEASURED, (132, 2048)),
    overheads("a100-80gb", 8, CONTEXT_ESTIMATE_BYTES, ESTIMATED, (108, 2048)),
    overheads("l40s", 8, CONTEXT_ESTIMATE_BYTES, ESTIMATED, (142, 1536)),
    overheads("rtx4090", 8, CONTEXT_ESTIMATE_BYTES, ESTIMATED, (128, 1536)),
    // A GPU not named: the larger workspace and the larger context, so the plan errs toward
    // fitting; the H200's multiprocessors, where the reductions were measured.
    overheads("cuda", 9, CONTEXT_MEASURED_H200_BYTES, MEASURED, (132, 2048)),
];

const fn overheads(
    key: &'static str,
    sm_major: u32,
    context_bytes: u64,
    context_source: &'static str,
    (multiprocessors, threads_per_multiprocessor): (u32, u32),
) -> CudaOverheads {
    CudaOverheads {
        key,
        sm_major,
        context_bytes,
        context_source,
        workspace_bytes: cublas_workspace_bytes(sm_major),
        multiprocessors,
        threads_per_multiprocessor,
    }
}

/// The overheads of `--target cuda:<key>`, or of an unnamed GPU (`None`).
pub fn cuda_overheads(key: Option<&str>) -> CudaOverheads {
    let key = key.unwrap_or("cuda");
    OVERHEADS
        .iter()
        .find(|o| o.key == key)
        .copied()
        .unwrap_or(OVERHEADS[OVERHEADS.len() - 1])
}
