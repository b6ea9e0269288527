"""A real PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) training step on the CPU, on N
processes, each rank's exact CPU tensor memory measured with ckptune's counting allocator: the
measurements a sharded memory model (`ckptune plan --shard N`) is derived from and checked
against (docs/fsdp.md).

    python -m ckptune_harness.fsdp --model tiny-bert --nproc 2 --seq 32 --micro-batch 4 \\
        --regex 'encoder\\.layer\\.0' -o run.json

With `--parent PID` the CLI arms the parent-death signal on itself (SIGTERM, then the run's
cleanup, which kills and reaps the ranks), for a caller that cannot: `ckptune verify --pytorch`
of a sharded plan passes its own pid. `--worker SPEC RANK` is how the run starts each rank.

Exit codes: 0 done, 2 bad input or no gloo, 1 a rank failed or the run timed out, 130
interrupted.
"""

import argparse
import json
import signal
import sys

from ..lifetime import exit_with_parent
from ..output import write_output
from .errors import FsdpError, GlooUnavailable
from .runner import run
from .spec import OPTIMIZERS, PRECISIONS, WORKER_FLAG


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER_FLAG]:
        from .rank import worker_main  # noqa: PLC0415

        return worker_main(argv[1], int(argv[2]))
    a = _parser().parse_args(argv)

    def stop(signum, frame):  # SIGTERM: leave through run's cleanup, as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if a.parent is not None and not exit_with_parent(a.parent):
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
    write_output(a.output, out)
    return 0


def _parser():
    ap = argparse.ArgumentParser(prog="python -m ckptune_harness.fsdp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a reference model name (tiny-bert, tiny-resnet, ...)")
    ap.add_argument("--config", type=_config_arg, action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of the reference's config (JSON values); repeatable")
    ap.add_argument("--nproc", type=int, default=2, help="world size: ranks, one process each")
    ap.add_argument("--regex", default="", help="checkpoint the backbone modules this fully matches")
    ap.add_argument("--shard-regex", help="the FSDP units (default: the family's layers)")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
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
    return ap


def _config_arg(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIELD=VALUE")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value
