"""Writes results/export-corpus/README.md from the corpus.json that scripts/export_corpus_run.py
wrote: a summary, the failures grouped by what their error says, and one row per model. Every
number comes from that file.

    .venv/bin/python scripts/export_corpus_table.py results/export-corpus > results/export-corpus/README.md
"""

import collections
import json
import os
import re
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def params(n):
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def short_reason(record):
    """The error line without the parts every line repeats (`error: loading model X.pt2: ...`)."""
    text = record["reason"]
    name = re.escape(record["name"])
    path = rf"(\S*/)?{name}\.pt2"
    for prefix in (r"error: ", r"panicked at ", rf"loading model {path}: ",
                   rf"(cannot run )?torch\.export program {path}: "):
        text = re.sub("^" + prefix, "", text)
    return text


def block_of(record):
    """The block or node an error line names (`block pooler (nodes ...)`, `node relu_ (...)`)."""
    m = re.search(r"block (\S+)( \(nodes|:)", record["reason"])
    return m[1] if m else ""


# What the error lines say, most specific first: (pattern, group name built from the match).
GROUPS = [
    (r"block <sym_size\S*> \(nodes .*hands 0 tensors",
     lambda m: "a block of only a symbolic size (`sym_size`, read by later blocks) hands 0 tensors to later nodes"),
    (r"hands 0 tensors to later nodes",
     lambda m: "a block whose result no later node and no output reads hands 0 tensors to later nodes"),
    (r"hands (\d+) tensors? to later nodes", lambda m: f"a block hands {m[1]} tensors to later nodes"),
    (r"writes the model's input", lambda m: "a later block writes the program's input in place"),
    (r"dispatcher has no such operator", lambda m: "an operator libtorch's dispatcher lacks (custom op)"),
    (r"input of sizes .* is not supported", lambda m: "input shape not supported"),
    (r"tensor inputs", lambda m: "more tensor inputs than ckptune feeds"),
    (r"GuardOnDataDependentSymNode", lambda m: "torch.export: data-dependent control flow"),
]


def group_of(record):
    """The failure group of a record that did not verify to the byte."""
    if record["outcome"] == "verified, off":
        return "verified, prediction off by some bytes"
    if record["outcome"] == "timed out":
        return f"timed out ({record['stage']})"
    reason = short_reason(record)
    for pattern, name in GROUPS:
        m = re.search(pattern, reason)
        if m:
            return name(m)
    m = re.search(r"node \S+ \((\S+)\): (.*)", reason)
    if record["outcome"] == "panicked" and m:
        # The operator and the message; the block and node names go to the table's blocks column.
        return f"panic in `{m[1]}`: {m[2]}"
    return re.sub(r"\d+", "N", reason)


def planned(record):
    if "checkpointed" not in record:
        return "no"
    text = f"{len(record['checkpointed'])} of {len(record['candidates'])} candidates"
    if record["peak_all"] >= record["peak_none"]:
        text += " (checkpointing cannot lower the peak)"
    return text


def result(record):
    o = record["outcome"]
    if o.startswith("verified"):
        return "verified" if o == "verified" else f"peak {record['measured_peak'] - record['predicted_peak']:+,} B"
    code = "" if record["exit"] is None else f", exit {record['exit']}"
    # `<sym_size_int_1>` would render as an HTML tag, `|` would end the cell.
    reason = short_reason(record).replace("<", "&lt;").replace("|", "\\|")
    return f"{o} at {record['stage']}{code}: {reason}"


def row(i, r):
    inp = r.get("input") or {}
    shapes = " ".join("×".join(str(d) for d in t["shape"]) for t in inp.get("tensors", []))
    err = f"{r['error_bytes']:,}" if "error_bytes" in r else ""
    return (f"| {i} | `{r['name']}` | {r['source']} | {r['kind']} | {params(r.get('params') or 0)} | "
            f"{inp.get('kind', '')} {shapes} | {'yes' if r['exported'] else 'no'} | {planned(r)} | {err} | "
            f"{result(r)} |")


def summary(models):
    count = collections.Counter(r["outcome"] for r in models)
    n = len(models)
    exported = sum(r["exported"] for r in models)
    planned_n = sum("checkpointed" in r for r in models)
    exact = count["verified"]
    checkpointing = sum(r["outcome"] == "verified" and bool(r["checkpointed"]) for r in models)
    on_meta = sum(r["outcome"] == "verified" and r.get("memory_measured", "").startswith("memory on the meta device")
                  for r in models)
    return (f"{n} models: {exported} exported, {planned_n} planned, **{exact} planned and verified to the byte "
            f"({100 * exact / n:.0f}%)**, {checkpointing} of them with a plan that checkpoints something, "
            f"{on_meta} of them with their memory measured on the meta device (the profile's "
            f"`device.measured`: the plan's prediction from the meta device, the verified peak from a real step), "
            f"{count['verified, off']} verified with a peak error, "
            f"{count['refused']} refused with exit 2, {count['panicked']} panics, {count['failed']} other "
            f"failures (exit 1), {count['timed out']} timeouts, {count['export failed']} export failures.")


