"""The peer channel over real sockets: round trips, pipelining, errors, timeouts, reconnects, bad frames."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from skyring.codec import dumps, loads
from skyring.errors import PeerError, PeerNotConnected, PeerTimeout, PeerUnavailable
from skyring.peers import MAX_FRAME_BYTES, PeerClient, PeerServer
from tests.support import MS, eventually

HEADER = struct.Struct(">IIH")


class Handler:
    """Echoes each request as ``({"echo": meta}, body)``; ``meta["do"]`` asks it to fail, sleep, block or
    return an unencodable reply."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def __call__(self, meta: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        self.started += 1
        action = meta.get("do")
        if action == "fail":
            raise RuntimeError("handler exploded")
        if action == "sleep":
            await asyncio.sleep(meta["s"])
        if action == "block":
            await self.release.wait()
        if action == "bad_reply":
            return {"not_json": {1, 2}}, b""
        return {"echo": meta}, body


StartServer = Callable[..., Awaitable[PeerServer]]


@pytest.fixture
def handler() -> Handler:
    return Handler()


@pytest.fixture
async def start_server(handler: Handler) -> AsyncIterator[StartServer]:
    """``await start_server(port=0)``: a peer server on 127.0.0.1 running ``handler``; closed after the test."""
    started: list[PeerServer] = []

    async def start(port: int = 0) -> PeerServer:
        server = await PeerServer.start("127.0.0.1", port, handler)
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()


@pytest.fixture
async def server(start_server: StartServer) -> PeerServer:
    return await start_server()


@pytest.fixture
async def client() -> AsyncIterator[PeerClient]:
    peer_client = PeerClient(timeout_s=2000 * MS, connect_timeout_s=1000 * MS)
    yield peer_client
    await peer_client.close()


def address_of(server: PeerServer) -> str:
    return f"127.0.0.1:{server.port}"


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
    return port


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A port whose listen backlog is full, so a new connection's handshake is never answered."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port: int = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        try:
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
            time.sleep(50 * MS)  # let the kernel queue the fillers' handshakes
            yield port
        finally:
            for filler in fillers:
                filler.close()


def frame(request_id: int, meta: bytes, body: bytes = b"", *, length: int | None = None) -> bytes:
    if length is None:
        length = 6 + len(meta) + len(body)
    return HEADER.pack(length, request_id, len(meta)) + meta + body


async def test_round_trip_carries_meta_and_body(server, client):
    """A request's meta and body reach the handler intact, and its reply comes back intact."""
    meta = {"op": "create", "id": "tïmer/1", "nested": {"n": [1, 2.5, None, True]}}

    reply_meta, reply_body = await client.request(address_of(server), meta, b"\x00\xffpayload\n")

    assert reply_meta == {"echo": meta}
    assert reply_body == b"\x00\xffpayload\n"


