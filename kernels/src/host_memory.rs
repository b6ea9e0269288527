//! Freed host memory kept by the process while real CPU steps run, so that a step reuses the
//! pages the step before it touched instead of faulting fresh ones in.
//!
//! glibc's malloc serves an allocation of 32 MiB or more (less, early in a process) with its own
//! `mmap` and unmaps it on free, and returns its heap's top to the kernel once enough of it is
//! free. A training step frees what it allocated, so every step then pays the kernel to map and
//! zero its large tensors again: half a million minor faults and up to a third of GPT-2's step
//! (batch 8) on the machines of `results/cost/`, at a price the host sets and that varies run to
//! run (docs/cost-model.md, "Freed memory"). A GPU never pays it: the CUDA caching allocator
//! keeps what a step frees. So while a [`HostMemoryHold`] lives, malloc takes everything from its
//! heap (`M_MMAP_MAX` 0) and never trims it (`M_TRIM_THRESHOLD` -1, which mallopt(3) documents
//! as off), which is what jemalloc or tcmalloc do for a PyTorch loop that preloads them. The
//! Python harness sets the same two parameters (python/ckptune_harness/host_memory.py), so its
//! steps are timed like the runtime's.
//!
//! The counted bytes are the tensors' own (`meter`), so this changes no memory figure, only the
//! time the kernel spends. When the last hold ends, what is free is returned (`malloc_trim`); the
//! two parameters stay set for the rest of the process (glibc cannot restore its dynamic
//! thresholds), which only means the heap is returned when the next hold ends, not before.

use std::sync::Mutex;

/// How many holds are alive.
static HOLDS: Mutex<usize> = Mutex::new(0);

/// While alive, freed host memory stays with the process. Holds nest; see the module's doc.
#[must_use = "freed memory is kept only while the hold lives"]
pub struct HostMemoryHold(());

impl HostMemoryHold {
    /// Keeps freed memory from now until the last hold is dropped.
    pub fn new() -> HostMemoryHold {
        let mut holds = HOLDS.lock().unwrap_or_else(|p| p.into_inner());
        if *holds == 0 {
            glibc::keep_freed();
        }
        *holds += 1;
        HostMemoryHold(())
    }

    /// Whether a hold is alive.
    pub fn held() -> bool {
        *HOLDS.lock().unwrap_or_else(|p| p.into_inner()) > 0
    }

    /// Whether this process's allocator can keep freed memory (glibc's can; on other C
    /// libraries a hold does nothing).
    pub fn supported() -> bool {
        glibc::SUPPORTED
    }
}

impl Default for HostMemoryHold {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for HostMemoryHold {
    fn drop(&mut self) {
        let mut holds = HOLDS.lock().unwrap_or_else(|p| p.into_inner());
        *holds -= 1;
        if *holds == 0 {
            glibc::return_free();
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use std::os::raw::c_int;

    pub const SUPPORTED: bool = true;

    // malloc.h's parameter numbers.
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_MMAP_MAX: c_int = -4;

    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
        fn malloc_trim(pad: usize) -> c_int;
    }

    pub fn keep_freed() {
        // Both are valid values, so mallopt cannot refuse them.
        // SAFETY: mallopt only sets malloc's parameters, under malloc's own lock.
        unsafe {
            mallopt(M_MMAP_MAX, 0);
            mallopt(M_TRIM_THRESHOLD, -1);
        }
    }

    pub fn return_free() {
        // SAFETY: malloc_trim returns free heap pages to the kernel, under malloc's own lock.
        unsafe {
            malloc_trim(0);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod glibc {
    pub const SUPPORTED: bool = false;
    pub fn keep_freed() {}
    pub fn return_free() {}
}
