"""`ckptune_harness.fsdp`: a real FSDP2 training step on two gloo ranks on the CPU, each rank's memory
measured by the counting allocator. The assertions are byte-exact properties of FSDP2 that a
sharded memory model builds on (docs/fsdp.md), and the harness's own guarantees: no rank process
outlives a run, whichever way it ends. Needs a checkout (the meter compiles kernels/csrc/).

    .venv/bin/python -m unittest discover -s python/tests
"""

import math
import os
import sys
import tempfile
import time
import unittest
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from ckptune_harness import fsdp  # noqa: E402
from ckptune_harness.fsdp import spec as spec_mod  # noqa: E402

# A tiny BERT whose word embeddings (101 rows) and classifier (3 rows) do not split evenly in
# two, so rank 1's chunks of them are a row short of rank 0's: the padding is visible.
CONFIG = {"vocab_size": 101, "num_labels": 3}
RUN = dict(config=CONFIG, world_size=2, micro_batch=4, seq=32, steps=3, warmup=1, timeout=300)


def rows(shape, n, rank):
    """Rows of dim 0 in rank `rank`'s chunk, and in every rank's padded shard."""
    per = math.ceil(shape[0] / n)
    return max(0, min(per, shape[0] - per * rank)), per


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def fails_on_rank_1(micro_batch, generator):
    """A model callable (module level: the ranks unpickle it) whose rank 1 raises while rank 0
    goes on into the collectives, where it would wait for rank 1 forever."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    return model, (lambda: torch.randn(micro_batch, 4, generator=generator)), (lambda b: model(b).sum())


def never_returns(micro_batch, generator):
    time.sleep(3600)


class SpecTest(unittest.TestCase):
    """The typed spec the parent writes for its ranks, and the checks it makes before any
    process starts."""

    ARGS = dict(config={"vocab_size": 101}, regex="", world_size=2, precision="bf16", optimizer="adamw",
                micro_batch="4", image=None, seq=32, reshard_after_forward=0, shard_regex=None, steps=3, warmup=1,
                lr=1e-3, trace=False, settle=True, autocast_cache=True, seed=0, timeout=60, port=0, root="/ckptune",
                parent=1, sys_path=["/a", "/b"])

    def test_the_json_file_reads_back_as_the_same_spec(self):
        spec = spec_mod.make_spec(**self.ARGS)
        self.assertEqual((spec.micro_batch, spec.reshard_after_forward, spec.timeout), (4, False, 60.0))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "spec.json")
            spec.write(path)
            self.assertEqual(spec_mod.RunSpec.read(path), spec)

    def test_arguments_no_rank_could_run_with_are_refused(self):
        for change, fragment in [
            (dict(world_size=0), "world_size must be a positive integer"),
            (dict(precision="fp16"), "precision 'fp16': expected one of fp32, bf16"),
            (dict(optimizer="lion"), "optimizer 'lion': expected one of adamw, sgd-momentum"),
            (dict(steps=1), "need warmup >= 1"),
            (dict(warmup=0), "need warmup >= 1"),
            (dict(shard_regex="("), "shard_regex '(' is not a valid regex"),
        ]:
            with self.subTest(change=change), self.assertRaises(ValueError) as cm:
                spec_mod.make_spec(**{**self.ARGS, **change})
            self.assertIn(fragment, str(cm.exception))


class ShardArithmeticTest(unittest.TestCase):
    def test_every_rank_stores_the_first_chunks_rows_and_owns_its_own(self):
        self.assertEqual([fsdp.padded_shard_numel([101, 8], 2), fsdp.padded_shard_numel([], 2)], [51 * 8, 1])
        self.assertEqual([fsdp.local_shard_numel([101, 8], 2, r) for r in range(2)], [51 * 8, 50 * 8])
        # Three rows on four ranks: chunks of one row, the last rank's empty.
        self.assertEqual([fsdp.local_shard_numel([3], 4, r) for r in range(4)], [1, 1, 1, 0])
        self.assertEqual([fsdp.local_shard_numel([], 2, r) for r in range(2)], [1, 0])

    def test_unit_bytes_add_up_each_units_parameters(self):
        params = [{"shape": [101, 8], "dtype": "float32", "unit": "<root>"},
                  {"shape": [3], "dtype": "bfloat16", "unit": "layer1"}]
        units = fsdp.unit_bytes(params, 2)
        self.assertEqual(units["<root>"], {"unsharded": 101 * 8 * 4, "padded_unsharded": 2 * 51 * 8 * 4,
                                           "shard": 51 * 8 * 4, "local": [51 * 8 * 4, 50 * 8 * 4], "params": 1})
        self.assertEqual(units["layer1"]["local"], [2 * 2, 1 * 2])


@unittest.skipUnless(fsdp.gloo_available(), "torch.distributed with the gloo backend is not available in this "
                                            "torch build")
class FsdpStepTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.plain = fsdp.run("tiny-bert", trace=True, **RUN)
        cls.ckpt = fsdp.run("tiny-bert", regex=r"encoder\.layer\.0", **RUN)

    def test_each_parameter_is_sharded_on_dim0_and_padded_to_the_first_chunk(self):
        params = self.plain["params"]
        self.assertEqual([p["name"] for p in params if p["shape"][0] % 2],
                         ["embeddings.word_embeddings.weight", "<head>.classifier.weight", "<head>.classifier.bias"])
        unsharded = sum(math.prod(p["shape"]) * 4 for p in params)
        padded = sum(rows(p["shape"], 2, 0)[1] * math.prod(p["shape"][1:]) * 4 for p in params)
        for r in self.plain["ranks"]:
            with self.subTest(rank=r["rank"]):
                for p in r["params"]:
                    mine, per = rows(p["shape"], 2, r["rank"])
                    self.assertEqual(p["local_shape"], [mine] + p["shape"][1:], p["name"])
                    # Every rank allocates the padded shard, its own chunk a view at its start.
                    self.assertEqual(p["local_storage_bytes"], per * math.prod(p["shape"][1:]) * 4, p["name"])
                self.assertEqual(r["sharded_param_bytes"], padded)
                # The meter agrees: sharding swaps the unsharded parameters for the padded
                # shards and changes nothing else (buffers stay whole on every rank).
                lv = r["levels"]
                self.assertEqual(lv["after_build"] - lv["after_shard"], unsharded - padded)

    def test_optimizer_state_is_unpadded_and_gradients_are_padded(self):
        params = self.plain["params"]
        for r in self.plain["ranks"]:
            with self.subTest(rank=r["rank"]):
                local = sum(rows(p["shape"], 2, r["rank"])[0] * math.prod(p["shape"][1:]) * 4 for p in params)
                # AdamW (foreach=False): exp_avg and exp_avg_sq of the rank's own chunk, and a
                # 4-byte float32 `step` per parameter.
                self.assertEqual(r["optimizer_state_bytes"], 2 * local + 4 * len(params))
                lv = r["levels"]
                self.assertEqual(lv["after_optimizer_state"] - lv["after_shard"], r["optimizer_state_bytes"])
                # The sharded gradients are views of one reduce-scatter output per unit, padded.
                for s in r["steps"]:
                    self.assertEqual(s["grad_storage_bytes"], r["sharded_param_bytes"])
        state = [r["optimizer_state_bytes"] for r in self.plain["ranks"]]
        self.assertEqual(state[0] - state[1], 2 * (32 + 32 + 1) * 4)  # rank 1 lacks a row of each odd one

    def test_all_gather_buffers_and_resharding_move_whole_padded_units(self):
        units = self.plain["unit_bytes"]
        layers = self.plain["units"]
        self.assertEqual(layers, ["encoder.layer.0", "encoder.layer.1"])
        for r in self.plain["ranks"]:
            with self.subTest(rank=r["rank"]):
                trace = r["trace"]
                forward = trace[:[e[0] for e in trace].index("forward_end") + 1]
                at = {(e[0], e[1]): i for i, e in enumerate(forward)}

                def delta(event, unit):
                    i = at[(event, unit)]
                    return forward[i][2] - forward[i - 1][2]

                root = units["<root>"]["padded_unsharded"]
                self.assertEqual(delta("copy_out", "<root>"), root)  # its flat buffer is kept meanwhile
                for k, unit in enumerate(layers):
                    size = units[unit]["padded_unsharded"]
                    i = at[("all_gather", unit)]
                    # Gloo's all-gather allocates a temporary as large as its output.
                    self.assertEqual(forward[i][3] - forward[i][2], size)
                    # The copy-out allocates the unsharded parameters and frees the previous
                    # unit's flat buffer, which FSDP kept until then.
                    previous = units[layers[k - 1]]["padded_unsharded"] if k else root
                    self.assertEqual(delta("copy_out", unit), size - previous)
                    self.assertEqual(delta("post_forward", unit), -size)  # resharded after forward
                # The root's post-forward frees the last unit's flat buffer.
                self.assertEqual(delta("forward_end", ""), -units[layers[-1]]["padded_unsharded"])

    def test_checkpointing_a_layer_lowers_the_peak_when_activations_dominate(self):
        self.assertEqual(self.ckpt["checkpointed"], ["encoder.layer.0"])
        for plain, ckpt in zip(self.plain["ranks"], self.ckpt["ranks"]):
            with self.subTest(rank=plain["rank"]):
                self.assertLess(ckpt["peak_bytes"], plain["peak_bytes"])
                # Checkpointing changes activations, not what FSDP shards.
                self.assertEqual(ckpt["levels"]["after_optimizer_state"], plain["levels"]["after_optimizer_state"])

    def test_every_rank_is_gone_and_its_process_group_destroyed(self):
        for run in (self.plain, self.ckpt):
            self.assertEqual(sorted(r["pid"] for r in run["ranks"]), sorted(run["pids"]))
            for r in run["ranks"]:
                self.assertTrue(r["process_group_destroyed"])
                self.assertTrue(gone(r["pid"]), f"rank {r['rank']} (pid {r['pid']}) outlived the run")

    def test_a_failing_rank_is_reported_and_every_rank_killed(self):
        with self.assertRaises(fsdp.FsdpError) as cm:
            fsdp.run(fails_on_rank_1, world_size=2, timeout=120)
        self.assertEqual(cm.exception.rank, 1)
        self.assertIn("rank 1 fails on purpose", str(cm.exception))
        self.assertEqual(len(cm.exception.pids), 2)
        self.assertTrue(all(gone(pid) for pid in cm.exception.pids))

    def test_the_timeout_kills_every_rank(self):
        with self.assertRaises(fsdp.FsdpTimeout) as cm:
            fsdp.run(never_returns, world_size=2, timeout=5)
        self.assertEqual(len(cm.exception.pids), 2)
        self.assertTrue(all(gone(pid) for pid in cm.exception.pids))


if __name__ == "__main__":
    unittest.main()
