"""The timer store: states, ordering, never-early firing, cancellation and bursts, on a fake clock."""

from __future__ import annotations

import gc

import pytest

from skyring.errors import DeliveryInProgress, TimerExists, TimerNotFound
from skyring.timers import Timer, TimerState, TimerStore, deadline_after
from tests.fakes import FakeClock


def make_timer(clock: FakeClock, timer_id: str, timeout_ms: int, spec: bytes = b"[null,{}]") -> Timer:
    deadline_ms = deadline_after(clock.now_ms(), timeout_ms)
    return Timer(deadline_ms, timer_id, deadline_ms, timeout_ms, 0, spec)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fired() -> list[Timer]:
    return []


@pytest.fixture
def store(clock: FakeClock, fired: list[Timer]) -> TimerStore:
    return TimerStore(clock, fired.append)


def lookups_to(action, store: TimerStore) -> int:
    """How many liveness lookups the schedule makes while ``action()`` runs (its work, in entries)."""
    pending, checks = store._pending, 0

    class CountingLookups:
        def get(self, timer_id):
            nonlocal checks
            checks += 1
            return pending.get(timer_id)

    store._schedule._live = CountingLookups()
    try:
        action()
    finally:
        store._schedule._live = pending
    return checks


def add(store: TimerStore, timer: Timer) -> Timer:
    store.insert(timer)
    store.arm(timer)
    return timer


def test_deadline_is_rounded_up_to_a_whole_ms():
    """A fractional now never makes the deadline earlier than now + timeout."""
    assert deadline_after(1000.2, 5) == 1006
    assert deadline_after(1000.0, 5) == 1005


def test_timer_fires_at_its_deadline_not_before(store, clock, fired):
    """A timer is handed over once its deadline has passed, and not a moment earlier."""
    timer = add(store, make_timer(clock, "a", 100))

    clock.advance(99.9)
    assert fired == []
    clock.advance(0.1)

    assert fired == [timer]
    assert store.get("a") == (timer, TimerState.DELIVERING)


def test_timers_fire_in_deadline_order(store, clock, fired):
    """Timers inserted in any order fire in deadline order."""
    for timer_id, timeout_ms in [("c", 300), ("a", 100), ("b", 200)]:
        add(store, make_timer(clock, timer_id, timeout_ms))

    clock.advance(1000)

    assert [t.id for t in fired] == ["a", "b", "c"]


def test_early_alarm_rearms_instead_of_firing(clock, fired):
    """An alarm that rings before the deadline (as uvloop's can) fires nothing and re-arms."""

    class EarlyClock(FakeClock):
        def call_later(self, delay_s, callback):
            return super().call_later(delay_s - min(0.002, delay_s / 2), callback)

    early = EarlyClock()
    store = TimerStore(early, fired.append)
    add(store, make_timer(early, "a", 100))

    early.advance(98.5)
    assert fired == []
    early.advance(1.5)

    assert [t.id for t in fired] == ["a"]


def test_unarmed_timer_does_not_fire_but_can_be_found(store, clock, fired):
    """An inserted timer is visible at once and fires only after it is armed."""
    timer = make_timer(clock, "a", 10)
    store.insert(timer)

    clock.advance(50)
    assert fired == []
    assert store.get("a") == (timer, TimerState.PENDING)
    store.arm(timer)
    clock.advance(0)

    assert fired == [timer]


def test_insert_of_an_existing_id_raises(store, clock):
    """Ids are unique across every state."""
    add(store, make_timer(clock, "a", 10))
    with pytest.raises(TimerExists):
        store.insert(make_timer(clock, "a", 20))
    clock.advance(10)
    with pytest.raises(TimerExists):
        store.insert(make_timer(clock, "a", 20))


def test_removed_timer_never_fires(store, clock, fired):
    """A cancelled timer is gone: it never fires and cannot be found."""
    add(store, make_timer(clock, "a", 100))

    store.remove("a")
    clock.advance(1000)

    assert fired == []
    assert store.get("a") is None
    with pytest.raises(TimerNotFound):
        store.remove("a")


def test_delivering_timer_cannot_be_removed_or_changed(store, clock):
    """Once a timer is due, cancel and replace answer DeliveryInProgress."""
    add(store, make_timer(clock, "a", 10))
    clock.advance(10)

    with pytest.raises(DeliveryInProgress):
        store.remove("a")
    with pytest.raises(DeliveryInProgress):
        store.current("a")


