"""The in-memory timer store: which timers exist, in which state, and when each is due.

No I/O. Time comes from an injected ``Clock``; due timers are handed to an ``on_due`` callback.

Why one heap and one armed loop timer, rather than a ``loop.call_later`` handle per timer: a handle
costs ~380-690 bytes and is a GC-tracked object; with a million pending timers a full collection over
the handles stalls the loop for 0.6-1.1 s (``research/limits.md`` §1b). The store keeps each timer as an
exact tuple of atoms (str, int, bytes), which the GC untracks (a ``NamedTuple`` instance stays tracked:
a full collection over 1M of them took 246 ms against 29 ms), and the heap holds those same tuples.
Cancelled timers stay in the heap until they surface or a compaction drops them (lazy deletion, as
asyncio does with its handles). Callers see ``Timer``s; timers are compared by value, not identity.
Imports only ``errors``.
"""

from __future__ import annotations

import enum
import heapq
import math
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from .errors import DeliveryInProgress, TimerExists, TimerNotFound

__all__ = ["Cancellable", "Clock", "LoopClock", "Timer", "TimerState", "TimerStore", "deadline_after"]


class Timer(NamedTuple):
    """One timer. Immutable: a change (retry, replace) makes a new ``Timer``.

    Field order matters: timers are ordered by ``due_ms`` in the store's heap.
    """

    due_ms: int  #: wall-clock ms of the next attempt; ``deadline_ms`` until a retry is scheduled
    id: str
    deadline_ms: int  #: wall-clock ms (epoch) at which the timer lapses
    timeout_ms: int  #: the requested delay; ``deadline_ms - timeout_ms`` is when it was created
    attempts: int  #: delivery attempts made so far
    spec: bytes  #: data and callback, encoded by ``codec.encode_spec``

    @property
    def created_ms(self) -> int:
        return self.deadline_ms - self.timeout_ms


_Raw = tuple[int, str, int, int, int, bytes]  # a Timer's fields as an exact tuple: [0] due_ms, [1] id
_make = Timer._make


class _Index(dict[str, "_Raw"]):
    """An id -> timer dict the GC never untracks.

    CPython untracks an exact dict whose values are all untracked (our timer tuples) at a full
    collection, and tracks it again, as a young object, at the next insert: from then on every young
    collection walks all of its entries (50-100 ms pauses at 1M timers). A subclass is never untracked,
    so once frozen or old it stays out of the young generations.
    """

    __slots__ = ()


def _raw(timer: Timer) -> _Raw:
    return tuple(timer)  # type: ignore[return-value]


class TimerState(enum.Enum):
    PENDING = "pending"  #: waiting for its deadline
    DELIVERING = "delivering"  #: due; an attempt is queued or under way
    RETRYING = "retrying"  #: an attempt failed; waiting for the next one
    MOVING = "moving"  #: being handed to another node; fires nowhere until it lands


def deadline_after(now_ms: float, timeout_ms: int) -> int:
    """The whole-ms deadline ``timeout_ms`` after ``now_ms``, rounded up so it is never early."""
    return math.ceil(now_ms) + timeout_ms


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now_ms(self) -> float: ...

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Cancellable: ...


class LoopClock:
    """Wall-clock time, alarms on the running asyncio loop."""

    def __init__(self, call_later: Callable[[float, Callable[[], None]], Cancellable]) -> None:
        self._call_later = call_later

    def now_ms(self) -> float:
        return time.time() * 1000.0

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Cancellable:
        return self._call_later(delay_s, callback)


