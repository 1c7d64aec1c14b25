"""The framework floor: a bare aiohttp + uvloop + orjson app with skyring's routes and nothing behind them.

``POST /timer`` reads and parses the JSON body and answers 201 with a ``Location``; ``DELETE
/timer/{id}`` answers 202; ``GET /ping`` and ``GET /health`` (with counters, so the benchmark driver can
read rates) as in skyring. No timers, no validation, no middleware. What a create or cancel costs here
is what aiohttp itself costs on this machine at that moment; the difference to skyring is skyring's.
Prints a ``skyring ready`` line like a node does, so ``bench_single.py`` can drive it the same way.

    python bench/baseline_server.py [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import sys
import uuid

import orjson
from aiohttp import web

COUNTS = {"created": 0, "cancelled": 0}


async def create(request: web.Request) -> web.Response:
    doc = orjson.loads(await request.read())
    if not isinstance(doc, dict):
        raise web.HTTPBadRequest()
    timer_id = request.headers.get("x-timer-id") or str(uuid.uuid4())
    COUNTS["created"] += 1
    return web.Response(status=201, headers={"Location": f"/timer/{timer_id}"})


async def cancel(request: web.Request) -> web.Response:
    COUNTS["cancelled"] += 1
    return web.Response(status=202, headers={"Location": f"/timer/{request.match_info['timer_id']}"})


async def ping(request: web.Request) -> web.Response:
    return web.Response()


async def health(request: web.Request) -> web.Response:
    body = {"status": "ok", "timers": {"pending": COUNTS["created"] - COUNTS["cancelled"]}, "counters": COUNTS}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def main(port: int) -> None:
    app = web.Application()
    app.add_routes(
        [
            web.post("/timer", create),
            web.delete("/timer/{timer_id}", cancel),
            web.get("/ping", ping),
            web.get("/health", health),
        ]
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", port), backlog=1024)
    await web.SockSite(runner, sock).start()
    gc.freeze()
    port = sock.getsockname()[1]
    print(f"skyring ready node=baseline url=http://127.0.0.1:{port}", file=sys.stderr, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    import uvloop

    uvloop.run(main(parser.parse_args().port))
