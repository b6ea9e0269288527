# Plain PyTorch training with the ckptune plan for bert-base-uncased (ckptune 0.1.0).
#   checkpoint: embeddings, encoder.layer.3 (regex ^(?:embeddings|encoder\.layer\.3)$)
#   config bf16/adamw/mb12x1: precision bf16, optimizer adamw, micro-batch 12, gradient accumulation 1, set_to_none true
#   inputs: sequences of 128 tokens
#   predicted peak 2.16 GiB (2,323,671,684 B) of the budget 2.17 GiB (2,326,261,216 B), measured on cpu, threads: 2
# Needs the ckptune companion (`pip install ./python` from a ckptune checkout) and torch.
import torch

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": "bert."},
    "checkpoint": {"regex": "^(?:embeddings|encoder\\.layer\\.3)$", "modules": ["embeddings", "encoder.layer.3"]},
    "config": {"grad_accum": 1, "micro_batch": 12, "optimizer": "adamw", "optimizer_impl": "single", "precision": "bf16", "set_to_none": True},
}
# ckptune plans the backbone: the plan's `encoder.layer.0` is `bert.encoder.layer.0` of
# a Hugging Face BertForSequenceClassification. The plan records that, so ckptune.apply takes
# the whole model (or the backbone, or a module holding either) and refuses, naming the
# closest modules, a model whose names differ.


def train(model, loader, loss_fn, lr=1e-3, device="cpu"):
    """Trains `model` as the plan was measured: the plan's modules checkpointed, its precision,
    optimizer, accumulation and zero_grad. `loader` yields batches of 12 samples;
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
