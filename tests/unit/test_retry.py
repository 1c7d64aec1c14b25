"""Retry policy and Retry-After parsing."""

from __future__ import annotations

import email.utils
import time

from skyring.delivery import RetryPolicy
from skyring.transports.http import parse_retry_after


def test_backoff_doubles_with_jitter_and_is_capped():
    """Attempt n waits between half and all of base * 2**(n-1), never above the cap."""
    policy = RetryPolicy(max_attempts=10, backoff_s=1.0, backoff_max_s=10.0)

    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (60, 10.0)]:
        delays = [policy.delay_s(attempt) for _ in range(200)]
        assert ceiling / 2 <= min(delays) <= max(delays) <= ceiling


def test_retry_after_raises_the_delay_up_to_the_cap():
    """A Retry-After longer than the backoff is honoured, but not beyond the cap."""
    policy = RetryPolicy(max_attempts=10, backoff_s=0.1, backoff_max_s=30.0)

    assert policy.delay_s(1, retry_after_s=5.0) == 5.0
    assert policy.delay_s(1, retry_after_s=600.0) == 30.0


def test_retry_after_parses_seconds_and_http_dates():
    """Retry-After is delta-seconds or an HTTP date; anything else is ignored."""
    in_a_minute = email.utils.formatdate(time.time() + 60, usegmt=True)

    assert parse_retry_after("120") == 120.0
    assert 55 <= parse_retry_after(in_a_minute) <= 61
    assert parse_retry_after("soon") is None
    assert parse_retry_after("") is None
    assert parse_retry_after(None) is None
