"""Transport plug-ins found through the ``skyring.transports`` entry-point group of an installed distribution."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.harness import SkyringProcess, run_skyring
from tests.process.client import create_timer, get_timer, health
from tests.support import MS

pytestmark = pytest.mark.process

FAKE_TRANSPORT = '''
"""Appends each delivery attempt as a JSON line to the file named by callback.path."""

import json
import os

from skyring.errors import DeliveryError, InvalidRequest


class FakeTransport:
    def __init__(self, settings):
        self.node_id = settings.node_id

    def normalize(self, callback):
        path = callback.get("path")
        if not isinstance(path, str) or not path:
            raise InvalidRequest("callback.path must name a file", code="invalid_path")
        return {"path": path, "fail_attempts": int(callback.get("fail_attempts", 0))}

    def destination(self, callback):
        return "fake:" + callback["path"]

    async def deliver(self, delivery):
        line = {
            "timer_id": delivery.timer_id,
            "attempt": delivery.attempt,
            "deadline_ms": delivery.deadline_ms,
            "data": delivery.data,
            "callback": delivery.callback,
            "node": self.node_id,
        }
        with open(delivery.callback["path"], "a") as out:
            out.write(json.dumps(line) + "\\n")
        if delivery.attempt <= delivery.callback["fail_attempts"]:
            raise DeliveryError("fake failure", retryable=True)

    async def close(self):
        with open(os.environ["FAKE_TRANSPORT_CLOSED"], "w") as out:
            out.write("closed")


class BrokenTransport:
    def __init__(self, settings):
        raise RuntimeError("no carrier pigeons available")
'''


def install_plugin(directory: Path, entry_points: dict[str, str]) -> dict[str, str]:
    """Write ``fake_transport.py`` and a ``fake_transport-0.1.dist-info`` registering ``entry_points`` into
    ``directory``; returns the environment that puts it on a node's path."""
    directory.mkdir()
    (directory / "fake_transport.py").write_text(FAKE_TRANSPORT)
    dist_info = directory / "fake_transport-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-transport\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (dist_info / "entry_points.txt").write_text("[skyring.transports]\n" + lines)
    path = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def read_lines(path: Path, count: int, timeout_s: float) -> list[dict[str, Any]]:
    """Wait until ``path`` holds at least ``count`` JSON lines; returns them."""
    async with asyncio.timeout(timeout_s):
        while True:
            if len(lines := json_lines(path)) >= count:
                return lines
            await asyncio.sleep(0.02)  # polling: the writer is another process


async def test_timer_is_delivered_through_a_plugin_transport(tmp_path, processes, http):
    """A transport registered under skyring.transports by another distribution delivers timers naming it
    (case-insensitively), retries its DeliveryError, and is closed at shutdown."""
    env = install_plugin(tmp_path / "plugins", {"fake": "fake_transport:FakeTransport"})
    env["FAKE_TRANSPORT_CLOSED"] = str(tmp_path / "closed")
    node = await SkyringProcess.start("--node-id", "plugged", "--delivery-backoff-s", "0.05", env=env)
    processes.append(node)
    out = tmp_path / "deliveries.jsonl"
    callback = {"transport": "FAKE", "path": str(out), "fail_attempts": 1}

    assert (await health(http, node))["transports"] == ["fake", "http"]
    timer_id = await create_timer(http, node, {"timeout": 50, "data": {"k": "v"}, "callback": callback})
    first, second = await read_lines(out, 2, 5000 * MS)

    assert [first["attempt"], second["attempt"]] == [1, 2]
    for line in (first, second):
        assert line["timer_id"] == timer_id
        assert line["data"] == {"k": "v"}
        assert line["callback"] == {"transport": "fake", "path": str(out), "fail_attempts": 1}
        assert line["node"] == "plugged"
    assert first["deadline_ms"] == second["deadline_ms"]
    await asyncio.sleep(100 * MS)
    assert len(json_lines(out)) == 2
    report = await health(http, node)
    assert report["counters"]["retried"] == 1
    assert report["counters"]["delivered"] == 1

    waiting = await create_timer(http, node, {"timeout": 60_000, "callback": {"transport": "fake", "path": "x"}})
    status, view = await get_timer(http, node, waiting)
    assert status == 200
    assert view["callback"] == {"transport": "fake", "path": "x", "fail_attempts": 0}

    assert await node.stop(signal.SIGTERM) == 0
    assert (tmp_path / "closed").read_text() == "closed"


async def test_plugin_and_unknown_transports_reject_bad_callbacks_with_400(tmp_path, processes, http):
    """A callback the plug-in's normalize rejects gets its 400 code; an unknown transport gets 400 unknown_transport."""
    env = install_plugin(tmp_path / "plugins", {"fake": "fake_transport:FakeTransport"})
    node = await SkyringProcess.start(env=env)
    processes.append(node)

    async with http.post(f"{node.url}/timer", json={"timeout": 100, "callback": {"transport": "fake"}}) as response:
        assert response.status == 400
        assert (await response.json())["error"] == "invalid_path"
    body = {"timeout": 100, "callback": {"transport": "pigeon", "uri": "http://example.invalid/"}}
    async with http.post(f"{node.url}/timer", json=body) as response:
        assert response.status == 400
        error = await response.json()
        assert error["error"] == "unknown_transport"
        assert "fake, http" in error["message"]
        assert "pigeon" in response.headers["x-skyring-reason"]


async def test_plugin_that_cannot_load_stops_startup_with_exit_3(tmp_path):
    """A registered transport whose constructor fails keeps the node from starting: exit 3, naming the plug-in."""
    env = install_plugin(tmp_path / "plugins", {"broken": "fake_transport:BrokenTransport"})

    result = await run_skyring("serve", "--port", "0", "--storage", "memory", env=env, timeout_s=10)

    assert result.code == 3, result.stderr
    assert "cannot load transport 'broken' (fake_transport:BrokenTransport)" in result.stderr
    assert "no carrier pigeons available" in result.stderr
    assert "skyring ready" not in result.stderr
