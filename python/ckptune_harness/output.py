"""The harness's JSON results: written whole or not at all, and the optimizer settings they
record."""

import json
import os
import sys
import tempfile


def write_atomic(path, obj):
    """`obj` (JSON, or a str as it is) to `path` through a synced temporary file and a rename: a
    reader never sees half a file, and a failed write leaves the old one."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            if isinstance(obj, str):
                f.write(obj)
            else:
                json.dump(obj, f, indent=2)
                f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_output(path, doc):
    """A command's JSON result: to `path` atomically when one is given, else to stdout."""
    if path:
        write_atomic(path, doc)
    else:
        json.dump(doc, sys.stdout, indent=2)
        print()


def optimizer_settings(opt):
    """The optimizer's settings (its first parameter group's, `params` aside) that JSON holds as
    they are: numbers, strings, booleans, None and tuples of numbers."""
    return {k: v for k, v in opt.param_groups[0].items() if k != "params" and _plain(v)}


def _plain(v):
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v))
