"""A ckptune built-in model (or a Llama-family config.json) trained in PyTorch eager, its exact CPU peak measured with ckptune's
own counting allocator (`ckptune_harness.meter`) loaded into this process: the PyTorch side of
`ckptune verify --pytorch` and of the benchmark (scripts/bench/eager.py).

The model is the built-in name's plain-torch reference (models/fixtures/reference.py of a
ckptune checkout: torchvision ResNet, Hugging Face BERT, GPT-2 and Llama in eager mode, the same
module names), or for a Hugging Face config.json of the Llama family (the file or its folder, as
the plan names the model) the reference Llama built from its fields with seeded random weights
(a step's bytes do not depend on the weights' values), its modules checkpointed with
`ckptune.apply`. Per step, as ckptune's runtime
does it: reset the peak; per micro-batch make the batch (the shapes and dtypes of ckptune's
`Chain::make_batch`), forward and loss (under CPU autocast for bf16), `backward()`; then the
optimizer step and `zero_grad(set_to_none=...)` (or, for a plan that steps the optimizer in
backward, `ckptune.optimizer_in_backward`'s hooks during `backward()`): the loop of ckptune's docs/memory-model.md, in
which each micro-batch and its loss are released after its backward except the last one's,
which stay alive through the optimizer step, as a loop's variables do. The meter is installed before the model is built, so absolute levels count the
same tensors as ckptune's.

    python -m ckptune_harness.eager --plan plan.json -o run.json   # the plan's model, regex and config

Exit codes: 0 done, 2 bad input (a plan this run cannot follow: another format, a model
without a reference, names that differ), 1 anything else.
"""

import argparse
import os
import sys
import time
from typing import Any, Callable, List, NamedTuple

import torch
from torch import nn

from ckptune import apply, load_plan, optimizer_in_backward, plan_root, selective_policy, training_config

from . import host_memory
from . import meter as meter_mod
from . import reference
from .cuda_meter import CudaMeter
from .output import optimizer_settings, write_output

FORMAT = "ckptune.pytorch-run/1"


class _Training(NamedTuple):
    """The model being trained, with what a step needs."""

    model: nn.Module
    backbone: nn.Module
    wrapped: List[str]
    device: torch.device
    make_batch: Callable[[], Any]
    loss_of: Callable[[Any], torch.Tensor]
    opt: Any  # a torch.optim.Optimizer, or ckptune.OptimizerInBackward


def run(model_name, plan, *, image=None, seq=None, attention=None, steps=6, warmup=2, threads=2, lr=1e-3,
        root=None, log=None, autocast_cache=None, device="cpu", instrument=None):
    """Trains the reference of `model_name` with `plan` (a path or dict: its checkpoint and
    config) applied, and measures every step. Returns the run as a dict (format `FORMAT`).
    `attention` is a transformer's `attn_implementation` (None: "sdpa", ckptune's default).
    `autocast_cache` is autocast's `cache_enabled` (False: bf16 weight casts are not kept until
    the autocast region ends); None follows the plan's config, the loop its peak was planned for.
    `device` "cpu" counts every tensor byte with ckptune's meter; a CUDA device reads PyTorch's
    caching-allocator statistics instead, and each step reports its reserved peak too.
    `instrument`, when given, is called with the backbone once the plan is applied and before
    the first step (to add hooks that time its blocks, say).

    Raises ValueError for a plan this cannot follow (its names differ from the reference's, a
    precision or optimizer torch cannot run on CPU, a model without a reference).
    """
    if steps <= warmup:
        raise ValueError(f"steps {steps} must exceed warmup {warmup}")
    doc = load_plan(plan)
    cfg = training_config(doc)
    if autocast_cache is None:
        autocast_cache = cfg.autocast_cache
    device = torch.device(device)
    if cfg.grad_scaler:
        raise ValueError(f"precision {cfg.precision!r} runs on CUDA only; this run measures the CPU"
                         if device.type == "cpu" else
                         f"precision {cfg.precision!r} needs a GradScaler, which this run does not drive yet")
    ref = reference.load(root)
    if model_name not in ref.NAMES and ref.config_json(model_name) is None:
        raise ValueError(f"model {model_name!r} has no plain-torch reference (models/fixtures/reference.py "
                         f"has {', '.join(ref.NAMES)}, and builds a Hugging Face config.json of "
                         f"{', '.join(ref.CONFIG_TYPES)}); the PyTorch run covers those models only")

    torch.set_num_threads(threads)
    if device.type == "cpu":
        meter = meter_mod.Meter(meter_mod.build())  # installed before anything is allocated
        host_memory.hold()
    else:
        meter = CudaMeter(device)
    t = _build(ref, model_name, doc, cfg, image, seq, attention, lr, device)
    if instrument is not None:
        instrument(t.backbone)
    records = []
    for i in range(steps):
        records.append(_step(i + 1, t, cfg, meter, autocast_cache))
        if log:
            r = records[-1]
            log(f"  step {i + 1:>3}  loss {r['loss']:.6f}  {r['seconds']:.3f} s  peak {meter.peak():,} B")
    out = _result(model_name, doc, cfg, ref, t, records, warmup, image, seq, autocast_cache, meter)
    if attention:
        out["attention"] = attention
    return out


