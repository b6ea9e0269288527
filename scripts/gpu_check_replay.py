"""Does `ckptune simulate-allocator` predict PyTorch's CUDA caching allocator? Replays allocation
traces on the GPU — `torch.empty(bytes, dtype=torch.uint8, device="cuda")` and `del`, in order,
on the trace's streams — reading `torch.cuda.memory_stats()` after every event, and compares
each event's allocated, reserved and active bytes and segment count with the simulation's
(`--every-event`), under several PYTORCH_CUDA_ALLOC_CONF settings, each in a fresh process
(PyTorch reads the variable when CUDA initializes). `scripts/gpu_check` is its front door.

    .venv/bin/python scripts/gpu_check_replay.py run [--out results/gpu] [--traces DIR]
        [--phase all|measure|compare] [--backend torch|fake] [--ckptune BIN] [--models LIST]

Phases: `measure` needs the GPU (writes OUT/work/measured-K.json per config K); `compare` needs
the ckptune binary (simulates each trace under each config with the measured device's capacity,
writes OUT/replay.json and OUT/replay.md); `all` does both. `--backend fake` replaces the GPU by
a stand-in allocator with made-up statistics, to test the pipeline on a CPU: its results say so
and mean nothing about PyTorch. The subcommand `measure` is what each fresh process runs. With
`--phase all`, `--models` (scripts/gpu_check_models.py) are first planned here for the GPU, their
step traces replayed with the others, then measured on the GPU (OUT/models.{json,md}); their
step and block times are measured last, alone on the card, against the times the plans estimate
for the `--target` GPU (scripts/gpu_check_times.py, OUT/times.{json,md}). `--parts` picks which of
the replay, the steps' memory and the times a run measures and compares.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import alloc_traces  # noqa: E402
import gpu_check_models  # noqa: E402
import gpu_check_times  # noqa: E402

MEASURED_FORMAT = "ckptune.gpu-replay-measured/1"
RESULT_FORMAT = "ckptune.gpu-replay/1"
# What is compared after each event, and where the simulation's --every-event rows hold it
# (its columns: allocated, reserved, active, requested, segments, largest free block).
COLUMNS = ["allocated_bytes", "reserved_bytes", "active_bytes", "segments"]
SIMULATED_INDEX = [0, 1, 2, 4]
# Each config's process: import torch, initialize CUDA, replay a few thousand events.
MEASURE_TIMEOUT_S = 240


class TorchBackend:
    """The real allocator: tensors of uint8 on the current CUDA device, one stream per trace
    stream id (0: the default stream)."""

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_check_replay: torch sees no CUDA device; run this on the GPU machine "
                             "(or pass --backend fake to test the pipeline)")
        torch.cuda.init()  # memory_stats_as_nested_dict() is empty before CUDA initializes
        self.torch = torch
        self.OutOfMemory = torch.OutOfMemoryError
        self.streams = {0: torch.cuda.default_stream()}
        self.live = {}

    def device(self):
        props = self.torch.cuda.get_device_properties(0)
        return {"name": props.name, "total_memory": props.total_memory, "torch": self.torch.__version__}

    def alloc(self, id_, nbytes, stream):
        torch = self.torch
        if stream not in self.streams:
            self.streams[stream] = torch.cuda.Stream()
        with torch.cuda.stream(self.streams[stream]):
            self.live[id_] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def free(self, id_):
        del self.live[id_]

    def empty_cache(self):
        self.torch.cuda.empty_cache()

    def stats(self):
        s = self.torch.cuda.memory_stats_as_nested_dict()
        return [s["allocated_bytes"]["all"]["current"], s["reserved_bytes"]["all"]["current"],
                s["active_bytes"]["all"]["current"], s["segment"]["all"]["current"]]

    def counters(self):
        s = self.torch.cuda.memory_stats_as_nested_dict()
        return {"num_alloc_retries": s["num_alloc_retries"], "num_ooms": s["num_ooms"]}

    def reset(self):
        self.live.clear()
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()


class FakeOutOfMemory(Exception):
    pass


class FakeBackend:
    """A stand-in with made-up statistics (every request its own 2 MiB-rounded segment, nothing
    cached, out of memory past `limit`): lets the pipeline run without a GPU. Not PyTorch."""

    OutOfMemory = FakeOutOfMemory
    MIB2 = 2 << 20

    def __init__(self, limit=1 << 40):
        self.limit = limit
        self.live = {}
        self.ooms = 0

    def device(self):
        return {"name": "fake (no GPU)", "total_memory": 80 << 30, "torch": "none"}

    def alloc(self, id_, nbytes, stream):
        block = -(-max(nbytes, 1) // 512) * 512
        if sum(b for b, _ in self.live.values()) + block > self.limit:
            self.ooms += 1
            raise FakeOutOfMemory(f"fake out of memory allocating {nbytes} bytes")
        self.live[id_] = (block, -(-block // self.MIB2) * self.MIB2) if nbytes else (0, 0)

    def free(self, id_):
        del self.live[id_]

    def empty_cache(self):
        pass

    def stats(self):
        allocated = sum(b for b, _ in self.live.values())
        reserved = sum(r for _, r in self.live.values())
        return [allocated, reserved, allocated, sum(1 for b, _ in self.live.values() if b)]

    def counters(self):
        return {"num_alloc_retries": 0, "num_ooms": self.ooms}

    def reset(self):
        self.live.clear()


BACKENDS = {"torch": TorchBackend, "fake": FakeBackend}


def replay_trace(events, backend):
    """Replays one trace's events; the statistics after each, where it stopped (an
    out-of-memory error), and the retry counters it added. Leaves the allocator empty."""
    backend.reset()
    before = backend.counters()
    baseline = backend.stats()
    rows, stopped = [], None
    for i, event in enumerate(events):
        op = event[0]
        try:
            if op == "a":
                backend.alloc(event[1], event[2], event[3] if len(event) > 3 else 0)
            elif op == "f":
                backend.free(event[1])
            elif op == "e":
                backend.empty_cache()
            elif op != "m":
                raise ValueError(f"event {i}: unknown operation {op!r}")
        except backend.OutOfMemory as e:
            stopped = {"event": i, "error": str(e).splitlines()[0]}
        rows.append(backend.stats())
        if stopped:
            break
    after = backend.counters()
    backend.reset()
    return {"baseline": baseline, "rows": rows, "stopped": stopped,
            "counters": {k: after[k] - before[k] for k in after}}


def measure(trace_paths, backend, alloc_conf):
    """The measured document for one configuration: every trace replayed in this process."""
    traces = []
    for path in trace_paths:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != alloc_traces.FORMAT:
            raise SystemExit(f"gpu_check_replay: {path} is not a {alloc_traces.FORMAT} trace")
        started = time.monotonic()
        result = replay_trace(doc["events"], backend)
        result.update(name=trace_name(path), events=len(doc["events"]), seconds=time.monotonic() - started)
        traces.append(result)
    return {"format": MEASURED_FORMAT, "alloc_conf": alloc_conf, "device": backend.device(), "traces": traces}


def trace_name(path):
    return os.path.splitext(os.path.basename(path))[0]


def relative_errors(gpu, simulated):
    """|simulated − gpu| / gpu per event; 0 where both are 0, 1 where only the GPU's is 0."""
    out = []
    for g, s in zip(gpu, simulated):
        out.append(0.0 if g == s else (1.0 if g == 0 else abs(s - g) / g))
    return out


