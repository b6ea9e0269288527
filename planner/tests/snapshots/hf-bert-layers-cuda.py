# Hugging Face Trainer with the ckptune plan for bert-base-uncased (ckptune 0.1.0).
#   checkpoint: encoder.layer.0, encoder.layer.2, encoder.layer.3, encoder.layer.7, encoder.layer.8, encoder.layer.10 (regex ^(?:encoder\.layer\.(?:0|2|3|7|8|10))$)
#   config bf16/adamw/mb12x1/cache: precision bf16, optimizer adamw, micro-batch 12, gradient accumulation 1, set_to_none true
#   inputs: sequences of 128 tokens
#   predicted peak 1.81 GiB (1,939,301,300 B) of the budget 1.82 GiB (1,954,779,696 B), measured on cpu, threads: 2
#   on the GPU (h100): predicted 1.02 GiB allocated, 1.21 GiB reserved by the caching allocator, plus 512.00 MiB of CUDA context
# The recommended allocator setting (docs/cuda-allocator.md), set before CUDA starts (PyTorch
# reads it once, at the first allocation on the GPU):
import os
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "roundup_power2_divisions:4"
# Needs transformers (with accelerate) and the ckptune companion (`pip install ./python`).
# The plan checkpoints 6 of the 12 layers, each a transformers GradientCheckpointingLayer, so
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
    "model": {"prefix": "bert."},
    "checkpoint": {"regex": "^(?:encoder\\.layer\\.(?:0|2|3|7|8|10))$", "modules": ["encoder.layer.0", "encoder.layer.2", "encoder.layer.3", "encoder.layer.7", "encoder.layer.8", "encoder.layer.10"]},
    "config": {"autocast_cache": True, "grad_accum": 1, "micro_batch": 12, "optimizer": "adamw", "optimizer_impl": "single", "precision": "bf16", "set_to_none": True},
}
# ckptune plans the backbone: the plan's `encoder.layer.0` is `bert.encoder.layer.0` of
# a Hugging Face BertForSequenceClassification. The plan records that, so ckptune.apply takes
# the whole model (or the backbone, or a module holding either) and refuses, naming the
# closest modules, a model whose names differ.


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
    """A Trainer with the plan applied: its modules checkpointed, its micro-batch (12) and
    accumulation (1), precision and optimizer. Extra TrainingArguments pass through. Trainer
    clips gradients by default (max_grad_norm=1.0), which the plan did not measure: its norms add
    a few bytes per parameter tensor before the optimizer step; max_grad_norm=0 is the plan's step."""
    checkpoint_plan(model)
    cfg = ckptune.training_config(PLAN)
    model.to(cfg.param_dtype)
    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=12,
        gradient_accumulation_steps=1,
        bf16=True,
        fp16=False,
        activation_checkpointing=False,
        **training_args,
    )
    return Trainer(model=model, args=args, train_dataset=train_dataset, optimizers=(opt, None),
                   **(trainer_kwargs or {}))
