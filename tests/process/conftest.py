from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.process.receiver import Receiver


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for talking to node processes (URLs are absolute: a restarted node has a new port)."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def receiver(aiohttp_server: Any) -> AsyncIterator[Receiver]:
    """A callback receiver that can hold deliveries in flight; see tests/process/receiver.py."""
    target = Receiver()
    server = await aiohttp_server(target.app())
    target.url = str(server.make_url("")).rstrip("/")
    yield target
    target.release()  # held requests answer, so the server closes at once
