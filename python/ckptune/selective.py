"""Selective checkpointing's policies, as ckptune's runtime applies them (kernels/csrc/sac.cpp):
which operators' outputs a selective module's forward keeps, so that its recompute computes
only the rest, through `torch.utils.checkpoint`'s `create_selective_checkpoint_contexts`:
`matmul` keeps matrix products and attention kernels, `attention` recomputes the attention core
only (docs/memory-model.md, "Selective checkpointing")."""

import functools
import inspect
from typing import Any, Callable, FrozenSet

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

# The `matmul` policy (torchtitan's `op` policy without its every-other-mm rule): the outputs of
# matrix products, which every `linear` and `matmul` becomes below autograd, and of the
# scaled-dot-product attention kernels are kept; everything else is recomputed. The same
# names, every overload, as sac.cpp's `matmul_class` (python/tests/test_selective.py compares).
ATTENTION_KERNELS: FrozenSet[str] = frozenset({
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
})
MATMUL_OPS: FrozenSet[str] = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}) | ATTENTION_KERNELS

# Operators that make a tensor without computing its values from their inputs' values: the
# `attention` policy recomputes them (cheap, and often filled in place afterwards, as the CPU's
# dropout fills an `empty_like` with `bernoulli_`, a fill then recomputed with them). sac.cpp's
# `factories`, compared by python/tests/test_selective.py.
FACTORIES: FrozenSet[str] = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
    "aten::zeros", "aten::zeros_like", "aten::new_zeros", "aten::ones", "aten::ones_like", "aten::new_ones",
    "aten::full", "aten::full_like", "aten::new_full", "aten::scalar_tensor", "aten::arange",
})

POLICIES = ("matmul", "attention")


def _op_name(func: Any) -> str:
    """`aten::mm` for `torch.ops.aten.mm.default` (any overload); "" for what is not an operator."""
    schema = getattr(func, "_schema", None)
    return str(schema.name) if schema is not None else ""


def _matmul_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if _op_name(func) in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _score_shaped(x: Any) -> bool:
    """Whether `x` has the attention-score shape [..., s, s]: three dimensions or more, the last
    two equal."""
    return isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[-1] == x.shape[-2]


class _AttentionPolicy:
    """Megatron's "recompute the attention core only", decided per call from the operator, its
    inputs and its outputs (`ctx.op_output`), as sac.cpp's `attention_keeps` decides it. One per
    checkpointed call (it remembers the storages of what that forward kept). An operator writing
    an input in place follows that input: kept when its storage holds a kept output (the recompute
    must not write it twice), recomputed otherwise. Otherwise recomputed are the fused attention
    kernels, every operator reading or writing a tensor of the score shape (q@k^T, its scale, the
    mask's add, softmax and its casts, dropout, probabilities@v), random operators (so the
    recompute draws the forward's numbers in order), pointwise operators (cheap, and many),
    factories and views (keeping them keeps nothing); every other operator's outputs are kept:
    matrix products, norms, reductions, concatenations. Higher-order operators, which ckptune's
    runtime never meets (torchtitan's flex attention), are recomputed."""

    def __init__(self) -> None:
        self.kept_storages: set = set()

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = self._keeps(ctx, func, args, kwargs)
        if keep:
            self.kept_storages.update(_storage(x) for x in tree_leaves(ctx.op_output) if isinstance(x, torch.Tensor))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def _keeps(self, ctx: Any, func: Any, args: tuple, kwargs: dict) -> bool:
        schema = getattr(func, "_schema", None)
        if schema is None:  # not an aten operator: a higher-order one such as flex attention
            return False
        written = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        written = [x for x in written if isinstance(x, torch.Tensor)]
        if written:
            return any(_storage(x) in self.kept_storages for x in written)
        return not (
            _op_name(func) in ATTENTION_KERNELS | FACTORIES
            or any(_score_shaped(x) for x in tree_leaves((args, kwargs, ctx.op_output)))
            or torch.Tag.nondeterministic_seeded in func.tags
            or torch.Tag.pointwise in func.tags
            or any(r.alias_info is not None for r in schema.returns)
        )


def _storage(x: torch.Tensor) -> int:
    return x.untyped_storage()._cdata


def policy_fn(policy: str) -> Callable[..., CheckpointPolicy]:
    """The policy function for `create_selective_checkpoint_contexts` named `policy`; for
    `attention` a new one, for one checkpointed call, to be used with
    `allow_cache_entry_mutation=True` (`context_fn` does both)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown selective checkpointing policy {policy!r}; known: {', '.join(POLICIES)}")
    if policy == "attention" and not _sees_outputs():
        raise ValueError(f"the selective policy 'attention' decides from an operator's outputs, which this torch "
                         f"{torch.__version__} does not show a policy (SelectiveCheckpointContext.op_output); "
                         "upgrade torch, or re-plan with --selective matmul")
    return _AttentionPolicy() if policy == "attention" else _matmul_policy


def _sees_outputs() -> bool:
    """Whether this torch calls a policy after the operator ran, with its outputs (2.13 does)."""
    return "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def context_fn(policy: str) -> Callable[[], Any]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
    context_fn=..., early_stop=False)` running a module selective under `policy`. Pass
    `early_stop=False` for the plan's memory: stopped early, the recompute leaves the kept outputs
    of the operators after the backward's last need (a layer's last matmul) in the cache until the
    module's backward ends. Under `attention`, each call gets its own policy, and a kept output the
    block then writes in place is taken as written (`allow_cache_entry_mutation=True`; the write
    is kept too, so the recompute does not write it twice)."""
    policy_fn(policy)  # refuses an unknown policy, or one this torch cannot run, now
    if policy == "attention":
        return lambda: create_selective_checkpoint_contexts(_AttentionPolicy(), allow_cache_entry_mutation=True)
    return functools.partial(create_selective_checkpoint_contexts, _matmul_policy)


def supported() -> bool:
    """Whether this torch has selective checkpointing (2.4 and later)."""
    return hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")
