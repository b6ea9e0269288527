"""Runs the whole benchmark and writes `bench.json` (every figure, computed from the raw JSON
outputs of `ckptune` and `eager.py`, which are kept under `raw/`). `scripts/bench/run` calls
this after building; `report.py` renders `README.md` from `bench.json`.

    python scripts/bench/bench.py --out results/bench [--quick] [--no-bf16] [--ckptune PATH]

Sections (see results/bench/README.md for what each means):
  1. runtime  — ckptune train vs PyTorch eager + torch.utils.checkpoint, same model/batch/regex
  2. quality  — ckptune's plan vs exhaustive / every layer / every 2nd / Chen √n / greedy knapsack
  3. profcost — profiling steps and wall time vs per-candidate and all-subsets measurement
  4. accuracy — predicted vs measured peak and step time over every verified plan (and sweep point)
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
sys.path.insert(0, os.path.join(ROOT, "python"))

from ckptune_harness.output import write_atomic  # noqa: E402  (the one atomic JSON writer of the Python side)

# Sizes. Full: about 15–20 min on a quiet 2-core machine. BERT-base needs batch 8 × 128 tokens
# for activations to outgrow AdamW's optimizer-step peak (at batch ≤ 4 × 128 the peak is the
# optimizer step whatever is checkpointed, and every budget is the same); ResNet-50 at batch 4,
# 128 px keeps a step near one second. Quick: tiny models, a test of the harness.
FULL = [
    {"key": "resnet", "model": "resnet50", "batch": 4, "image": 128, "block_profile": True, "exhaustive": True},
    {"key": "bert", "model": "bert-base-uncased", "batch": 8, "seq": 128, "block_profile": False,
     "exhaustive": False},  # 14 candidates: 2^14 subsets do not fit the time
]
# The quick run takes the same code paths as the full one (tiny-bert has 4 candidates, but is
# treated like BERT-base: no exhaustive sweep).
QUICK = [
    {"key": "resnet", "model": "tiny-resnet", "batch": 4, "image": 32, "block_profile": True, "exhaustive": True},
    {"key": "bert", "model": "tiny-bert", "batch": 4, "seq": 16, "block_profile": False, "exhaustive": False},
]
BUDGET_FRACTIONS = (0.25, 0.5, 0.75)  # of the way from the smallest achievable peak to no-checkpoint
EVERY_K = 2


class BenchError(SystemExit):
    pass


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load(path):
    with open(path) as f:
        return json.load(f)


class Runner:
    """Runs commands, logs each one (command line, exit code, wall time) for bench.json."""

    def __init__(self, raw, timeout):
        self.raw = raw
        self.timeout = timeout
        self.commands = []
        os.makedirs(os.path.join(raw, "logs"), exist_ok=True)

    def run(self, name, argv, ok=(0,)):
        logf = os.path.join(self.raw, "logs", name + ".log")
        shown = " ".join(shlex.quote(a) for a in argv)
        log(f"{name}: {shown}")
        t0 = time.perf_counter()
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            raise BenchError(f"bench: {name} did not finish in {self.timeout} s: {shown}") from e
        wall = time.perf_counter() - t0
        with open(logf, "w") as f:
            f.write(f"$ {shown}\n# exit {r.returncode}, {wall:.2f} s\n--- stdout\n{r.stdout}--- stderr\n{r.stderr}")
        self.commands.append({"name": name, "argv": argv, "exit": r.returncode, "wall_seconds": wall})
        if r.returncode not in ok:
            tail = (r.stderr or r.stdout)[-3000:]
            raise BenchError(f"bench: {name} failed with exit {r.returncode} (log: {logf}):\n  {shown}\n{tail}")
        return r, wall


def median(xs):
    v = sorted(xs)
    n = len(v)
    if n == 0:
        return float("nan")
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def exact_regex(names):
    """A regex selecting exactly `names` (full match), for ckptune and Python's re alike."""
    if not names:
        return ""
    return "^(?:" + "|".join(re.escape(n) for n in names) + ")$"


# ---------------------------------------------------------------- the alternatives' choices


