"""What one rank of an FSDP run does, in its own process: install the meter before it allocates
anything, join the gloo group, build the model from the same seed as every other rank, apply
`fully_shard` to every unit and then to a root whose forward is the loss, checkpoint the regex's
modules (as `ckptune.apply` does), and run warm-up and measured steps of the loop ckptune models
(docs/memory-model.md: batch and loss alive through the optimizer step, `zero_grad(set_to_none=
True)` after it), reading the meter at named moments and its peak per phase."""

import datetime
import os
import sys
import time
import traceback
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ckptune import training_config

from .. import host_memory
from .. import meter as meter_mod
from .. import reference
from ..lifetime import die_with_parent
from ..output import optimizer_settings, write_atomic
from ..plans import regex_plan
from .comms import settled_comms
from .model import Loss, build_model, checkpoint_modules, find_units, units_regex
from .shards import local, storage_bytes
from .spec import RunSpec, rank_file
from .trace import SegmentMeter, trace_transitions


class _Sharded(NamedTuple):
    """The model as FSDP holds it: its groups bottom-up (the units, then "<root>", the root), the
    parameter table, what was checkpointed, and the settled collectives."""

    groups: List[Tuple[str, nn.Module]]
    shard_regex: Optional[str]
    unit_names: List[str]
    params: List[Dict[str, Any]]
    checkpointed: List[str]
    settle: Optional[tuple]


def worker_main(spec_path, rank):
    """`python -m ckptune_harness.fsdp --worker SPEC RANK`: runs the rank and writes its result
    (or its traceback, then re-raises) beside the spec."""
    spec = RunSpec.read(spec_path)
    die_with_parent(spec.parent)
    out_dir = os.path.dirname(spec_path)
    try:
        result = _rank(spec, rank)
    except BaseException as e:  # noqa: BLE001  (reported to the parent, then re-raised)
        error = {"time": time.time(), "traceback": "".join(traceback.format_exception(e))}
        write_atomic(rank_file(out_dir, rank, "error"), error)
        raise
    write_atomic(rank_file(out_dir, rank, "json"), result)
    return 0


def _rank(spec, rank):
    torch.set_num_threads(1)
    meter = SegmentMeter(meter_mod.Meter(spec.meter))  # before this process allocates any tensor
    host_memory.hold()
    levels = {"baseline": meter.current()}

    import torch.distributed as dist  # noqa: PLC0415

    for p in spec.sys_path:
        if p not in sys.path:
            sys.path.append(p)  # the parent's: where a model callable's module is found

    timeout = datetime.timedelta(seconds=spec.timeout)
    store = dist.TCPStore("127.0.0.1", spec.port, None, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
    try:
        result = _train(spec, rank, meter, levels)
        dist.barrier()  # no rank tears the group down while a peer still needs it
    finally:
        dist.destroy_process_group()
    result["process_group_destroyed"] = not dist.is_initialized()
    result["pid"] = os.getpid()
    return result


def _train(spec, rank, meter, levels):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (spec.world_size,))
    levels["after_init"] = meter.current()

    ref = reference.load(spec.root)
    torch.manual_seed(spec.seed)  # the same parameters on every rank, as FSDP requires
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data, as in data parallelism
    built = build_model(spec, ref, gen)
    built.model.train()
    task = Loss(built.model, built.loss_of)
    levels["after_build"] = meter.current()

    s = _shard(spec, built, task, mesh, meter)
    levels["after_shard"] = meter.current()
    for entry, p in zip(s.params, task.parameters()):  # named_parameters' order, unchanged by sharding
        entry["local_shape"] = list(local(p).shape)
        entry["local_storage_bytes"] = local(p).untyped_storage().nbytes()
    sharded_param_bytes = storage_bytes(task.parameters())

    cfg = training_config(regex_plan(spec.regex, s.checkpointed, precision=spec.precision,
                                     optimizer=spec.optimizer, micro_batch=spec.micro_batch))
    opt = cfg.optimizer_class(task.parameters(), lr=spec.lr, **cfg.optimizer_kwargs)
    levels["after_optimizer_init"] = meter.current()

    events = []
    if spec.trace:
        trace_transitions(s.groups, meter, events)
    records = []
    for i in range(spec.steps):
        records.append(_step(i + 1, spec, task, built.make_batch, opt, cfg, meter, events))
        if i == 0:
            levels["after_optimizer_state"] = meter.current()
    result = _result(spec, rank, ref, built, s, opt, cfg, levels, sharded_param_bytes, records)
    if spec.trace:
        result["trace"] = events
    return result


