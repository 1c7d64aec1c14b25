"""Test doubles for the core's seams."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class _Alarm:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A ``Clock`` whose time moves only on ``advance``; alarms ring in time order, never early."""

    def __init__(self, now_ms: float = 1_700_000_000_000.0) -> None:
        self._now_ms = now_ms
        self._alarms: list[tuple[float, int, _Alarm, Callable[[], None]]] = []
        self._seq = itertools.count()

    def now_ms(self) -> float:
        return self._now_ms

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> _Alarm:
        alarm = _Alarm()
        heapq.heappush(self._alarms, (self._now_ms + delay_s * 1000.0, next(self._seq), alarm, callback))
        return alarm

    @property
    def armed(self) -> int:
        return sum(not alarm.cancelled for _, _, alarm, _ in self._alarms)

    def advance(self, ms: float) -> None:
        target_ms = self._now_ms + ms
        while self._alarms and self._alarms[0][0] <= target_ms:
            when_ms, _, alarm, callback = heapq.heappop(self._alarms)
            if alarm.cancelled:
                continue
            self._now_ms = max(self._now_ms, when_ms)
            callback()
        self._now_ms = target_ms
