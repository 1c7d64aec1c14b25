"""Graceful hand-off: a leaving node gives its timers to the others through a NATS queue group.

The leaving node publishes its pending timers in batches on ``handoff_subject(cluster)`` as requests.
Every other node listens in the queue group ``handoff_queue(cluster)``, so exactly one of them takes
each batch; it places every timer at its owner (through the mover, deadlines kept) and only then
replies, naming the timers it could not place. The leaving node forgets a timer only once a reply
says it was placed; the rest are sent again until the time bound, and what is left stays in local
storage for the node's next start. Imports the NATS adapter, the node and the mover.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from .cluster import Bus, Message, Subscription, handoff_queue, handoff_subject
from .codec import decode_timers, dumps, encode_timer_batches, loads
from .errors import ClusterError
from .mover import Mover
from .node import Node
from .timers import Timer

__all__ = ["HandOff"]

logger = logging.getLogger(__name__)

_RETRY_PAUSE_S = 0.2


class HandOff:
    """Both sides of the hand-off for one node.

    Args:
        batch_size: timers per NATS request.
        concurrency: batches in flight at once.
        request_timeout_s: how long one batch may take to be placed and acknowledged.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        cluster: str,
        node: Node,
        mover: Mover,
        batch_size: int = 1000,
        concurrency: int = 8,
        request_timeout_s: float = 10.0,
    ) -> None:
        self._bus = bus
        self._cluster = cluster
        self._node = node
        self._mover = mover
        self._batch_size = batch_size
        self._concurrency = concurrency
        self._request_timeout_s = request_timeout_s
        self._subscription: Subscription | None = None

    async def serve(self) -> None:
        """Take part in the queue group that receives other nodes' timers."""
        self._subscription = await self._bus.subscribe(
            handoff_subject(self._cluster), self._on_batch, queue=handoff_queue(self._cluster)
        )

    async def stop_serving(self) -> None:
        """Leave the queue group (a leaving node must not receive its own batches)."""
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    async def _on_batch(self, message: Message) -> None:
        try:
            timers = decode_timers(message.data)
        except ValueError as exc:
            logger.warning("malformed hand-off batch ignored: %s", exc)
            return
        placed, failed = await self._mover.place(timers)
        logger.debug("hand-off batch received placed=%d failed=%d", len(placed), len(failed))
        await self._bus.respond(message, dumps({"placed": len(placed), "failed": [t.id for t in failed]}))

    async def send_all(self, timeout_s: float, *, has_peers: Callable[[], bool]) -> tuple[int, int]:
        """Hand every pending timer to the other nodes within ``timeout_s``.

        Timers that fall due meanwhile are delivered here (only those taken for a batch are not), and
        those in a batch are armed by their new owner with their original deadline. Returns
        ``(handed_off, left)``: the timers still here, which stay in local storage.
        Gives up early once ``has_peers()`` is false (every other node left too).
        """
        deadline_s = time.monotonic() + timeout_s
        handed_off = 0
        slots = asyncio.Semaphore(self._concurrency)
        # Each round takes whatever is pending by then: timers put back by a failed batch, and retries
        # of deliveries that were under way, go in the next round.
        while (queue := self._node.pending_ids()) and time.monotonic() < deadline_s and has_peers():
            chunks = [queue[i : i + self._batch_size] for i in range(0, len(queue), self._batch_size)]
            handed_off += sum(await asyncio.gather(*(self._send(ids, slots, deadline_s) for ids in chunks)))
            if self._node.pending_count:
                await asyncio.sleep(_RETRY_PAUSE_S)
        return handed_off, self._node.pending_count + self._node.moving_count

    async def _send(self, ids: list[str], slots: asyncio.Semaphore, deadline_s: float) -> int:
        """Hand off the timers among ``ids`` still pending; returns how many were placed."""
        async with slots:
            timers = self._node.take(ids)
            placed_count = 0
            try:
                # NATS refuses messages over its max_payload: keep every batch well under it.
                max_bytes = self._bus.max_payload_bytes - 4096
                for batch, encoded in encode_timer_batches(timers, max_bytes=max_bytes, max_count=len(timers)):
                    placed = await self._send_batch(batch, encoded, deadline_s)
                    await self._node.release(placed, moved=True)
                    placed_count += len(placed)
            finally:
                await self._node.release(timers, moved=False)  # what was not placed stays here
            return placed_count

    async def _send_batch(self, batch: list[Timer], encoded: bytes, deadline_s: float) -> list[Timer]:
        timeout_s = min(self._request_timeout_s, max(0.1, deadline_s - time.monotonic()))
        try:
            answer: dict[str, Any] = loads(
                await self._bus.request(handoff_subject(self._cluster), encoded, timeout_s=timeout_s)
            )
            unplaced = set(answer.get("failed", ()))
        except (ClusterError, ValueError) as exc:
            logger.warning("hand-off batch not acknowledged count=%d error=%s", len(batch), exc)
            return []
        return [t for t in batch if t.id not in unplaced]
