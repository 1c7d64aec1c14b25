"""Membership and Bus against a real nats-server: discovery, leave, expiry, outages, bad input."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from skyring.cluster import Bus, Message, members_subject
from skyring.codec import dumps
from skyring.errors import ClusterError
from skyring.membership import Member, Membership
from tests.nats import NatsServer
from tests.support import MS, eventually

HEARTBEAT_S = 100 * MS
FAILURE_S = 500 * MS
DISCOVERY_S = 200 * MS
#: Long enough that no heartbeat or expiry happens during a test: only hello, welcome and leave act.
QUIET = {"heartbeat_s": 10.0, "failure_timeout_s": 30.0}


def member(node_id: str) -> Member:
    return Member(node_id, f"http://{node_id}.test:8080", f"{node_id}.test:9090")


@dataclass
class Node:
    bus: Bus
    membership: Membership
    views: list[dict[str, Member]] = field(default_factory=list)  #: every on_change argument, in order

    @property
    def ids(self) -> set[str]:
        return set(self.membership.members)


StartNode = Callable[..., Awaitable[Node]]


@pytest.fixture
def cluster() -> str:
    return uuid.uuid4().hex


@pytest.fixture
async def connect(nats_server: NatsServer) -> AsyncIterator[Callable[[str], Awaitable[Bus]]]:
    """``await connect(name)``: a Bus on the test's server (quick reconnects), closed after the test."""
    buses: list[Bus] = []

    async def make(name: str) -> Bus:
        bus = await Bus.connect([nats_server.url], name=name, connect_timeout_s=2.0, reconnect_wait_s=50 * MS)
        buses.append(bus)
        return bus

    yield make
    for bus in buses:
        await bus.close()


@pytest.fixture
async def start_node(connect: Callable[[str], Awaitable[Bus]], cluster: str) -> AsyncIterator[StartNode]:
    """``await start_node(node_id, **membership_overrides)``: a started Membership on its own Bus."""
    nodes: list[Node] = []

    async def start(node_id: str, **overrides: Any) -> Node:
        bus = await connect(node_id)
        views: list[dict[str, Member]] = []
        timing: dict[str, Any] = {
            "heartbeat_s": HEARTBEAT_S,
            "failure_timeout_s": FAILURE_S,
            "discovery_s": DISCOVERY_S,
        }
        membership = Membership(bus, cluster=cluster, me=member(node_id), on_change=views.append, **timing | overrides)
        node = Node(bus, membership, views)
        nodes.append(node)
        await membership.start()
        return node

    yield start
    for node in nodes:
        await node.membership.close()


async def test_members_discover_each_other_and_agree(start_node: StartNode) -> None:
    """Three nodes started together see all three members and compute the same checksum."""
    nodes = await asyncio.gather(start_node("a"), start_node("b"), start_node("c"))
    for node in nodes:
        assert node.views[0][node.membership.me.node_id] == node.membership.me  # the first view includes me

    await eventually(lambda: all(node.ids == {"a", "b", "c"} for node in nodes), timeout_s=2.0)
    assert len({node.membership.checksum for node in nodes}) == 1
    assert all(node.views[-1] == node.membership.members for node in nodes)
    assert nodes[0].membership.members["b"] == member("b")


async def test_late_joiner_learns_existing_members_during_start(start_node: StartNode) -> None:
    """A node joining a running cluster knows every member when start() returns, from the answers to its hello."""
    a = await start_node("a", **QUIET)
    b = await start_node("b", **QUIET)
    assert b.ids == {"a", "b"}

    c = await start_node("c", **QUIET)

    assert c.ids == {"a", "b", "c"}
    assert c.views == [c.membership.members]  # on_change once, with the full initial view
    await eventually(lambda: a.ids == b.ids == {"a", "b", "c"}, timeout_s=1.0)
    assert a.membership.checksum == b.membership.checksum == c.membership.checksum


async def test_leave_removes_member_from_others_at_once(start_node: StartNode) -> None:
    """After leave(), the others drop the node immediately, and its heartbeats stop so it stays gone."""
    a = await start_node("a", failure_timeout_s=30.0)
    b = await start_node("b", failure_timeout_s=30.0)
    await eventually(lambda: a.ids == {"a", "b"}, timeout_s=1.0)
    version = a.membership.version

    await b.membership.leave()
    await b.membership.leave()  # idempotent

    await eventually(lambda: a.ids == {"a"}, timeout_s=1.0)
    assert a.views[-1] == {"a": member("a")}
    assert a.membership.version == version + 1
    await asyncio.sleep(5 * HEARTBEAT_S)
    assert a.ids == {"a"}


