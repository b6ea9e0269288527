# Plain PyTorch training with the ckptune plan for tinyllama-1.1b (ckptune 0.1.0).
#   checkpoint: model.layers.7, model.layers.9, model.layers.12, model.layers.13, model.layers.20 (regex ^(?:model\.layers\.(?:7|9|12|13|20))$)
#   of them selective (policy matmul: matmul and attention outputs kept, the rest recomputed): model.layers.9
#   of them selective (policy attention: the attention core and pointwise operators recomputed, the rest kept): model.layers.13
#   config fp32/adamw/mb1x1: precision fp32, optimizer adamw, micro-batch 1, gradient accumulation 1, set_to_none true
#   inputs: sequences of 1024 tokens
#   predicted peak 17.94 GiB (19,264,194,156 B) of the budget 18.04 GiB (19,367,044,016 B), measured on cpu, threads: 2
# Needs the ckptune companion (`pip install ./python` from a ckptune checkout) and torch.
import torch

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": ""},
    "checkpoint": {"regex": "^(?:model\\.layers\\.(?:7|9|12|13|20))$", "modules": ["model.layers.7", "model.layers.9", "model.layers.12", "model.layers.13", "model.layers.20"], "selective": [{"policy": "matmul", "modules": ["model.layers.9"]}, {"policy": "attention", "modules": ["model.layers.13"]}]},
    "config": {"grad_accum": 1, "micro_batch": 1, "optimizer": "adamw", "optimizer_impl": "single", "precision": "fp32", "set_to_none": True},
}
# The plan's module names are those of a Hugging Face LlamaForCausalLM (Mistral, Qwen2).
# ckptune.apply refuses, naming the closest modules, a model whose names differ.


def train(model, loader, loss_fn, lr=1e-3, device="cpu"):
    """Trains `model` as the plan was measured: the plan's modules checkpointed, its precision,
    optimizer, accumulation and zero_grad. `loader` yields batches of 1 samples;
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
