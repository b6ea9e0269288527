"""The times part of `scripts/gpu_check`: does the cost model's estimate for a named GPU
(`ckptune plan --target cuda:NAME`, docs/cost-model.md "GPU rates: the table") hold on that GPU?
On the GPU, with PyTorch alone: each model's prepared plans (nothing checkpointed, then
checkpointed) trained in turn, interleaved over rounds, in one fresh process per model with no
other process on the card and no allocator history recorded (the memory part's runs record it,
which slows every allocation); then the unconstrained plan once more with CUDA events around each
block's forward and backward. Here again: the measured step, recompute and block times against
the plans' estimates, and the candidates' order by bytes saved per second of their forward
(a checkpoint's own cost beyond it shows only in the steps' difference, the recompute row).

    python3 scripts/gpu_check_times.py measure --plans A.json B.json -o model.json   # on the GPU
    (scripts/gpu_check runs both phases: work/times/ on the GPU, times.{json,md} here)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

from gpu_check_steps import write_atomic  # noqa: E402

MEASURED_FORMAT = "ckptune.gpu-times-measured/1"
FORMAT = "ckptune.gpu-times/1"
ROUNDS, STEPS, WARMUP = 3, 7, 2
TIMEOUT_S = 240
# The cost bench's target per block on the CPU (docs/cost-model.md, "How good it is").
BLOCK_TARGET = 0.15


def plans_by_model(work):
    """work/models/index.json's plans grouped by model, in order (the unconstrained plan first)."""
    with open(os.path.join(work, "models", "index.json")) as f:
        plans = json.load(f)["plans"]
    groups = {}
    for p in plans:
        groups.setdefault(p["model"], []).append(p)
    return groups


def measure_all(work, python=sys.executable):
    """One process per model, one at a time, under the allocator setting its unconstrained plan
    recommends: work/times/MODEL.json, or {"error": ...} there when the process fails."""
    out_dir = os.path.join(work, "times")
    os.makedirs(out_dir, exist_ok=True)
    for model, plans in plans_by_model(work).items():
        paths = [os.path.join(work, "models", p["plan"]) for p in plans]
        with open(paths[0]) as f:
            conf = json.load(f)["cuda_memory"]["alloc_conf"]
        out = os.path.join(out_dir, f"{model}.json")
        cmd = [python, os.path.abspath(__file__), "measure", "--plans", *paths, "-o", out]
        print(f"gpu_check: timing {model} on the GPU", file=sys.stderr)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                                  env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf, PYTHONUNBUFFERED="1"))
            error = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {TIMEOUT_S} s"
        if error:
            print(f"gpu_check: timing {model} failed: {error}", file=sys.stderr)
            write_atomic(out, {"format": MEASURED_FORMAT, "model": model, "error": error})