def test_swap_replaces_timer_and_old_deadline_is_ignored(store, clock, fired):
    """After a replace only the new timer fires, at its own deadline."""
    old = add(store, make_timer(clock, "a", 100, b"old"))
    new = make_timer(clock, "a", 300, b"new")

    assert store.swap(old, new)
    store.arm(new)
    clock.advance(200)
    assert fired == []
    clock.advance(100)

    assert fired == [new]


def test_swap_back_restores_the_old_timer(store, clock, fired):
    """Rolling a replace back re-arms the old timer at its old deadline, once."""
    old = add(store, make_timer(clock, "a", 100, b"old"))
    new = make_timer(clock, "a", 300, b"new")
    store.swap(old, new)

    assert store.swap(new, old)
    store.arm(old)
    clock.advance(1000)

    assert fired == [old]


def test_same_id_recreated_with_same_deadline_fires_once(store, clock, fired):
    """A stale heap entry for a recreated id does not make it fire twice."""
    first = add(store, make_timer(clock, "a", 100))
    store.remove("a")
    second = add(store, first._replace(spec=b"second"))

    clock.advance(200)

    assert fired == [second]


def test_retry_moves_timer_back_to_pending_as_retrying(store, clock, fired):
    """A failed attempt returns the timer to the heap; it fires again at the retry time."""
    timer = add(store, make_timer(clock, "a", 10))
    clock.advance(10)
    next_try = timer._replace(due_ms=timer.due_ms + 500, attempts=1)

    store.retry(timer, next_try)

    assert store.get("a") == (next_try, TimerState.RETRYING)
    clock.advance(499)
    assert fired == [timer]
    clock.advance(1)
    assert fired == [timer, next_try]


def test_finish_forgets_a_delivered_timer(store, clock):
    """After finish the id is free again."""
    timer = add(store, make_timer(clock, "a", 10))
    clock.advance(10)

    store.finish(timer)

    assert store.get("a") is None
    assert len(store) == 0


def test_burst_is_handed_over_in_batches(clock, fired):
    """Many timers due at once are handed over a batch per alarm, so the loop is not held."""
    store = TimerStore(clock, fired.append, fire_batch=100)
    deadline_ms = deadline_after(clock.now_ms(), 10)
    store.load(Timer(deadline_ms, f"t{i}", deadline_ms, 10, 0, b"") for i in range(1000))
    alarms: list[int] = []
    real_call_later = clock.call_later

    def counting_call_later(delay_s, callback):
        alarms.append(len(fired))
        return real_call_later(delay_s, callback)

    clock.call_later = counting_call_later  # type: ignore[method-assign]
    clock.advance(10)

    assert len(fired) == 1000
    assert alarms[:3] == [100, 200, 300]


def test_load_arms_recovered_timers_and_overdue_ones_fire_at_once(store, clock, fired):
    """Recovered timers keep their deadlines; overdue ones fire on the next alarm."""
    now = clock.now_ms()
    overdue = Timer(int(now) - 5000, "late", int(now) - 5000, 1000, 0, b"")
    future = Timer(int(now) + 5000, "future", int(now) + 5000, 9000, 0, b"")

    assert store.load([future, overdue]) == 2
    clock.advance(0)
    assert fired == [overdue]
    clock.advance(5000)
    assert fired == [overdue, future]


def test_stop_fires_nothing_more(store, clock, fired):
    """A stopped store keeps its timers but never fires them."""
    add(store, make_timer(clock, "a", 10))

    store.stop()
    clock.advance(100)

    assert fired == []
    assert store.pending_count == 1


def test_cancelled_timers_do_not_pile_up(store, clock):
    """Cancelled timers, near or far, leave few dead entries behind."""
    for i in range(6000):
        add(store, make_timer(clock, f"t{i}", 500 if i % 2 else 3_600_000 + i * 1000))
    for i in range(6000):
        store.remove(f"t{i}")

    assert len(store._schedule) <= 1024 + 4096


def test_mass_cancel_never_does_much_work_in_one_call(clock, fired):
    """Cancelling most of 50,000 far-off timers looks at a bounded number of entries per cancel."""
    store = TimerStore(clock, fired.append)
    for i in range(50_000):
        add(store, make_timer(clock, f"t{i}", 60_000 + (i % 3000) * 1000))
    most = 0
    for i in range(45_000):
        most = max(most, lookups_to(lambda i=i: store.remove(f"t{i}"), store))
    clock.advance(3_100_000)

    assert most < 5000
    assert len(fired) == 5000
    assert sorted(t.id for t in fired) == sorted(f"t{i}" for i in range(45_000, 50_000))


