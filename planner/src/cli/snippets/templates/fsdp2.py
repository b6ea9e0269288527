${header}# Launch one process per rank: torchrun --nproc_per_node ${ranks} train.py
# Needs torch with torch.distributed.fsdp.fully_shard (2.6 or later) and the ckptune companion
# (`pip install ./python` from a ckptune checkout).
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptune

${plan}${root_comment}RANKS = ${ranks}


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
${init_process_group}
    if dist.get_world_size() != RANKS:
        raise RuntimeError(f"the plan is for {RANKS} ranks, this run has {dist.get_world_size()}: launch it with "
                           f"torchrun --nproc_per_node {RANKS}, or plan again with --shard {dist.get_world_size()}")
    return device


def shard(model, loss_fn, device):
    """The plan on this rank's `model`: ckptune.apply checkpoints the plan's modules, fully_shard
    makes each unit an FSDP unit, then the root takes every other parameter and, as FSDP does by
    default, keeps them unsharded from its forward to its backward.
    ${units_doc}
    Returns the root, whose forward is the loss, and the names ckptune.apply wrapped."""
    backbone = ckptune.plan_root(model, PLAN)
    wrapped = ckptune.apply(backbone, PLAN)
    cfg = ckptune.training_config(PLAN)
    model.to(device=device, dtype=cfg.param_dtype)
    mesh = init_device_mesh(device.type, (RANKS,))
${fully_shard_units}    root = LossRoot(model, loss_fn)
    fully_shard(root, mesh=mesh)
    return root, wrapped


def train(model, loader, loss_fn, device, lr=1e-3):
    """Trains `model` on this rank as the plan was measured: the plan's modules checkpointed, the
    model sharded over the ${ranks} ranks, its precision, optimizer, accumulation and zero_grad. Every
    rank builds `model` with the same initial weights (FSDP shards one model); `loader` yields this
    rank's own batches of ${micro_batch} samples (a DistributedSampler splits a dataset); `loss_fn(model,
    batch)` returns the loss. Returns the names `ckptune.apply` wrapped."""
    root, wrapped = shard(model, loss_fn, device)
    cfg = ckptune.training_config(PLAN)
    root.train()
    # The plan's optimizer (${optimizer}) on this rank's shards.
    opt = cfg.optimizer_class(root.parameters(), lr=lr, **cfg.optimizer_kwargs)
    scaler = torch.amp.GradScaler(device.type) if cfg.grad_scaler else None
${training_loop}


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
