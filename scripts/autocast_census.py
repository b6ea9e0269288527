"""Every aten operator of one bf16 (or fp32) training step of a built-in model's plain-torch
reference, as the device runs it: the operator, its inputs' and outputs' dtypes and shapes, and
on CUDA the bytes the caching allocator handed out inside the operator beyond its outputs (a
kernel's own workspace). Run once on the CPU and once on a GPU, the two lists show where CPU and
CUDA autocast (or a kernel) differ, which a trace made with CPU semantics for a CUDA target gets
wrong (`--compare A B`).

    python3 scripts/autocast_census.py --model tinyllama-1.1b --layers 2 --device cuda -o gpu.json
    python3 scripts/autocast_census.py --compare cpu.json gpu.json

Needs PyTorch only (the GPU machine has no ckptune binary). `--layers` keeps the first N layers
of the model's stack: every layer runs the same operators, and the CPU run stays short.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

FORMAT = "ckptune.autocast-census/1"


def tensors(x):
    import torch  # noqa: PLC0415

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors(y)]
    return []


def describe(ts):
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in ts]


def truncate(model, layers):
    """Keeps the first `layers` entries of the model's one ModuleList of layers."""
    import torch  # noqa: PLC0415

    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > layers]
    if not lists:
        return
    name, stack = max(lists, key=lambda nm: len(nm[1]))
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    setattr(parent, name.rsplit(".", 1)[-1], torch.nn.ModuleList(list(stack)[:layers]))


def census(args):
    import torch  # noqa: PLC0415
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    from ckptune_harness import reference  # noqa: PLC0415

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    ref = reference.load(ROOT)
    torch.manual_seed(0)
    with torch.device(device):
        model, prefix = ref.build(args.model, "sdpa")
    truncate(model, args.layers)
    model.to(device).train()
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    gen = torch.Generator().manual_seed(1234)
    draw, loss_of = reference.batches(ref, model, backbone, args.batch, None, args.seq, gen)
    batch = tuple(x.to(device) if torch.is_tensor(x) else x for x in draw())
    records = []

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            kw = kw or {}
            before = torch.cuda.memory_allocated(device) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            out = func(*a, **kw)
            row = {"op": str(func.overloadpacket.__name__) + "." + func._overloadname,
                   "in": describe(tensors(list(a) + list(kw.values()))), "out": describe(tensors(out))}
            if cuda:
                outs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors(out)}
                row["workspace"] = torch.cuda.max_memory_allocated(device) - before - sum(outs.values())
            records.append(row)
            return out

    enabled = args.precision == "bf16"
    with Census():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=False):
            loss = loss_of(batch)
        loss.backward()
    doc = {"format": FORMAT, "model": args.model, "layers": args.layers, "device": str(device),
           "torch": torch.__version__, "precision": args.precision, "batch": args.batch, "seq": args.seq,
           "ops": records}
    tmp = f"{args.output}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, args.output)


def compare(a_path, b_path):
    """Aligns the two operator lists and prints where they differ (operator or dtypes), and the
    operators with a workspace of their own."""
    import difflib  # noqa: PLC0415

    a, b = (json.load(open(p)) for p in (a_path, b_path))

    def key(r):
        return f"{r['op']} in={[d for d, _ in r['in']]} out={[d for d, _ in r['out']]}"

    ka, kb = [key(r) for r in a["ops"]], [key(r) for r in b["ops"]]
    print(f"{a['device']}: {len(ka)} ops; {b['device']}: {len(kb)} ops")
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ka, kb, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        print(f"-- {tag} {a['device']}[{i1}:{i2}] {b['device']}[{j1}:{j2}]")
        for r in a["ops"][i1:i2]:
            print(f"   {a['device']:>6}  {r['op']}  in={r['in']}  out={r['out']}")
        for r in b["ops"][j1:j2]:
            print(f"   {b['device']:>6}  {r['op']}  in={r['in']}  out={r['out']}")
    for doc in (a, b):
        for i, r in enumerate(doc["ops"]):
            if r.get("workspace", 0) > 0:
                print(f"workspace {doc['device']}[{i}] {r['op']}: {r['workspace']:,} B  out={r['out']}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tinyllama-1.1b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("-o", "--output")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args(argv)
    if args.compare:
        compare(*args.compare)
    elif not args.output:
        p.error("-o is required to record a census")
    else:
        census(args)


if __name__ == "__main__":
    main()
