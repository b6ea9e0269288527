//! Raw declarations of the shim's C entry points (csrc/*.cpp) and the error plumbing.

use std::ffi::{c_char, c_int, c_void, CStr};

use tch::{TchError, Tensor};

use crate::KernelError;

/// `at::Tensor*`, as tch allocates tensor handles.
pub(crate) type CTensor = *mut torch_sys::C_tensor;
/// `torch::jit::Module*`.
#[repr(C)]
pub(crate) struct CModule {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct AutocastState {
    pub enabled: c_int,
    pub dtype: c_int,
    pub cache_enabled: c_int,
}

/// A block input's gradient sink (`CkptSink`, shim.cpp).
#[repr(C)]
pub(crate) struct CSink {
    _private: [u8; 0],
}

/// A block output's gradient edge (`OutputEdge`, shim.cpp).
#[repr(C)]
pub(crate) struct COutputEdge {
    _private: [u8; 0],
}

/// The CPU generator's state outside any tensor (`CkptRngSnapshot`, shim.cpp).
#[repr(C)]
pub(crate) struct CRngSnapshot {
    _private: [u8; 0],
}

/// A selective block's cache of saved outputs (`CkptSacCache`, sac.cpp).
#[repr(C)]
pub(crate) struct CSacCache {
    _private: [u8; 0],
}

pub(crate) type NamedModuleCb = extern "C" fn(*mut c_void, *const c_char, *mut CModule);
pub(crate) type NamedTensorCb = extern "C" fn(*mut c_void, *const c_char, CTensor);
/// (ctx, name, scope, depth, end, enter, exit, peak, nanos, inputs, their length, outputs, their
/// length, numbers, their length); see optrace.cpp.
pub(crate) type OpEventCb = extern "C" fn(
    *mut c_void,
    *const c_char,
    i32,
    i32,
    i64,
    i64,
    i64,
    i64,
    i64,
    *const i64,
    i64,
    *const i64,
    i64,
    *const i64,
    i64,
);
/// (ctx, return index, list item or -1, tag, tensor, int, float); see shim.cpp's ckpt_value_cb.
pub(crate) type ValueCb = extern "C" fn(*mut c_void, i32, i32, i32, CTensor, i64, f64);
/// (ctx, saved (0 or 1) or -1 for a kept number, the kept number); see shim.cpp's ckpt_number_cb.
pub(crate) type NumberCb = extern "C" fn(*mut c_void, c_int, CTensor);

extern "C" {
    pub(crate) fn ckpt_free_str(s: *mut c_char);

    pub(crate) fn ckpt_meter_install(err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_meter_current() -> i64;
    pub(crate) fn ckpt_meter_peak() -> i64;
    pub(crate) fn ckpt_meter_allocs() -> i64;
    pub(crate) fn ckpt_meter_backward_start() -> i64;
    pub(crate) fn ckpt_meter_reset_peak();
    pub(crate) fn ckpt_meter_window_peak() -> i64;
    pub(crate) fn ckpt_meter_reset_window();
    pub(crate) fn ckpt_meter_install_meta(err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_meter_log_start();
    pub(crate) fn ckpt_meter_log_stop();
    pub(crate) fn ckpt_meter_log_len() -> i64;
    pub(crate) fn ckpt_meter_log_read(from: i64, cap: i64, bytes: *mut i64, keys: *mut u64) -> i64;

    pub(crate) fn ckpt_sac_record(policy: c_int, out: *mut *mut CSacCache, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_sac_replay(cache: *mut CSacCache, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_sac_stop();
    pub(crate) fn ckpt_sac_left(cache: *const CSacCache) -> i64;
    pub(crate) fn ckpt_sac_free(cache: *mut CSacCache);
    pub(crate) fn ckpt_sac_saves(policy: c_int, name: *const c_char) -> c_int;
    pub(crate) fn ckpt_fake_enter(err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_fake_exit();
    pub(crate) fn ckpt_fake_active() -> c_int;
    pub(crate) fn ckpt_fake_suspend(err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_fake_resume();
    pub(crate) fn ckpt_fake_set_scratch(
        keys: *const *const c_char,
        bytes: *const i64,
        n: i64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_fake_set_cuda_reductions(
        multiprocessors: c_int,
        threads_per_multiprocessor: c_int,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_is_fake(t: CTensor) -> c_int;
    pub(crate) fn ckpt_same_tensor(a: CTensor, b: CTensor) -> c_int;

    pub(crate) fn ckpt_optrace_start(err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_optrace_stop(ctx: *mut c_void, cb: OpEventCb, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_op_has_meta_kernel(name: *const c_char) -> c_int;
    pub(crate) fn ckpt_op_traits(name: *const c_char) -> c_int;
    pub(crate) fn ckpt_scope_enter(name: *const c_char, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_scope_exit();

    pub(crate) fn ckpt_autocast_enter(
        device: c_int,
        dtype: c_int,
        enabled: c_int,
        prev: *mut AutocastState,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_autocast_exit(device: c_int, prev: *const AutocastState, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_autocast_is_enabled(device: c_int) -> c_int;
    pub(crate) fn ckpt_autocast_dtype(device: c_int) -> c_int;
    pub(crate) fn ckpt_autocast_clear_cache();

    pub(crate) fn ckpt_backward(out: CTensor, grad: CTensor, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_clear_grad(t: CTensor, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_set_post_accumulate_hook(
        t: CTensor,
        cb: Option<extern "C" fn(i64) -> c_int>,
        index: i64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_writable_alias(t: CTensor, out: *mut CTensor, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_sink_alias(t: CTensor, out: *mut CTensor, sink: *mut *mut CSink, err: *mut *mut c_char)
        -> c_int;
    pub(crate) fn ckpt_sink_reader(sink: *mut CSink, t: CTensor, out: *mut CTensor, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_sink_take_grad(sink: *mut CSink, out: *mut CTensor, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_sink_free(sink: *mut CSink);
    pub(crate) fn ckpt_output_edge(out: CTensor, edge: *mut *mut COutputEdge, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_output_edge_free(edge: *mut COutputEdge);
    pub(crate) fn ckpt_storage_holders(t: CTensor) -> i64;
    pub(crate) fn ckpt_backward_edges(
        edges: *const *mut COutputEdge,
        grads: *const CTensor,
        n: i64,
        sinks: *const *mut CSink,
        m: i64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_rng_get_state(out: *mut CTensor, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_rng_set_state(state: CTensor, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_rng_snapshot(out: *mut *mut CRngSnapshot, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_rng_restore(snap: *const CRngSnapshot, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_rng_snapshot_free(snap: *mut CRngSnapshot);

    pub(crate) fn ckpt_jit_load(path: *const c_char, out: *mut *mut CModule, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_jit_free(m: *mut CModule);
    pub(crate) fn ckpt_jit_named_children(
        m: *mut CModule,
        ctx: *mut c_void,
        cb: NamedModuleCb,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_jit_type_name(m: *mut CModule, out: *mut *mut c_char, err: *mut *mut c_char) -> c_int;
    pub(crate) fn ckpt_jit_named_parameters(
        m: *mut CModule,
        buffers: c_int,
        ctx: *mut c_void,
        cb: NamedTensorCb,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_jit_forward(
        m: *mut CModule,
        inputs: *const CTensor,
        n: c_int,
        out: *mut CTensor,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_jit_train(m: *mut CModule, on: c_int, err: *mut *mut c_char) -> c_int;

    pub(crate) fn ckpt_op_schema(
        name: *const c_char,
        overload: *const c_char,
        out: *mut *mut c_char,
        err: *mut *mut c_char,
    ) -> c_int;
    /// `args` points at `nargs` `CkptArg` structs (ops.rs's `CArg`).
    pub(crate) fn ckpt_op_call(
        name: *const c_char,
        overload: *const c_char,
        args: *const c_void,
        nargs: c_int,
        ctx: *mut c_void,
        cb: ValueCb,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_numbers_begin(
        grad: c_int,
        saved: *const u8,
        n: i64,
        learned: c_int,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn ckpt_numbers_end(ctx: *mut c_void, cb: Option<NumberCb>);
}

/// Takes a malloc'd C string from the shim and frees it.
pub(crate) fn take_str(s: *mut c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: the shim hands out NUL-terminated strings from malloc, freed exactly once here.
    let out = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    unsafe { ckpt_free_str(s) };
    out
}

/// Runs a shim call that reports failure through `err`, mapping it to a [`KernelError`].
pub(crate) fn check(op: &'static str, f: impl FnOnce(*mut *mut c_char) -> c_int) -> Result<(), KernelError> {
    let mut err: *mut c_char = std::ptr::null_mut();
    if f(&mut err) == 0 {
        Ok(())
    } else {
        Err(KernelError::Torch {
            op,
            message: first_line(&take_str(err)),
        })
    }
}

/// libtorch messages carry a C++ backtrace after the first lines; keep what a person reads.
pub(crate) fn first_line(msg: &str) -> String {
    let cut = msg.find("\nException raised from").unwrap_or(msg.len());
    msg[..cut].trim().to_owned()
}

/// Hands a tensor's handle to the shim, which takes ownership and deletes it.
pub(crate) fn into_raw(t: Tensor) -> CTensor {
    let mut t = t;
    let p = t.as_mut_ptr();
    std::mem::forget(t);
    p
}

/// Wraps a handle the shim allocated with `new at::Tensor`.
pub(crate) fn from_raw(p: CTensor) -> Tensor {
    // SAFETY: the shim returns a fresh heap `at::Tensor*`, which tch owns from here on.
    unsafe { Tensor::from_ptr(p) }
}

impl From<KernelError> for TchError {
    fn from(e: KernelError) -> Self {
        TchError::Torch(e.to_string())
    }
}
