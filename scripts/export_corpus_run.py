"""Runs ckptune on every program of the export corpus (scripts/export_corpus.py's OUT_DIR and its
manifest.json), one model at a time, and writes one record per model to a JSON file
(results/export-corpus/corpus.json): what it exported as, and for each ckptune step (profile, then
plan --verify under a budget that forces checkpointing, then verify of the written plan) its exit
code, seconds, whether it panicked or timed out, and the first line of its error; for a verified
plan, the predicted and measured peaks and their difference in bytes. Standard library only.

    python3 scripts/export_corpus_run.py --bin BIN --programs DIR --work DIR --out corpus.json \
        [--precision fp32|bf16] [--only NAME...]

The budget lies FRACTION of the way from the smallest achievable peak (`peak_all`: everything
checkpointed) to the peak with nothing checkpointed (`peak_none`), read from the profile's config,
so the plan has to checkpoint something whenever checkpointing can lower the peak at all.
"""

import argparse
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time

BATCH = 2
FRACTION = 0.3


def common_args(precision):
    """The flags every profile and plan takes."""
    return ["--batch", str(BATCH), "--precision", precision, "--optimizer", "adamw", "--threads", "1",
            "--repeats", "1", "--quiet", "--no-cache"]


@dataclasses.dataclass
class Step:
    """One ckptune command's outcome."""

    command: list
    exit: int | None  # None: timed out
    seconds: float
    panicked: bool
    error: str  # the first meaningful stderr line (the panic's message for a panic), else ""

    @property
    def ok(self):
        return self.exit == 0


def error_line(stderr):
    """The line that says what went wrong: for a panic, where and the message after it; else the
    first `error:` line, else the first non-empty one."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "panicked at" in line:
            message = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("note:") else ""
            # `thread 'main' (12345) panicked at`: the thread id changes from run to run.
            return re.sub(r"^thread '[^']*' (\(\d+\) )?", "", f"{line} {message}".strip())
    return next((line for line in lines if line.startswith("error:")), lines[0] if lines else "")


def run_step(command, timeout, log_prefix):
    """Runs one command with a timeout, its stdout and stderr kept beside the outputs."""
    start = time.monotonic()
    try:
        p = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        code, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        err += f"\ntimed out after {timeout} s"
    seconds = round(time.monotonic() - start, 1)
    with open(log_prefix + ".stdout", "w") as f:
        f.write(out)
    with open(log_prefix + ".stderr", "w") as f:
        f.write(err)
    panicked = code == 101 or "panicked at" in err
    error = "" if code == 0 else (f"timed out after {timeout} s" if code is None else error_line(err))
    return Step(command, code, seconds, panicked, error)


def load(path):
    with open(path) as f:
        return json.load(f)


def budget_from_profile(profile):
    """(budget, peak_all, peak_none) of the profile's first config."""
    c = profile["configs"][0]
    lo, hi = c["peak_all"], c["peak_none"]
    return (int(lo + FRACTION * (hi - lo)) if hi > lo else hi), lo, hi


def run_model(model, bin_path, programs, work, timeout, common):
    """Profile, plan --verify and verify one exported program; returns the facts for its record."""
    d = os.path.join(work, model["name"])
    os.makedirs(d, exist_ok=True)
    program = os.path.join(programs, model["file"])
    facts = {"steps": {}}

    def step(name, command):
        s = run_step(command, timeout, os.path.join(d, name))
        facts["steps"][name] = dataclasses.asdict(s)
        return s

    profile_json = os.path.join(d, "profile.json")
    if not step("profile", [bin_path, "profile", program, *common, "-o", profile_json]).ok:
        return facts
    profile = load(profile_json)
    # How `--measure auto` measured it: memory on the meta device where the step runs there.
    facts["memory_measured"] = profile["device"].get("measured", "")
    budget, lo, hi = budget_from_profile(profile)
    facts.update(peak_all=lo, peak_none=hi, budget=budget,
                 candidates=list(dict.fromkeys(b["name"] for b in profile["model"]["blocks"] if b.get("candidate"))),
                 blocks=len(profile["model"]["blocks"]))
    plan_json = os.path.join(d, "plan.json")
    if not step("plan", [bin_path, "plan", "--budget", str(budget), program, *common, "--profile", profile_json,
                         "--verify", "-o", plan_json]).ok:
        return facts
    plan = load(plan_json)
    facts.update(checkpointed=plan["checkpoint"].get("modules", []), corrections=len(plan.get("corrections", [])),
                 first_correction_bytes=next((c["measured_peak_bytes"] - c["predicted_peak_bytes"]
                                              for c in plan.get("corrections", [])), None))
    verify_json = os.path.join(d, "verify.json")
    if not step("verify", [bin_path, "verify", plan_json, "-o", verify_json, "--quiet"]).ok:
        return facts
    v = load(verify_json)
    facts.update(predicted_peak=v["predicted"]["peak_bytes"], measured_peak=v["measured"]["peak_bytes"],
                 error_bytes=v["peak_error_bytes"], within_budget=v["within_budget"],
                 peak_moment=v.get("peak_moment"), mismatches=v.get("mismatches", [])[:3])
    return facts


