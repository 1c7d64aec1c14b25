"""Talking to node processes over HTTP, as a client of the cluster would."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from tests.harness import SkyringProcess
from tests.sink import Call
from tests.support import timer_body


class Created:
    """A timer created through some node: its id and the window its deadline must fall in."""

    def __init__(self, timer_id: str, earliest_deadline_ms: float, latest_deadline_ms: float) -> None:
        self.id = timer_id
        self.earliest_deadline_ms = earliest_deadline_ms
        self.latest_deadline_ms = latest_deadline_ms


async def create(
    http: aiohttp.ClientSession, node: SkyringProcess, uri: str, timeout_ms: int, **headers: str
) -> Created:
    before_ms = time.time() * 1000
    async with http.post(node.url + "/timer", json=timer_body(uri, timeout_ms=timeout_ms), headers=headers) as r:
        assert r.status == 201, f"{r.status} {await r.text()}"
        location = r.headers["Location"]
    after_ms = time.time() * 1000
    return Created(location.removeprefix("/timer/"), before_ms + timeout_ms, after_ms + timeout_ms + 1)


async def call(http: aiohttp.ClientSession, method: str, node: SkyringProcess, timer_id: str, **kw: Any) -> int:
    async with http.request(method, f"{node.url}/timer/{timer_id}", **kw) as response:
        await response.read()
        return response.status


def check_fired_once_on_time(created: list[Created], calls: list[Call], *, max_lateness_ms: float) -> None:
    """Each timer in ``created`` was delivered once, with its original deadline, not early and not too late."""
    by_id: dict[str, list[Call]] = {}
    for c in calls:
        by_id.setdefault(c.timer_id, []).append(c)
    expected = {t.id: t for t in created}
    assert sorted(by_id) == sorted(expected), f"missing={set(expected) - set(by_id)} extra={set(by_id) - set(expected)}"
    duplicates = {i: len(cs) for i, cs in by_id.items() if len(cs) != 1}
    assert not duplicates, f"delivered more than once: {duplicates}"
    lateness_ms = []
    for timer_id, [c] in by_id.items():
        deadline_ms = int(c.headers["X-Skyring-Deadline"])
        t = expected[timer_id]
        assert t.earliest_deadline_ms - 1 <= deadline_ms <= t.latest_deadline_ms, f"deadline moved for {timer_id}"
        assert c.received_s * 1000 >= deadline_ms, f"{timer_id} fired {deadline_ms - c.received_s * 1000:.1f} ms early"
        lateness_ms.append(c.received_s * 1000 - deadline_ms)
    assert max(lateness_ms) <= max_lateness_ms, f"max lateness {max(lateness_ms):.0f} ms"
