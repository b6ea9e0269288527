//! Mixed-precision autocast regions as scoped guards (tch has none for CPU).
//!
//! Mirrors `torch.autocast.__enter__/__exit__`: the previous enabled flag, dtype and cache
//! setting are restored on drop, nesting is counted, and the cache of low-precision weight
//! casts is cleared when the outermost region closes (that cache is memory the planner sees:
//! the casts live until then).

use tch::{Device, Kind};

use crate::{ffi, KernelError};

/// An open autocast region; closes on drop.
#[derive(Debug)]
pub struct AutocastGuard {
    device: i32,
    prev: ffi::AutocastState,
}

fn device_code(device: Device) -> Result<i32, KernelError> {
    match device {
        Device::Cpu => Ok(0),
        Device::Cuda(_) => Ok(1),
        other => Err(KernelError::Torch {
            op: "autocast",
            message: format!("device {other:?} is not supported (cpu or cuda)"),
        }),
    }
}

fn kind_code(kind: Kind) -> Result<i32, KernelError> {
    // c10::ScalarType values.
    match kind {
        Kind::BFloat16 => Ok(15),
        Kind::Half => Ok(5),
        Kind::Float => Ok(6),
        other => Err(KernelError::Torch {
            op: "autocast",
            message: format!("dtype {other:?} is not an autocast dtype (bf16 or f16)"),
        }),
    }
}

impl AutocastGuard {
    /// Opens a region in which eligible ops on `device` run in `dtype` (`enabled = false`
    /// opens a region that disables autocast, as `torch.autocast(enabled=False)`).
    pub fn new(device: Device, dtype: Kind, enabled: bool) -> Result<Self, KernelError> {
        let device = device_code(device)?;
        let dtype = kind_code(dtype)?;
        let mut prev = ffi::AutocastState::default();
        ffi::check("entering autocast", |e| unsafe {
            ffi::ckpt_autocast_enter(device, dtype, enabled as i32, &mut prev, e)
        })?;
        Ok(Self { device, prev })
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // Restoring plain thread-local flags cannot fail in practice; a failure here would
        // leave autocast on for the thread, so make it loud rather than silent.
        if let Err(e) = ffi::check("leaving autocast", |e| unsafe {
            ffi::ckpt_autocast_exit(self.device, &self.prev, e)
        }) {
            panic!("{e}");
        }
    }
}

/// Whether autocast is on for `device` in this thread.
pub fn is_enabled(device: Device) -> bool {
    device_code(device)
        .map(|d| unsafe { ffi::ckpt_autocast_is_enabled(d) } != 0)
        .unwrap_or(false)
}

/// The autocast dtype currently set for `device` (as a c10::ScalarType code mapped to Kind).
pub fn dtype(device: Device) -> Option<Kind> {
    let code = unsafe { ffi::ckpt_autocast_dtype(device_code(device).ok()?) };
    match code {
        15 => Some(Kind::BFloat16),
        5 => Some(Kind::Half),
        6 => Some(Kind::Float),
        _ => None,
    }
}

/// Drops the cached low-precision weight casts now.
pub fn clear_cache() {
    unsafe { ffi::ckpt_autocast_clear_cache() }
}
