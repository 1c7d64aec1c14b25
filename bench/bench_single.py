"""Single-node benchmarks: creates, cancels, fire lateness, memory per timer, loop stalls, durable creates.

Starts its own ``skyring serve`` processes (port 0) and drives them over HTTP from 64 concurrent
connections with ``wrk`` (Debian package) and small helpers in this directory. Prints figures; it is
not a test. Run from the repository root with the project's venv (see docs/benchmarks.md):

    .venv/bin/python bench/bench_single.py --repeat 3           # everything, ~8-10 min
    .venv/bin/python bench/bench_single.py --only creates,cancels --repeat 3
    .venv/bin/python bench/bench_single.py --only creates,cancels,sqlite --profile /tmp/prof   # py-spy

Parts (``--only``): baseline (a bare aiohttp app under the same loads), creates, cancels, lateness,
memory, stall, sqlite, rebuild (in-process: the heap compaction a mass cancel triggers).
By default the server is pinned to CPU 0 and everything else (wrk, pinger, receiver, this script)
to CPU 1, so the load generator does not take CPU from the server (``--no-pin`` to turn that off).
Server CPU comes from ``/proc/<pid>/stat`` (utime + stime, all threads), RSS from ``/proc/<pid>/status``.
Rates and CPU per operation are taken over the steady part of a run, from the node's own counters
(``GET /health`` every 100 ms), so wrk's warm-up and wind-down do not count. Before each run the
script waits (``--quiet-wait``) for other processes on the machine to go quiet, measures how much CPU
they took during the run anyway ("other load"), and sets disturbed runs aside when taking medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from minihttp import Connection, split_url  # noqa: E402
from pinger import percentile  # noqa: E402
from pyspy_summary import render, summarize  # noqa: E402
from wrkload import Reading, sample_until, steady_figures, wrk_command, wrk_figures  # noqa: E402

PARTS = ("baseline", "creates", "cancels", "lateness", "memory", "stall", "sqlite", "rebuild")
HOUR_MS = 3_600_000
# ~150 bytes of JSON: the `data` every benchmark timer carries.
DATA = json.dumps(
    {
        "user": "u-7f3a9c2e",
        "event": "invoice.reminder",
        "invoice": "INV-2026-000123456",
        "amount": {"value": 129.95, "currency": "EUR"},
        "note": "bench payload 12345",
    },
    separators=(",", ":"),
)
NOWHERE = "http://127.0.0.1:9/never"  # callback of timers that never fire in the benchmark
TICK = os.sysconf("SC_CLK_TCK")
SRC = ROOT  # the skyring source tree the nodes run from (--src)
QUIET_WAIT_S = 0.0  # set from --quiet-wait: before each measured run, wait for other processes to go quiet


def system_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all CPUs; user+nice+system+irq+softirq+steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / TICK


def proc_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def wait_quiet(max_wait_s: float, busy_limit: float = 0.15) -> float:
    """Wait (up to ``max_wait_s``) until the machine is nearly idle; returns the last busy fraction of a CPU."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0 = system_busy_s()
        time.sleep(1.0)
        busy = system_busy_s() - b0
        if busy <= busy_limit or time.monotonic() > deadline:
            if busy > busy_limit:
                log(f"machine still busy ({busy * 100:.0f}% of a CPU) after waiting {max_wait_s:.0f} s; going on")
            return busy
        log(f"machine busy ({busy * 100:.0f}% of a CPU used by other processes); waiting")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def out(msg: str = "") -> None:
    print(msg, flush=True)


def median_range(values: list[float], fmt: str = "{:.0f}") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    low, mid, high = (fmt.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} [{low}..{high}] (n={len(values)})"


# -- processes ---------------------------------------------------------------------------------


class Pinning:
    """Which CPUs each process may use; ``None`` leaves the scheduler free."""

    def __init__(self, enabled: bool) -> None:
        ncpu = os.cpu_count() or 1
        self.enabled = enabled and ncpu >= 2
        self.server = {0} if self.enabled else None
        self.load = set(range(1, ncpu)) if self.enabled else None

    def preexec(self, cpus: set[int] | None) -> Callable[[], None] | None:
        if cpus is None:
            return None
        return lambda: os.sched_setaffinity(0, cpus)

    def describe(self) -> str:
        if not self.enabled:
            return "none (all processes share all CPUs)"
        server, load = sorted(self.server or ()), sorted(self.load or ())
        return f"server on CPU {server}, wrk/pinger/receiver/this script on CPU {load}"


