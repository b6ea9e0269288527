//! `--device`: `cpu`, `cuda`, or `auto` (the default: CUDA when one is visible, else the CPU,
//! said in the output). What "visible" takes: a build with the `cuda` feature (the default),
//! the NVIDIA driver library libcuda loading, and libtorch seeing a device through it.

use tch::Device;

use super::error::UsageError;

/// A resolved `--device`, and what `auto` chose and why (for the output).
pub struct ResolvedDevice {
    pub device: Device,
    pub note: Option<String>,
}

pub fn resolve(name: &str) -> Result<ResolvedDevice, UsageError> {
    match name {
        "cpu" => Ok(ResolvedDevice {
            device: Device::Cpu,
            note: None,
        }),
        "cuda" => match cuda_visible() {
            Ok(()) => Ok(ResolvedDevice {
                device: Device::Cuda(0),
                note: None,
            }),
            Err(why) => Err(UsageError(format!(
                "--device cuda: no CUDA device is visible: {why}; use --device cpu (or auto)"
            ))),
        },
        "auto" => Ok(match cuda_visible() {
            Ok(()) => ResolvedDevice {
                device: Device::Cuda(0),
                note: Some("--device auto: a CUDA device is visible, so the step is measured on cuda:0".into()),
            },
            Err(why) => ResolvedDevice {
                device: Device::Cpu,
                note: Some(format!(
                    "--device auto: no CUDA device is visible ({why}), so the step is measured on the CPU"
                )),
            },
        }),
        other => Err(UsageError(format!("--device {other:?}: expected auto, cpu or cuda"))),
    }
}

/// Whether a CUDA device can be used, else what was looked for and not found.
#[cfg(feature = "cuda")]
fn cuda_visible() -> Result<(), String> {
    if !ckptune_kernels::cuda::driver_present() {
        return Err("the NVIDIA driver library libcuda.so.1 could not be loaded".into());
    }
    match ckptune_kernels::cuda::device_count() {
        Ok(0) => Err("libcuda loaded, but libtorch's CUDA runtime sees no device (CUDA_VISIBLE_DEVICES?)".into()),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("libcuda loaded, but libtorch's CUDA runtime failed: {e}")),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_visible() -> Result<(), String> {
    Err("this ckptune was built without the `cuda` feature (cargo build --features cuda)".into())
}
