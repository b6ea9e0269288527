//! Block boundaries without leaves: a block's input is a non-leaf alias of the previous
//! block's output whose gradient flows into a [`GradSink`], and a block's backward starts from
//! its output's [`OutputEdge`], so neither end holds the boundary's storage. It lives as long
//! as PyTorch keeps the previous layer's output: while a reader's graph saved it (or the
//! runtime keeps it for a recompute). A leaf would hold it until backward (its `AccumulateGrad`
//! holds the leaf), and autocast would cache one cast of it for all its readers.

use tch::Tensor;

use crate::{ffi, KernelError};

/// Where every reader's gradient of one boundary accumulates, in the order one fused graph
/// sums them (see [`backward_edges`]). Holds no tensor of the forward.
pub struct GradSink {
    raw: *mut ffi::CSink,
}

impl GradSink {
    /// One more reader's alias of `t`, the tensor this sink's first alias was made of (same
    /// shape and dtype, checked), its gradient flowing here too. Each reader holds its own
    /// alias, so the storage goes with the last handle on it.
    pub fn alias(&self, t: &Tensor) -> Result<Tensor, KernelError> {
        let p = t.as_ptr() as ffi::CTensor;
        let mut out: ffi::CTensor = std::ptr::null_mut();
        ffi::check("making one more reader of a block input", |e| unsafe {
            ffi::ckpt_sink_reader(self.raw, p, &mut out, e)
        })?;
        Ok(ffi::from_raw(out))
    }

    /// The gradient the readers' backward left here (undefined if none did), taken off.
    pub fn take_grad(&self) -> Result<Tensor, KernelError> {
        let mut out: ffi::CTensor = std::ptr::null_mut();
        ffi::check("taking a boundary's gradient", |e| unsafe {
            ffi::ckpt_sink_take_grad(self.raw, &mut out, e)
        })?;
        Ok(ffi::from_raw(out))
    }
}

impl Drop for GradSink {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `ckpt_sink_alias` and is freed once, here.
        unsafe { ffi::ckpt_sink_free(self.raw) }
    }
}

/// A reader's view of `t`: a detached alias (same storage and version counter, no view) that
/// is not a leaf, its gradient flowing into the returned sink. Autocast casts it once per
/// operator, an in-place operator may write it, and the alias holds `t`'s storage only while a
/// handle on it does. `t` must be floating point.
pub fn sink_alias(t: &Tensor) -> Result<(Tensor, GradSink), KernelError> {
    let p = t.as_ptr() as ffi::CTensor;
    let mut out: ffi::CTensor = std::ptr::null_mut();
    let mut raw: *mut ffi::CSink = std::ptr::null_mut();
    ffi::check("making a block input with a gradient sink", |e| unsafe {
        ffi::ckpt_sink_alias(p, &mut out, &mut raw, e)
    })?;
    Ok((ffi::from_raw(out), GradSink { raw }))
}

/// Whether anything but the handle `t` holds `t`'s storage: for a block output just made, that
/// its graph saved it (as an operator's output or input), or that a view of it or a tensor it
/// aliases is alive. Such an output outlives the runtime's handle on it, whoever reads it.
pub fn storage_shared(t: &Tensor) -> bool {
    // SAFETY: `t` is a live tensor for the duration of the call, which only reads it.
    unsafe { ffi::ckpt_storage_holders(t.as_ptr() as ffi::CTensor) > 0 }
}

/// A block output's gradient edge: what its backward starts from once the output is gone.
pub struct OutputEdge {
    raw: *mut ffi::COutputEdge,
}

impl Drop for OutputEdge {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: `raw` came from `ckpt_output_edge` and was not handed to a backward.
            unsafe { ffi::ckpt_output_edge_free(self.raw) }
        }
    }
}

/// The gradient edge of `out` (which must require grad); consumes the handle.
pub fn output_edge(out: Tensor) -> Result<OutputEdge, KernelError> {
    let p = ffi::into_raw(out);
    let mut raw: *mut ffi::COutputEdge = std::ptr::null_mut();
    ffi::check("taking a block output's gradient edge", |e| unsafe {
        ffi::ckpt_output_edge(p, &mut raw, e)
    })?;
    Ok(OutputEdge { raw })
}

/// One backward from every `(edge, gradient)` of `roots`, with the gradient each of `sinks`
/// (the block's inputs) already holds from later readers fed in ahead of the block's own
/// contributions, so each sink ends with the sum one fused graph computes, bit for bit. Edges and
/// gradients are consumed, the gradients' handles dropped before the graph runs.
pub fn backward_edges(roots: Vec<(OutputEdge, Tensor)>, sinks: &[&GradSink]) -> Result<(), KernelError> {
    let (edges, grads): (Vec<*mut ffi::COutputEdge>, Vec<ffi::CTensor>) = roots
        .into_iter()
        .map(|(mut edge, g)| (std::mem::replace(&mut edge.raw, std::ptr::null_mut()), ffi::into_raw(g)))
        .unzip();
    let sinks: Vec<*mut ffi::CSink> = sinks.iter().map(|s| s.raw).collect();
    ffi::check("backward from output edges", |e| unsafe {
        ffi::ckpt_backward_edges(
            edges.as_ptr(),
            grads.as_ptr(),
            edges.len() as i64,
            sinks.as_ptr(),
            sinks.len() as i64,
            e,
        )
    })
}
