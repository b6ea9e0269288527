# Lightning with the ckptune plan for resnet152 (ckptune 0.1.0).
#   checkpoint: layer1, layer2, layer3 (regex ^(?:layer1|layer2|layer3)$)
#   config bf16/adamw/mb4x1: precision bf16, optimizer adamw, micro-batch 4, gradient accumulation 1, set_to_none true
#   inputs: images 224x224
#   predicted peak 1.01 GiB (1,088,388,108 B) of the budget 1.02 GiB (1,096,590,090 B), measured on cpu, threads: 2
#   on the GPU (h100): predicted 1.02 GiB allocated, 1.21 GiB reserved by the caching allocator, plus 512.00 MiB of CUDA context
#   PyTorch's default PYTORCH_CUDA_ALLOC_CONF is the recommended setting: leave it unset.
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
    "checkpoint": {"regex": "^(?:layer1|layer2|layer3)$", "modules": ["layer1", "layer2", "layer3"]},
    "config": {"grad_accum": 1, "micro_batch": 4, "optimizer": "adamw", "optimizer_impl": "single", "precision": "bf16", "set_to_none": True},
}
# The plan's module names are those of the model ckptune planned (a torchvision ResNet, your exported module).
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
    """A Trainer with the plan's precision and accumulation; feed it batches of 4 samples."""
    return L.Trainer(precision="bf16-mixed", accumulate_grad_batches=1, callbacks=[CkptunePlan()],
                     **trainer_args)
