"""wrk runs shared by the benchmarks: wrk's command line, its figures, and sampling a run in progress.

``bench_single.py`` drives one node with one wrk; ``bench_cluster.py`` drives three nodes with one wrk
each. Both sample the nodes' counters and CPU every 100 ms while wrk runs (``sample_until``) and take
rates and CPU per operation over the steady part of the run (``steady_figures``). The Lua scripts in
``lua/`` print their figures as one ``WRKJSON {...}`` line (``wrk_figures`` reads it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["LUA", "Reading", "Sample", "sample_until", "steady_figures", "wrk_command", "wrk_figures"]

LUA = Path(__file__).resolve().parent / "lua"
#: (server CPU s, operations counted so far, machine busy CPU s, CPU s of the load generators and the driver)
Reading = tuple[float, int, float, float]
#: (t since start, server CPU s, count, machine busy s, load generators + driver CPU s)
Sample = tuple[float, float, int, float, float]
_ERROR_KEYS = ("err_connect", "err_read", "err_write", "err_status", "err_timeout")


def wrk_command(url: str, script: str, script_args: list[str], *, conns: int, seconds: int) -> list[str]:
    """``wrk`` with one thread (so every connection shares the script's counter) and a ``lua/`` script."""
    return [
        "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{seconds}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA / script),
        url,
        "--",
        *script_args,
    ]


def wrk_figures(wrk: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Stop ``wrk`` (SIGINT) if it still runs; its ``WRKJSON`` figures, with ``errors`` summed."""
    if wrk.poll() is None:
        wrk.send_signal(signal.SIGINT)
    output = wrk.communicate(timeout=30)[0].decode(errors="replace")
    figures: dict[str, Any] = {}
    for line in output.splitlines():
        if line.startswith("WRKJSON "):
            figures = json.loads(line[len("WRKJSON ") :])
    if not figures:
        raise RuntimeError(f"wrk printed no figures:\n{output}")
    figures["errors"] = sum(figures[k] for k in _ERROR_KEYS)
    return figures


def sample_until(
    read: Callable[[], Reading],
    running: Callable[[], bool],
    t0: float,
    duration: float,
    limit: int | None,
    *,
    label: str,
    log: Callable[[str], None],
) -> list[Sample]:
    """Every 100 ms while ``running()``: ``read()``, stamped with the time since ``t0`` (monotonic).

    Stops after ``duration`` s, or (with a ``limit``) once the count reaches it or has not moved for 3 s.
    """
    samples: list[Sample] = []
    stalled_since = None
    while running():
        cpu, count, busy, ours = read()
        now = time.monotonic()
        samples.append((now - t0, cpu, count, busy, ours))
        if limit is None:
            if now - t0 >= duration:
                break
        elif count >= limit:
            break
        elif len(samples) > 1 and count == samples[-2][2]:
            stalled_since = stalled_since or now
            if now - stalled_since > 3.0:
                log(f"counter {label} stopped at {count} of {limit}")
                break
        else:
            stalled_since = None
        time.sleep(0.1)
    return samples


def steady_figures(samples: list[Sample], warmup: float, limit: int | None) -> dict[str, float]:
    """Rate and CPU per operation between the first sample after ``warmup`` and the last one before the end
    (for a limited run, before 98 % of ``limit``)."""
    steady = [s for s in samples if s[0] >= warmup and (limit is None or s[2] <= 0.98 * limit)]
    if len(steady) < 2:
        steady = samples
    (ta, ca, na, ba, oa), (tb, cb, nb, bb, ob) = steady[0], steady[-1]
    ops, dt = nb - na, tb - ta
    nan = float("nan")
    return {
        "window_s": dt,
        "rate": ops / dt if dt > 0 else nan,
        "cpu_us_per_op": (cb - ca) * 1e6 / ops if ops else nan,
        "server_cpu_util": (cb - ca) / dt if dt > 0 else nan,
        # CPU used by processes other than the servers, the load generators and the driver
        "other_load": max(0.0, (bb - ba) - (cb - ca) - (ob - oa)) / dt if dt > 0 else nan,
    }
