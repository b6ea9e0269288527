"""Writes README.md and peaks.svg of a results/fsdp/<cpu>/ directory from what
scripts/results_fsdp left in it: `<name>-n<N>.plan.json` and `.verify.json` for each plan that
fits, `<name>-n<N>.nofit.txt` (the plan's own message) where nothing fits. Every number comes
from those files.

Usage: fsdp_table.py DIR COMMAND (COMMAND: how DIR was made, for the README)
"""

import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bert_differences  # noqa: E402

MIB = 1024 * 1024
MODELS = (("resnet50", "ResNet-50"), ("bert-base", "BERT-base"))


def size(b):
    return f"{b / MIB:.2f} MiB"


def load(d):
    rows = {}
    for path in sorted(glob.glob(os.path.join(d, "*-n*.plan.json"))) + sorted(glob.glob(os.path.join(d, "*.nofit.txt"))):
        m = re.match(r"(.+)-n(\d+)\.(plan\.json|nofit\.txt)$", os.path.basename(path))
        name, n, kind = m.group(1), int(m.group(2)), m.group(3)
        base = os.path.join(d, f"{name}-n{n}")
        if kind == "nofit.txt":
            text = open(path).read()
            smallest = re.search(r"smallest achievable peak is .*? \((\d+) bytes\)", text)
            budget = re.search(r"fits the budget ([^:]+):", text)
            rows[(name, n)] = {"fits": False, "smallest": int(smallest.group(1)), "budget": budget.group(1),
                               "message": text.strip()}
            continue
        plan = json.load(open(base + ".plan.json"))
        verify = json.load(open(base + ".verify.json"))
        shard = plan["shard"]
        chosen = [a for a in plan["alternatives"]
                  if a["config"] == plan["config"] and a.get("reshard_after_forward") == shard["reshard_after_forward"]]
        rows[(name, n)] = {"fits": True, "plan": plan, "verify": verify, "baseline": chosen[0]["baseline_peak_bytes"]}
    return rows


