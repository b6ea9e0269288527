"""`scripts/gpu_check` without a GPU: the synthetic traces are well formed, the replay loop and the
comparison compute what they say on a stand-in allocator and hand-made statistics, and bad
arguments are refused. The GPU measurement itself runs only on a GPU machine; the whole pipeline
through `ckptune simulate-allocator` is run by planner/tests/simulate_allocator.rs.

    .venv/bin/python -m unittest discover -s python/tests
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


traces = load("alloc_traces")
replay = load("gpu_check_replay")
steps = load("gpu_check_steps")
MIB = 1 << 20


class TracesTest(unittest.TestCase):
    def test_every_trace_is_well_formed_and_ends_clean(self):
        for name, build in traces.TRACES.items():
            with self.subTest(trace=name):
                events = build()
                live, seen = set(), set()
                for e in events:
                    if e[0] == "a":
                        self.assertEqual(len(e), 4)
                        self.assertNotIn(e[1], seen, "ids are not reused")
                        self.assertGreaterEqual(e[2], 0)
                        seen.add(e[1])
                        live.add(e[1])
                    elif e[0] == "f":
                        self.assertIn(e[1], live, "frees only what is live")
                        live.remove(e[1])
                    else:
                        self.assertIn(e[0], ("m", "e"))
                self.assertEqual(live, set())
                self.assertEqual(events[-1], ["e"])

    def test_traces_are_deterministic(self):
        for name, build in traces.TRACES.items():
            self.assertEqual(build(), build(), name)

    def test_write_all_writes_tagged_documents(self):
        with tempfile.TemporaryDirectory() as d:
            paths = traces.write_all(d)
            self.assertEqual(sorted(os.path.basename(p)[:-5] for p in paths), sorted(traces.TRACES))
            with open(paths[0]) as f:
                doc = replay.json.load(f)
            self.assertEqual((doc["format"], doc["alloc_conf"]), ("ckptune.alloc-trace/1", ""))


class ReplayTest(unittest.TestCase):
    def test_one_row_per_event_and_the_allocator_left_empty(self):
        backend = replay.FakeBackend()
        events = [["m", "x"], ["a", 1, 1000, 0], ["a", 2, 3 * MIB, 1], ["f", 1], ["e"], ["f", 2]]
        r = replay.replay_trace(events, backend)
        # The stand-in: 1000 → a 1024-byte block in its own 2 MiB "segment".
        self.assertEqual(r["rows"], [[0, 0, 0, 0], [1024, 2 * MIB, 1024, 1], [1024 + 3 * MIB, 6 * MIB, 1024 + 3 * MIB, 2],
                                     [3 * MIB, 4 * MIB, 3 * MIB, 1], [3 * MIB, 4 * MIB, 3 * MIB, 1], [0, 0, 0, 0]])
        self.assertIsNone(r["stopped"])
        self.assertEqual(backend.live, {})

    def test_stops_at_out_of_memory_with_the_state_after_it(self):
        backend = replay.FakeBackend(limit=5 * MIB)
        r = replay.replay_trace([["a", 1, 4 * MIB, 0], ["a", 2, 2 * MIB, 0], ["f", 1]], backend)
        self.assertEqual(r["stopped"]["event"], 1)
        self.assertEqual(len(r["rows"]), 2)
        self.assertEqual(r["counters"], {"num_alloc_retries": 0, "num_ooms": 1})
        self.assertEqual(backend.live, {})

    def test_measure_refuses_other_documents(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "x.json")
            with open(path, "w") as f:
                f.write('{"format": "ckptune.plan/1"}')
            with self.assertRaises(SystemExit) as e:
                replay.measure([path], replay.FakeBackend(), "")
            self.assertIn("not a ckptune.alloc-trace/1 trace", str(e.exception))


def simulated(rows, stopped=None, retries=0):
    """A simulate-allocator document with --every-event rows [allocated, reserved, active,
    requested, segments, largest free]."""
    return {"every_event": {"rows": rows}, "stopped": stopped, "stats": {"num_alloc_retries": retries}}


def measured(rows, stopped=None, retries=0):
    return {"name": "t", "events": len(rows), "rows": rows, "stopped": stopped, "baseline": [0, 0, 0, 0],
            "counters": {"num_alloc_retries": retries, "num_ooms": 0}}


class CompareTest(unittest.TestCase):
    def test_relative_errors(self):
        self.assertEqual(replay.relative_errors([0, 0, 100, 100], [0, 5, 150, 100]), [0.0, 1.0, 0.5, 0.0])

    def test_an_exact_pair(self):
        gpu = [[1024, 2 * MIB, 1024, 1], [0, 2 * MIB, 0, 1]]
        sim = [[1024, 2 * MIB, 1024, 1000, 1, 2 * MIB - 1024], [0, 2 * MIB, 0, 0, 1, 2 * MIB]]
        r = replay.compare_trace(measured(gpu), simulated(sim))
        self.assertTrue(r["exact"])
        self.assertIsNone(r["first_divergence"])
        self.assertEqual(r["reserved_bytes"], {"max_rel_error": 0.0, "mean_rel_error": 0.0})

    def test_errors_and_the_first_divergence(self):
        gpu = [[1024, 2 * MIB, 1024, 1], [0, 2 * MIB, 0, 1], [0, 0, 0, 0]]
        sim = [[1024, 2 * MIB, 1024, 0, 1, 0], [0, 4 * MIB, 0, 0, 2, 0], [0, 0, 0, 0, 0, 0]]
        r = replay.compare_trace(measured(gpu), simulated(sim))
        self.assertFalse(r["exact"])
        self.assertEqual(r["first_divergence"], {"event": 1, "columns": ["reserved_bytes", "segments"],
                                                 "gpu": [0, 2 * MIB, 0, 1], "simulated": [0, 4 * MIB, 0, 2]})
        self.assertEqual(r["reserved_bytes"]["max_rel_error"], 1.0)
        self.assertAlmostEqual(r["reserved_bytes"]["mean_rel_error"], 1 / 3)
        self.assertEqual(r["allocated_bytes"]["max_rel_error"], 0.0)

    def test_stops_and_retries_must_agree(self):
        rows = [[0, 0, 0, 0]]
        sim_rows = [[0, 0, 0, 0, 0, 0]]
        self.assertFalse(replay.compare_trace(measured(rows, stopped={"event": 0}), simulated(sim_rows))["exact"])
        self.assertFalse(replay.compare_trace(measured(rows, retries=1), simulated(sim_rows))["exact"])
        r = replay.compare_trace(measured(rows, stopped={"event": 0}, retries=1),
                                 simulated(sim_rows, stopped={"event": 0}, retries=1))
        self.assertTrue(r["exact"])
        self.assertEqual((r["gpu_stopped"], r["simulated_stopped"]), (0, 0))

    def test_markdown_flags_the_fake_backend(self):
        row = dict(alloc_conf="expandable_segments:True", **replay.compare_trace(
            measured([[0, 0, 0, 0]]), simulated([[0, 0, 0, 0, 0, 0]])))
        doc = {"date": "2026-01-01", "device": {"name": "fake (no GPU)", "total_memory": 1 << 30, "torch": "none"},
               "fake_backend": True, "results": [row], "summary": replay.summary([row])}
        text = replay.markdown(doc)
        self.assertIn("FAKE BACKEND", text)
        self.assertIn("| `expandable_segments:True` | t | 1 | yes |", text)
        self.assertIn("1 of 1 config × trace pairs agree", text)
        doc["fake_backend"] = False
        self.assertNotIn("FAKE", replay.markdown(doc))


class HistoryTest(unittest.TestCase):
    """The GPU allocator's history as a trace: worked out by hand."""

    def test_history_becomes_a_trace_with_reserved_bytes(self):
        seg, s1, s2 = 2 * MIB, 140001, 140002
        entries = [
            {"action": "segment_alloc", "addr": 0, "size": seg, "stream": s1},
            {"action": "alloc", "addr": 0, "size": 1000, "stream": s1},
            {"action": "alloc", "addr": 1024, "size": 10, "stream": s2},
            {"action": "free_requested", "addr": 0, "size": 1000, "stream": s1},
            {"action": "free_completed", "addr": 0, "size": 1000, "stream": s1},
            {"action": "alloc", "addr": 0, "size": 100, "stream": s1},  # the address again: a new block
            {"action": "free_completed", "addr": 0, "size": 100, "stream": s1},
            {"action": "free_completed", "addr": 1024, "size": 10, "stream": s2},
            {"action": "segment_free", "addr": 0, "size": seg, "stream": s1},
            {"action": "free_completed", "addr": 99, "size": 1, "stream": s1},  # from before the history
        ]
        events, reserved_after, reserved_end, notes = steps.convert_history(entries)
        self.assertEqual(events, [["a", 0, 1000, 0], ["a", 1, 10, 1], ["f", 0], ["a", 2, 100, 0], ["f", 2], ["f", 1]])
        self.assertEqual(reserved_after, [seg] * 6)
        self.assertEqual(reserved_end, 0)
        self.assertEqual(notes, {"frees_of_unknown_blocks": 1})

    def test_expandable_segments_map_and_unmap(self):
        entries = [
            {"action": "segment_map", "addr": 0, "size": 20 * MIB, "stream": 0},
            {"action": "alloc", "addr": 0, "size": 5 * MIB, "stream": 0},
            {"action": "segment_map", "addr": 20 * MIB, "size": 20 * MIB, "stream": 0},
            {"action": "alloc", "addr": 5 * MIB, "size": 30 * MIB, "stream": 0},
            {"action": "free_completed", "addr": 5 * MIB, "size": 30 * MIB, "stream": 0},
        ]
        _, reserved_after, _, _ = steps.convert_history(entries)
        self.assertEqual(reserved_after, [20 * MIB, 40 * MIB, 40 * MIB])


