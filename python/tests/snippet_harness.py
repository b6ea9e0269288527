"""Executes a snippet printed by `ckptune plan --emit KIND` in the trainer it is for, on a small
model whose module names are the plan's, and prints what happened as JSON: which modules ran
twice per step (forward and recompute: checkpointed), whether training changed the weights.
Driven by planner/tests/emit.rs:

    python snippet_harness.py KIND SNIPPET.py MODEL STEPS CANDIDATES_JSON

CANDIDATES_JSON lists the plan's candidate modules: each is watched, so the caller sees that the
planned ones, and only they, ran twice.

python: the plain-torch reference of MODEL (models/fixtures/reference.py), the snippet's `train`.
hf: transformers' own BertForSequenceClassification for tiny-bert (built from its config, no
download), or the reference for other models, through the snippet's `make_trainer`.
lightning: the reference inside a LightningModule (`self.model`), the snippet's callback,
optimizer mix-in and `make_trainer`.
torchtitan: torchtitan's Llama 3 debug model; its ACTIVATION_CHECKPOINT built and applied, and
`apply_plan` on torchtitan's TrainingConfig (flex attention has no CPU backward, so the model
runs forward only).
"""

import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "python"))


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = load(ROOT / "models" / "fixtures" / "reference.py", "ckptune_reference")
torch.set_num_threads(1)
WATCH = []  # the candidate modules whose calls are counted (set by main)


def snippet(path):
    """The snippet run as a module, as a user would paste it into one."""
    return load(path, "ckptune_snippet")


def count_calls(backbone, names):
    """Counts forward pre-hook calls of each named module's first child (a child: the wrapper
    replaces the module's forward, so the module's own hooks run once; its children run in the
    forward and again in the recompute)."""
    calls = {}
    for name, module in backbone.named_modules():
        if name in names:
            child = next(module.children())
            calls[name] = 0
            child.register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    return calls


def record_autocast(backbone):
    """The CPU autocast dtype (None: off) each forward of the backbone ran under."""
    seen = []

    def hook(*_):
        seen.append(str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None)

    backbone.register_forward_pre_hook(hook)
    return seen


def tiny_batches(name, steps, batch, seq=16, image=32):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if name == "tiny-resnet":
            out.append((torch.randn(batch, 3, image, image, generator=g), torch.randint(0, 10, (batch,), generator=g)))
        else:
            ids = torch.randint(0, 100, (batch, seq), generator=g)
            mask = torch.ones(batch, seq, dtype=torch.long)
            out.append((ids, mask, torch.randint(0, 2, (batch,), generator=g)))
    return out


def reference_loss(name):
    def loss_fn(model, batch):
        if name == "tiny-resnet":
            x, y = batch
            return F.cross_entropy(model(x), y)
        ids, mask, y = batch
        if name == "tiny-bert":
            _, pooled = model.bert(ids, mask)
            return F.cross_entropy(model.classifier(model.dropout(pooled)), y)
        return model(ids, ids)[1]
    return loss_fn


def changed(before, model):
    return any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


class Observed:
    """What every trainer's run reports: the watched modules' calls, the autocast dtypes the
    backbone's forwards ran under, and whether training changed the parameters."""

    def __init__(self, model, backbone):
        self.model = model
        self.calls = count_calls(backbone, WATCH)
        self.autocast = record_autocast(backbone)
        self.before = [p.detach().clone() for p in model.parameters()]

    def report(self, micro_steps, **extra):
        return {"calls": self.calls, "micro_steps": micro_steps, "trained": changed(self.before, self.model),
                "autocast": sorted(set(map(str, self.autocast))), **extra}


def run_python(mod, name, steps):
    torch.manual_seed(0)
    model, prefix = reference.build(name)
    backbone = model.get_submodule(prefix.rstrip("."))
    seen = Observed(model, backbone)
    micro = mod.PLAN["config"]["micro_batch"]
    accum = mod.PLAN["config"]["grad_accum"]
    wrapped = mod.train(model, tiny_batches(name, steps * accum, micro), reference_loss(name))
    return seen.report(steps * accum, wrapped=wrapped)


def hf_model(name):
    """transformers' own model for tiny-bert; the reference for the rest (a plain nn.Module
    the Trainer drives through `compute_loss_func`)."""
    if name == "tiny-bert":
        from transformers import BertConfig, BertForSequenceClassification
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32)
        model = BertForSequenceClassification(cfg)
        return model, model.bert
    torch.manual_seed(0)
    model, prefix = reference.build(name)
    return model, model.get_submodule(prefix.rstrip("."))


