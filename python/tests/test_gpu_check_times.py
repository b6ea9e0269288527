"""`scripts/gpu_check_times.py` without a GPU: the block timer's hooks mark every forward and
backward of every block (wall-clock marks stand in for CUDA events), and the comparison computes
its errors, recompute and ranking from hand-made measurements and plans.

    .venv/bin/python -m unittest discover -s python/tests
"""

import importlib.util
import sys
import unittest
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("gpu_check_times", ROOT / "scripts" / "gpu_check_times.py")
times = importlib.util.module_from_spec(spec)
spec.loader.exec_module(times)


class KwargsBlock(nn.Module):
    """Called with its input by keyword, as Hugging Face layers are; returns a tuple."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden_states=None):
        return (torch.relu(self.linear(hidden_states)),)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.layer = KwargsBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.layer(hidden_states=self.stem(x))[0])


class BlockTimerTest(unittest.TestCase):
    def test_every_step_of_every_block_is_marked(self):
        model = Chain()
        timer = times.BlockTimer(torch, ["stem", "layer", "head", "missing"], device="cpu")
        timer(model)
        self.assertEqual(timer.missing, ["missing"])
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
        for name in ("stem", "layer", "head"):
            self.assertEqual(len(timer.events[name]["forward"]), 3, name)
            self.assertEqual(len(timer.events[name]["backward"]), 3, name)
        seconds = timer.seconds(warmup=1)
        for name in ("layer", "head"):  # inputs that need a gradient: both ends of the backward
            self.assertGreater(seconds[name]["forward"], 0)
            self.assertGreater(seconds[name]["backward"], 0)
        # The stem's input needs no gradient: its backward has no end to mark.
        self.assertIsNone(seconds["stem"]["backward"])
        self.assertGreater(seconds["stem"]["forward"], 0)


def plan(step_seconds, regex, blocks, recompute, classes):
    return {"checkpoint": {"regex": regex, "modules": regex.split("|") if regex else []}, "predicted": {"step_seconds": step_seconds,
                                                          "step_seconds_estimated": "estimated for cuda:h200"},
            "profile": {"recompute_seconds": recompute, "recompute_class": classes,
                        "regimes": [{"blocks": blocks}]}}


def block(name, fwd, bwd, saved):
    return {"name": name, "candidate": True, "fwd_seconds": fwd, "bwd_seconds": bwd,
            "kept_grad": saved, "kept_nograd": 0}


class CompareTest(unittest.TestCase):
    def setUp(self):
        blocks = [block("a", 1.0, 2.0, 100), block("b", 1.0, 2.0, 100), block("c", 4.0, 8.0, 100)]
        recompute = [1.0, 1.0, 4.0]
        classes = [0, 0, 2]
        self.plans = [plan(10.0, "", blocks, recompute, classes), plan(12.0, "a|b", blocks, recompute, classes)]
        self.measured = {
            "model": "m", "device": "GPU", "torch": "2", "alloc_conf": "", "plans": ["m.none", "m.ckpt"],
            "rounds": [[{"median_seconds": 8.0}, {"median_seconds": 11.0}],
                       [{"median_seconds": 9.0}, {"median_seconds": 12.0}],
                       [{"median_seconds": 10.0}, {"median_seconds": 10.0}]],
            "blocks": {"a": {"forward": 1.0, "backward": 2.5}, "b": {"forward": 3.0, "backward": 2.0},
                       "c": {"forward": 5.0, "backward": None}},
        }

    def test_steps_recompute_and_blocks(self):
        row = times.compare_model(self.measured, self.plans)
        none, ckpt = row["steps"]
        self.assertEqual(none["measured_seconds"], 9.0)  # the median of the rounds' medians
        self.assertAlmostEqual(none["rel_error"], 1 / 9)
        self.assertEqual(ckpt["measured_seconds"], 11.0)
        self.assertEqual(row["recompute"], {"predicted_seconds": 2.0, "measured_seconds": 2.0, "rel_error": 0.0})
        a = row["blocks"][0]
        self.assertAlmostEqual(a["backward"]["rel_error"], (2.0 - 2.5) / 2.5)
        # Within 15%: a's forward (0%), b's backward (0%); not a's backward (−20%), b's forward,
        # c's forward (−20%); c's backward was not measured.
        self.assertEqual((row["blocks_within_target"], row["block_terms"]), (2, 5))

    def test_ranking_pools_a_class_and_skips_the_pairs_the_estimate_ties(self):
        row = times.compare_model(self.measured, self.plans)
        # a and b tie in the estimate (one class), so the pairs are (a, c) and (b, c): a and b
        # pooled measure 2.0 each against c's 5.0, the estimate's order (a, b before c).
        self.assertEqual(row["ranking"], {"kendall_tau": 1.0, "same_order": True, "candidates": 3})

    def test_a_reversed_pair(self):
        tau, same = times.ranking([0, 1, 2], [100, 100, 100], [1.0, 2.0, 3.0], [1.0, 3.0, 2.0])
        self.assertEqual((tau, same), (1 / 3, False))

    def test_markdown_names_the_device_and_every_model(self):
        doc = {"rounds": 3, "steps": 7, "warmup": 2, "failures": {"x": "exit 1"},
               "models": [times.compare_model(self.measured, self.plans)]}
        text = times.markdown(doc)
        self.assertIn("from a run on GPU", text)
        self.assertIn("| m | nothing checkpointed | 10000.0 ms | 9000.0 ms | +11.1% |", text)
        self.assertIn("- x: exit 1", text)


if __name__ == "__main__":
    unittest.main()
