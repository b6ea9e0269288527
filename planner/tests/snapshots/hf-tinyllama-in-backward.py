# Hugging Face Trainer with the ckptune plan for tinyllama-1.1b (ckptune 0.1.0).
#   checkpoint: model.layers.7, model.layers.9, model.layers.12, model.layers.13, model.layers.20 (regex ^(?:model\.layers\.(?:7|9|12|13|20))$)
#   config fp32/adamw/mb1x1/in-bwd: precision fp32, optimizer adamw, micro-batch 1, gradient accumulation 1, set_to_none true
#   optimizer step in backward: each parameter updated as soon as its gradient is complete, in its post-accumulate-grad hook, its gradient freed there (ckptune.optimizer_in_backward)
#   inputs: sequences of 1024 tokens
#   predicted peak 17.94 GiB (19,264,194,156 B) of the budget 18.04 GiB (19,367,044,016 B), measured on cpu, threads: 2
# NOT EXPRESSED: the plan steps the optimizer in backward (`ckptune.optimizer_in_backward`); the Trainer (its `optimizers` argument takes one optimizer) steps it after backward, holding every parameter gradient at once, so it can peak above the plan's prediction. `ckptune emit python` writes a loop that steps in backward.
# Needs transformers (with accelerate) and the ckptune companion (`pip install ./python`).
# The plan checkpoints 5 of the 22 layers, each a transformers GradientCheckpointingLayer, so
# transformers' own per-layer flag expresses it exactly: activation checkpointing is enabled
# (non-reentrant, as ckptune measured) and then switched off on the layers the plan keeps.
# TrainingArguments(activation_checkpointing=True) (gradient_checkpointing_enable()) would
# checkpoint every layer and recompute more than the plan needs, so it stays False here.
import torch
from transformers import Trainer, TrainingArguments
from transformers.modeling_layers import GradientCheckpointingLayer

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": ""},
    "checkpoint": {"regex": "^(?:model\\.layers\\.(?:7|9|12|13|20))$", "modules": ["model.layers.7", "model.layers.9", "model.layers.12", "model.layers.13", "model.layers.20"]},
    "config": {"grad_accum": 1, "micro_batch": 1, "optimizer": "adamw", "optimizer_impl": "single", "optimizer_in_backward": True, "precision": "fp32", "set_to_none": True},
}
# The plan's module names are those of a Hugging Face LlamaForCausalLM (Mistral, Qwen2).
# ckptune.apply refuses, naming the closest modules, a model whose names differ.


def checkpoint_plan(model):
    """Transformers' per-layer checkpointing on exactly the plan's layers; returns their names."""
    backbone = ckptune.plan_root(model, PLAN)
    planned = PLAN["checkpoint"]["modules"]
    layers = {name: m for name, m in backbone.named_modules() if isinstance(m, GradientCheckpointingLayer)}
    missing = [name for name in planned if name not in layers]
    if missing:
        raise ValueError(f"not transformers checkpointing layers of this model: {missing}; its layers are "
                         f"{list(layers)[:4]}...; use ckptune.apply(model, PLAN)")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for name, layer in layers.items():
        layer.gradient_checkpointing = name in planned
    return [name for name in layers if name in planned]


def make_trainer(model, train_dataset, lr=1e-3, output_dir="ckptune-trainer", trainer_kwargs=None, **training_args):
    """A Trainer with the plan applied: its modules checkpointed, its micro-batch (1) and
    accumulation (1), precision and optimizer. Extra TrainingArguments pass through. Trainer
    clips gradients by default (max_grad_norm=1.0), which the plan did not measure: its norms add
    a few bytes per parameter tensor before the optimizer step; max_grad_norm=0 is the plan's step."""
    checkpoint_plan(model)
    cfg = ckptune.training_config(PLAN)
    model.to(cfg.param_dtype)
    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        **training_args,
    )
    return Trainer(model=model, args=args, train_dataset=train_dataset, optimizers=(opt, None),
                   **(trainer_kwargs or {}))
