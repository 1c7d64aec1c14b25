"""Transports deliver lapsed timers; this module defines the plug-in interface and the registry.

A transport is found through the Python entry-point group ``skyring.transports``: the entry point's
name is the name clients put in ``callback.transport`` (matched case-insensitively), its value a
callable that takes the node's ``Settings`` and returns an object with the ``Transport`` interface.
``http`` is registered this way by skyring itself. Every node of a cluster needs the same transports.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, NamedTuple, Protocol

from ..errors import InvalidRequest
from ..settings import Settings

__all__ = ["ENTRY_POINT_GROUP", "Delivery", "Transport", "Transports"]

ENTRY_POINT_GROUP = "skyring.transports"
logger = logging.getLogger(__name__)


class Delivery(NamedTuple):
    """One delivery attempt, as a transport sees it."""

    timer_id: str
    attempt: int  #: 1 for the first attempt
    deadline_ms: int  #: when the timer lapsed, epoch ms
    data: Any  #: the timer's ``data``: any JSON value, None if absent
    callback: dict[str, Any]  #: the callback as normalised by ``Transport.normalize``


class Transport(Protocol):
    """What a transport plug-in provides."""

    def normalize(self, callback: dict[str, Any]) -> dict[str, Any]:
        """Check a request's ``callback`` and return the form to store.

        Called when a timer is created or replaced. Raise ``skyring.errors.InvalidRequest`` (with a
        ``code``) for a callback this transport can never deliver, so the client gets a 400 at once.
        """
        ...

    def destination(self, callback: dict[str, Any]) -> str:
        """A key for the receiver (e.g. scheme://host:port); in-flight attempts are capped per key."""
        ...

    async def deliver(self, delivery: Delivery) -> None:
        """Make one attempt. Return on success; raise ``skyring.errors.DeliveryError`` on failure."""
        ...

    async def close(self) -> None:
        """Release connections. Called once, at shutdown, after the last attempt."""
        ...


class Transports:
    """The transports this node can deliver through, by lower-case name."""

    def __init__(self, transports: Mapping[str, Transport]) -> None:
        self._by_name = {name.lower(): transport for name, transport in transports.items()}

    @classmethod
    def from_entry_points(cls, settings: Settings) -> Transports:
        """Instantiate every transport registered under ``skyring.transports``.

        Raises:
            RuntimeError: a plug-in could not be loaded; the message names it.
        """
        transports: dict[str, Transport] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            name = ep.name.lower()
            if name in transports:
                continue  # the same distribution can be visible twice (e.g. editable installs)
            try:
                transports[name] = ep.load()(settings)
            except Exception as exc:
                raise RuntimeError(f"cannot load transport {ep.name!r} ({ep.value}): {exc}") from exc
            logger.debug("transport loaded name=%s from=%s", name, ep.value)
        return cls(transports)

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def get(self, name: str) -> Transport | None:
        return self._by_name.get(name)

    def normalize(self, callback: dict[str, Any]) -> dict[str, Any]:
        """Validate ``callback`` against its transport; the result names the transport in lower case."""
        name = callback.get("transport")
        if not isinstance(name, str):
            raise InvalidRequest("callback.transport is required and must be a string", code="invalid_transport")
        transport = self._by_name.get(name.lower())
        if transport is None:
            known = ", ".join(self.names) or "none"
            raise InvalidRequest(
                f"unknown callback.transport {name!r}; this node has: {known}", code="unknown_transport"
            )
        normalized = transport.normalize(callback)
        normalized["transport"] = name.lower()
        return normalized

    async def close(self) -> None:
        for name, transport in self._by_name.items():
            try:
                await transport.close()
            except Exception:
                logger.exception("transport close failed name=%s", name)