def strategy_sets(profile, budgets, bert):
    """Checkpoint sets of the non-ckptune strategies. Returns {strategy: {budget_index|None: [names]}}
    (None: the strategy does not depend on the budget)."""
    cfg = profile["configs"][0]
    blocks = cfg["regimes"][0]["blocks"]
    cands = [b["name"] for b in blocks if b["candidate"]]
    # "Layers" as the peers define them: HF's gradient_checkpointing_enable and torchtitan's
    # per-block AC wrap the repeated transformer layers only (not embeddings / pooler); for a
    # ResNet the repeated units are its stages, i.e. every candidate.
    layers = [n for n in cands if n.startswith("encoder.layer.")] if bert else cands
    n = len(cands)
    s = max(1, round(math.sqrt(n)))
    # Chen et al. 2016 √n, as PyTorch implements it (torch.utils.checkpoint.checkpoint_sequential
    # with segments = round(√n)): segment_size = n // s; the first (s−1)·segment_size links are
    # recomputed in backward, the last segment is not. Per-module wrapping recomputes exactly the
    # same links (same extra forward work); it keeps each wrapped module's input instead of only
    # each segment's, but recomputes one module at a time instead of a whole segment.
    seg = n // s
    chen = cands[: seg * (s - 1)]
    # √n evenly spaced candidates (the "checkpoint every √n-th" reading): indices ⌊(j+½)·n/s⌋.
    spaced = [cands[int((j + 0.5) * n / s)] for j in range(s)]
    # torchtitan/torchtune layer-SAC with ac_freq=k: a counter starting at 1 per wrapped layer,
    # checkpoint when count % k == 0, i.e. 0-based layers k−1, 2k−1, …
    every_k = [name for i, name in enumerate(layers) if (i + 1) % EVERY_K == 0]
    out = {
        "all layers": {None: layers},
        f"every {EVERY_K}nd layer": {None: every_k},
        "Chen √n (checkpoint_sequential)": {None: chen},
        "√n evenly spaced": {None: spaced},
        "greedy knapsack": {},
    }
    # Greedy ratio knapsack on an additive model: peak ≈ peak_none − Σ saving_i, saving_i =
    # kept_grad − kept_nograd (first micro-step), cost_i = the profile's recompute seconds; take
    # candidates by saving/cost, best first, until the estimate fits the budget.
    rec = cfg["recompute_seconds"]
    items = []
    for i, b in enumerate(blocks):
        if b["candidate"]:
            saving = b["kept_grad"] - b["kept_nograd"]
            if saving > 0:
                items.append((saving / max(rec[i], 1e-12), saving, b["name"]))
    items.sort(key=lambda t: -t[0])
    greedy_meta = {}
    for k, budget in enumerate(budgets):
        est = cfg["peak_none"]
        chosen = []
        for _, saving, name in items:
            if est <= budget:
                break
            chosen.append(name)
            est -= saving
        order = {name: i for i, name in enumerate(cands)}
        out["greedy knapsack"][k] = sorted(chosen, key=order.get)
        greedy_meta[k] = {"additive_estimate": est, "estimate_fits": est <= budget}
    return out, greedy_meta, cands, layers


# ---------------------------------------------------------------- per model


def machine_info():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    fl = line.split(":", 1)[1].split()
                    flags = " ".join(x for x in fl if x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "nproc_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": cpu, "cpu_flags": flags, "memory_bytes": mem,
        "kernel": platform.release(), "loadavg_start": os.getloadavg(),
    }


def git_info():
    def g(*a):
        r = subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT)
        return r.stdout.strip() if r.returncode == 0 else None

    dirty = g("status", "--porcelain", "--untracked-files=no")
    return {"commit": g("rev-parse", "HEAD"), "dirty": bool(dirty) if dirty is not None else None}