class NodeProcess:
    """A ``skyring serve`` child process on port 0."""

    def __init__(
        self,
        pinning: Pinning,
        storage: str = "memory",
        data_dir: str | None = None,
        cpus: set[int] | None | bool = True,
        command: list[str] | None = None,
        gc_log: bool = False,
    ) -> None:
        """``cpus``: the CPUs to pin it to; ``True`` means the server CPU of ``pinning``.
        ``command``: another server that prints the same ready line (``baseline_server.py``).
        ``gc_log``: run it under ``gclog.py``, which logs full and slow garbage collections."""
        launcher = [str(HERE / "gclog.py")] if gc_log else ["-m", "skyring"]
        argv = [sys.executable, *launcher, "serve", "--port", "0", "--storage", storage, "--log-level", "warning"]
        if data_dir is not None:
            argv += ["--data-dir", data_dir]
        if command is not None:
            argv = command
        self.cpus = pinning.server if cpus is True else (cpus or None)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            argv,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd=SRC,
            env=env,
            preexec_fn=pinning.preexec(self.cpus),
        )
        self.pid = self.proc.pid
        self.log: deque[str] = deque(maxlen=200)
        self.gc_events: list[tuple[float, int, float]] = []  # (monotonic time, generation, ms)
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 30
        while True:
            line = self.proc.stderr.readline().decode(errors="replace")
            if not line:
                raise RuntimeError("skyring exited before it was ready:\n" + "".join(self.log))
            self.log.append(line)
            if line.startswith("skyring ready"):
                fields = dict(item.split("=", 1) for item in line.split()[2:])
                self.url = fields["url"]
                break
            if time.monotonic() > deadline:
                raise RuntimeError("skyring did not get ready in 30 s")
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()
        self.host, self.port = split_url(self.url)
        self._http = http.client.HTTPConnection(self.host, self.port, timeout=30)

    def _read_rest(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            if line.startswith("GCLOG "):
                fields = dict(item.split("=", 1) for item in line.split()[1:])
                self.gc_events.append((time.monotonic(), int(fields["gen"]), float(fields["ms"])))
            else:
                self.log.append(line)

    def gc_summary(self, since: float) -> str:
        """Full collections (and slow young ones) logged since monotonic time ``since``."""
        events = [e for e in self.gc_events if e[0] >= since]
        full = [ms for _, gen, ms in events if gen == 2]
        slow_young = [ms for _, gen, ms in events if gen < 2]
        if not events:
            return "no full GC"
        text = f"{len(full)} full GC{'' if len(full) == 1 else 's'}"
        if full:
            text += f" (max {max(full):.0f} ms, total {sum(full):.0f} ms)"
        if slow_young:
            text += f", {len(slow_young)} young GCs over 5 ms (max {max(slow_young):.0f} ms)"
        return text

    def get(self, path: str) -> Any:
        for attempt in range(2):
            try:
                self._http.request("GET", path)
                response = self._http.getresponse()
                body = response.read()
                return json.loads(body) if body else None
            except (http.client.HTTPException, OSError):
                self._http.close()
                if attempt:
                    raise
        return None

    def health(self) -> dict[str, Any]:
        return self.get("/health")  # type: ignore[no-any-return]

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        self._http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        bad = [line for line in self.log if " ERROR " in line or "Traceback" in line]
        if bad:
            log("server logged errors:\n" + "".join(list(self.log)[-20:]))


@contextlib.contextmanager
def node(pinning: Pinning, **kwargs: Any) -> Iterator[NodeProcess]:
    proc = NodeProcess(pinning, **kwargs)
    try:
        yield proc
    finally:
        proc.stop()


class Receiver:
    """``bench/receiver.py`` as a child process."""

    def __init__(self, pinning: Pinning) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "receiver.py")],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            preexec_fn=pinning.preexec(pinning.load),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("receiver ready"):
            raise RuntimeError(f"receiver did not start: {line!r}")
        self.port = int(line.split("port=")[1])
        self.uri = f"http://127.0.0.1:{self.port}/cb"

    def _call(self, method: str, path: str) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path)
            body = conn.getresponse().read()
            return json.loads(body) if body else None
        finally:
            conn.close()

    def reset(self) -> None:
        self._call("POST", "/reset")

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/stats")  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class PySpy:
    """``py-spy record`` attached to the server for the length of a run (raw collapsed stacks)."""

    def __init__(self, pid: int, path: Path, pinning: Pinning, rate: int, native: bool) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        # Blocking mode (the default): py-spy pauses the server for each sample. --nonblocking is
        # cheaper but gave impossible stacks here (a frame reading headers "calling" a socket write).
        argv = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--output", str(path)]
        if native:
            argv.append("--native")
        self.path = path
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            preexec_fn=pinning.preexec(pinning.load),
        )

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.path.exists():
            log(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")


# -- wrk runs -----------------------------------------------------------------------------------


def run_wrk(
    server: NodeProcess,
    pinning: Pinning,
    script: str,
    script_args: list[str],
    *,
    counter: str,
    duration: float,
    limit: int | None = None,
    warmup: float = 2.0,
    conns: int = 64,
    profile: PyspyTarget | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Run wrk against ``server`` until ``duration`` passes or the node's ``counter`` grew by ``limit``.

    Returns wrk's own figures plus the node's rate and CPU per operation over the steady window
    (after ``warmup`` s; for a limited run, until 98 % of ``limit`` was reached).
    """
    if quiet and QUIET_WAIT_S > 0:
        wait_quiet(QUIET_WAIT_S)
    base = server.health()["counters"][counter]
    wrk_seconds = int(duration + 1) if limit is None else int(duration + 60)
    argv = wrk_command(server.url, script, script_args, conns=conns, seconds=wrk_seconds)
    t0 = time.monotonic()
    wrk = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=pinning.preexec(pinning.load),
    )
    spy = None
    if profile is not None:
        time.sleep(min(warmup, 1.0))
        spy = PySpy(server.pid, profile.path, pinning, profile.rate, profile.native)

    def read() -> Reading:
        count = server.health()["counters"][counter] - base
        ours = proc_cpu_s(wrk.pid) + proc_cpu_s(os.getpid())
        return server.cpu_s(), count, system_busy_s(), ours

    samples = sample_until(read, lambda: wrk.poll() is None, t0, duration, limit, label=counter, log=log)
    if spy is not None:
        spy.stop()
    figures = wrk_figures(wrk)
    figures["count"] = server.health()["counters"][counter] - base
    return figures | steady_figures(samples, warmup, limit)


class PyspyTarget:
    def __init__(self, path: Path, rate: int, native: bool) -> None:
        self.path, self.rate, self.native = path, rate, native


def fmt_run(r: dict[str, Any]) -> str:
    return (
        f"{r['rate']:,.0f}/s  p50 {r['p50_us'] / 1000:.2f} ms  p99 {r['p99_us'] / 1000:.2f} ms  "
        f"max {r['max_us'] / 1000:.1f} ms  server CPU {r['cpu_us_per_op']:.1f} µs/op "
        f"({r['server_cpu_util'] * 100:.0f}% of a core)  count {r['count']:,}  errors {r['errors']}  "
        f"other load {r['other_load'] * 100:.0f}% of a CPU"
    )


NOISY = 0.25  # a run during which other processes used more than this share of a CPU is set aside


def clean(runs: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """The runs not disturbed by other processes (``other_load`` ≤ NOISY); all of them if none is clean."""
    quiet = [r for r in runs if not r["other_load"] > NOISY]
    if len(quiet) < len(runs):
        dropped = [f"{r['other_load'] * 100:.0f}%" for r in runs if r["other_load"] > NOISY]
        if quiet:
            log(f"{what}: {len(dropped)} of {len(runs)} runs set aside, other processes used {dropped} of a CPU")
        else:
            log(f"{what}: every run was disturbed by other processes ({dropped} of a CPU); keeping them all")
            return runs
    return quiet


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("rate", "cpu_us_per_op", "p50_us", "p99_us", "max_us", "server_cpu_util")
    return {k: statistics.median([r[k] for r in runs]) for k in keys} | {
        "runs": runs,
        "n": len(runs),
        "errors": sum(r["errors"] for r in runs),
    }


# -- parts --------------------------------------------------------------------------------------


def create_body(timeout_ms: int, uri: str) -> bytes:
    """The POST /timer body; the same as ``lua/create.lua`` builds."""
    callback = f'{{"transport":"http","method":"post","uri":"{uri}"}}'
    return f'{{"timeout":{timeout_ms},"data":{DATA},"callback":{callback}}}'.encode()


def create_args(timeout_ms: int = HOUR_MS, uri: str = NOWHERE, id_format: str = "-", limit: int = 0) -> list[str]:
    return [str(timeout_ms), DATA, uri, id_format, str(limit)]


def part_baseline(a: argparse.Namespace, pin: Pinning, results: dict[str, Any]) -> None:
    """The same create and cancel loads against a bare aiohttp app (``baseline_server.py``)."""
    creates, cancels = [], []
    command = [sys.executable, str(HERE / "baseline_server.py"), "--port", "0"]
    for i in range(a.repeat):
        with node(pin, command=command) as server:
            r = run_wrk(server, pin, "create.lua", create_args(), counter="created", duration=a.duration)
            n = a.cancel_n
            c = run_wrk(
                server, pin, "cancel.lua", ["b-%d", "0", str(n)], counter="cancelled", duration=120, limit=n, warmup=1.0
            )
        log(f"baseline creates run {i + 1}: {fmt_run(r)}")
        log(f"baseline cancels run {i + 1}: {fmt_run(c)}")
        creates.append(r)
        cancels.append(c)
    creates, cancels = clean(creates, "baseline creates"), clean(cancels, "baseline cancels")
    results["baseline"] = {"creates": summarize_runs(creates), "cancels": summarize_runs(cancels)}
    out("baseline: bare aiohttp app, same loads (POST parses the body and answers 201; DELETE answers 202):")
    for name, runs in (("creates", creates), ("cancels", cancels)):
        s = summarize_runs(runs)
        out(
            f"  {name + '/s':<10} {median_range([r['rate'] for r in runs])}; server CPU "
            f"{median_range([r['cpu_us_per_op'] for r in runs], '{:.1f}')} µs/op; "
            f"p50/p99 {s['p50_us'] / 1000:.2f} / {s['p99_us'] / 1000:.2f} ms"
        )


def part_creates(a: argparse.Namespace, pin: Pinning, results: dict[str, Any]) -> None:
    runs = []
    for i in range(a.repeat):
        with node(pin) as server:
            r = run_wrk(server, pin, "create.lua", create_args(), counter="created", duration=a.duration)
            r["pending"] = server.health()["timers"]["pending"]
        log(f"creates run {i + 1}: {fmt_run(r)}")
        runs.append(r)
    runs = clean(runs, "creates")
    results["creates"] = s = summarize_runs(runs)
    out(f"creates (64 conns, {len(DATA)} B data, 1 h timeouts, server picks uuid ids):")
    out(f"  creates/s        {median_range([r['rate'] for r in runs])}")
    out(f"  server CPU/create {median_range([r['cpu_us_per_op'] for r in runs], '{:.1f}')} µs")
    out(
        f"  latency p50/p99  {s['p50_us'] / 1000:.2f} / {s['p99_us'] / 1000:.2f} ms (medians); "
        f"max {max(r['max_us'] for r in runs) / 1000:.1f} ms; errors {s['errors']}"
    )


def part_cancels(a: argparse.Namespace, pin: Pinning, results: dict[str, Any]) -> None:
    runs, pre = [], []
    n = a.cancel_n
    for i in range(a.repeat):
        with node(pin) as server:
            p = run_wrk(
                server,
                pin,
                "create.lua",
                create_args(id_format="b-%d", limit=n),
                counter="created",
                duration=120,
                limit=n,
                warmup=1.0,
            )
            pre.append(p)
            pending = server.health()["timers"]["pending"]
            r = run_wrk(
                server,
                pin,
                "cancel.lua",
                ["b-%d", "0", str(pending)],
                counter="cancelled",
                duration=120,
                limit=pending,
                warmup=1.0,
            )
            r["left"] = server.health()["timers"]["pending"]
        log(f"create with x-timer-id run {i + 1}: {fmt_run(p)}")
        log(f"cancels run {i + 1}: {fmt_run(r)}  left pending {r['left']}")
        runs.append(r)
    runs, pre = clean(runs, "cancels"), clean(pre, "creates with x-timer-id")
    results["cancels"] = s = summarize_runs(runs)
    results["creates_with_id"] = summarize_runs(pre)
    out(f"cancels (64 conns, DELETE /timer/b-<n> of {n:,} pre-created timers):")
    out(f"  cancels/s        {median_range([r['rate'] for r in runs])}")
    out(f"  server CPU/cancel {median_range([r['cpu_us_per_op'] for r in runs], '{:.1f}')} µs")
    out(
        f"  latency p50/p99  {s['p50_us'] / 1000:.2f} / {s['p99_us'] / 1000:.2f} ms (medians); "
        f"max {max(r['max_us'] for r in runs) / 1000:.1f} ms; errors {s['errors']}; "
        f"left pending {[r['left'] for r in runs]}"
    )
    out(
        f"  (pre-create with x-timer-id: {median_range([r['rate'] for r in pre])}/s, "
        f"{median_range([r['cpu_us_per_op'] for r in pre], '{:.1f}')} µs CPU/create)"
    )


async def create_spread(
    url: str | Sequence[str], uri: str, n: int, lead_s: float, window_s: float, conns: int = 64
) -> dict[str, Any]:
    """Create ``n`` timers whose deadlines spread uniformly over ``window_s`` starting ``lead_s`` from now.

    Timers are sent in deadline order, each with ``timeout = deadline − now`` at the moment it is sent.
    ``url``: the node, or several nodes (a cluster): the connections are spread over them in turn.
    """
    urls = [url] if isinstance(url, str) else list(url)
    start_ms = time.time() * 1000.0 + lead_s * 1000.0
    targets = [start_ms + window_s * 1000.0 * i / n for i in range(n)]
    next_index = 0
    min_timeout = float("inf")
    failures = 0

    async def worker(k: int) -> None:
        nonlocal next_index, min_timeout, failures
        conn = await Connection(*split_url(urls[k % len(urls)])).open()
        try:
            while next_index < n:
                i = next_index
                next_index += 1
                timeout = max(1, round(targets[i] - time.time() * 1000.0))
                min_timeout = min(min_timeout, timeout)
                body = create_body(timeout, uri)
                status, _, _ = await conn.request("POST", "/timer", body, [("Content-Type", "application/json")])
                if status != 201:
                    failures += 1
        finally:
            await conn.close()

    t0 = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(conns)))
    return {
        "create_s": time.monotonic() - t0,
        "min_timeout_ms": min_timeout,
        "failures": failures,
        "window_start_ms": start_ms,
        "window_end_ms": start_ms + window_s * 1000.0,
    }


def lateness_figures(stats: dict[str, Any], expected: int) -> dict[str, Any]:
    values = sorted(stats["lateness_ms"])
    return {
        "expected": expected,
        "received": stats["count"],
        "distinct": stats["distinct"],
        "duplicates": stats["duplicates"],
        "early": sum(1 for v in values if v < 0),
        "min_ms": values[0] if values else float("nan"),
        "p50_ms": percentile(values, 50),
        "p99_ms": percentile(values, 99),
        "max_ms": values[-1] if values else float("nan"),
    }


def wait_received(receiver: Receiver, expected: int, until_ms: float, grace_s: float = 10.0) -> dict[str, Any]:
    time.sleep(max(0.0, (until_ms - time.time() * 1000.0) / 1000.0))
    deadline = time.monotonic() + grace_s
    while True:
        stats = receiver.stats()
        if stats["count"] >= expected or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def fmt_late(f: dict[str, Any]) -> str:
    return (
        f"p50 {f['p50_ms']:.2f} ms  p99 {f['p99_ms']:.2f} ms  max {f['max_ms']:.2f} ms  min {f['min_ms']:.2f} ms  "
        f"early {f['early']}  received {f['received']}/{f['expected']} (dup {f['duplicates']})"
    )


def part_lateness(a: argparse.Namespace, pin: Pinning, results: dict[str, Any], receiver: Receiver) -> None:
    runs = []
    for i in range(a.repeat):
        with node(pin) as server:
            if QUIET_WAIT_S > 0:
                wait_quiet(QUIET_WAIT_S)
            receiver.reset()
            made = asyncio.run(create_spread(server.url, receiver.uri, a.late_n, a.late_lead, a.late_window))
            stats = wait_received(receiver, a.late_n, made["window_end_ms"] + 500)
            f = lateness_figures(stats, a.late_n) | made
        log(
            f"lateness run {i + 1}: {fmt_late(f)}  (created in {made['create_s']:.2f} s, "
            f"min timeout {made['min_timeout_ms']} ms, failures {made['failures']})"
        )
        runs.append(f)
    results["lateness"] = {"runs": runs} | {
        k: statistics.median([r[k] for r in runs]) for k in ("p50_ms", "p99_ms", "max_ms")
    }
    out(f"fire lateness ({a.late_n:,} timers due uniformly over {a.late_window:g} s; receive time − deadline):")
    out(f"  p50 {median_range([r['p50_ms'] for r in runs], '{:.2f}')} ms")
    out(f"  p99 {median_range([r['p99_ms'] for r in runs], '{:.2f}')} ms")
    out(f"  max {median_range([r['max_ms'] for r in runs], '{:.2f}')} ms")
    out(
        f"  early fires {sum(r['early'] for r in runs)}; received {[r['received'] for r in runs]} of {a.late_n} each; "
        f"duplicates {sum(r['duplicates'] for r in runs)}"
    )


def run_pinger(server: NodeProcess, pin: Pinning, seconds: float, delay: float = 0.0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            str(HERE / "pinger.py"),
            server.url,
            "--seconds",
            str(seconds),
            "--interval-ms",
            "10",
            "--delay",
            str(delay),
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        preexec_fn=pin.preexec(pin.load),
    )


def pinger_result(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    output = proc.communicate(timeout=120)[0].decode()
    return json.loads(output.strip().splitlines()[-1])  # type: ignore[no-any-return]


def fmt_ping(p: dict[str, Any]) -> str:
    return (
        f"{p['count']} pings: p50 {p['p50_ms']:.2f} ms  p99 {p['p99_ms']:.2f} ms  p99.9 {p['p999_ms']:.2f} ms  "
        f"max {p['max_ms']:.1f} ms  over 50 ms: {p['over_50ms']}  slowest [s, ms]: {p['slowest'][:5]}"
    )


def part_memory_stall(
    a: argparse.Namespace, pin: Pinning, results: dict[str, Any], parts: set[str], receiver: Receiver | None
) -> None:
    # The node runs under gclog.py, so full garbage collections show up with their durations.
    with node(pin, gc_log=True) as server:
        fill_and_measure(a, pin, results, server)
        if "stall" in parts:
            stall_checks(a, pin, results, server, receiver)


def fill_and_measure(a: argparse.Namespace, pin: Pinning, results: dict[str, Any], server: NodeProcess) -> None:
    """Create timers (1 h timeouts) up to each of ``--mem-sizes`` pending; read RSS at each."""
    for _ in range(200):
        server.get("/ping")
    time.sleep(0.5)
    rss0 = server.rss_bytes()
    mem: dict[str, Any] = {"rss_start": rss0, "points": []}
    created = 0
    for size in sorted(a.mem_sizes):
        t0 = time.monotonic()
        more = size - created
        r = run_wrk(
            server, pin, "create.lua", create_args(limit=more), counter="created", duration=600, limit=more, warmup=1.0
        )
        time.sleep(1.0)
        created = pending = server.health()["timers"]["pending"]
        rss = server.rss_bytes()
        point = {
            "pending": pending,
            "rss": rss,
            "bytes_per_timer": (rss - rss0) / pending,
            "create": r,
            "gc": server.gc_summary(t0),
        }
        mem["points"].append(point)
        log(
            f"memory: {pending:,} pending, RSS {rss / 2**20:.1f} MiB (start {rss0 / 2**20:.1f} MiB): "
            f"{point['bytes_per_timer']:.0f} B/timer; created at {fmt_run(r)}; {point['gc']}"
        )
    results["memory"] = mem
    out(
        f"memory (uuid ids, {len(DATA)} B data, 1 h timeouts; (RSS − RSS at start) / pending; "
        f"start {rss0 / 2**20:.1f} MiB):"
    )
    for p in mem["points"]:
        c = p["create"]
        out(f"  {p['pending']:>9,} pending: {p['bytes_per_timer']:.0f} B/timer  (RSS {p['rss'] / 2**20:.0f} MiB)")
        out(
            f"      filled at {c['rate']:,.0f}/s, {c['cpu_us_per_op']:.1f} µs CPU each, wrk p99 "
            f"{c['p99_us'] / 1000:.1f} ms, max {c['max_us'] / 1000:.0f} ms; server: {p['gc']}"
        )


def stall_checks(
    a: argparse.Namespace, pin: Pinning, results: dict[str, Any], server: NodeProcess, receiver: Receiver | None
) -> None:
    """GET /ping every 10 ms while many timers are pending: idle, with timers firing, under create load."""
    stall: dict[str, Any] = {"pending": server.health()["timers"]["pending"]}
    if QUIET_WAIT_S > 0:
        wait_quiet(QUIET_WAIT_S)
    out(f"loop stalls with {stall['pending']:,} timers pending (GET /ping every 10 ms, one connection):")
    t0 = time.monotonic()
    p = pinger_result(run_pinger(server, pin, a.stall_seconds))
    stall["idle"] = {"ping": p, "gc": server.gc_summary(t0)}
    out(f"  idle:               {fmt_ping(p)}; server: {stall['idle']['gc']}")
    log(f"stall idle: {fmt_ping(p)}")
    if receiver is not None and a.stall_fire:
        if QUIET_WAIT_S > 0:
            wait_quiet(QUIET_WAIT_S)
        receiver.reset()
        window = 5.0
        t0 = time.monotonic()
        pinger = run_pinger(server, pin, 2.0 + window + 1.5)
        time.sleep(0.2)
        made = asyncio.run(create_spread(server.url, receiver.uri, a.stall_fire, 2.0, window))
        stats = wait_received(receiver, a.stall_fire, made["window_end_ms"] + 500)
        p = pinger_result(pinger)
        late = lateness_figures(stats, a.stall_fire)
        stall["firing"] = {"ping": p, "lateness": late, "create": made, "gc": server.gc_summary(t0)}
        out(
            f"  {a.stall_fire:,} created, then firing over {window:g} s: {fmt_ping(p)}; server: {stall['firing']['gc']}"
        )
        out(f"      their lateness: {fmt_late(late)}")
        log(f"stall firing: {fmt_ping(p)}; lateness {fmt_late(late)}")
    if a.stall_load_seconds > 0:
        t0 = time.monotonic()
        # the pings start 1 s into the load, once wrk's 64 connections are open and busy
        pinger = run_pinger(server, pin, a.stall_load_seconds - 1.5, delay=1.0)
        r = run_wrk(
            server,
            pin,
            "create.lua",
            create_args(),
            counter="created",
            duration=a.stall_load_seconds,
            warmup=1.0,
            quiet=False,
        )
        p = pinger_result(pinger)
        stall["create_load"] = {"ping": p, "wrk": r, "gc": server.gc_summary(t0)}
        out(f"  under create load:  {fmt_ping(p)}; server: {stall['create_load']['gc']}")
        out(f"      the load: {fmt_run(r)}")
        log(f"stall under load: {fmt_ping(p)}")
    results["stall"] = stall


def part_sqlite(a: argparse.Namespace, pin: Pinning, results: dict[str, Any]) -> None:
    runs = []
    cpus: set[int] | None = pin.server if a.sqlite_pin == "server" else None
    for i in range(a.repeat):
        data_dir = tempfile.mkdtemp(prefix="skyring-bench-", dir=a.sqlite_dir)
        try:
            with node(pin, storage="sqlite", data_dir=data_dir, cpus=cpus) as server:
                r = run_wrk(server, pin, "create.lua", create_args(), counter="created", duration=a.duration)
                health = server.health()
                r["pending"] = health["timers"]["pending"]
                r["commits"] = health["storage"]["commits"]
            conn = sqlite3.connect(Path(data_dir) / "timers.db")
            r["rows"] = conn.execute("SELECT count(*) FROM timers").fetchone()[0]
            conn.close()
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
        r["rows_per_commit"] = r["pending"] / max(1, r["commits"])
        log(
            f"sqlite run {i + 1}: {fmt_run(r)}  rows after stop {r['rows']:,} (pending {r['pending']:,}), "
            f"{r['rows_per_commit']:.1f} rows/commit"
        )
        runs.append(r)
    runs = clean(runs, "sqlite")
    results["sqlite"] = s = summarize_runs(runs)
    where = "server pinned to CPU 0 (with its writer thread)" if cpus else "server unpinned"
    out(f"sqlite durable creates (WAL, synchronous=FULL, group commit; 64 conns; {where}; data dir on {a.sqlite_dir}):")
    out(f"  creates/s        {median_range([r['rate'] for r in runs])}")
    out(f"  server CPU/create {median_range([r['cpu_us_per_op'] for r in runs], '{:.1f}')} µs")
    out(
        f"  latency p50/p99  {s['p50_us'] / 1000:.2f} / {s['p99_us'] / 1000:.2f} ms (medians); "
        f"max {max(r['max_us'] for r in runs) / 1000:.1f} ms; errors {s['errors']}; "
        f"rows/commit {median_range([r['rows_per_commit'] for r in runs], '{:.1f}')}; "
        f"rows stored == pending: {all(r['rows'] == r['pending'] for r in runs)}"
    )


def part_rebuild(a: argparse.Namespace, results: dict[str, Any]) -> None:
    """In-process: the longest single ``TimerStore.remove`` while cancelling most of 1M pending timers.

    Cancelled timers stay in the heap until it is rebuilt (when it holds more than twice the live
    timers); that rebuild runs inside one cancel request, on the loop.
    """
    import gc

    sys.path.insert(0, str(SRC))  # the same skyring the nodes run
    from skyring.timers import Timer, TimerStore

    class _Alarm:
        def cancel(self) -> None:
            pass

    class _Clock:
        def now_ms(self) -> float:
            return time.time() * 1000.0

        def call_later(self, delay_s: float, callback: Callable[[], None]) -> _Alarm:
            return _Alarm()

    n = a.rebuild_n
    spec = DATA.encode()
    store = TimerStore(_Clock(), lambda t: None)
    now = int(time.time() * 1000)
    ids = [f"{i:08x}-0000-4000-8000-{random.getrandbits(48):012x}" for i in range(n)]
    for tid in ids:
        due = now + HOUR_MS + random.randrange(60_000)
        timer = Timer(due, tid, due, HOUR_MS, 0, spec)
        store.insert(timer)
        store.arm(timer)
    random.shuffle(ids)
    gc.collect()
    worst: list[tuple[float, int]] = []
    for k, tid in enumerate(ids[: int(n * 0.9)]):
        t0 = time.perf_counter()
        store.remove(tid)
        dt = time.perf_counter() - t0
        if dt > 0.005:
            worst.append((dt * 1000.0, n - k - 1))
    worst.sort(reverse=True)
    results["rebuild"] = {"n": n, "slow_removes": worst[:10]}
    out(f"heap rebuild on cancel (in-process TimerStore, {n:,} pending, cancel 90 % in random order):")
    out(
        f"  removes over 5 ms: {len(worst)}; slowest [ms, pending left]: "
        f"{[(round(ms, 1), left) for ms, left in worst[:6]]}"
    )


# -- machine, profile summary --------------------------------------------------------------------


def machine() -> dict[str, str]:
    info = {"nproc": str(os.cpu_count()), "kernel": platform.release(), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["ram"] = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("aiohttp", "uvloop", "orjson", "skyring"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = "-"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        first = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines()[0]
        info["wrk"] = first.split()[1]
    info["src"] = str(SRC)
    info["src_commit"] = source_commit(SRC)
    return info


def source_commit(src: Path) -> str:
    """The commit the nodes run: ``git`` in ``src`` (``+dirty`` if skyring/ has changes), else a COMMIT file."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src, capture_output=True, text=True)
        if rev.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "skyring"], cwd=src, capture_output=True, text=True)
            return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        pass
    commit_file = src / "COMMIT"
    return commit_file.read_text().strip() if commit_file.exists() else "unknown"


