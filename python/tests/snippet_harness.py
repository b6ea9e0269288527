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
`apply_plan` on torchtitan's TrainingConfig and ParallelismConfig (flex attention has no CPU
backward, so the model runs forward only).
fsdp2: the snippet's `main` on each of its RANKS ranks, launched by torchrun (the venv's
`python -m torch.distributed.run`, gloo on 127.0.0.1), each rank the reference model with its own
batches; every rank reports as the python kind does, plus the `fully_shard` calls the snippet
made (module and `reshard_after_forward`, in order) and whether its parameters are sharded.
Every rank is gone when the harness returns, however the run ended: torchrun stops the others
when one fails, the harness stops torchrun at its timeout, a rank dies with torchrun
(PR_SET_PDEATHSIG), and the harness checks each rank's pid before it returns.
"""

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
import uuid
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


def record_autocast_cache(backbone):
    """Whether autocast's weight-cast cache was on in each forward of the backbone under autocast."""
    seen = []

    def hook(*_):
        if torch.is_autocast_enabled("cpu"):
            seen.append(torch.is_autocast_cache_enabled())

    backbone.register_forward_pre_hook(hook)
    return seen


def tiny_batches(name, steps, batch, seq=16, image=32, seed=1):
    g = torch.Generator().manual_seed(seed)
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
        self.autocast_cache = record_autocast_cache(backbone)
        self.before = [p.detach().clone() for p in model.parameters()]

    def report(self, micro_steps, **extra):
        return {"calls": self.calls, "micro_steps": micro_steps, "trained": changed(self.before, self.model),
                "autocast": sorted(set(map(str, self.autocast))),
                "autocast_cache": sorted(set(self.autocast_cache)), **extra}


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
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    if mod.ACTIVATION_CHECKPOINT is not None:
        mod.ACTIVATION_CHECKPOINT.build().apply(model)
    wrapped = sorted(n[: -len("._checkpoint_wrapped_module")] for n, _ in model.named_modules()
                     if n.endswith("._checkpoint_wrapped_module"))
    # The real config classes (slotted dataclasses): a field name torchtitan lacks fails here.
    config = types.SimpleNamespace(training=TrainingConfig(), parallelism=ParallelismConfig(),
                                   activation_checkpoint=None)
    mod.apply_plan(config)
    tokens = torch.randint(0, 100, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        out = model(tokens, positions, model.get_attention_masks(positions))
    t = config.training
    return {"wrapped": wrapped, "ac": type(mod.ACTIVATION_CHECKPOINT).__qualname__,
            "training": {"local_batch_size": t.local_batch_size, "global_batch_size": t.global_batch_size,
                         "seq_len": t.seq_len, "dtype": t.dtype, "mixed_precision_param": t.mixed_precision_param},
            "parallelism": {"data_parallel_shard_degree": config.parallelism.data_parallel_shard_degree,
                            "fsdp_reshard_after_forward": config.parallelism.fsdp_reshard_after_forward},
            "output": list(out.shape)}


# ------------------------------------------------------------------------------ fsdp2


def _loopback_interface():
    """The loopback interface's name (`lo` on Linux, `lo0` on macOS), if there is one."""
    return next((name for _, name in socket.if_nameindex() if re.fullmatch(r"lo\d*", name)), None)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _rank_pids(out):
    return sorted(int(p.read_text()) for p in Path(out).glob("rank*.pid"))


def _rank_errors(out):
    """Every failed rank's traceback, the first to report first. Which one is the cause is not
    always the first: a rank that raises closes its connections on the way out (the snippet's
    `finally: destroy_process_group()`), and its peers' collectives fail at once."""
    errors = sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.error")), key=lambda e: e["time"])
    return "\n".join(f"rank {e['rank']} failed:\n{e['traceback'].rstrip()}" for e in errors) or None


class LaunchError(RuntimeError):
    """An fsdp2 run that did not complete; `pids` are its rank processes, all gone by now."""

    def __init__(self, message, pids):
        super().__init__(message)
        self.pids = pids


def run_fsdp2(path, name, steps, watch=(), timeout=120.0):
    """Launches the snippet on its RANKS ranks with torchrun and returns every rank's report, or
    raises LaunchError naming the failing rank (or the timeout) with torchrun's output. Every
    rank process is gone when this returns or raises."""
    ranks = snippet(path).RANKS  # the parent only reads the rank count
    out = tempfile.mkdtemp(prefix="ckptune-fsdp2-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    lo = _loopback_interface()
    if lo and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = lo  # gloo's pairs bind to loopback, not the host's address
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={ranks}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4()}",
           "--max-restarts=0", str(Path(__file__).resolve()), "fsdp2-rank", str(path), name, str(steps),
           json.dumps(list(watch)), out]
    log_path = Path(out) / "torchrun.log"
    failure = None
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                failure = f"the {ranks} ranks did not finish within {timeout:g} s; stopped torchrun and its ranks"
                proc.terminate()  # torchrun passes it on to its ranks and waits for them
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
                    proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            else:
                if code != 0:
                    failure = _rank_errors(out) or f"torchrun exited with {code}"
        pids = _rank_pids(out)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        outlived = [p for p in pids if alive(p)]
        for p in outlived:
            os.kill(p, signal.SIGKILL)
        if failure is None and outlived:
            failure = f"rank processes {outlived} outlived torchrun"
        if failure is not None:
            tail = log_path.read_bytes()[-4000:].decode(errors="replace")
            raise LaunchError(f"{failure}\n--- torchrun output\n{tail}", pids)
        reports = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]
        return {"ranks": reports, "pids": pids, "alive_after": [p for p in pids if alive(p)]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def fsdp2_rank(path, name, steps, out):
    """One rank under torchrun: the snippet's `main` with a `build` that gives the reference model
    (the same seed on every rank) and this rank's batches; writes the rank's report to `out`."""
    # SIGKILL this rank when torchrun, which started it, dies, however it dies.
    from ckptune_harness.lifetime import die_with_parent  # noqa: PLC0415

    die_with_parent(os.getppid())
    rank = int(os.environ["RANK"])
    (Path(out) / f"rank{rank}.pid").write_text(str(os.getpid()))
    try:
        report = _fsdp2_rank(path, name, steps, rank)
    except BaseException as e:
        error = {"rank": rank, "time": time.time(), "traceback": "".join(traceback.format_exception(e))}
        (Path(out) / f"rank{rank}.error").write_text(json.dumps(error))
        raise
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))


