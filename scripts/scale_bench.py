"""Plans models no machine here can hold, from their config.json alone, and PyTorch's MemTracker
on the same configs: each command's wall time and peak resident memory, measured by this script
(os.wait4), beside its answer. Run by scripts/scale_bench, which writes results/scale/.

    scale_bench.py --bin CKPTUNE --configs DIR --out DIR [--memtracker-timeout S]

Every ckptune plan runs with --target cuda:h100 (80 GB): memory measured on the meta device, times
estimated by the cost model over the H100's published rates (docs/cost-model.md), no step run.
"""

import argparse
import json
import shutil
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PRECISIONS = ["fp32", "bf16", "bf16-pure"]
OPTIMIZERS = ["adamw", "adamw8bit"]

# (name, config folder, sequence, extra ckptune flags). FSDP2 plans cover fp32 with AdamW or SGD
# with momentum (docs/fsdp.md), so the 70B rows offer those.
PLANS = [
    ("llama-3.1-8b", "llama-3.1-8b", 8192, []),
    ("qwen2.5-7b", "qwen2.5-7b", 8192, []),
    # Mistral beyond its 4096-token sliding window is refused (the windowed mask is not modelled).
    ("mistral-7b-v0.1", "mistral-7b-v0.1", 4096, []),
    ("llama-3.1-70b-shard8", "llama-3.1-70b", 4096, ["--shard", "8"]),
    ("llama-3.1-70b-shard64", "llama-3.1-70b", 4096, ["--shard", "64"]),
]


