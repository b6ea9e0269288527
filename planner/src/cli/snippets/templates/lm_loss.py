

def lm_loss(model, batch):
    """The plan's loss as it was measured, for a Hugging Face causal LM (pass it as `loss_fn`;
    `batch` is input_ids, labels, attention_mask): the backbone's last hidden states, then the
    head and the cross entropy in ${chunks} chunks of tokens, each chunk's logits and their gradient
    freed before the next."""
    input_ids, labels, attention_mask = batch
    hidden = model.base_model(input_ids, attention_mask=attention_mask).last_hidden_state
    return ckptune.chunked_causal_lm_loss(hidden, model.get_output_embeddings().weight, labels, ${chunks})