class TimerStore:
    """Timers by id, in three states, with one alarm armed for the earliest due time.

    A timer is *inserted* first and *armed* later, so a caller can make it durable in between; until
    it is armed it cannot fire but can be found, replaced and cancelled.

    Args:
        clock: time source and alarm.
        on_due: called, synchronously, with each timer whose ``due_ms`` has passed; the timer is then
            in state DELIVERING until ``finish`` or ``retry``.
        fire_batch: most timers handed over per loop iteration, so a burst does not stall the loop.
    """

    def __init__(self, clock: Clock, on_due: Callable[[Timer], None], *, fire_batch: int = 512) -> None:
        self._clock = clock
        self._on_due = on_due
        self._fire_batch = fire_batch
        self._pending = _Index()
        self._delivering = _Index()
        self._moving = _Index()
        self._heap: list[_Raw] = []
        self._alarm: Cancellable | None = None
        self._alarm_due_ms = math.inf
        self._running = True

    def __len__(self) -> int:
        return len(self._pending) + len(self._delivering) + len(self._moving)

    def __repr__(self) -> str:
        return (
            f"<TimerStore pending={len(self._pending)} delivering={len(self._delivering)}"
            f" moving={len(self._moving)} heap={len(self._heap)}>"
        )

    def __contains__(self, timer_id: str) -> bool:
        return timer_id in self._pending or timer_id in self._delivering or timer_id in self._moving

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def delivering_count(self) -> int:
        return len(self._delivering)

    @property
    def moving_count(self) -> int:
        return len(self._moving)

    def get(self, timer_id: str) -> tuple[Timer, TimerState] | None:
        if (raw := self._pending.get(timer_id)) is not None:
            timer = _make(raw)
            return timer, TimerState.RETRYING if timer.attempts else TimerState.PENDING
        if (raw := self._delivering.get(timer_id)) is not None:
            return _make(raw), TimerState.DELIVERING
        if (raw := self._moving.get(timer_id)) is not None:
            return _make(raw), TimerState.MOVING
        return None

    def insert(self, timer: Timer) -> None:
        """Add an unarmed timer. Raises ``TimerExists`` if the id is taken in any state."""
        if timer.id in self:
            raise TimerExists(timer.id)
        self._pending[timer.id] = _raw(timer)

    def arm(self, timer: Timer) -> None:
        """Schedule ``timer``, unless it was replaced or removed since it was inserted."""
        raw = self._pending.get(timer.id)
        if raw is None or raw != timer:
            return
        heapq.heappush(self._heap, raw)
        if timer.due_ms < self._alarm_due_ms:
            self._set_alarm()

    def current(self, timer_id: str) -> Timer:
        """The timer that may still be changed: pending or retrying.

        Raises:
            TimerNotFound: no such timer.
            DeliveryInProgress: it is being delivered.
        """
        raw = self._pending.get(timer_id)
        if raw is None:
            if timer_id in self._delivering:
                raise DeliveryInProgress(timer_id)
            raise TimerNotFound(timer_id)  # a moving timer is found through its new owner
        return _make(raw)

    def swap(self, old: Timer, new: Timer) -> bool:
        """Put unarmed ``new`` in place of ``old``; False if ``old`` is no longer current."""
        if self._pending.get(old.id) != old:
            return False
        self._pending[old.id] = _raw(new)
        self._note_stale()
        return True

    def remove(self, timer_id: str) -> Timer:
        """Cancel a pending or retrying timer; it will not fire. Raises like ``current``."""
        timer = self.current(timer_id)
        del self._pending[timer_id]
        self._note_stale()
        return timer

    def discard(self, timer: Timer) -> None:
        """Remove ``timer`` if it is still the current one (used to roll back a failed write)."""
        if self._pending.get(timer.id) == timer:
            del self._pending[timer.id]
            self._note_stale()

    def finish(self, timer: Timer) -> None:
        """A delivering timer is done (delivered or given up); forget it."""
        if self._delivering.get(timer.id) == timer:
            del self._delivering[timer.id]

    def retry(self, timer: Timer, next_try: Timer) -> None:
        """Move a delivering ``timer`` back to the heap as ``next_try`` (state RETRYING)."""
        if self._delivering.get(timer.id) == timer:
            del self._delivering[timer.id]
            self._pending[timer.id] = _raw(next_try)
            self.arm(next_try)

    def pending_ids(self) -> list[str]:
        """Ids of the timers that are pending or retrying (a snapshot)."""
        return list(self._pending)

    def take(self, timer_ids: Iterable[str]) -> list[Timer]:
        """Move those of ``timer_ids`` that are pending or retrying to MOVING; returns them."""
        taken = []
        for timer_id in timer_ids:
            raw = self._pending.pop(timer_id, None)
            if raw is not None:
                self._moving[timer_id] = raw
                taken.append(_make(raw))
        self._note_stale()
        return taken

    def moved(self, timers: Iterable[Timer]) -> None:
        """Forget MOVING timers that their new owner now holds."""
        for timer in timers:
            if self._moving.get(timer.id) == timer:
                del self._moving[timer.id]

    def restore(self, timers: Iterable[Timer]) -> None:
        """Schedule MOVING timers here again (their move failed)."""
        for timer in timers:
            raw = self._moving.get(timer.id)
            if raw is not None and raw == timer:
                del self._moving[timer.id]
                self._pending[timer.id] = raw
                self.arm(timer)

    def load(self, timers: Iterable[Timer]) -> int:
        """Add and arm many timers at once (recovery). Returns how many were added."""
        count = 0
        for timer in timers:
            self.insert(timer)
            self._heap.append(self._pending[timer.id])
            count += 1
        heapq.heapify(self._heap)
        self._set_alarm()
        return count

    def stop(self) -> None:
        """Fire nothing more. Timers stay where they are."""
        self._running = False
        self._cancel_alarm()

    def _note_stale(self) -> None:
        # Removed timers linger in the heap; rebuild it once they outnumber the live ones.
        if len(self._heap) > 2 * len(self._pending) + 1024:
            pending = self._pending
            self._heap[:] = [raw for raw in self._heap if pending.get(raw[1]) is raw]  # same list: it may be frozen
            heapq.heapify(self._heap)

    def _cancel_alarm(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        self._alarm_due_ms = math.inf

    def _set_alarm(self, now_ms: float | None = None) -> None:
        self._cancel_alarm()
        if not self._heap or not self._running:
            return
        due_ms = self._heap[0][0]
        if now_ms is None:
            now_ms = self._clock.now_ms()
        self._alarm_due_ms = due_ms
        self._alarm = self._clock.call_later(max(0.0, (due_ms - now_ms) / 1000.0), self._on_alarm)

    def _on_alarm(self) -> None:
        self._alarm = None
        self._alarm_due_ms = math.inf
        now_ms = self._clock.now_ms()
        heap, pending, delivering = self._heap, self._pending, self._delivering
        handed = 0
        # The alarm may ring early (uvloop rounds to whole ms): the due check re-arms instead of firing.
        while heap and heap[0][0] <= now_ms and handed < self._fire_batch:
            raw = heapq.heappop(heap)
            timer_id = raw[1]
            if pending.get(timer_id) is raw:
                del pending[timer_id]
                delivering[timer_id] = raw
                handed += 1
                self._on_due(_make(raw))
        self._set_alarm(now_ms)
