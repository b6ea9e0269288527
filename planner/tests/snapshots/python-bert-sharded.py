# Plain PyTorch training with the ckptune plan for bert-base-uncased (ckptune 0.1.0).
#   checkpoint: encoder.layer.4, encoder.layer.5, encoder.layer.7, encoder.layer.8, encoder.layer.10 (regex ^(?:encoder\.layer\.(?:4|5|7|8|10))$)
#   config fp32/adamw/mb4x1: precision fp32, optimizer adamw, micro-batch 4, gradient accumulation 1, set_to_none true
#   inputs: sequences of 128 tokens
#   attention: attn_implementation="sdpa" (load the model with it: the plan's memory is that attention's)
#   predicted peak 1.07 GiB (1,149,031,216 B) of the budget 1.07 GiB (1,153,433,600 B), measured on cpu, threads: 1
#   sharded over 2 ranks with FSDP2 (gloo): fully_shard on encoder.layer.0, encoder.layer.1, …, encoder.layer.11 (12 units) (reshard_after_forward=True), then on the root (every other parameter); micro-batch 4 per rank, 8 samples per micro-step over the 2 ranks
#   predicted peak per rank: ranks 0–1 1.07 GiB (1,149,031,216 B) at backward encoder.layer.4
# This snippet trains on one process, without the plan's sharding: `ckptune emit fsdp2` writes that.
# Needs the ckptune companion (`pip install ./python` from a ckptune checkout) and torch.
import torch

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": "bert."},
    "checkpoint": {"regex": "^(?:encoder\\.layer\\.(?:4|5|7|8|10))$", "modules": ["encoder.layer.4", "encoder.layer.5", "encoder.layer.7", "encoder.layer.8", "encoder.layer.10"]},
    "config": {"grad_accum": 1, "micro_batch": 4, "optimizer": "adamw", "optimizer_impl": "single", "precision": "fp32", "set_to_none": True},
}
# ckptune plans the backbone: the plan's `encoder.layer.0` is `bert.encoder.layer.0` of
# a Hugging Face BertForSequenceClassification. The plan records that, so ckptune.apply takes
# the whole model (or the backbone, or a module holding either) and refuses, naming the
# closest modules, a model whose names differ.


def train(model, loader, loss_fn, lr=1e-3, device="cpu"):
    """Trains `model` as the plan was measured: the plan's modules checkpointed, its precision,
    optimizer, accumulation and zero_grad. `loader` yields batches of 4 samples;
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