def run_hf(mod, name, steps, out_dir):
    model, backbone = hf_model(name)
    seen = Observed(model, backbone)
    micro = mod.PLAN["config"]["micro_batch"]
    accum = mod.PLAN["config"]["grad_accum"]
    n = steps * accum * micro
    if name == "tiny-bert":
        g = torch.Generator().manual_seed(1)
        data = [{"input_ids": torch.randint(0, 100, (16,), generator=g), "attention_mask": torch.ones(16, dtype=torch.long),
                 "labels": torch.randint(0, 2, (), generator=g)} for _ in range(n)]
        kwargs = {}
    else:
        g = torch.Generator().manual_seed(1)
        data = [{"x": torch.randn(3, 32, 32, generator=g), "labels": torch.randint(0, 10, (), generator=g)}
                for _ in range(n)]
        kwargs = {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: F.cross_entropy(outputs, labels)}
    trainer = mod.make_trainer(model, data, output_dir=out_dir, trainer_kwargs=kwargs, max_steps=steps,
                               use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                               disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0)
    trainer.train()
    flags = {n: bool(getattr(m, "gradient_checkpointing", False)) for n, m in backbone.named_modules()
             if hasattr(m, "gradient_checkpointing")}
    return seen.report(steps * accum, hf_flags=flags,
                       route="native" if "GradientCheckpointingLayer" in dir(mod) else "apply")


def run_lightning(mod, name, steps, out_dir):
    import lightning.pytorch as L

    torch.manual_seed(0)
    net, prefix = reference.build(name)
    backbone = net.get_submodule(prefix.rstrip("."))
    loss_fn = reference_loss(name)

    class Module(mod.CkptuneOptimization, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = net

        def training_step(self, batch, batch_idx):
            # Gradients alive when the forward starts: none with set_to_none (the plan frees them
            # after the optimizer step), all of them (zeroed in place) without.
            grads_at_forward.append(sum(p.grad is not None for p in self.model.parameters()))
            return loss_fn(self.model, batch)

    seen = Observed(net, backbone)
    grads_at_forward = []
    micro = mod.PLAN["config"]["micro_batch"]
    accum = mod.PLAN["config"]["grad_accum"]
    # A DataLoader over the samples: Lightning reads a plain list as a list of dataloaders.
    samples = [tuple(t[i] for t in b) for b in tiny_batches(name, steps * accum, micro) for i in range(micro)]
    data = torch.utils.data.DataLoader(samples, batch_size=micro)
    trainer = mod.make_trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                               default_root_dir=out_dir)
    callback = next(c for c in trainer.callbacks if isinstance(c, mod.CkptunePlan))
    # How the optimizer's gradients were zeroed, as Lightning called zero_grad.
    zeroed = set()
    original = torch.optim.Optimizer.zero_grad

    def recording(self, set_to_none=True):
        zeroed.add(set_to_none)
        return original(self, set_to_none=set_to_none)

    torch.optim.Optimizer.zero_grad = recording
    try:
        trainer.fit(Module(), train_dataloaders=data)
    finally:
        torch.optim.Optimizer.zero_grad = original
    return seen.report(steps * accum, wrapped=callback.wrapped, precision=str(trainer.precision),
                       set_to_none=sorted(zeroed), grads_at_forward=grads_at_forward,
                       parameters=sum(1 for _ in net.parameters()))


def run_torchtitan(mod):
    from torchtitan.config import TrainingConfig
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    if mod.ACTIVATION_CHECKPOINT is not None:
        mod.ACTIVATION_CHECKPOINT.build().apply(model)
    wrapped = sorted(n[: -len("._checkpoint_wrapped_module")] for n, _ in model.named_modules()
                     if n.endswith("._checkpoint_wrapped_module"))
    config = types.SimpleNamespace(training=TrainingConfig(), activation_checkpoint=None)
    mod.apply_plan(config)
    tokens = torch.randint(0, 100, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        out = model(tokens, positions, model.get_attention_masks(positions))
    t = config.training
    return {"wrapped": wrapped, "ac": type(mod.ACTIVATION_CHECKPOINT).__qualname__,
            "training": {"local_batch_size": t.local_batch_size, "global_batch_size": t.global_batch_size,
                         "seq_len": t.seq_len, "dtype": t.dtype, "mixed_precision_param": t.mixed_precision_param},
            "output": list(out.shape)}


def main():
    global WATCH
    kind, path, name, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    WATCH = json.loads(sys.argv[5]) if len(sys.argv) > 5 else []
    out_dir = str(Path(path).parent / "trainer-out")
    mod = snippet(path)
    if kind == "python":
        result = run_python(mod, name, steps)
    elif kind == "hf":
        result = run_hf(mod, name, steps, out_dir)
    elif kind == "lightning":
        result = run_lightning(mod, name, steps, out_dir)
    elif kind == "torchtitan":
        result = run_torchtitan(mod)
    else:
        raise SystemExit(f"unknown kind {kind}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
