//! Backward with an explicit output gradient (a vector-Jacobian product), which tch lacks, and
//! a non-leaf alias of a leaf for in-place writes.

use tch::Tensor;

use crate::{ffi, KernelError};

/// Runs backward from `output` with `grad_output` as its gradient, accumulating into the
/// `.grad` of every leaf that requires grad (as `output.backward(grad_output)` in PyTorch).
///
/// Both tensors are consumed: the shim drops these handles before the graph runs, and the
/// gradient's last handle right after the first node consumed it, so neither is kept alive
/// longer than PyTorch's engine would keep it. (Keeping them referenced for a block's whole
/// backward cost 2 × the block's output size of peak in a prototype.)
pub fn backward(output: Tensor, grad_output: Tensor) -> Result<(), KernelError> {
    let out = ffi::into_raw(output);
    let grad = ffi::into_raw(grad_output);
    ffi::check("backward with an output gradient", |e| unsafe {
        ffi::ckpt_backward(out, grad, e)
    })
}

/// Sets a tensor's `.grad` to None (`zero_grad(set_to_none=True)`), freeing it if no one else
/// holds it. tch can only zero a gradient in place.
pub fn clear_grad(t: &Tensor) -> Result<(), KernelError> {
    let p = t.as_ptr() as ffi::CTensor;
    ffi::check("clearing a gradient", |e| unsafe { ffi::ckpt_clear_grad(p, e) })
}

/// A handle on `t` that an in-place operator may write: under grad mode, for a leaf that
/// requires grad, a non-leaf alias whose gradient flows unchanged into `t`'s `.grad`; otherwise
/// `t` itself. PyTorch refuses an in-place operator on a leaf that requires grad (or on a view
/// of one) but not on the previous layer's output, which is what a block's input leaf stands
/// for; a block that writes its input in place (`nn.ReLU(inplace=True)` first) writes this
/// alias instead. It shares `t`'s storage and version counter (a write bumps it, as a write of
/// the previous output does in PyTorch) and allocates nothing, in forward or backward.
pub fn writable_alias(t: &Tensor) -> Result<Tensor, KernelError> {
    let p = t.as_ptr() as ffi::CTensor;
    let mut out: ffi::CTensor = std::ptr::null_mut();
    ffi::check("making a writable alias of a block input", |e| unsafe {
        ffi::ckpt_writable_alias(p, &mut out, e)
    })?;
    Ok(ffi::from_raw(out))
}
