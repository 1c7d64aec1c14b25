"""SIGTERM/SIGINT: a graceful stop keeps pending timers and lets deliveries finish within the bound."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import pytest

from tests.harness import SkyringProcess, wait_for_log
from tests.process.client import create_timer, get_timer, health
from tests.support import MS, timer_body

pytestmark = pytest.mark.process


async def test_sigterm_exits_0_and_pending_timers_fire_once_after_restart(tmp_path, sink, processes, http):
    """SIGTERM exits 0 at once; timers pending at shutdown fire once, not early, after a restart."""
    data_dir = tmp_path / "data"
    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)
    ids = [f"kept-{i}" for i in range(10)]
    await asyncio.gather(*(create_timer(http, node, timer_body(sink.hook(), timeout_ms=1500), tid) for tid in ids))

    sent_s = time.time()
    assert await node.stop(signal.SIGTERM) == 0
    assert time.time() - sent_s < 2.0
    assert "pending=10 " in node.output
    assert sink.calls == []

    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)
    calls = await sink.wait_for(len(ids), 4000 * MS)
    await asyncio.sleep(300 * MS)
    assert Counter(call.timer_id for call in sink.calls) == Counter(ids)
    for call in calls:
        assert call.received_s * 1000 >= int(call.headers["X-Skyring-Deadline"])


async def test_sigterm_lets_a_delivery_in_flight_finish(tmp_path, receiver, processes, http):
    """SIGTERM during a delivery waits for it (no longer than needed); it is not repeated after a restart."""
    data_dir = tmp_path / "data"
    node = await SkyringProcess.start("--shutdown-timeout-s", "5", data_dir=data_dir)
    processes.append(node)
    await create_timer(http, node, timer_body(receiver.hook("slow", 700), timeout_ms=50))
    await receiver.wait_started(1, 5000 * MS)

    sent_s = time.time()
    assert await node.stop(signal.SIGTERM) == 0
    exited_s = time.time()

    [answered] = receiver.completed
    assert answered.at_s <= exited_s
    assert exited_s - sent_s < 3.0, "shutdown waited for the whole bound instead of the delivery"
    assert "interrupted_deliveries=0" in node.output
    node = await SkyringProcess.start("--shutdown-timeout-s", "5", data_dir=data_dir)
    processes.append(node)
    await asyncio.sleep(300 * MS)
    assert len(receiver.started) == 1
    assert (await health(http, node))["counters"]["recovered"] == 0


async def test_sigterm_cuts_a_delivery_off_at_the_bound_and_it_is_retried_after_restart(
    tmp_path, receiver, processes, http
):
    """A delivery still running when --shutdown-timeout-s is up is abandoned; exit is 0 and it is made again later."""
    data_dir = tmp_path / "data"
    args = ("--shutdown-timeout-s", "0.5", "--delivery-timeout-s", "30")
    node = await SkyringProcess.start(*args, data_dir=data_dir)
    processes.append(node)
    timer_id = await create_timer(http, node, timer_body(receiver.hook("hang-once"), timeout_ms=50))
    await receiver.wait_started(1, 5000 * MS)

    sent_s = time.time()
    assert await node.stop(signal.SIGTERM) == 0
    assert 0.45 <= time.time() - sent_s < 3.0
    assert "interrupted_deliveries=1" in node.output
    assert receiver.completed == []

    node = await SkyringProcess.start(*args, data_dir=data_dir)
    processes.append(node)
    [answered] = await receiver.wait_completed(1, 3000 * MS)
    assert answered.timer_id == timer_id
    assert [call.timer_id for call in receiver.started] == [timer_id, timer_id]
    await asyncio.sleep(100 * MS)
    assert (await get_timer(http, node, timer_id))[0] == 404


async def test_sigint_also_stops_gracefully_with_exit_0(processes):
    """A single SIGINT (Ctrl-C) shuts down like SIGTERM: exit 0, no traceback."""
    node = await SkyringProcess.start()
    processes.append(node)

    assert await node.stop(signal.SIGINT) == 0
    assert "SIGINT received: shutting down" in node.output
    assert f"stopped node={node.node_id}" in node.output
    assert "Traceback" not in node.output


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)],
    ids=["term-term", "int-int", "term-int"],
)
async def test_second_signal_during_a_slow_shutdown_exits_at_once(tmp_path, receiver, processes, http, first, second):
    """A second SIGINT/SIGTERM while shutdown waits on a delivery exits promptly, non-zero, keeping the timer."""
    data_dir = tmp_path / "data"
    args = ("--shutdown-timeout-s", "30", "--delivery-timeout-s", "60")
    node = await SkyringProcess.start(*args, data_dir=data_dir)
    processes.append(node)
    timer_id = await create_timer(http, node, timer_body(receiver.hook("hang-once"), timeout_ms=50))
    await receiver.wait_started(1, 5000 * MS)

    node.proc.send_signal(first)
    await wait_for_log(node, "received: shutting down")
    await asyncio.sleep(200 * MS)
    assert node.proc.returncode is None, "the first signal should wait for the delivery in flight"
    sent_s = time.time()
    node.proc.send_signal(second)
    code = await asyncio.wait_for(node.proc.wait(), 5.0)
    assert time.time() - sent_s < 1.5
    assert code != 0

    node = await SkyringProcess.start(*args, data_dir=data_dir)
    processes.append(node)
    [answered] = await receiver.wait_completed(1, 3000 * MS)
    assert answered.timer_id == timer_id
