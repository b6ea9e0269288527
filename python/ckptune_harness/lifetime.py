"""Processes that do not outlive the one that started them (Linux's parent-death signal,
PR_SET_PDEATHSIG): the FSDP run's ranks, the run itself under `ckptune verify --pytorch`, and the
torchrun ranks of the snippet tests."""

import ctypes
import os
import signal


def _signal_with_parent(parent, sig):
    """Linux: deliver `sig` to this process when `parent`, the process that started it, dies,
    however it dies (PR_SET_PDEATHSIG). Returns False when `parent` is already gone (it died
    before the signal was armed); True where the signal cannot be armed (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return True
    return os.getppid() == parent


def die_with_parent(parent):
    """A rank: SIGKILL it when the process that started it dies."""
    if not _signal_with_parent(parent, signal.SIGKILL):
        os._exit(1)


def exit_with_parent(parent):
    """The harness: SIGTERM it when `parent` dies; the FSDP CLI's SIGTERM handler leaves through
    the run's cleanup, which kills and reaps the ranks. For callers that cannot arm the signal on
    their child themselves (`ckptune verify --pytorch`). Returns False when `parent` is already
    gone."""
    return _signal_with_parent(parent, signal.SIGTERM)