def compare_trace(measured, simulated_doc):
    """One trace under one config: errors of allocated and reserved bytes over the events both
    replayed, the first event where any compared statistic differs, and where each stopped."""
    gpu_rows = measured["rows"]
    sim_rows = [[row[i] for i in SIMULATED_INDEX] for row in simulated_doc["every_event"]["rows"]]
    n = min(len(gpu_rows), len(sim_rows))
    result = {"trace": measured["name"], "events": measured["events"], "compared": n}
    for col in ("allocated_bytes", "reserved_bytes"):
        k = COLUMNS.index(col)
        errors = relative_errors([r[k] for r in gpu_rows[:n]], [r[k] for r in sim_rows[:n]])
        result[col] = {"max_rel_error": max(errors, default=0.0),
                       "mean_rel_error": sum(errors) / n if n else 0.0}
    result["first_divergence"] = None
    for i in range(n):
        if gpu_rows[i] != sim_rows[i]:
            differ = [c for c, g, s in zip(COLUMNS, gpu_rows[i], sim_rows[i]) if g != s]
            result["first_divergence"] = {"event": i, "columns": differ, "gpu": gpu_rows[i], "simulated": sim_rows[i]}
            break
    gpu_stop = (measured.get("stopped") or {}).get("event")
    sim_stop = (simulated_doc.get("stopped") or {}).get("event")
    stats = simulated_doc["stats"]
    result.update(
        gpu_stopped=gpu_stop, simulated_stopped=sim_stop,
        gpu_retries=measured["counters"]["num_alloc_retries"], simulated_retries=stats["num_alloc_retries"],
        baseline=measured["baseline"],
        exact=(result["first_divergence"] is None and len(gpu_rows) == len(sim_rows) and gpu_stop == sim_stop
               and measured["counters"]["num_alloc_retries"] == stats["num_alloc_retries"]))
    return result


