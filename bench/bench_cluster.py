"""Cluster benchmarks: three nodes and a real nats-server; forwarded creates and cancels, lateness, hand-off.

Starts ``nats-server`` (from the venv, ``-a 127.0.0.1 -p -1``) and three ``skyring serve`` nodes
(``--storage memory --nats … --cluster bench --node-id n1..n3``, port 0), waits until every node's
``GET /cluster`` shows the same three-member ring, and drives them with one wrk per node (64
connections in all). Prints figures; it is not a test. Run from the repository root with the
project's venv (see docs/benchmarks.md, "Cluster benchmarks"):

    mkdir -p /tmp/skyring-cluster && git archive HEAD skyring pyproject.toml | tar -x -C /tmp/skyring-cluster
    git rev-parse HEAD > /tmp/skyring-cluster/COMMIT
    .venv/bin/python bench/bench_cluster.py --src /tmp/skyring-cluster --repeat 3 --json /tmp/cluster.json

Parts (``--only``):

* creates: 10 s of ``POST /timer`` (server-made uuid ids), each wrk through its own node, so ~2/3 are
  forwarded to their owner; then the same on a cluster started with ``--local-ids`` (no hop).
* cancels: timers pre-created with ``x-timer-id: c<k>-<n>`` through node k, then cancelled two ways:
  "random" (each wrk cancels its own range through its node; owners are random, ~2/3 forwarded) and
  "direct" (each wrk cancels ids its node owns, computed from the same ring; no hop). The CPU of one
  forwarded request follows from the two: (CPU random − local share × CPU direct) / forwarded share.
* lateness: timers created through the three nodes, due uniformly over 5 s, delivered to
  ``receiver.py``: receive time − ``X-Skyring-Deadline``.
* handoff: n1 filled to ``--handoff-n`` pending timers (1 h; created through n1 on the ``--local-ids``
  cluster, so n1 owns them), then SIGTERM: time to exit, timers/s moved (n2 + n3's ``adopted``
  counters over the span between n1's log lines ``left cluster`` and ``hand-off done``), and whether
  n2 + n3 then hold every timer. Repeated on fresh clusters for each of ``--handoff-graces``.
* profile: one wrk (64 connections) creates through n1 only: n1 is the entry node of every request
  (and owner of a third), n2 and n3 only owners. First unprofiled (CPU per create by node), then with
  py-spy (native) on n1 and n2; samples idle in ``epoll_wait`` are set aside.

Server CPU is utime + stime of all three nodes (``/proc/<pid>/stat``) over the steady window, divided
by the operations the nodes counted (``GET /health`` on each, every 100 ms). Nothing is pinned: the
nodes, the three wrk processes, nats-server and this script share the machine's CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_single as single  # noqa: E402
from bench_single import (  # noqa: E402
    NodeProcess,
    Pinning,
    PySpy,
    Receiver,
    clean,
    create_args,
    create_spread,
    fmt_late,
    lateness_figures,
    log,
    median_range,
    out,
    proc_cpu_s,
    system_busy_s,
    wait_quiet,
    wait_received,
)
from pyspy_summary import is_python, leaf_kind, package, render, strip_frame, summarize  # noqa: E402
from wrkload import Reading, sample_until, steady_figures, wrk_command, wrk_figures  # noqa: E402

PARTS = ("creates", "cancels", "lateness", "handoff", "profile")
NODE_IDS = ("n1", "n2", "n3")
CLUSTER = "bench"
NO_PIN = Pinning(False)
TARGETS = {
    "cpu_per_forwarded_us": 200.0,  # server CPU per forwarded request, both nodes together
    "creates_per_s": 3 * 2240.0,  # 3x the original's best (1,850-2,240 creates/s)
    "cancels_per_s": 3 * 3700.0,  # 3x the original's best (2,800-3,700 cancels/s)
    "lateness_p99_ms": 15.0,
    "handoff_per_s": 20_000.0,
}


class Options(NamedTuple):
    quiet_wait_s: float
    conns: int
    duration: float


# -- the cluster -------------------------------------------------------------------------------------


class NatsServer:
    """``nats-server -a 127.0.0.1 -p -1``; the port comes from its log."""

    def __init__(self) -> None:
        exe = Path(sys.executable).parent / "nats-server"
        command = str(exe) if exe.exists() else shutil.which("nats-server")
        if command is None:
            raise RuntimeError("nats-server not found (pip install -e '.[cluster]')")
        self.proc = subprocess.Popen(
            [command, "-a", "127.0.0.1", "-p", "-1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        self.pid = self.proc.pid
        self.log: deque[str] = deque(maxlen=100)
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.log.append(line)
            if "Listening for client connections on" in line:
                self.url = "nats://127.0.0.1:" + line.rsplit(":", 1)[1].strip()
                break
        else:
            raise RuntimeError("nats-server exited:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.log.append(raw.decode(errors="replace"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Cluster:
    """nats-server and three nodes, ready once every node shows the same three-member ring."""

    def __init__(self, *extra: str, log_level: str = "info") -> None:
        self.nats = NatsServer()
        self.nodes: list[NodeProcess] = []
        self.flags = list(extra)
        try:
            for node_id in NODE_IDS:
                command = [sys.executable, "-m", "skyring", "serve", "--port", "0", "--storage", "memory"]
                command += ["--nats", self.nats.url, "--cluster", CLUSTER, "--node-id", node_id]
                command += ["--log-level", log_level, *extra]
                self.nodes.append(NodeProcess(NO_PIN, command=command, cpus=None))
            self.checksum = self.wait_ring(len(NODE_IDS))
        except BaseException:
            self.close()
            raise
        self.started = time.monotonic()

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def live(self) -> list[NodeProcess]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def wait_ring(self, members: int, timeout_s: float = 30.0) -> str:
        """Wait until every live node's ring has ``members`` members and the same checksum."""
        deadline = time.monotonic() + timeout_s
        while True:
            views = [n.get("/cluster")["ring"] for n in self.live()]
            checksums: set[str] = {v["checksum"] for v in views}
            if all(len(v["members"]) == members for v in views) and len(checksums) == 1:
                return checksums.pop()
            if time.monotonic() > deadline:
                raise RuntimeError(f"rings did not agree in {timeout_s} s: {views}")
            time.sleep(0.1)

    def counter(self, name: str) -> int:
        return sum(n.health()["counters"][name] for n in self.live())

    def pending(self) -> dict[str, int]:
        return {n.url: n.health()["timers"]["pending"] for n in self.live()}

    def cpu_s(self) -> float:
        return sum(n.cpu_s() for n in self.live())

    def close(self) -> None:
        """Kill the nodes (memory storage: nothing to keep; a SIGTERM would start hand-offs), then NATS."""
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.kill()
        for n in self.nodes:
            n.proc.wait()
            n.stop()  # reports errors the node logged
            warnings = [line for line in n.log if " WARNING " in line]
            if warnings:
                log(f"{n.url} logged warnings:\n" + "".join(warnings[-10:]))
        self.nats.stop()


