"""What every rank of an FSDP run is told: the run's options, resolved and typed (`RunSpec`), and
the one way they travel from the parent to the ranks — a JSON file each rank is started with
(`python -m ckptune_harness.fsdp --worker SPEC RANK`), its result and error files beside it."""

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd-momentum")

WORKER_FLAG = "--worker"


@dataclass(frozen=True)
class RunSpec:
    """An FSDP run as its ranks run it. `make_spec` makes one from `run`'s arguments; the parent
    then fills in what to train (`model` or `builder`), the meter and the port it serves the
    rendezvous on (`dataclasses.replace`)."""

    # What to train: a reference name of models/fixtures/reference.py with `config` overriding
    # fields of its config, or (`model` None) a callable, pickled and base64-encoded in `builder`;
    # `main_path` is the parent's script when the callable lives in its `__main__`.
    model: Optional[str]
    config: Dict[str, Any]
    # The run: `world_size` ranks, each one process.
    world_size: int
    precision: str  # one of PRECISIONS ("bf16": CPU autocast, fp32 parameters)
    optimizer: str  # one of OPTIMIZERS (foreach=False)
    micro_batch: int
    image: Optional[int]  # a ResNet's input side (None: 224)
    seq: Optional[int]  # a transformer's sequence length (None: min(128, positions))
    reshard_after_forward: bool  # of the units; the root keeps FSDP's default
    regex: str  # the modules to checkpoint ('' none)
    shard_regex: Optional[str]  # the FSDP units (None: the family's layers)
    steps: int  # in all, warm-up included
    warmup: int
    lr: float
    trace: bool  # record the meter at FSDP's transitions of the last step
    settle: bool  # collectives that return only once gloo has let go of their memory
    autocast_cache: bool
    seed: int  # of the parameters, the same on every rank
    timeout: float  # seconds, for the ranks to finish and for gloo's collectives
    # Where it runs, from the parent.
    root: str  # the ckptune checkout (references, meter source)
    parent: int  # the parent's pid: each rank dies with it
    sys_path: Tuple[str, ...]  # the parent's, where a model callable's module is found
    port: int = 0  # the rendezvous store's on 127.0.0.1: as asked (0: the OS picks) until served
    builder: Optional[str] = None
    main_path: Optional[str] = None
    meter: str = ""  # the compiled meter library every rank loads

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Dict[str, Any]) -> "RunSpec":
        return cls(**{**doc, "sys_path": tuple(doc["sys_path"])})

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def read(cls, path: str) -> "RunSpec":
        with open(path) as f:
            return cls.from_json(json.load(f))


def make_spec(*, config, regex, world_size, precision, optimizer, micro_batch, image, seq, reshard_after_forward,
        shard_regex, steps, warmup, lr, trace, settle, autocast_cache, seed, timeout, port, root, parent,
        sys_path) -> RunSpec:
    """A spec from `run`'s arguments, before it knows what to train. Raises ValueError for an
    argument no rank could run with."""
    _check(world_size, precision, optimizer, steps, warmup, regex, shard_regex)
    return RunSpec(
        model=None, config=dict(config or {}), world_size=world_size, precision=precision, optimizer=optimizer,
        micro_batch=int(micro_batch), image=image, seq=seq, reshard_after_forward=bool(reshard_after_forward),
        regex=regex or "", shard_regex=shard_regex, steps=int(steps), warmup=int(warmup), lr=lr, trace=bool(trace),
        settle=bool(settle), autocast_cache=bool(autocast_cache), seed=seed, timeout=float(timeout), root=root,
        parent=parent, sys_path=tuple(sys_path), port=int(port),
    )


def _check(world_size, precision, optimizer, steps, warmup, regex, shard_regex):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, found {world_size!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    if steps <= warmup or warmup < 1:
        raise ValueError(f"need warmup >= 1 (the optimizer state is created in the first step) and steps > "
                         f"warmup, found steps {steps}, warmup {warmup}")
    for name, pattern in (("regex", regex), ("shard_regex", shard_regex)):
        if pattern:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{name} {pattern!r} is not a valid regex: {e}") from None


def worker_args(spec_path: str, rank: int) -> List[str]:
    """The interpreter arguments that start rank `rank` of the run whose spec is at `spec_path`."""
    return ["-m", "ckptune_harness.fsdp", WORKER_FLAG, spec_path, str(rank)]


def rank_file(run_dir: str, rank: int, kind: str) -> str:
    """A rank's file beside the spec: `json` its result, `error` its traceback (JSON), `log` its
    output."""
    return os.path.join(run_dir, f"rank{rank}.{kind}")
