"""kill -9 of a node with sqlite storage: acknowledged timers survive, fire once, never early."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import orjson
import pytest

from tests.harness import SkyringProcess
from tests.process.client import cancel_timer, create_timer, get_timer, health
from tests.support import MS, timer_body

pytestmark = pytest.mark.process


async def test_sigkill_with_pending_timers_loses_none_and_each_fires_once(tmp_path, sink, processes, http):
    """After kill -9 and a restart on the same data dir every acknowledged timer fires exactly once, never
    before its deadline, and pending ones can still be read and cancelled."""
    data_dir = tmp_path / "data"
    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)
    soon = [f"soon-{i}" for i in range(25)]
    later = [f"later-{i}" for i in range(25)]
    bodies = {tid: timer_body(sink.hook(), timeout_ms=1000, data={"id": tid}) for tid in soon}
    bodies |= {tid: timer_body(sink.hook(), timeout_ms=3000, data={"id": tid}) for tid in later}
    await asyncio.gather(*(create_timer(http, node, body, tid) for tid, body in bodies.items()))
    views = await asyncio.gather(*(get_timer(http, node, tid) for tid in bodies))
    deadline_ms = {view["id"]: view["deadline_ms"] for _, view in views}

    assert await node.kill() == -9
    assert sink.calls == []
    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)

    assert (await health(http, node))["counters"]["recovered"] == 50
    status, view = await get_timer(http, node, later[0])
    assert status == 200
    assert view["state"] == "pending"
    assert view["deadline_ms"] == deadline_ms[later[0]]
    assert view["node"] == node.node_id
    cancelled = later[-5:]
    assert [await cancel_timer(http, node, tid) for tid in cancelled] == [202] * 5
    assert [(await get_timer(http, node, tid))[0] for tid in cancelled] == [404] * 5

    expected = set(bodies) - set(cancelled)
    await sink.wait_for(len(expected), 6000 * MS)
    await asyncio.sleep(300 * MS)  # room for a duplicate or a cancelled timer to show up
    assert Counter(call.timer_id for call in sink.calls) == Counter(expected)
    for call in sink.calls:
        deadline = int(call.headers["X-Skyring-Deadline"])
        assert deadline == deadline_ms[call.timer_id]
        assert call.received_s * 1000 >= deadline, f"{call.timer_id} fired {deadline - call.received_s * 1000} ms early"
        assert orjson.loads(call.body) == {"id": call.timer_id}
    assert (await health(http, node))["timers"]["pending"] == 0


async def test_timers_overdue_at_restart_fire_at_once(tmp_path, sink, processes, http):
    """Timers whose deadline passed while the node was down are delivered as soon as it is back."""
    data_dir = tmp_path / "data"
    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)
    ids = [f"overdue-{i}" for i in range(10)]
    await asyncio.gather(*(create_timer(http, node, timer_body(sink.hook(), timeout_ms=1000), tid) for tid in ids))
    await node.kill()
    assert sink.calls == []
    killed_s = time.time()

    await asyncio.sleep(max(0.0, killed_s + 1.2 - time.time()))  # every deadline has passed
    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)
    ready_s = time.time()

    calls = await sink.wait_for(len(ids), 2000 * MS)
    await asyncio.sleep(200 * MS)
    assert Counter(call.timer_id for call in sink.calls) == Counter(ids)
    for call in calls:
        assert call.received_s - ready_s < 1.0, "an overdue timer waited after the restart"
        assert call.received_s * 1000 >= int(call.headers["X-Skyring-Deadline"])
        assert call.attempt == 1


async def test_delivery_cut_off_by_a_crash_is_delivered_again_after_restart(tmp_path, receiver, processes, http):
    """A delivery in flight when the node is killed is made again after the restart (at-least-once)."""
    data_dir = tmp_path / "data"
    node = await SkyringProcess.start("--delivery-timeout-s", "30", data_dir=data_dir)
    processes.append(node)
    timer_id = await create_timer(http, node, timer_body(receiver.hook("hang-once"), timeout_ms=100, data="once"))
    [first] = await receiver.wait_started(1, 5000 * MS)
    await node.kill()

    node = await SkyringProcess.start("--delivery-timeout-s", "30", data_dir=data_dir)
    processes.append(node)
    [answered] = await receiver.wait_completed(1, 3000 * MS)
    await asyncio.sleep(300 * MS)

    assert len(receiver.started) == 2, "delivered more than once after the restart"
    assert first.timer_id == answered.timer_id == timer_id
    assert answered.deadline_ms == first.deadline_ms
    assert answered.body == first.body == b"once"
    assert answered.attempt >= 1
    assert (await get_timer(http, node, timer_id))[0] == 404  # delivered and forgotten
    assert (await health(http, node))["counters"]["delivered"] == 1


async def test_every_acknowledged_create_survives_a_kill_in_the_middle_of_a_burst(tmp_path, sink, processes, http):
    """kill -9 while creates are in flight: every create answered 201 is there after the restart."""
    data_dir = tmp_path / "data"
    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)
    acked: list[str] = []
    enough = asyncio.Event()

    async def create(timer_id: str) -> None:
        body = timer_body(sink.hook(), timeout_ms=60_000)
        async with http.post(f"{node.url}/timer", json=body, headers={"x-timer-id": timer_id}) as response:
            if response.status == 201:
                acked.append(timer_id)
                if len(acked) >= 50:
                    enough.set()

    tasks = [asyncio.create_task(create(f"burst-{i}")) for i in range(300)]
    await asyncio.wait_for(enough.wait(), 10.0)
    await node.kill()
    await asyncio.gather(*tasks, return_exceptions=True)  # the rest fail or succeed; either is fine

    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)
    statuses = await asyncio.gather(*(get_timer(http, node, tid) for tid in acked))
    assert [status for status, _ in statuses] == [200] * len(acked)
    assert (await health(http, node))["counters"]["recovered"] >= len(acked)


async def test_a_retrying_timer_keeps_its_attempt_count_and_schedule_across_a_crash(tmp_path, sink, processes, http):
    """A timer waiting for a retry when the node is killed is retried after the restart as attempt 2, not before
    its scheduled time."""
    data_dir = tmp_path / "data"
    args = ("--delivery-backoff-s", "2")  # the retry comes 1-2 s after the first attempt
    node = await SkyringProcess.start(*args, data_dir=data_dir)
    processes.append(node)
    timer_id = await create_timer(http, node, timer_body(sink.hook("flaky", 1), timeout_ms=50))
    await sink.wait_for(1, 5000 * MS)
    async with asyncio.timeout(2.0):  # the retry is written to storage after the 503 comes back
        while True:
            if (await health(http, node))["storage"]["commits"] >= 2:  # the create, then the retry
                break
            await asyncio.sleep(0.01)
    await node.kill()

    node = await SkyringProcess.start(*args, data_dir=data_dir)
    processes.append(node)
    status, view = await get_timer(http, node, timer_id)
    assert status == 200
    assert view["state"] == "retrying"
    assert view["attempts"] == 1
    _, retry = await sink.wait_for(2, 4000 * MS)
    assert retry.timer_id == timer_id
    assert retry.attempt == 2
    assert retry.received_s * 1000 >= view["next_attempt_ms"]
    await asyncio.sleep(200 * MS)
    assert len(sink.calls) == 2
