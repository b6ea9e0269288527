"""Apply a plan written by `ckptune plan -o plan.json` to your own PyTorch training code.

The planner chose which modules to checkpoint and the training configuration on measurements of
the same module names PyTorch uses; this package turns that plan back into PyTorch: `apply`
wraps the chosen modules in `torch.utils.checkpoint` (selectively where the plan says so:
`selective_context_fn`; `selective_policy` says which policy a wrapped module runs),
`training_config` gives the dtypes,
optimizer and batch settings the plan's memory prediction assumed,
`chunked_causal_lm_loss` computes a language model's loss in the chunks a plan may choose, and
`optimizer_in_backward` steps each parameter in backward, as a plan may choose.
"""

from .checkpointing import apply, plan_root, selective_policy, wrapped_modules
from .in_backward import OptimizerInBackward, optimizer_in_backward
from .loss import chunked_causal_lm_loss
from .plan import FORMAT, load_plan
from .selective import context_fn as selective_context_fn
from .training import TrainingConfig, training_config

__all__ = [
    "FORMAT",
    "OptimizerInBackward",
    "TrainingConfig",
    "apply",
    "chunked_causal_lm_loss",
    "load_plan",
    "optimizer_in_backward",
    "plan_root",
    "selective_context_fn",
    "selective_policy",
    "training_config",
    "wrapped_modules",
]
__version__ = "0.1.0"
