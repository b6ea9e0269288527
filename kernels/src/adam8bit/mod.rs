//! 8-bit block-wise Adam and AdamW (Dettmers et al., "8-bit Optimizers via Block-wise
//! Quantization", ICLR 2022): both moments stored as 8-bit codes into a 256-entry dynamic
//! quantization map, with one f32 absmax per block of [`BLOCK`] elements.
//!
//! Each step, per block: dequantize (`map[code] · absmax`), apply the Adam/AdamW update with the
//! formulas of `torch.optim.AdamW`'s single-tensor loop (decoupled or L2 weight decay, bias
//! correction), take the block's new absmax, re-quantize each moment to the *nearest* code.
//! The parameter update uses the freshly computed moments, before re-quantization, as
//! bitsandbytes does. Tensors with fewer than [`MIN_8BIT_NUMEL`] elements keep 32-bit moments.
//!
//! The CPU path works in place on the tensors' contiguous buffers, one fused pass per block,
//! blocks spread over `tch::get_num_threads()` threads. The CUDA path (feature `cuda`) launches
//! `csrc/adam8bit.cu`, compiled by NVRTC; it performs the same IEEE operations in the same order
//! (no FMA contraction), so both devices produce bit-identical states.
//!
//! State lives in libtorch tensors (`uint8` codes, `f32` absmax or 32-bit moments) on the
//! parameter's device, allocated on its first step as in PyTorch, so the CPU memory meter sees
//! exactly [`state_bytes_for`] bytes per parameter.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod cpu;
mod cuda;
mod qmap;
mod state;
mod update;

use tch::{Device, Kind, Tensor};

use crate::KernelError;
use cpu::{check_disjoint, run_cpu, CpuJob};
use cuda::gpu_step;
use state::torch_err;

#[cfg(feature = "cuda")]
pub use cuda::gpu;
pub use cuda::{cuda_source, CUDA_KERNELS, NVRTC_OPTIONS};
pub use qmap::{dequantize_blockwise, quantize_blockwise, QuantMap, BLOCK, SIGNED, UNSIGNED};
pub use state::{state_bytes_for, Moments, ParamState, MIN_8BIT_NUMEL};
pub use update::{update_block, update_full, AdamHyper, StepScalars};

/// 8-bit block-wise Adam/AdamW over a fixed list of parameters, updated from their `.grad`.
#[derive(Debug)]
pub struct Adam8bit {
    params: Vec<Tensor>,
    hyper: AdamHyper,
    states: Vec<Option<ParamState>>,
}

impl Adam8bit {
    /// No state is allocated until a parameter's first step (PyTorch's lazy state).
    pub fn new(params: Vec<Tensor>, hyper: AdamHyper) -> Self {
        let states = params.iter().map(|_| None).collect();
        Self { params, hyper, states }
    }

