"""Where a timer operation is answered: here, or at the timer's owner, one hop away.

The rules, in order:

1. A node that holds the timer answers for it, whatever its ring says: the ring says where a timer
   should be, the store where it is. A timer on its way to another node is waited for, then routed.
2. Otherwise the owner by this node's ring answers; the request is forwarded over the peer channel
   with a hop count. Past ``MAX_HOPS`` a node answers from what it holds (views differ only briefly).
3. An owner asked about an id it does not hold checks, for ``handover_window_s`` after its ring
   changed, with that id's previous owner (a ``local`` request: "answer only if you hold it", else
   421): the timer may still be on its way. So a cancel or replace that reaches the new owner before
   the timer itself still wins, and a create cannot make a second timer under a moving id.

An unreachable owner is retried, on the ring as it is by then, for ``forward_retry_s``; then the
answer is 503. Imports core modules, the node and the peer client; never aiohttp.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .codec import TimerRequest, decode_timers, encode_error, parse_timer_request
from .errors import PeerError, PeerNotConnected, PeerTimeout, PeerUnavailable, SkyringError, TimerExists
from .node import Node
from .peers import PeerClient
from .ring import Ring

__all__ = ["MAX_HOPS", "OPS", "RandomUuids", "Reply", "Router", "error_reply", "location"]

MAX_HOPS = 3
OPS = frozenset({"create", "replace", "cancel", "get"})
REASON_HEADER = "x-skyring-reason"
_JSON = {"Content-Type": "application/json"}
_RETRY_PAUSE_S = 0.1
_LOCAL_ID_TRIES = 64


class Reply(NamedTuple):
    """An answer to a timer operation, the same whichever node produced it."""

    status: int
    headers: dict[str, str]
    body: bytes = b""


def location(timer_id: str) -> dict[str, str]:
    return {"Location": f"/timer/{timer_id}"}


def error_reply(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Reply:
    """A JSON error with the original Skyring's reason header (ASCII-safe, one line)."""
    reason = message.encode("ascii", "backslashreplace").decode("ascii")[:512]
    all_headers = {REASON_HEADER: reason.replace("\r", " ").replace("\n", " "), **_JSON}
    if headers:
        all_headers.update(headers)
    return Reply(status, all_headers, encode_error(code, message))


def reply_for(exc: SkyringError) -> Reply:
    headers = location(exc.timer_id) if isinstance(exc, TimerExists) else None
    return error_reply(exc.status, exc.code, str(exc), headers)


_MISDIRECTED = error_reply(421, "not_here", "this node does not hold that timer")


class RandomUuids:
    """Random (version 4) UUID strings, like ``str(uuid.uuid4())`` at a third of the cost.

    One ``os.urandom`` call serves 256 ids (``uuid4`` makes a syscall and a ``UUID`` object per id).
    """

    _BATCH = 256
    _VARIANT = {f"{n:x}": "89ab"[n & 3] for n in range(16)}  # RFC 4122 variant bits: 10xx

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def __call__(self) -> str:
        if self._at >= len(self._pool):
            self._pool, self._at = os.urandom(16 * self._BATCH), 0
        h = self._pool[self._at : self._at + 16].hex()
        self._at += 16
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{self._VARIANT[h[16]]}{h[17:20]}-{h[20:]}"


