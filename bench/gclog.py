"""Run ``python -m skyring ...`` with a ``gc.callbacks`` hook that logs slow or full collections to stderr.

    python bench/gclog.py serve --port 0 --storage memory

Each full (generation 2) collection, and any collection over 5 ms, prints
``GCLOG gen=<g> ms=<duration> collected=<n>``. The hook costs about a microsecond per collection; it
changes nothing else in the server.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import time
from typing import Any

_started = [0.0]


def _hook(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _started[0]) * 1000.0
    if info["generation"] == 2 or ms > 5.0:
        print(f"GCLOG gen={info['generation']} ms={ms:.1f} collected={info['collected']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    gc.callbacks.append(_hook)
    sys.path.insert(0, os.getcwd())  # like ``python -m``: the skyring in the working directory wins
    sys.argv = ["skyring", *sys.argv[1:]]
    runpy.run_module("skyring", run_name="__main__", alter_sys=True)
