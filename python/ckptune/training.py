"""The plan's training configuration as the Python values a training loop needs."""

import types
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Type

import torch

from .plan import PlanLike, load_plan

# (autocast dtype, parameter dtype) per precision, as ckptune's runtime trains them.
_PRECISIONS = {
    "fp32": (None, torch.float32),
    "bf16": (torch.bfloat16, torch.float32),  # autocast; f32 parameters
    "fp16": (torch.float16, torch.float32),  # autocast; f32 parameters, dynamic loss scaling
    "bf16-pure": (None, torch.bfloat16),  # bf16 parameters, no autocast
}

# Hyper-parameters beyond the learning rate that change what the optimizer keeps in memory or
# computes; the rest are PyTorch's defaults, which ckptune's runtime uses too.
_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),  # the momentum buffer is planned for
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {"weight_decay": 1e-2}),  # PyTorch's default, stated
}

# Optimizers ckptune plans for that torch.optim lacks, and where to get them.
_ELSEWHERE = {
    "lion": "the lion-pytorch package (lion_pytorch.Lion) or bitsandbytes (bitsandbytes.optim.Lion)",
    "adam8bit": "the bitsandbytes package (bitsandbytes.optim.Adam8bit)",
    "adamw8bit": "the bitsandbytes package (bitsandbytes.optim.AdamW8bit)",
}

# `optimizer_impl` in a plan's config: which of PyTorch's implementations was measured. They
# differ in transient memory (foreach and fused allocate per-group temporaries).
_IMPLS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@dataclass(frozen=True)
class TrainingConfig:
    """What the plan's predicted peak assumed about the training loop.

    Build the optimizer as `optimizer_class(params, lr=..., **optimizer_kwargs)`, run forward
    and loss under `torch.autocast(device_type, dtype=autocast_dtype)` when `autocast_dtype` is
    not None, keep parameters in `param_dtype`, feed `micro_batch` samples per forward, step
    after `grad_accum` micro-batches, and call `zero_grad(set_to_none=set_to_none)`. For fp16,
    `grad_scaler` is True: scale the loss with `torch.amp.GradScaler`, as ckptune did.
    `autocast_cache` is the `cache_enabled` of that autocast region: True for a plan made for a
    trainer that keeps autocast's weight-cast cache on (the Hugging Face `Trainer`),
    whose peak counts the cached casts; False otherwise. When `loss_chunks` is above 1, compute
    a language model's loss with
    `ckptune.chunked_causal_lm_loss(hidden, lm_head.weight, labels, loss_chunks)` from the
    model's last hidden states instead of from its logits, inside that same region. When
    `optimizer_in_backward` is True, build the optimizer with
    `ckptune.optimizer_in_backward(model.parameters(), optimizer_class, lr=..., **optimizer_kwargs)`
    instead: each parameter is stepped in backward, and the loop calls no `step()` (nor
    `zero_grad`, nor any gradient clipping).
    """

    precision: str
    optimizer: str
    autocast_dtype: Optional[torch.dtype]
    param_dtype: torch.dtype
    optimizer_class: Type[torch.optim.Optimizer]
    # Read-only, so the frozen config cannot be changed through it; excluded from the hash.
    optimizer_kwargs: Mapping[str, Any] = field(hash=False)
    micro_batch: int
    grad_accum: int
    set_to_none: bool
    grad_scaler: bool
    autocast_cache: bool = False
    loss_chunks: int = 1
    optimizer_in_backward: bool = False


def training_config(plan: PlanLike) -> TrainingConfig:
    """The plan's `config` as Python values (see `TrainingConfig`).

    Raises ValueError for values this package cannot express with torch alone: an unknown
    precision or optimizer, or one torch.optim lacks (lion, adam8bit, adamw8bit; the message
    names the package that provides it, which is not imported here).
    """
    doc = load_plan(plan)
    try:
        config = doc["config"]
        precision, optimizer = config["precision"], config["optimizer"]
        micro_batch, grad_accum = int(config["micro_batch"]), int(config["grad_accum"])
        set_to_none = bool(config["set_to_none"])
        autocast_cache = bool(config.get("autocast_cache", False))
        loss_chunks = int(config.get("loss_chunks", 1))
        in_backward = bool(config.get("optimizer_in_backward", False))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"plan's config lacks {e}; re-plan with this ckptune") from None

    if in_backward and (grad_accum != 1 or not set_to_none or precision == "fp16"):
        raise ValueError("the plan steps the optimizer in backward with gradient accumulation, "
                         "set_to_none false or fp16, which cannot run so; re-plan with this ckptune")
    if loss_chunks < 1:
        raise ValueError(f"loss_chunks {loss_chunks} in the plan must be at least 1")
    if precision not in _PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} in the plan; expected one of "
                         f"{', '.join(_PRECISIONS)}")
    autocast_dtype, param_dtype = _PRECISIONS[precision]

    if optimizer in _ELSEWHERE:
        raise ValueError(f"optimizer {optimizer!r} is not in torch.optim; it is provided by "
                         f"{_ELSEWHERE[optimizer]}")
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r} in the plan; expected one of "
                         f"{', '.join(list(_OPTIMIZERS) + list(_ELSEWHERE))}")
    optimizer_class, kwargs = _OPTIMIZERS[optimizer]
    kwargs = dict(kwargs)
    if "optimizer_impl" in config:
        impl = config["optimizer_impl"]
        if impl not in _IMPLS:
            raise ValueError(f"unknown optimizer_impl {impl!r} in the plan; expected one of "
                             f"{', '.join(_IMPLS)}")
        kwargs.update(_IMPLS[impl])

    return TrainingConfig(
        precision=precision,
        optimizer=optimizer,
        autocast_dtype=autocast_dtype,
        param_dtype=param_dtype,
        optimizer_class=optimizer_class,
        optimizer_kwargs=types.MappingProxyType(kwargs),
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        set_to_none=set_to_none,
        grad_scaler=precision == "fp16",
        autocast_cache=autocast_cache and autocast_dtype is not None,
        loss_chunks=loss_chunks,
        optimizer_in_backward=in_backward,
    )
