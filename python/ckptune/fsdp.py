"""A real PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) training step on the CPU, on N
processes, each rank's exact CPU tensor memory measured with ckptune's counting allocator: the
measurements a sharded memory model (`ckptune plan --shard N`) is derived from and checked
against (docs/fsdp.md).

Each rank is its own process (gloo over 127.0.0.1; the rendezvous port is the OS's choice
unless `port` is given). A rank installs the meter before it allocates anything, builds the
model from the same seed as every other rank, applies `fully_shard` to every candidate layer
(`encoder.layer.N`, `layerK`, `h.N`, `model.layers.N`, or `shard_regex`) and then to a root
module whose forward is the loss, checkpoints the modules the checkpoint regex matches (as
`ckptune.apply` does), and runs warm-up and measured steps of the loop ckptune models
(docs/memory-model.md: batch and loss alive through the optimizer step, `zero_grad(set_to_none=
True)` after it). The meter's levels are taken at named moments and its peak per phase. The
collectives are FSDP's own, made to return only once gloo has let go of their memory, so that a
step's peak does not depend on thread scheduling (`_settled_comms`).

    python -m ckptune.fsdp --model tiny-bert --nproc 2 --seq 32 --micro-batch 4 \\
        --regex 'encoder\\.layer\\.0' -o run.json

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
(Linux parent-death signal), should that one be killed outright. With `--parent PID` the CLI
arms the same signal on itself (SIGTERM, then the cleanup above), for a caller that cannot:
`ckptune verify --pytorch` of a sharded plan passes its own pid.

Exit codes of the CLI: 0 done, 2 bad input or no gloo, 1 a rank failed or the run timed out.
"""

import argparse
import base64
import ctypes
import datetime
import functools
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
from torch import nn

from . import meter as meter_mod

FORMAT = "ckptune.fsdp-run/1"

# The layers each reference family shards as FSDP units, by the backbone's module names (the
# names plans use). Everything else (embeddings, stem, head) lands in the root's group.
_FAMILY_UNITS = {
    "ResNet": r"layer\d+",
    "BertForSequenceClassification": r"encoder\.layer\.\d+",
    "GPT2LMHeadModel": r"h\.\d+",
    "LlamaForCausalLM": r"model\.layers\.\d+",
}

_PRECISIONS = ("fp32", "bf16")
_OPTIMIZERS = ("adamw", "sgd-momentum")


class FsdpError(RuntimeError):
    """A run that did not complete. `pids` are the rank processes it started (all of them
    killed and reaped before this is raised); `rank` the failing rank, when one failed."""

    def __init__(self, message, pids=(), rank=None):
        super().__init__(message)
        self.pids = list(pids)
        self.rank = rank


class FsdpTimeout(FsdpError, TimeoutError):
    """The ranks did not finish within the run's timeout."""


class GlooUnavailable(RuntimeError):
    """This torch build has no torch.distributed or no gloo backend."""


def gloo_available():
    """Whether torch.distributed with the gloo backend can run here (the harness needs both)."""
    import torch.distributed as dist  # noqa: PLC0415

    return dist.is_available() and dist.is_gloo_available()


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


