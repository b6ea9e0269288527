"""The models part of `scripts/gpu_check`: ResNet-50, BERT-base and a Llama-family model
(TinyLlama-1.1B), each planned for the GPU from the meta device (`ckptune plan --target cuda
--alloc-trace`: the predicted allocated and reserved peaks, and the step's trace, which joins the
replayed traces), then on the GPU profiled, planned and verified there (`ckptune plan --device
cuda`, `ckptune verify`: the measured allocated and reserved peaks). Writes OUT/models.json and
OUT/models.md. With `--backend fake` nothing runs on a GPU: the rows say so.
"""

import argparse
import json
import os
import shutil
import subprocess

MODELS_FORMAT = "ckptune.gpu-models/1"
# name: the model and its shape. The default three are the issue's; the tiny ones test the
# pipeline in seconds.
MODELS = {
    "resnet50": ["resnet50", "--batch", "32", "--image", "224"],
    "bert-base": ["bert-base-uncased", "--batch", "16", "--seq", "512"],
    "tinyllama": ["tinyllama-1.1b", "--batch", "2", "--seq", "1024"],
    "tiny-resnet": ["tiny-resnet", "--batch", "8", "--image", "32"],
    "tiny-bert": ["tiny-bert", "--batch", "4", "--seq", "32"],
}
DEFAULT_MODELS = "resnet50,bert-base,tinyllama"
# Nothing checkpointed (an unlimited budget), fp32 with AdamW: the same plan on both sides.
COMMON = ["--budget", "1TiB", "--precision", "fp32", "--optimizer", "adamw", "--quiet"]
GPU_TIMEOUT_S = 240


def parse_models(text):
    """`--models`: names of MODELS, comma-separated (an argparse type: bad names exit 2)."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    return names


def ckptune_json(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=GPU_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return proc


def predict(ckptune, name, work):
    """The plan made here for an unnamed CUDA GPU from the meta device; its trace path."""
    out = os.path.join(work, "models", f"{name}.predicted.json")
    trace = os.path.join(work, "model-traces", f"{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.makedirs(os.path.dirname(trace), exist_ok=True)
    # Memory on the meta device; times from the cost model, as no step runs here (the plan
    # checkpoints nothing, so they choose nothing).
    ckptune_json([ckptune, "plan", *MODELS[name], *COMMON, "--device", "cpu", "--target", "cuda",
                  "--measure", "estimate", "--alloc-trace", trace, "-o", out])
    with open(out) as f:
        return json.load(f), trace


def measure_on_gpu(ckptune, name, work):
    """Profile, plan and verify on the GPU; the verification report."""
    plan = os.path.join(work, "models", f"{name}.gpu-plan.json")
    report = os.path.join(work, "models", f"{name}.gpu-verify.json")
    ckptune_json([ckptune, "plan", *MODELS[name], *COMMON, "--device", "cuda", "-o", plan])
    ckptune_json([ckptune, "verify", plan, "--quiet", "-o", report])
    with open(report) as f:
        return json.load(f)


def rel(measured, predicted):
    return None if not measured else (predicted - measured) / measured


def row(name, predicted, verified, why_not):
    c = predicted["cuda_memory"]
    r = {"model": name, "alloc_conf": c["alloc_conf"], "trace_events": c["trace_events"],
         "predicted_allocated_bytes": c["predicted_allocated_peak_bytes"],
         "predicted_reserved_bytes": c["predicted_reserved_peak_bytes"],
         "predicted_reserved_by_conf": {k["alloc_conf"]: k["reserved_peak_bytes"] for k in c["candidates"]},
         "measured_allocated_bytes": None, "measured_reserved_bytes": None, "not_measured": why_not}
    if verified is not None:
        m = verified["measured"]
        r["measured_allocated_bytes"] = m["peak_bytes"]
        r["measured_reserved_bytes"] = m.get("reserved_peak_bytes")
        # The GPU ran under PyTorch's default allocator setting: compare with its prediction.
        default = r["predicted_reserved_by_conf"].get("", r["predicted_reserved_bytes"])
        r["allocated_rel_error"] = rel(m["peak_bytes"], r["predicted_allocated_bytes"])
        r["reserved_rel_error_default_conf"] = rel(m.get("reserved_peak_bytes"), default)
    return r


def run_models(ckptune, names, work, trace_dir, on_gpu):
    """Predicts each model here, adds its trace to `trace_dir` (None: leave the traces alone),
    and where `on_gpu` measures it on the GPU. Returns the document."""
    predicted = {}
    for name in names:
        predicted[name], trace = predict(ckptune, name, work)
        if trace_dir is not None:
            shutil.copyfile(trace, os.path.join(trace_dir, f"model-{name}.json"))
    rows = []
    for name in names:
        verified, why_not = None, None
        if not on_gpu:
            why_not = "fake backend: nothing ran on a GPU"
        else:
            try:
                verified = measure_on_gpu(ckptune, name, work)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                why_not = f"the GPU run failed: {e}"
        rows.append(row(name, predicted[name], verified, why_not))
    return {"format": MODELS_FORMAT, "fake_backend": not on_gpu, "models": rows}


def markdown(doc):
    def size(b):
        return "—" if b is None else f"{b / 2**20:,.1f} MiB"

    def pct(x):
        return "—" if x is None else f"{100 * x:+.2f}%"

    lines = ["# Models on the GPU: predicted from the meta device, measured on the GPU", ""]
    if doc["fake_backend"]:
        lines += ["**FAKE BACKEND: nothing here ran on a GPU; the rows only test the pipeline.**", ""]
    lines += ["Written by `scripts/gpu_check` (scripts/gpu_check_models.py). Predicted: `ckptune plan --target cuda`",
              "from the meta device, nothing checkpointed, fp32 with AdamW; reserved under PyTorch's default",
              "setting (the GPU's) and under the recommended one. Measured: `ckptune plan --device cuda` and",
              "`ckptune verify` on the GPU.", "",
              "| model | predicted allocated | measured allocated | error | predicted reserved (default) "
              "| measured reserved | error | recommended setting (its reserved) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in doc["models"]:
        default = r["predicted_reserved_by_conf"].get("", r["predicted_reserved_bytes"])
        lines.append(
            f"| {r['model']} | {size(r['predicted_allocated_bytes'])} | {size(r['measured_allocated_bytes'])} "
            f"| {pct(r.get('allocated_rel_error'))} | {size(default)} | {size(r['measured_reserved_bytes'])} "
            f"| {pct(r.get('reserved_rel_error_default_conf'))} | `{r['alloc_conf'] or '(default)'}` "
            f"({size(r['predicted_reserved_bytes'])}) |")
    notes = [f"- {r['model']}: {r['not_measured']}" for r in doc["models"] if r["not_measured"]]
    if notes:
        lines += ["", "Not measured:", ""] + notes
    return "\n".join(lines) + "\n"
