"""Writes results/export/README.md from the JSON that scripts/results_export wrote: per model,
the candidates, the sweep's peak range and its largest prediction error, and every verified
plan. Every number comes from those files.

    .venv/bin/python scripts/export_table.py results/export > results/export/README.md
"""
import glob
import json
import os
import sys

NAMES = {"vit": "ViT", "llama": "Llama-style decoder", "cnn": "depthwise/dense CNN"}


def load(path):
    with open(path) as f:
        return json.load(f)


def main(out):
    rows, plans = [], []
    cpu = ""
    for m in ("vit", "llama", "cnn"):
        d = os.path.join(out, m)
        profile = load(os.path.join(d, "profile.json"))
        sweep = load(os.path.join(d, "sweep.json"))
        cpu = cpu or profile["device"].get("cpu", "")
        cands = [b["name"] for b in profile["model"]["blocks"] if b["candidate"]]
        points = [p for c in sweep["configs"] for p in c["points"]]
        peaks = [p["peak_bytes"] for p in points]
        err = max(abs(p["peak_bytes"] - p["predicted_peak_bytes"]) for p in points)
        rows.append(
            f"| {NAMES[m]} | {len(cands)}: {', '.join(f'`{c}`' for c in cands)} | {len(points)} | "
            f"{min(peaks):,} – {max(peaks):,} | {err:,} B |"
        )
        for vf in sorted(glob.glob(os.path.join(d, "plans", "verify-*.json")), key=lambda p: int(p.split("-")[-1][:-5])):
            v = load(vf)
            mods = ", ".join(f"`{x}`" for x in v["modules"]) or "(nothing)"
            plans.append(
                f"| {NAMES[m]} | {v['budget_bytes']:,} | {mods} | {v['predicted']['peak_bytes']:,} | "
                f"{v['measured']['peak_bytes']:,} | {v['peak_error_bytes']:,} B | "
                f"{'yes' if v['within_budget'] else 'NO'} | {v['predicted']['step_seconds']:.3f} s | "
                f"{v['measured']['step_seconds']['median']:.3f} s |"
            )
    print(f"""# torch.export programs: ViT, Llama-style decoder, depthwise/dense CNN

Written by `scripts/results_export` (this table by `scripts/export_table.py` from the JSON beside
it). `make_examples.py` writes three small models from plain-torch references (no torchvision or
transformers): a ViT with torchvision's `VisionTransformer` module names (4 encoder layers,
32-pixel images, 8-pixel patches), a decoder with Hugging Face `LlamaForCausalLM`'s names
(4 layers, RMSNorm, rotary embeddings computed inside each attention, SDPA, SiLU-gated MLP) on
32 tokens, and a CNN with MobileNetV2-style depthwise stages and a DenseNet-style dense block
(`torch.cat` growth). Each is exported in training mode with a dynamic batch, as the README
tells users to, and planned at `--granularity layer` (batch 4, fp32, AdamW, one thread) on
{cpu or "the machine that ran the script"}.

Every checkpoint subset of the layers, measured against the profile's prediction:

| model | candidates | subsets | peak range (bytes) | largest error |
|---|---|---|---|---|
""" + "\n".join(rows) + """

Plans under budgets that force checkpointing, each run by `ckptune verify`:

| model | budget (bytes) | checkpointed | predicted peak | measured peak | error | fits | predicted step | measured step |
|---|---|---|---|---|---|---|---|---|
""" + "\n".join(plans) + """

Per model: `profile.json`/`.txt`, `sweep.json`/`.txt`, `plots/` (trade-off and per-candidate
charts) and `plans/` (each plan and its verification) are the commands' outputs.
[`speed.md`](speed.md) (`scripts/bench_export.py`) times exported ResNet-50 and BERT-base
against the built-in models. The layers' children (`--granularity block` or `nested`) are
covered by the tests on the fixtures of `models/fixtures/` (`planner/tests/export_cli.rs`,
`runtime/tests/export.rs`), transformers' own `LlamaForCausalLM` among them.""")


if __name__ == "__main__":
    main(sys.argv[1])
