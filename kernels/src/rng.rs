//! The default CPU generator's state, saved before a checkpointed block's forward and
//! restored before its recompute so that dropout draws the same mask bitwise (what
//! `torch.utils.checkpoint`'s `preserve_rng_state` does).

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
