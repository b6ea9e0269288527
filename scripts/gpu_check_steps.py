"""The real-step part of `scripts/gpu_check`, on the GPU with PyTorch alone (no ckptune binary):
trains a built-in model's plain-torch reference (models/fixtures/reference.py) on CUDA with a
plan that ckptune made for `--target cuda` applied (`ckptune_harness.eager.run(device="cuda")`),
reads the allocated and reserved peak of every step from `torch.cuda.memory_stats`, and records
the allocator's own history of the whole run (`torch.cuda.memory._record_memory_history`), which
it converts into a `ckptune.alloc-trace/1` trace with the GPU's reserved bytes after every
event, so `ckptune simulate-allocator` can be checked on a real step, event by event.

    python3 scripts/gpu_check_steps.py context -o context.json
    PYTORCH_CUDA_ALLOC_CONF=... python3 scripts/gpu_check_steps.py step --plan P --label L -o run.json

`context` measures what the card holds outside the caching allocator (the CUDA context, then
cuBLAS's and cuDNN's first use): `torch.cuda.mem_get_info` against the allocator's reserved bytes.
Each `step` must run in a fresh process started with the PYTORCH_CUDA_ALLOC_CONF it reports.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

TRACE_FORMAT = "ckptune.alloc-trace/1"
STEPS_FORMAT = "ckptune.gpu-step/1"
CONTEXT_FORMAT = "ckptune.gpu-context/1"
# Enough for a 1B-parameter model's build and a few steps (each entry is one allocator event).
MAX_HISTORY = 4_000_000


def write_atomic(path, doc):
    """Compact JSON (ckptune_harness.output's is indented: a trace here runs to 100,000 events)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)


def outside_allocator(torch, device):
    """Bytes the device has in use that the caching allocator did not reserve (this process's
    CUDA context and libraries, and any other process's memory)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def context_cmd(args):
    import torch  # noqa: PLC0415

    device = torch.device("cuda", 0)
    torch.cuda.init()
    torch.empty(1, device=device)  # creates the context
    rows = {"context": outside_allocator(torch, device)}
    a = torch.randn(1024, 1024, device=device)
    (a @ a).sum().item()  # cuBLAS's handle and workspace
    rows["after_cublas"] = outside_allocator(torch, device)
    conv = torch.nn.Conv2d(3, 8, 3).to(device)
    conv(torch.randn(2, 3, 32, 32, device=device)).sum().backward()  # cuDNN's handle
    rows["after_cudnn"] = outside_allocator(torch, device)
    props = torch.cuda.get_device_properties(device)
    doc = {"format": CONTEXT_FORMAT, "device": props.name, "total_memory": props.total_memory,
           "capability": list(torch.cuda.get_device_capability(device)), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "outside_allocator_bytes": rows, "reserved_bytes": torch.cuda.memory_reserved(device)}
    write_atomic(args.output, doc)


def convert_history(entries):
    """The allocator's trace entries as `ckptune.alloc-trace/1` events, and the GPU's reserved
    bytes after each event. Blocks are named by a fresh id per allocation (addresses repeat);
    a block is freed when the allocator takes it back (`free_completed`); streams are numbered
    in order of first use. Segment events change reserved bytes but are the allocator's own
    doing, which the simulation must reproduce, so they are not events of the trace."""
    events, reserved_after, ids, streams = [], [], {}, {}
    reserved, next_id, notes = 0, 0, {}
    for e in entries:
        action = e["action"]
        if action in ("segment_alloc", "segment_map"):
            reserved += e["size"]
        elif action in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
        elif action == "alloc":
            stream = streams.setdefault(e["stream"], len(streams))
            ids[e["addr"]] = next_id
            events.append(["a", next_id, e["size"], stream])
            next_id += 1
            reserved_after.append(reserved)
        elif action == "free_completed":
            block = ids.pop(e["addr"], None)
            if block is None:  # allocated before the history started
                notes["frees_of_unknown_blocks"] = notes.get("frees_of_unknown_blocks", 0) + 1
                continue
            events.append(["f", block])
            reserved_after.append(reserved)
        elif action == "oom":
            notes["oom"] = notes.get("oom", 0) + 1
    # The last event's reserved bytes can lag the segment events after it (a release at the end).
    return events, reserved_after, reserved, notes


def step_cmd(args):
    import torch  # noqa: PLC0415

    from ckptune import load_plan  # noqa: PLC0415
    from ckptune_harness import eager  # noqa: PLC0415

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    doc = load_plan(args.plan)
    shape = doc.get("shape") or {}
    device = torch.device("cuda", 0)
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=MAX_HISTORY, context=None, stacks="python")
    run = eager.run(shape["model"], doc, image=shape.get("image"), seq=shape.get("seq"),
                    attention=shape.get("attention", "eager"), steps=args.steps, warmup=args.warmup,
                    threads=4, root=ROOT, device=device, log=lambda m: print(m, file=sys.stderr))
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events, reserved_after, reserved_end, notes = convert_history(snapshot["device_traces"][0])
    stats = torch.cuda.memory_stats(device)
    out = {"format": STEPS_FORMAT, "label": args.label, "alloc_conf": conf, "plan": os.path.basename(args.plan),
           "device": torch.cuda.get_device_name(device), "total_memory": torch.cuda.get_device_properties(device).total_memory,
           "outside_allocator_bytes": outside_allocator(torch, device), "run": run,
           "whole_run": {"allocated_peak_bytes": stats["allocated_bytes.all.peak"],
                         "reserved_peak_bytes": stats["reserved_bytes.all.peak"],
                         "num_alloc_retries": stats["num_alloc_retries"], "num_ooms": stats["num_ooms"]},
           "trace_events": len(events), "history_notes": notes}
    write_atomic(args.output, out)
    if args.trace:
        write_atomic(args.trace, {"format": TRACE_FORMAT, "alloc_conf": conf, "events": events,
                                  "gpu_reserved_after": reserved_after, "gpu_reserved_end": reserved_end})


def main(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/gpu_check_steps.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("context", help="what the card holds outside the caching allocator")
    c.add_argument("-o", "--output", required=True)
    s = sub.add_parser("step", help="train the plan's model on the GPU; its peaks and its allocator trace")
    s.add_argument("--plan", required=True, help="a plan written by `ckptune plan --target cuda -o`")
    s.add_argument("--label", required=True)
    s.add_argument("--steps", type=int, default=4, help="steps in all, warm-up included")
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--trace", help="write the run's allocator trace here (ckptune.alloc-trace/1)")
    s.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    (context_cmd if args.command == "context" else step_cmd)(args)


if __name__ == "__main__":
    main()