async def test_silent_member_expires_after_failure_timeout(
    start_node: StartNode, caplog: pytest.LogCaptureFixture
) -> None:
    """A member that stops without leaving is dropped after failure_timeout_s, and on_change reports it."""
    caplog.set_level(logging.INFO, logger="skyring")
    a = await start_node("a")
    b = await start_node("b")
    await eventually(lambda: a.ids == {"a", "b"}, timeout_s=1.0)

    await b.membership.close()
    await b.bus.close()
    stopped = time.monotonic()
    assert a.ids == {"a", "b"}  # no leave message was sent

    await eventually(lambda: a.ids == {"a"}, timeout_s=FAILURE_S + 1.0)
    assert time.monotonic() - stopped >= FAILURE_S - 2 * HEARTBEAT_S
    assert a.views[-1] == {"a": member("a")}
    assert "member expired node=b" in caplog.text


async def test_nats_outage_freezes_membership_and_it_resumes_after_restart(
    start_node: StartNode, nats_server: NatsServer
) -> None:
    """While NATS is down nobody expires; after a restart on the same port heartbeats resume and nodes can join."""
    a = await start_node("a")
    b = await start_node("b")
    c = await start_node("c")
    await eventually(lambda: a.ids == b.ids == {"a", "b", "c"}, timeout_s=1.0)
    seen = len(a.views), len(b.views)

    await nats_server.stop()
    await eventually(lambda: not a.bus.connected and not b.bus.connected, timeout_s=1.0)
    await c.membership.close()  # c dies during the outage
    await c.bus.close()
    await asyncio.sleep(2 * FAILURE_S)
    assert a.ids == b.ids == {"a", "b", "c"}

    await nats_server.restart()
    await eventually(lambda: a.bus.connected and b.bus.connected, timeout_s=3.0)
    reconnected = time.monotonic()
    assert a.ids == b.ids == {"a", "b", "c"}

    # c is expired a full failure timeout after the reconnect (every clock restarts), not at once.
    await eventually(lambda: a.ids == b.ids == {"a", "b"}, timeout_s=FAILURE_S + 1.0)
    assert time.monotonic() - reconnected >= FAILURE_S - 2 * HEARTBEAT_S
    assert a.membership.checksum == b.membership.checksum
    assert a.membership.last_seen_s()["b"] < 3 * HEARTBEAT_S  # heartbeats resumed
    later_views = a.views[seen[0] :] + b.views[seen[1] :]
    assert all({"a", "b"} <= set(view) for view in later_views)  # a and b never lost each other
    d = await start_node("d")
    assert d.ids == {"a", "b", "d"}
    await eventually(lambda: a.ids == b.ids == {"a", "b", "d"}, timeout_s=1.0)


async def test_stalled_event_loop_expires_nobody(start_node: StartNode) -> None:
    """A node that could not listen for longer than failure_timeout_s does not blame the others for its silence."""
    a = await start_node("a")
    b = await start_node("b")
    await eventually(lambda: a.ids == b.ids == {"a", "b"}, timeout_s=1.0)
    versions = a.membership.version, b.membership.version

    time.sleep(2 * FAILURE_S)  # noqa: ASYNC251  (the point: nothing runs, but NATS stays connected)
    await asyncio.sleep(3 * HEARTBEAT_S)

    assert (a.membership.version, b.membership.version) == versions  # not even a drop and a rejoin
    assert a.ids == b.ids == {"a", "b"}


async def test_views_resync_after_reconnect(
    start_node: StartNode, nats_server: NatsServer, connect: Callable[[str], Awaitable[Bus]], cluster: str
) -> None:
    """After a reconnect nodes say hello again, so a member missing from a view returns without any heartbeat."""
    a = await start_node("a", **QUIET)
    b = await start_node("b", **QUIET)
    probe = await connect("probe")
    await probe.publish(members_subject(cluster), dumps({"type": "leave", **_fields(member("b"))}))  # forged
    await eventually(lambda: a.ids == {"a"}, timeout_s=1.0)
    assert b.ids == {"a", "b"}  # a leave in your own name is ignored

    await nats_server.restart()

    await eventually(lambda: a.ids == {"a", "b"}, timeout_s=3.0)
    assert a.membership.checksum == b.membership.checksum


async def test_heartbeat_with_new_address_updates_member(
    start_node: StartNode, connect: Callable[[str], Awaitable[Bus]], cluster: str
) -> None:
    """A heartbeat from an unknown node adds it; one with a changed address replaces the old one."""
    a = await start_node("a", **QUIET)
    probe = await connect("probe")
    x = member("x")

    await probe.publish(members_subject(cluster), dumps({"type": "heartbeat", **_fields(x)}))
    await eventually(lambda: a.membership.members.get("x") == x, timeout_s=1.0)
    moved = x._replace(api_url="http://x.test:8181")
    await probe.publish(members_subject(cluster), dumps({"type": "heartbeat", **_fields(moved)}))

    await eventually(lambda: a.membership.members.get("x") == moved, timeout_s=1.0)
    assert a.views[-1]["x"] == moved


