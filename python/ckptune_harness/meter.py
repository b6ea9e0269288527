"""ckptune's counting CPU allocator, for a PyTorch process.

Compiles `kernels/csrc/meter.cpp` (the very meter ckptune links) into a shared library against
the libtorch that the venv's torch package ships, caches it under a name that carries the hash
of the source, the compile command and the torch version, and loads it with ctypes. After
`install()`, every CPU tensor allocation of this process is counted exactly as in ckptune:
`current()`, `peak()`, `reset_peak()` (peak := current).

It compiles the meter from a ckptune checkout: the one this file sits in
(python/ckptune_harness/), or the one $CKPTUNE_ROOT names when this file is used from elsewhere.
It imports nothing of its package, so it also runs as a script:

    python python/ckptune_harness/meter.py build   # compile (or find cached) and print the library path
"""

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import time

# Resolved, so that `planner/..` and the checkout's own path give one build key.
ROOT = os.path.realpath(
    os.environ.get("CKPTUNE_ROOT") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
SOURCE = os.path.join(ROOT, "kernels", "csrc", "meter.cpp")
HEADERS = [os.path.join(ROOT, "kernels", "csrc", h) for h in ("common.h", "meter.h")]
DEFAULT_BUILD = os.path.join(ROOT, "results", "bench", ".build")


def libtorch_dir():
    """The torch package directory (include/ and lib/) of this interpreter's torch: the libtorch
    the PyTorch side runs on, and the one `scripts/setup` links to `.libtorch` for ckptune. (Not
    read through the `.libtorch` link, which a concurrent set-up may be re-creating.)"""
    import torch  # noqa: PLC0415

    return os.path.realpath(os.path.dirname(torch.__file__))


def compile_command(t, out):
    return [
        os.environ.get("CXX", "g++"), "-O2", "-shared", "-fPIC", "-std=c++17",
        "-D_GLIBCXX_USE_CXX11_ABI=1", "-DGLOG_USE_GLOG_EXPORT", "-w",
        f"-I{t}/include", f"-I{t}/include/torch/csrc/api/include",
        SOURCE, f"-L{t}/lib", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{t}/lib", "-o", out,
    ]


def build(build_dir=None):
    """Path of the compiled meter library, compiling it if no cached build matches."""
    build_dir = build_dir or os.environ.get("CKPTUNE_BENCH_BUILD", DEFAULT_BUILD)
    if not os.path.exists(SOURCE):
        raise SystemExit(f"meter: {SOURCE} not found: the meter compiles ckptune's shim from a checkout; "
                         f"set CKPTUNE_ROOT to a ckptune checkout")
    t = libtorch_dir()
    src = b""
    for path in (SOURCE, *HEADERS):  # the source and the headers it includes
        with open(path, "rb") as f:
            src += f.read()
    version_file = os.path.join(t, "version.py")
    if os.path.exists(version_file):
        with open(version_file) as f:
            torch_version = f.read()
    else:
        torch_version = t
    key = hashlib.sha256(src + " ".join(compile_command(t, "OUT")).encode() + torch_version.encode())
    out = os.path.join(build_dir, f"libckptune_meter-{key.hexdigest()[:16]}.so")
    if os.path.exists(out):
        return out
    os.makedirs(build_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libckptune_meter-", suffix=".so.tmp", dir=build_dir)
    os.close(fd)
    try:
        r = subprocess.run(compile_command(t, tmp), capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(
                f"meter: compiling the meter from {SOURCE} failed (exit {r.returncode}):\n"
                f"{' '.join(compile_command(t, tmp))}\n{r.stderr[-4000:]}"
            )
        os.replace(tmp, out)
        _remove_stale(build_dir, keep=out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


STALE_SECONDS = 7 * 24 * 3600


def _remove_stale(build_dir, keep):
    """Removes builds of an older shim or torch, once they are a week old: a build that another
    interpreter (the trainers' venv, a concurrent test) has just made or handed to its ranks is
    in use, though its key differs from this one."""
    now = time.time()
    for name in os.listdir(build_dir):
        path = os.path.join(build_dir, name)
        if not (name.startswith("libckptune_meter-") and name.endswith(".so")) or path == keep:
            continue
        try:
            if now - os.path.getmtime(path) > STALE_SECONDS:
                os.remove(path)
        except FileNotFoundError:  # removed by a concurrent build
            pass


class Meter:
    """The loaded, installed meter. Load only after `import torch`."""

    def __init__(self, path):
        if "torch" not in sys.modules:
            raise RuntimeError("import torch before loading the meter (it links the same libtorch)")
        self.path = path
        self.lib = ctypes.CDLL(path)
        for name in ("ckpt_meter_current", "ckpt_meter_peak", "ckpt_meter_allocs"):
            getattr(self.lib, name).restype = ctypes.c_int64
            getattr(self.lib, name).argtypes = []
        self.lib.ckpt_meter_reset_peak.restype = None
        self.lib.ckpt_meter_install.restype = ctypes.c_int
        self.lib.ckpt_meter_install.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
        err = ctypes.c_char_p()
        if self.lib.ckpt_meter_install(ctypes.byref(err)) != 0:
            raise RuntimeError(f"ckpt_meter_install failed: {err.value.decode(errors='replace')}")

    def current(self):
        return int(self.lib.ckpt_meter_current())

    def peak(self):
        return int(self.lib.ckpt_meter_peak())

    def reset_peak(self):
        self.lib.ckpt_meter_reset_peak()


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        raise SystemExit("usage: meter.py build")
    print(build())