def table(rows):
    out = ["| model | ranks | budget per rank | config | reshard_after_forward | checkpointed | "
           "peak, nothing checkpointed (predicted) | peak per rank, predicted | peak per rank, measured | "
           "error per rank | within budget |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, title in MODELS:
        for n in (1, 2, 4):
            r = rows.get((name, n))
            if r is None:
                continue
            if not r["fits"]:
                out.append(f"| {title} | {n} | {r['budget']} | — | — | — | — | nothing fits: smallest "
                           f"{size(r['smallest'])} | — | — | no |")
                continue
            p, v = r["plan"], r["verify"]
            c = p["config"]
            ranks = v["per_rank"]
            out.append("| {} | {} | {} | {} / {} / micro-batch {} | {} | {} | {} | {} | {} | {} | {} |".format(
                title, n, size(p["budget_bytes"]), c["precision"], c["optimizer"], c["micro_batch"],
                p["shard"]["reshard_after_forward"],
                ", ".join(p["checkpoint"]["modules"]) or "(nothing)",
                size(r["baseline"]),
                ", ".join(f"{k['predicted_peak_bytes']:,}" for k in ranks),
                ", ".join(f"{k['measured_peak_bytes']:,}" for k in ranks),
                ", ".join(f"{k['error_bytes']:+,} B" for k in ranks),
                "yes" if v["within_budget"] else "no"))
    return out


def itemized(rows):
    """Per BERT rank: measured − predicted, what BERT's known eager differences account for at
    the rank's predicted peak (scripts/bert_differences.py) and what is left."""
    out = ["| model | ranks | rank | peak at (predicted) | measured − predicted | mask | bias gradient | left |",
           "|---|---|---|---|---|---|---|---|"]
    for name, title in MODELS:
        for n in (1, 2, 4):
            r = rows.get((name, n))
            if r is None or not r["fits"] or "bert" not in name:
                continue
            for k in r["verify"]["per_rank"]:
                moment = k["predicted_peak_moment"]
                mask, bias = bert_differences.of_plan(r["plan"], moment)
                err = k["error_bytes"]
                out.append(f"| {title} | {n} | {k['rank']} | {moment} | {err:+,} B | {mask:+,} B | {bias:+,} B | "
                           f"{err - mask - bias:+,} B |")
    return out


def svg(rows):
    """Peak per rank against N, one panel per model: the plan's predicted and measured peaks
    (every rank), the predicted peak with nothing checkpointed, the budget."""
    w, h, pad_l, pad_r, pad_t, pad_b = 420, 300, 70, 20, 40, 50
    panels = []
    for i, (name, title) in enumerate(MODELS):
        pts = {n: rows[(name, n)] for n in (1, 2, 4) if (name, n) in rows}
        if not pts:
            continue
        values = []
        budget = None
        for r in pts.values():
            if r["fits"]:
                values += [r["baseline"]] + [k["measured_peak_bytes"] for k in r["verify"]["per_rank"]]
                budget = r["plan"]["budget_bytes"]
            else:
                values.append(r["smallest"])
        if budget is not None:
            values.append(budget)
        lo, hi = 0, max(values) * 1.1
        x0 = i * w

        def px(n):
            return x0 + pad_l + {1: 0.1, 2: 0.5, 4: 0.9}[n] * (w - pad_l - pad_r)

        def py(b):
            return pad_t + (1 - (b - lo) / (hi - lo)) * (h - pad_t - pad_b)

        g = [f'<text x="{x0 + w / 2}" y="22" text-anchor="middle" font-size="14">{title}: peak per rank</text>',
             f'<line x1="{x0 + pad_l}" y1="{py(lo)}" x2="{x0 + w - pad_r}" y2="{py(lo)}" stroke="black"/>',
             f'<line x1="{x0 + pad_l}" y1="{pad_t}" x2="{x0 + pad_l}" y2="{py(lo)}" stroke="black"/>',
             f'<text x="{x0 + w / 2 + 20}" y="{h - 12}" text-anchor="middle" font-size="12">ranks (N)</text>']
        step = next(s for s in (10, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000) if hi / MIB / s <= 8)
        for t in range(0, int(hi / MIB) + 1, step):
            y = py(t * MIB)
            g.append(f'<line x1="{x0 + pad_l - 4}" y1="{y:.1f}" x2="{x0 + pad_l}" y2="{y:.1f}" stroke="black"/>')
            g.append(f'<text x="{x0 + pad_l - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{t} MiB</text>')
        for n in pts:
            g.append(f'<text x="{px(n):.1f}" y="{py(lo) + 16:.1f}" text-anchor="middle" font-size="11">{n}</text>')
        if budget is not None:
            g.append(f'<line x1="{x0 + pad_l}" y1="{py(budget):.1f}" x2="{x0 + w - pad_r}" y2="{py(budget):.1f}" '
                     f'stroke="#c00" stroke-dasharray="5,4"/>')
            g.append(f'<text x="{x0 + w - pad_r}" y="{py(budget) - 4:.1f}" text-anchor="end" font-size="10" '
                     f'fill="#c00">budget {size(budget)}</text>')
        fits = [n for n, r in pts.items() if r["fits"]]
        for key, colour, dash in (("baseline", "#888", "3,3"), ("predicted", "#1f77b4", "")):
            coords = [(px(n), py(pts[n]["baseline"] if key == "baseline"
                                 else max(k["predicted_peak_bytes"] for k in pts[n]["verify"]["per_rank"])))
                      for n in fits]
            if len(coords) > 1:
                d = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
                g.append(f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="2" '
                         f'stroke-dasharray="{dash}"/>')
            for x, y in coords:
                g.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')
        for n in fits:
            for k in pts[n]["verify"]["per_rank"]:
                g.append(f'<circle cx="{px(n):.1f}" cy="{py(k["measured_peak_bytes"]):.1f}" r="6" fill="none" '
                         f'stroke="#2ca02c" stroke-width="1.5"/>')
        for n, r in pts.items():
            if not r["fits"]:
                x, y = px(n), py(r["smallest"])
                g.append(f'<path d="M{x - 5:.1f},{y - 5:.1f} L{x + 5:.1f},{y + 5:.1f} M{x - 5:.1f},{y + 5:.1f} '
                         f'L{x + 5:.1f},{y - 5:.1f}" stroke="#c00" stroke-width="2"/>')
        panels += g
    legend = [("#888", "nothing checkpointed (predicted)"), ("#1f77b4", "the plan, predicted (highest rank)"),
              ("#2ca02c", "the plan, measured (each rank, ring)"), ("#c00", "budget; × smallest peak, no fit")]
    width = w * len(MODELS)
    for j, (colour, label) in enumerate(legend):
        x = 20 + j * (width - 20) / len(legend)
        panels.append(f'<rect x="{x:.1f}" y="{h + 4}" width="10" height="10" fill="{colour}"/>')
        panels.append(f'<text x="{x + 14:.1f}" y="{h + 13}" font-size="10">{label}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h + 24}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(panels) + "\n</svg>\n")


def main():
    d, command = sys.argv[1], sys.argv[2]
    rows = load(d)
    fitting = [r for r in rows.values() if r["fits"]]
    cpu = fitting[0]["plan"]["device"].get("cpu", "") if fitting else ""
    torch = fitting[0]["verify"]["fsdp"]["torch"] if fitting else ""
    lines = ["# Plans for PyTorch FSDP2, verified on real ranks", "",
             f"Regenerated by `{command}` (this file and peaks.svg by `scripts/fsdp_table.py`); nothing here is "
             "typed by hand.", "",
             "Each row is `ckptune plan --shard N` under one per-rank budget (fp32, AdamW, one thread per rank; "
             "ResNet-50 at 224 px, micro-batch 8 per rank; BERT-base at sequence 128, micro-batch 4 per rank), and "
             "`ckptune verify --pytorch` of the plan: N CPU processes over gloo on 127.0.0.1, each wrapping the "
             "plan's units (every `layerK` / `encoder.layer.K`) and the root with `fully_shard`, checkpointing the "
             "plan's modules, each rank's peak from ckptune's counting allocator (the highest of the timed steps). "
             "Peaks in bytes; an error is measured minus predicted. How the per-rank model is built, what it "
             "leaves out, and what each difference below is (BERT's attention mask, and a checkpointed layer's "
             "backward): [docs/fsdp.md](../../../docs/fsdp.md), section 11.", "",
             f"Machine: {cpu}. PyTorch {torch}.", ""]
    lines += table(rows)
    lines += ["", "Every byte of BERT-base's errors, rank by rank: *mask* is BERT's attention masks, which "
              "ckptune holds from before the first layer to the end of the micro-step's backward (the "
              "additive one, and under SDPA, the default, the `[batch, 1, seq, seq]` bool one) and PyTorch "
              "from `BertModel.forward` until that forward returns, or until the backward of the lowest "
              "checkpointed layer that keeps it as an input; *bias gradient* is the one PyTorch allocates "
              "below the prediction where the peak is a checkpointed layer's backward (docs/fsdp.md, "
              "section 11). Both are computed from the rank's predicted peak moment by "
              "`scripts/bert_differences.py`; *left* is what neither explains.", ""]
    lines += itemized(rows)
    nofit = [(k, r) for k, r in sorted(rows.items()) if not r["fits"]]
    if nofit:
        lines += ["", "Where nothing fits, the plan's message:", ""]
        lines += [f"- {name}, {n} rank(s): {r['message'].removeprefix('error: ')}" for (name, n), r in nofit]
    lines += ["", "![peak per rank against the number of ranks](peaks.svg)", ""]
    with open(os.path.join(d, "README.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(d, "peaks.svg"), "w") as f:
        f.write(svg(rows))


if __name__ == "__main__":
    main()
