"""Routing between two in-process nodes over a real peer channel (no NATS): the rules in router.py."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from skyring.codec import encode_timers
from skyring.node import Node
from skyring.peers import PeerClient, PeerServer
from skyring.ring import Ring
from skyring.router import Router
from skyring.storage.memory import MemoryStorage
from skyring.transports import Transports
from skyring.transports.http import HttpTransport
from tests.support import node_settings

BODY = b'{"timeout": 60000, "callback": {"transport": "http", "method": "post", "uri": "http://127.0.0.1:9/x"}}'


@dataclass
class Peer:
    node: Node
    router: Router
    server: PeerServer
    client: PeerClient


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Peer, Peer]]:
    """Nodes a and b, each alone on its ring at first (call ``join`` to give both the ring [a, b])."""
    peers = []
    for name in ("a", "b"):
        settings = node_settings(node_id=name)
        node = Node(settings, storage=MemoryStorage(), transports=Transports({"http": HttpTransport(settings)}))
        await node.start()
        client = PeerClient(timeout_s=2, connect_timeout_s=1)
        router = Router(node, node_id=name, peers=client, forward_retry_s=0.3)
        server = await PeerServer.start("127.0.0.1", 0, router.serve_peer)
        peers.append(Peer(node, router, server, client))
    yield peers[0], peers[1]
    for peer in peers:
        await peer.server.close()
        await peer.node.close()
        await peer.client.close()
        await peer.node.transports.close()


def join(*peers: Peer) -> None:
    ring = Ring(p.router.node_id for p in peers)
    addresses = {p.router.node_id: f"127.0.0.1:{p.server.port}" for p in peers}
    for peer in peers:
        peer.router.update(ring, addresses)


def id_owned_by(owner: str, members: list[str]) -> str:
    ring = Ring(members)
    return next(f"t{i}" for i in itertools.count() if ring.owner(f"t{i}") == owner)


async def test_request_is_forwarded_to_the_owner_and_its_answer_returned(pair):
    """A create through a and a read through a, for an id b owns, land at b."""
    a, b = pair
    join(a, b)
    timer_id = id_owned_by("b", ["a", "b"])

    created = await a.router.handle("create", timer_id, BODY, generated=True)
    viewed = await a.router.handle("get", timer_id)

    assert created.status == 201
    assert created.headers["Location"] == f"/timer/{timer_id}"
    assert b.node.holds(timer_id) and not a.node.holds(timer_id)
    assert viewed.status == 200
    assert b'"node":"b"' in viewed.body


async def test_cancel_reaching_the_new_owner_before_the_timer_wins(pair):
    """b joins a; a still holds a timer b now owns; a cancel sent to b finds it at a and wins."""
    a, b = pair
    timer_id = id_owned_by("b", ["a", "b"])
    assert (await a.router.handle("create", timer_id, BODY)).status == 201

    join(a, b)
    reply = await b.router.handle("cancel", timer_id)

    assert reply.status == 202
    assert not a.node.holds(timer_id) and not b.node.holds(timer_id)


async def test_create_of_an_id_still_at_the_previous_owner_is_refused(pair):
    """A client-chosen id that is on its way to its new owner cannot be created twice."""
    a, b = pair
    timer_id = id_owned_by("b", ["a", "b"])
    await a.router.handle("create", timer_id, BODY)
    join(a, b)

    reply = await b.router.handle("create", timer_id, BODY)

    assert reply.status == 409
    assert reply.headers["Location"] == f"/timer/{timer_id}"


async def test_request_for_a_moving_timer_waits_for_the_move(pair):
    """A cancel for a timer in flight between nodes waits until it lands, then applies where it landed."""
    a, b = pair
    timer_id = id_owned_by("b", ["a", "b"])
    await a.router.handle("create", timer_id, BODY)
    join(a, b)
    [moving] = a.node.take([timer_id])

    cancel = asyncio.create_task(a.router.handle("cancel", timer_id))
    await asyncio.sleep(0.05)
    assert not cancel.done()
    await b.node.adopt([moving])
    await a.node.release([moving], moved=True)

    assert (await cancel).status == 202
    assert not b.node.holds(timer_id)


async def test_unreachable_owner_answers_503_after_the_retry_bound(pair):
    """When the owner's channel is gone, the entry retries for forward_retry_s, then answers 503."""
    a, b = pair
    join(a, b)
    await b.server.close()
    timer_id = id_owned_by("b", ["a", "b"])

    started = asyncio.get_running_loop().time()
    reply = await a.router.handle("get", timer_id)
    elapsed_s = asyncio.get_running_loop().time() - started

    assert reply.status == 503
    assert b"peer_unavailable" in reply.body
    assert "unreachable" in reply.headers["x-skyring-reason"]
    assert 0.25 <= elapsed_s < 2


async def test_views_that_disagree_do_not_loop(pair):
    """a thinks b owns an id and b thinks a does: the request stops after MAX_HOPS and is answered."""
    a, b = pair
    addresses = {"a": f"127.0.0.1:{a.server.port}", "b": f"127.0.0.1:{b.server.port}"}
    a.router.update(Ring(["b"]), addresses)
    b.router.update(Ring(["a"]), addresses)

    reply = await a.router.handle("get", "loop-test")

    assert reply.status == 404


async def test_adopted_timers_keep_their_deadline_and_attempts(pair):
    """Timers moved to another node arrive with the same deadline and attempt count."""
    a, b = pair
    join(a, b)
    timer_id = id_owned_by("a", ["a", "b"])
    await a.router.handle("create", timer_id, BODY)
    [timer] = a.node.take([timer_id])
    retried = timer._replace(attempts=2)

    answer, _ = await a.client.request(f"127.0.0.1:{b.server.port}", {"op": "adopt"}, encode_timers([retried]))

    assert answer == {"adopted": 1}
    view = await b.router.handle("get", timer_id, local=True)
    assert b'"attempts":2' in view.body
    assert f'"deadline_ms":{timer.deadline_ms}'.encode() in view.body


async def test_local_ids_are_owned_by_the_entry_node(pair):
    """With local ids, every generated id is one this node owns, so its create needs no hop."""
    a, b = pair
    join(a, b)

    ids = [a.router.new_id(local=True) for _ in range(200)]

    assert all(a.router.owns(i) for i in ids)
    assert len(set(ids)) == 200
    assert not all(a.router.owns(a.router.new_id()) for _ in range(200))


async def test_create_with_a_generated_id_survives_an_unreachable_owner(pair):
    """A create whose made-up id belongs to an unreachable node is stored here under a new id."""
    a, b = pair
    join(a, b)
    await b.server.close()
    timer_id = id_owned_by("b", ["a", "b"])

    reply = await a.router.handle("create", timer_id, BODY, generated=True)

    assert reply.status == 201
    new_id = reply.headers["Location"].removeprefix("/timer/")
    assert new_id != timer_id
    assert a.router.owns(new_id) and a.node.holds(new_id)
