"""Framing for the node-to-node channel: the wire format, and a connection base with flow control.

Wire format, network byte order, the same in both directions::

    u32 length (of all that follows) | u32 request_id | u16 meta_length | meta (JSON) | body

A frame is at most ``MAX_FRAME_BYTES``; a larger or malformed one closes its connection. ``peers``
builds the client and the server on ``Connection``. Imports ``codec`` and ``errors`` only; never aiohttp or nats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Iterable
from typing import Any, cast

from .codec import dumps, loads
from .errors import PeerError

__all__ = ["CLOSE_GRACE_S", "Connection", "FrameError", "MAX_FRAME_BYTES", "close_all"]

logger = logging.getLogger("skyring.peers")

MAX_FRAME_BYTES = 64 * 1024 * 1024  #: largest ``length`` accepted or sent

_HEADER = struct.Struct(">IIH")  # length, request_id, meta_length
_HEADER_BYTES = _HEADER.size
_MIN_LENGTH = _HEADER_BYTES - 4  # the length field does not count itself
_MAX_META_BYTES = 0xFFFF
_LARGE_BYTES = 64 * 1024  # from this size a body is written, and reassembled, without joining copies
CLOSE_GRACE_S = 1.0  # how long close() lets a connection flush before aborting it


class FrameError(Exception):
    """A received frame breaks the wire format; its connection is closed."""


class Connection(asyncio.Protocol):
    """One end of a peer connection: framing, write flow control, close. Subclasses act on frames."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.peer = "?"
        self.lost: asyncio.Future[None] = loop.create_future()  #: done once the transport is gone
        self.closed = False  #: no more frames are written or accepted
        self.write_paused = False
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        # Bytes of an incomplete frame, kept as received (no joins until the frame is complete).
        self._chunks: list[bytes] = []
        self._buffered_bytes = 0
        self._need_bytes = _HEADER_BYTES  # buffered bytes needed before parsing can progress
        self._reading_paused = False
        # Frames written while an earlier write's flush is scheduled; sent together by _flush.
        self._corked: list[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not a TCP socket (tests may use others)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._transport = None
        self._chunks = []
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False

    def close(self) -> None:
        """Close after flushing what was written; ``lost`` completes when the transport is gone."""
        self._flush()
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        self.closed = True
        self._corked = None
        if self._transport is not None:
            self._transport.abort()

    # -- reading

    def data_received(self, data: bytes) -> None:
        if self._chunks:
            self._chunks.append(data)
            self._buffered_bytes += len(data)
            if self._buffered_bytes < self._need_bytes or self._reading_paused:
                return
            data = self._take_buffered()
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        """Hand over each complete frame in ``data``; keep the incomplete rest for the next call."""
        pos, end = 0, len(data)
        unpack = _HEADER.unpack_from
        try:
            while end - pos >= _HEADER_BYTES:
                length, request_id, meta_bytes = unpack(data, pos)
                _check_header(length, meta_bytes)  # before buffering: an oversized frame is refused at once
                frame_end = pos + 4 + length
                if frame_end > end or self._reading_paused:
                    break
                meta_end = pos + _HEADER_BYTES + meta_bytes
                meta = _decode_meta(data[pos + _HEADER_BYTES : meta_end])
                body = data[meta_end:frame_end]
                pos = frame_end
                self._frame_received(request_id, meta, body)
        except FrameError as exc:
            self._reject(str(exc))
            return
        if pos < end:
            rest = data[pos:] if pos else data
            self._chunks.append(rest)
            self._buffered_bytes = len(rest)
            if len(rest) >= _HEADER_BYTES:
                self._need_bytes = 4 + _HEADER.unpack_from(rest)[0]  # checked in the loop above
            else:
                self._need_bytes = _HEADER_BYTES

    def _take_buffered(self) -> bytes:
        """The buffered bytes as one ``bytes``; a large frame is reassembled with a single copy."""
        chunks, self._chunks = self._chunks, []
        buffered_bytes, self._buffered_bytes = self._buffered_bytes, 0
        first, last = chunks[0], chunks[-1]
        # data_received parses as soon as a frame is complete, so usually only the last chunk reaches
        # past it; when it does not, or the meta is split, take the simple path.
        last_used = len(last) - (buffered_bytes - self._need_bytes)
        if self._need_bytes < _LARGE_BYTES or len(chunks) < 2 or len(first) < _HEADER_BYTES or last_used < 0:
            return b"".join(chunks)
        _, request_id, meta_bytes = _HEADER.unpack_from(first)
        body_start = _HEADER_BYTES + meta_bytes
        if len(first) < body_start:
            return b"".join(chunks)
        pieces: list[bytes | memoryview] = [memoryview(first)[body_start:], *chunks[1:-1]]
        pieces.append(memoryview(last)[:last_used])
        try:
            meta = _decode_meta(first[_HEADER_BYTES:body_start])
        except FrameError as exc:
            self._reject(str(exc))
            return b""
        self._frame_received(request_id, meta, b"".join(pieces))
        return last[last_used:]

    def _reject(self, reason: str) -> None:
        logger.warning("peer frame rejected peer=%s: %s; closing the connection", self.peer, reason)
        self._chunks = []
        self.abort()

    def _frame_received(self, request_id: int, meta: dict[str, Any], body: bytes) -> None:
        raise NotImplementedError

    # -- writing

    def _write_frame(self, request_id: int, meta: dict[str, Any], body: bytes) -> None:
        """Encode and write one frame. Raises ``PeerError`` if it is too large to send."""
        raw_meta = dumps(meta)
        meta_bytes = len(raw_meta)
        length = _MIN_LENGTH + meta_bytes + len(body)
        if meta_bytes > _MAX_META_BYTES or length > MAX_FRAME_BYTES:
            raise PeerError(
                f"frame too large for {self.peer}: meta {meta_bytes} bytes (max {_MAX_META_BYTES}), "
                f"frame {length} bytes (max {MAX_FRAME_BYTES})"
            )
        head = _HEADER.pack(length, request_id, meta_bytes)
        corked = self._corked
        if len(body) >= _LARGE_BYTES:  # never copied into a batch
            self._flush()
            self._send(head + raw_meta)
            self._send(body)
        elif corked is not None:
            corked.append(head + raw_meta + body)
        else:
            # Send at once, then batch what else is written before the loop's next turn: a lone
            # request costs one send, a burst (many callers, many replies) two, not one per frame.
            # Halves CPU per request at 64 concurrent requests.
            self._send(head + raw_meta + body)
            self._corked = []
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        corked, self._corked = self._corked, None
        if corked:
            self._send(b"".join(corked) if len(corked) > 1 else corked[0])

    def _send(self, data: bytes) -> None:
        if self._transport is not None and not self.closed:
            self._transport.write(data)


def _check_header(length: int, meta_bytes: int) -> None:
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    if length < _MIN_LENGTH + meta_bytes:
        raise FrameError(f"frame length {length} cannot hold a {meta_bytes}-byte meta")


def _decode_meta(raw: bytes) -> dict[str, Any]:
    try:
        meta = loads(raw)
    except ValueError:
        raise FrameError("meta is not valid JSON") from None
    if type(meta) is not dict:
        raise FrameError("meta is not a JSON object")
    return meta


async def close_all(connections: Iterable[Connection]) -> None:
    """Close connections, giving each ``CLOSE_GRACE_S`` to flush, and wait until they are gone."""
    connections = list(connections)
    if not connections:
        return
    for connection in connections:
        connection.close()
    _, stuck = await asyncio.wait([c.lost for c in connections], timeout=CLOSE_GRACE_S)
    if stuck:
        for connection in connections:
            if not connection.lost.done():
                connection.abort()
        await asyncio.wait(stuck)