def part_profile(a: argparse.Namespace, pin: Pinning, results: dict[str, Any]) -> None:
    outdir = Path(a.profile)
    outdir.mkdir(parents=True, exist_ok=True)
    prof: dict[str, Any] = {}
    wanted = set(a.only)
    if "creates" in wanted:
        with node(pin) as server:
            target = PyspyTarget(outdir / "creates.txt", a.profile_rate, not a.profile_python_only)
            r = run_wrk(
                server, pin, "create.lua", create_args(), counter="created", duration=a.duration, profile=target
            )
        prof["creates"] = summarize(target.path) | {"run": fmt_run(r)}
    if "cancels" in wanted:
        with node(pin) as server:
            n = a.cancel_n
            run_wrk(
                server,
                pin,
                "create.lua",
                create_args(id_format="b-%d", limit=n),
                counter="created",
                duration=120,
                limit=n,
                warmup=1.0,
            )
            target = PyspyTarget(outdir / "cancels.txt", a.profile_rate, not a.profile_python_only)
            r = run_wrk(
                server,
                pin,
                "cancel.lua",
                ["b-%d", "0", str(n)],
                counter="cancelled",
                duration=120,
                limit=n,
                warmup=1.0,
                profile=target,
            )
        prof["cancels"] = summarize(target.path) | {"run": fmt_run(r)}
    if "sqlite" in wanted:
        data_dir = tempfile.mkdtemp(prefix="skyring-bench-", dir=a.sqlite_dir)
        try:
            cpus: set[int] | None = pin.server if a.sqlite_pin == "server" else None
            with node(pin, storage="sqlite", data_dir=data_dir, cpus=cpus) as server:
                target = PyspyTarget(outdir / "sqlite.txt", a.profile_rate, not a.profile_python_only)
                r = run_wrk(
                    server, pin, "create.lua", create_args(), counter="created", duration=a.duration, profile=target
                )
            prof["sqlite"] = summarize(target.path) | {"run": fmt_run(r)}
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
    results["profile"] = prof
    for name, p in prof.items():
        out(render(name, p))
        out(f"  (the run, slowed by the profiler: {p['run']})")