@contextlib.contextmanager
def cluster(*extra: str) -> Any:
    c = Cluster(*extra)
    log(f"cluster up{' with ' + ' '.join(extra) if extra else ''}: {' '.join(c.urls)} ring {c.checksum}")
    try:
        yield c
    finally:
        c.close()


# -- load: one wrk per node -----------------------------------------------------------------------


class Job(NamedTuple):
    node: NodeProcess
    script: str
    args: list[str]
    conns: int


def split_conns(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_load(
    c: Cluster,
    jobs: list[Job],
    counter: str,
    opts: Options,
    *,
    duration: float,
    limit: int | None = None,
    warmup: float = 2.0,
    helpers: tuple[int, ...] = (),
    profile: list[tuple[NodeProcess, Path]] | None = None,
    rate: int = 200,
) -> dict[str, Any]:
    """Run one wrk per job at once until ``duration`` passes or the nodes' ``counter`` grew by ``limit``.

    Returns the wrk figures combined (requests and errors summed, p50 the median of the instances', p99
    and max the worst) and the cluster's rate and CPU per operation over the steady window.
    """
    if opts.quiet_wait_s > 0:
        wait_quiet(opts.quiet_wait_s)
    base = c.counter(counter)
    seconds = int(duration + 1) if limit is None else int(duration + 60)
    t0 = time.monotonic()
    wrks = [
        subprocess.Popen(
            wrk_command(j.node.url, j.script, j.args, conns=j.conns, seconds=seconds),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        for j in jobs
    ]
    spies = []
    if profile:
        time.sleep(min(warmup, 1.0))
        spies = [PySpy(n.pid, path, NO_PIN, rate, True) for n, path in profile]
    seen: dict[int, float] = {}  # CPU s of our helper processes, kept once one has exited
    extra: list[tuple[float, ...]] = []  # per sample: interrupt CPU s, then each node's CPU s

    def read() -> Reading:
        count = c.counter(counter) - base
        for pid in (*(w.pid for w in wrks), *(s.proc.pid for s in spies), *helpers, c.nats.pid, os.getpid()):
            seen[pid] = max(seen.get(pid, 0.0), proc_cpu_s(pid))
        nodes = [n.cpu_s() for n in c.nodes]
        extra.append((irq_s(), *nodes))
        # interrupt time (loopback TCP is processed in softirq, charged to no process) counts as ours
        return sum(nodes), count, system_busy_s(), sum(seen.values()) + extra[-1][0]

    running = lambda: any(w.poll() is None for w in wrks)  # noqa: E731
    samples = sample_until(read, running, t0, duration, limit, label=counter, log=log)
    for spy in spies:
        spy.stop()

    def per_op(column: int) -> float:
        """µs per operation of another CPU figure (``extra[column]``) over the same steady window."""
        replaced = [(s[0], e[column], *s[2:]) for s, e in zip(samples, extra, strict=True)]
        return steady_figures(replaced, warmup, limit)["cpu_us_per_op"]

    each = [wrk_figures(w) for w in wrks]
    figures: dict[str, Any] = {
        "requests": sum(f["requests"] for f in each),
        "errors": sum(f["errors"] for f in each),
        "p50_us": statistics.median(f["p50_us"] for f in each),
        "p99_us": max(f["p99_us"] for f in each),
        "max_us": max(f["max_us"] for f in each),
        "count": c.counter(counter) - base,
        "wrk": each,
        "irq_us_per_op": per_op(0),
        "node_cpu_us_per_op": [per_op(k + 1) for k in range(len(c.nodes))],
    }
    return figures | steady_figures(samples, warmup, limit)


def fmt_load(r: dict[str, Any]) -> str:
    return (
        f"{r['rate']:,.0f}/s  p50 {r['p50_us'] / 1000:.2f} ms  p99 {r['p99_us'] / 1000:.2f} ms  "
        f"max {r['max_us'] / 1000:.1f} ms  CPU {r['cpu_us_per_op']:.1f} µs/op (nodes; "
        f"{r['server_cpu_util'] * 100:.0f}% of a core) + softirq {r['irq_us_per_op']:.1f} µs/op  "
        f"count {r['count']:,}  errors {r['errors']}  other load {r['other_load'] * 100:.0f}%"
    )


def irq_s() -> float:
    """CPU seconds the machine spent in hard and soft interrupts (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[6]) + int(fields[7])) / single.TICK


def per_node_jobs(c: Cluster, script: str, args_for: Any, conns: int) -> list[Job]:
    return [
        Job(node, script, args_for(k), share)
        for k, (node, share) in enumerate(zip(c.nodes, split_conns(conns, 3), strict=True))
    ]


# -- parts ----------------------------------------------------------------------------------------------


def part_creates(c: Cluster, opts: Options, label: str) -> dict[str, Any]:
    jobs = per_node_jobs(c, "create.lua", lambda k: create_args(), opts.conns)
    r = run_load(c, jobs, "created", opts, duration=opts.duration)
    log(f"creates ({label}): {fmt_load(r)}")
    return r


def owner_ring() -> Any:
    """The ring the nodes build, from the source tree they run."""
    if str(single.SRC) not in sys.path:
        sys.path.insert(0, str(single.SRC))
    from skyring.ring import Ring

    return Ring(NODE_IDS)


def part_cancels(c: Cluster, opts: Options, n: int, workdir: Path) -> dict[str, Any]:
    """Pre-create ids ``c<k>-<j>`` through node k; cancel a range of them through the same node (random
    owners), then ids each node owns through that node (direct)."""
    ring = owner_ring()
    per = n // 3
    pool = int(per * 1.2) + 100  # per range, for the direct cancels: every node must own `per` of the 3 pools
    made = per + pool
    start = sum(c.pending().values())
    jobs = per_node_jobs(c, "create.lua", lambda k: create_args(id_format=f"c{k + 1}-%d", limit=made), opts.conns)
    pre = run_load(c, jobs, "created", opts, duration=120, limit=3 * made, warmup=1.0)
    log(f"creates with x-timer-id: {fmt_load(pre)}")
    local_random = sum(1 for k in range(3) for j in range(per) if ring.owner(f"c{k + 1}-{j}") == NODE_IDS[k]) / (
        3 * per
    )
    owned: dict[str, list[str]] = {node_id: [] for node_id in NODE_IDS}
    for k in range(3):
        for j in range(per, made):
            tid = f"c{k + 1}-{j}"
            owned[ring.owner(tid)].append(tid)
    files = []
    for node_id in NODE_IDS:
        if len(owned[node_id]) < per:
            raise RuntimeError(f"{node_id} owns only {len(owned[node_id])} of the pool; need {per}")
        path = workdir / f"cancel-{node_id}.txt"
        path.write_text("\n".join(owned[node_id][:per]) + "\n")
        files.append(path)
    jobs = per_node_jobs(c, "cancel.lua", lambda k: [f"c{k + 1}-%d", "0", str(per)], opts.conns)
    rnd = run_load(c, jobs, "cancelled", opts, duration=120, limit=3 * per, warmup=1.0)
    log(f"cancels (random owners, {local_random * 100:.1f}% local): {fmt_load(rnd)}")
    jobs = per_node_jobs(c, "cancel.lua", lambda k: [f"@{files[k]}", "0", str(per)], opts.conns)
    direct = run_load(c, jobs, "cancelled", opts, duration=120, limit=3 * per, warmup=1.0)
    log(f"cancels (direct to owner): {fmt_load(direct)}")
    left = sum(c.pending().values())
    expected = start + 3 * made - 6 * per  # every pre-created timer is held once, every cancelled one is gone
    if left != expected:
        log(f"cancels: {left:,} timers pending afterwards, expected {expected:,}")
    return {
        "pre": pre,
        "random": rnd,
        "direct": direct,
        "local_share": local_random,
        "pending_after": left,
        "pending_expected": expected,
    }


def part_lateness(c: Cluster, opts: Options, receiver: Receiver, n: int, lead: float, window: float) -> dict[str, Any]:
    if opts.quiet_wait_s > 0:
        wait_quiet(opts.quiet_wait_s)
    receiver.reset()
    base = c.counter("delivered")
    made = asyncio.run(create_spread(c.urls, receiver.uri, n, lead, window))
    stats = wait_received(receiver, n, made["window_end_ms"] + 500)
    time.sleep(0.5)  # a duplicate would arrive late
    f = lateness_figures(receiver.stats(), n) | made
    f["delivered_counter"] = c.counter("delivered") - base
    log(
        f"lateness: {fmt_late(f)}  (created in {made['create_s']:.2f} s, min timeout "
        f"{made['min_timeout_ms']} ms, failures {made['failures']}, nodes counted {f['delivered_counter']} delivered; "
        f"first read {stats['count']})"
    )
    return f


def _log_time(line: str) -> float:
    """Epoch seconds of a skyring log line (``2026-11-22 10:00:00,123 INFO …``, local time)."""
    stamp = datetime.datetime.strptime(" ".join(line.split()[:2]), "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def _find(lines: list[str], text: str) -> str | None:
    return next((line for line in lines if text in line), None)


def _fields(line: str | None) -> dict[str, str]:
    return dict(item.split("=", 1) for item in (line or "").split() if "=" in item)


class HealthWatch(threading.Thread):
    """``GET /health`` on a node every 50 ms until it stops answering: (epoch s, pending, moving)."""

    def __init__(self, node: NodeProcess) -> None:
        super().__init__(daemon=True)
        self.node = node
        self.seen: list[tuple[float, int, int]] = []

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.node.host, self.node.port, timeout=5)
        while True:
            try:
                conn.request("GET", "/health")
                timers = json.loads(conn.getresponse().read())["timers"]
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                return
            self.seen.append((time.time(), timers["pending"], timers["moving"]))
            time.sleep(0.05)


def _fill(c: Cluster, opts: Options, node: NodeProcess, n: int) -> dict[str, Any] | None:
    """Create timers through ``node`` until it holds ``n`` (on a --local-ids cluster it owns them all)."""
    more = n - node.health()["timers"]["pending"]
    if more <= 0:
        return None
    job = Job(node, "create.lua", create_args(limit=more), opts.conns)
    fill = run_load(c, [job], "created", opts, duration=300, limit=more, warmup=1.0)
    log(f"hand-off fill: {fmt_load(fill)}")
    return fill


def _stop_and_time(node: NodeProcess) -> tuple[int, float, float, HealthWatch]:
    """SIGTERM ``node`` and wait for it to exit: (exit code, signal time, exit time), epoch s."""
    watch = HealthWatch(node)
    watch.start()
    watchdog = threading.Timer(120.0, node.proc.kill)
    watchdog.start()
    t_signal = time.time()
    node.proc.send_signal(signal.SIGTERM)
    rc = node.proc.wait()
    t_exit = time.time()
    watchdog.cancel()
    watch.join(5)
    node._drain.join(5)  # the rest of its log
    return rc, t_signal, t_exit, watch


def part_handoff(c: Cluster, opts: Options, n: int, grace_s: float) -> dict[str, Any]:
    """Fill n1 to ``n`` pending, SIGTERM it, time its leave and check that n2 + n3 then hold every timer.

    A leaving node first rebalances over the peer channel (its own ring no longer has it) during the
    leave grace, then hands what is left off through NATS: both count as moved.
    """
    leaver, others = c.nodes[0], c.nodes[1:]
    fill = _fill(c, opts, leaver, n)
    before = {node.url: node.health() for node in c.nodes}
    total = sum(h["timers"]["pending"] for h in before.values())
    adopted = sum(before[node.url]["counters"]["adopted"] for node in others)
    others_cpu = sum(node.cpu_s() for node in others)
    if opts.quiet_wait_s > 0:
        wait_quiet(opts.quiet_wait_s)
    rc, t_signal, t_exit, watch = _stop_and_time(leaver)
    others_cpu = sum(node.cpu_s() for node in others) - others_cpu
    lines = list(leaver.log)
    left, done = _find(lines, "left cluster node="), _find(lines, "hand-off done node=")
    if left is None or done is None:
        raise RuntimeError("the leaving node did not log its hand-off:\n" + "".join(lines[-30:]))
    rebalance = _fields(_find(lines[lines.index(left) :], "rebalance moved="))
    handed, failed = int(_fields(done)["handed_off"]), int(_fields(done)["failed"])
    t_left, t_done = _log_time(left), _log_time(done)
    c.wait_ring(2)
    deadline = time.monotonic() + 10
    while any(node.health()["timers"]["moving"] for node in others) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = {node.url: node.health() for node in others}
    held = sum(h["timers"]["pending"] for h in after.values())
    moved = sum(h["counters"]["adopted"] for h in after.values()) - adopted
    last = watch.seen[-1] if watch.seen else (float("nan"), -1, -1)
    r = {
        "pending_before": {url: h["timers"]["pending"] for url, h in before.items()},
        "total": total,
        "grace_s": grace_s,
        "leaver_pending": before[leaver.url]["timers"]["pending"],
        "exit_code": rc,
        "sigterm_to_exit_s": t_exit - t_signal,
        "sigterm_to_left_s": t_left - t_signal,
        "handoff_s": t_done - t_left,
        "done_to_exit_s": t_exit - t_done,
        "rebalanced": int(rebalance.get("moved", 0)),
        "rebalance_ms": int(rebalance.get("ms", 0)),
        "handed_off": handed,
        "failed": failed,
        "adopted_by_others": moved,
        "rate_logged": handed / (t_done - t_left),
        "rate": moved / (t_done - t_left),
        "last_seen": {"before_exit_s": t_exit - last[0], "pending": last[1], "moving": last[2]},
        "others_cpu_s": others_cpu,
        "pending_after": {url: h["timers"]["pending"] for url, h in after.items()},
        "held_after": held,
        "all_kept": held == total,
        "fill": fill,
    }
    log(
        f"hand-off: n1 held {r['leaver_pending']:,}; moved {moved:,} in {r['handoff_s']:.2f} s from 'left cluster' to "
        f"'hand-off done' ({r['rate']:,.0f}/s, the {grace_s:g} s grace included): rebalance "
        f"{r['rebalanced']:,} in {r['rebalance_ms']} ms, then handed_off={handed:,} failed={failed}; n1 last seen "
        f"pending {last[1]} moving {last[2]}; SIGTERM→exit {r['sigterm_to_exit_s']:.2f} s (code {rc}); "
        f"n2+n3 hold {held:,} of {total:,}; their CPU {others_cpu:.2f} s"
    )
    return r


# -- profile ------------------------------------------------------------------------------------------


IDLE_LEAVES = ("epoll_pwait (libc", "epoll_wait (libc")


def busy_stacks(path: Path, src: Path) -> tuple[Path, float]:
    """A copy of a py-spy file with the source tree's paths made relative (``skyring/peers.py``, as
    pyspy_summary expects) and without the idle samples (the loop waiting in ``epoll_wait``; py-spy's own
    idle detection misses them in native mode). Returns the copy and the idle share of all samples."""
    busy, idle, kept = 0, 0, []
    for line in path.read_text().replace(str(src) + "/", "").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        if stack.rsplit(";", 1)[-1].startswith(IDLE_LEAVES):
            idle += int(count)
        else:
            busy += int(count)
            kept.append(line)
    out_path = path.with_suffix(".busy.txt")
    out_path.write_text("\n".join(kept) + "\n")
    return out_path, idle / max(1, idle + busy)


def by_module(path: Path) -> dict[str, Any]:
    """Samples by the innermost Python frame's module (skyring split by file), and the syscalls under each."""
    owners: Counter[str] = Counter()
    syscalls: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = [strip_frame(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        count = int(count_text)
        total += count
        python = [f for f in frames if is_python(f)]
        inner = python[-1] if python else ""
        if not inner:
            who = "no Python frame"
        elif inner.startswith("Runner.run (asyncio/runners.py"):
            who = "uvloop C code"
        elif package(inner) == "skyring":
            who = inner.partition(" (")[2].rstrip(")")
        else:
            who = package(inner)
        owners[who] += count
        kind = leaf_kind(frames[-1])
        if kind.startswith("syscall "):
            syscalls[f"{kind[8:]} (from {who})"] += count

    def pct(n: int) -> float:
        return round(100.0 * n / total, 1) if total else 0.0

    return {
        "samples": total,
        "module": {k: pct(v) for k, v in owners.most_common()},
        "syscalls": {k: pct(v) for k, v in syscalls.most_common(10)},
    }


def part_profile(opts: Options, outdir: Path, seconds: float, rate: int) -> dict[str, Any]:
    outdir.mkdir(parents=True, exist_ok=True)
    with cluster() as c:
        entry, owner = c.nodes[0], c.nodes[1]
        job = Job(entry, "create.lua", create_args(), opts.conns)
        plain = run_load(c, [job], "created", opts, duration=opts.duration)
        split = plain["node_cpu_us_per_op"]
        held = [n.health()["timers"]["pending"] for n in c.nodes]  # a fresh cluster: all made by this run
        forwarded = (held[1] + held[2]) / sum(held)
        log(f"creates through n1 only: {fmt_load(plain)}; CPU per create by node {[round(x, 1) for x in split]} µs")
        targets = [(entry, outdir / "entry-n1.txt"), (owner, outdir / "owner-n2.txt")]
        r = run_load(c, [job], "created", opts, duration=seconds, profile=targets, rate=rate)
    log(f"profiled run (creates through n1 only): {fmt_load(r)}")
    result: dict[str, Any] = {"run": r, "unprofiled": plain}
    out("creates through n1 only (n1 is the entry of every request, n2 and n3 owners of ~2/3 of them):")
    out(f"  {fmt_load(plain)}")
    out(
        f"  CPU per create: n1 {split[0]:.1f} µs, n2 + n3 {split[1] + split[2]:.1f} µs, i.e. "
        f"{(split[1] + split[2]) / forwarded:.1f} µs per forwarded create at its owner ({forwarded:.1%} forwarded)"
    )
    result["forwarded_share"] = forwarded
    for role, (_, path) in zip(("entry", "owner"), targets, strict=True):
        if not path.exists():
            continue
        busy, idle = busy_stacks(path, single.SRC)
        result[role] = summarize(busy) | by_module(busy) | {"idle_share": idle}
        out(render(f"forwarded creates, {role} node ({path.name}; busy samples only, {idle:.0%} idle)", result[role]))
        for title, key in (("by module (innermost Python frame)", "module"), ("syscalls (by caller)", "syscalls")):
            out(f"  {title}: " + ", ".join(f"{k} {v}%" for k, v in result[role][key].items()))
    out(f"  (the profiled run, slowed by the profiler: {fmt_load(r)})")
    return result


# -- summary ----------------------------------------------------------------------------------------


def forwarded_cost(mixed: float, local: float, local_share: float) -> float:
    """CPU of one forwarded request from a mix with ``local_share`` answered at the entry node."""
    return (mixed - local_share * local) / (1.0 - local_share)


def report_load(name: str, runs: list[dict[str, Any]], target: float | None = None) -> dict[str, Any]:
    runs = clean(runs, name)
    rates = [r["rate"] for r in runs]
    summary = {
        "rate": statistics.median(rates),
        "cpu_us_per_op": statistics.median(r["cpu_us_per_op"] for r in runs),
        "p50_ms": statistics.median(r["p50_us"] for r in runs) / 1000,
        "p99_ms": statistics.median(r["p99_us"] for r in runs) / 1000,
        "max_ms": max(r["max_us"] for r in runs) / 1000,
        "errors": sum(r["errors"] for r in runs),
        "n": len(runs),
    }
    goal = f"  (target ≥ {target:,.0f}/s)" if target else ""
    out(f"  {name:<34} {median_range(rates)}/s{goal}")
    out(
        f"  {'':<34} CPU {median_range([r['cpu_us_per_op'] for r in runs], '{:.1f}')} µs per request (3 nodes); "
        f"p50/p99 {summary['p50_ms']:.2f} / {summary['p99_ms']:.2f} ms; max {summary['max_ms']:.0f} ms; "
        f"errors {summary['errors']}"
    )
    return summary


def report(results: dict[str, Any]) -> None:
    out(f"cluster of 3 nodes, memory storage, {results['args']['conns']} connections over 3 wrk (one per node)")
    creates = results.get("creates", {})
    if creates.get("random"):
        s = report_load("creates, random owners", creates["random"], TARGETS["creates_per_s"])
        loc = report_load("creates, --local-ids (no hop)", creates["local"])
        fwd = forwarded_cost(s["cpu_us_per_op"], loc["cpu_us_per_op"], 1 / 3)
        results["summary_creates"] = {"random": s, "local": loc, "cpu_per_forwarded_us": fwd}
        out(f"  CPU per forwarded create (both nodes), from the medians: {fwd:.0f} µs (target ≤ 200)")
    cancels = results.get("cancels", [])
    if cancels:
        share = statistics.median(r["local_share"] for r in cancels)
        pre = report_load("creates with x-timer-id, random", [r["pre"] for r in cancels])
        s = report_load("cancels, random owners", [r["random"] for r in cancels], TARGETS["cancels_per_s"])
        d = report_load("cancels, direct to owner", [r["direct"] for r in cancels])
        fwd = forwarded_cost(s["cpu_us_per_op"], d["cpu_us_per_op"], share)
        results["summary_cancels"] = {"pre": pre, "random": s, "direct": d, "cpu_per_forwarded_us": fwd}
        out(f"  CPU per forwarded cancel (both nodes): {fwd:.0f} µs ({share * 100:.1f}% of the random ones local)")
        out(
            f"  pending afterwards {[r['pending_after'] for r in cancels]}, expected "
            f"{[r['pending_expected'] for r in cancels]} (the creates run's timers and the unused pool)"
        )
    late = results.get("lateness", [])
    if late:
        out(f"  fire lateness ({late[0]['expected']:,} timers through 3 nodes, due over the window):")
        for key in ("p50_ms", "p99_ms", "max_ms"):
            out(f"    {key[:-3]:<4} {median_range([r[key] for r in late], '{:.2f}')} ms")
        out(
            f"    early {sum(r['early'] for r in late)}; received {[r['received'] for r in late]}; "
            f"duplicates {sum(r['duplicates'] for r in late)}; create failures {sum(r['failures'] for r in late)}"
        )
    for grace in sorted({h["grace_s"] for h in results.get("handoff", [])}, reverse=True):
        report_handoff(grace, [h for h in results["handoff"] if h["grace_s"] == grace])


def report_handoff(grace: float, hand: list[dict[str, Any]]) -> None:
    out(f"  hand-off, SIGTERM of n1, --leave-grace-s {grace:g} (target ≥ {TARGETS['handoff_per_s']:,.0f}/s):")
    out(f"    n1 pending        {[h['leaver_pending'] for h in hand]} (cluster total {[h['total'] for h in hand]})")
    out(
        f"    moved             {[h['adopted_by_others'] for h in hand]}: rebalanced in the grace "
        f"{[h['rebalanced'] for h in hand]} (logged), handed_off {[h['handed_off'] for h in hand]}, "
        f"failed {[h['failed'] for h in hand]}"
    )
    out(f"    'left cluster' → 'hand-off done' {median_range([h['handoff_s'] for h in hand], '{:.2f}')} s")
    out(f"    timers moved/s    {median_range([h['rate'] for h in hand])} (over that span)")
    out(f"    handed_off/s      {median_range([h['rate_logged'] for h in hand])} (the log line's count over the span)")
    out(f"    SIGTERM → exit    {median_range([h['sigterm_to_exit_s'] for h in hand], '{:.2f}')} s")
    out(
        f"    n2+n3 hold all    {[h['all_kept'] for h in hand]}: lost {[h['total'] - h['held_after'] for h in hand]}; "
        f"n1 last seen moving {[h['last_seen']['moving'] for h in hand]}; exit codes {[h['exit_code'] for h in hand]}"
    )


# -- main -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {','.join(PARTS)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every part but the profile (medians)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per creates run")
    parser.add_argument("--conns", type=int, default=64, help="connections in all, split over the three wrk")
    parser.add_argument("--cancel-n", type=int, default=75_000, help="cancels per way (random, direct)")
    parser.add_argument("--late-n", type=int, default=10_000)
    parser.add_argument("--late-window", type=float, default=5.0, help="seconds over which the timers fall due")
    parser.add_argument("--late-lead", type=float, default=3.0, help="s from creation start to the first deadline")
    parser.add_argument("--handoff-n", type=int, default=100_000, help="timers pending on the leaving node")
    parser.add_argument("--leave-grace-s", type=float, default=1.0, help="the nodes' --leave-grace-s")
    parser.add_argument(
        "--handoff-graces",
        type=lambda text: [float(x) for x in text.split(",") if x.strip()],
        default=[0.0],
        metavar="S,…",
        help="also run the hand-off on a fresh cluster with each of these --leave-grace-s ('' for none)",
    )
    parser.add_argument("--quiet-wait", type=float, default=60.0, metavar="S", help="wait up to S s for quiet")
    parser.add_argument("--profile-seconds", type=float, default=20.0, help="length of the profiled run")
    parser.add_argument("--profile-rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--profile-dir", default="/tmp/skyring-cluster-prof", help="where the py-spy stacks go")
    parser.add_argument("--src", default=str(single.ROOT), metavar="DIR", help="skyring source tree the nodes run")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    return parser


def run_repeat(a: argparse.Namespace, opts: Options, results: dict[str, Any], receiver: Receiver | None) -> None:
    parts = set(a.only)
    grace = ("--leave-grace-s", str(a.leave_grace_s))
    if parts & {"creates", "cancels", "lateness"}:
        with cluster(*grace) as c:
            if receiver is not None:
                results["lateness"].append(part_lateness(c, opts, receiver, a.late_n, a.late_lead, a.late_window))
            if "creates" in parts:
                results["creates"]["random"].append(part_creates(c, opts, "random owners"))
            if "cancels" in parts:
                with tempfile.TemporaryDirectory(prefix="skyring-cluster-") as workdir:
                    results["cancels"].append(part_cancels(c, opts, a.cancel_n, Path(workdir)))
    if parts & {"creates", "handoff"}:
        with cluster("--local-ids", *grace) as c:
            if "creates" in parts:
                results["creates"]["local"].append(part_creates(c, opts, "--local-ids"))
            if "handoff" in parts:
                results["handoff"].append(part_handoff(c, opts, a.handoff_n, a.leave_grace_s))
    for extra in a.handoff_graces if "handoff" in parts else ():
        with cluster("--local-ids", "--leave-grace-s", str(extra)) as c:
            results["handoff"].append(part_handoff(c, opts, a.handoff_n, extra))


def main() -> None:
    parser = build_parser()
    a = parser.parse_args()
    a.only = [p.strip() for p in a.only.split(",") if p.strip()]
    if set(a.only) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(set(a.only) - set(PARTS)))}")
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed (apt-get install -y wrk)")
    single.SRC = Path(a.src).resolve()
    os.environ["PYTHONPATH"] = str(single.SRC)  # the nodes import skyring from --src, not the editable install
    opts = Options(a.quiet_wait, a.conns, a.duration)
    info = single.machine()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        nats = Path(sys.executable).parent / "nats-server"
        info["nats-server"] = subprocess.run([nats, "--version"], capture_output=True, text=True).stdout.strip()
    results: dict[str, Any] = {"machine": info, "args": vars(a), "creates": {"random": [], "local": []}}
    results |= {"cancels": [], "lateness": [], "handoff": []}
    out(f"machine: {info}")
    started = time.monotonic()
    receiver = Receiver(NO_PIN) if "lateness" in a.only else None
    try:
        for i in range(a.repeat):
            log(f"--- repeat {i + 1} of {a.repeat}")
            run_repeat(a, opts, results, receiver)
    finally:
        if receiver is not None:
            receiver.stop()
    report(results)
    if "profile" in a.only:
        results["profile"] = part_profile(opts, Path(a.profile_dir), a.profile_seconds, a.profile_rate)
    out(f"total {time.monotonic() - started:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
