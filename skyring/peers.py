"""The node-to-node channel: forwarded API requests and timer batches between cluster nodes.

A request is ``(meta, body)`` and so is its reply: ``meta`` a JSON object, ``body`` opaque bytes; this
module knows nothing about timers. Each peer address gets one persistent TCP connection, opened on
first use, and requests are pipelined on it by id (framing in ``frames``). Framing over
``asyncio.Protocol`` rather than HTTP: a proxy hop did ~16k req/s at 62+14 µs CPU per request against
~5k and 190+80 µs with aiohttp keep-alive (``research/limits.md`` §3).

A reply carries its request's id. The reply meta ``{"peer_error": "<message>"}`` means the remote
handler raised. Imports ``frames``, ``codec`` and ``errors`` only; never aiohttp or nats.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import PeerError, PeerNotConnected, PeerTimeout, PeerUnavailable
from .frames import MAX_FRAME_BYTES, Connection, close_all

__all__ = ["MAX_FRAME_BYTES", "Handler", "PeerClient", "PeerServer"]

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any], bytes], Awaitable[tuple[dict[str, Any], bytes]]]
_Reply = tuple[dict[str, Any], bytes]
_Pending = tuple["asyncio.Future[_Reply]", float, float]  # reply, deadline (loop time), timeout_s

_ERROR_KEY = "peer_error"  # reserved in reply metas
_MAX_IN_FLIGHT = 1024  # handler tasks per server connection before it stops reading
_RESUME_IN_FLIGHT = 512
_ALARM_SLACK_S = 0.001  # uvloop rounds timers to whole ms and may ring that much early


# -- server


class PeerServer:
    """Accepts peer connections and answers each request with ``handler(meta, body)``.

    Each request runs in its own task; many run at once on one connection, and replies go out as
    they finish. An exception from the handler is logged and answered as an error frame. If its
    connection closes, a running handler still finishes; its reply is dropped.

    Start with ``await PeerServer.start(host, port, handler)``.
    """

    def __init__(self, handler: Handler) -> None:
        self.port = 0  #: the bound port
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    async def start(cls, host: str, port: int, handler: Handler) -> PeerServer:
        """Listen on ``host:port`` (port 0: any free port, then read ``port``). Raises ``OSError``."""
        loop = asyncio.get_running_loop()
        server = cls(handler)
        server._server = await loop.create_server(lambda: _ServerConnection(loop, server), host, port)
        server.port = server._server.sockets[0].getsockname()[1]
        logger.info("peer server listening on %s port=%d", host, server.port)
        return server

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<PeerServer port={self.port} connections={len(self._connections)} handling={len(self._tasks)}{state}>"

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def handling_count(self) -> int:
        """Requests whose handler is running."""
        return len(self._tasks)

    async def close(self) -> None:
        """Stop listening, cancel and await the handlers, close the connections. Safe to repeat."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(self._connections)
        if self._server is not None:
            await self._server.wait_closed()
        logger.info("peer server closed port=%d", self.port)