class _Mark:
    """A wall-clock stand-in for a CUDA event (`elapsed_time` in milliseconds, as CUDA's)."""

    def __init__(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return 1000 * (end.t - self.t)


class BlockTimer:
    """CUDA events around each named block: forward from its pre-hook to its hook; backward from
    the gradient reaching its output to the gradient of its input (a block whose input needs no
    gradient, the first, has no backward end). Every forward and backward of every step, in order."""

    def __init__(self, torch, names, device="cuda"):
        self.torch, self.names, self.cuda = torch, names, device == "cuda"
        self.events = {n: {"forward": [], "backward": []} for n in names}
        self.missing = []

    def __call__(self, backbone):
        for name in self.names:
            try:
                module = backbone.get_submodule(name)
            except AttributeError:
                self.missing.append(name)
                continue
            module.register_forward_pre_hook(self._pre(name), with_kwargs=True)
            module.register_forward_hook(self._post(name), with_kwargs=True)

    def _event(self):
        if not self.cuda:  # a test of the pipeline on the CPU: wall-clock marks
            return _Mark()
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _pre(self, name):
        def hook(_module, _args, _kwargs):
            self.events[name]["forward"].append([self._event(), None])
        return hook

    def _post(self, name):
        def hook(_module, args, kwargs, output):
            self.events[name]["forward"][-1][1] = self._event()
            y = output
            while isinstance(y, (tuple, list)) and y:
                y = y[0]
            if not self.torch.is_tensor(y) or not y.requires_grad:
                return
            x = next((a for a in (*args, *kwargs.values()) if self.torch.is_tensor(a) and a.requires_grad), None)
            pair = [None, None]
            self.events[name]["backward"].append(pair)

            def started(_grad):
                pair[0] = self._event()

            def ended(_grad):
                pair[1] = self._event()
            y.register_hook(started)
            if x is not None:
                x.register_hook(ended)
        return hook

    def seconds(self, warmup):
        """Per block, the median forward and backward seconds of the steps after `warmup`."""
        if self.cuda:
            self.torch.cuda.synchronize()

        def median(pairs):
            xs = [a.elapsed_time(b) / 1000 for a, b in pairs[warmup:] if a is not None and b is not None]
            return statistics.median(xs) if xs else None
        return {n: {k: median(v) for k, v in e.items()} for n, e in self.events.items()}


def run_plan(eager, doc, args, instrument=None):
    shape = doc.get("shape") or {}
    return eager.run(shape["model"], doc, image=shape.get("image"), seq=shape.get("seq"),
                     attention=shape.get("attention", "eager"), steps=args.steps, warmup=args.warmup, threads=4,
                     root=ROOT, device=args.device, instrument=instrument)


def measure_cmd(args):
    import torch  # noqa: PLC0415

    from ckptune import load_plan  # noqa: PLC0415
    from ckptune_harness import eager  # noqa: PLC0415

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.init()
    docs = [load_plan(p) for p in args.plans]
    rounds = []
    for _ in range(args.rounds):  # interleaved: each round runs every plan once
        row = []
        for doc in docs:
            run = run_plan(eager, doc, args)
            row.append({"median_seconds": run["median_seconds"], "seconds": [s["seconds"] for s in run["steps"]],
                        "peak_bytes": run["peak_bytes"]})
            if cuda:
                torch.cuda.empty_cache()
        rounds.append(row)
    blocks = [b["name"] for b in docs[0]["model"]["blocks"]]
    timer = BlockTimer(torch, blocks, args.device)
    run_plan(eager, docs[0], args, instrument=timer)
    device = torch.cuda.get_device_properties(0).name if cuda else "cpu (a test of the pipeline, not a GPU)"
    # MODEL.predicted.json: the name may hold dots of its own (qwen2.5-bf16).
    model = os.path.basename(args.plans[0]).removesuffix(".json").rsplit(".", 1)[0]
    out = {"format": MEASURED_FORMAT, "model": model,
           "plans": [os.path.basename(p) for p in args.plans], "device": device, "torch": torch.__version__,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "steps": args.steps, "warmup": args.warmup,
           "rounds": rounds, "blocks": timer.seconds(args.warmup), "blocks_not_found": timer.missing}
    write_atomic(args.output, out)


def rel(measured, predicted):
    return None if not measured or predicted is None else (predicted - measured) / measured


def value(saved, seconds):
    return saved / max(seconds, 1e-12)


def ranking(candidates, saved, estimated, measured):
    """Kendall's tau over the pairs the estimate orders (as runtime/examples/cost_bench.rs ranks
    them: blocks of one work class tie in the estimate), and whether no pair is reversed."""
    agree = pairs = 0
    for k, a in enumerate(candidates):
        for b in candidates[k + 1:]:
            e = value(saved[a], estimated[a]) - value(saved[b], estimated[b])
            if abs(e) <= 1e-9 * abs(value(saved[a], estimated[a])):
                continue
            m = value(saved[a], measured[a]) - value(saved[b], measured[b])
            pairs += 1
            agree += 1 if (e > 0) == (m > 0) else -1
    return (1.0, True) if pairs == 0 else (agree / pairs, agree == pairs)


def pooled_by_class(values, classes):
    """Each block's measured value as the profile pools it: the median over its work class."""
    out = []
    for i, c in enumerate(classes):
        xs = [values[j] for j in range(len(values)) if classes[j] == c and values[j] is not None]
        out.append(statistics.median(xs) if xs and values[i] is not None else None)
    return out


def compare_model(measured, plans):
    """One model's row: each plan's step, the recompute it adds, each block, and the ranking."""
    steps = []
    for k, plan in enumerate(plans):
        medians = [r[k]["median_seconds"] for r in measured["rounds"]]
        m = statistics.median(medians)
        steps.append({"plan": measured["plans"][k], "regex": plan["checkpoint"]["regex"],
                      "checkpointed": len(plan["checkpoint"].get("modules") or []),
                      "predicted_seconds": plan["predicted"]["step_seconds"], "measured_seconds": m,
                      "measured_by_round": medians, "rel_error": rel(m, plan["predicted"]["step_seconds"])})
    row = {"model": measured["model"], "device": measured["device"], "torch": measured["torch"],
           "alloc_conf": measured["alloc_conf"], "estimated_by": plans[0]["predicted"].get("step_seconds_estimated"),
           "steps": steps}
    if len(steps) > 1:
        p = steps[1]["predicted_seconds"] - steps[0]["predicted_seconds"]
        m = steps[1]["measured_seconds"] - steps[0]["measured_seconds"]
        row["recompute"] = {"predicted_seconds": p, "measured_seconds": m, "rel_error": rel(m, p)}
    row.update(compare_blocks(measured["blocks"], plans[0]))
    return row


def predicted_blocks(profile):
    """Each block's predicted forward and backward seconds: the cost model's for the plan's
    GPU (`profile.estimated.blocks`), else the profile's own (a profile that timed its steps)."""
    estimated = (profile.get("estimated") or {}).get("blocks")
    regime = profile["regimes"][0]["blocks"]
    if estimated:
        return [(e["forward"], e["backward"]) for e in estimated]
    return [(b["fwd_seconds"], b["bwd_seconds"]) for b in regime]


def compare_blocks(measured, plan):
    profile = plan["profile"]
    regime = profile["regimes"][0]["blocks"]
    names = [b["name"] for b in regime]
    blocks = []
    for b, (fwd, bwd) in zip(regime, predicted_blocks(profile)):
        m = measured.get(b["name"], {})
        blocks.append({"name": b["name"], "candidate": b.get("candidate", False),
                       "forward": {"predicted": fwd, "measured": m.get("forward"),
                                   "rel_error": rel(m.get("forward"), fwd)},
                       "backward": {"predicted": bwd, "measured": m.get("backward"),
                                    "rel_error": rel(m.get("backward"), bwd)}})
    forward = pooled_by_class([blk["forward"]["measured"] for blk in blocks], profile["recompute_class"])
    candidates = [i for i, b in enumerate(regime) if b.get("candidate") and forward[i] is not None]
    saved = [b["kept_grad"] - b["kept_nograd"] for b in regime]
    # Both sides by the block's forward: a checkpoint's own cost beyond it (the recompute row)
    # is measured only over the whole step.
    estimated = [blk["forward"]["predicted"] for blk in blocks]
    tau, same = ranking(candidates, saved, estimated, forward)
    errors = [abs(x[k]["rel_error"]) for x in blocks for k in ("forward", "backward") if x[k]["rel_error"] is not None]
    return {"blocks": blocks, "block_names": names,
            "ranking": {"kendall_tau": tau, "same_order": same, "candidates": len(candidates)},
            "blocks_within_target": sum(e <= BLOCK_TARGET for e in errors), "block_terms": len(errors)}


def compare(work):
    """work/times/ against the plans: the document (`FORMAT`), or None when nothing was timed."""
    out_dir = os.path.join(work, "times")
    if not os.path.isdir(out_dir):
        return None
    rows, failures = [], {}
    for model, entries in plans_by_model(work).items():
        path = os.path.join(out_dir, f"{model}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            measured = json.load(f)
        if "error" in measured:
            failures[model] = measured["error"]
            continue
        measured["model"] = model  # the index's name (results/gpu/measured.tgz's files cut it at a dot)
        plans = []
        for p in entries:
            with open(os.path.join(work, "models", p["plan"])) as f:
                plans.append(json.load(f))
        rows.append(compare_model(measured, plans))
    return {"format": FORMAT, "rounds": ROUNDS, "steps": STEPS, "warmup": WARMUP, "models": rows, "failures": failures}


def pct(x):
    return "—" if x is None else f"{100 * x:+.1f}%"


def ms(x):
    return "—" if x is None else f"{1000 * x:.1f} ms"


def markdown(doc):
    rows = doc["models"]
    device = rows[0]["device"] if rows else "?"
    lines = ["# Step times on the GPU: the cost model's estimate against PyTorch", "",
             f"Written by `scripts/gpu_check` (scripts/gpu_check_times.py) from a run on {device}, torch "
             f"{rows[0]['torch'] if rows else '?'}. Predicted: `ckptune plan --target cuda:NAME --measure estimate` on "
             "this machine (times from the GPU table's peaks and stated efficiencies, nothing run on a GPU). "
             "Measured: the model's plain-torch reference trained on the GPU with the plan applied by the companion, "
             f"{doc['steps']} steps of which the first {doc['warmup']} are warm-up, the plans of a model interleaved "
             f"over {doc['rounds']} rounds in one process alone on the card (the median of the rounds' medians); "
             "blocks: CUDA events around each block's forward and backward in a run of the unconstrained plan; "
             "recompute: the checkpointed plan's step less the unconstrained one's; ranking: the candidates by bytes "
             "saved per second of their forward, estimated against measured (Kendall's tau over the pairs the "
             "estimate orders).", "",
             "| model | plan | predicted step | measured step | error | recompute: predicted / measured |"
             " blocks within 15% | ranking (Kendall's tau) |",
             "|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        rec = r.get("recompute")
        for k, s in enumerate(r["steps"]):
            extra = ["", "", ""]
            if k == 0:
                extra = [f"{ms(rec['predicted_seconds'])} / {ms(rec['measured_seconds'])}" if rec else "—",
                         f"{r['blocks_within_target']} of {r['block_terms']}",
                         f"{r['ranking']['kendall_tau']:.2f} ({r['ranking']['candidates']} candidates)"]
            what = f"`{s['regex']}`" if s.get("checkpointed") else "nothing checkpointed"
            lines.append(f"| {r['model']} | {what} | {ms(s['predicted_seconds'])} | "
                         f"{ms(s['measured_seconds'])} | {pct(s['rel_error'])} | {' | '.join(extra)} |")
    lines += ["", "Per block (the unconstrained plan; forward, then backward: predicted / measured, error):", ""]
    for r in rows:
        lines.append(f"- {r['model']}: " + "; ".join(
            f"{b['name']} {ms(b['forward']['predicted'])} / {ms(b['forward']['measured'])} "
            f"({pct(b['forward']['rel_error'])}), {ms(b['backward']['predicted'])} / "
            f"{ms(b['backward']['measured'])} ({pct(b['backward']['rel_error'])})" for b in r["blocks"]))
    if doc["failures"]:
        lines += ["", "Runs that failed:", ""] + [f"- {k}: {v}" for k, v in doc["failures"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/gpu_check_times.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="on the GPU: time one model's plans, interleaved, and its blocks")
    m.add_argument("--plans", nargs="+", required=True, help="the model's plans, the unconstrained one first")
    m.add_argument("--rounds", type=int, default=ROUNDS)
    m.add_argument("--steps", type=int, default=STEPS)
    m.add_argument("--warmup", type=int, default=WARMUP)
    m.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: wall-clock marks instead of CUDA events, to test the pipeline without a GPU")
    m.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    measure_cmd(args)


if __name__ == "__main__":
    main()
