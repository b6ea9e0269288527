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


