"""The in-memory timer store: which timers exist, in which state, and when each is due.

No I/O. Time comes from an injected ``Clock``; due timers are handed to an ``on_due`` callback.

Why not a ``loop.call_later`` handle per timer: a handle costs ~380-690 bytes and is a GC-tracked
object; with a million pending timers a full collection over the handles stalls the loop for 0.6-1.1 s
(``research/limits.md`` §1b). The store keeps each timer as an exact tuple of atoms (str, int, bytes),
which the GC untracks (a ``NamedTuple`` instance stays tracked: a full collection over 1M of them took
246 ms against 29 ms), and schedules them in a ``_Schedule`` with one loop alarm armed for the earliest.
Callers see ``Timer``s; timers are compared by value, not identity.
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


_SECOND_MS = 1000
# (entries due at most this far beyond now, go in buckets this wide): a bucket is
# re-sorted into finer ones, or into the heap, once its start enters the near window.
_LEVELS = ((3_600_000, 1000), (86_400_000, 60_000), (math.inf, 3_600_000))
_MIGRATE_BATCH = 20_000  # entries moved between levels per loop iteration
_SWEEP_EVERY = 256  # forgotten entries between two sweeps for dead ones
_SWEEP_BATCH = 512  # entries a sweep looks at: twice the dead ones made meanwhile


class _Schedule:
    """Due times of armed timers: a heap for the next second or two, coarse buckets beyond.

    A timer due within the hour waits in a 1 s bucket, within the day in a 1 min one, beyond in a
    1 h one; a bucket is re-sorted into finer buckets, or into the heap, once its start enters the
    near window, a bounded slice per loop iteration. Removed timers leave dead entries behind (lazy
    deletion: an entry is live while ``live[id] is entry``): they are dropped when they surface, when the near heap is
    rebuilt, or by a sweep over the buckets that runs a little with every few removals. With one heap
    for everything, cancelling half of 1M timers meant rebuilding a 1M-entry heap at once (~1 s stall).
    """

    def __init__(self, live: dict[str, _Raw], now_ms: float) -> None:
        self._live = live
        self._near: list[_Raw] = []  # a heap of the entries due before _horizon_ms
        self._near_dead = 0
        # Bucket key: its start (a whole second, in ms) plus its level (0-2).
        self._far: dict[int, list[_Raw]] = {}
        self._far_keys: list[int] = []  # a heap of keys in _far (and some already gone)
        self._horizon_ms = (int(now_ms) // _SECOND_MS + 2) * _SECOND_MS
        self._forgotten = 0
        self._sweep_keys: list[int] = []  # buckets still to sweep in this round; the last is under way
        self._sweep_at = 0  # where in that bucket the sweep goes on

    def __len__(self) -> int:
        return len(self._near) + sum(map(len, self._far.values()))

    def push(self, raw: _Raw, now_ms: float) -> None:
        due_ms = raw[0]
        if due_ms < self._horizon_ms:
            heapq.heappush(self._near, raw)
            return
        # The width follows the distance from now: the horizon moves only when an alarm rings, which
        # for far-off timers can be an hour away (a stale horizon put 1 h timers in 1 min buckets).
        distance_ms = due_ms - max(self._horizon_ms, now_ms)
        level = 0
        while distance_ms > _LEVELS[level][0]:
            level += 1
        key = due_ms - due_ms % _LEVELS[level][1] + level
        bucket = self._far.get(key)
        if bucket is None:
            self._far[key] = [raw]
            heapq.heappush(self._far_keys, key)
        else:
            bucket.append(raw)

    def next_ms(self) -> float:
        """When the store must next look: the earliest near entry, or a second before a bucket starts."""
        near_ms = self._near[0][0] if self._near else math.inf
        far_ms = self._far_keys[0] // _SECOND_MS * _SECOND_MS - _SECOND_MS if self._far_keys else math.inf
        return min(near_ms, far_ms)

    def advance(self, now_ms: float) -> bool:
        """Re-sort the buckets whose start the near window now covers; True if some are left for later."""
        self._horizon_ms = max(self._horizon_ms, (int(now_ms) // _SECOND_MS + 2) * _SECOND_MS)
        keys, far, live = self._far_keys, self._far, self._live
        budget = _MIGRATE_BATCH
        while keys and keys[0] < self._horizon_ms:
            bucket = far.get(keys[0])
            if bucket is None:
                heapq.heappop(keys)
                continue
            if budget <= 0:
                return True
            moving = bucket[-budget:]
            del bucket[-budget:]
            if not bucket:
                del far[heapq.heappop(keys)]
            budget -= len(moving)
            for raw in moving:
                if live.get(raw[1]) is raw:
                    self.push(raw, now_ms)  # into the heap, or a finer bucket (never one already due)
        return False

    def pop_due(self, now_ms: float) -> _Raw | None:
        """The earliest entry if it is due by ``now_ms`` (live or not), else None."""
        near = self._near
        if near and near[0][0] <= now_ms:
            return heapq.heappop(near)
        return None

    def forget(self, raw: _Raw) -> None:
        """``raw`` is no longer live: account for its dead entry."""
        if raw[0] < self._horizon_ms:
            self._near_dead += 1
            if self._near_dead > len(self._near) // 2 + 1024:
                live = self._live
                self._near[:] = [r for r in self._near if live.get(r[1]) is r]
                heapq.heapify(self._near)
                self._near_dead = 0
        self._forgotten += 1
        if self._forgotten >= _SWEEP_EVERY:
            self._forgotten = 0
            self._sweep()

    def _sweep(self) -> None:
        """Drop dead entries from the next ``_SWEEP_BATCH`` bucket entries, round-robin over all buckets."""
        far, live = self._far, self._live
        looked_at = 0
        while looked_at < _SWEEP_BATCH:
            if not self._sweep_keys:
                self._sweep_keys = list(far)
                self._sweep_at = 0
                if not self._sweep_keys:
                    return
            key = self._sweep_keys[-1]
            bucket = far.get(key)
            if bucket is None or self._sweep_at >= len(bucket):
                self._sweep_keys.pop()
                self._sweep_at = 0
                if bucket is not None and not bucket:
                    del far[key]
                continue
            # One window of a bucket at a time, so a big bucket never makes one cancel slow.
            start, end = self._sweep_at, self._sweep_at + _SWEEP_BATCH - looked_at
            window = bucket[start:end]
            kept = [raw for raw in window if live.get(raw[1]) is raw]
            if len(kept) < len(window):
                bucket[start:end] = kept
            self._sweep_at = start + len(kept)
            looked_at += len(window)


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
        self._schedule = _Schedule(self._pending, clock.now_ms())
        self._alarm: Cancellable | None = None
        self._alarm_due_ms = math.inf
        self._running = True

    def __len__(self) -> int:
        return len(self._pending) + len(self._delivering) + len(self._moving)

    def __repr__(self) -> str:
        return (
            f"<TimerStore pending={len(self._pending)} delivering={len(self._delivering)}"
            f" moving={len(self._moving)} scheduled={len(self._schedule)}>"
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
        self._schedule.push(raw, self._clock.now_ms())
        if self._schedule.next_ms() < self._alarm_due_ms:
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
        raw = self._pending.get(old.id)
        if raw is None or raw != old:
            return False
        self._pending[old.id] = _raw(new)
        self._schedule.forget(raw)
        return True

    def remove(self, timer_id: str) -> Timer:
        """Cancel a pending or retrying timer; it will not fire. Raises like ``current``."""
        timer = self.current(timer_id)
        self._schedule.forget(self._pending.pop(timer_id))
        return timer

    def discard(self, timer: Timer) -> None:
        """Remove ``timer`` if it is still the current one (used to roll back a failed write)."""
        raw = self._pending.get(timer.id)
        if raw is not None and raw == timer:
            del self._pending[timer.id]
            self._schedule.forget(raw)

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
                self._schedule.forget(raw)
                taken.append(_make(raw))
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
        now_ms = self._clock.now_ms()
        for timer in timers:
            self.insert(timer)
            self._schedule.push(self._pending[timer.id], now_ms)
            count += 1
        self._set_alarm()
        return count

    def stop(self) -> None:
        """Fire nothing more. Timers stay where they are."""
        self._running = False
        self._cancel_alarm()

    def _cancel_alarm(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        self._alarm_due_ms = math.inf

    def _set_alarm(self, now_ms: float | None = None, *, soon: bool = False) -> None:
        self._cancel_alarm()
        if now_ms is None:
            now_ms = self._clock.now_ms()
        due_ms = now_ms if soon else self._schedule.next_ms()
        if due_ms == math.inf or not self._running:
            return
        self._alarm_due_ms = due_ms
        self._alarm = self._clock.call_later(max(0.0, (due_ms - now_ms) / 1000.0), self._on_alarm)

    def _on_alarm(self) -> None:
        self._alarm = None
        self._alarm_due_ms = math.inf
        now_ms = self._clock.now_ms()
        schedule, pending, delivering = self._schedule, self._pending, self._delivering
        more = False
        try:
            more = schedule.advance(now_ms)
            handed = 0
            # The alarm may ring early (uvloop rounds to whole ms): the due check re-arms instead of firing.
            while handed < self._fire_batch and (raw := schedule.pop_due(now_ms)) is not None:
                timer_id = raw[1]
                if pending.get(timer_id) is raw:
                    del pending[timer_id]
                    delivering[timer_id] = raw
                    handed += 1
                    self._on_due(_make(raw))
        finally:
            # Whatever ``on_due`` raised, the next alarm is armed: one bad timer must not stop the rest.
            self._set_alarm(now_ms, soon=more)
