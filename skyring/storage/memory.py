"""No storage: every change is 'durable' at once and nothing survives a restart."""

from __future__ import annotations

import asyncio
from typing import Any

from ..timers import Timer

__all__ = ["MemoryStorage"]


class MemoryStorage:
    name = "memory"

    def __init__(self) -> None:
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._done.set_result(None)

    def put(self, timer: Timer) -> asyncio.Future[None]:
        return self._done

    def delete(self, timer_id: str) -> asyncio.Future[None]:
        return self._done

    async def load(self) -> list[Timer]:
        return []

    async def close(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"backend": self.name, "durable": False, "status": "ok"}
