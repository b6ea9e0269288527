//! The runtime's error type.

use ckptune_kernels::KernelError;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("{op}: {source}")]
    Torch { op: String, source: tch::TchError },
    #[error("invalid checkpoint regex {pattern:?}: {message}")]
    Regex { pattern: String, message: String },
    #[error("checkpoint regex {pattern:?} selects {name:?}, which is not a candidate block of {model} (candidates: {candidates})")]
    NotCandidate {
        pattern: String,
        name: String,
        model: String,
        candidates: String,
    },
    /// A checkpoint regex that selects something the chain cannot checkpoint as asked.
    #[error("{0}")]
    Selection(String),
    #[error("unsupported config: {0}")]
    Config(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

pub(crate) fn torch(op: impl Into<String>) -> impl FnOnce(tch::TchError) -> RuntimeError {
    let op = op.into();
    move |source| RuntimeError::Torch { op, source }
}
