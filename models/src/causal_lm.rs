//! The loss head of a causal language model, as Hugging Face's `GPT2LMHeadModel` and
//! `LlamaForCausalLM` compute it: `lm_head` (no bias) and `ForCausalLMLoss` (`logits.float()`,
//! labels padded on the right with -100 and shifted by one, mean cross entropy). Also the
//! pieces of the chunked loss (`--loss-chunks`), which the runtime runs chunk by chunk.

use tch::{Kind, Tensor};

use crate::chain::{Batch, LmHead, LossHead};

/// `ignore_index` of `ForCausalLMLoss`: the padding label shifted in at each sequence's end.
pub const IGNORE_INDEX: i64 = -100;

/// `lm_head` (its weight `[vocab, hidden]`, tied to the embedding or not) and the loss.
pub struct CausalLm {
    weight: Tensor,
    vocab_size: i64,
}

impl CausalLm {
    pub(crate) fn new(weight: Tensor, vocab_size: i64) -> Self {
        Self { weight, vocab_size }
    }
}

impl LmHead for CausalLm {
    fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// One label per token, flattened as the logits are:
    /// `F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous().view(-1)`, its temporaries
    /// freed when it returns.
    fn shift_labels(&self, batch: &Batch) -> Tensor {
        batch
            .target
            .to_device(self.weight.device())
            .pad([0, 1], "constant", IGNORE_INDEX as f64)
            .slice(-1, 1, None, 1)
            .contiguous()
            .view([-1])
    }

    /// The summed cross entropy of one chunk: `rows` `[tokens, hidden]` hidden states, `labels`
    /// `[tokens]`; `F.cross_entropy(F.linear(rows.view_as(rows), weight.view_as(weight)).float(),
    /// labels, ignore_index=-100, reduction="sum")`, the logits freed when it returns. The views
    /// keep both out of autocast's cache (it caches the casts of leaves that require grad, not of
    /// views): each chunk's casts die with the chunk whether the loop's autocast caches or not,
    /// instead of every chunk's rows piling up in the cache.
    fn chunk_loss(&self, rows: &Tensor, labels: &Tensor) -> Tensor {
        rows.view_as(rows)
            .linear(&self.weight.view_as(&self.weight), None::<&Tensor>)
            .to_kind(Kind::Float)
            .cross_entropy_loss(labels, None::<&Tensor>, tch::Reduction::Sum, IGNORE_INDEX, 0.0)
    }
}

impl LossHead for CausalLm {
    fn loss(&self, hidden_states: &Tensor, batch: &Batch) -> Tensor {
        // `logits` stays alive in the model's forward while the loss function runs, and so do
        // the padded labels in `ForCausalLMLoss`.
        let lm_logits = hidden_states.linear(&self.weight, None::<&Tensor>);
        // `logits.float()` is the same tensor for fp32 logits and an fp32 copy for bf16/fp16.
        let mut logits = lm_logits.to_kind(Kind::Float);
        let labels = batch
            .target
            .to_device(logits.device())
            .pad([0, 1], "constant", IGNORE_INDEX as f64);
        let shift_labels = labels.slice(-1, 1, None, 1).contiguous().view([-1]);
        logits = logits.view([-1, self.vocab_size]);
        logits.cross_entropy_loss(&shift_labels, None::<&Tensor>, tch::Reduction::Mean, IGNORE_INDEX, 0.0)
    }

    fn causal_lm(&self) -> Option<&dyn LmHead> {
        Some(self)
    }
}
