"""The ring: agreement between nodes, balance, and minimal movement on a join."""

from __future__ import annotations

import uuid

import pytest

from skyring.ring import Ring

IDS = [str(uuid.UUID(int=i * 7919 + 13, version=4)) for i in range(30_000)]


def test_rings_with_the_same_members_agree_on_every_owner():
    """Order of members does not matter: equal member sets give equal owners and checksums."""
    a = Ring(["n1", "n2", "n3"])
    b = Ring(["n3", "n1", "n2"])

    assert a.checksum == b.checksum
    assert all(a.owner(i) == b.owner(i) for i in IDS)


def test_different_members_have_different_checksums():
    """A ring with other members is visibly different."""
    assert Ring(["n1", "n2"]).checksum != Ring(["n1", "n2", "n3"]).checksum


def test_ids_spread_across_members():
    """Each of three members owns a fair share of random ids (within 1.5x of each other)."""
    ring = Ring(["node-a", "node-b", "node-c"])
    counts = {m: 0 for m in ring.members}
    for i in IDS:
        counts[ring.owner(i)] += 1

    assert max(counts.values()) / min(counts.values()) < 1.5


def test_a_join_moves_ids_only_to_the_new_member():
    """Adding a node moves about a quarter of the ids, all of them to the new node."""
    before = Ring(["node-a", "node-b", "node-c"])
    after = Ring(["node-a", "node-b", "node-c", "node-d"])

    moved = [i for i in IDS if before.owner(i) != after.owner(i)]

    assert all(after.owner(i) == "node-d" for i in moved)
    assert 0.15 < len(moved) / len(IDS) < 0.35


def test_single_member_owns_everything():
    """A ring of one answers without hashing."""
    assert Ring(["solo"]).owner("anything") == "solo"


def test_empty_ring_is_refused():
    """A ring needs a member."""
    with pytest.raises(ValueError, match="at least one"):
        Ring([])
