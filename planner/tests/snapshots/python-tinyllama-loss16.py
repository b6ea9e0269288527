# Plain PyTorch training with the ckptune plan for tiny-llama (ckptune 0.1.0).
#   checkpoint: nothing (regex ^[^\s\S]$)
#   config fp32/adamw/mb2x1/loss16: precision fp32, optimizer adamw, micro-batch 2, gradient accumulation 1, set_to_none true
#   inputs: sequences of 512 tokens
#   attention: attn_implementation="sdpa" (load the model with it: the plan's memory is that attention's)
#   predicted peak 9.92 MiB (10,405,500 B) of the budget 953.67 MiB (1,000,000,000 B), measured on cpu, threads: 1
# The plan computes the loss in 16 chunks of tokens (`ckptune.chunked_causal_lm_loss`); `lm_loss` below does, pass it as `loss_fn`.
# Needs the ckptune companion (`pip install ./python` from a ckptune checkout) and torch.
import torch

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": ""},
    "checkpoint": {"regex": "^[^\\s\\S]$", "modules": []},
    "config": {"grad_accum": 1, "loss_chunks": 16, "micro_batch": 2, "optimizer": "adamw", "optimizer_impl": "single", "precision": "fp32", "set_to_none": True},
}
# The plan's module names are those of a Hugging Face LlamaForCausalLM (Mistral, Qwen2).
# ckptune.apply refuses, naming the closest modules, a model whose names differ.


def lm_loss(model, batch):
    """The plan's loss as it was measured, for a Hugging Face causal LM (pass it as `loss_fn`;
    `batch` is input_ids, labels, attention_mask): the backbone's last hidden states, then the
    head and the cross entropy in 16 chunks of tokens, each chunk's logits and their gradient
    freed before the next."""
    input_ids, labels, attention_mask = batch
    hidden = model.base_model(input_ids, attention_mask=attention_mask).last_hidden_state
    return ckptune.chunked_causal_lm_loss(hidden, model.get_output_embeddings().weight, labels, 16)


def train(model, loader, loss_fn, lr=1e-3, device="cpu"):
    """Trains `model` as the plan was measured: the plan's modules checkpointed, its precision,
    optimizer, accumulation and zero_grad. `loader` yields batches of 2 samples;
    `loss_fn(model, batch)` returns the loss (with inputs in the parameters' dtype for bf16-pure).
    Returns the names `ckptune.apply` wrapped."""
    wrapped = ckptune.apply(model, PLAN)
    cfg = ckptune.training_config(PLAN)
    model.to(device=device, dtype=cfg.param_dtype).train()
    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
    scaler = torch.amp.GradScaler(device) if cfg.grad_scaler else None
    for step, batch in enumerate(loader):
        # cache_enabled as planned: autocast's cache keeps the casts of weights (checkpointed
        # layers' too) until this region ends, which the plan counts only when it was made with
        # --autocast-cache (docs/memory-model.md, "Autocast's cache").
        with torch.autocast(device, dtype=cfg.autocast_dtype, enabled=cfg.autocast_dtype is not None,
                            cache_enabled=cfg.autocast_cache):
            loss = loss_fn(model, batch) / cfg.grad_accum
        (scaler.scale(loss) if scaler else loss).backward()
        if (step + 1) % cfg.grad_accum == 0:
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=cfg.set_to_none)
    return wrapped
