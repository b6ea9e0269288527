"""FSDP2's shard arithmetic: each parameter is split on dim 0 with `torch.chunk` and every rank
stores a shard padded to the first (largest) chunk; the bytes this gives each unit's buffers, and
what a rank's sharded tensors occupy."""

import math

import torch


def padded_shard_numel(shape, world_size):
    """Elements one rank stores for a parameter of `shape`: FSDP2 shards each parameter on dim 0
    with `torch.chunk`, so every rank's shard is padded to ceil(dim0 / N) rows (rank 0's chunk,
    the largest), whatever its own chunk holds."""
    shape = list(shape)
    if not shape:
        return 1
    rest = math.prod(shape[1:])
    return -(-shape[0] // world_size) * rest


def local_shard_numel(shape, world_size, rank):
    """Elements of rank `rank`'s own (unpadded) chunk: what the optimizer state and the sharded
    gradient of that parameter hold on that rank."""
    shape = list(shape)
    if not shape:
        return 1 if rank == 0 else 0
    rows = -(-shape[0] // world_size)
    mine = max(0, min(rows, shape[0] - rows * rank))
    return mine * math.prod(shape[1:])


def unit_bytes(params, world_size):
    """Per FSDP unit ("<root>" too), from the parameter shapes: `unsharded` (the parameters'
    bytes), `padded_unsharded` (N x the padded shard: the all-gather buffer and the unsharded
    parameters FSDP allocates, also the reduce-scatter input), `shard` (one rank's padded shard:
    its sharded parameters and its sharded-gradient buffer), and `local` per rank (the unpadded
    chunk: its optimizer state per state tensor)."""
    out = {}
    for p in params:
        es = torch.empty(0, dtype=getattr(torch, p["dtype"])).element_size()
        u = out.setdefault(p["unit"], {"unsharded": 0, "padded_unsharded": 0, "shard": 0,
                                       "local": [0] * world_size, "params": 0})
        shard = padded_shard_numel(p["shape"], world_size) * es
        u["params"] += 1
        u["unsharded"] += math.prod(p["shape"]) * es
        u["shard"] += shard
        u["padded_unsharded"] += shard * world_size
        for r in range(world_size):
            u["local"][r] += local_shard_numel(p["shape"], world_size, r) * es
    return out


def local(t):
    """A rank's own tensor of `t`: a DTensor's local shard, any other tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storage_bytes(tensors):
    """Bytes of the distinct storages under `tensors` (DTensors by their local tensors)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = local(t).untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total
