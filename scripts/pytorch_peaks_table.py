"""results/pytorch-peaks/README.md from peaks.json (written by scripts/pytorch_peaks.py)."""

import json
import sys


def b(n):
    return f"{n:,}"


def signed(n):
    return f"{n:+,}"


def _shape(text):
    """(batch, seq) from a model's shape arguments (`--batch 8 --seq 128`)."""
    args = text.split()
    return args[args.index("--batch") + 1], args[args.index("--seq") + 1]


def _layer(name):
    """N of `encoder.layer.N` (or None)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) >= 3 and parts[:2] == ["encoder", "layer"] else None


def _attention(r):
    """The attention the row's PyTorch run used: rows made before the choice existed ran eager."""
    return r.get("attention", "eager")


def _mask_bytes(doc, r):
    """What BERT's attention mask contributes to PyTorch − predicted at the predicted peak's
    moment. ckptune holds its additive mask (batch × seq f32) from before the first block to the
    micro-step's end, and under SDPA also the `[batch, 1, seq, seq]` bool mask, a shared input
    made beside it once per micro-batch as `BertModel.forward` makes it once (none when nothing
    is padded; the benchmark's batches pad every other sequence). The reference holds, under
    eager attention, the same additive mask, and under SDPA the bool mask `sdpa_mask` builds
    after the embeddings, each from where `BertModel.forward` builds it until that forward
    returns, or until the backward of the lowest checkpointed encoder layer, which keeps it as
    an input."""
    batch, seq = (int(x) for x in _shape(doc["shapes"][r["model"]]))
    additive = batch * seq * 4
    ckptune, pytorch = _mask_holders(r)
    if _attention(r) == "sdpa":
        bool_mask = batch * seq * seq if batch > 1 and seq // 4 > 0 else 0
        return (bool_mask if pytorch else 0) - (bool_mask + additive if ckptune else 0)
    return (additive if pytorch else 0) - (additive if ckptune else 0)


def _mask_holders(r):
    """(ckptune holds its mask, the reference holds its mask) at the predicted peak's moment.
    Forward moments: both, except the embeddings' under SDPA (the reference builds its mask after
    them). The optimizer step: neither. Loss, backward and recompute moments: ckptune; the
    reference while a checkpointed encoder layer at or below the moment's layer has not finished
    its backward."""
    moment = r["predicted_moment"]
    if moment == "optimizer step":
        return False, False
    ckpt = [n for n in (_layer(m) for m in r["modules"]) if n is not None]
    if ": forward " in moment:
        return True, not (moment.endswith(" embeddings") and _attention(r) == "sdpa")
    if moment.endswith(": loss") or moment.endswith(": loss backward"):
        return True, bool(ckpt)
    where = moment.split(": ")[-1].split(" ", 1)[-1]
    k = _layer(where)
    if where == "pooler":
        return True, bool(ckpt)
    if k is None:  # the embeddings, after every encoder layer's backward
        return True, False
    return True, any(j <= k for j in ckpt)


def _scalar_bytes(r):
    """The 8-byte wrapped numbers PyTorch keeps per checkpointed layer: eager attention divides
    its scores by a Python float; SDPA takes the scale as an argument and saves no tensor."""
    return 8 * _checkpointed_layers_before_backward(r) if _attention(r) == "eager" else 0


# Hidden sizes of the BERT configs the benchmark runs (models/fixtures/reference.py's BertConfig).
HIDDEN = {"bert-base-uncased": 768, "tiny-bert": 32}


def _checkpointed_layers_before_backward(r):
    """How many checkpointed encoder layers have run their forward but not yet finished their
    backward at the predicted peak's moment (each holds its attention scaling's wrapped number
    in PyTorch)."""
    moment = r["predicted_moment"]
    ckpt = [n for n in (_layer(m) for m in r["modules"]) if n is not None]
    if moment == "optimizer step":
        return 0
    if moment.endswith(": loss") or moment.endswith(": loss backward"):
        return len(ckpt)
    where = moment.split(": ")[-1].split(" ", 1)
    kind, name = where[0], where[-1]
    k = _layer(name)
    if kind == "forward":
        return sum(j < k for j in ckpt) if k is not None else (len(ckpt) if name == "pooler" else 0)
    if name == "pooler":
        return len(ckpt)
    if k is None:  # the embeddings' backward: every encoder layer's is done
        return 0
    return sum(j <= k for j in ckpt)


