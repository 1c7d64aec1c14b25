"""A tiny keep-alive HTTP/1.1 client on asyncio streams, for the benchmarks' own light traffic.

Much cheaper per request than ``aiohttp.ClientSession`` (which costs ~80 µs CPU a request here), so
the pinger and the lateness test's creator do not compete with the server for CPU. It understands
exactly what a skyring node answers: a status line, headers and a ``Content-Length`` body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class HttpError(Exception):
    pass


class Connection:
    """One keep-alive connection; requests on it run one at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> Connection:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
            self._writer = self._reader = None

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request and read its answer: ``(status, lower-cased headers, body)``."""
        if self._writer is None or self._reader is None:
            await self.open()
        assert self._writer is not None and self._reader is not None
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        head += [f"{name}: {value}" for name, value in headers]
        if body or method in ("POST", "PUT"):
            head.append(f"Content-Length: {len(body)}")
        self._writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise HttpError(f"bad status line {lines[0]!r}")
        found: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                found[name.strip().lower()] = value.strip()
        length = int(found.get("content-length", "0"))
        data = await self._reader.readexactly(length) if length else b""
        if found.get("connection", "").lower() == "close":
            await self.close()
        return int(parts[1]), found, data


def split_url(url: str) -> tuple[str, int]:
    """``http://host:port`` → ``(host, port)``."""
    rest = url.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)
