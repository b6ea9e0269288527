"""Speed of torch.export programs against the built-in models: ResNet-50 and BERT-base exported
from the plain-torch references (`models/fixtures/reference.py`), each trained by `ckptune
train` next to the built-in model of the same name, interleaved (built-in, exported, built-in,
exported) in one run so that both see the same machine. Reports the step-time ratio per round
and the per-node dispatch overhead: the extra time per step divided by the program's nodes,
measured also on the tiny ResNet fixture at batch 1, where kernels take microseconds and the
difference is the interpreter's own cost.

    .venv/bin/python scripts/bench_export.py target/release/ckptune results/export

writes `speed.json` and `speed.md` in the output directory (atomically). About 12 minutes on
2 cores. With `--table OUT_DIR` it only writes `speed.md` again from the `speed.json` there.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile

import torch
from torch.export import Dim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "models", "fixtures")
STEPS = 6  # the first is a warm-up; the median of the other five is the step time
ROUNDS = 5  # each a built-in and an exported run, the order alternating between rounds
TARGET = 1.05  # issue 14: an exported program steps within 1.05x of the built-in model


def export(model, args, path):
    shapes = tuple({0: Dim("batch")} for _ in args)
    ep = torch.export.export(model.train(), args, dynamic_shapes=shapes)
    torch.export.save(ep, path)


def graph_nodes(path):
    """Nodes of the program's graph (every ATen call and Python operator the interpreter runs)."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith("models/model.json"))
        program = json.loads(z.read(name))
    return len(program["graph_module"]["graph"]["nodes"])


def step_seconds(binary, model, args):
    out = subprocess.run(
        [binary, "train", model, *args, "--steps", str(STEPS), "--threads", "2", "--json", "--quiet",
         "--no-cache"],
        check=True, capture_output=True, text=True,
    ).stdout
    steps = json.loads(out)["steps"]
    return statistics.median(s["seconds"] for s in steps[1:])


def main(binary, out_dir):
    # The fixtures' scripts import each other by name.
    sys.path.insert(0, FIXTURES)
    import make_export_fixtures as fixtures
    import reference
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        resnet, _ = reference.build("resnet50")
        bert, _ = reference.build("bert-base-uncased")
        cases = [
            ("resnet50", resnet, (torch.randn(2, 3, 224, 224),), ["--batch", "4", "--image", "224"]),
            ("bert-base-uncased", fixtures.BertForExport(bert),
             (torch.randint(0, 30522, (2, 128)), torch.ones(2, 128, dtype=torch.long)),
             ["--batch", "4", "--seq", "128"]),
        ]
        # Where kernels take microseconds, the step time is mostly the interpreter's own work:
        # the test fixture of tiny-resnet at batch 1 bounds the dispatch cost per node.
        cases.append(("tiny-resnet", None, None, ["--batch", "1", "--image", "32"]))
        for name, model, args, flags in cases:
            if model is None:
                path = os.path.join(FIXTURES, "tiny_resnet.pt2")
            else:
                path = os.path.join(tmp, f"{name}.pt2")
                export(model, args, path)
            nodes = graph_nodes(path)
            builtin, exported = [], []
            for r in range(ROUNDS):
                # The program fixes the image size and sequence length; only the batch is a flag.
                runs = [(builtin, name, flags), (exported, path, flags[:2])]
                # Alternating which goes first cancels a machine that speeds up or slows down
                # through the run.
                for times, model_arg, model_flags in (runs if r % 2 == 0 else runs[::-1]):
                    times.append(step_seconds(binary, model_arg, model_flags + ["--precision", "fp32"]))
            ratios = [e / b for b, e in zip(builtin, exported)]
            overhead = statistics.median(e - b for b, e in zip(builtin, exported)) / nodes
            rows.append({
                "model": name, "flags": " ".join(flags), "graph_nodes": nodes,
                "builtin_step_seconds": builtin, "exported_step_seconds": exported,
                "ratio": ratios, "median_ratio": statistics.median(ratios),
                "overhead_per_node_seconds": overhead,
            })
            print(f"{name}: built-in {builtin}, exported {exported}, ratios {ratios}", file=sys.stderr)
    os.makedirs(out_dir, exist_ok=True)
    write(out_dir, "speed.json", json.dumps(rows, indent=2) + "\n")
    write(out_dir, "speed.md", render(rows))


def write(out_dir, name, text):
    tmp = os.path.join(out_dir, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out_dir, name))


def render(rows):
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    md = [
        "# torch.export programs against the built-in models: step time",
        "",
        "Written by `scripts/bench_export.py`: ResNet-50 and BERT-base exported from the plain-torch",
        "references, and the tiny ResNet test fixture at batch 1 (where kernels take microseconds, so",
        "the difference is the interpreter's own cost), each `ckptune train`ed next to the built-in",
        "model (fp32, AdamW, nothing",
        f"checkpointed, 2 threads, {STEPS} steps of which the median of the last {STEPS - 1}),",
        f"interleaved over {len(rows[0]['ratio']) if rows else ROUNDS} rounds in one run on {cpu} (each round runs both,",
        "the order alternating between rounds). The ratio is judged by its median over the rounds,",
        f"against the target of {TARGET}x; single rounds on this shared 2-core machine move by more",
        "than that. The overhead per node is the median extra time per step divided by the program's",
        "graph nodes; a negative figure means the exported program stepped faster than the built-in",
        "model, so the interpreter's dispatch cost is below what this comparison resolves.",
        "",
        "| model | graph nodes | built-in step (s) | exported step (s) | exported / built-in | median | within target | overhead per node |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        median = r.get("median_ratio", statistics.median(r["ratio"]))
        md.append(
            f"| {r['model']} ({r['flags']}) | {r['graph_nodes']:,} | "
            + ", ".join(f"{s:.4g}" for s in r["builtin_step_seconds"]) + " | "
            + ", ".join(f"{s:.4g}" for s in r["exported_step_seconds"]) + " | "
            + ", ".join(f"{x:.3f}x" for x in r["ratio"]) + f" | {median:.3f}x | "
            + ("yes" if median <= TARGET else "**no**") + f" | {r['overhead_per_node_seconds'] * 1e6:+.1f} µs |"
        )
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        with open(os.path.join(sys.argv[2], "speed.json")) as f:
            write(sys.argv[2], "speed.md", render(json.load(f)))
    else:
        main(sys.argv[1], sys.argv[2])