class Router:
    """Answers timer operations for this node, locally or through the owner.

    Args:
        node: this node's timers.
        node_id: this node's id on the ring.
        peers: the channel to other nodes; None for a node on its own.
        forward_retry_s: how long an unreachable owner is retried.
        handover_window_s: how long after a ring change an owner asks the previous owner about
            ids it does not hold.
        on_misplaced: called when timers landed here that this node does not own (moves them on).
    """

    def __init__(
        self,
        node: Node,
        *,
        node_id: str,
        peers: PeerClient | None = None,
        forward_retry_s: float = 3.0,
        handover_window_s: float = 30.0,
        on_misplaced: Callable[[], None] | None = None,
    ) -> None:
        self._node = node
        self._me = node_id
        self._peers = peers
        self._forward_retry_s = forward_retry_s
        self._handover_window_s = handover_window_s
        self.on_misplaced = on_misplaced
        self.ring = Ring([node_id])
        self._previous: Ring | None = None
        self._changed_at_s = -float("inf")
        self._addresses: dict[str, str] = {}
        self._new_uuid = RandomUuids()

    def __repr__(self) -> str:
        return f"<Router {self._me} ring={self.ring.checksum} members={len(self.ring.members)}>"

    @property
    def node_id(self) -> str:
        return self._me

    def update(self, ring: Ring, addresses: dict[str, str]) -> bool:
        """Take a new view of the cluster; returns whether the ring changed.

        Addresses of members that just left are kept for the hand-over window: they may still hold
        timers until their hand-off ends.
        """
        if ring == self.ring:
            self._addresses.update(addresses)
            return False
        if self.ring.members == {self._me} and ring.members != {self._me}:
            # Joining: the timers this node now owns are still with the members it joined.
            self._previous = Ring(ring.members - {self._me})
        else:
            self._previous = self.ring
        self.ring = ring
        self._changed_at_s = time.monotonic()
        self._addresses.update(addresses)
        return True

    def address(self, node_id: str) -> str | None:
        return self._addresses.get(node_id)

    def owns(self, timer_id: str) -> bool:
        return self.ring.owner(timer_id) == self._me

    def new_id(self, *, local: bool = False) -> str:
        """A fresh timer id; with ``local``, one this node owns, so creating it needs no hop."""
        timer_id = self._new_uuid()
        if local:
            for _ in range(_LOCAL_ID_TRIES):  # each try succeeds with probability 1/members
                if self.owns(timer_id):
                    break
                timer_id = self._new_uuid()
        return timer_id

    # -- answering operations -------------------------------------------------------------------

    async def handle(
        self, op: str, timer_id: str, body: bytes = b"", *, hops: int = 0, local: bool = False, generated: bool = False
    ) -> Reply:
        """Answer ``op`` on ``timer_id`` (``body`` is the raw request body for create and replace).

        Args:
            hops: forwards so far.
            local: answer only if this node holds the timer, else 421 (a previous owner being asked).
            generated: the entry node made the id up, so no other node can hold it yet.
        """
        node = self._node
        if node.holds(timer_id):
            await node.wait_moved(timer_id)
            if node.holds(timer_id):
                return await self._local(op, timer_id, body)
        if local:
            return _MISDIRECTED
        owner = self.ring.owner(timer_id)
        if owner != self._me and hops < MAX_HOPS and self._peers is not None:
            return await self._forward(owner, op, timer_id, body, hops + 1, generated)
        previous = None if generated else self._previous_owner(timer_id)
        if previous is not None:
            reply = await self._ask(previous, {"op": op, "id": timer_id, "hops": hops + 1, "local": True}, body)
            if reply is not None and reply.status != 421:
                return reply
        return await self._local(op, timer_id, body)

    async def _local(self, op: str, timer_id: str, body: bytes) -> Reply:
        node = self._node
        try:
            if op == "get":
                return Reply(200, _JSON, node.view(timer_id))
            if op == "cancel":
                await node.cancel(timer_id)
                return Reply(202, location(timer_id))
            request = self._parse(body)
            if op == "create":
                await node.create(request, timer_id)
                return Reply(201, location(timer_id))
            await node.replace(timer_id, request)
            return Reply(200, location(timer_id))
        except SkyringError as exc:
            return reply_for(exc)

    def _parse(self, body: bytes) -> TimerRequest:
        return parse_timer_request(
            body, max_timeout_ms=self._node.settings.max_timeout_ms, normalize_callback=self._node.transports.normalize
        )

    def _previous_owner(self, timer_id: str) -> str | None:
        if self._previous is None or time.monotonic() - self._changed_at_s > self._handover_window_s:
            return None
        previous = self._previous.owner(timer_id)
        return previous if previous != self._me else None

    async def _ask(self, node_id: str, meta: dict[str, Any], body: bytes) -> Reply | None:
        """One request to ``node_id``; None if it cannot be reached."""
        address = self._addresses.get(node_id)
        if address is None or self._peers is None:
            return None
        try:
            answer, answer_body = await self._peers.request(address, meta, body)
        except PeerError:
            return None
        return Reply(answer["s"], answer["h"], answer_body)

    async def _forward(self, owner: str, op: str, timer_id: str, body: bytes, hops: int, generated: bool) -> Reply:
        assert self._peers is not None
        meta = {"op": op, "id": timer_id, "hops": hops, "gen": generated}
        deadline_s = time.monotonic() + self._forward_retry_s
        retried = False
        while True:
            address = self._addresses.get(owner)
            try:
                if address is None:
                    raise PeerUnavailable(f"no address known for node {owner}")
                answer, answer_body = await self._peers.request(address, meta, body)
                reply = Reply(answer["s"], answer["h"], answer_body)
                if retried and generated and op == "create" and reply.status == 409:
                    # Our own first attempt got through before the connection dropped.
                    return Reply(201, location(timer_id))
                return reply
            except PeerTimeout as exc:  # the owner may have applied it: do not try again
                return reply_for(PeerTimeout(f"owner {owner} did not answer in time: {exc}"))
            except PeerUnavailable as exc:
                if generated and op == "create" and not retried and isinstance(exc, PeerNotConnected):
                    # The owner never saw this made-up id: give the timer one this node owns instead.
                    return await self._local(op, self.new_id(local=True), body)
                if time.monotonic() >= deadline_s:
                    return reply_for(PeerUnavailable(f"owner {owner} is unreachable: {exc}"))
            except PeerError as exc:
                return reply_for(PeerError(f"owner {owner} failed: {exc}"))
            await asyncio.sleep(_RETRY_PAUSE_S)
            retried = True
            owner = self.ring.owner(timer_id)
            if owner == self._me:
                return await self.handle(op, timer_id, body, hops=hops, generated=generated)

    # -- the peer channel's server side ---------------------------------------------------------

    async def serve_peer(self, meta: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        """Answer a request from another node (a forwarded operation or a batch of timers to adopt)."""
        op = meta.get("op")
        if op in OPS:
            reply = await self.handle(
                op,
                str(meta["id"]),
                body,
                hops=int(meta.get("hops", 1)),
                local=bool(meta.get("local", False)),
                generated=bool(meta.get("gen", False)),
            )
            return {"s": reply.status, "h": reply.headers}, reply.body
        if op == "adopt":
            timers = decode_timers(body)
            try:
                adopted = await self._node.adopt(timers)
            except SkyringError as exc:  # e.g. this node is leaving: the sender keeps the timers
                return {"error": exc.code, "message": str(exc)}, b""
            if self.on_misplaced is not None and any(not self.owns(t.id) for t in timers):
                self.on_misplaced()
            return {"adopted": adopted}, b""
        raise ValueError(f"unknown peer operation {op!r}")
