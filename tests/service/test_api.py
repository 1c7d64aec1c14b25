"""The timer API end to end on one in-process node, with a real callback receiver."""

from __future__ import annotations

import time

from tests.support import MS, timer_body


async def test_create_answers_201_with_location_and_fires_with_data(client, sink):
    """POST /timer answers 201 + Location and an empty body; the callback receives the data, not early."""
    sent_s = time.time()

    response = await client.post("/timer", json=timer_body(sink.hook(), timeout_ms=200, data={"order": 42}))

    assert response.status == 201
    assert response.headers["Location"].startswith("/timer/")
    assert await response.read() == b""
    [call] = await sink.wait_for(1, 2000 * MS)
    assert call.body == b'{"order":42}'
    assert call.headers["Content-Type"] == "application/json"
    assert call.timer_id == response.headers["Location"].removeprefix("/timer/")
    assert call.received_s - sent_s >= 0.200
