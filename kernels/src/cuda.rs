//! CUDA device facts (through cudarc) and the CUDA caching allocator's statistics (through the
//! shim). Compiled with the `cuda` feature; on a machine without a GPU or without libcuda every
//! function returns an error that says so — cudarc would panic, so each call is guarded by
//! `is_culib_present()` first.

use std::ffi::{c_char, c_int};

use crate::{ffi, KernelError};

/// What a planner needs to know about a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFacts {
    pub ordinal: usize,
    pub name: String,
    pub total_bytes: u64,
}

/// CUDA caching-allocator statistics for one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct CudaMemory {
    pub allocated_current: i64,
    pub allocated_peak: i64,
    pub reserved_current: i64,
    pub reserved_peak: i64,
}

extern "C" {
    fn ckpt_cuda_device_count() -> c_int;
    fn ckpt_cuda_memory_stats(device: c_int, out: *mut CudaMemory, err: *mut *mut c_char) -> c_int;
    fn ckpt_cuda_reset_peak(device: c_int, err: *mut *mut c_char) -> c_int;
}

fn no_gpu(op: &'static str, why: &str) -> KernelError {
    KernelError::Cuda {
        op,
        message: format!("{why}; run on a machine with an NVIDIA GPU and driver, or use --device cpu"),
    }
}

/// Whether the CUDA driver library can be loaded at all.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Name and memory of GPU `ordinal`.
pub fn device_facts(ordinal: usize) -> Result<DeviceFacts, KernelError> {
    const OP: &str = "reading CUDA device facts";
    if !driver_present() {
        return Err(no_gpu(OP, "libcuda (the NVIDIA driver library) is not present"));
    }
    let count = cudarc::driver::CudaContext::device_count().map_err(|e| no_gpu(OP, &e.to_string()))?;
    if ordinal as i64 >= count as i64 {
        return Err(no_gpu(OP, &format!("GPU {ordinal} requested but {count} present")));
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| no_gpu(OP, &e.to_string()))?;
    let name = ctx.name().map_err(|e| no_gpu(OP, &e.to_string()))?;
    let total = ctx.total_mem().map_err(|e| no_gpu(OP, &e.to_string()))?;
    Ok(DeviceFacts {
        ordinal,
        name,
        total_bytes: total as u64,
    })
}

/// How many CUDA devices libtorch's CUDA runtime sees (an error when libcuda cannot be loaded).
pub fn device_count() -> Result<usize, KernelError> {
    if !driver_present() {
        return Err(no_gpu(
            "counting CUDA devices",
            "libcuda (the NVIDIA driver library) is not present",
        ));
    }
    // SAFETY: c10::cuda::device_count catches CUDA's errors and returns 0 for them.
    Ok(unsafe { ckpt_cuda_device_count() }.max(0) as usize)
}

fn check_device(op: &'static str, device: usize) -> Result<(), KernelError> {
    if !driver_present() {
        return Err(no_gpu(op, "libcuda (the NVIDIA driver library) is not present"));
    }
    let n = unsafe { ckpt_cuda_device_count() };
    if device as i64 >= n as i64 {
        return Err(no_gpu(op, &format!("GPU {device} requested but libtorch sees {n}")));
    }
    Ok(())
}

/// The caching allocator's allocated and reserved bytes (current and peak) on `device`.
pub fn memory(device: usize) -> Result<CudaMemory, KernelError> {
    const OP: &str = "reading CUDA allocator statistics";
    check_device(OP, device)?;
    let mut out = CudaMemory::default();
    ffi::check(OP, |e| unsafe { ckpt_cuda_memory_stats(device as c_int, &mut out, e) }).map_err(|e| {
        KernelError::Cuda {
            op: OP,
            message: e.to_string(),
        }
    })?;
    Ok(out)
}

/// Resets the allocated and reserved peaks of `device` to their current values.
pub fn reset_peak(device: usize) -> Result<(), KernelError> {
    const OP: &str = "resetting CUDA allocator peaks";
    check_device(OP, device)?;
    ffi::check(OP, |e| unsafe { ckpt_cuda_reset_peak(device as c_int, e) }).map_err(|e| KernelError::Cuda {
        op: OP,
        message: e.to_string(),
    })
}
