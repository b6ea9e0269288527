"""What eager PyTorch's BERT holds at a moment of ckptune's prediction that the prediction does
not, and the reverse: the differences docs/memory-model.md ("Where exactness needs care") names,
itemized per point by the results tables (scripts/pytorch_peaks_table.py, scripts/fsdp_table.py).

A moment is ckptune's label, with or without its regime or rank prefix ("first micro-step:
backward encoder.layer.11", "rank 0: reduce-scatter encoder.layer.3", "optimizer step").
"""


def layer(name):
    """N of `encoder.layer.N` (or None)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) >= 3 and parts[:2] == ["encoder", "layer"] else None


def _split(moment):
    """(kind, block) of a moment: ("backward", "encoder.layer.3"), ("loss", ""), ..."""
    m = moment.split(": ")[-1]
    if m.startswith("prefetch ") and m.endswith(" pre-backward)"):
        # FSDP's prefetch in a unit's pre-backward hook: that unit's backward is about to run.
        owner = m[m.index("(") + 1:-len(" pre-backward)")]
        return ("loss", "") if owner == "root" else ("backward", owner)
    if m.endswith(" (pre-backward)"):
        return "backward", m.removesuffix(" (pre-backward)").split(" ", 1)[1]
    kind, _, block = m.partition(" ")
    if kind in ("optimizer", "end") or m == "reduce-scatter <root>":
        return "after", ""
    if kind in ("all-gather", "copy-out") and block == "<root>":
        return "before", ""
    if kind in ("all-gather", "copy-out"):
        return "forward", block
    if kind in ("loss",):
        return "loss", ""
    if kind in ("backward", "recompute", "reduce-scatter"):
        return "backward", block
    return kind, block


def mask_holders(moment, checkpointed, attention):
    """(ckptune holds its masks, the reference holds its mask) at `moment`. ckptune makes its
    additive mask, and under SDPA the bool mask, before the first block and frees them when the
    micro-step's backward is done; the reference makes its mask in `BertModel.forward` (under
    SDPA after the embeddings) and frees it when that forward returns, or, where a checkpointed
    encoder layer keeps it as an input, when the lowest such layer's backward is done."""
    kind, block = _split(moment)
    layers = [n for n in (layer(m) for m in checkpointed) if n is not None]
    if kind in ("after", "before"):
        return False, False
    if kind == "forward":
        return True, not (block == "embeddings" and attention == "sdpa")
    if kind == "loss" or block == "pooler":
        return True, bool(layers)
    k = layer(block)
    if k is None:  # the embeddings' backward, after every encoder layer's
        return True, False
    return True, any(j <= k for j in layers)


def mask_bytes(moment, checkpointed, attention, batch, seq):
    """PyTorch − predicted owed to the attention masks at `moment`: ckptune's additive mask
    (batch × seq f32) and, under SDPA, the `[batch, 1, seq, seq]` bool mask beside it (none when
    nothing is padded; these benchmarks pad every other sequence); the reference's mask is the
    additive one under eager attention, the bool one under SDPA."""
    additive = batch * seq * 4
    ckptune, pytorch = mask_holders(moment, checkpointed, attention)
    if attention == "sdpa":
        bool_mask = batch * seq * seq if batch > 1 and seq // 4 > 0 else 0
        return (bool_mask if pytorch else 0) - (bool_mask + additive if ckptune else 0)
    return (additive if pytorch else 0) - (additive if ckptune else 0)


def bias_bytes(moment, checkpointed, precision, hidden):
    """PyTorch − predicted owed to a bias gradient: where the prediction peaks in the backward
    of a checkpointed (or selective) encoder layer, it peaks at `output.dense`'s weight gradient
    with the bias gradient's `sum` on top; `torch.utils.checkpoint` has freed the Linear's
    recomputed input before that `sum`, so PyTorch peaks one fp32 bias gradient (hidden × 4
    bytes) lower. Counted for fp32 only, where it is measured (planner/tests/selective.rs,
    planner/tests/shard.rs)."""
    _, block = _split(moment)
    if precision != "fp32" or not moment.split(": ")[-1].startswith("backward ") or block not in checkpointed:
        return 0
    return -4 * hidden if layer(block) is not None else 0


def of_plan(plan, moment):
    """(mask, bias gradient) at `moment` of a ckptune plan JSON: its checkpointed modules,
    attention, micro-batch, sequence, precision, and BERT's hidden size (the length of a layer's
    `output.dense.bias`)."""
    modules, shape, c = plan["checkpoint"]["modules"], plan["shape"], plan["config"]
    hidden = next(p["shape"][0] for p in plan["model"]["parameters"] if p["name"].endswith("output.dense.bias"))
    return (mask_bytes(moment, modules, shape.get("attention", "eager"), c["micro_batch"], shape["seq"]),
            bias_bytes(moment, modules, c["precision"], hidden))
