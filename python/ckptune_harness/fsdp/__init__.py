"""A real PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) training step on the CPU, on N
processes, each rank's exact CPU tensor memory measured with ckptune's counting allocator: the
measurements a sharded memory model (`ckptune plan --shard N`) is derived from and checked
against (docs/fsdp.md). `run` from Python, `python -m ckptune_harness.fsdp` from a shell (cli.py).

Each rank is its own process (gloo over 127.0.0.1; the rendezvous port is the OS's choice
unless `port` is given). A rank installs the meter before it allocates anything, builds the
model from the same seed as every other rank, applies `fully_shard` to every candidate layer
(`encoder.layer.N`, `layerK`, `h.N`, `model.layers.N`, or `shard_regex`) and then to a root
module whose forward is the loss, checkpoints the modules the checkpoint regex matches (as
`ckptune.apply` does), and runs warm-up and measured steps of the loop ckptune models. The
meter's levels are taken at named moments and its peak per phase. The collectives are FSDP's
own, made to return only once gloo has let go of their memory, so that a step's peak does not
depend on thread scheduling (comms.py).

The result (JSON, format `FORMAT`) has the parameters with their shapes, units and each rank's
local shard, the per-unit byte sizes FSDP's buffers take (`unit_bytes`), and per rank: the levels
after process-group init, model build, sharding, optimizer construction and the first step (the
optimizer state exists from then on); per step the levels at its start, after forward, backward
and the optimizer step and at its end, and the peaks of the forward (batch included), the
backward and the optimizer step; `peak_bytes`, the highest measured step; whether the process
group was destroyed. `trace` adds the level and the peak since the previous event at each of
FSDP's transitions of the last step (all-gather, copy-out, reshard, pre/post-backward); it
allocates nothing. docs/fsdp.md is what these show.

Every path out of `run` (success, a failing rank, the timeout, Ctrl-C) kills and reaps the
rank processes before it returns or raises; a rank also dies with the process that started it
(Linux parent-death signal), should that one be killed outright.

One module per job; imports go one way (cli.py → runner.py and rank.py → the rest):

- runner.py: `run`, from the caller's arguments to the result.
- spec.py: `RunSpec`, the typed options every rank gets, and their JSON file.
- model.py: the model a rank trains (a reference or a callable), its units and checkpoints.
- launch.py: the rendezvous store and the N processes, reaped on every path.
- rank.py: one rank: meter, process group, `fully_shard`, the measured steps.
- comms.py, trace.py: the settled collectives; the meter at FSDP's transitions.
- shards.py: FSDP2's dim-0 shard arithmetic and what shards occupy.
- errors.py: FsdpError, FsdpTimeout, GlooUnavailable.
- cli.py (`__main__.py`): the command line, and the ranks' entry point.
"""

from .errors import FsdpError, FsdpTimeout, GlooUnavailable, gloo_available
from .runner import FORMAT, run
from .shards import local_shard_numel, padded_shard_numel, unit_bytes
from .spec import RunSpec

__all__ = ["FORMAT", "FsdpError", "FsdpTimeout", "GlooUnavailable", "RunSpec", "gloo_available",
           "local_shard_numel", "padded_shard_numel", "run", "unit_bytes"]
