"""`ckptune_harness.host_memory`: with ckptune's meter installed, as every CPU run of the harness
has it, a large tensor is mapped afresh each time it is allocated until freed memory is held,
and after that its pages are reused (the kernel's count of minor faults says which). Runs in a
fresh interpreter: glibc serves the main thread from its main heap only, and the hold lasts for
the rest of the process.

    .venv/bin/python -m unittest discover -s python/tests
"""

import json
import subprocess
import sys
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent

ROUNDS = """
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from ckptune_harness import host_memory, meter as meter_mod
meter_mod.Meter(meter_mod.build())
torch.set_num_threads(1)

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(16 << 20)  # 64 MiB, above glibc's largest mmap threshold
    assert t.sum().item() == 16 << 20
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

unheld = [faults() for _ in range(3)]
held = host_memory.hold()
print(json.dumps({"unheld": unheld, "held": held, "rounds": [faults() for _ in range(4)]}))
"""


def huge_pages_always():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


class HoldTest(unittest.TestCase):
    @unittest.skipUnless(sys.platform == "linux", "glibc's malloc parameters")
    def test_a_hold_reuses_freed_pages(self):
        out = subprocess.run([sys.executable, "-c", ROUNDS, str(HERE.parent)], capture_output=True, text=True,
                             check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        pages = (64 << 20) // 4096
        self.assertTrue(r["held"], "glibc took M_MMAP_MAX and M_TRIM_THRESHOLD")
        if not huge_pages_always():  # else a fresh mapping faults once per 2 MiB
            for n in r["unheld"][1:]:
                self.assertGreater(n, pages * 9 // 10, f"without a hold the tensor is mapped afresh: {r}")
        # The first held round grows the heap; the rest reuse it.
        for n in r["rounds"][1:]:
            self.assertLess(n, pages // 20, f"a held round faulted in fresh pages: {r}")


if __name__ == "__main__":
    unittest.main()
