"""Who is in the cluster: ``Membership`` keeps this node's view from messages on the bus.

Imports ``cluster`` (the bus), ``codec`` and ``errors``; never nats or aiohttp directly.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple

from .cluster import Bus, Message, Subscription, members_subject
from .codec import dumps, loads
from .errors import ClusterError

__all__ = ["Member", "Membership"]

logger = logging.getLogger(__name__)


class Member(NamedTuple):
    """One node as the others see it."""

    node_id: str
    api_url: str  #: e.g. ``http://10.0.0.5:8080``
    peer_address: str  #: ``host:port`` of the node's peer channel


class Membership:
    """This node's view of the cluster, kept by messages on ``members_subject(cluster)``.

    A newcomer publishes ``hello`` with a reply inbox; every member records it and answers with its own
    details (``welcome``). Members then publish ``heartbeat`` every ``heartbeat_s`` and ``leave`` when they
    go. A member not heard for ``failure_timeout_s`` is dropped, but only while this node can hear itself:
    its own heartbeats come back through NATS (echo is on), and silence is measured up to the last one
    that did. So a NATS outage, noticed or not, or a stalled event loop, freezes the view instead of
    shrinking it. A stand-in for ``Bus`` must echo too, or nobody ever expires.

    Args:
        bus: a connected ``Bus``; the caller owns it.
        cluster: the cluster name, shared by all its nodes.
        me: this node.
        heartbeat_s: interval between heartbeats (and expiry checks).
        failure_timeout_s: silence after which a member is dropped; more than twice ``heartbeat_s``.
        discovery_s: how long ``start()`` collects answers to its hello.
        on_change: called synchronously with the full new view (node id -> ``Member``) on every change,
            and once by ``start()``.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        cluster: str,
        me: Member,
        heartbeat_s: float = 1.0,
        failure_timeout_s: float = 5.0,
        discovery_s: float = 0.5,
        on_change: Callable[[dict[str, Member]], None],
    ) -> None:
        if heartbeat_s <= 0 or discovery_s < 0:
            raise ValueError("heartbeat_s must be positive and discovery_s not negative")
        if failure_timeout_s <= 2 * heartbeat_s:
            raise ValueError(
                "failure_timeout_s must be more than twice heartbeat_s, so one late heartbeat is no failure"
            )
        self._bus = bus
        self._cluster = cluster
        self._subject = members_subject(cluster)
        self._me = me
        self._heartbeat_s = heartbeat_s
        self._failure_timeout_s = failure_timeout_s
        self._discovery_s = discovery_s
        # A gap in our own heartbeats longer than this means we heard nobody; see _heard_self.
        self._deaf_after_s = min(2 * heartbeat_s, failure_timeout_s - heartbeat_s)
        self._on_change = on_change
        self._members: dict[str, Member] = {me.node_id: me}
        self._last_heard_s: dict[str, float] = {}  # monotonic time each other member was last heard
        self._heard_self_s = 0.0  # when our own heartbeat last came back (or we started listening)
        self._subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._inbox = ""
        self._started = False
        self._announced = False  # on_change fires from here on
        self._left = False
        self._closed = False
        self.version = 0  #: increments on every change of ``members``
        self.checksum = _checksum(self._members)  #: equal views have equal checksums

    def __repr__(self) -> str:
        return (
            f"<Membership {self._me.node_id} cluster={self._cluster} members={len(self._members)}"
            f" version={self.version} checksum={self.checksum}>"
        )

    @property
    def me(self) -> Member:
        return self._me

    @property
    def members(self) -> dict[str, Member]:
        """Node id -> ``Member``, this node included (a copy)."""
        return dict(self._members)

    def last_seen_s(self) -> dict[str, float]:
        """Seconds since each member was last heard (0 for this node)."""
        now = time.monotonic()
        return {
            node_id: now - self._last_heard_s[node_id] if node_id in self._last_heard_s else 0.0
            for node_id in self._members
        }

    async def start(self) -> None:
        """Subscribe, say hello, collect answers for ``discovery_s``, start heartbeating, report the first view.

        Raises:
            ClusterError: subscribing or publishing failed (everything started is stopped again).
        """
        assert not self._started, "Membership.start() called twice"
        self._started = True
        self._heard_self_s = time.monotonic()
        try:
            self._subscriptions.append(await self._bus.subscribe(self._subject, self._on_message))
            self._inbox = self._bus.new_inbox()
            self._subscriptions.append(await self._bus.subscribe(self._inbox, self._on_message))
            await self._bus.publish(self._subject, self._encode("hello"), reply=self._inbox)
            await asyncio.sleep(self._discovery_s)
        except BaseException:
            await self.close()
            raise
        self._bus.on_reconnect(self._on_reconnect)
        self._spawn(self._beat())
        self._announced = True
        logger.info(
            "membership started node=%s cluster=%s members=%d", self._me.node_id, self._cluster, len(self._members)
        )
        self._on_change(self.members)

    async def leave(self) -> None:
        """Tell the others this node is going, and stop heartbeating. Idempotent; logs rather than raises.

        The view keeps following the others afterwards (for hand-off), but hellos are no longer answered.
        """
        if self._left or self._closed:
            return
        self._left = True
        if not self._started:
            return
        try:
            await self._bus.publish(self._subject, self._encode("leave"))
        except ClusterError as exc:
            logger.warning("leave not announced node=%s error=%s; others expire it instead", self._me.node_id, exc)
            return
        logger.info("left cluster node=%s cluster=%s", self._me.node_id, self._cluster)

    async def close(self) -> None:
        """Stop heartbeating and listening, without a leave message. Idempotent. Does not close the bus."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _encode(self, kind: str) -> bytes:
        me = self._me
        return dumps({"type": kind, "node": me.node_id, "api": me.api_url, "peer": me.peer_address})

    async def _beat(self) -> None:
        while True:
            if not self._left and self._bus.connected:  # nothing buffered while disconnected, to replay later
                try:
                    await self._bus.publish(self._subject, self._encode("heartbeat"))
                except ClusterError as exc:
                    logger.warning("heartbeat not sent node=%s error=%s", self._me.node_id, exc)
            try:
                self._expire(time.monotonic())
            except Exception:
                logger.exception("membership expiry failed node=%s", self._me.node_id)
            await asyncio.sleep(self._heartbeat_s)

    def _expire(self, now: float) -> None:
        if not self._bus.connected:
            return  # frozen: a NATS outage must not shrink the ring
        # Silence is measured up to the last time we heard ourselves: if our own heartbeats stopped coming
        # back, we are not hearing anyone, and that is not their fault.
        until_s = self._heard_self_s
        expired = [
            (node_id, until_s - seen)
            for node_id, seen in self._last_heard_s.items()
            if until_s - seen > self._failure_timeout_s
        ]
        for node_id, silent_s in expired:
            del self._members[node_id], self._last_heard_s[node_id]
            logger.info("member expired node=%s silent_s=%.1f members=%d", node_id, silent_s, len(self._members))
        if expired:
            self._changed()

    async def _on_message(self, message: Message) -> None:
        if self._closed:
            return
        try:
            kind, member = _decode(message.data)
        except ValueError as exc:
            logger.warning("malformed membership message ignored subject=%s error=%s", message.subject, exc)
            return
        now = time.monotonic()
        if member.node_id == self._me.node_id:
            self._heard_self(kind, member, now)
        elif kind == "leave":
            self._remove(member.node_id)
        else:
            self._heard(member, now)
            if kind == "hello" and message.reply and not self._left:
                try:
                    await self._bus.respond(message, self._encode("welcome"))
                except ClusterError as exc:
                    logger.warning("hello not answered node=%s to=%s error=%s", self._me.node_id, member.node_id, exc)

    def _heard_self(self, kind: str, member: Member, now: float) -> None:
        if member != self._me:
            logger.warning("another node uses this node's id node=%s api=%s peer=%s", *member)
            return
        if kind != "heartbeat":
            return
        if now - self._heard_self_s > self._deaf_after_s:
            # We heard nobody for a while (stalled loop, or a dead link nats-py had not noticed yet): give
            # everyone a fresh start rather than blaming them for our silence.
            logger.info("membership resync node=%s deaf_s=%.1f", self._me.node_id, now - self._heard_self_s)
            self._refresh(now)
        self._heard_self_s = now

    def _heard(self, member: Member, now: float) -> None:
        self._last_heard_s[member.node_id] = now
        known = self._members.get(member.node_id)
        if known == member:
            return
        self._members[member.node_id] = member
        if known is None:
            logger.info("member joined node=%s api=%s peer=%s members=%d", *member, len(self._members))
        else:
            logger.info("member moved node=%s api=%s peer=%s", *member)
        self._changed()

    def _remove(self, node_id: str) -> None:
        if self._members.pop(node_id, None) is None:
            return
        del self._last_heard_s[node_id]
        logger.info("member left node=%s members=%d", node_id, len(self._members))
        self._changed()

    def _refresh(self, now: float) -> None:
        for node_id in self._last_heard_s:
            self._last_heard_s[node_id] = now

    def _changed(self) -> None:
        self.version += 1
        self.checksum = _checksum(self._members)
        if self._announced:
            self._on_change(self.members)

    def _on_reconnect(self) -> None:
        if self._closed:
            return
        # Nobody could be heard while we were away: restart every clock, and say hello so that both
        # sides relearn whoever joined or left meanwhile.
        now = time.monotonic()
        self._refresh(now)
        self._heard_self_s = now
        if not self._left:
            self._spawn(self._hello())

    async def _hello(self) -> None:
        try:
            await self._bus.publish(self._subject, self._encode("hello"), reply=self._inbox)
        except ClusterError as exc:
            logger.warning("hello not sent node=%s error=%s", self._me.node_id, exc)


_KINDS = frozenset({"hello", "welcome", "heartbeat", "leave"})


def _decode(data: bytes) -> tuple[str, Member]:
    """``(type, member)`` from a membership message. Raises ``ValueError`` naming what is wrong."""
    doc = loads(data)  # orjson.JSONDecodeError is a ValueError
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    kind = doc.get("type")
    if kind not in _KINDS:
        raise ValueError(f"unknown type {kind!r}")
    fields: list[Any] = [doc.get("node"), doc.get("api"), doc.get("peer")]
    if not all(isinstance(field, str) and field for field in fields):
        raise ValueError("node, api and peer must be non-empty strings")
    return kind, Member(*fields)


def _checksum(members: dict[str, Member]) -> str:
    lines = sorted("\t".join(member) for member in members.values())
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]
