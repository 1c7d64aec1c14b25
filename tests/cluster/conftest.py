from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import SkyringProcess
from tests.nats import NatsServer
from tests.support import eventually

#: Fast failure detection so tests do not wait long; every node of a test gets the same.
CLUSTER_FLAGS = ("--heartbeat-s", "0.2", "--failure-timeout-s", "1.5", "--leave-grace-s", "0.3")

StartNode = Callable[..., Awaitable[SkyringProcess]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def start_node(nats_server: NatsServer, processes: list[SkyringProcess], tmp_path: Path) -> StartNode:
    """``await start_node("n1", durable=True)``: a node process in this test's cluster (unique name)."""
    cluster = "t" + uuid.uuid4().hex[:12]

    async def start(node_id: str, *extra: str, durable: bool = False) -> SkyringProcess:
        data_dir = tmp_path / node_id if durable else None
        args = ("--node-id", node_id, "--nats", nats_server.url, "--cluster", cluster, *CLUSTER_FLAGS, *extra)
        node = await SkyringProcess.start(*args, data_dir=data_dir)
        processes.append(node)
        return node

    return start


async def cluster_view(http: aiohttp.ClientSession, node: SkyringProcess) -> dict[str, Any]:
    async with http.get(node.url + "/cluster") as response:
        return await response.json()  # type: ignore[no-any-return]


async def wait_for_ring(http: aiohttp.ClientSession, nodes: list[SkyringProcess], timeout_s: float = 10.0) -> str:
    """Wait until every node's ring has exactly ``nodes`` as members, with one checksum; returns it."""
    expected = sorted(n.node_id for n in nodes)

    async def agreed() -> bool:
        views = await asyncio.gather(*(cluster_view(http, n) for n in nodes))
        return all(v["ring"]["members"] == expected for v in views) and len({v["ring"]["checksum"] for v in views}) == 1

    await eventually(agreed, timeout_s, poll_s=0.05)
    return (await cluster_view(http, nodes[0]))["ring"]["checksum"]  # type: ignore[no-any-return]


@pytest.fixture
async def trio(start_node: StartNode, http: aiohttp.ClientSession) -> list[SkyringProcess]:
    """Three nodes that agree on the ring."""
    nodes = list(await asyncio.gather(*(start_node(f"n{i}") for i in (1, 2, 3))))
    await wait_for_ring(http, nodes)
    return nodes
