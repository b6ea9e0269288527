"""The meter's build cache: a build whose key differs (another interpreter's torch, a concurrent
checkout) may be in use by a process that was handed its path, so only week-old builds go."""

import os
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ckptune_harness"))
import meter  # noqa: E402


class StaleBuilds(unittest.TestCase):
    def test_only_week_old_builds_of_other_keys_are_removed(self):
        with tempfile.TemporaryDirectory() as d:
            paths = {n: os.path.join(d, n) for n in (
                "libckptune_meter-aaaa.so", "libckptune_meter-bbbb.so", "libckptune_meter-cccc.so", "notes.txt")}
            for p in paths.values():
                open(p, "w").close()
            old = time.time() - meter.STALE_SECONDS - 60
            for n in ("libckptune_meter-bbbb.so", "libckptune_meter-cccc.so", "notes.txt"):
                os.utime(paths[n], (old, old))
            meter._remove_stale(d, keep=paths["libckptune_meter-cccc.so"])
            self.assertEqual(sorted(os.listdir(d)),
                             ["libckptune_meter-aaaa.so", "libckptune_meter-cccc.so", "notes.txt"])

    def test_the_root_is_resolved_so_one_checkout_has_one_key(self):
        self.assertEqual(meter.ROOT, os.path.realpath(meter.ROOT))
        self.assertNotIn("..", meter.SOURCE.split(os.sep))


if __name__ == "__main__":
    unittest.main()
