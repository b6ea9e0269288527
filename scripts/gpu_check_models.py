"""The models part of `scripts/gpu_check`: ResNet-50, BERT-base and a Llama-family model
(TinyLlama-1.1B), each planned for the GPU from the meta device (`ckptune plan --target cuda
--alloc-trace`: the predicted allocated and reserved peaks, and the step's trace, which joins the
replayed traces), then on the GPU profiled, planned and verified there (`ckptune plan --device
cuda`, `ckptune verify`: the measured allocated and reserved peaks). Writes OUT/models.json and
OUT/models.md. With `--backend fake` nothing runs on a GPU: the rows say so.
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS_FORMAT = "ckptune.gpu-models/1"
INDEX_FORMAT = "ckptune.gpu-plans/1"
STEPS_FORMAT = "ckptune.gpu-steps/1"
# The checkpointed plan's budget: the context and workspaces, and a share of the rest of the
# unconstrained plan's predicted reserved peak; the first share that a plan fits under (tight
# enough that the model must checkpoint; where the optimizer step is the peak, it cannot go far).
CHECKPOINTED_SHARES = (0.7, 0.85, 0.95)
# name: the model, its shape and precision. The fp32 three are the issue's, bf16 (autocast) is
# what most users train in; the tiny ones test the pipeline in seconds.
MODELS = {
    "resnet50": ["resnet50", "--batch", "32", "--image", "224", "--precision", "fp32"],
    "bert-base": ["bert-base-uncased", "--batch", "16", "--seq", "512", "--precision", "fp32"],
    "tinyllama": ["tinyllama-1.1b", "--batch", "2", "--seq", "1024", "--precision", "fp32"],
    "bert-base-bf16": ["bert-base-uncased", "--batch", "16", "--seq", "512", "--precision", "bf16"],
    "tinyllama-bf16": ["tinyllama-1.1b", "--batch", "2", "--seq", "1024", "--precision", "bf16"],
    # The optimizer step in backward (each parameter's AdamW step in its gradient's hook).
    "bert-base-in-bwd": ["bert-base-uncased", "--batch", "4", "--seq", "512", "--precision", "fp32",
                         "--optimizer-step", "in-backward"],
    # Selective checkpointing offered per layer (matmul outputs saved, the rest recomputed): the
    # checkpointed plan may run layers selective; its recompute times are the cost model's here.
    "tinyllama-selective": ["tinyllama-1.1b", "--batch", "2", "--seq", "1024", "--precision", "bf16",
                            "--selective", "matmul"],
    # Architectures the cost model's GPU constants were not fitted to (results/gpu/times.md).
    "gpt2": ["gpt2", "--batch", "8", "--seq", "1024", "--precision", "fp32"],
    "gpt2-bf16": ["gpt2", "--batch", "8", "--seq", "1024", "--precision", "bf16"],
    "qwen2.5-bf16": ["qwen2.5-0.5b", "--batch", "4", "--seq", "1024", "--precision", "bf16"],
    "resnet152-bf16": ["resnet152", "--batch", "32", "--image", "224", "--precision", "bf16"],
    "tiny-resnet": ["tiny-resnet", "--batch", "8", "--image", "32", "--precision", "fp32"],
    "tiny-bert": ["tiny-bert", "--batch", "4", "--seq", "32", "--precision", "fp32"],
    "tiny-llama-selective": ["tiny-llama", "--batch", "16", "--seq", "512", "--precision", "fp32",
                             "--selective", "matmul"],
}
DEFAULT_MODELS = ("resnet50,bert-base,tinyllama,bert-base-bf16,tinyllama-bf16,bert-base-in-bwd,"
                  "tinyllama-selective,gpt2,gpt2-bf16,qwen2.5-bf16,resnet152-bf16")
# Nothing checkpointed (an unlimited budget), AdamW: the same plan on both sides.
COMMON = ["--budget", "1TiB", "--optimizer", "adamw", "--quiet"]
# The GPU the plans are made for: its times are estimated (scripts/gpu_check_times.py compares
# them with the GPU's); its memory is any CUDA GPU's but for the context.
DEFAULT_TARGET = "cuda:h200"
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


def predict(ckptune, name, work, target):
    """The plan made here for `target` (`cuda`, or `cuda:NAME` for that GPU's estimated times)
    from the meta device; its trace path."""
    out = os.path.join(work, "models", f"{name}.predicted.json")
    trace = os.path.join(work, "model-traces", f"{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.makedirs(os.path.dirname(trace), exist_ok=True)
    # Memory on the meta device; times from the cost model, as no step runs here (the plan
    # checkpoints nothing, so they choose nothing).
    ckptune_json([ckptune, "plan", *MODELS[name], *COMMON, "--device", "cpu", "--target", target,
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


def prepare(ckptune, names, work, trace_dir, target=DEFAULT_TARGET):
    """Plans each model here for the GPU: nothing checkpointed, and checkpointed under a budget
    of the first of `CHECKPOINTED_SHARES` that fits; adds the first plan's step trace to `trace_dir`
    (None: leave the traces alone). Writes and returns work/models/index.json: per plan its
    model, label and path, for the GPU phase, which needs no ckptune binary."""
    plans = []
    for name in names:
        doc, trace = predict(ckptune, name, work, target)
        if trace_dir is not None:
            shutil.copyfile(trace, os.path.join(trace_dir, f"model-{name}.json"))
        plans.append({"model": name, "label": f"{name}.none", "plan": f"{name}.predicted.json"})
        c = doc["cuda_memory"]
        fixed = c["context_bytes"] + sum(c["workspace_bytes"])
        out = os.path.join(work, "models", f"{name}.checkpointed.json")
        for share in CHECKPOINTED_SHARES:
            budget = fixed + int(share * (c["predicted_reserved_peak_bytes"] - sum(c["workspace_bytes"])))
            try:
                ckptune_json([ckptune, "plan", *MODELS[name], *COMMON[2:], "--budget", str(budget), "--device",
                              "cpu", "--target", target, "--measure", "estimate", "-o", out])
            except RuntimeError as e:  # no plan fits that budget: try the next share
                print(f"gpu_check: no checkpointed plan for {name} at {share:.0%}: {e}", file=sys.stderr)
                continue
            plans.append({"model": name, "label": f"{name}.checkpointed", "plan": f"{name}.checkpointed.json"})
            break
    index = os.path.join(work, "models", "index.json")
    with open(index, "w") as f:
        json.dump({"format": INDEX_FORMAT, "plans": plans}, f, indent=1)
    return plans


def confs_for(plan_doc):
    """The allocator settings a plan is run under on the GPU: PyTorch's default, and the one the
    plan recommends when that differs."""
    recommended = plan_doc["cuda_memory"]["alloc_conf"]
    return [""] + ([recommended] if recommended else [])


def conf_key(conf):
    return "default" if not conf else "".join(ch if ch.isalnum() else "-" for ch in conf)


def measure_steps(work, python=sys.executable, parallel=5):
    """On the GPU, with PyTorch alone: the context (unless work/steps/context.json exists; it
    must be measured with no other process on the card), then each prepared plan trained under
    each of its allocator settings, a fresh process each, `parallel` at a time (each process has
    its own allocator, so their statistics do not mix): work/steps/. A run that fails is
    recorded with its error, not raised: the other runs still measure."""
    with open(os.path.join(work, "models", "index.json")) as f:
        plans = json.load(f)["plans"]
    steps = os.path.join(work, "steps")
    os.makedirs(steps, exist_ok=True)
    script = os.path.join(HERE, "gpu_check_steps.py")
    failures = {}
    if not os.path.exists(os.path.join(steps, "context.json")):
        failures.update(_gpu_process([python, script, "context", "-o", os.path.join(steps, "context.json")],
                                     "context", ""))
    jobs = []
    for p in plans:
        plan_path = os.path.join(work, "models", p["plan"])
        with open(plan_path) as f:
            plan_doc = json.load(f)
        for conf in confs_for(plan_doc):
            key = f"{p['label']}.{conf_key(conf)}"
            jobs.append(([python, script, "step", "--plan", plan_path, "--label", p["label"],
                          "-o", os.path.join(steps, f"{key}.json"),
                          "--trace", os.path.join(steps, f"{key}.trace.json")], key, conf))
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        for failed in pool.map(lambda job: _gpu_process(*job), jobs):
            failures.update(failed)
    with open(os.path.join(steps, "failures.json"), "w") as f:
        json.dump(failures, f, indent=1)
    return failures


def _gpu_process(cmd, key, conf):
    """Runs one GPU process under `conf`; {key: why} when it fails, else {}."""
    print(f"gpu_check: {key} on the GPU", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=GPU_TIMEOUT_S,
                              env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired:
        return {key: f"timed out after {GPU_TIMEOUT_S} s"}
    return {} if proc.returncode == 0 else {key: f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}"}


def compare_steps(ckptune, work):
    """Each GPU run of work/steps against its plan's prediction for the setting it ran under,
    and its recorded allocator trace replayed through `ckptune simulate-allocator` against the
    reserved bytes the GPU had after every event. The document (`STEPS_FORMAT`)."""
    steps = os.path.join(work, "steps")
    with open(os.path.join(steps, "context.json")) as f:
        context = json.load(f)
    with open(os.path.join(steps, "failures.json")) as f:
        failures = json.load(f)
    rows = []
    for name in sorted(os.listdir(steps)):
        if (not name.endswith(".json") or name.endswith((".trace.json", ".simulated.json"))
                or name in ("context.json", "failures.json")):
            continue  # a run's trace, its simulation (written here, below), or no run
        with open(os.path.join(steps, name)) as f:
            measured = json.load(f)
        with open(os.path.join(work, "models", measured["plan"])) as f:
            plan = json.load(f)
        trace = os.path.join(steps, name[: -len(".json")] + ".trace.json")
        rows.append(step_row(measured, plan, replay_gpu_trace(ckptune, trace, context["total_memory"])))
    return {"format": STEPS_FORMAT, "context": context, "failures": failures, "runs": rows}


def step_row(measured, plan, replay):
    """One run: predicted against measured peaks (the timed steps' largest), and the replay."""
    c = plan["cuda_memory"]
    conf = measured["alloc_conf"]
    predicted_reserved = {k["alloc_conf"]: k["reserved_peak_bytes"] for k in c["candidates"]}[conf]
    run = measured["run"]
    # The GPU whose times the plan estimated (`--target cuda:NAME`), else the plan's device.
    rates = ((plan.get("profile") or {}).get("estimated") or {}).get("rates") or {}
    return {"label": measured["label"], "alloc_conf": conf, "target": rates.get("device") or plan.get("target_device"),
            "regex": plan["checkpoint"]["regex"],
            "config": plan["config"], "torch": run["torch"], "device": measured["device"],
            "predicted_allocated_bytes": c["predicted_allocated_peak_bytes"],
            "measured_allocated_bytes": run["peak_bytes"],
            "allocated_rel_error": rel(run["peak_bytes"], c["predicted_allocated_peak_bytes"]),
            "predicted_reserved_bytes": predicted_reserved,
            "measured_reserved_bytes": run["reserved_peak_bytes"],
            "reserved_rel_error": rel(run["reserved_peak_bytes"], predicted_reserved),
            "peaks_per_step": [s["peak_bytes"] for s in run["steps"]], "warmup": run["warmup"],
            "replay": replay}


def replay_gpu_trace(ckptune, trace, capacity):
    """The GPU's own trace of a run through the simulation: after every event, simulated
    reserved bytes against the GPU's; exact when they never differ."""
    with open(trace) as f:
        doc = json.load(f)
    out = trace[: -len(".json")] + ".simulated.json"
    cmd = [ckptune, "simulate-allocator", trace, "--alloc-conf", doc["alloc_conf"], "--capacity", str(capacity),
           "--every-event", "-o", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    with open(out) as f:
        simulated = [r[1] for r in json.load(f)["every_event"]["rows"]]
    gpu = doc["gpu_reserved_after"]
    n = min(len(gpu), len(simulated))
    errors = [abs(simulated[i] - gpu[i]) / gpu[i] if gpu[i] else float(simulated[i] != 0) for i in range(n)]
    first = next((i for i in range(n) if simulated[i] != gpu[i]), None)
    return {"events": len(gpu), "compared": n, "exact": first is None and len(gpu) == len(simulated),
            "first_divergence": first, "max_rel_error_reserved": max(errors, default=0.0),
            "gpu_reserved_peak_bytes": max(gpu, default=0), "simulated_reserved_peak_bytes": max(simulated, default=0)}


def steps_markdown(doc):
    """steps.md: the context, then a row per run."""
    def gib(b):
        return f"{b / 2**30:.3f} GiB"

    def pct(x):
        return f"{100 * x:+.2f}%"

    ctx = doc["context"]
    outside = ctx["outside_allocator_bytes"]
    lines = ["# Real training steps on the GPU: the plan's prediction against PyTorch", "",
             f"Written by `scripts/gpu_check` (scripts/gpu_check_models.py, scripts/gpu_check_steps.py) from a run on "
             f"{ctx['device']} ({ctx['total_memory'] / 2**30:.1f} GiB, compute capability "
             f"{'.'.join(map(str, ctx['capability']))}), torch {ctx['torch']}, CUDA {ctx['cuda']}, cuDNN {ctx['cudnn']}.",
             f"Predicted: `ckptune plan --target {(doc['runs'] or [{}])[0].get('target') or 'cuda'}` on this machine, "
             "memory from the meta device, nothing run on",
             "a GPU. Measured: the model's plain-torch reference (models/fixtures/reference.py) trained on the GPU",
             "with the plan applied by the companion, `torch.cuda.memory_stats` peaks of the steps after the",
             "first (which creates the optimizer state), in a fresh process per allocator setting.",
             "Replay: the allocator history the GPU recorded in that run (`torch.cuda.memory._record_memory_history`)",
             "replayed through `ckptune simulate-allocator`, reserved bytes compared after every event.", "",
             "| model.plan | PYTORCH_CUDA_ALLOC_CONF | allocated: predicted / measured | error "
             "| reserved: predicted / measured | error | replay of the GPU's trace: exact / max error / peak sim vs GPU |",
             "|---|---|---|---:|---|---:|---|"]
    for r in doc["runs"]:
        rp = r["replay"]
        peak = rel(rp["gpu_reserved_peak_bytes"], rp["simulated_reserved_peak_bytes"])
        lines.append(
            f"| {r['label']} | `{r['alloc_conf'] or '(default)'}` | {gib(r['predicted_allocated_bytes'])} / "
            f"{gib(r['measured_allocated_bytes'])} | {pct(r['allocated_rel_error'])} | "
            f"{gib(r['predicted_reserved_bytes'])} / {gib(r['measured_reserved_bytes'])} | "
            f"{pct(r['reserved_rel_error'])} | {'yes' if rp['exact'] else 'no'} ({rp['events']} events) / "
            f"{100 * rp['max_rel_error_reserved']:.2f}% / {pct(peak)} |")
    lines += ["", "Plans (checkpoint regex, config):", ""]
    seen = set()
    for r in doc["runs"]:
        if r["label"] not in seen:
            seen.add(r["label"])
            c = r["config"]
            lines.append(f"- {r['label']}: `{r['regex']}`, {c['precision']}/{c['optimizer']} micro-batch "
                         f"{c['micro_batch']}")
    lines += ["", "Memory the card held outside the caching allocator (`torch.cuda.mem_get_info` less reserved "
              "bytes, one process alone on the card): after creating the context "
              f"{outside['context'] / 2**20:,.0f} MiB, after cuBLAS's first matrix product "
              f"{outside['after_cublas'] / 2**20:,.0f} MiB, after cuDNN's first convolution "
              f"{outside['after_cudnn'] / 2**20:,.0f} MiB."]
    if doc["failures"]:
        lines += ["", "Runs that failed:", ""] + [f"- {k}: {v}" for k, v in doc["failures"].items()]
    return "\n".join(lines) + "\n"


def run_models(ckptune, names, work, trace_dir, on_gpu, target=DEFAULT_TARGET):
    """Predicts each model here, adds its trace to `trace_dir` (None: leave the traces alone),
    and where `on_gpu` profiles and verifies it with ckptune on the GPU. Returns the document."""
    prepare(ckptune, names, work, trace_dir, target)
    rows = []
    for name in names:
        with open(os.path.join(work, "models", f"{name}.predicted.json")) as f:
            predicted = json.load(f)
        verified, why_not = None, None
        if not on_gpu:
            why_not = "fake backend: nothing ran on a GPU"
        else:
            try:
                verified = measure_on_gpu(ckptune, name, work)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                why_not = f"the GPU run failed: {e}"
        rows.append(row(name, predicted, verified, why_not))
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
