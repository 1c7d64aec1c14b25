"""Moves timers to the nodes that own them, keeping their deadlines.

Used when the ring changes (every node sends on the timers it no longer owns) and for hand-off
batches received over NATS. A timer is released by its old holder only after the new owner has
stored it; a batch that cannot be placed stays (or goes back) where it was and is tried again.
Imports core modules, the node, the router and the peer client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from .codec import encode_timer_batches
from .errors import PeerError, SkyringError
from .node import Node
from .peers import MAX_FRAME_BYTES, PeerClient
from .router import Router
from .timers import Timer

__all__ = ["Mover"]

logger = logging.getLogger(__name__)

_SCAN_CHUNK = 2000  # ids checked against the ring per loop iteration, so a big store never stalls the loop
_RETRY_S = 1.0
_MAX_BATCH_BYTES = MAX_FRAME_BYTES // 2  # room for the frame's own header and meta


class Mover:
    """Places timers at their owners and keeps this node's timers where the ring says.

    Args:
        batch_size: timers per adopt request.
        concurrency: adopt requests in flight at once.
    """

    def __init__(
        self, node: Node, router: Router, peers: PeerClient, *, batch_size: int = 500, concurrency: int = 4
    ) -> None:
        self._node = node
        self._router = router
        self._peers = peers
        self._batch_size = batch_size
        self._slots = asyncio.Semaphore(concurrency)
        self._wanted = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def __repr__(self) -> str:
        return f"<Mover running={self._task is not None} idle={self._idle.is_set()}>"

    def trigger(self) -> None:
        """Check (soon, in the background) for timers held here that another node owns."""
        if self._closing:
            return
        self._wanted.set()
        self._idle.clear()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="skyring-rebalance")

    async def settled(self, timeout_s: float) -> bool:
        """Wait until no rebalance is wanted or running; False if that took longer than ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def place(self, timers: list[Timer]) -> tuple[list[Timer], list[Timer]]:
        """Store each timer at its owner by the current ring. Returns ``(placed, failed)``."""
        by_owner: defaultdict[str, list[Timer]] = defaultdict(list)
        ring = self._router.ring
        for timer in timers:
            by_owner[ring.owner(timer.id)].append(timer)
        batches = [
            (owner, batch, encoded)
            for owner, group in by_owner.items()
            for batch, encoded in encode_timer_batches(group, max_bytes=_MAX_BATCH_BYTES, max_count=self._batch_size)
        ]
        outcomes = await asyncio.gather(*(self._place_batch(*batch) for batch in batches))
        placed = [t for ok, (_, batch, _) in zip(outcomes, batches, strict=True) if ok for t in batch]
        failed = [t for ok, (_, batch, _) in zip(outcomes, batches, strict=True) if not ok for t in batch]
        return placed, failed

    async def _place_batch(self, owner: str, batch: list[Timer], encoded: bytes) -> bool:
        async with self._slots:
            try:
                if owner == self._router.node_id:
                    await self._node.adopt(batch)
                    return True
                address = self._router.address(owner)
                if address is None:
                    return False
                answer, _ = await self._peers.request(address, {"op": "adopt"}, encoded)
                if "adopted" not in answer:
                    raise PeerError(f"{answer.get('error')}: {answer.get('message')}")
                return True
            except (PeerError, SkyringError) as exc:
                logger.warning("cannot place timers owner=%s count=%d error=%s", owner, len(batch), exc)
                return False

    async def _run(self) -> None:
        while not self._closing:
            await self._wanted.wait()
            self._wanted.clear()
            if self._closing:
                break
            try:
                failed = await self._rebalance()
            except Exception:
                logger.exception("rebalance crashed")
                failed = 1
            if failed and not self._closing:
                await asyncio.sleep(_RETRY_S)
                self._wanted.set()
            elif not self._wanted.is_set():
                self._idle.set()
        self._idle.set()

    async def _rebalance(self) -> int:
        """Send every timer held here that another node owns to its owner; returns how many failed."""
        started_s = time.monotonic()
        moved = failed = 0
        ids = self._node.pending_ids()
        for start in range(0, len(ids), _SCAN_CHUNK):
            if self._closing:  # stop between chunks: nothing is left half-moved
                break
            ring, me = self._router.ring, self._router.node_id
            misplaced = [i for i in ids[start : start + _SCAN_CHUNK] if ring.owner(i) != me]
            if misplaced:
                taken = self._node.take(misplaced)
                placed: list[Timer] = []
                try:
                    placed, unplaced = await self.place(taken)
                    await self._node.release(placed, moved=True)
                finally:
                    # Whatever cut this short, nothing stays half-moved: what was not placed comes
                    # back here (an owner that stored some before a cut-off fires them too: at least
                    # once beats never).
                    placed_ids = {t.id for t in placed}
                    kept = [t for t in taken if t.id not in placed_ids]
                    await self._node.release(kept, moved=False)
                moved += len(placed)
                failed += len(kept)
            await asyncio.sleep(0)
        if moved or failed:
            logger.info(
                "rebalance moved=%d failed=%d ms=%d ring=%s",
                moved,
                failed,
                (time.monotonic() - started_s) * 1000,
                self._router.ring.checksum,
            )
        return failed

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop rebalancing: let the chunk under way finish (within ``timeout_s``), start nothing new.

        Safe to call twice; ``trigger`` does nothing afterwards.
        """
        self._closing = True
        self._wanted.set()  # wake the loop so it sees the flag
        if self._task is not None:
            done, _ = await asyncio.wait([self._task], timeout=timeout_s)
            if not done:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._idle.set()
