//! The GPU table: each GPU's published peaks, and the rates the cost model takes from them
//! (docs/cost-model.md, "GPU rates: the table"). Nothing here is measured on the user's GPU.

use crate::rates::{Curve, DeviceRates, Dtype, HostIssue};

/// One GPU's published figures: dense peaks (no structured sparsity) and memory bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSpec {
    /// The name `--target cuda:<name>` takes.
    pub key: &'static str,
    pub name: &'static str,
    /// Dense tensor-core TFLOP/s for bf16 and fp16 with fp32 accumulation, and for tf32.
    pub bf16_tflops: f64,
    pub fp16_tflops: f64,
    pub tf32_tflops: f64,
    /// fp32 TFLOP/s on the CUDA cores (no tensor cores).
    pub fp32_tflops: f64,
    /// Memory bandwidth, GB/s.
    pub memory_gbps: f64,
    /// The document the figures are from.
    pub source: &'static str,
}

/// The GPUs `--target cuda:<name>` knows (docs/cost-model.md lists them with the same figures).
pub const GPUS: &[GpuSpec] = &[
    GpuSpec {
        key: "h100",
        name: "NVIDIA H100 SXM5 80GB",
        bf16_tflops: 989.4,
        fp16_tflops: 989.4,
        tf32_tflops: 494.7,
        fp32_tflops: 66.9,
        memory_gbps: 3350.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet (SXM5; sparsity figures halved)",
    },
    GpuSpec {
        key: "h200",
        name: "NVIDIA H200 SXM 141GB",
        bf16_tflops: 989.4,
        fp16_tflops: 989.4,
        tf32_tflops: 494.7,
        fp32_tflops: 66.9,
        memory_gbps: 4800.0,
        source: "NVIDIA H200 Tensor Core GPU datasheet (SXM; sparsity figures halved)",
    },
    GpuSpec {
        key: "a100-80gb",
        name: "NVIDIA A100 SXM4 80GB",
        bf16_tflops: 312.0,
        fp16_tflops: 312.0,
        tf32_tflops: 156.0,
        fp32_tflops: 19.5,
        memory_gbps: 2039.0,
        source: "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)",
    },
    GpuSpec {
        key: "l40s",
        name: "NVIDIA L40S 48GB",
        bf16_tflops: 362.05,
        fp16_tflops: 362.05,
        tf32_tflops: 183.0,
        fp32_tflops: 91.6,
        memory_gbps: 864.0,
        source: "NVIDIA L40S datasheet (sparsity figures halved)",
    },
    GpuSpec {
        key: "rtx4090",
        name: "NVIDIA GeForce RTX 4090 24GB",
        bf16_tflops: 165.2,
        fp16_tflops: 165.2,
        tf32_tflops: 82.6,
        fp32_tflops: 82.6,
        memory_gbps: 1008.0,
        source: "NVIDIA Ada Lovelace architecture whitepaper, appendix A (FP16/BF16 with FP32 accumulate, dense)",
    },
];

/// The efficiencies applied to a GPU's published peaks (docs/cost-model.md says why): the
/// share of the tensor-core peak large matrix products reach, the share of the fp32 peak, the
/// share of the tensor-core peak convolutions reach, the share of the memory bandwidth streaming
/// kernels reach, and the device's time per call besides its work (a kernel's start behind the
/// one before it; the host's time to issue it is [`GPU_HOST`]'s).
pub const GPU_MATMUL_EFFICIENCY: f64 = 0.70;
pub const GPU_FP32_EFFICIENCY: f64 = 0.80;
pub const GPU_CONV_EFFICIENCY: f64 = 0.60;
pub const GPU_MEMORY_EFFICIENCY: f64 = 0.80;
pub const GPU_OVERHEAD_SECONDS: f64 = 3e-6;
/// The host's seconds per operator it issues to a GPU ([`HostIssue`]), fitted to steps timed on
/// an NVIDIA H200's host running PyTorch 2.11 eager (results/gpu/times.md, docs/cost-model.md).
pub const GPU_HOST: HostIssue = HostIssue {
    op_seconds: 5e-6,
    checkpoint_op_seconds: 16e-6,
};

/// The GPU of the table called `key` (`h100`, `a100-80gb`, ...; case-insensitive).
pub fn gpu(key: &str) -> Option<&'static GpuSpec> {
    GPUS.iter().find(|g| g.key.eq_ignore_ascii_case(key))
}

/// The names [`gpu`] knows, for messages.
pub fn gpu_names() -> Vec<&'static str> {
    GPUS.iter().map(|g| g.key).collect()
}

impl GpuSpec {
    /// The rates the cost model uses for this GPU: its peaks times the stated efficiencies.
    /// PyTorch's defaults decide which peak an fp32 operator meets: matrix products run on the
    /// CUDA cores (`torch.backends.cuda.matmul.allow_tf32` is off), convolutions on tf32 tensor
    /// cores (`torch.backends.cudnn.allow_tf32` is on).
    pub fn rates(&self) -> DeviceRates {
        let t = 1e12;
        let flat = Curve::flat;
        DeviceRates {
            device: format!("cuda:{}", self.key),
            name: self.name.into(),
            measured: false,
            source: format!(
                "published peaks ({}) times efficiencies: matmul {:.0}% of the tensor-core peak, fp32 \
                 {:.0}%, convolution {:.0}%, memory {:.0}% of the bandwidth, {:.0} µs per kernel; \
                 each part of the step no faster than its host issues its operators, {:.0} µs each, \
                 {:.0} µs in a checkpointed block's forward (docs/cost-model.md)",
                self.source,
                GPU_MATMUL_EFFICIENCY * 100.0,
                GPU_FP32_EFFICIENCY * 100.0,
                GPU_CONV_EFFICIENCY * 100.0,
                GPU_MEMORY_EFFICIENCY * 100.0,
                GPU_OVERHEAD_SECONDS * 1e6,
                GPU_HOST.op_seconds * 1e6,
                GPU_HOST.checkpoint_op_seconds * 1e6
            ),
            threads: None,
            matmul: vec![
                flat(Dtype::Fp32, self.fp32_tflops * t * GPU_FP32_EFFICIENCY),
                flat(Dtype::Bf16, self.bf16_tflops * t * GPU_MATMUL_EFFICIENCY),
                flat(Dtype::Fp16, self.fp16_tflops * t * GPU_MATMUL_EFFICIENCY),
            ],
            matmul_thin: Vec::new(),
            matmul_transposed: Vec::new(),
            conv: vec![
                flat(Dtype::Fp32, self.tf32_tflops * t * GPU_CONV_EFFICIENCY),
                flat(Dtype::Bf16, self.bf16_tflops * t * GPU_CONV_EFFICIENCY),
                flat(Dtype::Fp16, self.fp16_tflops * t * GPU_CONV_EFFICIENCY),
            ],
            conv_shapes: Vec::new(),
            conv_backward: Vec::new(),
            conv_setup: Vec::new(),
            bandwidth: vec![flat(Dtype::Fp32, self.memory_gbps * 1e9 * GPU_MEMORY_EFFICIENCY)],
            bandwidth_in_place: Vec::new(),
            overhead_seconds: GPU_OVERHEAD_SECONDS,
            ops: Vec::new(),
            op_setup: Vec::new(),
            attention: None,
            block_overhead: None,
            host: Some(GPU_HOST),
        }
    }
}

#[cfg(test)]
#[path = "gpus_tests.rs"]
mod tests;