class Bench:
    def __init__(self, a, raw):
        self.a = a
        self.raw = raw
        self.run = Runner(raw, a.timeout)
        self.ck = a.ckptune

    def shape_flags(self, m, precision="fp32", repeats=None):
        f = ["--batch", str(m["batch"]), "--optimizer", "adamw", "--precision", precision,
             "--threads", str(self.a.threads), "--repeats", str(repeats or self.a.repeats), "-q"]
        if "image" in m:
            f += ["--image", str(m["image"])]
        if "seq" in m:
            f += ["--seq", str(m["seq"])]
        return f

    def model(self, m):
        key, name = m["key"], m["model"]
        d = os.path.join(self.raw, key)
        os.makedirs(d, exist_ok=True)
        bert = "bert" in name
        res = {"model": name, "batch": m["batch"], "image": m.get("image"), "seq": m.get("seq")}

        # ---- profile (layer granularity; and block granularity for the step-count figure)
        prof_path = os.path.join(d, "profile.json")
        _, wall = self.run.run(f"{key}-profile", [self.ck, "profile", name, *self.shape_flags(m),
                                                   "--no-cache", "-o", prof_path])
        prof = load(prof_path)
        pc = prof["configs"][0]
        res["profile"] = {"path": os.path.relpath(prof_path, self.a.out), "process_wall_seconds": wall}
        cands = [b["name"] for b in prof["model"]["blocks"] if b["candidate"]]
        profcost = [self.profcost_row(name, "layer", prof, wall)]
        if m.get("block_profile"):
            bp = os.path.join(d, "profile-block.json")
            _, bwall = self.run.run(f"{key}-profile-block", [
                self.ck, "profile", name, *self.shape_flags(m), "--granularity", "block", "--no-cache", "-o", bp])
            profcost.append(self.profcost_row(name, "block", load(bp), bwall))

        # ---- budgets: between the smallest achievable peak and the no-checkpoint peak
        hi = pc["peak_none"]
        r, _ = self.run.run(f"{key}-plan-min", [self.ck, "plan", "--budget", "1", name, *self.shape_flags(m),
                                                "--profile", prof_path], ok=(1,))
        mm = re.search(r"smallest achievable peak is [^(]*\((\d+) bytes\)", r.stderr)
        if not mm:
            raise BenchError("bench: could not read the smallest achievable peak from `ckptune plan --budget 1` "
                             f"(stderr: {r.stderr[-500:]!r})")
        lo = int(mm.group(1))
        budgets = [lo + int(f * (hi - lo)) for f in BUDGET_FRACTIONS]
        res["budgets"] = {"min_peak": lo, "peak_none": hi, "fractions": list(BUDGET_FRACTIONS), "bytes": budgets}

        # ---- plans and their verification
        plans = []
        for k, b in enumerate(budgets):
            pp = os.path.join(d, f"plan-{k + 1}.json")
            self.run.run(f"{key}-plan-{k + 1}", [self.ck, "plan", "--budget", str(b), name, *self.shape_flags(m),
                                                 "--profile", prof_path, "-o", pp])
            plan = load(pp)
            vp = os.path.join(d, f"verify-{k + 1}.json")
            self.run.run(f"{key}-verify-{k + 1}", [self.ck, "verify", pp, "-o", vp, "-q"], ok=(0, 1))
            plans.append({"budget": b, "plan": plan, "verify": load(vp),
                          "plan_path": os.path.relpath(pp, self.a.out), "verify_path": os.path.relpath(vp, self.a.out)})

        # ---- one sweep with every subset any strategy picked (+ all subsets where feasible)
        strat, greedy_meta, cands, layers = strategy_sets(prof, budgets, bert)
        subsets = [[], cands] + [p["plan"]["checkpoint"]["modules"] for p in plans]
        for per in strat.values():
            subsets.extend(per.values())
        regexes = []
        for s in subsets:
            rx = exact_regex(s)
            if rx not in regexes:
                regexes.append(rx)
        exhaustive = m["exhaustive"] and len(cands) <= 10  # the CLI's --all-subsets limit
        sp = os.path.join(d, "sweep.json")
        argv = [self.ck, "sweep", name, *self.shape_flags(m), "--profile", prof_path, "-o", sp]
        for rx in regexes:
            argv += ["--checkpoint", rx]
        if exhaustive:
            argv.append("--all-subsets")
        _, swall = self.run.run(f"{key}-sweep", argv)
        sweep = load(sp)
        points = sweep["configs"][0]["points"]
        by_set = {frozenset(p["modules"]): p for p in points}

        def point(names):
            p = by_set.get(frozenset(names))
            if p is None:
                raise BenchError(f"bench: the sweep of {name} has no point for {sorted(names)}")
            return p

        # ---- section 2: plan quality
        quality = []
        for k, b in enumerate(budgets):
            rows = []

            def row(label, names, extra=None):
                p = point(names)
                r = {"strategy": label, "modules": [n for n in cands if n in set(names)],
                     "peak_bytes": p["peak_bytes"], "predicted_peak_bytes": p["predicted_peak_bytes"],
                     "fits": p["peak_bytes"] <= b, "step_seconds": p["step_seconds"]["median"],
                     "step_seconds_stats": p["step_seconds"]}
                if extra:
                    r.update(extra)
                rows.append(r)

            row("ckptune plan", plans[k]["plan"]["checkpoint"]["modules"])
            if exhaustive:
                fitting = [p for p in points if p["peak_bytes"] <= b]
                best = min(fitting, key=lambda p: p["step_seconds"]["median"]) if fitting else None
                if best is not None:
                    row(f"exhaustive best of {len(points)} measured", best["modules"])
            for label, per in strat.items():
                names = per[None] if None in per else per[k]
                row(label, names, {"greedy": greedy_meta[k]} if label == "greedy knapsack" else None)
            ref = rows[1] if exhaustive and len(rows) > 1 and rows[1]["strategy"].startswith("exhaustive") else rows[0]
            for r in rows:
                r["time_vs_ref"] = r["step_seconds"] / ref["step_seconds"]
            quality.append({"budget": b, "reference": ref["strategy"], "rows": rows})
        # Winner's curse: the exhaustive best is the fastest of many noisy measurements, so it is
        # biased low. Where ckptune's set differs from it, measure both sets again, interleaved
        # (A B A B in one sweep: 2 × repeats timed steps per set), and compare those times too.
        pairs = []
        for q in quality:
            if q["reference"].startswith("exhaustive"):
                a_set, b_set = q["rows"][0]["modules"], q["rows"][1]["modules"]
                if set(a_set) != set(b_set) and (a_set, b_set) not in pairs:
                    pairs.append((a_set, b_set))
        if pairs:
            cp = os.path.join(d, "sweep-confirm.json")
            argv = [self.ck, "sweep", name, *self.shape_flags(m), "-o", cp]
            order = []
            for a_set, b_set in pairs:
                for s in (a_set, b_set, a_set, b_set):
                    argv += ["--checkpoint", exact_regex(s)]
                    order.append(frozenset(s))
            self.run.run(f"{key}-sweep-confirm", argv)
            cpts = load(cp)["configs"][0]["points"]
            again = {}
            for p in cpts:
                again.setdefault(frozenset(p["modules"]), []).append(p["step_seconds"]["median"])
            for q in quality:
                if not q["reference"].startswith("exhaustive"):
                    continue
                a_set, b_set = frozenset(q["rows"][0]["modules"]), frozenset(q["rows"][1]["modules"])
                if a_set == b_set:
                    q["confirm"] = {"same_set": True, "time_vs_ref": 1.0}
                else:
                    ta, tb = sum(again[a_set]) / len(again[a_set]), sum(again[b_set]) / len(again[b_set])
                    q["confirm"] = {"same_set": False, "ckptune_seconds": ta, "best_seconds": tb,
                                    "time_vs_ref": ta / tb, "path": os.path.relpath(cp, self.a.out)}
        for q in quality:
            if q["reference"].startswith("exhaustive") and "confirm" not in q:
                q["confirm"] = {"same_set": True, "time_vs_ref": 1.0}
        res["quality"] = quality
        res["sweep"] = {"path": os.path.relpath(sp, self.a.out), "points": len(points),
                        "process_wall_seconds": swall, "exhaustive": exhaustive}

        # ---- section 3: profiling cost
        n = len(cands)
        t_step = pc["seconds_none"]["median"]
        per_point = 1 + self.a.repeats  # a sweep point: one warm-up + `repeats` timed steps
        res["profcost"] = {
            "rows": profcost,
            "alternatives": {
                "candidates": n, "steps_per_measured_subset": per_point, "step_seconds": t_step,
                "per_candidate_steps": (n + 1) * per_point,
                "per_candidate_seconds_est": (n + 1) * per_point * t_step,
                "all_subsets_steps": (2 ** n) * per_point,
                "all_subsets_seconds_est": (2 ** n) * per_point * t_step,
            },
            "sweep_measured": {"points": len(points), "process_wall_seconds": swall,
                               "seconds_per_point": swall / max(len(points), 1)},
        }

        # ---- section 4: prediction error
        res["accuracy"] = {
            "verified": [{
                "budget": p["budget"], "modules": p["verify"]["modules"],
                "predicted_peak": p["verify"]["predicted"]["peak_bytes"],
                "measured_peak": p["verify"]["measured"]["peak_bytes"],
                "peak_error_bytes": p["verify"]["peak_error_bytes"],
                "peak_error_relative": p["verify"]["peak_error_relative"],
                "predicted_step": p["verify"]["predicted"]["step_seconds"],
                "measured_step": p["verify"]["measured"]["step_seconds"]["median"],
                "step_error_relative": p["verify"]["step_error_relative"],
                "within_budget": p["verify"]["within_budget"],
                "mismatched_moments": len(p["verify"]["mismatches"]),
            } for p in plans],
            "sweep_points": [{
                "modules": p["modules"], "measured_peak": p["peak_bytes"], "predicted_peak": p["predicted_peak_bytes"],
                "measured_step": p["step_seconds"]["median"], "predicted_step": p["predicted_step_seconds"],
            } for p in points if p["predicted_peak_bytes"] is not None],
        }

        # ---- section 1: runtime and peak vs PyTorch eager, same sets
        mid = plans[len(plans) // 2]["plan"]["checkpoint"]["modules"]
        sets = [("nothing", []), ("plan (middle budget)", mid), ("every candidate", cands)]
        fixed = pc["regimes"][0]["fixed"] - pc["fixed"]["batch"]  # ckptune's level at step start
        runtime = []
        precisions = ["fp32"] + (["bf16"] if self.a.bf16 else [])
        total = self.a.warmup + self.a.steps
        for prec in precisions:
            for j, (label, names) in enumerate(sets):
                rx = exact_regex(names)
                tag = f"{prec}-{j}"
                tp = os.path.join(d, f"train-{tag}.json")
                ep = os.path.join(d, f"eager-{tag}.json")
                ck_cmd = [self.ck, "train", name, "--checkpoint", rx, "--steps", str(total), "-o", tp,
                          *self.shape_flags(m, prec)]
                pt_cmd = [PY, os.path.join(HERE, "eager.py"), name, "--checkpoint", rx, "--batch", str(m["batch"]),
                          "--precision", prec, "--steps", str(total), "--warmup", str(self.a.warmup),
                          "--threads", str(self.a.threads), "-o", ep]
                if "image" in m:
                    pt_cmd += ["--image", str(m["image"])]
                if "seq" in m:
                    pt_cmd += ["--seq", str(m["seq"])]
                # Alternate which side runs first, so drift on a shared machine does not favour one.
                order = [("ck", ck_cmd), ("pt", pt_cmd)] if j % 2 == 0 else [("pt", pt_cmd), ("ck", ck_cmd)]
                for side, cmd in order:
                    self.run.run(f"{key}-{'train' if side == 'ck' else 'eager'}-{tag}", cmd)
                tr, ea = load(tp), load(ep)
                if sorted(tr["modules"]) != sorted(ea["modules"]):
                    raise BenchError(f"bench: ckptune checkpointed {tr['modules']} but PyTorch {ea['modules']} "
                                     f"for regex {rx!r}")
                timed = tr["steps"][self.a.warmup:]
                ck_peak = max(s["peak_bytes"] for s in timed)
                ck_med = median([s["seconds"] for s in timed])
                runtime.append({
                    "precision": prec, "set": label, "modules": names, "regex": rx,
                    "ckptune": {"median_seconds": ck_med, "seconds": [s["seconds"] for s in timed],
                                "peak_bytes": ck_peak, "start_bytes": fixed,
                                "peak_varies": len({s["peak_bytes"] for s in timed}) > 1,
                                "path": os.path.relpath(tp, self.a.out)},
                    "pytorch": {"median_seconds": ea["median_seconds"],
                                "seconds": [s["seconds"] for s in ea["steps"][self.a.warmup:]],
                                "peak_bytes": ea["peak_bytes"], "start_bytes": ea["start_bytes"],
                                "peak_varies": "peak_varies" in ea, "path": os.path.relpath(ep, self.a.out)},
                    "time_ratio": ck_med / ea["median_seconds"],
                    "peak_ratio": ck_peak / ea["peak_bytes"],
                    "peak_above_start_ratio": (ck_peak - fixed) / (ea["peak_bytes"] - ea["start_bytes"]),
                })
        res["runtime"] = runtime
        res["torch_adamw"] = load(os.path.join(d, "eager-fp32-0.json"))["optimizer_kwargs"]
        return res

    def profcost_row(self, name, gran, prof, wall):
        c = prof["configs"][0]
        return {"model": name, "granularity": gran,
                "candidates": sum(1 for b in prof["model"]["blocks"] if b["candidate"]),
                "steps_run": c["steps_run"], "wall_seconds": c["wall_seconds"],
                "process_wall_seconds": wall, "step_seconds": c["seconds_none"]["median"]}


def main():
    ap = argparse.ArgumentParser(description="ckptune vs peers, side by side (see module docstring)")
    ap.add_argument("--out", required=True, help="output directory (bench.json, raw/)")
    ap.add_argument("--quick", action="store_true", help="tiny-resnet and tiny-bert: a test of the harness")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the bf16 autocast runtime rows")
    ap.add_argument("--ckptune", default=os.path.join(ROOT, "target", "release", "ckptune"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of profile/sweep/verify steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps of the runtime comparison")
    ap.add_argument("--steps", type=int, default=5, help="timed steps of the runtime comparison (median)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per command")
    ap.add_argument("--command", default=None, help="the command line to record in the report")
    a = ap.parse_args()
    if a.steps < 3:
        raise SystemExit("bench: --steps must be at least 3 (median of ≥ 3 timed steps)")
    if not os.access(a.ckptune, os.X_OK):
        raise SystemExit(f"bench: no ckptune binary at {a.ckptune}; build it with cargo build --release -p ckptune")
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)

    # Raw outputs go to a staging directory that replaces raw/ only when everything succeeded.
    staging = tempfile.mkdtemp(prefix=".staging-", dir=a.out)
    t0 = time.time()
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        import torch  # noqa: PLC0415 (version only)

        torch_version = torch.__version__
        info = {
            "format": "ckptune.bench/1",
            "mode": "quick" if a.quick else "full",
            "command": a.command or " ".join(shlex.quote(x) for x in sys.argv),
            "date_utc": started.isoformat(timespec="seconds"),
            "machine": machine_info(), "git": git_info(), "torch": torch_version,
            "ckptune_version": subprocess.run([a.ckptune, "--version"], capture_output=True, text=True).stdout.strip(),
            "settings": {"threads": a.threads, "repeats": a.repeats, "warmup": a.warmup, "steps": a.steps,
                         "bf16": a.bf16, "budget_fractions": list(BUDGET_FRACTIONS), "every_k": EVERY_K},
        }
        b = Bench(a, staging)
        models = {}
        for m in QUICK if a.quick else FULL:
            t_model = time.time()
            models[m["key"]] = b.model(m)
            models[m["key"]]["bench_wall_seconds"] = time.time() - t_model
            log(f"{m['model']}: done in {time.time() - t_model:.0f} s")
        info["models"] = models
        info["commands"] = [{**c, "argv": [os.path.relpath(x, ROOT) if os.path.isabs(x) and x.startswith(ROOT)
                                           else x for x in c["argv"]]} for c in b.run.commands]
        info["wall_seconds"] = time.time() - t0
        info["machine"]["loadavg_end"] = os.getloadavg()
        # Swap raw/ in.
        final = os.path.join(a.out, "raw")
        old = None
        if os.path.exists(final):
            old = os.path.join(a.out, f".old-raw-{os.getpid()}")
            os.replace(final, old)
        os.replace(staging, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        # bench.json beside raw/ (paths inside are relative to the output directory, raw/ included).
        write_atomic(os.path.join(a.out, "bench.json"), _rebase(info, os.path.basename(staging)))
        log(f"wrote {os.path.join(a.out, 'bench.json')} ({info['wall_seconds']:.0f} s)")
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)


def _rebase(info, staging_name):
    """Raw paths were recorded while the files lived in the staging directory; they live under
    raw/ now."""
    return json.loads(json.dumps(info).replace(staging_name, "raw"))


if __name__ == "__main__":
    main()
