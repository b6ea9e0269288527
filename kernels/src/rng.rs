//! The default CPU generator's state, saved before a checkpointed block's forward and
//! restored before its recompute so that dropout draws the same mask bitwise (what
//! `torch.utils.checkpoint`'s `preserve_rng_state` does, holding the state as a tensor); and
//! held outside any tensor around ckptune's own draws in a step (a batch's values), which the
//! user's loop does not make.

use tch::Tensor;

use crate::{ffi, KernelError};

/// The CPU generator's state as a byte tensor.
pub fn cpu_state() -> Result<Tensor, KernelError> {
    let mut out: ffi::CTensor = std::ptr::null_mut();
    ffi::check("reading the CPU RNG state", |e| unsafe {
        ffi::ckpt_rng_get_state(&mut out, e)
    })?;
    Ok(ffi::from_raw(out))
}

/// Restores a state returned by [`cpu_state`].
pub fn set_cpu_state(state: &Tensor) -> Result<(), KernelError> {
    let p = state.as_ptr() as ffi::CTensor;
    ffi::check("restoring the CPU RNG state", |e| unsafe {
        ffi::ckpt_rng_set_state(p, e)
    })
}

/// The CPU generator's state held outside any tensor, so that taking it allocates no tensor
/// bytes: a step that draws its batch between [`CpuSnapshot::take`] and
/// [`CpuSnapshot::restore`] counts the batch alone, as the user's loop holds it (a state tensor
/// is 5,056 bytes, beyond a small model's whole step).
pub struct CpuSnapshot(*mut ffi::CRngSnapshot);

impl CpuSnapshot {
    pub fn take() -> Result<Self, KernelError> {
        let mut out = std::ptr::null_mut();
        ffi::check("reading the CPU RNG state", |e| unsafe {
            ffi::ckpt_rng_snapshot(&mut out, e)
        })?;
        Ok(CpuSnapshot(out))
    }

    /// Puts the generator back where [`CpuSnapshot::take`] found it.
    pub fn restore(self) -> Result<(), KernelError> {
        ffi::check("restoring the CPU RNG state", |e| unsafe {
            ffi::ckpt_rng_restore(self.0, e)
        })
    }
}

impl Drop for CpuSnapshot {
    fn drop(&mut self) {
        unsafe { ffi::ckpt_rng_snapshot_free(self.0) }
    }
}
