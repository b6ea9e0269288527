"""FSDP's collectives, made to return only once gloo has let go of their memory, so that a
step's peak does not depend on thread scheduling."""

import time

import torch


def settled_comms(meter):
    """(all-gather, reduce-scatter, counts): FSDP's default collectives (the same buffers,
    allocated the same way, the same gloo calls) that return only once gloo holds nothing of
    the collective any more: the meter is back at its level before the call (gloo's temporary
    is freed) and the caller's tensors have their reference counts from before the call (gloo's
    views of them are gone).

    Gloo runs a collective on a worker thread, which marks the work done (waking the caller)
    and lets go of the work a moment later; the work holds a temporary of the full size (the
    all-gather's output, the reduce-scatter's input) and views of the caller's tensors, which
    keep FSDP's buffer alive after FSDP drops it. Under CPU contention that moment comes late,
    and a step's peak then depends on thread scheduling (peaks that differ between steps and
    ranks). The caller's buffers exist before the call, so both conditions hold once gloo is
    done; waiting for them pins gloo's release to the collective's end. Nothing else allocates
    meanwhile: the caller waits, and CPU autograd runs in the caller's thread. `counts` records
    how often the wait was needed (`waited`) and how often it gave up after 10 s (`unsettled`,
    which leaves that release unpinned)."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: PLC0415

    counts = {"all_gathers": 0, "reduce_scatters": 0, "waited": 0, "unsettled": 0}
    settle = _settler(meter, counts)

    class SettledAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            tensors = (output_tensor, input_tensor)
            level, uses = meter.current(), [t._use_count() for t in tensors]
            work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            counts["all_gathers"] += 1
            if work is None:  # synchronous: the data is there, only gloo's references linger
                settle(level, tensors, uses)
            return work

    class SettledReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            tensors = (output_tensor, input_tensor)
            level, uses = meter.current(), [t._use_count() for t in tensors]
            work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                              async_op=async_op)
            counts["reduce_scatters"] += 1
            if work is None:
                settle(level, tensors, uses)
            return work

    return SettledAllGather(), SettledReduceScatter(), counts


def _settler(meter, counts):
    """`settle(level, tensors, uses)`: waits until the meter is at or below `level` and each of
    `tensors` has at most its count in `uses`, at most 10 s, counting the waits in `counts`."""

    def settled(level, tensors, uses):
        return meter.current() <= level and all(t._use_count() <= u for t, u in zip(tensors, uses))

    def settle(level, tensors, uses):
        if settled(level, tensors, uses):
            return
        counts["waited"] += 1
        deadline = time.monotonic() + 10.0
        while not settled(level, tensors, uses):
            if time.monotonic() > deadline:
                counts["unsettled"] += 1
                return
            time.sleep(0.0001)

    return settle
