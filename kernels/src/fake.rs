//! Fake mode (`csrc/fake.cpp`): a step run with every tensor a fake CPU tensor — a meta tensor
//! that reports the CPU as its device — so that the models, autograd, autocast and the runtime
//! run as on the CPU while nothing computes and no memory is touched. Storages come from the
//! meta allocator slot, where the meter counts them ([`crate::meter`]): the meter reads a fake
//! step's bytes as it reads a real one's.
//!
//! Everything created on the CPU while a [`FakeMode`] is alive on the thread is fake: parameters,
//! batches, activations, gradients, optimizer state. Values are not: an operator whose result
//! depends on a fake tensor's values (`.item()`, `nonzero`) fails, saying so. Real tensors stay
//! real and compute ([`real`] makes them).

use std::marker::PhantomData;

use tch::Tensor;

use crate::{ffi, meter, KernelError};

/// Fake mode on this thread while alive (not `Send`: the mode is per thread).
#[derive(Debug)]
pub struct FakeMode {
    _thread: PhantomData<*const ()>,
    cuda_reductions: bool,
}

/// What decides how CUDA's reductions split their work across thread blocks, and so the
/// staging buffer they allocate (`csrc/cuda_reductions.cpp`): the GPU's multiprocessor count
/// and the threads one multiprocessor holds (`cudaDeviceProp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuGeometry {
    pub multiprocessors: u32,
    pub threads_per_multiprocessor: u32,
}

impl FakeMode {
    /// Turns fake mode on, with the meter installed in the CPU and meta allocator slots.
    pub fn enter() -> Result<FakeMode, KernelError> {
        Self::enter_for(None)
    }

    /// Fake mode for a step traced as `gpu` runs it (`None`: as the CPU does): each `sum` and
    /// `mean` that CUDA splits across thread blocks allocates and frees, as it ends, the staging
    /// buffer and semaphores it takes there. Process-wide while the mode is alive.
    pub fn enter_for(gpu: Option<GpuGeometry>) -> Result<FakeMode, KernelError> {
        meter::install()?;
        ffi::check("installing the meta memory meter", |e| unsafe {
            ffi::ckpt_meter_install_meta(e)
        })?;
        ffi::check("entering fake mode", |e| unsafe { ffi::ckpt_fake_enter(e) })?;
        let mode = FakeMode {
            _thread: PhantomData,
            cuda_reductions: gpu.is_some(),
        };
        if let Some(g) = gpu {
            set_cuda_reductions(g.multiprocessors as i32, g.threads_per_multiprocessor as i32)?;
        }
        Ok(mode)
    }
}

fn set_cuda_reductions(multiprocessors: i32, threads: i32) -> Result<(), KernelError> {
    ffi::check("setting the GPU of fake mode's reductions", |e| unsafe {
        ffi::ckpt_fake_set_cuda_reductions(multiprocessors, threads, e)
    })
}

impl Drop for FakeMode {
    fn drop(&mut self) {
        if self.cuda_reductions {
            // Removing a callback cannot fail once adding it did; a failure would only leave
            // reductions observed, which checks that fake mode is on before anything else.
            let _ = set_cuda_reductions(0, 0);
        }
        unsafe { ffi::ckpt_fake_exit() }
    }
}

/// Real tensors while alive, in fake mode or not: what is created meanwhile is real (an
/// optimizer's step count, which lives on the host and whose value the step reads).
#[derive(Debug)]
pub struct Real {
    _thread: PhantomData<*const ()>,
}

/// Suspends fake mode on this thread until the guard is dropped.
pub fn real() -> Result<Real, KernelError> {
    ffi::check("suspending fake mode", |e| unsafe { ffi::ckpt_fake_suspend(e) })?;
    Ok(Real { _thread: PhantomData })
}

impl Drop for Real {
    fn drop(&mut self) {
        unsafe { ffi::ckpt_fake_resume() }
    }
}

/// Whether fake mode is on for this thread.
pub fn active() -> bool {
    unsafe { ffi::ckpt_fake_active() != 0 }
}

