"""The PyTorch side of the benchmark: trains a ckptune built-in model's plain-torch reference
(`models/fixtures/reference.py`: torchvision ResNet, HF BERT eager, same module names) with
torch 2.13 eager, wrapping every module whose qualified name fully matches REGEX in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` (`ckptune.apply`), and measures each
step's time and exact CPU peak with ckptune's own counting allocator. The run itself is
`ckptune_harness.eager.run` (python/ckptune_harness/eager.py), which `ckptune verify --pytorch` uses too; this
is its command line for bare regexes, writing the benchmark's format.

    python scripts/bench/eager.py resnet50 --checkpoint '^(?:layer1)$' --batch 4 --image 96 \
        --precision fp32 --steps 6 --threads 2 -o eager.json

Output: JSON `ckptune.bench-eager/1`, written atomically.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))

from ckptune_harness import eager  # noqa: E402
from ckptune_harness.output import write_atomic  # noqa: E402
from ckptune_harness.plans import regex_plan  # noqa: E402
from ckptune_harness.reference import matching  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--checkpoint", default="", help="regex, full match over module names ('' = none)")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--image", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=6, help="steps in all, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", choices=["sgd", "sgd-momentum", "adam", "adamw"], default="adamw")
    ap.add_argument("--optimizer-impl", choices=["single", "foreach", "fused"], default="single",
                    help="torch.optim's implementation (single = foreach=False, PyTorch's CPU default)")
    ap.add_argument("--no-autocast-cache", action="store_true",
                    help="torch.autocast(..., cache_enabled=False): bf16 weight casts are not cached")
    ap.add_argument("--attention", choices=["eager", "sdpa"],
                    help="a transformer's attn_implementation (default: the reference's, sdpa)")
    ap.add_argument("-o", "--output")
    a = ap.parse_args()

    names = matching(a.model, a.checkpoint, ROOT)
    plan = regex_plan(a.checkpoint, names, precision=a.precision, micro_batch=a.batch,
                            optimizer=a.optimizer, optimizer_impl=a.optimizer_impl)
    try:
        r = eager.run(a.model, plan, image=a.image, seq=a.seq, steps=a.steps, warmup=a.warmup,
                      threads=a.threads, lr=a.lr, root=ROOT, log=lambda m: print(m, file=sys.stderr),
                      attention=a.attention,
                      autocast_cache=not a.no_autocast_cache)
    except ValueError as e:
        raise SystemExit(f"eager.py: {e}")
    kw = r["optimizer_kwargs"]
    out = {
        "format": "ckptune.bench-eager/1",
        **{k: r[k] for k in ("model", "torch", "threads", "precision", "optimizer")},
        "optimizer_impl": a.optimizer_impl,
        "optimizer_kwargs": {k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()
                             if k in ("lr", "betas", "eps", "weight_decay", "momentum", "foreach", "fused")},
        "batch": a.batch,
        **{k: r[k] for k in ("image", "seq", "regex", "modules", "warmup", "steps", "median_seconds",
                             "peak_bytes", "start_bytes", "meter")},
    }
    out["regex"] = a.checkpoint
    if r["seq"] is not None:  # a transformer: the attention it ran, the reference's default if not given
        out["attention"] = a.attention or "sdpa"
    if "peak_varies" in r:
        out["peak_varies"] = r["peak_varies"]
    if a.output:
        write_atomic(a.output, out)
    else:
        json.dump(out, sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
