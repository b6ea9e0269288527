# Hugging Face Trainer with the ckptune plan for tiny-llama (ckptune 0.1.0).
#   checkpoint: nothing (regex ^[^\s\S]$)
#   config fp32/adamw/mb2x1/loss16: precision fp32, optimizer adamw, micro-batch 2, gradient accumulation 1, set_to_none true
#   inputs: sequences of 512 tokens
#   attention: attn_implementation="sdpa" (load the model with it: the plan's memory is that attention's)
#   predicted peak 9.92 MiB (10,405,500 B) of the budget 953.67 MiB (1,000,000,000 B), measured on cpu, threads: 1
# NOT EXPRESSED: the plan computes the loss in 16 chunks of tokens (`ckptune.chunked_causal_lm_loss`); Trainer computes it whole from the model's logits, holding the [tokens, vocab] logits and their gradient at once, so it can peak above the plan's prediction.
# Needs transformers (with accelerate) and the ckptune companion (`pip install ./python`).
# The plan checkpoints nothing: activation checkpointing stays off.
import torch
from transformers import Trainer, TrainingArguments

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": ""},
    "checkpoint": {"regex": "^[^\\s\\S]$", "modules": []},
    "config": {"grad_accum": 1, "loss_chunks": 16, "micro_batch": 2, "optimizer": "adamw", "optimizer_impl": "single", "precision": "fp32", "set_to_none": True},
}
# The plan's module names are those of a Hugging Face LlamaForCausalLM (Mistral, Qwen2).
# ckptune.apply refuses, naming the closest modules, a model whose names differ.


def checkpoint_plan(model):
    """ckptune.apply on the plan's modules; returns their names."""
    return ckptune.apply(model, PLAN)


def make_trainer(model, train_dataset, lr=1e-3, output_dir="ckptune-trainer", trainer_kwargs=None, **training_args):
    """A Trainer with the plan applied: its modules checkpointed, its micro-batch (2) and
    accumulation (1), precision and optimizer. Extra TrainingArguments pass through. Trainer
    clips gradients by default (max_grad_norm=1.0), which the plan did not measure: its norms add
    a few bytes per parameter tensor before the optimizer step; max_grad_norm=0 is the plan's step."""
    checkpoint_plan(model)
    cfg = ckptune.training_config(PLAN)
    model.to(cfg.param_dtype)
    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        **training_args,
    )
    return Trainer(model=model, args=args, train_dataset=train_dataset, optimizers=(opt, None),
                   **(trainer_kwargs or {}))