def reproduce(record):
    """The failing command, run in the scratch folder (the export's, for an export)."""
    if record["stage"] == "export":
        return f"`scripts/export_corpus --only {record['name']}`"
    return "`ckptune " + " ".join(record["steps"][record["stage"]]["command"]) + "`"


def taxonomy(models):
    groups = collections.defaultdict(list)
    for r in models:
        if r["outcome"] != "verified":
            groups[group_of(r)].append(r)
    lines = ["| what the error says | models | blocks named | outcome | to reproduce (first model) |",
             "|---|---|---|---|---|"]
    for name, rs in sorted(groups.items(), key=lambda g: (-len(g[1]), g[0])):
        outcomes = ", ".join(f"{k} {v}" for k, v in collections.Counter(
            f"{r['outcome']} ({r['stage']}{'' if r['exit'] is None else ', exit ' + str(r['exit'])})"
            for r in rs).items())
        names = ", ".join(f"`{r['name']}`" for r in rs)
        blocks = ", ".join(f"`{b}`" for b in dict.fromkeys(block_of(r) for r in rs) if b)
        lines.append(f"| {name.replace('|', '/')} | {len(rs)}: {names} | {blocks} | {outcomes} | "
                     f"{reproduce(rs[0])} |")
    return "\n".join(lines) if groups else "Every model planned and verified to the byte."


def no_gain(models):
    """The planned models whose smallest achievable peak is not below the peak with nothing
    checkpointed: which candidates the layer rule found, and where the step peaks."""
    rows = [f"| `{r['name']}` | {len(r['candidates'])}: {', '.join(f'`{c}`' for c in r['candidates'][:4])}"
            f"{', …' if len(r['candidates']) > 4 else ''} | {r['peak_all'] - r['peak_none']:+,} | {r['peak_moment']} |"
            for r in models if "peak_moment" in r and r["peak_all"] >= r["peak_none"]]
    if not rows:
        return "Every planned model has a budget that makes its plan checkpoint something."
    return "\n".join(["| model | candidates | peak all − peak none (B) | verified peak moment |",
                      "|---|---|---|---|", *rows])


def command_minutes(models):
    """Minutes the corpus's ckptune commands took, from their recorded seconds."""
    return sum(s["seconds"] for r in models for s in r.get("steps", {}).values()) / 60


def main(out):
    corpus = load(os.path.join(out, "corpus.json"))
    models = corpus["models"]
    rows = "\n".join(row(i, r) for i, r in enumerate(models, 1))
    common = " ".join(corpus["common_args"])
    precision = corpus["common_args"][corpus["common_args"].index("--precision") + 1]
    title, flag = ("", "") if precision == "fp32" else (" under bf16 autocast", f" --precision {precision}")
    print(f"""# The export corpus{title}: real architectures through `torch.export` and ckptune

Written by `scripts/export_corpus` (this file by `scripts/export_corpus_table.py` from
[`corpus.json`](corpus.json) beside it); nothing here is typed by hand.

- **Models**: `scripts/export_corpus.py` builds every torchvision classification model in its
  default configuration (10 classes) at the image size it trains at (the five above 150M
  parameters at a quarter width, same depth), and transformers models of every kind in tiny
  configurations (hidden 32-64, 4 layers, 128 tokens), all with random weights, and exports each in
  training mode with a dynamic batch, as the README tells users to.
- **Versions**: torch {corpus['torch']}, torchvision {corpus['torchvision']}, transformers
  {corpus['transformers']}; {corpus['ckptune']}.
- **Steps**: `profile` (`{common}`, candidates at the default `--granularity layer`), then
  `plan --verify` under a budget {corpus['budget_fraction']:.0%} of the way from the smallest
  achievable peak to the peak with nothing checkpointed (so that the plan has to checkpoint
  something wherever checkpointing can lower the peak), then `verify` of the written plan.
- **Machine**: {corpus['cpu']}, {corpus['cores']} cores. Peaks are exact CPU tensor bytes, so the
  verified errors do not depend on the machine; the seconds in corpus.json do.

{summary(models)}

## What stops the others

{taxonomy(models)}

## Planned, but checkpointing cannot lower the peak

{no_gain(models)}

## Every model

"planned": the candidates the plan checkpoints, and whether the profile's smallest achievable
peak (everything checkpointed) is not below the peak with nothing checkpointed, so that no budget
makes the plan checkpoint anything; "verified error": measured minus predicted peak of
`ckptune verify` on the written plan.

| # | model | source | kind | params | input | exported | planned | verified error (B) | result |
|---|---|---|---|---|---|---|---|---|---|
{rows}

## Regenerating

`scripts/export_corpus{flag}` exports every model again and runs them all: the ckptune commands
above took {command_minutes(models):.0f} minutes on the machine above, the export comes on top
(`CKPTUNE_BIN` picks the binary, `CKPTUNE_CORPUS_WORK` the scratch folder, default
`~/.cache/ckptune/export-corpus`, in which the commands above run); `scripts/export_corpus{flag}
--only NAME...` re-runs some and keeps the other records. The programs lie in the scratch folder's
`programs/` with the exporter's `manifest.json`; each model's profile, plan, verify report and the
commands' output in `runs{'-' + precision if flag else ''}/NAME/`.""")


if __name__ == "__main__":
    main(sys.argv[1])
