"""Summarise a ``py-spy record --format raw`` file (collapsed stacks, ideally with ``--native``).

Three views, each as a share of all samples:

* **owner**: the innermost *Python* frame of each sample decides who caused the work: ``skyring``,
  ``aiohttp``, ``stdlib``, ``other``; samples whose innermost Python frame is the event loop's runner
  are uvloop's own C code (polling, reading sockets, running callbacks).
* **leaf**: what the CPU was executing: a syscall (``write``, ``read``, ``getrandom``…), the CPython
  interpreter, a C extension, or Python code of a package.
* **functions**: the top functions by self samples, and skyring's functions by inclusive samples.

    python bench/pyspy_summary.py /tmp/prof/creates.txt
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

# libc functions that are (thin wrappers around) system calls
SYSCALLS = frozenset(
    {
        "write",
        "read",
        "writev",
        "readv",
        "send",
        "recv",
        "sendto",
        "recvfrom",
        "sendmsg",
        "recvmsg",
        "getrandom",
        "getpid",
        "epoll_wait",
        "epoll_ctl",
        "epoll_pwait",
        "accept4",
        "close",
        "fsync",
        "fdatasync",
        "pwrite64",
        "pread64",
        "futex",
        "__futex_abstimed_wait_common",
        "clock_gettime",
        "__clock_gettime",
        "syscall",
        "ioctl",
    }
)
STDLIB_TOP = frozenset(
    {
        "uuid.py",
        "enum.py",
        "typing.py",
        "_weakrefset.py",
        "weakref.py",
        "abc.py",
        "functools.py",
        "re",
        "json",
        "http",
        "email",
        "logging",
        "concurrent",
        "threading.py",
        "selectors.py",
        "socket.py",
        "sqlite3",
        "heapq.py",
    }
)


def strip_frame(frame: str) -> str:
    """``func (/long/path/site-packages/pkg/mod.py:123)`` → ``func (pkg/mod.py)``."""
    frame = frame.strip()
    name, sep, where = frame.partition(" (")
    if not sep:
        return frame
    where = where.rstrip(")")
    if where.rsplit(":", 1)[-1].isdigit():
        where = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", "/lib/python3.11/", "/lib/python3.12/", "/work/main/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{name} ({where})"


def _where(frame: str) -> str:
    return frame.partition(" (")[2].rstrip(")")


def is_python(frame: str) -> bool:
    where = _where(frame)
    return where.endswith(".py") or where.startswith("<frozen") or where == "<string>"


def package(frame: str) -> str:
    where = _where(frame)
    if where.startswith(("skyring/", "aiohttp/", "asyncio/", "yarl/", "multidict/", "uvloop/", "orjson")):
        return where.split("/", 1)[0]
    top = where.split("/", 1)[0]
    if top in STDLIB_TOP or where.startswith("<frozen"):
        return "stdlib"
    return "other"


def leaf_kind(frame: str) -> str:
    name = frame.partition(" (")[0]
    if is_python(frame):
        return f"Python: {package(frame)}"
    where = _where(frame)
    if name in SYSCALLS and where.startswith("libc"):
        return f"syscall {name}"
    if where.startswith("libpython") or where.endswith(".h") or where in ("ceval.c", "obmalloc.c"):
        return "CPython interpreter/runtime"
    if where.startswith("libc"):
        return "libc (other)"
    return f"C: {where}"


def summarize(path: Path, top: int = 20) -> dict[str, Any]:
    owner: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [strip_frame(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        python_frames = [f for f in frames if is_python(f)]
        innermost = python_frames[-1] if python_frames else ""
        if not innermost:
            who = "no Python frame (C threads, startup)"
        elif innermost.startswith("Runner.run (asyncio/runners.py"):
            who = "uvloop C code (under Runner.run)"
        else:
            who = package(innermost)
        owner[who] += count
        leaf[leaf_kind(frames[-1])] += count
        self_counts[frames[-1]] += count
        for f in set(frames):
            inclusive[f] += count

    def pct(c: int) -> float:
        return round(100.0 * c / total, 1) if total else 0.0

    return {
        "samples": total,
        "owner": {k: pct(v) for k, v in owner.most_common()},
        "leaf": {k: pct(v) for k, v in leaf.most_common(12)},
        "top_self": [(f, pct(c)) for f, c in self_counts.most_common(top)],
        "skyring_inclusive": [
            (f, pct(c))
            for f, c in inclusive.most_common()
            if package(f) == "skyring" and not f.startswith(("<module>", "main (", "run ("))
        ][:top],
    }


def render(name: str, p: dict[str, Any], top: int = 15) -> str:
    lines = [f"py-spy profile of the server during {name} ({p['samples']} samples)"]
    lines.append("  by owner (innermost Python frame): " + ", ".join(f"{k} {v}%" for k, v in p["owner"].items()))
    lines.append("  by leaf (what ran):                " + ", ".join(f"{k} {v}%" for k, v in p["leaf"].items()))
    lines.append("  top functions, self:")
    lines += [f"    {share:5.1f}%  {f}" for f, share in p["top_self"][:top]]
    lines.append("  skyring functions, inclusive:")
    lines += [f"    {share:5.1f}%  {f}" for f, share in p["skyring_inclusive"][:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        summary = summarize(Path(arg))
        print(render(Path(arg).stem, summary))
        if "--json" in sys.argv:
            print(json.dumps(summary))
