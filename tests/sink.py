"""A real HTTP server that receives callbacks, with behaviour chosen by path.

/ok/...              200
/status/<code>/...   answers <code> every time
/flaky/<n>/...       answers 503 to the first <n> attempts of each timer, then 200
/retry-after/<s>/... 429 with Retry-After: <s> on the first attempt of each timer, then 200
/hang/...            never answers
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    received_s: float  #: wall clock, seconds

    @property
    def timer_id(self) -> str:
        return self.headers["X-Skyring-Timer-Id"]

    @property
    def attempt(self) -> int:
        return int(self.headers["X-Skyring-Attempt"])


@dataclass
class CallbackSink:
    calls: list[Call] = field(default_factory=list)
    url: str = ""
    in_flight: int = 0
    max_in_flight: int = 0
    _attempts: Counter[str] = field(default_factory=Counter)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._respond(request)
        finally:
            self.in_flight -= 1

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        call = Call(request.method, request.path, dict(request.headers), await request.read(), time.time())
        parts = request.path.strip("/").split("/")
        kind = parts[0]
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "slow":
            await asyncio.sleep(int(parts[1]) / 1000)
        self.calls.append(call)
        self._changed.set()
        timer_id = request.headers.get("X-Skyring-Timer-Id", "")
        self._attempts[timer_id] += 1
        if kind == "status":
            return web.Response(status=int(parts[1]))
        if kind == "flaky" and self._attempts[timer_id] <= int(parts[1]):
            return web.Response(status=503)
        if kind == "retry-after" and self._attempts[timer_id] == 1:
            return web.Response(status=429, headers={"Retry-After": parts[1]})
        return web.Response()

    def hook(self, kind: str = "ok", *args: object) -> str:
        """The callback URL for a behaviour, e.g. ``hook("flaky", 2)``."""
        return "/".join([self.url, kind, *map(str, args), "hook"])

    def calls_for(self, timer_id: str) -> list[Call]:
        return [c for c in self.calls if c.headers.get("X-Skyring-Timer-Id") == timer_id]

    async def wait_for(self, count: int, timeout_s: float) -> list[Call]:
        """Wait until at least ``count`` calls arrived; returns them all. Raises TimeoutError."""
        async with asyncio.timeout(timeout_s):
            while len(self.calls) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.calls
