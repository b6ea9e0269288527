"""Does the plan's predicted peak hold in PyTorch? ckptune's prediction, ckptune's own run and
PyTorch eager's run of the same model, checkpoint set and training config, side by side, with
every peak measured by the same counting allocator (results/pytorch-peaks/).

For ResNet-50 and BERT-base, fp32 and bf16 autocast, AdamW and SGD with momentum (torch.optim's
single-tensor implementation, PyTorch's CPU default), three checkpoint sets each, one of them a
set whose peak is the optimizer step; then BERT-base's optimizer-step case again with AdamW's
foreach and fused implementations. Per model and implementation: `ckptune profile` once,
`ckptune sweep --profile` over the sets (predicted and ckptune-measured peaks), and
`scripts/bench/eager.py` per point (PyTorch eager with `torch.utils.checkpoint`, the plain-torch
reference model with the same module names).

    .venv/bin/python scripts/pytorch_peaks.py           # results/pytorch-peaks (about 30 min)
    .venv/bin/python scripts/pytorch_peaks.py --quick   # tiny models, into /tmp/ckptune-pytorch-peaks
    .venv/bin/python scripts/pytorch_peaks.py --cache-rows   # add the --autocast-cache rows

The PyTorch runs keep autocast's cache on (PyTorch's default); `--cache-rows` profiles and
sweeps the bf16 configs with `--autocast-cache` (the loop of the Hugging Face Trainer) and runs
PyTorch for each of their points again (raw outputs tagged `-autocast-cache`), so both sides use
today's defaults (the attention implementation among them) even when the other rows are older.

Every number in the README it writes comes from the raw outputs kept under raw/.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

from ckptune_harness.output import write_atomic  # noqa: E402

PY = os.path.join(ROOT, ".venv", "bin", "python")
# CKPTUNE_BIN: a ckptune binary already built (a debug build measures the same bytes; only its
# step times are slower), instead of building the release one.
BIN = os.environ.get("CKPTUNE_BIN") or os.path.join(ROOT, "target", "release", "ckptune")
THREADS = 2

# Per model: the shape arguments, and the checkpoint sets as (label, regex). The last set of each
# is the one whose peak is the optimizer step: everything checkpointed at a small batch.
MODELS = {
    "resnet50": (["--batch", "2", "--image", "64"], [
        ("nothing", ""),
        ("layer3", "layer3"),
        ("every layer", "layer[1-4]"),
    ]),
    "bert-base-uncased": (["--batch", "8", "--seq", "128"], [
        ("nothing", ""),
        ("encoder.layer.{0..5}", r"encoder\.layer\.[0-5]"),
        ("every layer", r"embeddings|encoder\.layer\.\d+|pooler"),
    ]),
}
QUICK = {
    "tiny-resnet": (["--batch", "2", "--image", "32"], [
        ("nothing", ""), ("layer3", "layer3"), ("every layer", "layer[1-4]")]),
    "tiny-bert": (["--batch", "2", "--seq", "16"], [
        ("nothing", ""), ("encoder.layer.0", r"encoder\.layer\.0"),
        ("every layer", r"embeddings|encoder\.layer\.\d+|pooler")]),
}
PRECISIONS = ["fp32", "bf16"]
OPTIMIZERS = ["adamw", "sgd-momentum"]
# The extra runs: (model index, precision, optimizer, implementations, set index).
EXTRA_IMPLS = (1, "fp32", "adamw", ["foreach", "fused"], 2)


def run(cmd, log):
    print("  $ " + " ".join(cmd), file=sys.stderr)
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"pytorch_peaks: {cmd[0]} exited {r.returncode}; see {log}")
    return r.stdout


def ckptune_points(model, shape, sets, precisions, optimizers, impl, raw, autocast_cache=False):
    """(precision, optimizer, set label) -> sweep point, from one profile and one sweep."""
    tag = f"{model}-{impl}" + ("-autocast-cache" if autocast_cache else "")
    common = [*shape, "--precision", ",".join(precisions), "--optimizer", ",".join(optimizers),
              "--optimizer-impl", impl, "--threads", str(THREADS), "--repeats", "1", "--quiet",
              "--no-cache", *(["--autocast-cache"] if autocast_cache else [])]
    prof = os.path.join(raw, f"profile-{tag}.json")
    run([BIN, "profile", model, *common, "-o", prof], os.path.join(raw, f"profile-{tag}.log"))
    sweep = os.path.join(raw, f"sweep-{tag}.json")
    checkpoints = [a for _, rx in sets for a in ("--checkpoint", rx)]
    run([BIN, "sweep", model, *common, *checkpoints, "--profile", prof, "-o", sweep],
        os.path.join(raw, f"sweep-{tag}.log"))
    doc = json.load(open(sweep))
    out = {}
    for c in doc["configs"]:
        cfg = c["config"]
        if len(c["points"]) != len(sets):
            raise SystemExit(f"pytorch_peaks: {sweep} has {len(c['points'])} points for {len(sets)} sets")
        for (label, _), p in zip(sets, c["points"]):
            out[(cfg["precision"], cfg["optimizer"], label)] = p
    return out


def eager_point(model, shape, label, regex, precision, optimizer, impl, raw, autocast_cache=True, suffix=""):
    tag = f"{model}-{precision}-{optimizer}-{impl}-{label.replace(' ', '-')}{suffix}"
    if not autocast_cache:
        tag += "-no-autocast-cache"
    out = os.path.join(raw, f"eager-{tag}.json")
    full = f"^(?:{regex})$" if regex else ""
    run([PY, os.path.join(HERE, "bench", "eager.py"), model, "--checkpoint", full, *shape,
         "--precision", precision, "--optimizer", optimizer, "--optimizer-impl", impl,
         "--steps", "3", "--warmup", "2", "--threads", str(THREADS), "-o", out,
         *([] if autocast_cache else ["--no-autocast-cache"])],
        os.path.join(raw, f"eager-{tag}.log"))
    return json.load(open(out))


def row(model, label, regex, precision, optimizer, impl, p, e, autocast_cache=False):
    return {
        "model": model, "precision": precision, "optimizer": optimizer,
        "impl": impl, "set": label, "regex": regex, "autocast_cache": autocast_cache,
        "modules": p["modules"], "eager_modules": e["modules"],
        **({"attention": e["attention"]} if "attention" in e else {}),
        "predicted_peak": p["predicted_peak_bytes"],
        "predicted_moment": p["predicted_moment"],
        "ckptune_peak": p["peak_bytes"],
        "pytorch_peak": e["peak_bytes"],
        "pytorch_peak_varies": e.get("peak_varies"),
        "predicted_seconds": p["predicted_step_seconds"],
        "ckptune_seconds": p["step_seconds"]["median"],
        "pytorch_seconds": e["median_seconds"],
    }


def cache_rows(doc, models, raw):
    """The bf16 configs again, planned with --autocast-cache, against PyTorch's runs with the
    cache on, made again beside them."""
    t0, start = time.time(), os.getloadavg()
    rows = [r for r in doc["rows"] if not r.get("autocast_cache")]
    for model, (shape, sets) in models.items():
        print(f"== {model} (bf16, --autocast-cache)", file=sys.stderr)
        ours = ckptune_points(model, shape, sets, ["bf16"], OPTIMIZERS, "single", raw, autocast_cache=True)
        for optimizer in OPTIMIZERS:
            for label, regex in sets:
                e = eager_point(model, shape, label, regex, "bf16", optimizer, "single", raw,
                                suffix="-autocast-cache")
                rows.append(row(model, label, regex, "bf16", optimizer, "single",
                                ours[("bf16", optimizer, label)], e, autocast_cache=True))
    doc["rows"] = rows
    doc["cache_rows_command"] = "scripts/pytorch_peaks.py --cache-rows" + (
        f" (CKPTUNE_BIN={os.path.relpath(BIN, ROOT)})" if os.environ.get("CKPTUNE_BIN") else "")
    doc["cache_rows_minutes"] = round((time.time() - t0) / 60, 1)
    doc["cache_rows_load_average_start_end"] = [list(start), list(os.getloadavg())]


def autocast_cache_check(rows, models, raw):
    """bf16 points where PyTorch peaks above the prediction: PyTorch again with autocast's cache
    off, which tells whether the cached weight casts are the difference."""
    for r in rows:
        if r["precision"] != "bf16" or r["pytorch_peak"] <= r["predicted_peak"] or r.get("autocast_cache"):
            continue
        shape = models[r["model"]][0]
        e = eager_point(r["model"], shape, r["set"], r["regex"], "bf16", r["optimizer"], r["impl"], raw,
                        autocast_cache=False)
        r["pytorch_peak_no_autocast_cache"] = e["peak_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, output under /tmp")
    ap.add_argument("--autocast-check-only", action="store_true",
                    help="only the last phase: re-run peaks.json's bf16 points above the prediction "
                         "with autocast's cache off, and rewrite peaks.json and the README")
    ap.add_argument("--cache-rows", action="store_true",
                    help="only the --autocast-cache rows: profile and sweep the bf16 configs with "
                         "--autocast-cache, add their rows to peaks.json and rewrite the README")
    a = ap.parse_args()
    models = QUICK if a.quick else MODELS
    out_dir = "/tmp/ckptune-pytorch-peaks" if a.quick else os.path.join(ROOT, "results", "pytorch-peaks")
    raw = os.path.join(out_dir, "raw")
    if a.cache_rows:
        if not os.environ.get("CKPTUNE_BIN"):
            subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "ckptune"], cwd=ROOT, check=True)
        doc = json.load(open(os.path.join(out_dir, "peaks.json")))
        cache_rows(doc, models, raw)
        finish(doc, out_dir)
        return
    if a.autocast_check_only:
        doc = json.load(open(os.path.join(out_dir, "peaks.json")))
        autocast_cache_check(doc["rows"], models, raw)
        doc["autocast_check_command"] = "scripts/pytorch_peaks.py --autocast-check-only"
        finish(doc, out_dir)
        return
    os.makedirs(raw, exist_ok=True)
    for f in os.listdir(raw):  # nothing stale: every file comes from this run
        os.remove(os.path.join(raw, f))
    subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "ckptune"], cwd=ROOT, check=True)
    t0 = time.time()
    load_start = os.getloadavg()
    rows = []
    torch_version = None
    names = list(models)
    for mi, model in enumerate(names):
        shape, sets = models[model]
        jobs = [("single", PRECISIONS, OPTIMIZERS, list(range(len(sets))))]
        emi, ep, eo, eimpls, es = EXTRA_IMPLS
        if mi == emi:
            jobs += [(i, [ep], [eo], [es]) for i in eimpls]
        for impl, precisions, optimizers, set_ids in jobs:
            print(f"== {model} ({impl})", file=sys.stderr)
            ours = ckptune_points(model, shape, sets, precisions, optimizers, impl, raw)
            for precision in precisions:
                for optimizer in optimizers:
                    for si in set_ids:
                        label, regex = sets[si]
                        p = ours[(precision, optimizer, label)]
                        e = eager_point(model, shape, label, regex, precision, optimizer, impl, raw)
                        torch_version = e["torch"]
                        rows.append(row(model, label, regex, precision, optimizer, impl, p, e))
    autocast_cache_check(rows, models, raw)
    doc = {
        "format": "ckptune.pytorch-peaks/1",
        "command": "scripts/pytorch_peaks.py" + (" --quick" if a.quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, nproc {os.cpu_count()}",
        "cpu_flags": sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}),
        "load_average_start_end": [list(load_start), list(os.getloadavg())],
        "torch": torch_version,
        "threads": THREADS,
        "wall_minutes": round((time.time() - t0) / 60, 1),
        "shapes": {m: " ".join(models[m][0]) for m in names},
        "rows": rows,
    }
    cache_rows(doc, models, raw)
    finish(doc, out_dir)


def finish(doc, out_dir):
    """Writes peaks.json and the README made from it."""
    write_atomic(os.path.join(out_dir, "peaks.json"), doc)
    readme = os.path.join(out_dir, "README.md")
    text = subprocess.run([PY, os.path.join(HERE, "pytorch_peaks_table.py"), os.path.join(out_dir, "peaks.json")],
                          check=True, stdout=subprocess.PIPE, text=True).stdout
    tmp = readme + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, readme)
    print(f"wrote {readme}", file=sys.stderr)


if __name__ == "__main__":
    main()