class _ServerConnection(Connection):
    def __init__(self, loop: asyncio.AbstractEventLoop, server: PeerServer) -> None:
        super().__init__(loop)
        self._server = server
        self._in_flight = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peer = _format_peername(transport.get_extra_info("peername"))
        self._server._connections.add(self)
        if self._server._closed:  # accepted while the server was closing
            self.abort()
        logger.debug("peer connected peer=%s", self.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._server._connections.discard(self)
        logger.debug("peer disconnected peer=%s in_flight=%d", self.peer, self._in_flight)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._pause_reading()  # the peer is not reading replies: stop taking requests

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._in_flight <= _RESUME_IN_FLIGHT:
            self._resume_reading()

    def _frame_received(self, request_id: int, meta: dict[str, Any], body: bytes) -> None:
        task = self._loop.create_task(self._answer(request_id, meta, body))
        self._server._tasks.add(task)
        task.add_done_callback(self._answered)
        self._in_flight += 1
        if self._in_flight >= _MAX_IN_FLIGHT:
            self._pause_reading()

    def _answered(self, task: asyncio.Task[None]) -> None:
        self._server._tasks.discard(task)
        self._in_flight -= 1
        if self._reading_paused and self._in_flight <= _RESUME_IN_FLIGHT and not self.write_paused:
            self._resume_reading()

    async def _answer(self, request_id: int, meta: dict[str, Any], body: bytes) -> None:
        try:
            reply_meta, reply_body = await self._server._handler(meta, body)
        except Exception as exc:
            logger.exception("peer handler failed peer=%s request=%d", self.peer, request_id)
            reply_meta, reply_body = _error_meta(exc), b""
        if self.closed:
            return
        try:
            self._write_frame(request_id, reply_meta, reply_body)
        except Exception as exc:  # not encodable, or too large
            logger.exception("peer reply cannot be sent peer=%s request=%d", self.peer, request_id)
            self._write_frame(request_id, _error_meta(exc), b"")

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self.closed:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if not self._reading_paused or self._transport is None or self.closed:
            return
        self._reading_paused = False
        self._transport.resume_reading()
        if self._chunks and self._buffered_bytes >= self._need_bytes:  # frames received before the pause
            self._parse(self._take_buffered())


def _error_meta(exc: Exception) -> dict[str, Any]:
    return {_ERROR_KEY: f"{type(exc).__name__}: {exc}"[:1000]}


def _format_peername(peername: Any) -> str:
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return str(peername)


# -- client


class PeerClient:
    """Sends requests to peers, one persistent, pipelined connection per peer address.

    A connection is opened by the first request to an address (concurrent first requests share the
    attempt) and reopened by the next request after it is lost.

    Args:
        timeout_s: how long a request waits for its reply, unless the request says otherwise.
        connect_timeout_s: how long opening a connection may take.
    """

    def __init__(self, *, timeout_s: float, connect_timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._connections: dict[str, _ClientConnection] = {}  # by address: the one requests use
        self._live: set[_ClientConnection] = set()  # every open connection, including retiring ones
        self._connecting: dict[str, asyncio.Task[_ClientConnection]] = {}
        self._closed = False

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (
            f"<PeerClient connections={len(self._live)} pending={self.pending_count} "
            f"connecting={len(self._connecting)}{state}>"
        )

    @property
    def connection_count(self) -> int:
        return len(self._live)

    @property
    def pending_count(self) -> int:
        """Requests sent and not yet answered."""
        return sum(len(c.pending) for c in self._live)

    async def request(
        self, address: str, meta: dict[str, Any], body: bytes = b"", *, timeout_s: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """Send ``(meta, body)`` to the peer at ``address`` and return its reply ``(meta, body)``.

        Args:
            address: ``host:port``, an IPv6 host in brackets (``[::1]:7000``).
            timeout_s: how long to wait for the reply (default: the client's ``timeout_s``); a
                connection still to be opened first gets ``connect_timeout_s`` on top.

        Raises:
            PeerUnavailable: cannot connect, or the connection was lost before the reply.
            PeerTimeout: no reply in time; a late reply is dropped.
            PeerError: the remote handler raised, or the request is too large to send.
        """
        connection = self._connections.get(address)
        if connection is None:
            connection = await self._connect(address)
        if timeout_s is None:
            timeout_s = self._timeout_s
        if connection.write_paused:
            timeout_s = await connection.wait_writable(timeout_s)
        request_id, reply = connection.send(meta, body, timeout_s)
        try:
            return await reply
        except asyncio.CancelledError:
            connection.pending.pop(request_id, None)
            raise

    def forget(self, address: str) -> None:
        """Close the connection to ``address`` (a peer that left); its pending requests fail."""
        self._connecting.pop(address, None)  # an attempt under way is discarded when it completes
        connection = self._connections.pop(address, None)
        if connection is not None:
            connection.abort_with(PeerUnavailable(f"peer {address} was forgotten"))

    async def close(self) -> None:
        """Close every connection; pending requests fail with ``PeerUnavailable``. Safe to repeat."""
        if self._closed:
            return
        self._closed = True
        attempts = list(self._connecting.values())
        self._connecting.clear()
        for attempt in attempts:
            attempt.cancel()
        await asyncio.gather(*attempts, return_exceptions=True)
        self._connections.clear()
        connections = list(self._live)
        for connection in connections:
            connection.abort_with(PeerUnavailable(f"peer client closed; no reply from {connection.peer}"))
        if connections:
            await asyncio.wait([connection.lost for connection in connections])

    async def _connect(self, address: str) -> _ClientConnection:
        if self._closed:
            raise PeerNotConnected(f"peer client is closed; cannot reach {address}")
        attempt = self._connecting.get(address)
        if attempt is None:
            attempt = asyncio.get_running_loop().create_task(self._open(address))
            self._connecting[address] = attempt
            attempt.add_done_callback(lambda done: self._connect_done(address, done))
        try:
            # Shielded: a caller giving up must not cancel the attempt others are waiting on.
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if attempt.cancelled() and (current is None or not current.cancelling()):
                raise PeerNotConnected(f"connecting to {address} was abandoned: the client closed") from None
            raise

    def _connect_done(self, address: str, attempt: asyncio.Task[_ClientConnection]) -> None:
        if self._connecting.get(address) is attempt:
            del self._connecting[address]

    async def _open(self, address: str) -> _ClientConnection:
        host, port = _split_address(address)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _ClientConnection(loop, self, address), host, port)
        except TimeoutError:
            raise PeerNotConnected(f"cannot connect to {address}: no answer in {self._connect_timeout_s}s") from None
        except OSError as exc:
            raise PeerNotConnected(f"cannot connect to {address}: {exc}") from exc
        if connection.closed or self._closed or self._connecting.get(address) is not asyncio.current_task():
            connection.abort()
            raise PeerNotConnected(f"connection to {address} was closed as it opened (lost or forgotten)")
        self._connections[address] = connection
        logger.debug("peer connection opened peer=%s", address)
        return connection

    def _connection_made(self, connection: _ClientConnection) -> None:
        self._live.add(connection)

    def _connection_lost(self, connection: _ClientConnection) -> None:
        self._live.discard(connection)
        if self._connections.get(connection.peer) is connection:
            del self._connections[connection.peer]


class _ClientConnection(Connection):
    def __init__(self, loop: asyncio.AbstractEventLoop, client: PeerClient, address: str) -> None:
        super().__init__(loop)
        self.peer = address
        self.pending: dict[int, _Pending] = {}  #: requests awaiting their reply, by id
        self._client = client
        self._next_id = 0
        self._writable_waiters: list[asyncio.Future[None]] = []
        # One alarm at the earliest deadline rather than a loop timer (a handle, a heap push and a
        # cancel) per request: with one usual timeout it rings about once per timeout_s, and then
        # scans only the requests in flight.
        self._alarm: asyncio.TimerHandle | None = None
        self._alarm_at = math.inf

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._client._connection_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pending:
            logger.warning("peer connection lost peer=%s pending=%d: %s", self.peer, len(self.pending), exc or "closed")
        reason = f"connection to {self.peer} lost before the reply" + (f": {exc}" if exc else "")
        self.fail_pending(PeerUnavailable(reason))
        if self._alarm is not None:
            self._alarm.cancel()
        super().connection_lost(exc)
        self._client._connection_lost(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        waiters, self._writable_waiters = self._writable_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def abort_with(self, error: PeerError) -> None:
        """Fail the pending requests and drop the connection, with anything still unsent."""
        self.fail_pending(error)
        self.abort()

    def fail_pending(self, error: PeerError) -> None:
        """Fail every awaited reply (and wait for writing) with a copy of ``error``."""
        waiters: list[asyncio.Future[Any]] = [reply for reply, _, _ in self.pending.values()]
        waiters += self._writable_waiters
        self.pending = {}
        self._writable_waiters = []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(type(error)(str(error)))  # one instance each: tracebacks stay apart

    def send(self, meta: dict[str, Any], body: bytes, timeout_s: float) -> tuple[int, asyncio.Future[_Reply]]:
        """Write a request; returns its id and the future of its reply, failed after ``timeout_s``."""
        if self.closed:
            raise PeerNotConnected(f"connection to {self.peer} is closed")
        request_id = self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        self._write_frame(request_id, meta, body)
        reply: asyncio.Future[_Reply] = self._loop.create_future()
        deadline = self._loop.time() + timeout_s
        self.pending[request_id] = (reply, deadline, timeout_s)
        if deadline < self._alarm_at:
            self._arm(deadline)
        return request_id, reply

    async def wait_writable(self, timeout_s: float) -> float:
        """Wait while the transport's buffer is full; returns what is left of ``timeout_s``."""
        started_s = self._loop.time()
        waiter = self._loop.create_future()
        self._writable_waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            raise PeerTimeout(f"{self.peer} did not read our requests for {timeout_s}s") from None
        return max(0.0, timeout_s - (self._loop.time() - started_s))

    def _arm(self, when: float) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        self._alarm_at = when
        self._alarm = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:
        """Fail the requests past their deadline and re-arm for the earliest of the rest."""
        self._alarm, self._alarm_at = None, math.inf
        now = self._loop.time() + _ALARM_SLACK_S
        expired = [request_id for request_id, (_, deadline, _) in self.pending.items() if deadline <= now]
        for request_id in expired:
            reply, _, timeout_s = self.pending.pop(request_id)
            if not reply.done():
                reply.set_exception(PeerTimeout(f"no reply from {self.peer} in {timeout_s}s"))
        if self.pending:
            self._arm(min(deadline for _, deadline, _ in self.pending.values()))

    def _frame_received(self, request_id: int, meta: dict[str, Any], body: bytes) -> None:
        pending = self.pending.pop(request_id, None)
        if pending is None:  # timed out or abandoned: the late reply is dropped
            return
        reply = pending[0]
        if reply.done():
            return
        if _ERROR_KEY in meta:
            reply.set_exception(PeerError(f"{self.peer} failed to handle the request: {meta[_ERROR_KEY]}"))
        else:
            reply.set_result((meta, body))


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or int(port) > 0xFFFF:
        raise PeerNotConnected(f"bad peer address {address!r}: expected host:port")
    return host, int(port)
