"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from typing import Any

from skyring.settings import Settings

#: One millisecond in seconds, scaled for slow machines with SKYRING_TEST_TIME_FACTOR.
MS = 0.001 * float(os.environ.get("SKYRING_TEST_TIME_FACTOR", "1"))


def node_settings(**overrides: Any) -> Settings:
    """Settings for an in-process node: memory storage, fast retries."""
    values: dict[str, Any] = {
        "port": 0,
        "node_id": "test-node",
        "storage": "memory",
        "delivery_backoff_s": 0.05,
        "delivery_backoff_max_s": 0.5,
        "delivery_timeout_s": 2.0,
        "shutdown_timeout_s": 2.0,
    }
    values.update(overrides)
    return Settings(**values)


def timer_body(
    uri: str, *, timeout_ms: int = 100, data: Any = None, method: str = "post", **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"timeout": timeout_ms, "callback": {"transport": "http", "method": method, "uri": uri}}
    if data is not None:
        body["data"] = data
    body.update(extra)
    return body


async def eventually(predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float, poll_s: float = 0.01) -> None:
    """Wait until ``predicate()`` (sync or async) is true. Raises ``TimeoutError``.

    For state that lives in another task, process or server, where there is no event to wait on.
    """
    async with asyncio.timeout(timeout_s):
        while True:
            result = predicate()
            if await result if inspect.isawaitable(result) else result:
                return
            await asyncio.sleep(poll_s)
