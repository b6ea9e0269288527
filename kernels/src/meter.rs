//! Exact CPU tensor memory: a counting allocator installed in libtorch's CPU allocator slot.
//!
//! Every CPU tensor allocation (and oneDNN's raw allocations) goes through it, so `current`
//! is the exact number of tensor bytes alive, `peak` the high-water mark since the last reset,
//! and a second resettable "window" peak lets a profiler bracket one moment of a step without
//! disturbing the overall peak. Reading the counters allocates nothing, so an instrumented
//! step allocates exactly what a plain step does.
//!
//! The counters are process-wide: code that measures must not run concurrently with other
//! code that allocates tensors. [`exclusive`] serializes such sections within a process (tests
//! take it).

use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::{ffi, KernelError};

static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
static EXCLUSIVE: Mutex<()> = Mutex::new(());

/// Installs the counting allocator (idempotent). Tensors allocated before this call are not
/// counted, before or after they are freed.
pub fn install() -> Result<(), KernelError> {
    INSTALLED
        .get_or_init(|| {
            ffi::check("installing the CPU memory meter", |e| unsafe {
                ffi::ckpt_meter_install(e)
            })
            .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|message| KernelError::Torch {
            op: "installing the CPU memory meter",
            message,
        })
}

/// Holds the process-wide right to measure: no other holder runs meanwhile. Poisoning is
/// ignored, since a panicking test must not fail every later test.
pub fn exclusive() -> MutexGuard<'static, ()> {
    EXCLUSIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes of CPU tensor memory alive now.
pub fn current() -> i64 {
    unsafe { ffi::ckpt_meter_current() }
}
/// The level when the latest [`crate::autograd::backward`] (or its seeded form) had let go of
/// its output tensor, before any backward node ran: what a hook at the start of that backward
/// sees. The output is freed there unless its own graph saved it.
pub fn backward_start() -> i64 {
    unsafe { ffi::ckpt_meter_backward_start() }
}
/// Highest `current` since the last [`reset_peak`].
pub fn peak() -> i64 {
    unsafe { ffi::ckpt_meter_peak() }
}
/// Sets the peak to the current level.
pub fn reset_peak() {
    unsafe { ffi::ckpt_meter_reset_peak() }
}
/// Highest `current` since the last [`reset_window`]; independent of [`peak`].
pub fn window_peak() -> i64 {
    unsafe { ffi::ckpt_meter_window_peak() }
}
/// Sets the window peak to the current level.
pub fn reset_window() {
    unsafe { ffi::ckpt_meter_reset_window() }
}
/// Number of allocations counted so far (to check that a code path allocates nothing).
pub fn allocations() -> i64 {
    unsafe { ffi::ckpt_meter_allocs() }
}

/// A scoped measurement: holds [`exclusive`] for its lifetime.
pub struct MemoryMeter {
    _guard: MutexGuard<'static, ()>,
}

/// What a closure did to CPU tensor memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// Level before the closure ran.
    pub before: i64,
    /// Level after it returned (its result still alive).
    pub after: i64,
    /// Highest level while it ran.
    pub peak: i64,
}

impl Measured {
    /// Bytes the closure left allocated (its result included).
    pub fn kept(&self) -> i64 {
        self.after - self.before
    }
    /// Highest level above the starting level.
    pub fn peak_above_start(&self) -> i64 {
        self.peak - self.before
    }
}

impl MemoryMeter {
    /// Installs the meter if needed and takes the process-wide measurement lock.
    pub fn new() -> Result<Self, KernelError> {
        let guard = exclusive();
        install()?;
        Ok(Self { _guard: guard })
    }

    /// Runs `f`, returning its result and the memory it used. Uses the window peak, so the
    /// overall peak keeps counting across measurements.
    pub fn measure<T>(&self, f: impl FnOnce() -> T) -> (T, Measured) {
        let before = current();
        reset_window();
        let out = f();
        let m = Measured {
            before,
            after: current(),
            peak: window_peak(),
        };
        (out, m)
    }
}
