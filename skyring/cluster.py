"""The cluster over NATS: ``Bus``, a thin nats-py wrapper, and ``Membership``, the view of who is in the ring.

The only module that imports ``nats``; no nats exception leaves it (they become ``ClusterError``).
Imports ``codec`` and ``errors`` only; never aiohttp.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from .codec import dumps, loads
from .errors import ClusterError

__all__ = [
    "Bus",
    "Member",
    "Membership",
    "Message",
    "Subscription",
    "handoff_queue",
    "handoff_subject",
    "members_subject",
]

logger = logging.getLogger(__name__)

_CLUSTER_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
#: Failures of the nats client we turn into ``ClusterError`` (nats' own, and socket errors it lets through).
_NATS_ERRORS = (nats.errors.Error, OSError)


class Member(NamedTuple):
    """One node as the others see it."""

    node_id: str
    api_url: str  #: e.g. ``http://10.0.0.5:8080``
    peer_address: str  #: ``host:port`` of the node's peer channel


class Message(NamedTuple):
    """A message as a ``Bus.subscribe`` handler receives it."""

    subject: str
    data: bytes
    reply: str  #: where to send an answer (``Bus.respond``); empty if none is expected


Handler = Callable[[Message], Awaitable[None]]


def _check_cluster(cluster: str) -> str:
    if not _CLUSTER_NAME.fullmatch(cluster):
        raise ValueError(f"cluster name {cluster!r} must be dot-separated words of A-Z a-z 0-9 _ -")
    return cluster


def members_subject(cluster: str) -> str:
    """Where hello, heartbeat and leave messages go."""
    return f"skyring.{_check_cluster(cluster)}.members"


def handoff_subject(cluster: str) -> str:
    """Where a leaving node sends its timers."""
    return f"skyring.{_check_cluster(cluster)}.handoff"


def handoff_queue(cluster: str) -> str:
    """The queue group on ``handoff_subject``: each hand-off message goes to one member only."""
    return f"skyring.{_check_cluster(cluster)}.handoff"


class Subscription:
    """A live subscription. ``unsubscribe()`` is idempotent and never raises."""

    __slots__ = ("_done", "_subscription")

    def __init__(self, subscription: NatsSubscription) -> None:
        self._subscription = subscription
        self._done = False

    async def unsubscribe(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            await self._subscription.unsubscribe()
        except _NATS_ERRORS:
            pass  # the connection is closed or draining: the subscription is gone with it


class Bus:
    """A NATS connection that reconnects forever once it has connected. Create it with ``Bus.connect``.

    Publishing while disconnected does not fail: nats-py buffers up to 2 MiB and sends it after the reconnect.
    """

    def __init__(self, client: Client, *, name: str, round_trip_timeout_s: float = 5.0) -> None:
        self._client = client
        self._name = name
        self._round_trip_timeout_s = round_trip_timeout_s
        self._reconnect_callbacks: list[Callable[[], None]] = []
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self.connected else "disconnected"
        return f"<Bus {self._name} {state}>"

    @classmethod
    async def connect(
        cls,
        servers: list[str],
        *,
        name: str,
        connect_timeout_s: float = 5.0,
        reconnect_wait_s: float = 2.0,
        ping_interval_s: float = 2.0,
        drain_timeout_s: float = 5.0,
    ) -> Bus:
        """Connect to the first of ``servers`` that answers.

        Args:
            servers: NATS URLs (``nats://host:4222``).
            name: the connection's name in NATS monitoring and in our logs (the node id).
            connect_timeout_s: how long the first connection may take, across all attempts.
            reconnect_wait_s: pause between attempts to connect to the same server.
            ping_interval_s: a connection that misses two pongs in a row is dropped and reconnected, so a
                dead link is noticed after about three intervals (nats-py's default interval is 120 s).
            drain_timeout_s: how long ``close()`` waits for handlers to finish messages already received.

        Raises:
            ClusterError: no server accepted the connection within ``connect_timeout_s``.
        """
        if not servers:
            raise ClusterError("no NATS servers configured")
        client = Client()
        bus = cls(client, name=name, round_trip_timeout_s=connect_timeout_s)
        # nats-py annotates these as int, but only ever passes them to asyncio.sleep and wait_for.
        durations: dict[str, Any] = {
            "connect_timeout": connect_timeout_s,
            "reconnect_time_wait": reconnect_wait_s,
            "ping_interval": ping_interval_s,
            "drain_timeout": drain_timeout_s,
        }
        # With max_reconnect_attempts=-1 nats-py retries even the first connection forever; bound it here.
        # Not with asyncio.timeout: its single cancel can be lost (see _cancel_until_done).
        attempt = asyncio.get_running_loop().create_task(
            client.connect(
                servers,
                name=name,
                max_reconnect_attempts=-1,
                no_echo=False,  # Membership hears its own heartbeats to know the bus works
                error_cb=bus._on_error,
                disconnected_cb=bus._on_disconnected,
                reconnected_cb=bus._on_reconnected,
                closed_cb=bus._on_closed,
                **durations,
            )
        )
        try:
            await asyncio.wait({attempt}, timeout=connect_timeout_s)
        finally:
            await _cancel_until_done(attempt)
            if attempt.cancelled() or attempt.exception() is not None:
                bus._closed = True
                await client.close()  # and any half-open socket with it
        if attempt.cancelled() or isinstance(attempt.exception(), _NATS_ERRORS):
            cause = client.last_error or (None if attempt.cancelled() else attempt.exception())
            raise ClusterError(
                f"cannot connect to NATS servers={','.join(servers)} within {connect_timeout_s}s: {cause!r}"
            ) from cause
        attempt.result()  # anything else (a bad URL, ...) as it is
        logger.info("nats connected node=%s server=%s", name, _server(client))
        return bus

    @property
    def connected(self) -> bool:
        return self._client.is_connected and not self._closed

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after each reconnect, once subscriptions are restored."""
        self._reconnect_callbacks.append(callback)

    async def publish(self, subject: str, payload: bytes, *, reply: str = "") -> None:
        """Send ``payload`` (buffered while disconnected). Raises ``ClusterError`` once closed, or for a bad subject."""
        try:
            await self._client.publish(subject, payload, reply=reply)
        except _NATS_ERRORS as exc:
            raise ClusterError(f"cannot publish subject={subject}: {exc!r}") from exc

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription:
        """Call ``handler`` for each message on ``subject``, one at a time, in order.

        Returns once the server has the interest (or, while disconnected, at once: nats-py subscribes
        again on reconnect). Exceptions from ``handler`` are logged; the subscription keeps going.
        """

        async def deliver(msg: Msg) -> None:
            try:
                await handler(Message(msg.subject, msg.data, msg.reply))
            except Exception:
                logger.exception("message handler failed node=%s subject=%s", self._name, msg.subject)

        try:
            subscription = await self._client.subscribe(subject, queue=queue, cb=deliver)
        except _NATS_ERRORS as exc:
            raise ClusterError(f"cannot subscribe subject={subject}: {exc!r}") from exc
        await self._round_trip()
        return Subscription(subscription)

    async def respond(self, message: Message, payload: bytes) -> None:
        """Answer a request. Raises ``ClusterError`` if ``message`` has no reply subject."""
        if not message.reply:
            raise ClusterError(f"message on subject={message.subject} expects no reply")
        await self.publish(message.reply, payload)

    async def request(self, subject: str, payload: bytes, *, timeout_s: float) -> bytes:
        """Send ``payload`` and return the first reply.

        Raises:
            ClusterError: nobody subscribes to ``subject``, no reply came within ``timeout_s``, or the bus is closed.
        """
        try:
            msg = await self._client.request(subject, payload, timeout=timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise ClusterError(f"no responders subject={subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise ClusterError(f"no reply within {timeout_s}s subject={subject}") from exc
        except _NATS_ERRORS as exc:
            raise ClusterError(f"request failed subject={subject}: {exc!r}") from exc
        return msg.data

    async def _round_trip(self) -> None:
        # Messages on one connection are processed in order, but another connection's are not ordered
        # with ours: without this a peer could publish to a subject we just subscribed to, and miss us.
        if not self._client.is_connected:
            return  # subscriptions are sent again on reconnect
        try:
            await self._client.flush(timeout=self._round_trip_timeout_s)  # type: ignore[arg-type]  # int in nats-py
        except _NATS_ERRORS as exc:
            logger.debug("nats flush failed node=%s error=%r", self._name, exc)

    def new_inbox(self) -> str:
        """A unique subject for replies."""
        return self._client.new_inbox()

    async def close(self) -> None:
        """Drain (handlers finish, within ``drain_timeout_s``; publishes are flushed) and close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._client.is_connected:
                await self._client.drain()  # refuses while reconnecting; nothing could be flushed then anyway
        except _NATS_ERRORS as exc:
            logger.warning("nats drain failed node=%s error=%r", self._name, exc)
        finally:
            await self._client.close()  # a no-op after a successful drain
            await self._stop_reconnecting()
        logger.info("nats closed node=%s", self._name)

    async def _stop_reconnecting(self) -> None:
        # close() cancels nats-py's reconnect task once; if that cancel is lost (see _cancel_until_done) the
        # task keeps trying and reconnects the closed client when the server returns: a zombie connection.
        task: asyncio.Task[None] | None = getattr(self._client, "_reconnection_task", None)
        if task is not None and not task.done():
            logger.debug("nats reconnect task still running after close node=%s", self._name)
            await _cancel_until_done(task)
            await self._client.close()

    async def _on_error(self, exc: Exception) -> None:
        # While reconnecting every failed attempt lands here; the disconnect itself was already a WARNING.
        level = logging.WARNING if self._client.is_connected else logging.DEBUG
        logger.log(level, "nats error node=%s error=%r", self._name, exc)

    async def _on_disconnected(self) -> None:
        if not self._closed:
            logger.warning("nats disconnected node=%s", self._name)

    async def _on_reconnected(self) -> None:
        logger.info("nats reconnected node=%s server=%s", self._name, _server(self._client))
        for callback in self._reconnect_callbacks:
            try:
                callback()
            except Exception:
                logger.exception("reconnect callback failed node=%s", self._name)

    async def _on_closed(self) -> None:
        if not self._closed:
            logger.warning("nats connection closed unexpectedly node=%s error=%r", self._name, self._client.last_error)


async def _cancel_until_done(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait for it to end, cancelling again if it swallowed the cancel.

    On Python 3.11 ``asyncio.wait_for`` drops a cancel that arrives as the awaited call fails; nats-py
    connects through ``wait_for`` and retries on failure, so one cancel may not stop it.
    """
    for _ in range(100):
        if task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    logger.warning("nats task ignores cancellation task=%r", task)


def _server(client: Client) -> str:
    url = client.connected_url
    return url.netloc if url is not None else "-"


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
