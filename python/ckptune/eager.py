"""A ckptune built-in model trained in PyTorch eager, its exact CPU peak measured with ckptune's
own counting allocator (`ckptune.meter`) loaded into this process: the PyTorch side of
`ckptune verify --pytorch` and of the benchmark (scripts/bench/eager.py).

The model is the built-in name's plain-torch reference (models/fixtures/reference.py of a
ckptune checkout: torchvision ResNet, Hugging Face BERT, GPT-2 and Llama in eager mode, the same
module names), its modules checkpointed with `ckptune.apply`. Per step, as ckptune's runtime
does it: reset the peak; per micro-batch make the batch (the shapes and dtypes of ckptune's
`Chain::make_batch`), forward and loss (under CPU autocast for bf16), `backward()`; then the
optimizer step and `zero_grad(set_to_none=...)`: the loop of ckptune's docs/memory-model.md, in
which each micro-batch and its loss are released after its backward except the last one's,
which stay alive through the optimizer step, as a loop's variables do. The meter is installed before the model is built, so absolute levels count the
same tensors as ckptune's.

    python -m ckptune.eager --plan plan.json -o run.json   # the plan's model, regex and config

Exit codes: 0 done, 2 bad input (a plan this run cannot follow: another format, a model
without a reference, names that differ), 1 anything else.
"""

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import time

import torch
from torch import nn

from . import meter as meter_mod
from .checkpointing import apply
from .plan import load_plan
from .training import training_config

FORMAT = "ckptune.pytorch-run/1"


def reference(root=None):
    """models/fixtures/reference.py of the checkout `root` (default: the meter's)."""
    path = os.path.join(root or meter_mod.ROOT, "models", "fixtures", "reference.py")
    if not os.path.exists(path):
        raise ValueError(f"{path} not found: the PyTorch run builds the plain-torch references of a "
                         f"ckptune checkout; set CKPTUNE_ROOT to one")
    spec = importlib.util.spec_from_file_location("ckptune_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batches(ref, model, backbone, batch, image, seq, gen):
    """(make_batch, loss_of) for the reference `model`, as ckptune's chain makes batches."""
    if isinstance(model, ref.ResNet):
        image = image or 224
        classes = model.fc.out_features

        def make_batch():
            x = torch.randn(batch, 3, image, image, generator=gen)
            return x, torch.randint(classes, (batch,), generator=gen), None

        def loss_of(b):
            x, y, _ = b
            return nn.functional.cross_entropy(model(x), y)

        return make_batch, loss_of

    # BERT's backbone carries the config; GPT-2's `transformer` and Llama's `model` do not, the
    # model around them does.
    cfg = getattr(backbone, "config", None) or model.config
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    seq = seq or min(128, positions)
    per_token = not isinstance(model, ref.BertForSequenceClassification)

    def make_batch():
        ids = torch.randint(cfg.vocab_size, (batch, seq), generator=gen)
        if per_token:
            y = torch.randint(cfg.vocab_size, (batch, seq), generator=gen)
        else:
            y = torch.randint(cfg.num_labels, (batch,), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.long)
        pad = seq // 4
        if pad > 0:
            mask[1::2, seq - pad:] = 0  # every other sequence: last quarter padded
        return ids, y, mask

    if isinstance(model, ref.BertForSequenceClassification):
        def loss_of(b):
            ids, y, mask = b
            _, pooled = model.bert(ids, mask)
            logits = model.classifier(model.dropout(pooled))
            return nn.functional.cross_entropy(logits.view(-1, cfg.num_labels), y.view(-1))
    elif isinstance(model, ref.GPT2LMHeadModel):
        def loss_of(b):
            ids, y, _ = b
            return model(ids, y)[1]
    else:
        def loss_of(b):
            ids, y, mask = b
            return model(ids, y, attention_mask=mask)[1]

    return make_batch, loss_of


def run(model_name, plan, *, image=None, seq=None, steps=6, warmup=2, threads=2, lr=1e-3, root=None,
        log=None, autocast_cache=True):
    """Trains the reference of `model_name` with `plan` (a path or dict: its checkpoint and
    config) applied, and measures every step. Returns the run as a dict (format `FORMAT`).
    `autocast_cache=False` runs autocast with `cache_enabled=False` (its bf16 weight casts are
    then not kept until the autocast region ends).

    Raises ValueError for a plan this cannot follow (its names differ from the reference's, a
    precision or optimizer torch cannot run on CPU, a model without a reference).
    """
    if steps <= warmup:
        raise ValueError(f"steps {steps} must exceed warmup {warmup}")
    doc = load_plan(plan)
    cfg = training_config(doc)
    if cfg.grad_scaler:
        raise ValueError(f"precision {cfg.precision!r} runs on CUDA only; this run measures the CPU")
    ref = reference(root)
    if model_name not in ref.NAMES:
        raise ValueError(f"model {model_name!r} has no plain-torch reference (models/fixtures/reference.py "
                         f"has {', '.join(ref.NAMES)}); the PyTorch run covers built-in models only")

    torch.set_num_threads(threads)
    meter = meter_mod.Meter(meter_mod.build())  # installed before anything is allocated
    torch.manual_seed(0)
    model, prefix = ref.build(model_name)
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    wrapped = apply(backbone, doc)  # checks the plan's names against the reference first
    model.to(cfg.param_dtype).train()

    gen = torch.Generator().manual_seed(1234)  # the batch's own generator: dropout is untouched
    make_batch, loss_of = _batches(ref, model, backbone, cfg.micro_batch, image, seq, gen)
    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
    pure = cfg.param_dtype != torch.float32

    records = []
    for i in range(steps):
        meter.reset_peak()
        start = meter.current()
        t0 = time.perf_counter()
        loss_sum = 0.0
        for k in range(cfg.grad_accum):
            batch = make_batch()
            if pure and batch[0].is_floating_point():
                batch = (batch[0].to(cfg.param_dtype),) + batch[1:]
            with torch.autocast("cpu", dtype=cfg.autocast_dtype or torch.bfloat16,
                                enabled=cfg.autocast_dtype is not None, cache_enabled=autocast_cache):
                loss = loss_of(batch)
            loss.backward()
            loss_sum += loss.item()
            if k + 1 < cfg.grad_accum:
                del loss, batch
        opt.step()
        opt.zero_grad(set_to_none=cfg.set_to_none)
        del loss, batch
        seconds = time.perf_counter() - t0
        records.append({"step": i + 1, "loss": loss_sum / cfg.grad_accum, "seconds": seconds,
                        "peak_bytes": meter.peak(), "start_bytes": start, "end_bytes": meter.current()})
        if log:
            log(f"  step {i + 1:>3}  loss {records[-1]['loss']:.6f}  {seconds:.3f} s  peak {meter.peak():,} B")

    timed = records[warmup:]
    secs = sorted(s["seconds"] for s in timed)
    mid = len(secs) // 2
    median = secs[mid] if len(secs) % 2 else 0.5 * (secs[mid - 1] + secs[mid])
    group = opt.param_groups[0]
    out = {
        "format": FORMAT,
        "model": model_name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "precision": cfg.precision,
        "autocast_cache": autocast_cache,
        "optimizer": cfg.optimizer,
        "optimizer_class": f"{cfg.optimizer_class.__module__}.{cfg.optimizer_class.__name__}",
        "optimizer_kwargs": {k: v for k, v in group.items() if k != "params" and _plain(v)},
        "micro_batch": cfg.micro_batch,
        "grad_accum": cfg.grad_accum,
        "set_to_none": cfg.set_to_none,
        "image": image if isinstance(model, ref.ResNet) else None,
        "seq": None if isinstance(model, ref.ResNet) else (seq or min(128, _positions(backbone))),
        "regex": doc["checkpoint"]["regex"],
        "modules": wrapped,
        "warmup": warmup,
        "steps": records,
        "median_seconds": median,
        "peak_bytes": max(s["peak_bytes"] for s in timed),
        "start_bytes": timed[0]["start_bytes"],
        "meter": os.path.basename(meter.path),
    }
    if any(s["peak_bytes"] != timed[0]["peak_bytes"] for s in timed):
        out["peak_varies"] = [s["peak_bytes"] for s in timed]
    return out


def _positions(backbone):
    # BERT's backbone carries the config; GPT-2's `transformer` and Llama's `model` do not, the
    # model around them does.
    cfg = getattr(backbone, "config", None) or model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def _plain(v):
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v))