def _build(ref, model_name, doc, cfg, image, seq, attention, lr, device):
    """The reference with the plan applied, in the plan's dtype and on `device`, its batches
    (drawn on the CPU, as ckptune draws them, then moved) and its optimizer."""
    torch.manual_seed(0)
    # On a GPU the model is built there (its initialization is the GPU's too): a 1B model's
    # initialization on the CPU would take longer than its steps.
    with torch.device(device):
        config = None if model_name in ref.NAMES else ref.config_json(model_name)
        model, prefix = ref.build(model_name, attention) if config is None else ref.build_config(config, attention)
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    wrapped = apply(backbone, doc)  # checks the plan's names against the reference first
    model.to(device=device, dtype=cfg.param_dtype).train()

    gen = torch.Generator().manual_seed(1234)  # the batch's own generator: dropout is untouched
    draw, loss_of = reference.batches(ref, model, backbone, cfg.micro_batch, image, seq, gen, cfg.loss_chunks)

    def make_batch():
        return tuple(x.to(device) if torch.is_tensor(x) else x for x in draw())

    if cfg.optimizer_in_backward:
        opt = optimizer_in_backward(model.parameters(), cfg.optimizer_class, lr=lr, **cfg.optimizer_kwargs)
    else:
        opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)
    return _Training(model, backbone, wrapped, device, make_batch, loss_of, opt)


def _step(number, t, cfg, meter, autocast_cache):
    """One measured step: every micro-batch's forward and backward, then the optimizer step. The
    last micro-batch and its loss stay alive through the optimizer step, as a loop's do."""
    pure = cfg.param_dtype != torch.float32
    meter.reset_peak()
    start = meter.current()
    t0 = time.perf_counter()
    loss_sum = 0.0
    for k in range(cfg.grad_accum):
        batch = t.make_batch()
        if pure and batch[0].is_floating_point():
            batch = (batch[0].to(cfg.param_dtype),) + batch[1:]
        with torch.autocast(t.device.type, dtype=cfg.autocast_dtype or torch.bfloat16,
                            enabled=cfg.autocast_dtype is not None, cache_enabled=autocast_cache):
            loss = t.loss_of(batch)
        loss.backward()
        loss_sum += loss.item()
        if k + 1 < cfg.grad_accum:
            del loss, batch
    if not cfg.optimizer_in_backward:  # stepped in backward otherwise, by the hooks
        t.opt.step()
        t.opt.zero_grad(set_to_none=cfg.set_to_none)
    del loss, batch
    peak = meter.peak()  # on CUDA this waits for the step's kernels
    seconds = time.perf_counter() - t0
    record = {"step": number, "loss": loss_sum / cfg.grad_accum, "seconds": seconds,
              "peak_bytes": peak, "start_bytes": start, "end_bytes": meter.current()}
    if hasattr(meter, "reserved_peak"):
        record["reserved_peak_bytes"] = meter.reserved_peak()
    return record


