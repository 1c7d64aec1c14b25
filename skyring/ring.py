"""Which node owns a timer id: a consistent hash ring over the members' node ids.

The only module that imports uhashring. Every node builds its ring with the same settings from the
same member ids, so all nodes agree on the owner of every id. No I/O; imports nothing from skyring.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from uhashring import HashRing

__all__ = ["VNODES", "Ring"]

#: Points per node on the ring (uhashring's default; 3-5 nodes balance within ~1.1-1.4x).
VNODES = 160


class Ring:
    """An immutable ring: build a new one when the members change."""

    __slots__ = ("_hash_ring", "_members", "_only", "checksum")

    def __init__(self, node_ids: Iterable[str]) -> None:
        self._members = frozenset(node_ids)
        if not self._members:
            raise ValueError("a ring needs at least one member")
        self._only = next(iter(self._members)) if len(self._members) == 1 else None
        self._hash_ring = HashRing(nodes=sorted(self._members), vnodes=VNODES) if self._only is None else None
        #: Short digest of the members: two nodes with equal checksums compute the same owners.
        self.checksum = hashlib.sha1("\n".join(sorted(self._members)).encode()).hexdigest()[:12]

    def __repr__(self) -> str:
        return f"<Ring {self.checksum} members={sorted(self._members)}>"

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._members

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ring) and other._members == self._members

    def __hash__(self) -> int:
        return hash(self._members)

    @property
    def members(self) -> frozenset[str]:
        return self._members

    def owner(self, timer_id: str) -> str:
        """The node id that owns ``timer_id``."""
        if self._only is not None:
            return self._only
        assert self._hash_ring is not None
        node: str = self._hash_ring.get_node(timer_id)
        return node
