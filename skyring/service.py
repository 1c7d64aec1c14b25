"""One node with everything it runs on: storage, transports, timers, routing and, with NATS, the cluster.

Start: open storage and recover timers; without NATS, serve alone. With NATS: open the peer channel,
join the queue group for hand-offs, join the membership (which builds the ring), and wait until the
timers recovered from storage are placed at their owners. Leave (SIGTERM): announce the leave, keep
answering for a grace period, then hand the timers off. Close: stop everything, in reverse order.
Imports the adapters and the node; never aiohttp.web.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from .cluster import Bus
from .handoff import HandOff
from .membership import Member, Membership
from .mover import Mover
from .node import Node
from .peers import PeerClient, PeerServer
from .ring import Ring
from .router import Router
from .settings import Settings
from .storage import open_storage
from .transports import Transports

__all__ = ["Service", "advertised_host", "host_port"]

logger = logging.getLogger(__name__)


def advertised_host(settings: Settings) -> str:
    """The address other nodes and clients should use for this node (a wildcard names no machine)."""
    if settings.advertise_host:
        return settings.advertise_host
    return socket.gethostname() if settings.host in ("0.0.0.0", "::", "") else settings.host


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Cluster:
    """The parts a node has only in a cluster."""

    def __init__(
        self,
        bus: Bus,
        membership: Membership,
        peers: PeerClient,
        peer_server: PeerServer,
        mover: Mover,
        handoff: HandOff,
    ) -> None:
        self.bus = bus
        self.membership = membership
        self.peers = peers
        self.peer_server = peer_server
        self.mover = mover
        self.handoff = handoff


class Service:
    """A running node. Build it with ``await Service.start(settings)``; ``close()`` it once."""

    def __init__(self, settings: Settings, node: Node, router: Router, cluster: _Cluster | None = None) -> None:
        self.settings = settings
        self.node = node
        self.router = router
        self._cluster = cluster
        self._left = False

    def __repr__(self) -> str:
        return f"<Service {self.node!r} {self.router!r}>"

    @classmethod
    async def start(cls, settings: Settings, *, transports: Transports | None = None) -> Service:
        """Open storage, recover timers and, if ``settings.nats`` names servers, join the cluster.

        ``settings.port`` must be the bound HTTP port. Raises ``SkyringError`` if storage or NATS
        cannot be reached (everything opened so far is closed again).
        """
        transports = transports or Transports.from_entry_points(settings)
        node = Node(settings, storage=await open_storage(settings), transports=transports)
        try:
            await node.start()
            if not settings.nats_servers:
                return cls(settings, node, Router(node, node_id=settings.node_id))
            return await cls._join(settings, node)
        except BaseException:
            await node.close()
            raise

    @classmethod
    async def _join(cls, settings: Settings, node: Node) -> Service:
        peers = PeerClient(timeout_s=settings.forward_timeout_s, connect_timeout_s=min(2.0, settings.forward_timeout_s))
        router = Router(
            node,
            node_id=settings.node_id,
            peers=peers,
            forward_retry_s=settings.forward_retry_s,
            # A leaving node may hold timers until its grace and hand-off are over.
            handover_window_s=max(
                settings.leave_grace_s + settings.handoff_timeout_s + settings.forward_timeout_s,
                3 * settings.failure_timeout_s,
            ),
        )
        peer_server = await PeerServer.start(settings.host, settings.peer_port, router.serve_peer)
        try:
            bus = await Bus.connect(settings.nats_servers, name=settings.node_id)
        except BaseException:
            await peer_server.close()
            await peers.close()
            raise
        host = advertised_host(settings)
        me = Member(settings.node_id, "http://" + host_port(host, settings.port), host_port(host, peer_server.port))
        mover = Mover(node, router, peers)
        router.on_misplaced = mover.trigger
        service = cls(settings, node, router)
        membership = Membership(
            bus,
            cluster=settings.cluster,
            me=me,
            heartbeat_s=settings.heartbeat_s,
            failure_timeout_s=settings.failure_timeout_s,
            on_change=service._on_members,
        )
        handoff = HandOff(bus, cluster=settings.cluster, node=node, mover=mover)
        service._cluster = _Cluster(bus, membership, peers, peer_server, mover, handoff)
        try:
            await handoff.serve()
            await membership.start()
        except BaseException:
            await service.close()
            raise
        if not await mover.settled(settings.handoff_timeout_s):
            logger.warning("recovered timers not all placed yet; carrying on in the background")
        logger.info(
            "joined cluster=%s node=%s members=%d ring=%s",
            settings.cluster,
            settings.node_id,
            len(router.ring.members),
            router.ring.checksum,
        )
        return service

    def _on_members(self, members: dict[str, Member]) -> None:
        if self._cluster is None:  # closing
            return
        if self._left:
            members = {node_id: m for node_id, m in members.items() if node_id != self.settings.node_id}
            if not members:
                return
        ring = Ring(members)
        if self.router.update(ring, {node_id: m.peer_address for node_id, m in members.items()}):
            logger.info("ring changed members=%s ring=%s", ",".join(sorted(members)), ring.checksum)
            self._cluster.mover.trigger()

    async def leave(self) -> None:
        """Leave the cluster gracefully: announce it, keep answering for the grace period, hand timers off.

        Without a cluster, or as the last node, timers simply stay in local storage.
        """
        cluster = self._cluster
        if cluster is None or self._left:
            return
        self._left = True
        self.node.begin_leaving()
        # The hand-off moves this node's timers; a rebalance must not move them too, or be cut off
        # half-way: stop it (between chunks) before this node drops itself from its ring.
        await cluster.mover.close(self.settings.forward_timeout_s)
        await cluster.handoff.stop_serving()
        others = [m for m in cluster.membership.members if m != self.settings.node_id]
        await cluster.membership.leave()
        if not others:
            logger.info("last node: keeping timers in local storage count=%d", self.node.pending_count)
            return
        self._on_members(dict(cluster.membership.members))
        await asyncio.sleep(self.settings.leave_grace_s)
        me = self.settings.node_id
        handed_off, left = await cluster.handoff.send_all(
            self.settings.handoff_timeout_s, has_peers=lambda: any(m != me for m in cluster.membership.members)
        )
        log = logger.info if left == 0 else logger.warning
        log("hand-off done node=%s handed_off=%d failed=%d", self.settings.node_id, handed_off, left)

    def cluster_view(self) -> dict[str, Any]:
        """This node's view of the cluster (``GET /cluster``)."""
        view: dict[str, Any] = {
            "node": self.settings.node_id,
            "cluster": self.settings.cluster if self._cluster else None,
            "ring": {"checksum": self.router.ring.checksum, "members": sorted(self.router.ring.members)},
        }
        if self._cluster is not None:
            membership = self._cluster.membership
            seen_s = membership.last_seen_s()
            view["version"] = membership.version
            view["members"] = [
                {
                    "node": m.node_id,
                    "url": m.api_url,
                    "peer": m.peer_address,
                    "last_seen_s": round(seen_s.get(m.node_id, 0.0), 3),
                }
                for m in sorted(membership.members.values())
            ]
        return view

    async def close(self) -> None:
        """Stop the cluster parts, then the node (which finishes deliveries and flushes storage)."""
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            await cluster.mover.close()
            await cluster.membership.close()
            await cluster.peer_server.close()
        await self.node.close()
        if cluster is not None:
            await cluster.peers.close()
            await cluster.bus.close()
