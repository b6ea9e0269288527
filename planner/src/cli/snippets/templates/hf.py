${header}# Needs transformers (with accelerate) and the ckptune companion (`pip install ./python`).
${checkpointing_comment}import torch
from transformers import Trainer, TrainingArguments
${layer_import}
import ckptune

${plan}${root_comment}

${checkpoint_plan}


def make_trainer(model, train_dataset, lr=1e-3, output_dir="ckptune-trainer", trainer_kwargs=None, **training_args):
    """A Trainer with the plan applied: its modules checkpointed, its micro-batch (${micro_batch}) and
    accumulation (${grad_accum}), precision and optimizer. Extra TrainingArguments pass through. Trainer
    clips gradients by default (max_grad_norm=1.0), which the plan did not measure: its norms add
    a few bytes per parameter tensor before the optimizer step; max_grad_norm=0 is the plan's step."""
    checkpoint_plan(model)
    cfg = ckptune.training_config(PLAN)
    model.to(cfg.param_dtype)
    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
${zero_grad_comment}    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=${micro_batch},
        gradient_accumulation_steps=${grad_accum},
        bf16=${bf16},
        fp16=${fp16},
        activation_checkpointing=False,
        **training_args,
    )
    return Trainer(model=model, args=args, train_dataset=train_dataset, optimizers=(opt, None),
                   **(trainer_kwargs or {}))
