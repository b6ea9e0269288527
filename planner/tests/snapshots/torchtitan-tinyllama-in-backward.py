# torchtitan with the ckptune plan for tinyllama-1.1b (ckptune 0.1.0).
#   checkpoint: model.layers.7, model.layers.9, model.layers.12, model.layers.13, model.layers.20 (regex ^(?:model\.layers\.(?:7|9|12|13|20))$)
#   config fp32/adamw/mb1x1/in-bwd: precision fp32, optimizer adamw, micro-batch 1, gradient accumulation 1, set_to_none true
#   optimizer step in backward: each parameter updated as soon as its gradient is complete, in its post-accumulate-grad hook, its gradient freed there (ckptune.optimizer_in_backward)
#   inputs: sequences of 1024 tokens
#   predicted peak 17.94 GiB (19,264,194,156 B) of the budget 18.04 GiB (19,367,044,016 B), measured on cpu, threads: 2
# NOT EXPRESSED: the plan steps the optimizer in backward (`ckptune.optimizer_in_backward`); torchtitan's train loop steps it after backward, holding every parameter gradient at once, so it can peak above the plan's prediction. `ckptune emit python` writes a loop that steps in backward.
# Needs torchtitan. torchtitan applies activation checkpointing per transformer block of its own
# model (`layers.N`) through `Trainer.Config(activation_checkpoint=...)`: FullAC (every block
# recomputed whole), SelectiveAC (per-op, every block), MemoryBudgetAC (compiler) or None. None
# of them checkpoints a subset of blocks or modules, so a plan naming one is expressed by a
# FullAC subclass that wraps just those modules with the same wrapper FullAC uses.
# torchtitan's Llama is not the Hugging Face Llama ckptune measured (flex attention, fused
# qkv): the plan's choice of modules carries over, its predicted bytes do not; measure there.
from dataclasses import dataclass, field

from torchtitan.distributed.activation_checkpoint import FullAC


class CkptunePlanAC(FullAC):
    """FullAC's checkpoint wrapper on the listed modules of torchtitan's model only."""

    @dataclass(kw_only=True, slots=True)
    class Config(FullAC.Config):
        modules: list[str] = field(default_factory=list)
        """torchtitan module names to checkpoint (`layers.3`, `layers.5.feed_forward`)."""

    def apply(self, model):
        for fqn in self.config.modules:
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            parent.register_module(child, self._wrap_block(parent.get_submodule(child), base_fqn=fqn))


# In your config_registry function: Trainer.Config(..., activation_checkpoint=ACTIVATION_CHECKPOINT)
ACTIVATION_CHECKPOINT = CkptunePlanAC.Config(modules=["layers.7", "layers.9", "layers.12", "layers.13", "layers.20"])

# TrainingConfig fields (torchtitan.config.TrainingConfig) for the plan's batch and precision.
TRAINING = {
    "local_batch_size": 1,
    "global_batch_size": 1,  # on one data-parallel rank: x the DP degree
    "seq_len": 1024,
    "dtype": "float32",
    "mixed_precision_param": "float32",
}

# The plan's optimizer is adamw; torchtitan's default_adamw(lr=..., **OPTIMIZER_KWARGS) builds AdamW with
# the implementation the plan measured (other optimizers: ParamGroupConfig(optimizer_name=...)).
OPTIMIZER_KWARGS = {"foreach": False}



def apply_plan(config):
    """Sets the plan's activation checkpointing, batch and precision on a torchtitan Trainer.Config."""
    config.activation_checkpoint = ACTIVATION_CHECKPOINT
    for name, value in TRAINING.items():
        setattr(config.training, name, value)
    return config