# ------------------------------------------------------------------------------ parent side


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
    `_settled_comms`); without it, gloo's worker thread can free a collective's temporaries late,
    at a moment that depends on thread scheduling, and peaks vary between steps and runs.
    `autocast_cache=False` enters bf16 autocast with `cache_enabled=False`, the loop ckptune
    plans (docs/memory-model.md): with the cache, each weight's bf16 copy lives until autocast
    exits.

    Raises ValueError for bad arguments, GlooUnavailable without gloo, FsdpTimeout after `timeout`
    seconds, FsdpError when a rank fails (with that rank's traceback) or `port` is taken.
    """
    if not gloo_available():
        raise GlooUnavailable("torch.distributed with the gloo backend is not available in this torch build "
                              f"({torch.__version__}); the FSDP harness needs it")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, found {world_size!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(_PRECISIONS)}")
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: expected one of {', '.join(_OPTIMIZERS)}")
    if steps <= warmup or warmup < 1:
        raise ValueError(f"need warmup >= 1 (the optimizer state is created in the first step) and steps > "
                         f"warmup, found steps {steps}, warmup {warmup}")
    for name, pattern in (("regex", regex), ("shard_regex", shard_regex)):
        if pattern:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{name} {pattern!r} is not a valid regex: {e}") from None

    spec = {
        "world_size": world_size, "precision": precision, "optimizer": optimizer, "micro_batch": int(micro_batch),
        "image": image, "seq": seq, "reshard_after_forward": bool(reshard_after_forward), "regex": regex or "",
        "shard_regex": shard_regex, "steps": int(steps), "warmup": int(warmup), "lr": lr, "trace": bool(trace),
        "settle": bool(settle),
        "autocast_cache": bool(autocast_cache),
        "root": root or meter_mod.ROOT, "seed": seed, "config": dict(config or {}), "timeout": float(timeout),
        "parent": os.getpid(), "sys_path": list(sys.path),
    }
    if isinstance(model, str):
        from .eager import reference  # noqa: PLC0415

        ref = reference(spec["root"])
        if model not in ref.NAMES:
            raise ValueError(f"model {model!r} has no plain-torch reference (models/fixtures/reference.py has "
                             f"{', '.join(ref.NAMES)})")
        spec["model"] = model
        _check_reference(spec, ref)
    elif callable(model):
        if config:
            raise ValueError("config overrides apply to a reference name, not to a callable")
        try:
            payload = pickle.dumps(model)
        except Exception as e:  # noqa: BLE001  (pickle raises several kinds)
            raise ValueError(f"the model callable must be picklable (a module-level function or a partial "
                             f"of one) to reach the rank processes: {e}") from None
        spec["model"] = None
        spec["builder"] = base64.b64encode(payload).decode()
        main = sys.modules.get("__main__")
        spec["main_path"] = getattr(main, "__file__", None) if b"__main__" in payload else None
    else:
        raise ValueError(f"model must be a reference name or a callable, found {type(model).__name__}")

    try:
        spec["meter"] = meter_mod.build()  # once here, rather than N compiles racing in the ranks
    except SystemExit as e:  # the meter's own message (a missing checkout, a failed compile)
        raise FsdpError(str(e)) from None
    return _launch(spec, port)


def _check_reference(spec, ref):
    """Refuses, before any process starts, what the ranks would refuse: unknown config fields, a
    shard or checkpoint regex that matches nothing, nested matches. The model is built on the
    meta device (no memory) with the ranks' code."""
    from .checkpointing import apply  # noqa: PLC0415
    from .eager import regex_plan  # noqa: PLC0415

    with torch.device("meta"):
        model, backbone, _ = _reference_model(spec, ref)
    shard_regex = spec["shard_regex"] if spec["shard_regex"] is not None else _FAMILY_UNITS.get(type(model).__name__)
    _units(backbone, shard_regex)
    if spec["regex"]:
        _checkpoint(backbone, spec["regex"], apply, regex_plan)


def _loopback_interface():
    """The loopback interface's name (`lo` on Linux, `lo0` on macOS), if there is one."""
    return next((name for _, name in socket.if_nameindex() if re.fullmatch(r"lo\d*", name)), None)


def _launch(spec, port):
    import torch.distributed as dist  # noqa: PLC0415

    n = spec["world_size"]
    # The parent serves the rendezvous store itself: the port is bound here and held for the
    # whole run, so no other process can take it between choosing and using it.
    try:
        store = dist.TCPStore("127.0.0.1", int(port), None, True, timeout=datetime.timedelta(seconds=60),
                              wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if port:
            raise FsdpError(f"cannot serve the rendezvous on 127.0.0.1:{port} (is the port taken? pass port=0 "
                            f"to let the OS choose a free one): {e}") from None
        raise FsdpError(f"cannot serve the rendezvous on 127.0.0.1: {e}") from None
    spec["port"] = store.port

    tmp = tempfile.mkdtemp(prefix="ckptune-fsdp-")
    procs, logs = [], []
    try:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ)
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in [env.get("PYTHONPATH")] if p])
        env["OMP_NUM_THREADS"] = "1"
        if "GLOO_SOCKET_IFNAME" not in env:
            lo = _loopback_interface()
            if lo:
                env["GLOO_SOCKET_IFNAME"] = lo  # gloo's pairs bind here, not on the host's address
        for rank in range(n):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "wb")
            logs.append(log)
            # A session of its own: Ctrl-C in a terminal reaches the parent only, which then
            # kills every rank (a rank that died alone would leave the others blocked in gloo).
            procs.append(subprocess.Popen([sys.executable, "-m", "ckptune.fsdp", "--worker", spec_path, str(rank)],
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
        pids = [p.pid for p in procs]
        deadline = time.monotonic() + spec["timeout"]
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank = _first_failure(tmp, failed)
                raise FsdpError(f"rank {rank} of {n} failed (exit {codes[rank]}):\n{_failure_text(tmp, rank)}",
                                pids, rank)
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise FsdpTimeout(f"the {n} ranks did not finish within {spec['timeout']:g} s; killed them", pids)
            time.sleep(0.05)
        ranks = []
        for rank in range(n):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for log in logs:
            log.close()
        del store
        shutil.rmtree(tmp, ignore_errors=True)

    out = {k: spec[k] for k in ("world_size", "precision", "optimizer", "micro_batch", "reshard_after_forward",
                                "regex", "steps", "warmup", "config", "seed", "port", "settle",
                                "autocast_cache")}
    first = ranks[0]
    out.update({"format": FORMAT, "torch": torch.__version__, "model": spec["model"] or first["model"],
                "image": first["image"], "seq": first["seq"], "shard_regex": first["shard_regex"],
                "optimizer_class": first["optimizer_class"], "optimizer_kwargs": first["optimizer_kwargs"],
                "units": first["units"], "checkpointed": first["checkpointed"], "params": first["params"],
                "unit_bytes": unit_bytes(first["params"], n),
                "pids": pids, "peak_bytes": [r["peak_bytes"] for r in ranks], "ranks": ranks})
    return out


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


def _first_failure(tmp, failed):
    """Of the failed ranks, the one whose error came first: a rank's failure makes its peers
    fail in their next collective, and the cause is the earliest."""
    def when(rank):
        try:
            with open(os.path.join(tmp, f"rank{rank}.error")) as f:
                return json.load(f)["time"]
        except (OSError, ValueError, KeyError):
            return float("inf")
    return min(failed, key=lambda r: (when(r), r))


def _failure_text(tmp, rank):
    try:
        with open(os.path.join(tmp, f"rank{rank}.error")) as f:
            return json.load(f)["traceback"].rstrip()
    except (OSError, ValueError, KeyError):
        pass
    try:
        with open(os.path.join(tmp, f"rank{rank}.log"), "rb") as f:
            text = f.read()[-4000:].decode(errors="replace").rstrip()
        return text or "(no output)"
    except OSError:
        return "(no output)"


# ------------------------------------------------------------------------------ rank side


def _signal_with_parent(parent, sig):
    """Linux: deliver `sig` to this process when `parent`, the process that started it, dies,
    however it dies (PR_SET_PDEATHSIG). Returns False when `parent` is already gone (it died
    before the signal was armed); True where the signal cannot be armed (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return True
    return os.getppid() == parent


def _die_with_parent(parent):
    """A rank: SIGKILL it when the process that started it dies."""
    if not _signal_with_parent(parent, signal.SIGKILL):
        os._exit(1)


def _exit_with_parent(parent):
    """The harness: SIGTERM it when `parent` dies; the SIGTERM handler leaves through `run`'s
    cleanup, which kills and reaps the ranks. For callers that cannot arm the signal on their
    child themselves (`ckptune verify --pytorch`). Returns False when `parent` is already gone."""
    return _signal_with_parent(parent, signal.SIGTERM)


def _worker_main(spec_path, rank):
    from .eager import write_atomic  # noqa: PLC0415

    with open(spec_path) as f:
        spec = json.load(f)
    _die_with_parent(spec["parent"])
    out_dir = os.path.dirname(spec_path)
    try:
        result = _rank(spec, rank)
    except BaseException as e:  # noqa: BLE001  (reported to the parent, then re-raised)
        error = {"time": time.time(), "traceback": "".join(traceback.format_exception(e))}
        write_atomic(os.path.join(out_dir, f"rank{rank}.error"), error)
        raise
    write_atomic(os.path.join(out_dir, f"rank{rank}.json"), result)
    return 0


class _Loss(nn.Module):
    """The FSDP root: its forward is the micro-batch's loss, so the root's pre-forward hook (the
    all-gather of the embeddings, stem and head) runs once per forward whatever the task's call
    structure is (BERT's loss calls `model.bert` and `model.classifier`, never `model`)."""

    def __init__(self, model, loss_of):
        super().__init__()
        self.model = model
        self._loss_of = loss_of

    def forward(self, batch):
        return self._loss_of(batch)


class _Meter:
    """The meter's levels with peaks per segment: `mark` ends a segment (returning its peak) and
    starts the next; a phase's peak is the highest of its segments'."""

    def __init__(self, meter):
        self.m = meter
        self.high = 0

    def current(self):
        return self.m.current()

    def begin(self):
        self.m.reset_peak()
        self.high = self.m.current()

    def mark(self):
        p = self.m.peak()
        self.high = max(self.high, p)
        self.m.reset_peak()
        return p


def _build(spec, ref, gen):
    """(model, backbone, backbone prefix, make_batch, loss_of, family units regex)."""
    from .eager import _batches  # noqa: PLC0415

    if spec["model"] is None:
        main_path = spec.get("main_path")
        if main_path:  # the callable lives in the parent's script: load it as multiprocessing does
            import runpy  # noqa: PLC0415
            import types  # noqa: PLC0415

            module = types.ModuleType("__mp_main__")
            module.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
            sys.modules["__main__"] = sys.modules["__mp_main__"] = module
        builder = pickle.loads(base64.b64decode(spec["builder"]))
        built = builder(spec["micro_batch"], gen)
        if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nn.Module)):
            raise ValueError("the model callable must return (module, make_batch, loss_of)")
        model, make_batch, loss_of = built
        return model, model, "", make_batch, loss_of, None

    model, backbone, prefix = _reference_model(spec, ref)
    make_batch, loss_of = _batches(ref, model, backbone, spec["micro_batch"], spec["image"], spec["seq"], gen)
    return model, backbone, prefix, make_batch, loss_of, _FAMILY_UNITS.get(type(model).__name__)


def _reference_model(spec, ref):
    """(model, backbone, backbone prefix) of the reference name with the config overrides."""
    name, overrides = spec["model"], spec["config"]
    if overrides:
        with torch.device("meta"):
            proto, prefix = ref.build(name)
        model = _rebuild(ref, proto, prefix, overrides)
    else:
        model, prefix = ref.build(name)
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    return model, backbone, prefix


def _config(model, backbone):
    """A transformer's config: on the backbone (BERT's `bert`) or on the model (GPT-2's, whose
    `transformer` has none; Llama's, whose backbone is the model); None for a ResNet."""
    return getattr(backbone, "config", None) or getattr(model, "config", None)


def _rebuild(ref, proto, prefix, overrides):
    if isinstance(proto, ref.ResNet):
        fields = {"layers": [len(getattr(proto, f"layer{i}")) for i in range(1, 5)],
                  "inplanes": proto.conv1.out_channels, "num_classes": proto.fc.out_features,
                  "block": "bottleneck" if isinstance(proto.layer1[0], ref.Bottleneck) else "basic"}
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ValueError(f"unknown ResNet config {', '.join(unknown)}; known: {', '.join(fields)}")
        fields.update(overrides)
        if fields["block"] not in ("basic", "bottleneck"):
            raise ValueError(f"ResNet block {fields['block']!r}: expected basic or bottleneck")
        block = ref.Bottleneck if fields["block"] == "bottleneck" else ref.BasicBlock
        return ref.ResNet(block, list(fields["layers"]), num_classes=int(fields["num_classes"]),
                          inplanes=int(fields["inplanes"]))
    cfg = _config(proto, proto.get_submodule(prefix[:-1]) if prefix else proto)
    fields = dict(vars(cfg))
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown {type(cfg).__name__} field {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    if isinstance(cfg, ref.LlamaConfig) and {"hidden_size", "num_attention_heads"} & set(overrides):
        fields.setdefault("head_dim", None)
        if "head_dim" not in overrides:
            fields["head_dim"] = None  # derived again from the new sizes
    fields.update(overrides)
    return type(proto)(type(cfg)(**fields))


def _matches(module, pattern):
    if not pattern:
        return []
    rx = re.compile(pattern)
    return [(name, m) for name, m in module.named_modules() if name and rx.fullmatch(name)]


def _units(backbone, shard_regex):
    """The FSDP units: the backbone's modules `shard_regex` fully matches, none inside another
    (`fully_shard` would nest them; the model here is one level of units under the root)."""
    units = _matches(backbone, shard_regex)
    if shard_regex and not units:
        raise ValueError(f"shard regex {shard_regex} matches no module of this model")
    names = [name for name, _ in units]
    nested = [f"{a} inside {b}" for a in names for b in names if a.startswith(b + ".")]
    if nested:
        raise ValueError(f"shard regex {shard_regex} matches nested modules ({'; '.join(nested)})")
    return units


def _checkpoint(backbone, regex, apply, regex_plan):
    """Checkpoints the backbone's modules `regex` fully matches, as `ckptune.apply` does."""
    names = [name for name, _ in _matches(backbone, regex)]
    if not names:
        raise ValueError(f"checkpoint regex {regex} matches no module of this model")
    return apply(backbone, regex_plan(regex, names))


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _storage_bytes(tensors):
    """Bytes of the distinct storages under `tensors` (DTensors by their local tensors)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _rank(spec, rank):
    torch.set_num_threads(1)
    meter = _Meter(meter_mod.Meter(spec["meter"]))  # before this process allocates any tensor
    levels = {"baseline": meter.current()}

    import torch.distributed as dist  # noqa: PLC0415

    for p in spec["sys_path"]:
        if p not in sys.path:
            sys.path.append(p)  # the parent's: where a model callable's module is found

    timeout = datetime.timedelta(seconds=spec["timeout"])
    store = dist.TCPStore("127.0.0.1", spec["port"], None, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=spec["world_size"], timeout=timeout)
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
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from .checkpointing import apply  # noqa: PLC0415
    from .eager import reference, regex_plan  # noqa: PLC0415
    from .training import training_config  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (spec["world_size"],))
    levels["after_init"] = meter.current()

    ref = reference(spec["root"])
    torch.manual_seed(spec["seed"])  # the same parameters on every rank, as FSDP requires
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data, as in data parallelism
    model, backbone, prefix, make_batch, loss_of, family_units = _build(spec, ref, gen)
    model.train()
    task = _Loss(model, loss_of)
    levels["after_build"] = meter.current()

    shard_regex = spec["shard_regex"] if spec["shard_regex"] is not None else family_units
    units = _units(backbone, shard_regex)
    unit_names = [name for name, _ in units]
    # Parameter names as plans write them: the backbone's, without the task wrapper's prefix.
    head = "model." + prefix
    unit_of = {id(p): name for name, m in units for p in m.parameters()}
    params = [{"name": name[len(head):] if name.startswith(head) else "<head>." + name[len("model."):],
               "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
               "unit": unit_of.get(id(p), "<root>")} for name, p in task.named_parameters()]
    del unit_of

    raf = spec["reshard_after_forward"]
    groups = []
    for name, m in units:  # bottom-up: the units first, then the root takes the rest
        fully_shard(m, mesh=mesh, reshard_after_forward=raf)
        groups.append((name, m))
    fully_shard(task, mesh=mesh)
    groups.append(("<root>", task))
    settle = _settled_comms(meter) if spec["settle"] else None
    if settle:
        for _, m in groups:
            m.set_custom_all_gather(settle[0])
            m.set_custom_reduce_scatter(settle[1])
    checkpointed = _checkpoint(backbone, spec["regex"], apply, regex_plan) if spec["regex"] else []
    levels["after_shard"] = meter.current()

    for entry, p in zip(params, task.parameters()):  # named_parameters' order, unchanged by sharding
        entry["local_shape"] = list(_local(p).shape)
        entry["local_storage_bytes"] = _local(p).untyped_storage().nbytes()
    sharded_param_bytes = _storage_bytes(task.parameters())

    cfg = training_config(regex_plan(spec["regex"], checkpointed, precision=spec["precision"],
                                     optimizer=spec["optimizer"], micro_batch=spec["micro_batch"]))
    opt = cfg.optimizer_class(task.parameters(), lr=spec["lr"], **cfg.optimizer_kwargs)
    levels["after_optimizer_init"] = meter.current()

    events = []
    if spec["trace"]:
        _trace(groups, meter, events)

    records = []
    for i in range(spec["steps"]):
        del events[:]
        rec = {"step": i + 1}
        meter.begin()
        rec["start"] = meter.current()
        batch = make_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_dtype is not None,
                            cache_enabled=spec["autocast_cache"]):
            loss = task(batch)
        events.append(["forward_end", "", meter.current(), meter.mark()])
        rec["after_forward"], rec["forward_peak"] = meter.current(), meter.high
        meter.begin()
        loss.backward()
        events.append(["backward_end", "", meter.current(), meter.mark()])
        rec["after_backward"], rec["backward_peak"] = meter.current(), meter.high
        rec["grad_storage_bytes"] = _storage_bytes(p.grad for p in task.parameters())
        rec["loss"] = loss.item()
        meter.begin()
        opt.step()
        events.append(["optimizer_end", "", meter.current(), meter.mark()])
        rec["after_optimizer"], rec["optimizer_peak"] = meter.current(), meter.high
        opt.zero_grad(set_to_none=cfg.set_to_none)
        del loss, batch
        rec["after_step"] = meter.current()
        rec["peak"] = max(rec["forward_peak"], rec["backward_peak"], rec["optimizer_peak"])
        if i == 0:
            levels["after_optimizer_state"] = meter.current()
        records.append(rec)

    state_bytes = _storage_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    timed = records[spec["warmup"]:]
    result = {
        "rank": rank,
        "model": type(model).__name__,
        "image": (spec["image"] or 224) if isinstance(model, ref.ResNet) else None,  # `_batches`' default
        "seq": None if isinstance(model, ref.ResNet) or spec["model"] is None else (
            spec["seq"] or min(128, getattr(_config(model, backbone), "max_position_embeddings", None)
                               or _config(model, backbone).n_positions)),
        "shard_regex": shard_regex,
        "units": unit_names,
        "checkpointed": checkpointed,
        "optimizer_class": f"{cfg.optimizer_class.__module__}.{cfg.optimizer_class.__name__}",
        "optimizer_kwargs": {k: v for k, v in opt.param_groups[0].items() if k != "params" and _plain(v)},
        "params": params,
        "levels": levels,
        "sharded_param_bytes": sharded_param_bytes,
        "optimizer_state_bytes": state_bytes,
        "steps": records,
        "peak_bytes": max(r["peak"] for r in timed),
    }
    if settle:
        result["settle"] = settle[2]
    if any(r["peak"] != timed[0]["peak"] for r in timed):
        result["peak_varies"] = [r["peak"] for r in timed]
    if spec["trace"]:
        result["trace"] = events
    return result


def _settled_comms(meter):
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


def _plain(v):
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v))


def _trace(groups, meter, events):
    """Records the meter at FSDP's own transitions of each unit's parameter group: after an
    all-gather (`unshard`, also when issued as a prefetch), after the copy-out into the
    unsharded parameters (`wait_for_unshard`), after a reshard, around `post_backward` (which
    frees the unsharded parameters and reduce-scatters the gradients). Each event carries the
    current level and the peak since the previous event. Python wrappers on the group object:
    nothing is allocated by them."""
    for name, module in groups:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            def wrap(method, before=None, after=None, label=name, group=group):
                orig = getattr(group, method)

                @functools.wraps(orig)
                def traced(*args, **kwargs):
                    if before:
                        events.append([before, label, meter.current(), meter.mark()])
                    # A bool, not the result itself: holding it would keep the all-gather buffer
                    # alive past the point where FSDP frees it.
                    pending = group._all_gather_result is not None
                    out = orig(*args, **kwargs)
                    # unshard and wait_for_unshard are no-ops on a group already unsharded (the
                    # root in backward) or already prefetched: only real transitions are events.
                    did = {"unshard": not pending and group._all_gather_result is not None,
                           "wait_for_unshard": pending}.get(method, True)
                    if after and did:
                        events.append([after, label, meter.current(), meter.mark()])
                    return out

                setattr(group, method, traced)

            wrap("unshard", after="all_gather")
            wrap("wait_for_unshard", after="copy_out")
            wrap("post_forward", before="forward_compute_end", after="post_forward")
            wrap("pre_backward", after="pre_backward")
            wrap("post_backward", before="backward_compute_end", after="post_backward")


# ------------------------------------------------------------------------------ CLI


def _config_arg(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIELD=VALUE")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker_main(argv[1], int(argv[2]))
    ap = argparse.ArgumentParser(prog="python -m ckptune.fsdp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a reference model name (tiny-bert, tiny-resnet, ...)")
    ap.add_argument("--config", type=_config_arg, action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of the reference's config (JSON values); repeatable")
    ap.add_argument("--nproc", type=int, default=2, help="world size: ranks, one process each")
    ap.add_argument("--regex", default="", help="checkpoint the backbone modules this fully matches")
    ap.add_argument("--shard-regex", help="the FSDP units (default: the family's layers)")
    ap.add_argument("--precision", choices=_PRECISIONS, default="fp32")
    ap.add_argument("--optimizer", choices=_OPTIMIZERS, default="adamw")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--image", type=int, help="ResNet input side (default 224)")
    ap.add_argument("--seq", type=int, help="sequence length (default min(128, positions))")
    ap.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false",
                    help="keep each unit's parameters unsharded from its forward to its backward")
    ap.add_argument("--steps", type=int, default=3, help="steps in all, warm-up included")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--trace", action="store_true", help="record the meter at each FSDP transition (last step)")
    ap.add_argument("--no-autocast-cache", dest="autocast_cache", action="store_false",
                    help="autocast with cache_enabled=False, the loop ckptune plans (docs/memory-model.md)")
    ap.add_argument("--no-settle", dest="settle", action="store_false",
                    help="FSDP's own collectives, whose buffers gloo may free late (peaks vary run to run)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    ap.add_argument("--port", type=int, default=0, help="rendezvous port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--root", help="the ckptune checkout (default: $CKPTUNE_ROOT, else this package's)")
    ap.add_argument("--parent", type=int, metavar="PID",
                    help="leave (killing the ranks) when process PID, the one that started this, dies (Linux)")
    ap.add_argument("-o", "--output")
    a = ap.parse_args(argv)

    def stop(signum, frame):  # SIGTERM: leave through run's cleanup, as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if a.parent is not None and not _exit_with_parent(a.parent):
        print(f"error: the parent process {a.parent} exited before the run started", file=sys.stderr)
        return 1
    try:
        out = run(a.model, config=dict(a.config), regex=a.regex, world_size=a.nproc, precision=a.precision,
                  optimizer=a.optimizer, micro_batch=a.micro_batch, image=a.image, seq=a.seq,
                  reshard_after_forward=a.reshard, shard_regex=a.shard_regex, steps=a.steps, warmup=a.warmup,
                  trace=a.trace, settle=a.settle, timeout=a.timeout, port=a.port, root=a.root,
                  autocast_cache=a.autocast_cache)
    except (ValueError, GlooUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FsdpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; the ranks were killed", file=sys.stderr)
        return 130
    from .eager import write_output  # noqa: PLC0415

    write_output(a.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
