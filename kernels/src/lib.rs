//! ckptune's native code: a C++ shim over libtorch for what `tch` does not expose (an exact
//! CPU memory meter and its allocation log, autocast, backward with an explicit output gradient,
//! post-accumulate-grad hooks, block boundaries that hold no storage (gradient sinks), RNG state,
//! TorchScript children, a generic boxed call of any dispatcher operator and the wrapped numbers
//! its calls make), glibc's malloc keeping freed memory while real steps run, and behind the
//! `cuda` feature the CUDA allocator's statistics and device facts. This is the only crate of
//! the workspace with native code.

pub mod adam8bit;
pub mod alloc_log;
pub mod autocast;
pub mod autograd;
mod error;
pub mod fake;
mod ffi;
pub mod host_memory;
pub mod jit;
pub mod meter;
pub mod numbers;
pub mod ops;
pub mod optrace;
pub mod post_accumulate;
pub mod rng;
pub mod sac;
pub mod sink;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod nvrtc;

pub use error::KernelError;
pub use meter::MemoryMeter;
