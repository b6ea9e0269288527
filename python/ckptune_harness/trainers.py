"""A plan trained by the trainer its snippet targets — the Hugging Face `Trainer` (`--emit hf`) or
Lightning (`--emit lightning`) — its exact CPU peak measured with ckptune's counting allocator
(`ckptune_harness.meter`): the trainer side of `ckptune verify --pytorch --trainer hf|lightning`.

What runs is what `ckptune_harness.eager` runs, handed to the trainer: the built-in name's
plain-torch reference (models/fixtures/reference.py), its batches drawn as eager draws them (the
same generator, shapes and padding, one micro-batch per call of the loader's collate function),
the same loss, and the plan applied by the emitted snippet itself (SNIPPET.py, loaded as a user
would paste it): its `make_trainer` builds the trainer, its precision, accumulation, optimizer
and checkpointing. The reference is handed over in a thin wrapper: for the Hugging Face `Trainer`
a module whose `forward(x, y, mask)` returns `{"loss": ...}`, whose transformer layers derive from
transformers' `GradientCheckpointingLayer` as transformers' own layers do, and which enables
checkpointing with transformers' own `PreTrainedModel` methods (the snippet's per-layer route);
for Lightning a LightningModule with the snippet's optimizer mix-in, holding it as `self.model`.

A step is an optimizer step: its peak is the highest level between the end of one optimizer step
(after `zero_grad`, the trainer's step-end hook) and the end of the next, so the loader's fetches
in between count, as eager's batches do.

What the trainers hold that eager's loop does not is listed in the run's `explained` (bytes and
why), each entry computed from the run's own tensors; the peak less the explained bytes is the
loop's that ckptune predicts.

    python -m ckptune_harness.trainers --trainer hf --snippet hf.py --plan plan.json -o run.json

Exit codes: 0 done, 2 bad input (the trainer not installed, a precision it cannot run on the CPU,
what `ckptune_harness.eager` refuses), 1 anything else.
"""

import argparse
import contextlib
import gc
import importlib.util
import os
import sys
import tempfile
import time
import weakref

import torch
from torch import nn

from ckptune import load_plan, training_config, wrapped_modules

from . import eager
from . import host_memory
from . import meter as meter_mod
from . import reference
from .output import optimizer_settings, write_output

# The trainers run on the CPU, where the counting meter measures them.
CPU = torch.device("cpu")

TRAINERS = {
    "hf": ("the Hugging Face Trainer", ("transformers", "accelerate")),
    "lightning": ("Lightning", ("lightning",)),
}


def check_trainer(trainer, cfg):
    """Refuses (ValueError) a trainer that is not importable here, or a precision it cannot run
    on the CPU."""
    if trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {trainer!r}: one of {', '.join(TRAINERS)}")
    name, packages = TRAINERS[trainer]
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ValueError(f"{name} is not installed for this Python ({', '.join(missing)} not importable): "
                         f"scripts/setup installs the pinned trainers of python/requirements-trainers.txt "
                         f"at .trainers; put that folder on PYTHONPATH")
    if cfg.grad_scaler:
        raise ValueError(f"precision {cfg.precision!r} needs a GradScaler, which {name} runs on CUDA only; "
                         f"this run measures the CPU (plan with --precision fp32, bf16 or bf16-pure)")