class ArgumentsTest(unittest.TestCase):
    def test_bad_arguments_exit_2(self):
        for argv in (["run", "--phase", "later"], ["run", "--backend", "cpu"], ["measure", "--traces", "d"], [],
                     ["run", "--models", "resnet50,gpt5"]):
            with self.subTest(argv=argv), self.assertRaises(SystemExit) as e:
                with open(os.devnull, "w") as null:
                    stderr, sys.stderr = sys.stderr, null
                    try:
                        replay.parse_args(argv)
                    finally:
                        sys.stderr = stderr
            self.assertEqual(e.exception.code, 2)

    def test_models_are_parsed_by_name(self):
        self.assertEqual(replay.parse_args(["run", "--models", "tiny-bert,resnet50"]).models, ["tiny-bert", "resnet50"])
        self.assertEqual(replay.parse_args(["run", "--models", ""]).models, [])
        self.assertEqual(replay.parse_args(["run"]).models,
                         ["resnet50", "bert-base", "tinyllama", "bert-base-bf16", "tinyllama-bf16",
                          "bert-base-in-bwd", "tinyllama-selective", "gpt2", "gpt2-bf16", "qwen2.5-bf16",
                          "resnet152-bf16"])

    def test_parts_are_parsed_by_name(self):
        self.assertEqual(replay.parse_args(["run"]).parts, ("replay", "steps", "times"))
        self.assertEqual(replay.parse_args(["run", "--parts", "steps,times"]).parts, ("steps", "times"))
        for bad in ("", "steps,nope"):
            stderr, sys.stderr = sys.stderr, open(os.devnull, "w")
            try:
                with self.assertRaises(SystemExit) as e:
                    replay.parse_args(["run", "--parts", bad])
            finally:
                sys.stderr.close()
                sys.stderr = stderr
            self.assertEqual(e.exception.code, 2)

    def test_measure_needs_the_variable_set_at_start(self):
        args = replay.parse_args(["measure", "--traces", "d", "--conf", "expandable_segments:True", "--out", "o"])
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        with mock.patch.dict(os.environ, env, clear=True), self.assertRaises(SystemExit) as e:
            replay.measure_cmd(args)
        self.assertIn("must be set to --conf", str(e.exception))

    def test_the_shell_front_door(self):
        script = str(ROOT / "scripts" / "gpu_check")
        help_ = subprocess.run([script, "--help"], capture_output=True, text=True)
        self.assertEqual(help_.returncode, 0, help_.stderr)
        self.assertIn("--backend {fake,torch}", help_.stdout)
        bad = subprocess.run([script, "--phase", "later"], capture_output=True, text=True)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("invalid choice: 'later'", bad.stderr)
        missing = subprocess.run([script], capture_output=True, text=True,
                                 env=dict(os.environ, CKPTUNE_PYTHON="/nonexistent/python"))
        self.assertEqual(missing.returncode, 2)
        self.assertIn("run scripts/setup first", missing.stderr)


if __name__ == "__main__":
    unittest.main()
