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
    /// The CUDA context with PyTorch's kernels loaded lazily: an estimate, not a measurement.
    pub context_bytes: u64,
    /// One cuBLAS workspace (PyTorch's `parseChosenWorkspaceSize` default for `sm_major`).
    pub workspace_bytes: u64,
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

/// The estimated CUDA context (docs/cuda-allocator.md: a published range, not measured here).
pub const CONTEXT_ESTIMATE_BYTES: u64 = 512 << 20;

/// A training step runs its forward on the main thread's cuBLAS handle and its backward on
/// the autograd engine's device thread, whose handle has a workspace of its own.
pub const WORKSPACES_PER_STEP: usize = 2;

pub const OVERHEADS: &[CudaOverheads] = &[
    overheads("h100", 9),
    overheads("h200", 9),
    overheads("a100-80gb", 8),
    overheads("l40s", 8),
    overheads("rtx4090", 8),
    // A GPU not named: the larger workspace, so the plan errs toward fitting.
    overheads("cuda", 9),
];

const fn overheads(key: &'static str, sm_major: u32) -> CudaOverheads {
    CudaOverheads {
        key,
        sm_major,
        context_bytes: CONTEXT_ESTIMATE_BYTES,
        workspace_bytes: cublas_workspace_bytes(sm_major),
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
