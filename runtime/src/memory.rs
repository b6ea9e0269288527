//! Memory probes for a step, by device: the exact CPU meter, or (feature `cuda`) the CUDA
//! caching allocator's allocated bytes, with its reserved bytes beside them (`memory_stats()`'s
//! `allocated_bytes.all` and `reserved_bytes.all`). Both give a current level, a whole-step peak
//! and a resettable window peak; reading them allocates no tensor memory.

use std::cell::Cell;

use ckptune_kernels::meter;
use tch::Device;

use crate::error::{Result, RuntimeError};

/// Reads the memory of one device.
#[derive(Debug)]
pub struct Probe {
    device: Device,
    /// CUDA has one resettable peak; windows reset it, so the step's peak is the largest of
    /// the windows' peaks and the one still running. (Unused on CPU, whose meter has both.)
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    step_peak: Cell<i64>,
    /// The same for the reserved bytes, which the windows' resets restart too.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    step_reserved: Cell<i64>,
}

impl Probe {
    pub fn new(device: Device) -> Result<Self> {
        match device {
            Device::Cpu => {
                meter::install()?;
            }
            Device::Cuda(_) => {
                #[cfg(not(feature = "cuda"))]
                return Err(RuntimeError::Config(
                    "this ckptune was built without the `cuda` feature, so it cannot measure CUDA memory; \
                     rebuild with `cargo build --release -p ckptune --features cuda`"
                        .into(),
                ));
            }
            other => {
                return Err(RuntimeError::Config(format!(
                    "device {other:?} is not supported (cpu or cuda)"
                )));
            }
        }
        Ok(Self {
            device,
            step_peak: Cell::new(0),
            step_reserved: Cell::new(0),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self) -> ckptune_kernels::cuda::CudaMemory {
        let Device::Cuda(i) = self.device else {
            unreachable!("CUDA probe on {:?}", self.device)
        };
        // The device was checked when the session was made; a failure now means the driver
        // went away, and zeros would silently corrupt a profile.
        ckptune_kernels::cuda::memory(i).unwrap_or_else(|e| panic!("reading CUDA memory: {e}"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_reset(&self) {
        let Device::Cuda(i) = self.device else { return };
        ckptune_kernels::cuda::reset_peak(i).unwrap_or_else(|e| panic!("resetting CUDA peak: {e}"));
    }

    /// Bytes alive now.
    pub fn current(&self) -> i64 {
        match self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => self.cuda().allocated_current,
            _ => meter::current(),
        }
    }

    /// Starts a step: the step peak restarts from the current level.
    pub fn reset_step(&self) {
        match self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                self.cuda_reset();
                let now = self.cuda();
                self.step_peak.set(now.allocated_current);
                self.step_reserved.set(now.reserved_current);
            }
            _ => meter::reset_peak(),
        }
    }

    /// Highest level since [`Probe::reset_step`].
    pub fn step_peak(&self) -> i64 {
        match self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => self.step_peak.get().max(self.cuda().allocated_peak),
            _ => meter::peak(),
        }
    }

    /// CUDA: the caching allocator's highest reserved bytes since [`Probe::reset_step`] (what
    /// `torch.cuda.max_memory_reserved()` reports); `None` on the CPU, which reserves nothing
    /// beyond its tensors.
    pub fn step_reserved_peak(&self) -> Option<i64> {
        match self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Some(self.step_reserved.get().max(self.cuda().reserved_peak)),
            _ => None,
        }
    }

    /// Starts a window: its peak restarts from the current level.
    pub fn reset_window(&self) {
        match self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let seen = self.cuda();
                self.step_peak.set(self.step_peak.get().max(seen.allocated_peak));
                self.step_reserved.set(self.step_reserved.get().max(seen.reserved_peak));
                self.cuda_reset();
            }
            _ => meter::reset_window(),
        }
    }

    /// Highest level since [`Probe::reset_window`].
    /// The level when the latest block backward had let go of its output, before the engine
    /// ran (CPU only: the CUDA probe does not see inside the call).
    pub fn backward_start(&self) -> Option<i64> {
        match self.device {
            Device::Cpu => Some(meter::backward_start()),
            _ => None,
        }
    }

    pub fn window_peak(&self) -> i64 {
        match self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => self.cuda().allocated_peak,
            _ => meter::window_peak(),
        }
    }
}
