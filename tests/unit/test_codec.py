"""The stored and moved forms of timers."""

from __future__ import annotations

from skyring.codec import decode_timers, encode_timer_batches, encode_timers
from skyring.timers import Timer


def timers(count: int, spec_bytes: int) -> list[Timer]:
    spec = b'["' + b"x" * spec_bytes + b'",{"transport":"http"}]'
    return [Timer(1000 + i, f"t{i}", 1000 + i, 500, i % 3, spec) for i in range(count)]


def test_timer_batches_round_trip_with_deadlines_and_attempts():
    """A batch decodes to the very timers that were encoded."""
    batch = timers(5, 10)

    assert decode_timers(encode_timers(batch)) == batch


def test_batches_respect_the_size_and_count_limits():
    """Big timers are split into batches under the byte limit; every timer lands in exactly one batch."""
    batch = timers(100, 10_000)

    batches = encode_timer_batches(batch, max_bytes=100_000, max_count=40)

    assert all(len(encoded) <= 100_000 and len(part) <= 40 for part, encoded in batches)
    assert sorted(t.id for part, _ in batches for t in part) == sorted(t.id for t in batch)
    assert all(decode_timers(encoded) == part for part, encoded in batches)


def test_a_timer_larger_than_the_limit_travels_alone():
    """A single timer over the limit makes a batch of its own (the sender then keeps it)."""
    [(part, encoded)] = encode_timer_batches(timers(1, 50_000), max_bytes=1000, max_count=10)

    assert len(part) == 1 and len(encoded) > 1000