def _result(model_name, doc, cfg, ref, t, records, warmup, image, seq, autocast_cache, meter):
    """The run as written (format `FORMAT`): the config it followed, every step, and the peak and
    median time of the steps after the warm-up."""
    timed = records[warmup:]
    secs = sorted(s["seconds"] for s in timed)
    mid = len(secs) // 2
    median = secs[mid] if len(secs) % 2 else 0.5 * (secs[mid - 1] + secs[mid])
    resnet = isinstance(t.model, ref.ResNet)
    out = {
        "format": FORMAT,
        "model": model_name,
        "torch": torch.__version__,
        "device": str(t.device),
        "threads": torch.get_num_threads(),
        "precision": cfg.precision,
        "autocast_cache": autocast_cache,
        "optimizer": cfg.optimizer,
        "optimizer_class": f"{cfg.optimizer_class.__module__}.{cfg.optimizer_class.__name__}",
        "optimizer_kwargs": optimizer_settings(t.opt.optimizers[0] if cfg.optimizer_in_backward else t.opt),
        "optimizer_in_backward": cfg.optimizer_in_backward,
        "micro_batch": cfg.micro_batch,
        "grad_accum": cfg.grad_accum,
        "set_to_none": cfg.set_to_none,
        "loss_chunks": cfg.loss_chunks,
        "image": image if resnet else None,
        "seq": None if resnet else reference.default_seq(t.model, t.backbone, seq),
        "regex": doc["checkpoint"]["regex"],
        "modules": t.wrapped,
        **_selective(t, doc),
        "warmup": warmup,
        "steps": records,
        "median_seconds": median,
        "peak_bytes": max(s["peak_bytes"] for s in timed),
        **({"reserved_peak_bytes": max(s["reserved_peak_bytes"] for s in timed)}
           if "reserved_peak_bytes" in timed[0] else {}),
        "start_bytes": timed[0]["start_bytes"],
        "meter": os.path.basename(meter.path),
    }
    if any(s["peak_bytes"] != timed[0]["peak_bytes"] for s in timed):
        out["peak_varies"] = [s["peak_bytes"] for s in timed]
    return out


def _selective(t, doc):
    """`{"selective": ...}` for the wrapped modules that run selective, read from the modules
    themselves (`ckptune.selective_policy`), as the plan writes it: one `{"policy", "modules"}`
    when they run under one policy, a list of them, one per policy, when under several; {} when
    none does."""
    root = plan_root(t.backbone, doc)
    groups = {}
    for n in t.wrapped:
        p = selective_policy(root.get_submodule(n))
        if p is not None:
            groups.setdefault(p, []).append(n)
    runs = [{"policy": p, "modules": ms} for p, ms in groups.items()]
    if not runs:
        return {}
    return {"selective": runs[0] if len(runs) == 1 else runs}


def cpu_plan(path, what):
    """The plan at `path`, its model name and the run's keyword arguments from its shape and
    device (image, seq, attention, threads), for `what` (a run that measures the CPU). Raises
    ValueError for a plan made for another device or without `shape.model`."""
    doc = load_plan(path)
    shape, device = doc.get("shape") or {}, doc.get("device") or {}
    if not str(device.get("device", "cpu")).startswith("cpu"):
        raise ValueError(f"the plan is for {device.get('device')}; {what} measures the CPU")
    if "model" not in shape:
        raise ValueError(f"{path} has no shape.model: re-plan with this ckptune")
    # A plan without an attention predates the choice: eager, then the only attention.
    return doc, shape["model"], {"image": shape.get("image"), "seq": shape.get("seq"),
                                 "attention": shape.get("attention", "eager"),
                                 "threads": int(device.get("threads") or 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ckptune_harness.eager", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, help="a plan written by `ckptune plan -o`")
    ap.add_argument("--steps", type=int, default=5, help="steps in all, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--root", help="the ckptune checkout (default: $CKPTUNE_ROOT, else this package's)")
    ap.add_argument("-o", "--output")
    a = ap.parse_args(argv)
    try:
        doc, model, kwargs = cpu_plan(a.plan, "the PyTorch run")
        out = run(model, doc, steps=a.steps, warmup=a.warmup, root=a.root,
                  log=lambda m: print(m, file=sys.stderr), **kwargs)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_output(a.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
