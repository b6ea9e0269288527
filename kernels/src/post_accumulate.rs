//! Post-accumulate-grad hooks: what `Tensor.register_post_accumulate_grad_hook` gives Python,
//! for the optimizer step in backward (each parameter updated as soon as its gradient is
//! accumulated, inside the autograd engine, as torchtune's `optimizer_in_bwd` does).
//!
//! A parameter's hook carries only its index; what the hook does is the handler of the
//! innermost [`with_handler`] scope, so a hook holds no pointer into Rust and outlives nothing.

use std::sync::Mutex;

use tch::Tensor;

use crate::{ffi, KernelError};

/// What a hook runs: the parameter's index in, an error message out.
pub type Handler<'a> = dyn FnMut(usize) -> Result<(), String> + 'a;

/// The handler of the running scope (its lifetime erased; [`with_handler`] removes it before
/// the borrow ends) and the first error it returned.
struct Current {
    handler: Option<*mut Handler<'static>>,
    error: Option<String>,
}

// SAFETY: the pointer is only dereferenced while `with_handler`'s caller blocks in the scope,
// by the engine thread running that caller's backward; nothing else touches it.
unsafe impl Send for Current {}

static CURRENT: Mutex<Current> = Mutex::new(Current {
    handler: None,
    error: None,
});

extern "C" fn on_accumulated(index: i64) -> std::os::raw::c_int {
    let handler = CURRENT.lock().map(|c| c.handler).unwrap_or(None);
    let result = match handler {
        // SAFETY: set by `with_handler` for the duration of the scope this backward runs in.
        Some(h) => unsafe { (*h)(index as usize) },
        None => Err(format!(
            "parameter {index}'s gradient was accumulated outside an optimizer-in-backward step"
        )),
    };
    match result {
        Ok(()) => 0,
        Err(message) => {
            if let Ok(mut c) = CURRENT.lock() {
                c.error.get_or_insert(message);
            }
            1
        }
    }
}

/// Registers the hook of parameter `t` (a leaf that requires grad), reporting `index` to the
/// handler each time the engine accumulates into its `.grad`.
pub fn set_hook(t: &Tensor, index: usize) -> Result<(), KernelError> {
    let p = t.as_ptr() as ffi::CTensor;
    ffi::check("registering a post-accumulate-grad hook", |e| unsafe {
        ffi::ckpt_set_post_accumulate_hook(p, Some(on_accumulated), index as i64, e)
    })
}

/// Removes the hook of `t`.
pub fn clear_hook(t: &Tensor) -> Result<(), KernelError> {
    let p = t.as_ptr() as ffi::CTensor;
    ffi::check("removing a post-accumulate-grad hook", |e| unsafe {
        ffi::ckpt_set_post_accumulate_hook(p, None, 0, e)
    })
}

/// Runs `f` (which runs backward) with `handler` answering the hooks that fire meanwhile.
/// Returns `f`'s result, and the handler's first error if it failed (the engine then stopped
/// the backward, so `f`'s own result is an error naming only the hook).
pub fn with_handler<R>(handler: &mut Handler<'_>, f: impl FnOnce() -> R) -> (R, Option<String>) {
    struct Reset(Option<*mut Handler<'static>>);
    impl Drop for Reset {
        fn drop(&mut self) {
            if let Ok(mut c) = CURRENT.lock() {
                c.handler = self.0;
            }
        }
    }
    // SAFETY: only the lifetime is erased; `Reset` puts the previous handler back before
    // `handler`'s borrow ends, on every path out of this function.
    let erased: *mut Handler<'static> = unsafe { std::mem::transmute(handler as *mut Handler<'_>) };
    let previous = {
        let mut c = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
        c.error = None;
        c.handler.replace(erased)
    };
    let reset = Reset(previous);
    let out = f();
    drop(reset);
    let error = CURRENT.lock().ok().and_then(|mut c| c.error.take());
    (out, error)
}