def _shard(spec, built, task, mesh, meter):
    """`fully_shard` on each unit, bottom-up, then on the root; the settled collectives; the
    checkpoint wrappers."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    shard_regex = units_regex(spec, built.family_units)
    units = find_units(built.backbone, shard_regex)
    params = _param_table(task, units, built.prefix)
    groups = []
    for name, m in units:  # bottom-up: the units first, then the root takes the rest
        fully_shard(m, mesh=mesh, reshard_after_forward=spec.reshard_after_forward)
        groups.append((name, m))
    fully_shard(task, mesh=mesh)
    groups.append(("<root>", task))
    settle = settled_comms(meter) if spec.settle else None
    if settle:
        for _, m in groups:
            m.set_custom_all_gather(settle[0])
            m.set_custom_reduce_scatter(settle[1])
    checkpointed = checkpoint_modules(built.backbone, spec.regex) if spec.regex else []
    return _Sharded(groups, shard_regex, [name for name, _ in units], params, checkpointed, settle)


def _param_table(task, units, prefix):
    """Each parameter's name as plans write it (the backbone's, without the task wrapper's
    prefix; "<head>." before the others), shape, dtype and unit ("<root>" outside the units)."""
    head = "model." + prefix
    unit_of = {id(p): name for name, m in units for p in m.parameters()}
    return [{"name": name[len(head):] if name.startswith(head) else "<head>." + name[len("model."):],
             "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
             "unit": unit_of.get(id(p), "<root>")} for name, p in task.named_parameters()]


def _step(number, spec, task, make_batch, opt, cfg, meter, events):
    """One step: the levels at its start, after forward, backward and the optimizer step and at
    its end, and the peaks of the forward (batch included), the backward and the optimizer step.
    The batch and the loss stay alive through the optimizer step, as a loop's do."""
    del events[:]
    rec = {"step": number}
    meter.begin()
    rec["start"] = meter.current()
    batch = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_dtype is not None,
                        cache_enabled=spec.autocast_cache):
        loss = task(batch)
    events.append(["forward_end", "", meter.current(), meter.mark()])
    rec["after_forward"], rec["forward_peak"] = meter.current(), meter.high
    meter.begin()
    loss.backward()
    events.append(["backward_end", "", meter.current(), meter.mark()])
    rec["after_backward"], rec["backward_peak"] = meter.current(), meter.high
    rec["grad_storage_bytes"] = storage_bytes(p.grad for p in task.parameters())
    rec["loss"] = loss.item()
    meter.begin()
    opt.step()
    events.append(["optimizer_end", "", meter.current(), meter.mark()])
    rec["after_optimizer"], rec["optimizer_peak"] = meter.current(), meter.high
    opt.zero_grad(set_to_none=cfg.set_to_none)
    del loss, batch
    rec["after_step"] = meter.current()
    rec["peak"] = max(rec["forward_peak"], rec["backward_peak"], rec["optimizer_peak"])
    return rec


def _result(spec, rank, ref, built, s, opt, cfg, levels, sharded_param_bytes, records):
    """The rank's part of the run's result (the trace, when there is one, is added after)."""
    state_bytes = storage_bytes(t for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    timed = records[spec.warmup:]
    resnet = isinstance(built.model, ref.ResNet)
    result = {
        "rank": rank,
        "model": type(built.model).__name__,
        "image": (spec.image or 224) if resnet else None,  # `reference.batches`' default
        "seq": None if resnet or spec.model is None else reference.default_seq(built.model, built.backbone, spec.seq),
        "shard_regex": s.shard_regex,
        "units": s.unit_names,
        "checkpointed": s.checkpointed,
        "optimizer_class": f"{cfg.optimizer_class.__module__}.{cfg.optimizer_class.__name__}",
        "optimizer_kwargs": optimizer_settings(opt),
        "params": s.params,
        "levels": levels,
        "sharded_param_bytes": sharded_param_bytes,
        "optimizer_state_bytes": state_bytes,
        "steps": records,
        "peak_bytes": max(r["peak"] for r in timed),
    }
    if s.settle:
        result["settle"] = s.settle[2]
    if any(r["peak"] != timed[0]["peak"] for r in timed):
        result["peak_varies"] = [r["peak"] for r in timed]
    return result