def test_timers_days_ahead_are_resorted_as_they_come_near(store, clock, fired):
    """A timer two days out passes through the coarse buckets and fires exactly at its deadline."""
    timer = add(store, make_timer(clock, "far", 2 * 86_400_000 + 1234))
    near = add(store, make_timer(clock, "near", 5000))

    clock.advance(2 * 86_400_000 + 1233)
    assert fired == [near]
    clock.advance(1)

    assert fired == [near, timer]


def test_far_timers_fire_on_time_across_buckets(store, clock, fired):
    """Timers due seconds to hours ahead fire at their deadlines, in order, never early."""
    timeouts_ms = [1, 999, 1000, 1001, 1999, 2500, 61_000, 3_600_000]
    timers = [add(store, make_timer(clock, f"t{ms}", ms)) for ms in timeouts_ms]

    for timer in timers:
        clock.advance(timer.deadline_ms - clock.now_ms() - 0.5)
        assert timer not in fired
        clock.advance(0.5)
        assert fired[-1] == timer


def test_pending_timers_are_not_tracked_by_the_gc(store, clock):
    """Timers are tuples of atoms: after one collection the GC no longer walks them."""
    add(store, make_timer(clock, "a", 1000, b'[{"x":1},{"transport":"http"}]'))

    gc.collect()

    assert not gc.is_tracked(store._pending["a"])
    assert not any(gc.is_tracked(raw) for raw in store._schedule._near)


def test_taken_timers_do_not_fire_and_keep_their_id(store, clock, fired):
    """A timer being moved fires nowhere here, and its id stays taken."""
    timer = add(store, make_timer(clock, "a", 10))

    assert store.take(["a", "unknown"]) == [timer]
    clock.advance(100)

    assert fired == []
    assert store.get("a") == (timer, TimerState.MOVING)
    with pytest.raises(TimerExists):
        store.insert(timer)
    with pytest.raises(TimerNotFound):
        store.remove("a")


def test_moved_timers_are_forgotten(store, clock):
    """Once the new owner holds a moved timer, this store no longer knows it."""
    timer = add(store, make_timer(clock, "a", 10))
    store.take(["a"])

    store.moved([timer])

    assert "a" not in store
    assert len(store) == 0


def test_restored_timers_fire_here_at_their_deadline(store, clock, fired):
    """A failed move puts timers back, still due at their original deadline."""
    timer = add(store, make_timer(clock, "a", 50))
    store.take(["a"])
    clock.advance(20)

    store.restore([timer])
    clock.advance(29)
    assert fired == []
    clock.advance(1)

    assert fired == [timer]


def test_index_stays_tracked_so_young_collections_skip_it(store, clock):
    """The id index is never untracked, so it is not re-tracked as a young object walked by every collection."""
    add(store, make_timer(clock, "a", 1000))
    gc.collect()

    assert gc.is_tracked(store._pending)


def test_buckets_stay_fine_while_time_passes_without_alarms(clock, fired):
    """One-hour timers created over minutes land in 1 s buckets (not ever wider ones), and cancels stay cheap."""
    store = TimerStore(clock, fired.append)
    for i in range(30_000):
        add(store, make_timer(clock, f"t{i}", 3_600_000))
        clock.advance(10)  # 300 s pass; no alarm rings, the first timer is an hour away
    most = 0
    for i in range(0, 30_000, 2):
        most = max(most, lookups_to(lambda i=i: store.remove(f"t{i}"), store))

    assert max(len(bucket) for bucket in store._schedule._far.values()) <= 101
    assert most <= 512


def test_an_error_handing_over_one_timer_does_not_stop_the_others(clock):
    """If on_due raises for one timer, the alarm is still re-armed and later timers fire."""
    fired: list[str] = []

    def on_due(timer):
        if timer.id == "bad":
            raise RuntimeError("boom")
        fired.append(timer.id)

    store = TimerStore(clock, on_due)
    add(store, make_timer(clock, "bad", 10))
    add(store, make_timer(clock, "good", 20))

    with pytest.raises(RuntimeError):
        clock.advance(10)
    clock.advance(10)

    assert fired == ["good"]
