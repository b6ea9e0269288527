"""The trainer run's refusals (`python -m ckptune_harness.trainers`): a trainer that is not
installed, and a precision no trainer runs on the CPU. The runs themselves are tested through
`ckptune verify --pytorch --trainer` (planner/tests/verify_trainer.rs), which emits their snippets."""

import importlib.util
import os
import sys
import unittest
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptune import training_config  # noqa: E402
from ckptune_harness import plans, trainers  # noqa: E402


class Refusals(unittest.TestCase):
    def test_a_trainer_not_installed_is_named_with_the_fix(self):
        cfg = training_config(plans.regex_plan("", []))
        real = importlib.util.find_spec
        with mock.patch("importlib.util.find_spec", lambda n: None if n == "lightning" else real(n)):
            with self.assertRaises(ValueError) as e:
                trainers.check_trainer("lightning", cfg)
        self.assertIn("Lightning is not installed", str(e.exception))
        self.assertIn("lightning not importable", str(e.exception))
        self.assertIn("scripts/setup", str(e.exception))

    def test_fp16_is_refused_on_the_cpu(self):
        cfg = training_config(plans.regex_plan("", [], precision="fp16"))
        with mock.patch("importlib.util.find_spec", lambda n: object()):
            for t in ("hf", "lightning"):
                with self.assertRaises(ValueError) as e:
                    trainers.check_trainer(t, cfg)
                self.assertIn("'fp16' needs a GradScaler", str(e.exception))

    def test_main_exits_2_for_bad_input(self):
        with mock.patch("sys.stderr"):
            self.assertEqual(trainers.main(["--trainer", "hf", "--snippet", "x.py", "--plan", "/nonexistent.json"]), 2)


if __name__ == "__main__":
    unittest.main()