    pub fn hyper(&self) -> &AdamHyper {
        &self.hyper
    }
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }
    /// Parameter `i`'s state, once it has had a step.
    pub fn state(&self, i: usize) -> Option<&ParamState> {
        self.states.get(i).and_then(Option::as_ref)
    }
    /// Bytes of optimizer state allocated.
    pub fn state_bytes(&self) -> i64 {
        self.states.iter().flatten().map(ParamState::bytes).sum()
    }

    /// One update of every parameter that has a gradient (others are skipped, as in PyTorch).
    ///
    /// f32 contiguous CPU parameters with f32 contiguous gradients are updated in place with no
    /// allocation; others (bf16 parameters, strided tensors) go through an f32 copy, one tensor
    /// at a time so the transient stays one tensor's size.
    pub fn step(&mut self) -> Result<(), KernelError> {
        const OP: &str = "8-bit Adam step";
        self.hyper.validate()?;
        let e = torch_err(OP);
        let _no_grad = tch::no_grad_guard();
        // Validate every parameter before touching any state, so an error leaves the optimizer
        // as it was. `todo` also keeps the gradients alive while jobs point into them.
        let mut todo: Vec<(usize, Tensor, Path)> = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            check_pair(p, &g)?;
            let path = match p.device() {
                Device::Cpu if is_f32_contiguous(p) && is_f32_contiguous(&g) => Path::Direct,
                Device::Cpu => Path::Staged,
                Device::Cuda(_) => Path::Cuda,
                other => {
                    return Err(KernelError::Invalid {
                        op: OP,
                        message: format!("parameter {i} is on {other:?}; 8-bit Adam runs on CPU and CUDA"),
                    })
                }
            };
            todo.push((i, g, path));
        }
        // Fake parameters (a step measured in fake mode) have no values: the state and the
        // staging copies are allocated as in a real step, and the update itself is skipped.
        let fake = self.params.iter().any(crate::fake::is_fake);
        if !fake {
            check_disjoint(
                todo.iter()
                    .filter(|(_, _, path)| *path == Path::Direct)
                    .flat_map(|(i, g, _)| [(&self.params[*i], true), (g, false)]),
            )?;
        }

        let mut direct: Vec<CpuJob> = Vec::new();
        let mut staged: Vec<(usize, StepScalars)> = Vec::new();
        for (i, g, path) in &todo {
            let p = &self.params[*i];
            let state = match &mut self.states[*i] {
                Some(s) => s,
                slot @ None => slot.insert(ParamState::zeros(p.numel() as i64, p.device())?),
            };
            state.step += 1;
            let s = StepScalars::new(&self.hyper, state.step);
            if p.numel() == 0 {
                continue;
            }
            match path {
                Path::Direct => direct.push(CpuJob::new(p, g, state, s)),
                Path::Staged => staged.push((*i, s)),
                Path::Cuda => {
                    let (pw, gw) = (f32_contiguous(p).map_err(&e)?, f32_contiguous(g).map_err(&e)?);
                    gpu_step(&pw, &gw, state, &s)?;
                    if pw.data_ptr() != p.data_ptr() {
                        p.shallow_clone().f_copy_(&pw).map_err(&e)?;
                    }
                }
            }
        }
        if !fake {
            run_cpu(&direct);
        }
        drop(direct);

        for (i, s) in staged {
            let (p, Some(state)) = (&self.params[i], self.states[i].as_ref()) else {
                continue;
            };
            // Fresh f32 copies (or `p` itself when only the gradient needed one): no aliasing,
            // and run one at a time, after the direct jobs, so nothing races.
            let (pw, gw) = (f32_contiguous(p).map_err(&e)?, f32_contiguous(&p.grad()).map_err(&e)?);
            if !fake {
                run_cpu(&[CpuJob::new(&pw, &gw, state, s)]);
            }
            if pw.data_ptr() != p.data_ptr() {
                p.shallow_clone().f_copy_(&pw).map_err(&e)?;
            }
        }
        Ok(())
    }
}

/// How a parameter is updated this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// In place on its f32 contiguous CPU buffer, with every other such parameter in one
    /// parallel pass.
    Direct,
    /// Through an f32 contiguous copy (bf16/f16 or strided CPU tensors).
    Staged,
    /// The CUDA kernel.
    Cuda,
}

fn is_f32_contiguous(t: &Tensor) -> bool {
    t.f_kind().ok() == Some(Kind::Float) && t.is_contiguous()
}

/// `t` as a contiguous f32 tensor: `t` itself when it already is one, else a copy.
fn f32_contiguous(t: &Tensor) -> Result<Tensor, tch::TchError> {
    t.f_to_kind(Kind::Float)?.f_contiguous()
}

fn check_pair(p: &Tensor, g: &Tensor) -> Result<(), KernelError> {
    const OP: &str = "8-bit Adam step";
    if p.numel() != g.numel() || p.device() != g.device() {
        return Err(KernelError::Invalid {
            op: OP,
            message: format!(
                "gradient {:?} on {:?} does not match its parameter {:?} on {:?}",
                g.size(),
                g.device(),
                p.size(),
                p.device()
            ),
        });
    }
    for (what, t) in [("parameter", p), ("gradient", g)] {
        match t.f_kind() {
            Ok(Kind::Float | Kind::BFloat16 | Kind::Half) => {}
            other => {
                return Err(KernelError::Invalid {
                    op: OP,
                    message: format!("{what} of dtype {other:?}; 8-bit Adam updates f32, bf16 and f16 tensors"),
                })
            }
        }
    }
    Ok(())
}