def _cache_section(doc, w):
    """The rows planned with --autocast-cache: the same PyTorch runs (cache on), against the
    prediction that counts the cache, with the mask and scalars of the BERT table."""
    rows = [r for r in doc["rows"] if r.get("autocast_cache")]
    if not rows:
        return
    w("## Autocast's cache on (`--autocast-cache`)\n")
    w(f"The bf16 points again, planned with `--autocast-cache` (the loop of the Hugging Face `Trainer`, "
      f"which keeps autocast's cache on, as these PyTorch runs do): each block's weight casts that only "
      f"the cache holds are kept until the loss is made (docs/memory-model.md, \"Autocast's cache\"). "
      f"Added by `{doc.get('cache_rows_command', doc['command'])}` ({doc.get('cache_rows_minutes', '?')} min, "
      f"load average at start and end {doc.get('cache_rows_load_average_start_end')}), PyTorch run "
      f"again beside them. *Mask* and *scalars* as above, for the attention the row ran (see below):\n")
    w("| model | optimizer | checkpointed | attention | predicted peak | at | ckptune | PyTorch | "
      "PyTorch − predicted | mask | scalars | left |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    exact = explained = 0
    for r in rows:
        d = r["pytorch_peak"] - r["predicted_peak"]
        bert = "bert" in r["model"]
        mask = _mask_bytes(doc, r) if bert else 0
        scalars = _scalar_bytes(r) if bert else 0
        left = d - mask - scalars
        exact += d == 0
        explained += left == 0
        w(f"| {r['model']} | {r['optimizer']} | {r['set']} | {_attention(r) if bert else '—'} | "
          f"{b(r['predicted_peak'])} | {r['predicted_moment']} | {b(r['ckptune_peak'])} | {b(r['pytorch_peak'])} | "
          f"{signed(d)} | {signed(mask)} | {signed(scalars)} | {signed(left)} |")
    w("")
    w(f"{exact} of {len(rows)} points: PyTorch's peak equals the prediction to the byte; {explained} of "
      f"{len(rows)} once the mask and the scalars are accounted for. ckptune's own run "
      f"equals the prediction in {sum(r['ckptune_peak'] == r['predicted_peak'] for r in rows)} of {len(rows)}.\n")
    w("Under SDPA the reference's mask is `sdpa_mask`'s `[batch, 1, seq, seq]` bool, built after the "
      "embeddings, and ckptune holds the same bool mask as a shared input beside its additive "
      "`[batch, 1, 1, seq]` f32 mask, through the micro-step; SDPA takes the scale as an argument, so "
      "no layer keeps a wrapped number. A layer's input is a non-leaf alias of the previous layer's "
      "output on ckptune's side too, so autocast casts it once per operator on both sides (BERT's "
      "query, key and value, in a forward and in a recompute), and the runtime lets go of an f32 input "
      "that a plain bf16 layer keeps only casts of, as PyTorch frees it (docs/memory-model.md, \"The "
      "execution scheme\"; `planner/tests/pytorch_bf16.rs` asserts both to the byte on tiny BERT).\n")


def main():
    doc = json.load(open(sys.argv[1]))
    rows = [r for r in doc["rows"] if not r.get("autocast_cache")]
    out = []
    w = out.append
    w("# The plan's peak in PyTorch\n")
    w(f"Generated by `{doc['command']}` ({doc['date']}, {doc['wall_minutes']} min) from "
      "[`peaks.json`](peaks.json); raw outputs of every command under [`raw/`](raw/). No number on "
      "this page is typed by hand.\n")
    w(f"Machine: {doc['machine']}, flags {' '.join(sorted(set(doc['cpu_flags'])))}; torch {doc['torch']}; "
      f"{doc['threads']} threads; load average (1/5/15 min) at start {doc['load_average_start_end'][0]}, "
      f"at end {doc['load_average_start_end'][1]}. Shapes: "
      + "; ".join(f"{m} `{s}`" for m, s in doc["shapes"].items()) + ".\n")
    w("*Predicted*: the profile's prediction for the checkpoint set (`ckptune sweep --profile`). "
      "*ckptune*: ckptune's runtime running it. *PyTorch*: `scripts/bench/eager.py`, the plain-torch "
      "reference model in PyTorch eager, `torch.utils.checkpoint(..., use_reentrant=False)` on the "
      "same modules, `torch.optim` in the same implementation (`single` = `foreach=False`, "
      "PyTorch's CPU default), the loop of [`docs/memory-model.md`](../../docs/memory-model.md#the-training-loop). "
      "All three peaks are whole-step CPU peaks counted by the same allocator (ckptune's, loaded "
      "into the PyTorch process), in bytes.\n")
    w("| model | precision | optimizer | impl | checkpointed | predicted peak | at | ckptune | PyTorch | PyTorch − predicted |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["pytorch_peak"] - r["predicted_peak"]
        w(f"| {r['model']} | {r['precision']} | {r['optimizer']} | {r['impl']} | {r['set']} | "
          f"{b(r['predicted_peak'])} | {r['predicted_moment']} | {b(r['ckptune_peak'])} | "
          f"{b(r['pytorch_peak'])} | {signed(d)} |")
    w("")
    exact = sum(r["pytorch_peak"] == r["predicted_peak"] for r in rows)
    mism = [r for r in rows if sorted(r["modules"]) != sorted(r["eager_modules"])]
    w(f"{exact} of {len(rows)} points: PyTorch's peak equals the prediction to the byte. "
      f"ckptune's own run equals the prediction in "
      f"{sum(r['ckptune_peak'] == r['predicted_peak'] for r in rows)} of {len(rows)}. "
      f"Checkpointed module sets differ between ckptune and PyTorch in {len(mism)} points.\n")
    # BERT's additive attention mask: ckptune computes it once per micro-step before the first
    # block and keeps it to the micro-step's end (a chain passes it to every layer); the
    # reference computes it inside BertModel.forward, where it dies with the forward unless a
    # checkpointed encoder layer saved it as an input (then it lives until the backward of the
    # lowest such layer is done).
    berts = [r for r in rows if "bert" in r["model"]]
    if berts:
        w("Where PyTorch and the prediction differ (BERT), first the attention mask: ckptune "
          "computes the additive mask (batch × seq × 4 bytes) before the first block and keeps it "
          "through the micro-step's backward, and under SDPA also the `[batch, 1, seq, seq]` bool "
          "mask, a shared input made once per micro-batch; the reference builds its mask (the "
          "additive one under eager attention, the bool one under SDPA) inside `BertModel.forward`, "
          "where it dies with the forward unless a checkpointed encoder layer saved it (then until "
          "that layer's backward is done). Second, under eager attention, each attention layer "
          "divides its scores by a Python float, and autograd saves that 8-byte wrapped-number "
          "tensor; saved-tensor hooks, which `torch.utils.checkpoint` uses to drop what a "
          "checkpointed forward saves, do not apply to wrapped numbers, so PyTorch keeps it per "
          "checkpointed layer from the forward to that layer's backward, where ckptune's no-grad "
          "forward saves nothing (SDPA takes the scale as an argument). *Mask* and *scalars* are "
          "what these account for at the predicted peak's moment; *left* is what neither explains:\n")
        w("| model | precision | optimizer | impl | checkpointed | at | PyTorch − predicted | mask | scalars | left |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        exact = 0
        for r in berts:
            d = r["pytorch_peak"] - r["predicted_peak"]
            mask = _mask_bytes(doc, r)
            scalars = _scalar_bytes(r)
            exact += d - mask - scalars == 0
            w(f"| {r['model']} | {r['precision']} | {r['optimizer']} | {r['impl']} | {r['set']} | "
              f"{r['predicted_moment']} | {signed(d)} | {signed(mask)} | {signed(scalars)} | "
              f"{signed(d - mask - scalars)} |")
        w("")
        w(f"{exact} of {len(berts)} BERT points are exact once these are accounted for.\n")
        checked = [r for r in rows if "pytorch_peak_no_autocast_cache" in r]
        if checked:
            w("bf16 points where PyTorch peaks above the prediction, run again in PyTorch with "
              "`torch.autocast(..., cache_enabled=False)`"
              + (f" (`{doc['autocast_check_command']}`)" if "autocast_check_command" in doc else "")
              + ". With the cache on, autocast keeps every bf16 weight cast made in its region until "
              "the region ends (after the loss), also the casts of layers run under "
              "`torch.utils.checkpoint`, whose forward saves nothing else; ckptune runs each block in "
              "its own autocast region, so a checkpointed block's casts die with its forward. Where "
              "the cache-off run equals the prediction up to the mask, the cache is the whole "
              "difference:\n")
            w("| model | optimizer | checkpointed | predicted | PyTorch | PyTorch, cache off | cache off − predicted − mask |")
            w("|---|---|---|---|---|---|---|")
            for r in checked:
                mask = _mask_bytes(doc, r)
                off = r["pytorch_peak_no_autocast_cache"]
                w(f"| {r['model']} | {r['optimizer']} | {r['set']} | {b(r['predicted_peak'])} | "
                  f"{b(r['pytorch_peak'])} | {b(off)} | {signed(off - r['predicted_peak'] - mask)} |")
            w("\nA plan made without `--autocast-cache` assumes a loop that disables the cache "
              "(`torch.autocast(..., cache_enabled=False)`, which re-casts each weight at each use); "
              "with the cache on, a bf16 plan that checkpoints some layers and not others can peak in "
              "PyTorch at the end of the forward, above every moment such a plan predicts. Planned "
              "with `--autocast-cache`, the prediction counts it: see the last section.\n")
    opt = [r for r in rows if r["predicted_moment"] == "optimizer step"]
    w(f"The peak is the optimizer step in {len(opt)} points: "
      + ", ".join(f"{r['model']} {r['precision']} {r['optimizer']}"
                  f"{'' if r['impl'] == 'single' else '-' + r['impl']} ({r['set']})" for r in opt) + ".\n")
    _cache_section(doc, w)
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
