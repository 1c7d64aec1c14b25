"""Delivery over the http transport: headers, retries, backoff, failures and isolation between targets."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tests.sink import CallbackSink
from tests.support import MS, eventually, timer_body


async def create(client, body, **headers) -> str:
    response = await client.post("/timer", json=body, headers=headers)
    assert response.status == 201, await response.text()
    return response.headers["Location"].removeprefix("/timer/")


async def state_of(client, timer_id: str) -> dict:
    response = await client.get(f"/timer/{timer_id}")
    assert response.status == 200
    return await response.json()


async def test_callback_carries_metadata_and_own_headers(client, sink):
    """A callback has the timer id, deadline, attempt, user agent, the timer's headers and text data."""
    body = timer_body(sink.hook(), timeout_ms=10, data="héllo", method="put")
    body["callback"]["headers"] = {"Authorization": "Bearer t0k3n", "X-Trace": "abc"}

    timer_id = await create(client, body)
    [call] = await sink.wait_for(1, 2000 * MS)

    assert call.method == "PUT"
    assert call.body == "héllo".encode()
    assert call.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert call.headers["X-Skyring-Timer-Id"] == timer_id
    assert call.headers["X-Skyring-Attempt"] == "1"
    assert int(call.headers["X-Skyring-Deadline"]) <= call.received_s * 1000
    assert call.headers["User-Agent"].startswith("skyring/")
    assert call.headers["Authorization"] == "Bearer t0k3n"
    assert call.headers["X-Trace"] == "abc"


async def test_timer_without_data_sends_an_empty_body(client, sink):
    """No data (or null) means an empty callback body with no content type."""
    await create(client, timer_body(sink.hook(), timeout_ms=10))

    [call] = await sink.wait_for(1, 2000 * MS)

    assert call.body == b""
    assert "Content-Type" not in call.headers


async def test_flaky_target_is_retried_until_it_succeeds(client, sink):
    """A target failing twice with 503 gets the callback a third time, attempt 3, and then no more."""
    timer_id = await create(client, timer_body(sink.hook("flaky", 2), timeout_ms=10, data={"n": 1}))

    await sink.wait_for(3, 3000 * MS)
    await asyncio.sleep(300 * MS)

    assert [c.attempt for c in sink.calls_for(timer_id)] == [1, 2, 3]
    assert all(c.body == b'{"n":1}' for c in sink.calls)
    assert (await client.get(f"/timer/{timer_id}")).status == 404


async def test_timer_is_retrying_between_attempts_and_a_cancel_then_wins(make_client, sink):
    """Between attempts a timer shows state retrying; cancelling it then stops further attempts."""
    client = await make_client(delivery_backoff_s=0.4, delivery_backoff_max_s=0.4)
    timer_id = await create(client, timer_body(sink.hook("status", 500), timeout_ms=10))
    await sink.wait_for(1, 2000 * MS)

    view = await state_of(client, timer_id)
    assert view["state"] == "retrying"
    assert view["attempts"] == 1
    assert (await client.delete(f"/timer/{timer_id}")).status == 202
    await asyncio.sleep(600 * MS)

    assert len(sink.calls_for(timer_id)) == 1


async def test_client_error_is_final_and_logged(client, sink, caplog):
    """A 4xx other than 408/425/429 is not retried; the timer is dropped with a WARNING naming it."""
    caplog.set_level(logging.WARNING, logger="skyring")
    timer_id = await create(client, timer_body(sink.hook("status", 404), timeout_ms=10))

    await sink.wait_for(1, 2000 * MS)
    await asyncio.sleep(200 * MS)

    assert len(sink.calls_for(timer_id)) == 1
    assert (await client.get(f"/timer/{timer_id}")).status == 404
    assert any(timer_id in r.getMessage() and "HTTP 404" in r.getMessage() for r in caplog.records)


async def test_dead_target_is_retried_up_to_the_limit_then_dropped(make_client, caplog, unused_tcp_port):
    """Connection refused is retried max_attempts times, then the timer is dropped and counted."""
    caplog.set_level(logging.WARNING, logger="skyring")
    client = await make_client(delivery_max_attempts=3, delivery_backoff_s=0.02, delivery_backoff_max_s=0.05)
    timer_id = await create(client, timer_body(f"http://127.0.0.1:{unused_tcp_port}/hook", timeout_ms=10))

    async def failed() -> int:
        return (await (await client.get("/health")).json())["counters"]["failed"]

    async def failed_once() -> bool:
        return await failed() == 1

    await eventually(failed_once, 3)

    health = await (await client.get("/health")).json()
    assert health["counters"]["retried"] == 2
    assert (await client.get(f"/timer/{timer_id}")).status == 404
    assert any(timer_id in r.getMessage() and "attempts=3" in r.getMessage() for r in caplog.records)


async def test_retry_after_is_honoured(make_client, sink):
    """A 429 with Retry-After: 1 delays the next attempt by at least a second."""
    client = await make_client(delivery_backoff_max_s=5)
    timer_id = await create(client, timer_body(sink.hook("retry-after", 1), timeout_ms=10))

    first, second = await sink.wait_for(2, 3000 * MS)

    assert [first.attempt, second.attempt] == [1, 2]
    assert second.received_s - first.received_s >= 0.95
    assert len(sink.calls_for(timer_id)) == 2


