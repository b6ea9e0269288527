"""Synthetic allocation traces (`ckptune.alloc-trace/1`) that exercise each rule of PyTorch's CUDA
caching allocator, for `scripts/gpu_check`: replayed on a GPU and through
`ckptune simulate-allocator`, they compare every rule even without a real training trace.

    .venv/bin/python scripts/alloc_traces.py --out DIR     # writes DIR/<name>.json

Each trace is deterministic (fixed sizes or a seeded generator) and frees everything it
allocates; `TRACES` names them with the rule they exercise. Under the configurations
scripts/gpu_check runs (`CONFIGS`), the same traces cover expandable segments, max_split_size,
roundup_power2_divisions, and the retries and garbage collection under a memory fraction.
"""

import argparse
import json
import os
import random

KIB = 1 << 10
MIB = 1 << 20
FORMAT = "ckptune.alloc-trace/1"

# The PYTORCH_CUDA_ALLOC_CONF settings scripts/gpu_check replays every trace under, one fresh
# process each (the variable is read when CUDA initializes). The fraction settings give a
# limit of 2% of the device (2.8 GB on an H200) that `pressure` crosses.
CONFIGS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[64:8,256:4,>:1]",
    "per_process_memory_fraction:0.02,max_split_size_mb:64",
    "per_process_memory_fraction:0.02,garbage_collection_threshold:0.6",
]


class Trace:
    """Builds events; ids are handed out in order."""

    def __init__(self):
        self.events = []
        self.next_id = 0
        self.live = set()

    def alloc(self, nbytes, stream=0):
        self.next_id += 1
        self.live.add(self.next_id)
        self.events.append(["a", self.next_id, int(nbytes), stream])
        return self.next_id

    def free(self, id_):
        self.live.remove(id_)
        self.events.append(["f", id_])

    def mark(self, name):
        self.events.append(["m", name])

    def empty_cache(self):
        self.events.append(["e"])

    def finish(self):
        """Frees what is still live, then empties the cache, so each trace ends clean."""
        self.mark("end")
        for id_ in sorted(self.live):
            self.free(id_)
        self.empty_cache()
        return self.events


def rounding():
    """round_size: kMinBlockSize and roundup_power2_divisions across the size intervals."""
    t = Trace()
    sizes = [1, 511, 512, 513, 1000, 1023, 1024, 4097, 65535, MIB - 1, MIB, MIB + 1, 3 * MIB + 1,
             5 * MIB + 1, 10 * MIB - 1, 10 * MIB, 10 * MIB + 1, 100 * MIB + 12345, 300 * MIB + 1,
             600 * MIB + 1]
    ids = [t.alloc(s) for s in sizes]
    t.mark("free")
    for id_ in ids[::2] + ids[1::2]:
        t.free(id_)
    return t.finish()


def small_pool():
    """The small pool: requests up to 1 MiB packed into 2 MiB segments, split and merged."""
    t = Trace()
    sizes = [64, 700, 4 * KIB, 100 * KIB, 300 * KIB, 1 * MIB, 17 * KIB, 512 * KIB + 1]
    ids = [t.alloc(sizes[i % len(sizes)]) for i in range(300)]
    t.mark("holes")
    for id_ in ids[::3]:
        t.free(id_)
    refill = [t.alloc(sizes[(i * 5) % len(sizes)]) for i in range(120)]
    t.mark("release")
    for id_ in reversed(ids[1::3] + refill):
        t.free(id_)
    t.empty_cache()
    return t.finish()


def segment_sizes():
    """get_allocation_size: 1–10 MiB requests share 20 MiB segments, larger ones get their own."""
    t = Trace()
    a = [t.alloc(s) for s in [MIB + 1, 2 * MIB, 5 * MIB, 9 * MIB + MIB // 2, 9 * MIB]]
    t.free(a[1])
    t.free(a[3])
    t.alloc(3 * MIB)
    t.alloc(6 * MIB)
    for s in [10 * MIB - 1, 11 * MIB + 1, 33 * MIB, 64 * MIB]:
        t.free(t.alloc(s))
    t.alloc(12 * MIB)
    return t.finish()


def best_fit():
    """get_free_block: the smallest cached block of the stream at least as large; no split of a
    remainder of 1 MiB or less in the large pool."""
    t = Trace()
    ids = [t.alloc(s * MIB) for s in [12, 16, 14, 30, 22]]
    for id_ in ids:
        t.free(id_)
    t.alloc(13 * MIB)
    t.alloc(12 * MIB, stream=1)
    t.alloc(12 * MIB)
    t.alloc(21 * MIB)
    t.alloc(15 * MIB)
    return t.finish()


def split_merge():
    """should_split and try_merge_blocks: remainders above and below the thresholds, frees that
    merge with one, two or no neighbours."""
    t = Trace()
    t.free(t.alloc(19 * MIB))
    a = t.alloc(5 * MIB)
    b = t.alloc(14 * MIB - 512 * KIB)
    c = t.alloc(MIB)
    d = t.alloc(MIB - 512)
    e = t.alloc(512)
    x, y, z = (t.alloc(256 * KIB) for _ in range(3))
    t.mark("merge")
    for id_ in [y, z, x, b, a, d, c, e]:
        t.free(id_)
    t.alloc(18 * MIB)
    return t.finish()


def streams():
    """Blocks cached on one stream are never reused by another."""
    t = Trace()
    rng = random.Random(3)
    live = []
    for i in range(600):
        stream = i % 3
        if live and rng.random() < 0.45:
            t.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randrange(1, MIB), rng.randrange(MIB, 12 * MIB), rng.randrange(12 * MIB, 40 * MIB)])
            live.append(t.alloc(size, stream))
    return t.finish()


