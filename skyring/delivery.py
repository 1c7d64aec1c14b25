"""Runs due timers' callbacks: bounded concurrency, a cap per receiver, retries with backoff.

The dispatcher owns every delivery task. It never raises into the timer store: each outcome goes to
a ``DeliverySink`` (the node), which updates the store and storage. Imports core modules and the
transport interface only.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any, Protocol

from .codec import decode_spec
from .errors import DeliveryError
from .timers import Timer
from .transports import Delivery, Transport, Transports

__all__ = ["DeliverySink", "Dispatcher", "RetryPolicy"]

logger = logging.getLogger(__name__)


class DeliverySink(Protocol):
    async def delivered(self, timer: Timer, attempt: int) -> None: ...

    async def retry(self, timer: Timer, attempt: int, due_ms: int) -> None: ...

    async def failed(self, timer: Timer, attempt: int, reason: str) -> None: ...


class RetryPolicy:
    """Exponential backoff with jitter: attempt n waits ``base * 2**(n-1)``, scaled by 0.5-1, capped."""

    def __init__(self, *, max_attempts: int, backoff_s: float, backoff_max_s: float) -> None:
        self.max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s

    def delay_s(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after failed ``attempt`` (1-based); a ``Retry-After`` hint is honoured up to the cap."""
        ceiling = min(self._backoff_max_s, self._backoff_s * 2.0 ** min(attempt - 1, 62))
        delay = random.uniform(ceiling / 2, ceiling)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return min(delay, self._backoff_max_s)


_Job = tuple[Timer, Transport, Any, dict[str, Any]]


class Dispatcher:
    """Starts delivery attempts for due timers, at most ``concurrency`` at once and ``per_destination``
    per receiver; attempts beyond a receiver's cap wait without holding a global slot, so one slow or
    dead receiver cannot hold up the others.
    """

    def __init__(
        self,
        transports: Transports,
        policy: RetryPolicy,
        sink: DeliverySink,
        *,
        now_ms: Callable[[], float],
        concurrency: int,
        per_destination: int,
    ) -> None:
        self._transports = transports
        self._policy = policy
        self._sink = sink
        self._now_ms = now_ms
        self._concurrency = concurrency
        self._per_destination = per_destination
        self._ready: deque[Timer] = deque()
        self._parked: defaultdict[str, deque[_Job]] = defaultdict(deque)
        self._active_by_destination: defaultdict[str, int] = defaultdict(int)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __repr__(self) -> str:
        parked = sum(len(q) for q in self._parked.values())
        return f"<Dispatcher active={len(self._tasks)} ready={len(self._ready)} parked={parked}>"

    @property
    def active(self) -> int:
        return len(self._tasks)

    def submit(self, timer: Timer) -> None:
        """Queue a due timer for delivery."""
        self._ready.append(timer)
        self._pump()

    def _pump(self) -> None:
        while self._ready and len(self._tasks) < self._concurrency and not self._closed:
            job = self._prepare(self._ready.popleft())
            if job is None:
                continue
            try:
                destination = job[1].destination(job[3])
            except Exception as exc:  # a plug-in bug, or a callback stored by another version
                self._spawn(self._sink.failed(job[0], job[0].attempts, f"no destination: {exc!r}"))
                continue
            if self._active_by_destination[destination] >= self._per_destination:
                self._parked[destination].append(job)
            else:
                self._launch(job, destination)

    def _prepare(self, timer: Timer) -> _Job | None:
        try:
            data, callback = decode_spec(timer.spec)
            name = callback["transport"]
        except (ValueError, TypeError, KeyError):
            self._spawn(self._sink.failed(timer, timer.attempts, "stored timer is unreadable"))
            return None
        transport = self._transports.get(name)
        if transport is None:  # stored by a node that had a transport this one lacks
            self._spawn(self._sink.failed(timer, timer.attempts, f"transport {name!r} is not loaded"))
            return None
        return timer, transport, data, callback

    def _launch(self, job: _Job, destination: str) -> None:
        self._active_by_destination[destination] += 1
        task = self._spawn(self._attempt(job))
        task.add_done_callback(lambda _: self._finished(destination))

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _finished(self, destination: str) -> None:
        self._active_by_destination[destination] -= 1
        parked = self._parked.get(destination)
        if parked and not self._closed:
            self._launch(parked.popleft(), destination)
            if not parked:
                del self._parked[destination]
        elif not self._active_by_destination[destination]:
            del self._active_by_destination[destination]
        self._pump()

    async def _attempt(self, job: _Job) -> None:
        timer, transport, data, callback = job
        attempt = timer.attempts + 1
        try:
            try:
                await transport.deliver(Delivery(timer.id, attempt, timer.deadline_ms, data, callback))
            except DeliveryError as exc:
                await self._after_failure(timer, attempt, exc)
            else:
                await self._sink.delivered(timer, attempt)
        except asyncio.CancelledError:
            raise
        except Exception:
            # A transport or sink bug: the timer stays in storage and is tried again after a restart.
            logger.exception("delivery crashed timer=%s attempt=%d", timer.id, attempt)

    async def _after_failure(self, timer: Timer, attempt: int, exc: DeliveryError) -> None:
        if exc.retryable and attempt < self._policy.max_attempts:
            delay_s = self._policy.delay_s(attempt, exc.retry_after_s)
            logger.debug("delivery failed timer=%s attempt=%d reason=%s retry_s=%.3f", timer.id, attempt, exc, delay_s)
            await self._sink.retry(timer, attempt, int(self._now_ms() + delay_s * 1000.0))
        else:
            await self._sink.failed(timer, attempt, exc.reason)

    async def close(self, timeout_s: float) -> int:
        """Start nothing new; let attempts under way finish within ``timeout_s``, then cancel them.

        Returns how many were cancelled (they stay in storage and are retried after a restart).
        """
        self._closed = True
        self._ready.clear()
        self._parked.clear()
        if not self._tasks:
            return 0
        _, still_running = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in still_running:
            task.cancel()
        if still_running:
            await asyncio.wait(still_running)
        return len(still_running)