async def test_wire_format_is_length_id_meta_length_meta_body(server):
    """A hand-built frame is answered with a frame of the documented layout carrying the same request id."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(frame(0xDEADBEEF, b'{"k":"v"}', b"body"))

        length, request_id, meta_length = HEADER.unpack(await reader.readexactly(HEADER.size))
        rest = await reader.readexactly(length - 6)
    finally:
        writer.close()
        await writer.wait_closed()

    assert request_id == 0xDEADBEEF
    assert loads(rest[:meta_length]) == {"echo": {"k": "v"}}
    assert rest[meta_length:] == b"body"


async def test_concurrent_requests_are_pipelined_on_one_connection(server, client):
    """2,000 concurrent requests, the first ones racing to connect, share one connection and all get their own reply."""
    address = address_of(server)

    replies = await asyncio.gather(*(client.request(address, {"n": n}, str(n).encode()) for n in range(2000)))

    assert replies == [({"echo": {"n": n}}, str(n).encode()) for n in range(2000)]
    assert client.connection_count == 1
    assert server.connection_count == 1
    assert client.pending_count == 0


async def test_large_body_round_trip(server, client):
    """A 5 MB body goes there and back intact, alongside small requests on the same connection."""
    body = bytes(range(256)) * (5 * 1024 * 1024 // 256) + b"tail"
    address = address_of(server)

    big, *small = await asyncio.gather(
        client.request(address, {"big": True}, body), *(client.request(address, {"n": n}) for n in range(20))
    )

    assert big == ({"echo": {"big": True}}, body)
    assert small == [({"echo": {"n": n}}, b"") for n in range(20)]


async def test_handler_exception_is_a_peer_error_and_the_connection_stays_usable(server, client, caplog):
    """A handler that raises is logged with its traceback and answered as PeerError; later requests work."""
    address = address_of(server)

    with pytest.raises(PeerError) as raised:
        await client.request(address, {"do": "fail"})
    reply = await client.request(address, {"after": 1})

    assert type(raised.value) is PeerError
    assert "RuntimeError: handler exploded" in str(raised.value)
    assert reply == ({"echo": {"after": 1}}, b"")
    assert server.connection_count == 1
    [record] = [r for r in caplog.records if r.name == "skyring.peers" and r.levelno == logging.ERROR]
    assert record.exc_info is not None


async def test_reply_that_cannot_be_encoded_is_a_peer_error(server, client, caplog):
    """A handler reply that is not JSON-encodable is logged and answered as PeerError, not left hanging."""
    with pytest.raises(PeerError, match="TypeError"):
        await client.request(address_of(server), {"do": "bad_reply"})

    assert any("reply cannot be sent" in r.getMessage() for r in caplog.records)


async def test_closed_port_is_unavailable_quickly(client):
    """Connecting to a port nobody listens on raises PeerUnavailable at once, not after a timeout."""
    started_s = time.monotonic()

    with pytest.raises(PeerUnavailable, match="cannot connect"):
        await client.request(f"127.0.0.1:{free_port()}", {})

    assert time.monotonic() - started_s < 500 * MS
    assert client.connection_count == 0


async def test_connect_timeout_is_unavailable():
    """A peer that never completes the handshake (its listen backlog is full) raises PeerUnavailable."""
    quick = PeerClient(timeout_s=1000 * MS, connect_timeout_s=100 * MS)
    try:
        with unanswered_port() as port, pytest.raises(PeerUnavailable, match="no answer in"):
            await quick.request(f"127.0.0.1:{port}", {})
    finally:
        await quick.close()


async def test_client_closing_while_connecting_fails_the_waiting_requests():
    """Requests waiting for a connection attempt fail with PeerUnavailable when the client closes."""
    slow = PeerClient(timeout_s=1000 * MS, connect_timeout_s=5000 * MS)
    with unanswered_port() as port:
        waiting = [asyncio.create_task(slow.request(f"127.0.0.1:{port}", {})) for _ in range(2)]
        await asyncio.sleep(50 * MS)

        await slow.close()
        results = await asyncio.gather(*waiting, return_exceptions=True)

    assert all(isinstance(result, PeerUnavailable) for result in results) and len(results) == 2, results
    assert "client closed" in str(results[0])


async def test_server_closing_fails_in_flight_requests_then_client_reconnects(start_server, handler, client):
    """1. Requests are in flight when the server closes: each fails with PeerUnavailable.
    2. A new server starts on the same port: the next request reconnects and succeeds.
    """
    first = await start_server()
    address = address_of(first)
    in_flight = [asyncio.create_task(client.request(address, {"do": "block"})) for _ in range(3)]
    await eventually(lambda: handler.started == 3, 1000 * MS)

    await first.close()
    results = await asyncio.gather(*in_flight, return_exceptions=True)

    assert all(type(result) is PeerUnavailable for result in results), results
    await eventually(lambda: client.connection_count == 0, 1000 * MS)

    second = await start_server(first.port)
    reply = await client.request(address, {"again": True})

    assert reply == ({"echo": {"again": True}}, b"")
    assert second.connection_count == 1


async def test_slow_handler_times_out_and_its_late_reply_is_dropped(server, handler, client):
    """A reply later than timeout_s raises PeerTimeout; when it does arrive it is dropped and later requests work."""
    address = address_of(server)
    await client.request(address, {"warm": True})

    with pytest.raises(PeerTimeout, match="no reply"):
        await client.request(address, {"do": "sleep", "s": 200 * MS}, timeout_s=50 * MS)
    assert client.pending_count == 0
    await eventually(lambda: server.handling_count == 0, 1000 * MS)  # the late reply has been sent
    await asyncio.sleep(20 * MS)
    reply = await client.request(address, {"next": 1})

    assert reply == ({"echo": {"next": 1}}, b"")
    assert client.connection_count == 1


async def test_requests_with_different_timeouts_expire_on_their_own_deadlines(server, client):
    """A short timeout sent after a long one fires first; the long one still fires, at its own deadline."""
    address = address_of(server)
    started_s = time.monotonic()
    long = asyncio.create_task(client.request(address, {"do": "block"}, timeout_s=300 * MS))
    short = asyncio.create_task(client.request(address, {"do": "block"}, timeout_s=50 * MS))

    with pytest.raises(PeerTimeout):
        await short
    short_s = time.monotonic() - started_s
    with pytest.raises(PeerTimeout):
        await long
    long_s = time.monotonic() - started_s

    assert 50 * MS <= short_s < 250 * MS
    assert long_s >= 300 * MS


@pytest.mark.parametrize(
    ("bad_frame", "reason"),
    [
        (HEADER.pack(MAX_FRAME_BYTES + 1, 1, 2) + b"{}", "exceeds"),
        (frame(1, b"{}", length=5), "cannot hold"),
        (frame(1, b"{not json"), "not valid JSON"),
        (frame(1, b"[1,2]"), "not a JSON object"),
    ],
    ids=["oversized", "length-below-meta", "bad-json", "meta-not-object"],
)
async def test_malformed_frame_closes_only_its_connection(server, client, caplog, bad_frame, reason):
    """A bad frame on a raw socket gets that connection closed with a warning; other connections keep working."""
    address = address_of(server)
    await client.request(address, {"before": 1})
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)

    try:
        writer.write(frame(7, b'{"ok":1}'))
        good = await reader.readexactly(len(frame(7, b'{"echo":{"ok":1}}')))
        writer.write(bad_frame + frame(8, b"{}"))
        after_bad = await asyncio.wait_for(reader.read(), 1000 * MS)  # until the server closes
    finally:
        writer.close()
        await writer.wait_closed()
    reply = await client.request(address, {"after": 1})

    assert HEADER.unpack_from(good)[1] == 7
    assert after_bad == b""  # nothing after the bad frame is answered
    assert reply == ({"echo": {"after": 1}}, b"")
    assert any(r.levelno == logging.WARNING and reason in r.getMessage() for r in caplog.records)
    await eventually(lambda: server.connection_count == 1, 1000 * MS)


async def test_frame_split_into_single_bytes_is_reassembled(server):
    """A frame that arrives one byte at a time is still parsed and answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        for byte in frame(3, b'{"slow":true}', b"x" * 100):
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)

        length, request_id, meta_length = HEADER.unpack(await reader.readexactly(HEADER.size))
        rest = await reader.readexactly(length - 6)
    finally:
        writer.close()
        await writer.wait_closed()

    assert request_id == 3
    assert rest == dumps({"echo": {"slow": True}}) + b"x" * 100


