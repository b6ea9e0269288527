# Plain PyTorch training with the ckptune plan for resnet152 (ckptune 0.1.0).
#   checkpoint: layer1, layer2, layer3 (regex ^(?:layer1|layer2|layer3)$)
#   config bf16/adamw/mb4x1: precision bf16, optimizer adamw, micro-batch 4, gradient accumulation 1, set_to_none true
#   inputs: images 224x224
#   predicted peak 1.01 GiB (1,088,388,108 B) of the budget 1.02 GiB (1,096,590,090 B), measured on cpu, threads: 2
#   on the GPU (h100): predicted 1.02 GiB allocated, 1.21 GiB reserved by the caching allocator, plus 512.00 MiB of CUDA context
# The recommended allocator setting (docs/cuda-allocator.md), set before CUDA starts (PyTorch
# reads it once, at the first allocation on the GPU):
import os
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
# Needs the ckptune companion (`pip install ./python` from a ckptune checkout) and torch.
import torch

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": ""},
    "checkpoint": {"regex": "^(?:layer1|layer2|layer3)$", "modules": ["layer1", "layer2", "layer3"]},
    "config": {"grad_accum": 1, "micro_batch": 4, "optimizer": "adamw", "optimizer_impl": "single", "precision": "bf16", "set_to_none": True},
}
# The plan's module names are those of the model ckptune planned (a torchvision ResNet, your exported module).
# ckptune.apply refuses, naming the closest modules, a model whose names differ.


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