def load_snippet(path):
    """The emitted snippet as a module, as a user would paste it into one."""
    spec = importlib.util.spec_from_file_location("ckptune_snippet", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Indices(torch.utils.data.Dataset):
    """`n` samples that are only their index: the collate function draws the batch itself."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _batch_maker(t, cfg):
    """One micro-batch per call, as eager's step makes it (bf16-pure: floating inputs cast)."""

    def make():
        batch = t.make_batch()
        if cfg.param_dtype != torch.float32 and batch[0].is_floating_point():
            batch = (batch[0].to(cfg.param_dtype),) + batch[1:]
        return batch

    return make


def batch_bytes(batch):
    """Bytes of a batch's tensors."""
    return sum(x.untyped_storage().nbytes() for x in batch if isinstance(x, torch.Tensor))


class _Steps:
    """The step records: each optimizer step's peak, from the end of the previous one, and at each
    step's end the bytes of the tensors the trainer's loop holds that eager's does not."""

    def __init__(self, meter, log, loop_tensors, accum):
        self.meter, self.log, self.loop_tensors, self.records = meter, log, loop_tensors, []
        self.start = self.t0 = None
        self.accum, self.losses = accum, []
        self.backward_copy_bytes = 0  # the largest loss copy a trainer's backward ran on (Hugging Face)

    def loss(self, loss):
        """Counts a micro-batch's loss (a float: `.item()` allocates nothing) and returns it."""
        self.losses.append(loss.item())
        return loss

    def begin(self):
        self.meter.reset_peak()
        self.start, self.t0 = self.meter.current(), time.perf_counter()

    def end(self):
        r = {"step": len(self.records) + 1, "loss": sum(self.losses) / self.accum, "seconds": time.perf_counter() - self.t0,
             "peak_bytes": self.meter.peak(), "start_bytes": self.start, "end_bytes": self.meter.current(),
             "loop_tensor_bytes": self.loop_tensors(), "backward_copy_bytes": self.backward_copy_bytes}
        self.records.append(r)
        self.losses, self.backward_copy_bytes = [], 0
        if self.log:
            self.log(f"  step {r['step']:>3}  {r['seconds']:.3f} s  peak {r['peak_bytes']:,} B")
        self.begin()


class _Batches:
    """The collate function's batches: drawn as eager draws them, their storages remembered (weakly)
    so that the tensors the trainer itself keeps can be told from them."""

    def __init__(self, t, cfg):
        self.make = _batch_maker(t, cfg)
        self.bytes = None
        self.storages = weakref.WeakValueDictionary()

    def __call__(self):
        batch = self.make()
        for x in batch:
            if isinstance(x, torch.Tensor):
                self.storages[x.untyped_storage().data_ptr()] = x
        self.bytes = batch_bytes(batch)
        return batch


def _loop_tensors(model, opt_of, batches, before):
    """A function giving the bytes of the live tensors that are none of: the model's parameters,
    gradients and buffers, the optimizer's state, the batches, or tensors that lived before the
    meter was installed (the trainers' module constants). Eager's loop holds none at a step's end."""

    def measure():
        known = set(before) | set(batches.storages.keys())
        for p in model.parameters():
            known.add(p.untyped_storage().data_ptr())
            if p.grad is not None:
                known.add(p.grad.untyped_storage().data_ptr())
        for b in model.buffers():
            known.add(b.untyped_storage().data_ptr())
        opt = opt_of()
        for state in (opt.state.values() if opt is not None else ()):
            known.update(v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
        seen = {}
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                ptr = o.untyped_storage().data_ptr()
                if ptr and ptr not in known:
                    seen[ptr] = o.untyped_storage().nbytes()
        return sum(seen.values())

    return measure


def _live_storages():
    return {o.untyped_storage().data_ptr() for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and o.device.type == "cpu"}


# ------------------------------------------------------------------------------ Hugging Face


# The reference's transformer layers whose transformers classes derive from GradientCheckpointingLayer.
_HF_LAYERS = ("BertLayer", "GPT2Block", "LlamaDecoderLayer")


def _hf_model(ref, net, loss_of):
    """The reference in a module the Trainer drives: `forward(x, y, mask)` returns the loss, and
    transformers' checkpointing methods and layer base class, so the snippet's per-layer route
    runs transformers' own code on it."""
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    layer_classes = tuple(getattr(ref, n) for n in _HF_LAYERS)
    rebased = {}
    for m in net.modules():
        cls = type(m)
        if cls in layer_classes:
            if cls not in rebased:
                rebased[cls] = type(cls.__name__, (cls, GradientCheckpointingLayer), {})
            m.__class__ = rebased[cls]

    class ReferenceForTrainer(nn.Module):
        supports_gradient_checkpointing = True
        main_input_name = "x"  # not input_ids: the embeddings' outputs need no require_grad hook
        activation_checkpointing_enable = PreTrainedModel.activation_checkpointing_enable
        gradient_checkpointing_enable = PreTrainedModel.gradient_checkpointing_enable
        _activation_checkpointing_enable = PreTrainedModel._activation_checkpointing_enable
        _set_gradient_checkpointing = PreTrainedModel._set_gradient_checkpointing
        _is_overridden = PreTrainedModel._is_overridden

        def __init__(self):
            super().__init__()
            self.model = net

        def forward(self, x, y, mask=None):
            return {"loss": loss_of((x, y, mask))}

    return ReferenceForTrainer()


def _run_hf(mod, ref, t, cfg, n, lr, steps, out_dir, meter, log, before):
    from transformers import TrainerCallback

    batches = _Batches(t, cfg)
    holder = {}
    rec = _Steps(meter, log, _loop_tensors(t.model, lambda: holder.get("opt"), batches, before), cfg.grad_accum)

    class Measure(TrainerCallback):
        def on_train_begin(self, *_, **__):
            rec.begin()

        def on_step_end(self, *_, **__):
            rec.end()

    def collate(_):
        x, y, mask = batches()
        return {"x": x, "y": y, **({} if mask is None else {"mask": mask})}

    model = _hf_model(ref, t.model, lambda b: rec.loss(t.loss_of(b)))
    trainer = mod.make_trainer(
        model, _Indices(n), lr=lr, output_dir=out_dir,
        trainer_kwargs={"data_collator": collate, "callbacks": [Measure()]},
        max_steps=steps, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0, max_grad_norm=0.0)
    holder["opt"] = trainer.optimizer
    trainer.accelerator.backward = _BackwardCopy(trainer.accelerator.backward, rec)
    trainer.train()
    return rec.records, trainer.optimizer, batches.bytes


class _BackwardCopy:
    """`Accelerator.backward`, recording the bytes of the tensor it runs backward on when that is
    not the loss it was handed: accelerate divides the loss by its gradient_accumulation_steps
    (even by 1) and runs backward on the quotient, so while the backward runs the Trainer holds
    that copy beside its own `loss`, where eager's loop holds the one `loss`. Keeps no tensor."""

    def __init__(self, backward, rec):
        self.backward, self.rec = backward, rec

    def __call__(self, loss, **kwargs):
        plain = torch.Tensor.backward
        given = loss.untyped_storage().data_ptr()
        rec = self.rec

        def spy(tensor, *args, **kw):
            storage = tensor.untyped_storage()
            rec.backward_copy_bytes = max(rec.backward_copy_bytes,
                                          0 if storage.data_ptr() == given else storage.nbytes())
            return plain(tensor, *args, **kw)

        torch.Tensor.backward = spy
        try:
            return self.backward(loss, **kwargs)
        finally:
            torch.Tensor.backward = plain


# ------------------------------------------------------------------------------ Lightning


def _run_lightning(mod, ref, t, cfg, n, lr, steps, out_dir, meter, log, before):
    import lightning.pytorch as L

    batches = _Batches(t, cfg)
    holder = {}
    rec = _Steps(meter, log, _loop_tensors(t.model, lambda: holder.get("opt"), batches, before), cfg.grad_accum)
    accum = cfg.grad_accum

    class Measure(L.Callback):
        def on_train_start(self, trainer, *_):
            holder["opt"] = trainer.optimizers[0]
            rec.begin()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % accum == 0:
                rec.end()

    net, loss_of = t.model, t.loss_of

    class Module(mod.CkptuneOptimization, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = net

        def training_step(self, batch, batch_idx):
            return rec.loss(loss_of(batch))

    Module.lr = lr
    data = torch.utils.data.DataLoader(_Indices(n), batch_size=cfg.micro_batch, collate_fn=lambda _: batches())
    trainer = mod.make_trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                               enable_checkpointing=False, enable_progress_bar=False,
                               enable_model_summary=False, default_root_dir=out_dir)
    trainer.callbacks.append(Measure())
    trainer.fit(Module(), train_dataloaders=data)
    return rec.records, trainer.optimizers[0], batches.bytes


# ------------------------------------------------------------------------------ the run


def _wrapped(backbone):
    """The modules that recompute: wrapped by ckptune.apply (the forward it keeps), or transformers'
    layers with their checkpointing flag on."""
    wrapped = set(wrapped_modules(backbone))
    return [name for name, m in backbone.named_modules()
            if getattr(m, "gradient_checkpointing", False) or name in wrapped]


def run(trainer, snippet, model_name, plan, *, image=None, seq=None, attention=None, steps=6, warmup=2,
        threads=2, lr=1e-3, root=None, log=None):
    """Trains the reference of `model_name` in `trainer` ("hf" or "lightning") through the snippet
    at `snippet` (emitted for `plan`), measuring every optimizer step. Returns the run as a dict
    (eager's format, with `trainer` and `explained`). Raises ValueError for bad input."""
    if steps <= warmup:
        raise ValueError(f"steps {steps} must exceed warmup {warmup}")
    doc = load_plan(plan)
    cfg = training_config(doc)
    check_trainer(trainer, cfg)
    ref = reference.load(root)
    if model_name not in ref.NAMES:
        raise ValueError(f"model {model_name!r} has no plain-torch reference (models/fixtures/reference.py "
                         f"has {', '.join(ref.NAMES)}); the PyTorch run covers built-in models only")
    mod = load_snippet(snippet)
    torch.set_num_threads(threads)
    before = _live_storages()  # the trainers' module constants, which the meter never sees
    meter = meter_mod.Meter(meter_mod.build())  # installed before anything is allocated
    host_memory.hold()
    t = _build(ref, model_name, cfg, image, seq, attention)
    # One step more than measured: the epoch's last step has no next batch to fetch ahead, so
    # every measured step is one of the many a real run has.
    ran = steps + 1
    runner = _run_hf if trainer == "hf" else _run_lightning
    with tempfile.TemporaryDirectory(prefix="ckptune-trainer-") as out_dir:
        records, opt, batch = runner(mod, ref, t, cfg, ran * cfg.grad_accum * cfg.micro_batch, lr, ran,
                                     out_dir, meter, log, before)
    if len(records) != ran:
        raise RuntimeError(f"{TRAINERS[trainer][0]} ran {len(records)} optimizer steps of {ran}")
    records = records[:steps]
    fake = eager._Training(model=t.model, backbone=t.backbone, wrapped=_wrapped(t.backbone), device=CPU,
                           make_batch=t.make_batch, loss_of=t.loss_of, opt=opt)
    out = eager._result(model_name, doc, cfg, ref, fake, records, warmup, image, seq,
                        cfg.autocast_cache, meter)
    out["trainer"] = trainer
    out["optimizer_kwargs"] = optimizer_settings(opt)
    out["explained"] = explained(trainer, records[warmup:], batch)
    if attention:
        out["attention"] = attention
    return out


def _build(ref, model_name, cfg, image, seq, attention):
    """The reference (the plan not applied: the snippet does that), its batches and loss."""
    torch.manual_seed(0)
    model, prefix = ref.build(model_name, attention)
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    model.train()
    gen = torch.Generator().manual_seed(1234)
    make_batch, loss_of = reference.batches(ref, model, backbone, cfg.micro_batch, image, seq, gen,
                                            cfg.loss_chunks)
    return eager._Training(model=model, backbone=backbone, wrapped=[], device=CPU, make_batch=make_batch,
                           loss_of=loss_of, opt=None)


def explained(trainer, timed, batch):
    """What the trainer's loop holds through a step that eager's does not, each with its bytes
    (measured in this run): the Hugging Face Trainer's next micro-batch, which accelerate's
    DataLoaderShard fetches one ahead, and the tensors either loop keeps from one step to the next
    (its running loss, the last loss, the gradient norm the Trainer computes even without clipping;
    Lightning's detached copy of the loss), and during the Hugging Face Trainer's backward the
    quotient accelerate runs it on."""
    name = TRAINERS[trainer][0]
    out = []
    if trainer == "hf":
        out.append({"bytes": batch, "why": "the next micro-batch, fetched one ahead by accelerate's "
                                           "DataLoaderShard"})
    copy = max(r["backward_copy_bytes"] for r in timed)
    if copy:
        out.append({"bytes": copy, "why": "the loss divided by accelerate's gradient_accumulation_steps in "
                                          "Accelerator.backward, the tensor backward runs on, beside the "
                                          "Trainer's own loss"})
    kept = max(r["loop_tensor_bytes"] for r in timed)
    if kept:
        out.append({"bytes": kept, "why": f"tensors {name}'s loop keeps from one step to the next "
                                          f"(loss scalars, the gradient norm)"})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ckptune_harness.trainers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", required=True, choices=sorted(TRAINERS))
    ap.add_argument("--snippet", required=True, help="the snippet `ckptune emit TRAINER plan.json` printed")
    ap.add_argument("--plan", required=True, help="a plan written by `ckptune plan -o`")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps in all, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--root", help="the ckptune checkout (default: $CKPTUNE_ROOT, else this package's)")
    ap.add_argument("-o", "--output")
    a = ap.parse_args(argv)
    try:
        doc, model, kwargs = eager.cpu_plan(a.plan, "the trainer run")
        with contextlib.redirect_stdout(sys.stderr):  # trainers print; stdout is the result
            out = run(a.trainer, a.snippet, model, doc, steps=a.steps, warmup=a.warmup, root=a.root,
                      log=lambda m: print(m, file=sys.stderr), **kwargs)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_output(a.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
