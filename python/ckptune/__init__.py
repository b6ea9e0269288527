"""Apply a plan written by `ckptune plan -o plan.json` to your own PyTorch training code.

The planner chose which modules to checkpoint and the training configuration on measurements of
the same module names PyTorch uses; this package turns that plan back into PyTorch: `apply`
wraps the chosen modules in `torch.utils.checkpoint`, `training_config` gives the dtypes,
optimizer and batch settings the plan's memory prediction assumed.
"""

from .checkpointing import apply, plan_root
from .plan import FORMAT, load_plan
from .training import TrainingConfig, training_config

__all__ = ["FORMAT", "TrainingConfig", "apply", "load_plan", "plan_root", "training_config"]
__version__ = "0.1.0"
