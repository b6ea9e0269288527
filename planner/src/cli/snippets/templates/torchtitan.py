${header}# Needs torchtitan. torchtitan applies activation checkpointing per transformer block of its own
# model (`layers.N`) through `Trainer.Config(activation_checkpoint=...)`: FullAC (every block
# recomputed whole), SelectiveAC (per-op, every block), MemoryBudgetAC (compiler) or None. None
# of them checkpoints a subset of blocks or modules, so a plan naming one is expressed by a
# FullAC subclass that wraps just those modules with the same wrapper FullAC uses.
# torchtitan's Llama is not the Hugging Face Llama ckptune measured (flex attention, fused
# qkv): the plan's choice of modules carries over, its predicted bytes do not; measure there.
${choice_comment}from dataclasses import dataclass, field

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


${selective_class}# In your config_registry function: Trainer.Config(..., activation_checkpoint=ACTIVATION_CHECKPOINT)
ACTIVATION_CHECKPOINT = ${activation_checkpoint}

# TrainingConfig fields (torchtitan.config.TrainingConfig) for the plan's batch and precision.
TRAINING = {
${training_fields}}

# The plan's optimizer is ${optimizer}; torchtitan's default_adamw(lr=..., **OPTIMIZER_KWARGS) builds AdamW with
# the implementation the plan measured (other optimizers: ParamGroupConfig(optimizer_name=...)).
OPTIMIZER_KWARGS = ${optimizer_kwargs}

${apply_plan}
