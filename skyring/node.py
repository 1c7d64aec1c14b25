"""A node: the timer store, its storage and the dispatcher, and the operations the API offers.

Owns the lifecycle (start, close) and every background task. Never imports ``aiohttp.web``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Iterable
from typing import Any

from . import __version__
from .codec import TimerRequest, encode_timer_view
from .delivery import Dispatcher, RetryPolicy
from .errors import NodeDraining, StorageError, TimerNotFound
from .settings import Settings
from .storage import Storage
from .timers import Clock, LoopClock, Timer, TimerState, TimerStore, deadline_after
from .transports import Transports

__all__ = ["Counters", "Node", "NodeState"]

logger = logging.getLogger(__name__)


class NodeState(enum.Enum):
    STARTING = "starting"  #: recovering timers; not serving yet
    SERVING = "serving"
    LEAVING = "leaving"  #: handing its timers to other nodes; still answers for those it holds
    CLOSING = "closing"  #: refusing changes, finishing deliveries
    CLOSED = "closed"


class Counters:
    """Monotonic event counts since start (``/metrics``)."""

    __slots__ = (
        "adopted",
        "cancelled",
        "created",
        "delivered",
        "failed",
        "moved_out",
        "recovered",
        "replaced",
        "retried",
    )

    def __init__(self) -> None:
        self.created = self.replaced = self.cancelled = 0
        self.delivered = self.retried = self.failed = self.recovered = 0
        self.adopted = self.moved_out = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Node:
    """Creates, replaces, cancels and inspects timers; delivers them when they lapse.

    Args:
        settings: the node's configuration.
        storage: an open storage backend; the node closes it.
        transports: the delivery transports; the node closes them.
        clock: time source; the running loop's by default.
    """

    def __init__(
        self, settings: Settings, *, storage: Storage, transports: Transports, clock: Clock | None = None
    ) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.transports = transports
        self.counters = Counters()
        self.state = NodeState.STARTING
        self._storage = storage
        self._clock = clock or LoopClock(asyncio.get_running_loop().call_later)
        self._dispatcher = Dispatcher(
            transports,
            RetryPolicy(
                max_attempts=settings.delivery_max_attempts,
                backoff_s=settings.delivery_backoff_s,
                backoff_max_s=settings.delivery_backoff_max_s,
            ),
            self,
            now_ms=self._clock.now_ms,
            concurrency=settings.delivery_concurrency,
            per_destination=min(settings.delivery_per_host, settings.delivery_concurrency),
        )
        self._store = TimerStore(self._clock, self._dispatcher.submit)
        self._move_waiters: dict[str, asyncio.Future[None]] = {}

    def __repr__(self) -> str:
        return f"<Node {self.node_id} {self.state.value} {self._store!r} {self._dispatcher!r}>"

    async def start(self) -> None:
        """Recover stored timers (overdue ones fire at once) and start serving."""
        assert self.state is NodeState.STARTING
        recovered = self._store.load(await self._storage.load())
        self.counters.recovered = recovered
        self.state = NodeState.SERVING
        logger.info("timers recovered node=%s count=%d storage=%s", self.node_id, recovered, self._storage.name)

    # -- the API's operations ----------------------------------------------------------------

    async def create(self, request: TimerRequest, timer_id: str) -> None:
        """Store and schedule a new timer. Raises ``TimerExists``, ``StorageError``."""
        self._check_serving()
        timer = self._new_timer(timer_id, request)
        self._store.insert(timer)
        try:
            await self._storage.put(timer)
        except StorageError:
            self._store.discard(timer)
            raise
        self._store.arm(timer)
        self.counters.created += 1

    async def replace(self, timer_id: str, request: TimerRequest) -> None:
        """Replace a pending or retrying timer; its timeout counts from now.

        Raises:
            TimerNotFound, DeliveryInProgress, StorageError.
        """
        self._check_serving()
        old = self._store.current(timer_id)
        new = self._new_timer(timer_id, request)
        self._store.swap(old, new)
        try:
            await self._storage.put(new)
        except StorageError:
            if self._store.swap(new, old):
                self._store.arm(old)
            raise
        self._store.arm(new)
        self.counters.replaced += 1

    async def cancel(self, timer_id: str) -> None:
        """Cancel a pending or retrying timer: once this returns it never fires.

        Raises:
            TimerNotFound, DeliveryInProgress, StorageError (the timer is then still scheduled).
        """
        self._check_serving()
        timer = self._store.remove(timer_id)
        try:
            await self._storage.delete(timer_id)
        except StorageError:
            if self._store.get(timer_id) is None:
                self._store.insert(timer)
                self._store.arm(timer)
            raise
        self.counters.cancelled += 1

    def view(self, timer_id: str) -> bytes:
        """The JSON description of a timer. Raises ``TimerNotFound``."""
        found = self._store.get(timer_id)
        if found is None:
            raise TimerNotFound(timer_id)
        timer, state = found
        return encode_timer_view(timer, state, now_ms=self._clock.now_ms(), node_id=self.node_id)

    def health(self) -> dict[str, Any]:
        storage = self._storage.status()
        if self.state is not NodeState.SERVING:
            status = self.state.value
        else:
            status = "ok" if storage["status"] == "ok" else "degraded"
        return {
            "status": status,
            "node": self.node_id,
            "version": __version__,
            "timers": {
                "pending": self._store.pending_count,
                "delivering": self._store.delivering_count,
                "moving": self._store.moving_count,
                "in_flight": self._dispatcher.active,
            },
            "storage": storage,
            "transports": self.transports.names,
            "counters": self.counters.as_dict(),
        }

    def _new_timer(self, timer_id: str, request: TimerRequest) -> Timer:
        deadline_ms = deadline_after(self._clock.now_ms(), request.timeout_ms)
        return Timer(deadline_ms, timer_id, deadline_ms, request.timeout_ms, 0, request.spec)

    def _check_serving(self) -> None:
        if self.state is not NodeState.SERVING and self.state is not NodeState.LEAVING:
            raise NodeDraining(f"node {self.node_id} is {self.state.value}")

    def begin_leaving(self) -> None:
        """From now on, take in no timers from other nodes."""
        if self.state is NodeState.SERVING:
            self.state = NodeState.LEAVING

    # -- moving timers to other nodes (rebalance, hand-off) and taking them in -------------------

    def holds(self, timer_id: str) -> bool:
        """Whether the timer is here, in any state (moving included)."""
        return timer_id in self._store

    def is_moving(self, timer_id: str) -> bool:
        found = self._store.get(timer_id)
        return found is not None and found[1] is TimerState.MOVING

    async def wait_moved(self, timer_id: str) -> None:
        """Wait until a moving timer has landed at its new owner, or come back here."""
        if not self.is_moving(timer_id):
            return
        waiter = self._move_waiters.get(timer_id)
        if waiter is None:
            waiter = self._move_waiters[timer_id] = asyncio.get_running_loop().create_future()
        await asyncio.shield(waiter)

    def pending_ids(self) -> list[str]:
        return self._store.pending_ids()

    @property
    def pending_count(self) -> int:
        return self._store.pending_count

    @property
    def moving_count(self) -> int:
        return self._store.moving_count

    def take(self, timer_ids: Iterable[str]) -> list[Timer]:
        """Start moving the pending or retrying timers among ``timer_ids``: they fire nowhere until released."""
        return self._store.take(timer_ids)

    async def release(self, timers: list[Timer], *, moved: bool) -> None:
        """End a move: forget timers their new owner has stored, or schedule them here again."""
        if moved:
            self._store.moved(timers)
            self.counters.moved_out += len(timers)
            results = await asyncio.gather(*(self._storage.delete(t.id) for t in timers), return_exceptions=True)
            if any(isinstance(r, BaseException) for r in results):
                logger.warning(
                    "moved timers stay in local storage count=%d: they may fire twice after a restart", len(timers)
                )
        else:
            self._store.restore(timers)
        for timer in timers:
            waiter = self._move_waiters.pop(timer.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def adopt(self, timers: list[Timer]) -> int:
        """Store and schedule timers moved here, keeping their deadlines; ids already here are kept as they are.

        Returns how many were taken in. Raises ``NodeDraining`` or ``StorageError`` (then none were).
        """
        if self.state is not NodeState.SERVING:
            raise NodeDraining(f"node {self.node_id} is {self.state.value}: not taking in timers")
        new = [t for t in timers if t.id not in self._store]
        for timer in new:
            self._store.insert(timer)
        try:
            await asyncio.gather(*(self._storage.put(t) for t in new))
        except StorageError:
            for timer in new:
                self._store.discard(timer)
            raise
        for timer in new:
            self._store.arm(timer)
        self.counters.adopted += len(new)
        return len(new)

    # -- DeliverySink: outcomes of delivery attempts --------------------------------------------

    async def delivered(self, timer: Timer, attempt: int) -> None:
        self._store.finish(timer)
        self.counters.delivered += 1
        await self._forget(timer)

    async def retry(self, timer: Timer, attempt: int, due_ms: int) -> None:
        next_try = timer._replace(due_ms=due_ms, attempts=attempt)
        self._store.retry(timer, next_try)
        self.counters.retried += 1
        try:
            await self._storage.put(next_try)
        except StorageError:
            pass  # logged by the storage; the stored copy keeps the older attempt count

    async def failed(self, timer: Timer, attempt: int, reason: str) -> None:
        logger.warning("delivery failed, giving up timer=%s attempts=%d reason=%s", timer.id, attempt, reason)
        self._store.finish(timer)
        self.counters.failed += 1
        await self._forget(timer)

    async def _forget(self, timer: Timer) -> None:
        try:
            await self._storage.delete(timer.id)
        except StorageError:
            pass  # logged by the storage; the timer may be delivered again after a restart

    # -- shutdown ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Fire nothing more, let attempts under way finish within the shutdown bound, flush storage.

        Pending timers stay in storage for the next start. Safe to call twice.
        """
        if self.state in (NodeState.CLOSING, NodeState.CLOSED):
            return
        self.state = NodeState.CLOSING
        self._store.stop()
        cancelled = await self._dispatcher.close(self.settings.shutdown_timeout_s)
        await self._storage.close()
        await self.transports.close()
        self.state = NodeState.CLOSED
        logger.info(
            "node closed node=%s pending=%d interrupted_deliveries=%d",
            self.node_id,
            self._store.pending_count,
            cancelled,
        )
