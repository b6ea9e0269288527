"""The PyTorch side of the benchmark: trains a ckptune built-in model's plain-torch reference
(`models/fixtures/reference.py`: torchvision ResNet, HF BERT eager, same module names) with
torch 2.13 eager, wrapping every module whose qualified name fully matches REGEX in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, and measures each step's time and
exact CPU peak with ckptune's own counting allocator (scripts/bench/meter.py).

    python scripts/bench/eager.py resnet50 --checkpoint '^(?:layer1)$' --batch 4 --image 96 \
        --precision fp32 --steps 6 --threads 2 -o eager.json

Per step, the loop ckptune's runtime models (docs/memory-model.md): reset the peak, make the
batch (same shapes and dtypes as ckptune's `Chain::make_batch`), forward + loss (under CPU bf16
autocast for `bf16`), `loss.backward()`, `opt.step()`, `zero_grad(set_to_none=True)`, then
`del batch, loss`: the batch and the loss stay alive through the optimizer step, as a loop's
variables do. The optimizer is torch.optim's, in the implementation given (`--optimizer-impl`:
single = foreach=False, PyTorch's CPU default). The meter is installed before the model is
built, so absolute levels count the same tensors as ckptune's.
Output: JSON `ckptune.bench-eager/1`, written atomically.
"""

import argparse
import functools
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "models", "fixtures"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import meter as meter_mod  # noqa: E402
from bench import write_atomic  # noqa: E402  (side-effect free: bench.py runs under __main__)


# torch.optim's optimizers as ckptune names them, with the hyper-parameters ckptune uses
# (PyTorch's defaults; momentum 0.9), and the implementations `--optimizer-impl` selects.
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
}
IMPLS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def wrap_checkpoint(module):
    """Per-module activation checkpointing, as `ckpt_monkey`/HF-style wrappers do it."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


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
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    ap.add_argument("--optimizer-impl", choices=sorted(IMPLS), default="single")
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        raise SystemExit(f"eager.py: --steps {a.steps} must exceed --warmup {a.warmup}")

    torch.set_num_threads(a.threads)
    meter = meter_mod.Meter(meter_mod.build())  # installed before anything is allocated
    import reference  # noqa: PLC0415

    torch.manual_seed(0)
    model, prefix = reference.build(a.model)
    backbone = getattr(model, prefix[:-1]) if prefix else model
    model.train()

    # Checkpointed modules: every qualified name of the backbone that fully matches the regex
    # (the backbone's names are ckptune's: `layer1`, `encoder.layer.3`).
    names = [n for n, _ in backbone.named_modules() if n and a.checkpoint and re.fullmatch(a.checkpoint, n)]
    for n in names:
        for m in names:
            if m != n and m.startswith(n + "."):
                raise SystemExit(f"eager.py: regex {a.checkpoint!r} selects nested modules {n} and {m}")
    mods = dict(backbone.named_modules())
    for n in names:
        wrap_checkpoint(mods[n])

    is_bert = isinstance(model, reference.BertForSequenceClassification)
    is_resnet = isinstance(model, reference.ResNet)
    if not (is_bert or is_resnet):
        raise SystemExit(f"eager.py: {a.model}: only the ResNet and BERT families are benchmarked")
    gen = torch.Generator().manual_seed(1234)  # the batch's own generator: dropout is untouched
    if is_resnet:
        image = a.image or 224
        classes = model.fc.out_features

        def make_batch():
            x = torch.randn(a.batch, 3, image, image, generator=gen)
            y = torch.randint(classes, (a.batch,), generator=gen)
            return x, y, None

        def loss_of(batch):
            x, y, _ = batch
            return nn.functional.cross_entropy(model(x), y)
    else:
        cfg = backbone.config
        seq = a.seq or min(128, cfg.max_position_embeddings)

        def make_batch():
            ids = torch.randint(cfg.vocab_size, (a.batch, seq), generator=gen)
            y = torch.randint(cfg.num_labels, (a.batch,), generator=gen)
            mask = torch.ones(a.batch, seq, dtype=torch.long)
            pad = seq // 4
            if pad > 0:
                mask[1::2, seq - pad:] = 0  # every other sequence: last quarter padded
            return ids, y, mask

        def loss_of(batch):
            ids, y, mask = batch
            _, pooled = model.bert(ids, mask)
            logits = model.classifier(model.dropout(pooled))
            return nn.functional.cross_entropy(logits.view(-1, cfg.num_labels), y.view(-1))

    opt_class, opt_kwargs = OPTIMIZERS[a.optimizer]
    opt = opt_class(model.parameters(), lr=a.lr, **opt_kwargs, **IMPLS[a.optimizer_impl])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16")

    steps = []
    for i in range(a.steps):
        meter.reset_peak()
        start = meter.current()
        t0 = time.perf_counter()
        batch = make_batch()
        with autocast:
            loss = loss_of(batch)
        loss.backward()
        loss_value = loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, batch
        seconds = time.perf_counter() - t0
        steps.append({
            "step": i + 1, "loss": loss_value, "seconds": seconds,
            "peak_bytes": meter.peak(), "start_bytes": start, "end_bytes": meter.current(),
        })
        print(f"  step {i + 1:>3}  loss {loss_value:.6f}  {seconds:.3f} s  peak {meter.peak():,} B",
              file=sys.stderr)

    timed = steps[a.warmup:]
    secs = sorted(s["seconds"] for s in timed)
    mid = len(secs) // 2
    median = secs[mid] if len(secs) % 2 else 0.5 * (secs[mid - 1] + secs[mid])
    group = opt.param_groups[0]
    out = {
        "format": "ckptune.bench-eager/1",
        "model": a.model,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "precision": a.precision,
        "optimizer": a.optimizer,
        "optimizer_impl": a.optimizer_impl,
        "optimizer_kwargs": {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                             if k in ("lr", "betas", "eps", "weight_decay", "momentum", "foreach", "fused")},
        "batch": a.batch,
        "image": a.image if is_resnet else None,
        "seq": (a.seq or min(128, backbone.config.max_position_embeddings)) if is_bert else None,
        "regex": a.checkpoint,
        "modules": names,
        "warmup": a.warmup,
        "steps": steps,
        "median_seconds": median,
        "peak_bytes": max(s["peak_bytes"] for s in timed),
        "start_bytes": timed[0]["start_bytes"],
        "meter": os.path.basename(meter.path),
    }
    if any(s["peak_bytes"] != timed[0]["peak_bytes"] for s in timed):
        out["peak_varies"] = [s["peak_bytes"] for s in timed]
    if a.output:
        write_atomic(a.output, out)
    else:
        json.dump(out, sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
