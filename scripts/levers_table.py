"""Writes results/levers/README.md and peaks.svg from the plans and verifications that
scripts/results_levers wrote beside them; nothing in either is typed by hand.

    levers_table.py DIR
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bert_differences  # noqa: E402

MODELS = [
    ("bert-base", "BERT-base (`bert-base-uncased`), sequence 128, micro-batch 2"),
    ("bert-base-sgd", "BERT-base (`bert-base-uncased`), sequence 512, micro-batch 2, SGD with momentum"),
    ("smollm2-135m", "SmolLM2-135M's architecture (`configs/smollm2-135m/config.json`, random weights), "
                     "sequence 256, micro-batch 2"),
]
BUDGETS = {"same": "whole-module's smallest peak", "min": "the lever's smallest peak",
           "mid": "halfway to nothing checkpointed"}
LEVERS = ["whole", "selective-matmul", "selective-attention", "loss-chunks", "in-backward"]
COLOURS = {"whole": "#444444", "selective-matmul": "#1f77b4", "selective-attention": "#17becf",
           "loss-chunks": "#ff7f0e", "in-backward": "#2ca02c"}


def gib(b):
    return b / 2**30


def choice(plan):
    """What the plan chose besides the checkpoint set: the config's levers and the modules."""
    c = plan["config"]
    parts = []
    if c.get("loss_chunks", 1) > 1:
        parts.append(f"loss in {c['loss_chunks']} chunks")
    if c.get("optimizer_step", "after") != "after":
        parts.append(f"optimizer step {c['optimizer_step']}")
    ck = plan["checkpoint"]
    # One policy's selective modules are one object, a plan mixing policies lists one per policy.
    sel = ck.get("selective") or []
    groups = sel if isinstance(sel, list) else [sel]
    selective = {m for g in groups for m in g["modules"]}
    whole = [m for m in ck["modules"] if m not in selective]
    if whole:
        parts.append(f"{len(whole)} checkpointed whole")
    parts.extend(f"{len(g['modules'])} selective ({g['policy']})" for g in groups if g["modules"])
    return ", ".join(parts) or "nothing"


def rows(d, model):
    out = []
    for lever in LEVERS:
        for at in ["same", "min", "mid"]:
            plan_f = d / model / f"{lever}-{at}.json"
            if not plan_f.exists():
                continue
            plan = json.loads(plan_f.read_text())
            row = {"lever": lever, "at": at, "plan": plan, "verify": None}
            v = d / model / f"verify-{lever}-{at}.json"
            if v.exists():
                row["verify"] = json.loads(v.read_text())
            out.append(row)
    return out


def table(rs, bert):
    """One row per plan; a BERT model's rows itemize PyTorch − predicted (mask, bias gradient,
    left)."""
    head = ("| lever | budget | chosen | predicted peak (B) | at | predicted step (s) | ckptune run (B) | "
            "PyTorch eager (B) | PyTorch − predicted |")
    lines = [head + (" mask | bias gradient | left |" if bert else ""), "|---" * (9 + 3 * bert) + "|"]
    for r in rs:
        p = r["plan"]
        budget = BUDGETS[r["at"]]
        v = r["verify"]
        items = ["", "", ""]
        if v and "pytorch" in v:
            run = f"{v['ckptune']['measured']['peak_bytes']:,}"
            torch = f"{v['pytorch']['peak_bytes']:,}"
            err = f"{v['pytorch_peak_error_bytes']:+,}"
            if bert:
                mask, bias = bert_differences.of_plan(p, p["predicted"].get("peak_moment", ""))
                items = [f"{mask:+,}", f"{bias:+,}", f"{v['pytorch_peak_error_bytes'] - mask - bias:+,}"]
        elif v:
            # `verify` alone (a run made without --pytorch).
            run = f"{v['measured']['peak_bytes']:,}"
            torch = err = "not run"
        else:
            run = torch = err = "not verified"
        lines.append(f"| {r['lever']} | {budget} | {choice(p)} | {p['predicted']['peak_bytes']:,} | "
                     f"{p['predicted'].get('peak_moment', '')} | {p['predicted']['step_seconds']:.3f} | "
                     f"{run} | {torch} | {err} |" + ("".join(f" {x} |" for x in items) if bert else ""))
    return lines


