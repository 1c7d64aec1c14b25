"""``skyring cluster``: NATS and N nodes on this machine, started and stopped as one."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import pytest

from tests.support import timer_body

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


async def test_local_cluster_serves_and_stops_cleanly_on_ctrl_c(tmp_path, sink):
    """It prints one ready line with every node's URL; a timer set through one node fires; SIGINT exits 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skyring", "cluster", "--nodes", "3", "--port", "0", "--nats-port", "0",
        "--data-dir", str(tmp_path), "--cluster", "lc",
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stderr is not None
    log: list[str] = []
    try:
        async with asyncio.timeout(30):
            while not (line := (await proc.stderr.readline()).decode()).startswith("skyring cluster ready"):
                assert line, "".join(log)
                log.append(line)
        urls = line.split("nodes=")[1].split()[0].split(",")
        assert len(urls) == 3

        async with aiohttp.ClientSession() as http:
            views = [await (await http.get(url + "/cluster")).json() for url in urls]
            async with http.post(urls[1] + "/timer", json=timer_body(sink.hook(), timeout_ms=200)) as response:
                assert response.status == 201
        await sink.wait_for(1, 5)
        assert {len(v["members"]) for v in views} == {3}

        proc.send_signal(signal.SIGINT)
        rest = (await asyncio.wait_for(proc.stderr.read(), 40)).decode()
        code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    assert code == 0, rest
    assert "second" not in rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node-1", "node-2", "node-3"]
