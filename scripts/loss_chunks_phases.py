"""PyTorch eager's peak in the forward and in the chunked loss separately, for
results/loss-chunks/: the reference tiny-llama at 2 x 512 tokens (fp32, AdamW single-tensor, one
thread, as the plans there), under ckptune's counting allocator, third step (optimizer state
exists, as in `verify --pytorch`'s measured steps).

    .venv/bin/python scripts/loss_chunks_phases.py 1 2 4 16 > results/loss-chunks/eager-phases.txt
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

from ckptune import chunked_causal_lm_loss  # noqa: E402
from ckptune_harness import meter as meter_mod  # noqa: E402
from ckptune_harness import reference  # noqa: E402


def phases(meter, ref, chunks):
    torch.manual_seed(0)
    model, _ = ref.build("tiny-llama", "sdpa")
    model.train()
    gen = torch.Generator().manual_seed(1234)
    make_batch, _ = reference.batches(ref, model, model, 2, None, 512, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, foreach=False)
    for _ in range(3):
        ids, y, mask = make_batch()
        meter.reset_peak()
        hidden = model.model(ids, mask)
        forward = meter.peak()
        meter.reset_peak()
        if chunks == 1:
            logits = model.lm_head(hidden).float()
            shift = torch.nn.functional.pad(y, (0, 1), value=-100)[..., 1:].contiguous().view(-1)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), shift, ignore_index=-100)
            del logits, shift
            loss.backward()
        else:
            loss = chunked_causal_lm_loss(hidden, model.lm_head.weight, y, chunks)
        loss_peak = meter.peak()
        if chunks != 1:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, hidden, ids, y, mask
    return forward, loss_peak


def main():
    torch.set_num_threads(1)
    meter = meter_mod.Meter(meter_mod.build())
    ref = reference.load()
    print("chunks  forward peak (B)  loss peak (B)")
    for chunks in (int(a) for a in sys.argv[1:]):
        forward, loss = phases(meter, ref, chunks)
        print(f"{chunks:>6}  {forward:>16,}  {loss:>13,}")


if __name__ == "__main__":
    main()