def svg(panels):
    w, h, pad = 420, 300, 52
    out = []
    for k, (title, rs) in enumerate(panels):
        x0 = k * (w + 20)
        pts = [(r["plan"]["predicted"]["step_seconds"], gib(r["plan"]["predicted"]["peak_bytes"]), r["lever"])
               for r in rs]
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        xl, xh = min(xs) * 0.95, max(xs) * 1.05
        yl, yh = min(ys) * 0.95, max(ys) * 1.05

        def px(x):
            return x0 + pad + (x - xl) / (xh - xl or 1) * (w - pad - 10)

        def py(y):
            return h - pad + 10 - (y - yl) / (yh - yl or 1) * (h - pad - 30)

        out.append(f'<text x="{x0 + w / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>')
        out.append(f'<line x1="{x0 + pad}" y1="{h - pad + 10}" x2="{x0 + w - 10}" y2="{h - pad + 10}" stroke="black"/>')
        out.append(f'<line x1="{x0 + pad}" y1="24" x2="{x0 + pad}" y2="{h - pad + 10}" stroke="black"/>')
        for t in range(5):
            xv = xl + (xh - xl) * t / 4
            yv = yl + (yh - yl) * t / 4
            out.append(f'<text x="{px(xv):.1f}" y="{h - pad + 26}" text-anchor="middle" font-size="10">{xv:.2f}</text>')
            out.append(f'<text x="{x0 + pad - 4}" y="{py(yv) + 3:.1f}" text-anchor="end" font-size="10">{yv:.2f}</text>')
        out.append(f'<text x="{x0 + w / 2}" y="{h - 8}" text-anchor="middle" font-size="11">predicted step (s)</text>')
        out.append(f'<text x="{x0 + 12}" y="{h / 2}" font-size="11" transform="rotate(-90 {x0 + 12} {h / 2})" '
                   'text-anchor="middle">predicted peak (GiB)</text>')
        # Levers often land on the same point (the same choice): each is drawn a size smaller than
        # the one before, whole-module checkpointing largest and first, so every one shows.
        for x, y, lever in sorted(pts, key=lambda p: LEVERS.index(p[2])):
            r = 4 + 2.5 * (len(LEVERS) - 1 - LEVERS.index(lever))
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{r}" fill="{COLOURS[lever]}">'
                       f'<title>{lever}: {y:.3f} GiB, {x:.3f} s</title></circle>')
    legend = [f'<rect x="{10 + i * 150}" y="{h + 8}" width="10" height="10" fill="{COLOURS[l]}"/>'
              f'<text x="{24 + i * 150}" y="{h + 17}" font-size="11">{l}</text>' for i, l in enumerate(LEVERS)]
    width = len(panels) * (w + 20)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h + 30}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(out + legend) + "\n</svg>\n")


def main():
    d = Path(sys.argv[1])
    doc = [
        "# Each lever against whole-module checkpointing",
        "",
        "Written by `scripts/results_levers` (this file and `peaks.svg` by `scripts/levers_table.py` "
        "from the JSON beside them); each section names its config and the machine that planned and "
        "verified it. Per model, per lever, one plan under the budget whole-module "
        "checkpointing reaches at best (its smallest peak, `whole-min.json`), one under the "
        "lever's own smallest peak (the least any of its configs reaches, which `plan` names when no "
        "config fits a budget of one byte) and, in sections made since the script had it, one halfway "
        "between whole-module checkpointing's smallest peak and the peak with nothing checkpointed "
        "(where each layer's choice among keep, selective and full decides); `whole` is whole-module checkpointing alone, "
        "each other lever adds one choice to it: selective checkpointing per layer (`--selective "
        "matmul`, `--selective attention`), the loss in chunks (`--loss-chunks 1,4`, a language "
        "model's head only), the optimizer step in backward (`--optimizer-step after,in-backward`). "
        "Each plan verified (`verify-*.json`): ckptune's run, and PyTorch eager running the same plan "
        "under the same counting allocator (`verify --pytorch`, on the built-in model's reference or on "
        "the reference Llama built from the config.json); a row whose PyTorch columns read \"not run\" "
        "was verified by ckptune's run alone. On BERT-base every byte of PyTorch − predicted is itemized: "
        "*mask* is BERT's two attention masks, which ckptune holds through the micro-step and PyTorch frees "
        "after the forward unless a checkpointed layer saved them (the SDPA bool mask, batch × seq² bytes, "
        "and the additive mask, batch × seq × 4 bytes); *bias gradient* is one Linear's (hidden × 4 bytes), "
        "which PyTorch allocates after `torch.utils.checkpoint` freed the recomputed input where the peak "
        "is a checkpointed or selective layer's backward (docs/memory-model.md, \"Where exactness needs "
        "care\"); both from the predicted peak's moment by `scripts/bert_differences.py`; *left* is what "
        "neither explains. Where PyTorch peaks 4,096 B below on SmolLM2 (every layer checkpointed, the "
        "step in backward, peaking at the loss), the difference is the additive causal bias and `position_ids`, "
        "which ckptune's chain holds as inputs shared by the layers and the reference does not keep "
        "(`a_tied_llama_peaking_at_its_loss_is_not_under_predicted` asserts it). Step times are one run's on a 2-core machine, measured "
        "for the configs that can win (the plan's text says which were estimated); bytes are exact on "
        "any load. Each lever's plan is solved over its own profile, timed in its own run, so the same "
        "choice can carry a different step time from one lever's rows to another's; the bytes compare "
        "exactly, the times within what separate runs on a shared machine differ by.",
        "",
        "![predicted peak against predicted step, per lever](peaks.svg)",
        "",
    ]
    panels = []
    for model, title in MODELS:
        rs = rows(d, model)
        if not rs:
            continue
        panels.append((model, rs))
        p = rs[0]["plan"]
        machine = (f"{p['config']['precision']}, {p['config']['optimizer']}; planned and verified on "
                   f"{p['device'].get('cpu', p['device']['device'])}, {p['device'].get('threads', '?')} threads.")
        doc += [f"## {title}", "", machine, "", *table(rs, model.startswith("bert")), ""]
    (d / "peaks.svg").write_text(svg(panels))
    tmp = d / "README.md.tmp"
    tmp.write_text("\n".join(doc))
    tmp.rename(d / "README.md")


if __name__ == "__main__":
    main()