async def test_large_frame_with_a_split_meta_is_reassembled(server):
    """A large frame whose first read ends inside its meta is still parsed and answered."""
    whole = frame(4, b'{"split":"meta"}', b"y" * 200_000)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        for piece in (whole[:12], whole[12:100], whole[100:]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(10 * MS)

        length, request_id, meta_length = HEADER.unpack(await reader.readexactly(HEADER.size))
        rest = await reader.readexactly(length - 6)
    finally:
        writer.close()
        await writer.wait_closed()

    assert request_id == 4
    assert loads(rest[:meta_length]) == {"echo": {"split": "meta"}}
    assert rest[meta_length:] == b"y" * 200_000


async def test_request_too_large_to_encode_is_refused_locally(server, client):
    """A meta over 64 KiB raises PeerError before anything is sent; the connection stays usable."""
    address = address_of(server)

    with pytest.raises(PeerError, match="too large"):
        await client.request(address, {"pad": "x" * 70_000})
    reply = await client.request(address, {"small": 1})

    assert reply == ({"echo": {"small": 1}}, b"")


async def test_busy_connection_stops_reading_at_1024_handlers(server, handler, client):
    """With handlers blocked, a connection runs at most 1024 of them; the rest wait unread until they finish."""
    address = address_of(server)
    requests = [asyncio.create_task(client.request(address, {"do": "block", "n": n})) for n in range(1500)]

    await eventually(lambda: handler.started == 1024, 2000 * MS)
    await asyncio.sleep(50 * MS)
    assert server.handling_count == 1024
    handler.release.set()
    replies = await asyncio.gather(*requests)

    assert [meta["echo"]["n"] for meta, _ in replies] == list(range(1500))
    assert handler.started == 1500


async def test_peer_that_does_not_read_makes_requests_wait_then_time_out(client):
    """When the peer stops reading, a request waits for the buffer to drain and raises PeerTimeout."""
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the handshake completes; nobody ever reads
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        first = asyncio.create_task(client.request(address, {}, b"x" * 16_000_000, timeout_s=300 * MS))
        await eventually(lambda: client.pending_count == 1, 1000 * MS)

        with pytest.raises(PeerTimeout, match="did not read"):
            await client.request(address, {}, timeout_s=50 * MS)
        with pytest.raises(PeerTimeout, match="no reply"):
            await first
        await client.close()


async def test_cancelled_request_leaves_the_connection_usable(server, handler, client):
    """A caller cancelling its request frees its slot; the late reply is dropped and later requests work."""
    address = address_of(server)
    waiting = asyncio.create_task(client.request(address, {"do": "block"}))
    await eventually(lambda: handler.started == 1, 1000 * MS)

    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert client.pending_count == 0
    handler.release.set()
    await eventually(lambda: server.handling_count == 0, 1000 * MS)

    assert await client.request(address, {"next": 1}) == ({"echo": {"next": 1}}, b"")
    assert client.connection_count == 1


async def test_forget_fails_pending_requests_and_next_request_reconnects(server, handler, client):
    """forget() closes the peer's connection: pending requests fail, and the next request opens a new one."""
    address = address_of(server)
    pending = asyncio.create_task(client.request(address, {"do": "block"}))
    await eventually(lambda: handler.started == 1, 1000 * MS)

    client.forget(address)

    with pytest.raises(PeerUnavailable, match="forgotten"):
        await pending
    handler.release.set()
    assert await client.request(address, {"back": 1}) == ({"echo": {"back": 1}}, b"")
    await eventually(lambda: server.connection_count == 1, 1000 * MS)


async def test_client_close_fails_pending_requests(server, handler, client):
    """Closing the client fails requests waiting for a reply with PeerUnavailable, and later ones too."""
    address = address_of(server)
    pending = asyncio.create_task(client.request(address, {"do": "block"}))
    await eventually(lambda: handler.started == 1, 1000 * MS)

    await client.close()

    with pytest.raises(PeerUnavailable, match="closed"):
        await pending
    with pytest.raises(PeerUnavailable, match="closed"):
        await client.request(address, {})
    assert client.connection_count == 0
    await eventually(lambda: server.connection_count == 0, 1000 * MS)


async def test_server_close_does_not_wait_forever_for_a_peer_that_does_not_read(server, handler, monkeypatch):
    """Closing the server aborts a connection whose unread replies cannot be flushed within the grace period."""
    monkeypatch.setattr("skyring.frames.CLOSE_GRACE_S", 100 * MS)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(frame(1, b"{}", b"z" * 16_000_000))  # its echo fills every buffer on the way back
        await writer.drain()
        await eventually(lambda: handler.started == 1 and server.handling_count == 0, 2000 * MS)
        started_s = time.monotonic()

        await server.close()

        assert time.monotonic() - started_s < 1000 * MS
        assert server.connection_count == 0
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_close_is_idempotent(server, client):
    """Closing a server or a client twice is harmless; repr shows the closed state and counts."""
    await client.request(address_of(server), {})

    await server.close()
    await server.close()
    await client.close()
    await client.close()

    assert repr(server) == f"<PeerServer port={server.port} connections=0 handling=0 closed>"
    assert repr(client) == "<PeerClient connections=0 pending=0 connecting=0 closed>"


async def test_ipv6_address_in_brackets(handler, client):
    """An IPv6 peer is addressed as [::1]:port."""
    try:
        server = await PeerServer.start("::1", 0, handler)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        reply = await client.request(f"[::1]:{server.port}", {"v": 6})
    finally:
        await server.close()

    assert reply == ({"echo": {"v": 6}}, b"")


@pytest.mark.parametrize("address", ["no-port", "host:", "host:99999", ":80"])
async def test_bad_address_is_unavailable(client, address):
    """An address that is not host:port raises PeerUnavailable naming it."""
    with pytest.raises(PeerUnavailable, match="bad peer address"):
        await client.request(address, {})


async def test_a_refused_connection_says_the_request_was_never_sent():
    """Connect failures are PeerNotConnected, so callers know the peer never saw the request."""
    client = PeerClient(timeout_s=1, connect_timeout_s=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    with pytest.raises(PeerNotConnected):
        await client.request(f"127.0.0.1:{port}", {"op": "x"})
    await client.close()
