# Plain PyTorch FSDP2 training with the ckptune plan for bert-base-uncased (ckptune 0.1.0).
#   checkpoint: encoder.layer.4, encoder.layer.5, encoder.layer.7, encoder.layer.8, encoder.layer.10 (regex ^(?:encoder\.layer\.(?:4|5|7|8|10))$)
#   config fp32/adamw/mb4x1: precision fp32, optimizer adamw, micro-batch 4, gradient accumulation 1, set_to_none true
#   inputs: sequences of 128 tokens
#   attention: attn_implementation="sdpa" (load the model with it: the plan's memory is that attention's)
#   predicted peak 1.07 GiB (1,149,031,216 B) of the budget 1.07 GiB (1,153,433,600 B), measured on cpu, threads: 1
#   sharded over 2 ranks with FSDP2 (gloo): fully_shard on encoder.layer.0, encoder.layer.1, …, encoder.layer.11 (12 units) (reshard_after_forward=True), then on the root (every other parameter); micro-batch 4 per rank, 8 samples per micro-step over the 2 ranks
#   predicted peak per rank: ranks 0–1 1.07 GiB (1,149,031,216 B) at backward encoder.layer.4
# Launch one process per rank: torchrun --nproc_per_node 2 train.py
# Needs torch with torch.distributed.fsdp.fully_shard (2.6 or later) and the ckptune companion
# (`pip install ./python` from a ckptune checkout).
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptune

PLAN = {
    "format": "ckptune.plan/1",
    "model": {"prefix": "bert."},
    "checkpoint": {"regex": "^(?:encoder\\.layer\\.(?:4|5|7|8|10))$", "modules": ["encoder.layer.4", "encoder.layer.5", "encoder.layer.7", "encoder.layer.8", "encoder.layer.10"]},
    "config": {"grad_accum": 1, "micro_batch": 4, "optimizer": "adamw", "optimizer_impl": "single", "precision": "fp32", "set_to_none": True},
}
# ckptune plans the backbone: the plan's `encoder.layer.0` is `bert.encoder.layer.0` of
# a Hugging Face BertForSequenceClassification. The plan records that, so ckptune.apply takes
# the whole model (or the backbone, or a module holding either) and refuses, naming the
# closest modules, a model whose names differ.
RANKS = 2


class LossRoot(torch.nn.Module):
    """FSDP's root: the model, with the loss as its forward. The root's parameters (all but the
    units') are all-gathered in its pre-forward and stay unsharded until its backward, so the
    whole step runs inside it, as ckptune modelled it; a loss that calls submodules (BERT's
    `model.bert`, then `model.classifier`) would otherwise bypass the root's hooks."""

    def __init__(self, model, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


def init_distributed():
    """Joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    with gloo, the plan's collective, on the CPU; returns this rank's device."""
    device = torch.device("cpu")
    dist.init_process_group(backend="gloo")
    if dist.get_world_size() != RANKS:
        raise RuntimeError(f"the plan is for {RANKS} ranks, this run has {dist.get_world_size()}: launch it with "
                           f"torchrun --nproc_per_node {RANKS}, or plan again with --shard {dist.get_world_size()}")
    return device


def shard(model, loss_fn, device):
    """The plan on this rank's `model`: ckptune.apply checkpoints the plan's modules, fully_shard
    makes each unit an FSDP unit, then the root takes every other parameter and, as FSDP does by
    default, keeps them unsharded from its forward to its backward.
    Each of the 12 units frees its gathered parameters after its forward
    (reshard_after_forward=True) and gathers them again for its backward.
    Returns the root, whose forward is the loss, and the names ckptune.apply wrapped."""
    backbone = ckptune.plan_root(model, PLAN)
    wrapped = ckptune.apply(backbone, PLAN)
    cfg = ckptune.training_config(PLAN)
    model.to(device=device, dtype=cfg.param_dtype)
    mesh = init_device_mesh(device.type, (RANKS,))
    fully_shard(backbone.get_submodule("encoder.layer.0"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.1"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.2"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.3"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.4"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.5"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.6"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.7"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.8"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.9"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.10"), mesh=mesh, reshard_after_forward=True)
    fully_shard(backbone.get_submodule("encoder.layer.11"), mesh=mesh, reshard_after_forward=True)
    root = LossRoot(model, loss_fn)
    fully_shard(root, mesh=mesh)
    return root, wrapped


def train(model, loader, loss_fn, device, lr=1e-3):
    """Trains `model` on this rank as the plan was measured: the plan's modules checkpointed, the
    model sharded over the 2 ranks, its precision, optimizer, accumulation and zero_grad. Every
    rank builds `model` with the same initial weights (FSDP shards one model); `loader` yields this
    rank's own batches of 4 samples (a DistributedSampler splits a dataset); `loss_fn(model,
    batch)` returns the loss. Returns the names `ckptune.apply` wrapped."""
    root, wrapped = shard(model, loss_fn, device)
    cfg = ckptune.training_config(PLAN)
    root.train()
    # The plan's optimizer (adamw with foreach=False) on this rank's shards.
    opt = cfg.optimizer_class(root.parameters(), lr=lr, **cfg.optimizer_kwargs)
    scaler = torch.amp.GradScaler(device.type) if cfg.grad_scaler else None
    for step, batch in enumerate(loader):
        # cache_enabled as planned: autocast's cache keeps the casts of weights (checkpointed
        # layers' too) until this region ends, which the plan counts only when it was made with
        # --autocast-cache (docs/memory-model.md, "Autocast's cache").
        with torch.autocast(device.type, dtype=cfg.autocast_dtype, enabled=cfg.autocast_dtype is not None,
                            cache_enabled=cfg.autocast_cache):
            loss = root(batch) / cfg.grad_accum
        (scaler.scale(loss) if scaler else loss).backward()
        if (step + 1) % cfg.grad_accum == 0:
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=cfg.set_to_none)
    return wrapped


def build(rank):
    """Yours: (model, loader, loss_fn) for this rank, as `train` takes them."""
    raise NotImplementedError("build(rank): return your model, this rank's loader and loss_fn")


def main(build=build):
    """One rank's run: joins the process group, trains what build(rank) returns, leaves the group."""
    device = init_distributed()
    try:
        model, loader, loss_fn = build(dist.get_rank())
        wrapped = train(model, loader, loss_fn, device)
        dist.barrier()  # no rank leaves the group while a peer still needs it
        return wrapped
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