def oversize():
    """max_split_size_mb (run under max_split_size_mb:64): blocks of 64 MiB or more are not split,
    not used for requests below 64 MiB, and not for requests 20 MiB or more below their size."""
    t = Trace()
    t.free(t.alloc(100 * MIB))
    t.alloc(40 * MIB)
    t.free(t.alloc(70 * MIB))
    t.alloc(90 * MIB)
    big = t.alloc(200 * MIB)
    t.free(big)
    t.alloc(150 * MIB)
    t.alloc(185 * MIB)
    for s in [66, 80, 64, 120]:
        t.free(t.alloc(s * MIB))
    t.alloc(65 * MIB)
    return t.finish()


def empty_cache():
    """release_cached_blocks: only segments with nothing allocated go back."""
    t = Trace()
    keep = [t.alloc(5 * MIB), t.alloc(300 * KIB), t.alloc(40 * MIB)]
    drop = [t.alloc(5 * MIB), t.alloc(30 * MIB), t.alloc(200 * KIB), t.alloc(1 * MIB)]
    for id_ in drop:
        t.free(id_)
    t.empty_cache()
    t.free(keep[0])
    t.empty_cache()
    t.alloc(25 * MIB)
    t.empty_cache()
    return t.finish()


def expandable_growth():
    """expandable_segments (run under expandable_segments:True): one segment grows page by page;
    frees leave holes that empty_cache unmaps only where whole pages are free."""
    t = Trace()
    ids = [t.alloc(s * MIB + 12345) for s in range(1, 40, 3)]
    small = [t.alloc(s * KIB) for s in range(1, 400, 37)]
    t.mark("holes")
    for id_ in ids[::2] + small[::2]:
        t.free(id_)
    t.empty_cache()
    ids += [t.alloc(s * MIB) for s in (7, 45, 3, 90)]
    t.empty_cache()
    return t.finish()


def pressure():
    """Past 2% of the device (run under the per_process_memory_fraction configs): the retries
    (release_available_cached_blocks, release_cached_blocks), garbage collection, and an
    out-of-memory error where even those do not help."""
    t = Trace()
    live = [t.alloc(64 * MIB) for _ in range(40)]
    for id_ in live[::2]:
        t.free(id_)
    t.mark("larger")
    more = [t.alloc(100 * MIB) for _ in range(14)]
    for id_ in more[::3]:
        t.free(id_)
    t.mark("over")
    t.alloc(1500 * MIB)
    return t.finish()


def training(seed=11, steps=3, layers=24):
    """A training-like step, seeded: forward keeps activations and frees temporaries, backward
    frees them in reverse making gradients, the optimizer makes and frees its temporaries."""
    rng = random.Random(seed)
    t = Trace()

    def activation():
        return rng.choice([rng.randrange(1, 4 * KIB), rng.randrange(4 * KIB, MIB),
                           rng.randrange(MIB, 16 * MIB), rng.randrange(16 * MIB, 96 * MIB)])

    params = [t.alloc(rng.randrange(1, 32) * MIB) for _ in range(layers)]
    grads = []
    for step in range(steps):
        t.mark(f"step {step} forward")
        saved = []
        for _ in range(layers):
            saved += [t.alloc(activation()) for _ in range(rng.randrange(2, 6))]
            t.free(t.alloc(activation(), stream=rng.randrange(2)))
        t.mark(f"step {step} backward")
        for id_ in grads:
            t.free(id_)
        grads = []
        while saved:
            grad_input = t.alloc(activation())
            t.free(saved.pop())
            t.free(grad_input)
        grads = [t.alloc(rng.randrange(1, 32) * MIB) for _ in params]
        t.mark(f"step {step} optimizer")
        for _ in params:
            t.free(t.alloc(rng.randrange(1, 32) * MIB))
    return t.finish()


TRACES = {
    "rounding": rounding,
    "small_pool": small_pool,
    "segment_sizes": segment_sizes,
    "best_fit": best_fit,
    "split_merge": split_merge,
    "streams": streams,
    "oversize": oversize,
    "empty_cache": empty_cache,
    "expandable_growth": expandable_growth,
    "pressure": pressure,
    "training": training,
}


def document(events, alloc_conf=""):
    return {"format": FORMAT, "alloc_conf": alloc_conf, "events": events}


def write_all(out_dir):
    """Writes every trace to out_dir/<name>.json; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, build in TRACES.items():
        path = os.path.join(out_dir, name + ".json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(document(build()), f, separators=(",", ":"))
        os.replace(tmp, path)
        paths.append(path)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the traces (created if missing)")
    args = parser.parse_args(argv)
    for path in write_all(args.out):
        print(path)


if __name__ == "__main__":
    main()