def _fsdp2_rank(path, name, steps, rank):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mod = snippet(path)
    state = {"names": {}, "calls": [], "shards": None}
    fully_shard = mod.fully_shard

    def recording(module, **kwargs):
        """The snippet's fully_shard, recording which module and how; after the root's call, this
        rank's shards as they were before training."""
        who = state["names"].get(id(module), "<root>")
        state["calls"].append([who, kwargs.get("reshard_after_forward")])
        result = fully_shard(module, **kwargs)
        if who == "<root>":
            state["shards"] = [p.to_local().detach().clone() for p in module.parameters()]
            state["backend"] = dist.get_backend()
            state["world_size"] = dist.get_world_size()
        return result

    mod.fully_shard = recording

    def build(r):
        torch.manual_seed(0)  # the same initial weights on every rank, as FSDP requires
        model, prefix = reference.build(name)
        backbone = model.get_submodule(prefix.rstrip("."))
        state["names"] = {id(m): n for n, m in backbone.named_modules()}
        state["model"] = model
        state["seen"] = Observed(model, backbone)
        micro = mod.PLAN["config"]["micro_batch"]
        accum = mod.PLAN["config"]["grad_accum"]
        return model, tiny_batches(name, steps * accum, micro, seed=1 + r), reference_loss(name)

    wrapped = mod.main(build)
    model = state["model"]
    after = [p.to_local().detach() for p in model.parameters()]
    seen = state["seen"]
    report = {
        "calls": seen.calls, "micro_steps": steps * mod.PLAN["config"]["grad_accum"], "wrapped": wrapped,
        "autocast": sorted(set(map(str, seen.autocast))),
        "rank": rank, "pid": os.getpid(), "world_size": state["world_size"], "backend": state["backend"],
        "fully_shard": state["calls"], "process_group_destroyed": not dist.is_initialized(),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        # this rank's own shards changed: the optimizer stepped on them
        "trained": any(not torch.equal(a, b) for a, b in zip(state["shards"], after)),
    }
    return report


def main():
    global WATCH
    kind, path, name, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    WATCH = json.loads(sys.argv[5]) if len(sys.argv) > 5 else []
    if kind == "fsdp2-rank":  # one rank, started by run_fsdp2's torchrun
        fsdp2_rank(path, name, steps, sys.argv[6])
        return
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
    elif kind == "fsdp2":
        result = run_fsdp2(path, name, steps, WATCH)
    else:
        raise SystemExit(f"unknown kind {kind}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
