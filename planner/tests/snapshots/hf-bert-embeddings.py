# Hugging Face Trainer with the ckptune plan for bert-base-uncased (ckptune 0.1.0).
#   checkpoint: embeddings, encoder.layer.3 (regex ^(?:embeddings|encoder\.layer\.3)$)
#   config bf16/adamw/mb12x1/cache: precision bf16, optimizer adamw, micro-batch 12, gradient accumulation 1, set_to_none true
#   inputs: sequences of 128 tokens
#   predicted peak 2.16 GiB (2,323,671,684 B) of the budget 2.17 GiB (2,326,261,216 B), measured on cpu, threads: 2
# Needs transformers (with accelerate) and the ckptune companion (`pip install ./python`).
# The plan checkpoints modules that are not whole layers (or not only layers), which
# transformers' activation checkpointing cannot express (it checkpoints every layer, or
# every n-th): ckptune.apply wraps exactly the plan's modules before the Trainer is built,
# and TrainingArguments(activation_checkpointing=False) keeps transformers from adding more.
import torch
from transformers import Trainer, TrainingArguments

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": "bert."},
    "checkpoint": {"regex": "^(?:embeddings|encoder\\.layer\\.3)$", "modules": ["embeddings", "encoder.layer.3"]},
    "config": {"autocast_cache": True, "grad_accum": 1, "micro_batch": 12, "optimizer": "adamw", "optimizer_impl": "single", "precision": "bf16", "set_to_none": True},
}
# ckptune plans the backbone: the plan's `encoder.layer.0` is `bert.encoder.layer.0` of
# a Hugging Face BertForSequenceClassification. The plan records that, so ckptune.apply takes
# the whole model (or the backbone, or a module holding either) and refuses, naming the
# closest modules, a model whose names differ.


def checkpoint_plan(model):
    """ckptune.apply on the plan's modules; returns their names."""
    return ckptune.apply(model, PLAN)


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
