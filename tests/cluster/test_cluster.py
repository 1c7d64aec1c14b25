"""A cluster of real node processes over a real nats-server: routing, joins, leaves, crashes, outages."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from tests.cluster.client import call, check_fired_once_on_time, create
from tests.cluster.conftest import cluster_view, wait_for_ring
from tests.harness import start_command
from tests.support import eventually, timer_body

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


async def test_timer_created_on_one_node_is_managed_through_the_others(trio, http, sink):
    """A timer made through A can be read through B, replaced through C and cancelled through B."""
    a, b, c = trio
    timer = await create(http, a, sink.hook(), 60_000)

    async with http.get(f"{b.url}/timer/{timer.id}") as response:
        assert response.status == 200
        view = await response.json()
    assert view["id"] == timer.id
    assert view["node"] in {n.node_id for n in trio}

    async with http.put(f"{c.url}/timer/{timer.id}", json=timer_body(sink.hook(), timeout_ms=300, data="new")) as r:
        assert r.status == 200
        assert r.headers["Location"] == f"/timer/{timer.id}"
    [delivered] = await sink.wait_for(1, 5)
    assert delivered.body == b"new"
    assert await call(http, "DELETE", b, timer.id) == 404
    async with http.delete(f"{b.url}/timer/unknown-id") as r:
        assert r.status == 404
        assert r.headers["x-skyring-reason"]
        assert (await r.json())["error"] == "timer_not_found"


async def test_forwarded_errors_come_back_unchanged(trio, http, sink):
    """A duplicate id created through any node gets the owner's 409 with the existing Location."""
    a, b, c = trio
    await create(http, a, sink.hook(), 60_000, **{"x-timer-id": "order-42"})

    for node in (a, b, c):
        async with http.post(
            node.url + "/timer", json=timer_body(sink.hook()), headers={"x-timer-id": "order-42"}
        ) as r:
            assert r.status == 409
            assert r.headers["Location"] == "/timer/order-42"
            assert r.headers["x-skyring-reason"]
            assert (await r.json())["error"] == "timer_exists"


async def test_cancels_through_random_nodes_win_and_the_rest_fire_once(trio, http, sink):
    """300 timers made through random nodes, 100 cancelled through random nodes: exactly the other 200 fire, once."""
    rng = random.Random(7)
    created = await asyncio.gather(
        *(create(http, rng.choice(trio), sink.hook(), 1500 + rng.randrange(1000)) for _ in range(300))
    )
    cancelled = rng.sample(created, 100)

    statuses = await asyncio.gather(*(call(http, "DELETE", rng.choice(trio), t.id) for t in cancelled))
    assert set(statuses) == {202}
    await sink.wait_for(200, 10)
    await asyncio.sleep(0.5)

    kept = [t for t in created if t not in cancelled]
    check_fired_once_on_time(kept, sink.calls, max_lateness_ms=500)


async def test_sigterm_hands_every_timer_to_the_others(trio, http, sink):
    """A node stopped with SIGTERM while 1,000 timers are pending hands its share off: all fire once, on time."""
    rng = random.Random(11)
    created = await asyncio.gather(
        *(create(http, rng.choice(trio), sink.hook(), 2500 + rng.randrange(1500)) for _ in range(1000))
    )
    leaving = trio[0]
    held_before = (await (await http.get(leaving.url + "/health")).json())["timers"]["pending"]
    assert held_before > 100

    code = await leaving.stop(signal.SIGTERM)

    assert code == 0, leaving.output
    assert "hand-off done" in leaving.output and "failed=0" in leaving.output, leaving.output
    await sink.wait_for(1000, 15)
    await asyncio.sleep(0.5)
    check_fired_once_on_time(created, sink.calls, max_lateness_ms=1000)


async def test_a_joining_node_takes_its_share_and_cancels_during_the_move_win(trio, start_node, http, sink):
    """With 1,000 timers pending a 4th node joins; timers move to it; those cancelled meanwhile never fire."""
    rng = random.Random(13)
    created = await asyncio.gather(
        *(create(http, rng.choice(trio), sink.hook(), 3000 + rng.randrange(1000)) for _ in range(1000))
    )

    joiner_start = asyncio.create_task(start_node("n4"))
    cancelled = created[:150]
    statuses = []
    for timer in cancelled:  # keep cancelling, through every node, while the join and the moves happen
        statuses.append(await call(http, "DELETE", rng.choice(trio), timer.id))
    joiner = await joiner_start
    await wait_for_ring(http, [*trio, joiner])

    assert set(statuses) == {202}
    adopted = (await (await http.get(joiner.url + "/health")).json())["counters"]["adopted"]
    assert adopted > 50
    kept = created[150:]
    await sink.wait_for(len(kept), 15)
    await asyncio.sleep(0.5)
    check_fired_once_on_time(kept, sink.calls, max_lateness_ms=1000)


