# Lightning with the ckptune plan for tinyllama-1.1b (ckptune 0.1.0).
#   checkpoint: model.layers.7, model.layers.9, model.layers.12, model.layers.13, model.layers.20 (regex ^(?:model\.layers\.(?:7|9|12|13|20))$)
#   config fp32/adamw/mb1x1/in-bwd: precision fp32, optimizer adamw, micro-batch 1, gradient accumulation 1, set_to_none true
#   optimizer step in backward: each parameter updated as soon as its gradient is complete, in its post-accumulate-grad hook, its gradient freed there (ckptune.optimizer_in_backward)
#   inputs: sequences of 1024 tokens
#   predicted peak 17.94 GiB (19,264,194,156 B) of the budget 18.04 GiB (19,367,044,016 B), measured on cpu, threads: 2
# NOT EXPRESSED: the plan steps the optimizer in backward (`ckptune.optimizer_in_backward`); this module's automatic optimization steps it after backward, holding every parameter gradient at once, so it can peak above the plan's prediction. `ckptune emit python` writes a loop that steps in backward.
# Needs lightning and the ckptune companion (`pip install ./python`).
# A callback applies the plan in `setup`, which Lightning runs before `configure_model`,
# `configure_optimizers` and any strategy's wrapping. FSDPStrategy(activation_checkpointing_policy=
# {LayerClass}) checkpoints every instance of the classes given, so it expresses a plan only
# when the plan names every layer of those classes; the callback is exact for any plan.
import lightning.pytorch as L

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": ""},
    "checkpoint": {"regex": "^(?:model\\.layers\\.(?:7|9|12|13|20))$", "modules": ["model.layers.7", "model.layers.9", "model.layers.12", "model.layers.13", "model.layers.20"]},
    "config": {"grad_accum": 1, "micro_batch": 1, "optimizer": "adamw", "optimizer_impl": "single", "optimizer_in_backward": True, "precision": "fp32", "set_to_none": True},
}
# The plan's module names are those of a Hugging Face LlamaForCausalLM (Mistral, Qwen2).
# ckptune.apply refuses, naming the closest modules, a model whose names differ.


class CkptunePlan(L.Callback):
    """Checkpoints the plan's modules of the LightningModule when fitting starts (ckptune.apply finds
    the backbone the plan names wherever the module keeps it, e.g. `self.model.bert`)."""

    def __init__(self):
        self.wrapped = None

    def setup(self, trainer, pl_module, stage):
        if stage == "fit" and self.wrapped is None:
            self.wrapped = ckptune.apply(pl_module, PLAN)


class CkptuneOptimization:
    """Mix into your LightningModule (`class Net(CkptuneOptimization, L.LightningModule)`): the plan's
    optimizer (class, foreach/fused) with learning rate `self.lr`, and gradients zeroed right after
    the optimizer step, as the plan was measured. (Lightning's own loop zeroes them after the next
    step's forward, so the last step's gradients would live through that forward.)"""

    lr = 1e-3

    def configure_optimizers(self):
        cfg = ckptune.training_config(PLAN)
        return cfg.optimizer_class(self.parameters(), lr=self.lr, **cfg.optimizer_kwargs)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        optimizer.zero_grad(set_to_none=ckptune.training_config(PLAN).set_to_none)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        pass  # done in optimizer_step


def make_trainer(**trainer_args):
    """A Trainer with the plan's precision and accumulation; feed it batches of 1 samples."""
    return L.Trainer(precision="32-true", accumulate_grad_batches=1, callbacks=[CkptunePlan()],
                     **trainer_args)