async def test_malformed_messages_are_ignored(
    start_node: StartNode, connect: Callable[[str], Awaitable[Bus]], cluster: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Messages that are not valid membership JSON are logged at WARNING and change nothing."""
    a = await start_node("a", **QUIET)
    probe = await connect("probe")
    junk = [
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        dumps({"type": "heartbeat"}),
        dumps({"type": "bogus", **_fields(member("x"))}),
        dumps({"type": "heartbeat", "node": 7, "api": "http://x", "peer": "x:1"}),
        dumps({"type": "heartbeat", "node": "", "api": "http://x", "peer": "x:1"}),
    ]
    for payload in junk:
        await probe.publish(members_subject(cluster), payload)
    # A valid message after the junk shows the handler survived it (messages arrive in order).
    await probe.publish(members_subject(cluster), dumps({"type": "heartbeat", **_fields(member("y"))}))

    await eventually(lambda: "y" in a.ids, timeout_s=1.0)
    assert a.ids == {"a", "y"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "malformed" in r.getMessage()]
    assert len(warnings) == len(junk)


async def test_request_reaches_one_queue_member_and_gets_its_reply(
    connect: Callable[[str], Awaitable[Bus]], cluster: str
) -> None:
    """request() returns the reply of one subscriber of a queue group."""
    seen: list[str] = []

    def responder(bus: Bus, name: str) -> Callable[[Message], Awaitable[None]]:
        async def handle(message: Message) -> None:
            seen.append(name)
            await bus.respond(message, name.encode() + b":" + message.data)

        return handle

    one, two, client = await connect("one"), await connect("two"), await connect("client")
    subject = f"skyring.{cluster}.test"
    await one.subscribe(subject, responder(one, "one"), queue="workers")
    await two.subscribe(subject, responder(two, "two"), queue="workers")

    reply = await client.request(subject, b"ping", timeout_s=1.0)

    assert reply in (b"one:ping", b"two:ping")
    await asyncio.sleep(50 * MS)
    assert len(seen) == 1


async def test_request_without_responders_raises_cluster_error(
    connect: Callable[[str], Awaitable[Bus]], cluster: str
) -> None:
    """request() to a subject nobody listens on fails at once with ClusterError."""
    bus = await connect("client")
    started = time.monotonic()
    with pytest.raises(ClusterError, match="no responders"):
        await bus.request(f"skyring.{cluster}.nobody", b"", timeout_s=5.0)
    assert time.monotonic() - started < 1.0


async def test_closed_bus_refuses_to_publish_and_closes_idempotently(connect: Callable[[str], Awaitable[Bus]]) -> None:
    """After close() the bus is disconnected, publish raises ClusterError, and close() again is a no-op."""
    bus = await connect("client")
    await bus.close()
    await bus.close()
    assert not bus.connected
    with pytest.raises(ClusterError):
        await bus.publish("skyring.test", b"")


async def test_bus_closed_during_outage_stays_closed_when_nats_returns(nats_server: NatsServer) -> None:
    """A bus closed while reconnecting does not come back when NATS does (nats-py can lose the cancel)."""
    # Without a pause between attempts the reconnect loop is nearly always inside a failing connect,
    # where a cancel can be lost; with ten buses that happens at least once in most runs.
    buses = [await Bus.connect([nats_server.url], name=f"bus{i}", reconnect_wait_s=0.0) for i in range(10)]
    try:
        await nats_server.stop()
        await eventually(lambda: not any(bus.connected for bus in buses), timeout_s=1.0)
        await asyncio.sleep(20 * MS)
        for bus in buses:
            await bus.close()

        await nats_server.restart()
        await asyncio.sleep(200 * MS)

        assert [bus for bus in buses if not bus._client.is_closed] == []  # bus.connected would hide a zombie
    finally:
        for bus in buses:
            await bus.close()


async def test_connect_to_dead_server_raises_cluster_error_quickly() -> None:
    """Bus.connect gives up after connect_timeout_s with ClusterError when no server answers."""
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ClusterError, match="cannot connect"):
        await Bus.connect([f"nats://127.0.0.1:{port}"], name="lonely", connect_timeout_s=300 * MS)
    assert time.monotonic() - started < 1.0


def _fields(m: Member) -> dict[str, str]:
    return {"node": m.node_id, "api": m.api_url, "peer": m.peer_address}
