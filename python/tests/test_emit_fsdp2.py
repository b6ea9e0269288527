"""The launcher that runs `ckptune emit fsdp2` snippets for planner/tests/emit.rs
(snippet_harness.run_fsdp2): a rank that fails, or ranks that never finish, end the run with an
error naming the cause, and no rank process outlives it. The emitted snippets themselves are
executed by planner/tests/emit.rs, which needs the ckptune binary; these stand-ins follow the
same contract (RANKS, PLAN, fully_shard, main(build)). Run from the repository root:

    .venv/bin/python -m unittest discover -s python/tests
"""

import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import snippet_harness  # noqa: E402

# A stand-in for an emitted snippet: two gloo ranks, with `body` as each rank's work.
STANDIN = """\
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

PLAN = {{"config": {{"micro_batch": 2, "grad_accum": 1}}}}
RANKS = 2


def main(build):
    dist.init_process_group(backend="gloo")
    try:
{body}
    finally:
        dist.destroy_process_group()
"""


@unittest.skipUnless(dist.is_available() and dist.is_gloo_available(),
                     "torch.distributed with the gloo backend is not available in this torch build")
class LaunchTest(unittest.TestCase):
    def launch(self, body, timeout=120.0):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "snippet.py"
            path.write_text(STANDIN.format(body=textwrap.indent(textwrap.dedent(body), " " * 8)))
            with self.assertRaises(snippet_harness.LaunchError) as cm:
                snippet_harness.run_fsdp2(path, "tiny-resnet", 1, timeout=timeout)
        return cm.exception

    def test_a_failing_rank_is_named_and_every_rank_is_gone(self):
        # Rank 1 raises; rank 0 waits in a collective for it, until torchrun stops it.
        e = self.launch("""\
            if dist.get_rank() == 1:
                raise RuntimeError("rank 1 fails on purpose")
            dist.all_reduce(torch.ones(1))
            """)
        self.assertIn("rank 1 failed", str(e))
        self.assertIn("rank 1 fails on purpose", str(e))
        self.assertEqual(len(e.pids), 2)
        self.assertTrue(not any(snippet_harness.alive(pid) for pid in e.pids), e.pids)

    def test_the_timeout_stops_every_rank(self):
        e = self.launch("time.sleep(3600)", timeout=8)
        self.assertIn("did not finish within 8 s", str(e))
        self.assertEqual(len(e.pids), 2)
        self.assertTrue(not any(snippet_harness.alive(pid) for pid in e.pids), e.pids)


if __name__ == "__main__":
    unittest.main()
