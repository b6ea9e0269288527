"""Starting an FSDP run's N rank processes and ending every one of them.

The parent serves the rendezvous store (gloo over 127.0.0.1) on a port the OS picks unless one
is given, and holds it for the whole run. Each rank is `python -m ckptune_harness.fsdp --worker
SPEC RANK` in a session of its own, dying with the parent (lifetime.py). Every path out of
`launch` (success, a failing rank, the timeout, Ctrl-C) kills and reaps the ranks before it
returns or raises.
"""

import dataclasses
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, NamedTuple

from .errors import FsdpError, FsdpTimeout
from .spec import RunSpec, rank_file, worker_args

# python/: where ckptune_harness and ckptune are, for the ranks' imports.
_PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Launched(NamedTuple):
    """A completed run: its spec with the port the store had, each rank's result, the pids."""

    spec: RunSpec
    ranks: List[Dict[str, Any]]
    pids: List[int]


def launch(spec):
    """Runs the spec's ranks to completion. Raises FsdpError when the store cannot be served or a
    rank fails (naming the first rank to fail, with its traceback), FsdpTimeout after the spec's
    timeout; the ranks are gone either way."""
    store = _serve_store(spec.port)
    spec = dataclasses.replace(spec, port=store.port)
    tmp = tempfile.mkdtemp(prefix="ckptune-fsdp-")
    procs, logs = [], []
    try:
        spec_path = os.path.join(tmp, "spec.json")
        spec.write(spec_path)
        env = _rank_env()
        for rank in range(spec.world_size):
            log = open(rank_file(tmp, rank, "log"), "wb")
            logs.append(log)
            # A session of its own: Ctrl-C in a terminal reaches the parent only, which then
            # kills every rank (a rank that died alone would leave the others blocked in gloo).
            procs.append(subprocess.Popen([sys.executable, *worker_args(spec_path, rank)],
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
        pids = [p.pid for p in procs]
        _wait(procs, tmp, spec)
        ranks = []
        for rank in range(spec.world_size):
            with open(rank_file(tmp, rank, "json")) as f:
                ranks.append(json.load(f))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for log in logs:
            log.close()
        del store
        shutil.rmtree(tmp, ignore_errors=True)
    return Launched(spec, ranks, pids)


def _serve_store(port):
    """The rendezvous store, served by the parent itself: the port is bound here and held for the
    whole run, so no other process can take it between choosing and using it."""
    import torch.distributed as dist  # noqa: PLC0415

    try:
        return dist.TCPStore("127.0.0.1", int(port), None, True, timeout=datetime.timedelta(seconds=60),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if port:
            raise FsdpError(f"cannot serve the rendezvous on 127.0.0.1:{port} (is the port taken? pass port=0 "
                            f"to let the OS choose a free one): {e}") from None
        raise FsdpError(f"cannot serve the rendezvous on 127.0.0.1: {e}") from None


def _rank_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_PYTHON_DIR] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    if "GLOO_SOCKET_IFNAME" not in env:
        lo = _loopback_interface()
        if lo:
            env["GLOO_SOCKET_IFNAME"] = lo  # gloo's pairs bind here, not on the host's address
    return env


def _loopback_interface():
    """The loopback interface's name (`lo` on Linux, `lo0` on macOS), if there is one."""
    return next((name for _, name in socket.if_nameindex() if re.fullmatch(r"lo\d*", name)), None)


def _wait(procs, tmp, spec):
    """Returns when every rank has exited 0; raises at the first failure or at the timeout."""
    n, pids = len(procs), [p.pid for p in procs]
    deadline = time.monotonic() + spec.timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank = _first_failure(tmp, failed)
            raise FsdpError(f"rank {rank} of {n} failed (exit {codes[rank]}):\n{_failure_text(tmp, rank)}",
                            pids, rank)
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise FsdpTimeout(f"the {n} ranks did not finish within {spec.timeout:g} s; killed them", pids)
        time.sleep(0.05)


def _first_failure(tmp, failed):
    """Of the failed ranks, the one whose error came first: a rank's failure makes its peers
    fail in their next collective, and the cause is the earliest."""
    def when(rank):
        try:
            with open(rank_file(tmp, rank, "error")) as f:
                return json.load(f)["time"]
        except (OSError, ValueError, KeyError):
            return float("inf")
    return min(failed, key=lambda r: (when(r), r))


def _failure_text(tmp, rank):
    try:
        with open(rank_file(tmp, rank, "error")) as f:
            return json.load(f)["traceback"].rstrip()
    except (OSError, ValueError, KeyError):
        pass
    try:
        with open(rank_file(tmp, rank, "log"), "rb") as f:
            text = f.read()[-4000:].decode(errors="replace").rstrip()
        return text or "(no output)"
    except OSError:
        return "(no output)"
