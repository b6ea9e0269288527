"""`run`: an FSDP2 training step on N CPU processes, from the caller's arguments to the run's
result (format `FORMAT`)."""

import dataclasses
import os
import sys

import torch

from .. import meter as meter_mod
from .errors import FsdpError, GlooUnavailable, gloo_available
from .launch import launch
from .model import with_model
from .shards import unit_bytes
from .spec import make_spec

FORMAT = "ckptune.fsdp-run/1"

# The spec's fields a result repeats, in its order.
_ECHOED = ("world_size", "precision", "optimizer", "micro_batch", "reshard_after_forward", "regex", "steps",
           "warmup", "config", "seed", "port", "settle", "autocast_cache")


def run(model, *, config=None, regex="", world_size=2, precision="fp32", optimizer="adamw", micro_batch=2,
        image=None, seq=None, reshard_after_forward=True, shard_regex=None, steps=3, warmup=1, lr=1e-3,
        trace=False, settle=True, timeout=600.0, port=0, root=None, seed=0, autocast_cache=True):
    """Runs an FSDP2 training step on `world_size` CPU processes and returns the measurements (a
    dict, format `FORMAT`, one entry per rank under "ranks").

    `model` is a reference name (models/fixtures/reference.py: "tiny-bert", "tiny-resnet", ...,
    with `config` overriding fields of its config: BERT/GPT-2/Llama config fields, or for a ResNet
    `layers`, `inplanes`, `num_classes`, `block` ("basic"/"bottleneck")), or a picklable callable
    `fn(micro_batch, generator) -> (module, make_batch, loss_of)` (`make_batch()` returns a batch,
    `loss_of(batch)` the loss computed with `module`); it runs in each rank. `regex` selects the
    modules to checkpoint and `shard_regex` the FSDP units (both full matches over the backbone's
    module names; a callable's module has no default units). `precision` is "fp32" or "bf16" (CPU
    autocast, fp32 parameters); `optimizer` "adamw" or "sgd-momentum" (foreach=False).
    `reshard_after_forward` applies to the units; the root keeps FSDP's default (its parameters
    stay unsharded from its forward to its backward). `settle` makes each all-gather and
    reduce-scatter return only once gloo has freed what it allocated for it (see
    `comms.settled_comms`); without it, gloo's worker thread can free a collective's temporaries
    late, at a moment that depends on thread scheduling, and peaks vary between steps and runs.
    `autocast_cache=False` enters bf16 autocast with `cache_enabled=False`, the loop ckptune
    plans (docs/memory-model.md): with the cache, each weight's bf16 copy lives until autocast
    exits.

    Raises ValueError for bad arguments, GlooUnavailable without gloo, FsdpTimeout after `timeout`
    seconds, FsdpError when a rank fails (with that rank's traceback) or `port` is taken.
    """
    if not gloo_available():
        raise GlooUnavailable("torch.distributed with the gloo backend is not available in this torch build "
                              f"({torch.__version__}); the FSDP harness needs it")
    spec = make_spec(
        config=config, regex=regex, world_size=world_size, precision=precision, optimizer=optimizer,
        micro_batch=micro_batch, image=image, seq=seq, reshard_after_forward=reshard_after_forward,
        shard_regex=shard_regex, steps=steps, warmup=warmup, lr=lr, trace=trace, settle=settle,
        autocast_cache=autocast_cache, seed=seed, timeout=timeout, port=port, root=root or meter_mod.ROOT,
        parent=os.getpid(), sys_path=sys.path,
    )
    spec = with_model(spec, model)
    try:
        spec = dataclasses.replace(spec, meter=meter_mod.build())  # once here, not N compiles racing
    except SystemExit as e:  # the meter's own message (a missing checkout, a failed compile)
        raise FsdpError(str(e)) from None
    return _result(launch(spec))


def _result(launched):
    """The run's result: the spec's settings, the parameters and units as rank 0 saw them, the
    bytes per unit, and every rank's own measurements."""
    spec, ranks, pids = launched
    first = ranks[0]
    out = {k: getattr(spec, k) for k in _ECHOED}
    out.update({"format": FORMAT, "torch": torch.__version__, "model": spec.model or first["model"],
                "image": first["image"], "seq": first["seq"], "shard_regex": first["shard_regex"],
                "optimizer_class": first["optimizer_class"], "optimizer_kwargs": first["optimizer_kwargs"],
                "units": first["units"], "checkpointed": first["checkpointed"], "params": first["params"],
                "unit_bytes": unit_bytes(first["params"], spec.world_size),
                "pids": pids, "peak_bytes": [r["peak_bytes"] for r in ranks], "ranks": ranks})
    return out
