"""Where a node keeps its timers between restarts, behind one small interface.

``put`` and ``delete`` take effect in call order; each returns an awaitable that completes once the
change is durable (``StorageError`` if it cannot be made so). Backends: ``sqlite`` (durable, group
commit) and ``memory`` (nothing survives a restart).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from ..settings import Settings
from ..timers import Timer

__all__ = ["Storage", "open_storage"]


class Storage(Protocol):
    name: str

    def put(self, timer: Timer) -> Awaitable[None]:
        """Insert or replace ``timer`` (by id)."""
        ...

    def delete(self, timer_id: str) -> Awaitable[None]: ...

    async def load(self) -> list[Timer]:
        """Every stored timer, for recovery at start."""
        ...

    async def close(self) -> None:
        """Make every accepted change durable, then release the store."""
        ...

    def status(self) -> dict[str, Any]: ...


async def open_storage(settings: Settings) -> Storage:
    """Open the backend ``settings.storage`` names. Raises ``StorageError`` if it cannot be opened."""
    if settings.storage == "memory":
        from .memory import MemoryStorage

        return MemoryStorage()
    from .sqlite import SqliteStorage

    return await SqliteStorage.open(settings.data_path)