def outcome(record):
    """(outcome, stage, exit code, reason) of a record: the first step that did not succeed."""
    if not record["exported"]:
        return "export failed", "export", None, record.get("error", "")
    for stage in ("profile", "plan", "verify"):
        s = record["steps"].get(stage)
        if s is None or s["exit"] == 0:
            continue
        if s["exit"] is None:
            kind = "timed out"
        elif s["panicked"]:
            kind = "panicked"
        elif s["exit"] == 2:
            kind = "refused"
        else:
            kind = "failed"
        return kind, stage, s["exit"], s["error"]
    return ("verified" if record["error_bytes"] == 0 else "verified, off"), "verify", 0, ""


def record_for(model, facts, scratch):
    """The model's record; paths in it are relative to `scratch` (programs/NAME.pt2,
    runs/NAME/profile.json), so that its commands run there and it does not name this machine."""
    record = {k: model.get(k) for k in ("name", "source", "kind", "note", "class", "params", "input", "exported")}
    record["error"] = model.get("error", "")
    record.update(facts)
    prefix = scratch.rstrip("/") + "/"
    for s in record.get("steps", {}).values():
        s["command"] = [a.replace(prefix, "") for a in s["command"][1:]]
        s["error"] = s["error"].replace(prefix, "")
    record["outcome"], record["stage"], record["exit"], record["reason"] = outcome(record)
    return record


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_corpus(out, manifest, records, bin_path, common):
    """Writes the corpus JSON, keeping the records of models not run this time (--only)."""
    old = load(out)["models"] if os.path.exists(out) else []
    merged = {r["name"]: r for r in old}
    merged.update({r["name"]: r for r in records})
    # A model keeps its place in the corpus; new ones follow in the manifest's order (a work
    # folder made for --only holds a manifest of those models alone).
    order = {r["name"]: i for i, r in enumerate(old)}
    for m in manifest["models"]:
        order.setdefault(m["name"], len(order))
    version = subprocess.run([bin_path, "--version"], capture_output=True, text=True).stdout.strip()
    corpus = {
        "format": 1,
        "ckptune": version,
        "torch": manifest["torch"], "torchvision": manifest["torchvision"],
        "transformers": manifest["transformers"],
        "cpu": cpu_name(), "cores": os.cpu_count(),
        "batch": BATCH, "budget_fraction": FRACTION, "common_args": common,
        "models": sorted(merged.values(), key=lambda r: order.get(r["name"], len(order))),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(corpus, f, indent=1)
        f.write("\n")
    os.replace(out + ".tmp", out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="the ckptune binary")
    ap.add_argument("--programs", required=True, help="export_corpus.py's OUT_DIR")
    ap.add_argument("--work", required=True, help="where each model's profile, plan and logs go")
    ap.add_argument("--out", required=True, help="the corpus JSON to write")
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="the precision every model is planned in (bf16: autocast)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per ckptune command")
    a = ap.parse_args()
    manifest = load(os.path.join(a.programs, "manifest.json"))
    models = [m for m in manifest["models"] if not a.only or m["name"] in a.only]
    scratch = os.path.commonpath([os.path.abspath(a.programs), os.path.abspath(a.work)])
    common = common_args(a.precision)
    records = []
    for i, model in enumerate(models, 1):
        facts = run_model(model, a.bin, os.path.abspath(a.programs), os.path.abspath(a.work), a.timeout,
                          common) if model["exported"] else {}
        record = record_for(model, facts, scratch)
        records.append(record)
        write_corpus(a.out, manifest, records, a.bin, common)
        detail = f"{record['error_bytes']:,} B" if record["outcome"].startswith("verified") else record["reason"]
        print(f"[{i}/{len(models)}] {model['name']}: {record['outcome']} ({record['stage']}) {detail}",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