async def test_hanging_target_times_out_and_is_retried(make_client, sink):
    """An attempt that gets no answer is cut off after delivery_timeout_s and retried."""
    client = await make_client(delivery_timeout_s=0.2, delivery_max_attempts=2)
    await create(client, timer_body(sink.hook("hang"), timeout_ms=10))

    async def retried() -> bool:
        return (await (await client.get("/health")).json())["counters"]["retried"] >= 1

    await eventually(lambda: sink.in_flight >= 1, 3)
    await eventually(retried, 3)


async def test_cancel_during_delivery_answers_409(make_client, sink):
    """While an attempt is under way a DELETE cannot win, and says so with 409."""
    client = await make_client(delivery_timeout_s=5)
    timer_id = await create(client, timer_body(sink.hook("slow", 500), timeout_ms=10))
    await eventually(lambda: sink.in_flight == 1, 2)

    response = await client.delete(f"/timer/{timer_id}")

    assert response.status == 409
    assert (await response.json())["error"] == "delivery_in_progress"
    assert (await state_of(client, timer_id))["state"] == "delivering"
    put = await client.put(f"/timer/{timer_id}", json=timer_body(sink.hook(), timeout_ms=1000))
    assert put.status == 409


async def test_hanging_target_does_not_delay_other_targets(make_client, aiohttp_server):
    """With a slow receiver saturated, timers for another receiver are still delivered on time."""
    slow, fast = CallbackSink(), CallbackSink()
    for receiver in (slow, fast):
        receiver.url = str((await aiohttp_server(receiver.app())).make_url("")).rstrip("/")
    client = await make_client(delivery_concurrency=16, delivery_per_host=4, delivery_timeout_s=5)
    for _ in range(40):
        await create(client, timer_body(slow.hook("hang"), timeout_ms=10))
    await eventually(lambda: slow.in_flight == 4, 2)

    for _ in range(20):
        await create(client, timer_body(fast.hook(), timeout_ms=50))
    calls = await fast.wait_for(20, 2000 * MS)

    lateness_ms = [c.received_s * 1000 - int(c.headers["X-Skyring-Deadline"]) for c in calls]
    assert max(lateness_ms) < 200
    assert slow.max_in_flight == 4


async def test_burst_is_delivered_with_bounded_concurrency(make_client, sink):
    """Many timers due at once are all delivered, never more than delivery_concurrency at a time."""
    client = await make_client(delivery_concurrency=8, delivery_per_host=8)
    ids = await asyncio.gather(*(create(client, timer_body(sink.hook("slow", 5), timeout_ms=300)) for _ in range(300)))

    await sink.wait_for(300, 10_000 * MS)

    assert sorted(c.timer_id for c in sink.calls) == sorted(ids)
    assert sink.max_in_flight <= 8


async def test_no_timer_fires_early(client, sink):
    """Across many timers with varied timeouts, none is received before its deadline."""
    sent: dict[str, float] = {}
    for i in range(100):
        timeout_ms = 20 + (i * 7) % 250
        before_s = time.time()
        timer_id = await create(client, timer_body(sink.hook(), timeout_ms=timeout_ms))
        sent[timer_id] = before_s + timeout_ms / 1000

    calls = await sink.wait_for(100, 5000 * MS)

    assert all(c.received_s >= sent[c.timer_id] for c in calls)
    assert all(c.received_s * 1000 >= int(c.headers["X-Skyring-Deadline"]) for c in calls)


async def test_cancelled_timers_never_fire(client, sink):
    """Of many timers, exactly those not cancelled fire, each once."""
    ids = [await create(client, timer_body(sink.hook(), timeout_ms=200)) for _ in range(60)]
    cancelled = set(ids[::2])
    for timer_id in cancelled:
        assert (await client.delete(f"/timer/{timer_id}")).status == 202

    await sink.wait_for(30, 3000 * MS)
    await asyncio.sleep(300 * MS)

    assert sorted(c.timer_id for c in sink.calls) == sorted(set(ids) - cancelled)


async def test_put_replaces_data_callback_and_timeout(client, sink):
    """A PUT replaces everything; the new timeout counts from the PUT and the old timer never fires."""
    timer_id = await create(client, timer_body(sink.hook(), timeout_ms=300, data="old"))
    await asyncio.sleep(100 * MS)
    put_s = time.time()

    response = await client.put(
        f"/timer/{timer_id}", json=timer_body(sink.hook("ok", "new"), timeout_ms=400, data="new")
    )
    assert response.status == 200
    [call] = await sink.wait_for(1, 2000 * MS)
    await asyncio.sleep(200 * MS)

    assert len(sink.calls) == 1
    assert call.body == b"new"
    assert call.path == "/ok/new/hook"
    assert call.received_s - put_s >= 0.4


@pytest.mark.parametrize("method", ["get", "post", "put", "patch", "delete"])
async def test_every_method_is_delivered(client, sink, method):
    """Each accepted HTTP method is used for the callback, with the body, GET included."""
    await create(client, timer_body(sink.hook(), timeout_ms=5, data={"m": method}, method=method))

    [call] = await sink.wait_for(1, 2000 * MS)

    assert call.method == method.upper()
    assert call.body == b'{"m":"%s"}' % method.encode()