def regex_plan(regex, names, precision="fp32", optimizer="adamw", micro_batch=1, optimizer_impl="single"):
    """A plan dict for a bare checkpoint regex (the benchmark's sets): `names` are the modules
    it matches, as `ckptune.apply` checks them."""
    return {"format": "ckptune.plan/1", "checkpoint": {"regex": regex or r"^[^\s\S]$", "modules": list(names)},
            "config": {"precision": precision, "optimizer": optimizer, "optimizer_impl": optimizer_impl,
                       "micro_batch": micro_batch, "grad_accum": 1, "set_to_none": True}}


def matching(model_name, regex, root=None):
    """The reference backbone's module names that fully match `regex` ('' matches none)."""
    if not regex:
        return []
    with torch.device("meta"):
        model, prefix = reference(root).build(model_name)
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    return [n for n, _ in backbone.named_modules() if n and re.fullmatch(regex, n)]


def write_atomic(path, obj):
    """`obj` (JSON, or a str as it is) to `path` through a synced temporary file and a rename: a
    reader never sees half a file, and a failed write leaves the old one."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            if isinstance(obj, str):
                f.write(obj)
            else:
                json.dump(obj, f, indent=2)
                f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_output(path, doc):
    """A command's JSON result: to `path` atomically when one is given, else to stdout."""
    if path:
        write_atomic(path, doc)
    else:
        json.dump(doc, sys.stdout, indent=2)
        print()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ckptune.eager", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, help="a plan written by `ckptune plan -o`")
    ap.add_argument("--steps", type=int, default=5, help="steps in all, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--root", help="the ckptune checkout (default: $CKPTUNE_ROOT, else this package's)")
    ap.add_argument("-o", "--output")
    a = ap.parse_args(argv)
    try:
        doc = load_plan(a.plan)
        shape, device = doc.get("shape") or {}, doc.get("device") or {}
        if not str(device.get("device", "cpu")).startswith("cpu"):
            raise ValueError(f"the plan is for {device.get('device')}; the PyTorch run measures the CPU")
        if "model" not in shape:
            raise ValueError(f"{a.plan} has no shape.model: re-plan with this ckptune")
        out = run(shape["model"], doc, image=shape.get("image"), seq=shape.get("seq"), steps=a.steps,
                  warmup=a.warmup, threads=int(device.get("threads") or 1), root=a.root,
                  log=lambda m: print(m, file=sys.stderr))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_output(a.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
