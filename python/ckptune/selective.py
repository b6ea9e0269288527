"""Selective checkpointing's policies, as ckptune's runtime applies them (kernels/csrc/sac.cpp):
which operators' outputs a selective module's forward keeps, so that its recompute computes
only the rest, through `torch.utils.checkpoint`'s `create_selective_checkpoint_contexts`."""

import functools
from typing import Any, Callable, FrozenSet

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# The `matmul` policy (torchtitan's `op` policy without its every-other-mm rule): the outputs of
# matrix products, which every `linear` and `matmul` becomes below autograd, and of the
# scaled-dot-product attention kernels are kept; everything else is recomputed. The same
# names, every overload, as sac.cpp's `matmul_class` (python/tests/test_selective.py compares).
MATMUL_OPS: FrozenSet[str] = frozenset({
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
})

POLICIES = ("matmul",)


def _op_name(func: Any) -> str:
    """`aten::mm` for `torch.ops.aten.mm.default` (any overload); "" for what is not an operator."""
    schema = getattr(func, "_schema", None)
    return str(schema.name) if schema is not None else ""


def _matmul_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if _op_name(func) in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def policy_fn(policy: str) -> Callable[..., CheckpointPolicy]:
    """The policy function for `create_selective_checkpoint_contexts` named `policy`."""
    if policy not in POLICIES:
        raise ValueError(f"unknown selective checkpointing policy {policy!r}; known: {', '.join(POLICIES)}")
    return _matmul_policy


def context_fn(policy: str) -> Callable[[], Any]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
    context_fn=..., early_stop=False)` running a module selective under `policy`. Pass
    `early_stop=False` for the plan's memory: stopped early, the recompute leaves the kept outputs
    of the operators after the backward's last need (a layer's last matmul) in the cache until the
    module's backward ends."""
    return functools.partial(create_selective_checkpoint_contexts, policy_fn(policy))


def supported() -> bool:
    """Whether this torch has selective checkpointing (2.4 and later)."""
    return hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")
