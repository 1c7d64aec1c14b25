"""Skyring's exceptions: one base, each class with an HTTP status and a stable code.

    SkyringError                 status  code
    ├── InvalidRequest            400    (the subclass or instance names the code)
    ├── TimerNotFound             404    timer_not_found
    ├── TimerExists               409    timer_exists
    ├── DeliveryInProgress        409    delivery_in_progress
    ├── StorageError              503    storage_unavailable
    ├── NodeDraining              503    node_draining
    ├── PeerError                 502    peer_error         (forwarding to the owner failed)
    │   ├── PeerUnavailable       503    peer_unavailable   (cannot connect, or the connection was lost)
    │   │   └── PeerNotConnected  503    peer_unavailable   (the request was certainly never sent)
    │   └── PeerTimeout           504    peer_timeout       (no answer in time)
    ├── ClusterError              503    cluster_error      (NATS failures)
    └── DeliveryError             —      delivery_failed (never reaches HTTP; logged and counted)

Imports nothing from skyring.
"""

from __future__ import annotations

__all__ = [
    "DeliveryError",
    "DeliveryInProgress",
    "InvalidRequest",
    "ClusterError",
    "NodeDraining",
    "PeerError",
    "PeerNotConnected",
    "PeerTimeout",
    "PeerUnavailable",
    "SkyringError",
    "StorageError",
    "TimerExists",
    "TimerNotFound",
]


class SkyringError(Exception):
    """Base of every error skyring raises on purpose."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidRequest(SkyringError):
    """The request is malformed; ``code`` names the rule it broke (``invalid_timeout``, ...)."""

    status = 400
    code = "invalid_request"


class TimerNotFound(SkyringError):
    status = 404
    code = "timer_not_found"

    def __init__(self, timer_id: str) -> None:
        super().__init__(f"timer {timer_id!r} not found (unknown, cancelled or already fired)")
        self.timer_id = timer_id


class TimerExists(SkyringError):
    status = 409
    code = "timer_exists"

    def __init__(self, timer_id: str) -> None:
        super().__init__(f"timer {timer_id!r} already exists")
        self.timer_id = timer_id


class DeliveryInProgress(SkyringError):
    status = 409
    code = "delivery_in_progress"

    def __init__(self, timer_id: str) -> None:
        super().__init__(f"timer {timer_id!r} is being delivered; it can no longer be changed or cancelled")
        self.timer_id = timer_id


class StorageError(SkyringError):
    status = 503
    code = "storage_unavailable"


class NodeDraining(SkyringError):
    status = 503
    code = "node_draining"


class PeerError(SkyringError):
    status = 502
    code = "peer_error"


class PeerUnavailable(PeerError):
    status = 503
    code = "peer_unavailable"


class PeerNotConnected(PeerUnavailable):
    """No connection to the peer could be had: the request was never sent."""


class PeerTimeout(PeerError):
    status = 504
    code = "peer_timeout"


class ClusterError(SkyringError):
    status = 503
    code = "cluster_error"


class DeliveryError(SkyringError):
    """One delivery attempt failed.

    Args:
        reason: what went wrong, for logs (``"HTTP 503"``, ``"timeout after 10.0s"``).
        retryable: whether another attempt may succeed.
        retry_after_s: the target's own ``Retry-After`` hint, if it gave one.
    """

    code = "delivery_failed"

    def __init__(self, reason: str, *, retryable: bool, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.retry_after_s = retry_after_s
