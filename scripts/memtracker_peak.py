"""PyTorch's own estimate of a training step's peak, for comparison with ckptune's
(scripts/scale_bench): torch.distributed._tools.mem_tracker.MemTracker under FakeTensorMode, on a
transformers model built from config.json (SDPA attention, as ckptune's default), batch 1, AdamW
(foreach=False, as ckptune's plans name it), two steps (the second, with optimizer state, is the
one reported). Prints one JSON line: seconds and the peak bytes per device.

    memtracker_peak.py CONFIG_DIR SEQ fp32|bf16|bf16-pure
"""

import json
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    config_dir, seq, precision = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cfg = AutoConfig.from_pretrained(config_dir)
    t0 = time.monotonic()
    with FakeTensorMode():
        # The dtype is explicit: from_config otherwise builds the config's torch_dtype (bf16 for
        # these checkpoints), and Module.to() cannot swap fake parameters' dtype afterwards.
        dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
        assert all(p.dtype == dtype for p in model.parameters()), "built in another dtype"
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for step in range(2):
                if step:
                    tracker.reset_mod_stats()
                ids = torch.randint(0, cfg.vocab_size, (1, seq))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
    by_device = {str(dev): stats.get("Total", 0) for dev, stats in peak.items()}
    print(json.dumps({"seconds": time.monotonic() - t0, "peak_bytes": by_device}))


if __name__ == "__main__":
    main()
