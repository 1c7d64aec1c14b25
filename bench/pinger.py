"""Measures event-loop stalls from outside: ``GET /ping`` every ``interval`` ms on one keep-alive connection.

A request sent while the server's loop is stalled waits for the stall to end, so the slowest ping bounds
the longest stall (to within one interval). Prints one JSON line with the latency distribution and the
slowest pings (with their start offsets in seconds).

    python bench/pinger.py URL --seconds 20 --interval-ms 10 [--delay 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minihttp import Connection, split_url


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(p / 100.0 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


async def ping(url: str, seconds: float, interval_s: float, delay_s: float = 0.0) -> dict[str, object]:
    await asyncio.sleep(delay_s)
    host, port = split_url(url)
    conn = await Connection(host, port).open()
    samples: list[tuple[float, float]] = []  # (offset s, latency ms)
    start = time.perf_counter()
    next_at = start
    while True:
        now = time.perf_counter()
        if now - start >= seconds:
            break
        if next_at > now:
            await asyncio.sleep(next_at - now)
        t0 = time.perf_counter()
        status, _, _ = await conn.request("GET", "/ping")
        t1 = time.perf_counter()
        if status != 200:
            raise RuntimeError(f"/ping answered {status}")
        samples.append((t0 - start, (t1 - t0) * 1000.0))
        next_at += interval_s
        if next_at < t1:  # a stall: do not fire a burst of catch-up pings
            next_at = t1
    await conn.close()
    latencies = sorted(lat for _, lat in samples)
    slowest = sorted(samples, key=lambda s: -s[1])[:10]
    return {
        "count": len(samples),
        "seconds": seconds,
        "interval_ms": interval_s * 1000.0,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "p999_ms": percentile(latencies, 99.9),
        "max_ms": latencies[-1] if latencies else float("nan"),
        "over_50ms": sum(1 for lat in latencies if lat > 50.0),
        "slowest": [[round(at, 3), round(lat, 2)] for at, lat in slowest],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait before the first ping")
    args = parser.parse_args()
    result = asyncio.run(ping(args.url, args.seconds, args.interval_ms / 1000.0, args.delay))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
