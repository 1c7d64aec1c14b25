"""Callback receiver for the lateness benchmarks: a raw asyncio HTTP/1.1 server.

Every request that carries ``X-Skyring-Deadline`` is a delivery: it records
``receive time − deadline`` in ms (wall clock, ``time.time()``, the clock skyring's deadlines use)
and answers 200. ``GET /stats`` answers the recorded figures as JSON; ``POST /reset`` clears them.
Prints ``receiver ready port=<port>`` on stdout once listening.

    python bench/receiver.py [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class Recorder:
    def __init__(self) -> None:
        self.lateness_ms: list[float] = []
        self.ids: set[str] = set()
        self.duplicates = 0

    def record(self, now_ms: float, deadline: str, timer_id: str) -> None:
        self.lateness_ms.append(now_ms - int(deadline))
        if timer_id in self.ids:
            self.duplicates += 1
        else:
            self.ids.add(timer_id)

    def stats(self) -> bytes:
        return json.dumps(
            {
                "count": len(self.lateness_ms),
                "distinct": len(self.ids),
                "duplicates": self.duplicates,
                "lateness_ms": self.lateness_ms,
            }
        ).encode()

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class ReceiverProtocol(asyncio.Protocol):
    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._buf = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now_ms = time.time() * 1000.0
        self._buf += data
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buf[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if len(self._buf) < end + 4 + length:
                return
            self._buf = self._buf[end + 4 + length :]
            self._answer(head[0], headers, now_ms)

    def _answer(self, request_line: str, headers: dict[str, str], now_ms: float) -> None:
        assert self._transport is not None
        deadline = headers.get("x-skyring-deadline")
        if deadline is not None:
            self._recorder.record(now_ms, deadline, headers.get("x-skyring-timer-id", ""))
            self._transport.write(_OK)
        elif request_line.startswith("GET /stats"):
            body = self._recorder.stats()
            self._transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
        else:
            if request_line.startswith("POST /reset"):
                self._recorder.reset()
            self._transport.write(_OK)


async def main(port: int) -> None:
    recorder = Recorder()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ReceiverProtocol(recorder), "127.0.0.1", port, backlog=1024)
    print(f"receiver ready port={server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(main(args.port))
    except ImportError:  # pragma: no cover
        asyncio.run(main(args.port))