async def test_a_crashed_node_restarts_with_its_timers_cancellable_anywhere(start_node, http, sink):
    """kill -9 a node, start it again on its data: its timers fire once and can be cancelled through any node."""
    nodes = [await start_node(f"d{i}", durable=True) for i in (1, 2, 3)]
    await wait_for_ring(http, nodes)
    rng = random.Random(17)
    created = await asyncio.gather(*(create(http, rng.choice(nodes), sink.hook(), 6000) for _ in range(150)))
    victim = nodes[1]
    await victim.kill()
    await wait_for_ring(http, [nodes[0], nodes[2]])

    restarted = await start_node("d2", durable=True)
    nodes[1] = restarted
    await wait_for_ring(http, nodes)
    views = await asyncio.gather(*(call(http, "GET", rng.choice(nodes), t.id) for t in created))
    assert set(views) == {200}
    cancelled = created[:30]
    statuses = await asyncio.gather(*(call(http, "DELETE", rng.choice(nodes), t.id) for t in cancelled))
    assert set(statuses) == {202}

    await sink.wait_for(120, 15)
    await asyncio.sleep(0.5)
    check_fired_once_on_time(created[30:], sink.calls, max_lateness_ms=1000)


async def test_timers_fire_while_nats_is_down_and_the_cluster_recovers(trio, http, sink, nats_server):
    """NATS stops and starts again while timers are pending: they fire, and the ring never shrinks."""
    rng = random.Random(19)
    created = await asyncio.gather(*(create(http, rng.choice(trio), sink.hook(), 2500) for _ in range(90)))
    checksum = (await cluster_view(http, trio[0]))["ring"]["checksum"]

    await nats_server.stop()
    await asyncio.sleep(2.0)  # longer than the failure timeout: nobody may be dropped
    views = await asyncio.gather(*(cluster_view(http, n) for n in trio))
    assert {v["ring"]["checksum"] for v in views} == {checksum}
    more = await asyncio.gather(*(create(http, rng.choice(trio), sink.hook(), 300) for _ in range(30)))
    await nats_server.restart()

    await sink.wait_for(120, 10)
    check_fired_once_on_time([*created, *more], sink.calls, max_lateness_ms=1000)
    await wait_for_ring(http, trio)


async def test_unreachable_owner_gets_503_within_the_retry_bound(trio, http, sink):
    """Requests for ids owned by a node that just died answer 503 with a reason, quickly; later the ring heals."""
    a, b, c = trio
    created = await asyncio.gather(*(create(http, a, sink.hook(), 60_000) for _ in range(30)))
    owners = await asyncio.gather(*(http.get(f"{a.url}/timer/{t.id}") for t in created))
    owned_by_c = [t for t, r in zip(created, owners, strict=True) if (await r.json())["node"] == c.node_id]
    assert owned_by_c
    await c.kill()

    async with http.get(f"{a.url}/timer/{owned_by_c[0].id}", timeout=10) as response:
        status = response.status
        reason = response.headers.get("x-skyring-reason", "")
    await wait_for_ring(http, [a, b])

    assert status in (503, 404), reason
    if status == 503:
        assert "unreachable" in reason
    async with http.post(a.url + "/timer", json=timer_body(sink.hook(), timeout_ms=100)) as r:
        assert r.status == 201
    await eventually(lambda: len(sink.calls) >= 1, 5)


async def test_nodes_started_side_by_side_keep_separate_default_stores(nats_server, processes, http, tmp_path):
    """Three clustered nodes started in one directory without --data-dir each get skyring-data/<node-id>."""
    args = ("serve", "--port", "0", "--nats", nats_server.url, "--cluster", "side", "--heartbeat-s", "0.2")
    nodes = [await start_command(*args, "--node-id", f"s{i}", cwd=tmp_path) for i in (1, 2, 3)]
    processes.extend(nodes)

    await wait_for_ring(http, nodes)

    assert sorted(p.name for p in (tmp_path / "skyring-data").iterdir()) == ["s1", "s2", "s3"]


async def test_leave_without_grace_loses_nothing(start_node, http, sink):
    """SIGTERM with --leave-grace-s 0 and thousands of timers: the survivors hold every one, none stranded."""
    nodes = list(await asyncio.gather(*(start_node(f"g{i}", "--leave-grace-s", "0") for i in (1, 2, 3))))
    await wait_for_ring(http, nodes)
    rng = random.Random(23)
    semaphore = asyncio.Semaphore(32)

    async def one() -> None:
        async with semaphore:
            await create(http, rng.choice(nodes), sink.hook(), 120_000)

    await asyncio.gather(*(one() for _ in range(4000)))

    assert await nodes[0].stop(signal.SIGTERM) == 0
    reports = [await (await http.get(n.url + "/health")).json() for n in nodes[1:]]

    assert sum(r["timers"]["pending"] for r in reports) == 4000, nodes[0].output[-2000:]
    assert "failed=0" in nodes[0].output
