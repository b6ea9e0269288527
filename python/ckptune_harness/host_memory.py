"""Freed host memory kept by this process while its CPU steps run, as ckptune's runtime keeps it
(kernels/src/host_memory.rs), so that a step here is timed like ckptune's.

glibc's malloc maps an allocation of 32 MiB or more on its own and unmaps it on free, and returns
its heap's top to the kernel once enough of it is free, so each training step pays the kernel to
fault its large tensors in afresh (a third of GPT-2's step at batch 8 on the machines of
`results/cost/`). With `M_MMAP_MAX` 0 and `M_TRIM_THRESHOLD` -1 (off, as mallopt(3) documents)
every step reuses the pages the step before touched, as the CUDA caching allocator does on a GPU
and jemalloc or tcmalloc do when preloaded. The counted bytes are the tensors' own, so no memory
figure changes. On a C library other than glibc this does nothing.
"""

import ctypes

# malloc.h's parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def hold():
    """Keeps freed memory with this process from now on. Returns whether the C library took it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))
