//! The kernels crate's error type.

/// Errors from the native shim: each names the operation that failed and libtorch's message.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: {message}")]
    Torch { op: &'static str, message: String },
    #[error("{op}: {message}")]
    Cuda { op: &'static str, message: String },
    #[error("loading TorchScript module {path}: {message}")]
    JitLoad { path: String, message: String },
    /// A caller handed a value the operation cannot work with (a mismatched length, a
    /// non-finite hyper-parameter, tensors that share memory).
    #[error("{op}: {message}")]
    Invalid { op: &'static str, message: String },
    /// NVRTC could not be found or could not compile a kernel.
    #[error("{op}: {message}")]
    Nvrtc { op: &'static str, message: String },
}
