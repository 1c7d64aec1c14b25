"""The cluster's bus over NATS: ``Bus``, a thin nats-py wrapper, and the subjects skyring uses.

The only module that imports ``nats``; no nats exception leaves it (they become ``ClusterError``).
Imports ``codec`` and ``errors`` only; never aiohttp.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from .errors import ClusterError

__all__ = [
    "Bus",
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

    @property
    def max_payload_bytes(self) -> int:
        """The largest message the server takes (its ``max_payload``, 1 MiB by default)."""
        return int(self._client.max_payload)

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
