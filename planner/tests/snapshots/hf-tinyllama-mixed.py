# Hugging Face Trainer with the ckptune plan for tinyllama-1.1b (ckptune 0.1.0).
#   checkpoint: model.layers.7, model.layers.9, model.layers.12, model.layers.13, model.layers.20 (regex ^(?:model\.layers\.(?:7|9|12|13|20))$)
#   of them selective (policy matmul: matmul and attention outputs kept, the rest recomputed): model.layers.9
#   of them selective (policy attention: the attention core and pointwise operators recomputed, the rest kept): model.layers.13
#   config fp32/adamw/mb1x1: precision fp32, optimizer adamw, micro-batch 1, gradient accumulation 1, set_to_none true
#   inputs: sequences of 1024 tokens
#   predicted peak 17.94 GiB (19,264,194,156 B) of the budget 18.04 GiB (19,367,044,016 B), measured on cpu, threads: 2
# Needs transformers (with accelerate) and the ckptune companion (`pip install ./python`).
# The plan runs some modules selective (matmul and attention outputs kept, the rest recomputed; the attention core and pointwise operators recomputed, the rest kept).
# transformers' activation checkpointing cannot express that (it recomputes a layer
# whole): ckptune.apply wraps exactly the plan's modules, the selective ones with
# create_selective_checkpoint_contexts, before the Trainer is built, and
# TrainingArguments(activation_checkpointing=False) keeps transformers from adding more.
import torch
from transformers import Trainer, TrainingArguments

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": ""},
    "checkpoint": {"regex": "^(?:model\\.layers\\.(?:7|9|12|13|20))$", "modules": ["model.layers.7", "model.layers.9", "model.layers.12", "model.layers.13", "model.layers.20"], "selective": [{"policy": "matmul", "modules": ["model.layers.9"]}, {"policy": "attention", "modules": ["model.layers.13"]}]},
    "config": {"grad_accum": 1, "micro_batch": 1, "optimizer": "adamw", "optimizer_impl": "single", "precision": "fp32", "set_to_none": True},
}
# The plan's module names are those of a Hugging Face LlamaForCausalLM (Mistral, Qwen2).
# ckptune.apply refuses, naming the closest modules, a model whose names differ.


def checkpoint_plan(model):
    """ckptune.apply on the plan's modules; returns their names."""
    return ckptune.apply(model, PLAN)


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