def simulate(ckptune, trace_path, alloc_conf, capacity, out_path):
    """`ckptune simulate-allocator` of one trace under one config, every event's state kept.
    Exit 1 (the trace runs out of memory) is a result, not a failure."""
    cmd = [ckptune, "simulate-allocator", trace_path, "--alloc-conf", alloc_conf, "--capacity", str(capacity),
           "--every-event", "-o", out_path]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode not in (0, 1) or not os.path.exists(out_path):
        raise SystemExit(f"gpu_check_replay: {' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    with open(out_path) as f:
        return json.load(f)


def compare(work, trace_dir, ckptune):
    """Simulates what was measured (each config, each trace, with the measured device's total
    memory as capacity) and compares; the result document."""
    results, devices, configs, failed = [], [], [], []
    for k in range(len(alloc_traces.CONFIGS)):
        path = os.path.join(work, f"measured-{k}.json")
        if not os.path.exists(path):
            raise SystemExit(f"gpu_check_replay: {path} is missing; run the measure phase first (on the GPU)")
        with open(path) as f:
            measured = json.load(f)
        configs.append(measured["alloc_conf"])
        if "error" in measured:
            failed.append({"alloc_conf": measured["alloc_conf"], "error": measured["error"]})
            continue
        devices.append(measured["device"])
        sim_dir = os.path.join(work, f"simulated-{k}")
        os.makedirs(sim_dir, exist_ok=True)
        for trace in measured["traces"]:
            sim = simulate(ckptune, os.path.join(trace_dir, trace["name"] + ".json"), measured["alloc_conf"],
                           measured["device"]["total_memory"], os.path.join(sim_dir, trace["name"] + ".json"))
            results.append(dict(alloc_conf=measured["alloc_conf"], **compare_trace(trace, sim)))
    return {
        "format": RESULT_FORMAT,
        "date": datetime.date.today().isoformat(),
        "device": devices[0] if devices else None,
        "fake_backend": any(d["name"].startswith("fake") for d in devices),
        "configs": configs,
        "failed_configs": failed,
        "results": results,
        "summary": summary(results),
    }


def summary(results):
    return {
        "pairs": len(results),
        "exact": sum(r["exact"] for r in results),
        "max_rel_error_reserved": max((r["reserved_bytes"]["max_rel_error"] for r in results), default=0.0),
        "max_rel_error_allocated": max((r["allocated_bytes"]["max_rel_error"] for r in results), default=0.0),
    }


def markdown(doc):
    """replay.md: the summary, then a row per config and trace."""
    s = doc["summary"]
    device = doc["device"] or {}
    lines = ["# The caching-allocator simulation against a GPU", ""]
    if doc["fake_backend"]:
        lines += ["**FAKE BACKEND: these statistics come from a stand-in, not from a GPU. They test the "
                  "pipeline and say nothing about PyTorch.**", ""]
    lines += [
        f"Written by `scripts/gpu_check` on {doc['date']}: {device.get('name', '?')} "
        f"({device.get('total_memory', 0) / 2**30:.1f} GiB), torch {device.get('torch', '?')}. Each trace of "
        "`scripts/alloc_traces.py` replayed with `torch.empty`/`del` under each PYTORCH_CUDA_ALLOC_CONF (a fresh "
        "process each), `torch.cuda.memory_stats()` read after every event and compared with "
        "`ckptune simulate-allocator --every-event` (capacity: the device's total memory).",
        "",
        f"{s['exact']} of {s['pairs']} config × trace pairs agree on every event (allocated, reserved and active "
        "bytes, segments, where it ran out of memory, retries). Largest relative error of reserved bytes "
        f"{s['max_rel_error_reserved']:.2%}, of allocated bytes {s['max_rel_error_allocated']:.2%}.",
        "",
        "Relative error: |simulated − GPU| / GPU after each event (1 where the GPU reads 0 and the simulation "
        "does not). First divergence: the first event where any compared statistic differs.",
        "",
        "| PYTORCH_CUDA_ALLOC_CONF | trace | events | exact | reserved max / mean | allocated max / mean "
        "| first divergence | stopped (GPU / sim) | retries (GPU / sim) |",
        "|---|---|---:|:-:|---:|---:|---|---|---|",
    ]
    for r in doc["results"]:
        d = r["first_divergence"]
        where = "—" if d is None else f"event {d['event']}: {', '.join(d['columns'])}"
        stop = f"{r['gpu_stopped']} / {r['simulated_stopped']}" if (r["gpu_stopped"], r["simulated_stopped"]) != (None, None) else "—"
        lines.append(
            f"| `{r['alloc_conf'] or '(default)'}` | {r['trace']} | {r['events']} | {'yes' if r['exact'] else 'no'} "
            f"| {r['reserved_bytes']['max_rel_error']:.2%} / {r['reserved_bytes']['mean_rel_error']:.2%} "
            f"| {r['allocated_bytes']['max_rel_error']:.2%} / {r['allocated_bytes']['mean_rel_error']:.2%} "
            f"| {where} | {stop} | {r['gpu_retries']} / {r['simulated_retries']} |")
    return "\n".join(lines) + "\n"


def write_atomic(path, text):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def find_ckptune(given):
    """The binary: --ckptune, $CKPTUNE_BIN, else target/release/ckptune (built when missing)."""
    path = given or os.environ.get("CKPTUNE_BIN") or os.path.join(ROOT, "target", "release", "ckptune")
    if not os.path.exists(path):
        print(f"gpu_check_replay: building {path} (cargo build --release -p ckptune)", file=sys.stderr)
        try:
            subprocess.run(["cargo", "build", "--release", "-p", "ckptune"], cwd=ROOT, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"gpu_check_replay: no ckptune binary at {path} and building it failed ({e}); "
                             "pass --ckptune BIN, or run `--phase compare` where ckptune builds")
    return path


def run(args):
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    trace_dir = args.traces or os.path.join(work, "traces")
    models = args.models
    ckptune = None
    if args.phase in ("all", "prepare"):
        if not args.traces:
            alloc_traces.write_all(trace_dir)
        if models:
            # Planned here from the meta device first, so their traces are replayed with the others.
            ckptune = find_ckptune(args.ckptune)
            if args.phase == "prepare":
                gpu_check_models.prepare(ckptune, models, work, None if args.traces else trace_dir, args.target)
            else:
                model_doc = gpu_check_models.run_models(ckptune, models, work, None if args.traces else trace_dir,
                                                        on_gpu=args.backend == "torch", target=args.target)
                write_atomic(os.path.join(args.out, "models.json"), json.dumps(model_doc, indent=1) + "\n")
                write_atomic(os.path.join(args.out, "models.md"), gpu_check_models.markdown(model_doc))
    parts = args.parts
    if args.phase in ("all", "measure"):
        if "replay" in parts:
            measure_all(work, trace_dir, args.backend)
        if models and args.backend == "torch" and os.path.exists(os.path.join(work, "models", "index.json")):
            if "steps" in parts:
                gpu_check_models.measure_steps(work)
            if "times" in parts:
                gpu_check_times.measure_all(work)  # last, alone on the card
    if args.phase in ("all", "compare"):
        compare_parts(args, work, trace_dir, ckptune or find_ckptune(args.ckptune))


def compare_parts(args, work, trace_dir, ckptune):
    """The compare phase: each measured part of `args.parts` against ckptune's predictions."""
    if "replay" in args.parts:
        doc = compare(work, trace_dir, ckptune)
        write_atomic(os.path.join(args.out, "replay.json"), json.dumps(doc, indent=1) + "\n")
        write_atomic(os.path.join(args.out, "replay.md"), markdown(doc))
        s = doc["summary"]
        print(f"gpu_check: {s['exact']} of {s['pairs']} pairs exact; wrote {args.out}/replay.json and replay.md")
    if "steps" in args.parts and os.path.exists(os.path.join(work, "steps", "context.json")):
        steps = gpu_check_models.compare_steps(ckptune, work)
        write_atomic(os.path.join(args.out, "steps.json"), json.dumps(steps, indent=1) + "\n")
        write_atomic(os.path.join(args.out, "steps.md"), gpu_check_models.steps_markdown(steps))
        print(f"gpu_check: {len(steps['runs'])} real steps compared; wrote {args.out}/steps.json and steps.md")
    times = gpu_check_times.compare(work) if "times" in args.parts else None
    if times is not None:
        write_atomic(os.path.join(args.out, "times.json"), json.dumps(times, indent=1) + "\n")
        write_atomic(os.path.join(args.out, "times.md"), gpu_check_times.markdown(times))
        print(f"gpu_check: {len(times['models'])} models' times compared; wrote {args.out}/times.json and times.md")


def measure_all(work, trace_dir, backend):
    """Every trace under every configuration, a fresh process each. A configuration this
    PyTorch refuses (or a process that fails) is recorded in its measured file, not raised."""
    for k, conf in enumerate(alloc_traces.CONFIGS):
        out = os.path.join(work, f"measured-{k}.json")
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        cmd = [sys.executable, os.path.abspath(__file__), "measure", "--traces", trace_dir, "--conf", conf,
               "--backend", backend, "--out", out]
        print(f"gpu_check: measuring PYTORCH_CUDA_ALLOC_CONF={conf!r}", file=sys.stderr)
        try:
            proc = subprocess.run(cmd, env=env, timeout=MEASURE_TIMEOUT_S, capture_output=True, text=True)
            error = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {MEASURE_TIMEOUT_S} s"
        if error:
            print(f"gpu_check: {conf!r} failed: {error}", file=sys.stderr)
            write_atomic(out, json.dumps({"format": MEASURED_FORMAT, "alloc_conf": conf, "error": error}) + "\n")


def measure_cmd(args):
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") != args.conf:
        raise SystemExit("gpu_check_replay measure: PYTORCH_CUDA_ALLOC_CONF must be set to --conf before this "
                         "process starts (PyTorch reads it once); `run` does that")
    paths = sorted(os.path.join(args.traces, f) for f in os.listdir(args.traces) if f.endswith(".json"))
    doc = measure(paths, BACKENDS[args.backend](), args.conf)
    write_atomic(args.out, json.dumps(doc) + "\n")


PARTS = ("replay", "steps", "times")


def parse_parts(text):
    """`--parts`: names of PARTS, comma-separated (an argparse type: bad names exit 2)."""
    names = tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown) or '(none given)'}; "
                                         f"known: {', '.join(PARTS)}")
    return names


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", prog="scripts/gpu_check", help="measure on the GPU and/or compare with the simulation")
    r.add_argument("--out", default=os.path.join(ROOT, "results", "gpu"), help="results folder (default results/gpu)")
    r.add_argument("--traces", help="a folder of ckptune.alloc-trace/1 files (default: the synthetic ones)")
    r.add_argument("--phase", choices=["all", "prepare", "measure", "compare"], default="all",
                   help="prepare: traces and plans here (needs ckptune); measure: on the GPU (needs only torch); "
                        "compare: here again (needs ckptune); all: the three in order")
    r.add_argument("--backend", choices=sorted(BACKENDS), default="torch",
                   help="torch: the GPU; fake: a stand-in to test the pipeline without one")
    r.add_argument("--ckptune", help="the ckptune binary (default $CKPTUNE_BIN, else target/release/ckptune)")
    r.add_argument("--parts", type=parse_parts, default=PARTS,
                   help="what to measure and compare, comma-separated (default all: replay = the traces under "
                        "each allocator setting, steps = the models' real steps' memory, times = their step and "
                        "block times)")
    r.add_argument("--target", default=gpu_check_models.DEFAULT_TARGET,
                   help="the --target the plans are made for (default %(default)s: that GPU's times estimated, "
                        "compared with the GPU's in times.md; `cuda` for an unnamed GPU)")
    r.add_argument("--models", type=gpu_check_models.parse_models, default=gpu_check_models.DEFAULT_MODELS,
                   help=f"with --phase all: models to plan here and measure on the GPU, comma-separated, or '' "
                        f"(default {gpu_check_models.DEFAULT_MODELS}; known: {', '.join(gpu_check_models.MODELS)})")
    m = sub.add_parser("measure", help="(one fresh process per config) replay every trace, record the stats")
    m.add_argument("--traces", required=True)
    m.add_argument("--conf", required=True, help="the PYTORCH_CUDA_ALLOC_CONF this process was started with")
    m.add_argument("--backend", choices=sorted(BACKENDS), default="torch")
    m.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.command == "run":
        run(args)
    else:
        measure_cmd(args)


if __name__ == "__main__":
    main()
