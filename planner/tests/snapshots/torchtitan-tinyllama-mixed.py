# torchtitan with the ckptune plan for tinyllama-1.1b (ckptune 0.1.0).
#   checkpoint: model.layers.7, model.layers.9, model.layers.12, model.layers.13, model.layers.20 (regex ^(?:model\.layers\.(?:7|9|12|13|20))$)
#   of them selective (policy matmul: matmul and attention outputs kept, the rest recomputed): model.layers.9
#   of them selective (policy attention: the attention core and pointwise operators recomputed, the rest kept): model.layers.13
#   config fp32/adamw/mb1x1: precision fp32, optimizer adamw, micro-batch 1, gradient accumulation 1, set_to_none true
#   inputs: sequences of 1024 tokens
#   predicted peak 17.94 GiB (19,264,194,156 B) of the budget 18.04 GiB (19,367,044,016 B), measured on cpu, threads: 2
# Needs torchtitan. torchtitan applies activation checkpointing per transformer block of its own
# model (`layers.N`) through `Trainer.Config(activation_checkpoint=...)`: FullAC (every block
# recomputed whole), SelectiveAC (per-op, every block), MemoryBudgetAC (compiler) or None. None
# of them checkpoints a subset of blocks or modules, so a plan naming one is expressed by a
# FullAC subclass that wraps just those modules with the same wrapper FullAC uses.
# torchtitan's Llama is not the Hugging Face Llama ckptune measured (flex attention, fused
# qkv): the plan's choice of modules carries over, its predicted bytes do not; measure there.
# The plan runs these modules selective under its matmul policy
# (matmul and attention outputs kept, the rest recomputed): layers.9.
# The plan runs these modules selective under its attention policy
# (the attention core and pointwise operators recomputed, the rest kept): layers.13.
# It checkpoints these whole: layers.7, layers.12, layers.20.
# torchtitan's SelectiveAC runs every block under its own op policy (saving every other
# matmul), so CkptuneSelectivePlanAC below wraps the plan's selective modules with ckptune's
# policy instead. torchtitan's Llama attends with flex attention by default, a higher-order
# operator either policy recomputes.
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


import ckptune
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


class CkptuneSelectivePlanAC(CkptunePlanAC):
    """CkptunePlanAC, with the plan's selective modules wrapped as SelectiveAC wraps a block but
    each under the plan's policy for it (ckptune.selective_context_fn), which chooses the
    operators whose outputs are kept."""

    @dataclass(kw_only=True, slots=True)
    class Config(CkptunePlanAC.Config):
        selective: dict[str, str] = field(default_factory=dict)
        """torchtitan module names to run selective, each with its policy (matmul, attention)."""

    def apply(self, model):
        super().apply(model)
        for fqn, policy in self.config.selective.items():
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            wrapped = checkpoint_wrapper(
                parent.get_submodule(child),
                context_fn=ckptune.selective_context_fn(policy),
                preserve_rng_state=self.config.preserve_rng_state,
                determinism_check=self.config.determinism_check,
                early_stop=False,
                debug=self.config.debug,
            )
            parent.register_module(child, wrapped)

# In your config_registry function: Trainer.Config(..., activation_checkpoint=ACTIVATION_CHECKPOINT)
ACTIVATION_CHECKPOINT = CkptuneSelectivePlanAC.Config(modules=["layers.7", "layers.12", "layers.20"], selective={"layers.9": "matmul", "layers.13": "attention"})

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
