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
    /// A step measured on the meta device met an operator fake mode cannot run: one whose
    /// result depends on tensor values, or one without a meta kernel (often only in backward,
    /// which a model's load-time trial does not run).
    #[error(
        "the training step cannot be measured on the meta device: {why}; measure the model by \
         running it instead (--measure run)"
    )]
    NotMeasurableOnMeta { why: String },
    /// A node of a block of the user's graph (a `torch.export` program) that failed in the
    /// step, after the model ran on a sample batch when it was loaded: what the step does
    /// differently (the precision, the micro-batch, backward) is what the program rejects.
    #[error(
        "{model}: block {block}, {failure}; the program ran on a sample batch in fp32 when it was \
         loaded, so it rejects what this step does differently: plan another --precision or \
         --batch, or export the model with the dtype and batch size you train with (a dynamic \
         batch: dynamic_shapes with torch.export.Dim(\"batch\"))"
    )]
    Block {
        model: String,
        block: String,
        failure: ckptune_models::BlockFailure,
    },
    /// A node of a block of the user's graph whose backward fails: an operator without a
    /// derivative, or an in-place write of a tensor an earlier node saved for backward. The
    /// load-time trial runs forward only; PyTorch's own backward of the program fails the same way.
    #[error(
        "{model}: block {block}: the backward of node {} ({}) fails ({}); training needs a \
         derivative for every operator between the loss and the parameters, and no in-place \
         write of a tensor that an earlier node saved for backward: export a model whose \
         operators have derivatives (torch.library.register_autograd for a custom operator), or \
         that writes a copy (`x = x.clone()` before the in-place operator)",
        failure.node,
        failure.target,
        failure.why
    )]
    Backward {
        model: String,
        block: String,
        /// Boxed: a second variant as large as [`RuntimeError::Block`] would grow every result.
        failure: Box<ckptune_models::BlockFailure>,
    },
    /// A selective block whose recompute calls operators its forward did not, so the forward's
    /// decisions cannot be replayed: a checkpointed block's forward runs without grad and its
    /// recompute with grad, and some operators pick their kernel by whether an input needs a
    /// gradient (on the CPU, `scaled_dot_product_attention` takes its math kernel where its mask
    /// does, as a learned position bias computed with grad does: BEiT, Swin).
    #[error(
        "{model}: block {block} cannot run selective: at node {} ({}) its recompute, with grad, \
         calls operators its forward, without grad, did not ({}); some operators pick another \
         kernel when an input needs a gradient (scaled_dot_product_attention where its mask \
         does, as a learned position bias computed with grad does). Plan without --selective \
         (whole blocks checkpointed), or leave this block out of the candidates (--candidates)",
        failure.node,
        failure.target,
        failure.why
    )]
    Selective {
        model: String,
        block: String,
        failure: Box<ckptune_models::BlockFailure>,
    },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

impl RuntimeError {
    /// This error as a fake step's refusal ([`RuntimeError::NotMeasurableOnMeta`]) when it is
    /// an operator's failure that says fake mode cannot run it.
    pub(crate) fn on_meta(self) -> RuntimeError {
        let why = match &self {
            RuntimeError::Kernel(KernelError::Torch { message, .. }) => ckptune_kernels::fake::meta_failure(message),
            RuntimeError::Torch { source, .. } => ckptune_kernels::fake::meta_failure(&source.to_string()),
            RuntimeError::Block { failure, .. } => meta_node(failure),
            RuntimeError::Backward { failure, .. } => meta_node(failure),
            _ => None,
        };
        match why {
            Some(why) => RuntimeError::NotMeasurableOnMeta { why },
            None => self,
        }
    }
}

/// A node's failure as a fake step's refusal, when it says fake mode cannot run the node.
fn meta_node(failure: &ckptune_models::BlockFailure) -> Option<String> {
    ckptune_kernels::fake::meta_failure(&failure.why)
        .map(|why| format!("node {} ({}): {why}", failure.node, failure.target))
}

pub(crate) fn torch(op: impl Into<String>) -> impl FnOnce(tch::TchError) -> RuntimeError {
    let op = op.into();
    move |source| RuntimeError::Torch { op, source }
}