/// Whether `t` is a fake tensor (it has no values).
pub fn is_fake(t: &Tensor) -> bool {
    // SAFETY: the handle is valid for the call; the shim only reads the tensor's keys.
    unsafe { ffi::ckpt_is_fake(t.as_ptr() as ffi::CTensor) != 0 }
}

/// Whether `a` and `b` are one tensor (handles of the same TensorImpl, as a var store's
/// shallow clones are). Data pointers cannot tell fake tensors apart: their storages have none.
pub fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    // SAFETY: both handles are valid for the call; the shim only compares their impls.
    unsafe { ffi::ckpt_same_tensor(a.as_ptr() as ffi::CTensor, b.as_ptr() as ffi::CTensor) != 0 }
}

/// Teaches fake mode what the CPU's kernels allocate beyond the meta kernels (oneDNN's scratch),
/// as [`crate::optrace::learned_scratch`] finds it in a real step: each call the step makes
/// whose operator and inputs match a key holds that many bytes more, for a moment, as it ends.
/// An empty list forgets it. Process-wide.
pub fn set_scratch(table: &[(String, i64)]) -> Result<(), KernelError> {
    let keys: Vec<std::ffi::CString> = table
        .iter()
        .map(|(k, _)| std::ffi::CString::new(k.as_str()).unwrap_or_default())
        .collect();
    let ptrs: Vec<*const std::ffi::c_char> = keys.iter().map(|k| k.as_ptr()).collect();
    let bytes: Vec<i64> = table.iter().map(|(_, b)| *b).collect();
    ffi::check("setting fake mode's learned scratch", |e| unsafe {
        ffi::ckpt_fake_set_scratch(ptrs.as_ptr(), bytes.as_ptr(), table.len() as i64, e)
    })
}

/// Why fake mode cannot run an operator, from the operator's error: its result depends on
/// tensor values (the fallback's refusal of `.item()`, `nonzero`), or libtorch has no meta
/// kernel for it (its `metaFallback`, or no kernel for the Meta key at all). The line of the
/// error that says so, naming the operator, without what libtorch adds for writers of custom
/// operators (registering a fake impl for torch.compile); `None` for any other error. A model
/// with such an operator can be measured only by running it.
pub fn meta_failure(message: &str) -> Option<String> {
    const SIGNS: [&str; 4] = [
        "which a step measured on the meta device does not have",
        "attempted to run this operator with Meta tensors",
        "with arguments from the 'Meta' backend",
        // A kernel that read a fake tensor's data, which it has none of (SigLIP's
        // `repeat` of its probe parameter reached the CPU's kernel).
        "but its data is not allocated yet",
    ];
    let line = message.lines().find(|l| SIGNS.iter().any(|s| l.contains(s)))?;
    // From the operator's name on (`aten::mode: attempted …`, `Could not run 'aten::x' …`), as
    // callers prefix their own context.
    let from = ["aten::", "Could not run"]
        .iter()
        .filter_map(|p| line.find(p))
        .min()
        .unwrap_or(0);
    let line = &line[from..];
    let end = line.find(". You may have run into this message").unwrap_or(line.len());
    Some(line[..end].trim_end_matches('.').to_owned())
}

#[cfg(test)]
mod tests {
    use super::meta_failure;

    #[test]
    fn meta_failures_are_told_from_other_errors() {
        let no_kernel = "Could not run 'aten::mode' with arguments from the 'Meta' backend. This could be because";
        assert_eq!(
            meta_failure(&format!("node mode_1: {no_kernel}")).as_deref(),
            Some(no_kernel),
            "from the operator's name on"
        );
        let no_data = "calling an operator: The tensor has a non-zero number of elements, but its data is not \
                       allocated yet.\nIf you're using torch.compile/export/fx, it is likely that";
        assert_eq!(
            meta_failure(no_data).as_deref(),
            Some(
                "calling an operator: The tensor has a non-zero number of elements, but its data is not allocated yet"
            )
        );
        assert_eq!(meta_failure("shape '[2, 3]' is invalid for input of size 5"), None);
    }
}