# -- main ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {','.join(PARTS)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of creates/cancels/lateness/sqlite (median)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per creates/sqlite run")
    parser.add_argument("--cancel-n", type=int, default=150_000, help="timers pre-created, then cancelled")
    parser.add_argument("--late-n", type=int, default=10_000)
    parser.add_argument("--late-window", type=float, default=5.0, help="seconds over which the timers fall due")
    parser.add_argument(
        "--late-lead", type=float, default=3.0, help="seconds from creation start to the first deadline"
    )
    parser.add_argument("--mem-sizes", default="100000,1000000", help="pending counts at which RSS is read")
    parser.add_argument("--stall-seconds", type=float, default=20.0)
    parser.add_argument("--stall-fire", type=int, default=5000, help="timers created and fired during the stall check")
    parser.add_argument("--stall-load-seconds", type=float, default=10.0, help="ping under full create load (0: skip)")
    parser.add_argument("--sqlite-dir", default="/var/tmp", help="parent of the sqlite data dir (not a tmpfs!)")
    parser.add_argument(
        "--sqlite-pin",
        choices=("server", "none"),
        default="server",
        help="pin the sqlite node to the server CPU, or leave it free",
    )
    parser.add_argument("--rebuild-n", type=int, default=1_000_000)
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        metavar="S",
        help="before each wrk run, wait up to S s for other processes to use < 15%% of a CPU (0: don't)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="instead of measuring, profile creates/cancels/sqlite (those in --only) with py-spy; stacks go to DIR",
    )
    parser.add_argument("--profile-rate", type=int, default=200)
    parser.add_argument("--profile-python-only", action="store_true", help="py-spy without --native")
    parser.add_argument(
        "--src",
        default=str(ROOT),
        metavar="DIR",
        help="skyring source tree to run the nodes from (their working directory); e.g. a `git archive` of a "
        "commit, to measure it while the work tree changes",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    return parser


def run_parts(a: argparse.Namespace, pin: Pinning, results: dict[str, Any]) -> None:
    parts = set(a.only)
    receiver = Receiver(pin) if parts & {"lateness", "stall"} else None
    try:
        if "baseline" in parts:
            part_baseline(a, pin, results)
        if "creates" in parts:
            part_creates(a, pin, results)
        if "cancels" in parts:
            part_cancels(a, pin, results)
        if "lateness" in parts:
            assert receiver is not None
            part_lateness(a, pin, results, receiver)
        if "sqlite" in parts:
            part_sqlite(a, pin, results)
        if parts & {"memory", "stall"}:
            part_memory_stall(a, pin, results, parts, receiver)
        if "rebuild" in parts:
            part_rebuild(a, results)
    finally:
        if receiver is not None:
            receiver.stop()


def main() -> None:
    parser = build_parser()
    a = parser.parse_args()
    a.only = [p.strip() for p in a.only.split(",") if p.strip()]
    unknown = set(a.only) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    a.mem_sizes = [int(x) for x in a.mem_sizes.split(",")]
    if shutil.which("wrk") is None and set(a.only) - {"lateness", "rebuild"}:
        parser.error("wrk is not installed (apt-get install -y wrk)")

    global QUIET_WAIT_S, SRC
    QUIET_WAIT_S = a.quiet_wait
    SRC = Path(a.src).resolve()
    pin = Pinning(not a.no_pin)
    if pin.load is not None:
        os.sched_setaffinity(0, pin.load)
    info = machine()
    results: dict[str, Any] = {"machine": info, "pinning": pin.describe(), "args": vars(a)}
    out(f"machine: {info}")
    out(f"pinning: {pin.describe()}")
    out(f"payload: data {len(DATA)} B; create body {len(create_body(HOUR_MS, NOWHERE))} B")
    started = time.monotonic()
    if a.profile:
        part_profile(a, pin, results)
    else:
        run_parts(a, pin, results)
    out(f"total {time.monotonic() - started:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