def timed(cmd, timeout, env=None):
    """Runs cmd; returns (exit code, wall seconds, stdout, stderr)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    wall = time.monotonic() - t0
    return proc.returncode, wall, out, err


def run_measured(cmd, timeout, env=None):
    """cmd under a small wrapper that reports the command's own wall time and peak resident memory
    (ru_maxrss of wait4 on it alone: RUSAGE_CHILDREN would be the maximum over every child)."""
    wrapper = [
        sys.executable,
        "-c",
        "import os,sys,json,time;t=time.monotonic();pid=os.fork()\n"
        "if pid==0: os.execvp(sys.argv[1],sys.argv[1:])\n"
        "_,st,ru=os.wait4(pid,0);sys.stderr.write('\\n@@'+json.dumps({'rc':os.waitstatus_to_exitcode(st),"
        "'wall':time.monotonic()-t,'maxrss_kb':ru.ru_maxrss})+'\\n');sys.exit(0)",
    ] + cmd
    rc, _, out, err = timed(wrapper, timeout, env)
    stats = {"rc": rc, "wall": None, "maxrss_kb": None}
    lines = err.rstrip().splitlines()
    if lines and lines[-1].startswith("@@"):
        stats = json.loads(lines[-1][2:])
        err = "\n".join(lines[:-1])
    return stats, out, err


def ckptune_plans(args, out_dir):
    rows = []
    for name, folder, seq, extra in PLANS:
        config = str(Path(args.configs) / folder / "config.json")
        shard = "--shard" in extra
        precisions = ["fp32"] if shard else PRECISIONS
        optimizers = ["adamw", "sgd-momentum"] if shard else OPTIMIZERS
        plan = out_dir / name / "plan.json"
        plan.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            args.bin, "plan", "--budget", "80GiB", config, "--seq", str(seq), "--batch", "1",
            "--precision", ",".join(precisions), "--optimizer", ",".join(optimizers),
            "--target", "cuda:h100", "--threads", "1", "--no-cache", "-o", str(plan),
        ] + extra
        stats, out, err = run_measured(cmd, args.plan_timeout)
        shown = " ".join(["ckptune"] + cmd[1:]).replace(str(Path(args.configs)), "results/scale/configs")
        (out_dir / name / "plan.txt").write_text(f"$ {shown}\n{out}{err}")
        row = {"name": name, "seq": seq, "command": shown, "shard": shard, **stats}
        if stats["rc"] == 0:
            p = json.loads(plan.read_text())
            row.update(
                config=p["config"], peak_bytes=p["predicted"]["peak_bytes"],
                step_seconds=p["predicted"]["step_seconds"], regex=p["checkpoint"]["regex"],
                checkpointed=len(p["checkpoint"]["modules"]), params=p["model"]["params"],
                configs=len(p["alternatives"]),
                # Each config's peak with nothing checkpointed, beside MemTracker's.
                baselines={f'{a["config"]["precision"]}/{a["config"]["optimizer"]}': a["baseline_peak_bytes"]
                           for a in p["alternatives"]},
            )
        if stats["rc"] == 0 and not shard:
            # The chosen config's predicted trade-offs, plotted from its profile (the same
            # measurement as the plan's; every other config's peak is in the plan's alternatives).
            # `plot` draws one device's step, so sharded plans have none.
            prof = out_dir / name / "profile.json"
            c = p["config"]
            pcmd = [args.bin, "profile", config, "--seq", str(seq), "--batch", "1",
                    "--precision", c["precision"], "--optimizer", c["optimizer"],
                    "--target", "cuda:h100", "--threads", "1", "--no-cache", "--quiet", "-o", str(prof)]
            subprocess.run(pcmd, check=True, capture_output=True)
            plots = out_dir / name / "plots"
            shutil.rmtree(plots, ignore_errors=True)
            subprocess.run([args.bin, "plot", str(prof), "-o", str(plots)], check=True, capture_output=True)
        if stats["rc"] != 0:
            row["error"] = (err.strip().splitlines() or [""])[-1]
        rows.append(row)
        print(f"{name}: rc {stats['rc']}, {stats['wall']:.1f} s, {stats['maxrss_kb'] / 1024:.0f} MiB",
              file=sys.stderr)
    return rows


def memtracker(args):
    rows = []
    for name, folder, seq, extra in PLANS:
        if "--shard" in extra:
            continue
        for precision in PRECISIONS:
            cmd = [sys.executable, str(HERE / "memtracker_peak.py"),
                   str(Path(args.configs) / folder), str(seq), precision]
            stats, out, err = run_measured(cmd, args.memtracker_timeout, env=dict(os.environ))
            row = {"name": name, "seq": seq, "precision": precision, "optimizer": "adamw", **stats}
            if stats["rc"] == 0:
                row.update(json.loads(out.strip().splitlines()[-1]))
            else:
                row["error"] = (err.strip().splitlines() or ["timed out"])[-1]
            rows.append(row)
            print(f"memtracker {name} {precision}: rc {stats['rc']}, {stats['wall']:.1f} s", file=sys.stderr)
    return rows


# A model that fits here, planned as the card's example line: memory on the meta device and times
# from real steps (--measure auto) against every step run for real (--measure run), the profile
# cache off for both. Run last, alone: its times are measured.
FITS = ["plan", "--budget", "12GiB", "bert-large-uncased", "--batch", "4", "--seq", "512", "--no-cache"]


def fits_here(args, out_dir):
    rows = []
    kept = {}
    if args.fits != ["auto", "run"]:
        kept = {r["measure"]: r for r in json.loads((out_dir / "scale.json").read_text()).get("fits", [])}
    for measure in ["auto", "run"]:
        if measure not in args.fits:
            rows.append(kept[measure])
            continue
        folder = out_dir / "bert-large" / measure
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [args.bin] + FITS + ["--measure", measure, "-o", str(folder / "plan.json")]
        stats, out, err = run_measured(cmd, args.fits_timeout)
        (folder / "plan.txt").write_text("$ " + " ".join(["ckptune"] + cmd[1:]) + f"\n{out}{err}")
        row = {"measure": measure, **stats}
        if stats["rc"] == 0:
            p = json.loads((folder / "plan.json").read_text())
            row.update(config=p["config"], regex=p["checkpoint"]["regex"],
                       peak_bytes=p["predicted"]["peak_bytes"], step_seconds=p["predicted"]["step_seconds"],
                       step_seconds_range=p["predicted"].get("step_seconds_range"),
                       steps_run=p["profile"]["steps_run"],
                       configs=len(p["alternatives"]),
                       timing_notes=[l[len("note: "):] for l in err.splitlines()
                                     if l.startswith("note: ") and " timed" in l],
                       configs_timed=sum(1 for a in p["alternatives"]
                                         if not a["predicted"].get("step_seconds_estimated")))
        rows.append(row)
        print(f"bert-large --measure {measure}: rc {stats['rc']}, {stats['wall']:.1f} s", file=sys.stderr)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan-timeout", type=int, default=120)
    ap.add_argument("--memtracker-timeout", type=int, default=600)
    ap.add_argument("--fits-timeout", type=int, default=1800)
    ap.add_argument("--fits", type=lambda s: [m for m in s.split(",") if m], default=["auto", "run"],
                    help="the --measure ways BERT-large is planned (the others' rows are kept)")
    ap.add_argument("--keep-memtracker", action="store_true",
                    help="reuse the MemTracker rows of the existing scale.json (plans only)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    plans = ckptune_plans(args, out_dir)
    cpu = open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t")
    if args.keep_memtracker:
        kept = json.loads((out_dir / "scale.json").read_text())
        tracked, tracked_cpu = kept["memtracker"], kept.get("memtracker_cpu", kept["cpu"])
    else:
        tracked, tracked_cpu = memtracker(args), cpu
    fits = fits_here(args, out_dir)
    doc = {"fits": fits, "cpu": cpu, "plans": plans, "memtracker": tracked, "memtracker_cpu": tracked_cpu}
    tmp = out_dir / "scale.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.rename(out_dir / "scale.json")


if __name__ == "__main__":
    main()
