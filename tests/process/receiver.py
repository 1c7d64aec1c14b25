"""A callback receiver for process tests that can keep a delivery in flight, chosen by path.

/ok/...            200 at once
/slow/<ms>/...     answers 200 after <ms> milliseconds, every attempt
/hang-once/...     the first attempt of each timer waits until ``release()``; later attempts get 200 at once
/hang/...          every attempt waits until ``release()``

Unlike tests/sink.py it records each request twice: when it arrives (``started``) and when it has
been answered (``completed``), so a test can act while a delivery is in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

#: Longest a held request waits for ``release()``; keeps a forgotten release from stalling teardown.
MAX_HOLD_S = 30.0


@dataclass(frozen=True)
class Received:
    path: str
    timer_id: str
    attempt: int
    deadline_ms: int
    body: bytes
    at_s: float  #: wall clock, seconds


@dataclass
class Receiver:
    url: str = ""
    started: list[Received] = field(default_factory=list)
    completed: list[Received] = field(default_factory=list)
    _arrivals: Counter[str] = field(default_factory=Counter)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    def hook(self, kind: str = "ok", *args: object) -> str:
        """The callback URL for a behaviour, e.g. ``hook("slow", 500)``."""
        return "/".join([self.url, kind, *map(str, args), "hook"])

    def release(self) -> None:
        """Let every held request (now and later) answer 200."""
        self._released.set()

    async def _handle(self, request: web.Request) -> web.Response:
        headers = request.headers
        call = Received(
            request.path,
            headers.get("X-Skyring-Timer-Id", ""),
            int(headers.get("X-Skyring-Attempt", "0")),
            int(headers.get("X-Skyring-Deadline", "0")),
            await request.read(),
            time.time(),
        )
        self._arrivals[call.timer_id] += 1
        self._record(self.started, call)
        parts = request.path.strip("/").split("/")
        kind = parts[0]
        if kind == "slow":
            await asyncio.sleep(int(parts[1]) / 1000)
        elif kind == "hang" or (kind == "hang-once" and self._arrivals[call.timer_id] == 1):
            try:
                await asyncio.wait_for(self._released.wait(), MAX_HOLD_S)
            except TimeoutError:
                pass
        self._record(self.completed, dataclasses.replace(call, at_s=time.time()))
        return web.Response()

    def _record(self, calls: list[Received], call: Received) -> None:
        calls.append(call)
        self._changed.set()

    async def wait_started(self, count: int, timeout_s: float) -> list[Received]:
        """Wait until at least ``count`` requests arrived; returns them all. Raises TimeoutError."""
        return await self._wait(self.started, count, timeout_s)

    async def wait_completed(self, count: int, timeout_s: float) -> list[Received]:
        """Wait until at least ``count`` requests were answered; returns them all. Raises TimeoutError."""
        return await self._wait(self.completed, count, timeout_s)

    async def _wait(self, calls: list[Received], count: int, timeout_s: float) -> list[Received]:
        async with asyncio.timeout(timeout_s):
            while len(calls) < count:
                self._changed.clear()
                await self._changed.wait()
        return calls
