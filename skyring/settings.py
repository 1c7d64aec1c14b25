"""Node configuration: one frozen ``Settings`` built at the edge and passed in.

Every field is settable as ``SKYRING_<FIELD>`` in the environment and as ``--<field>`` on the command
line (``cli.py`` builds its flags from ``FIELDS``). Only this module and ``cli.py`` see the environment.
Imports nothing from skyring.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENV_PREFIX", "FIELDS", "LOG_LEVELS", "STORAGE_BACKENDS", "Settings"]

ENV_PREFIX = "SKYRING_"
DEFAULT_DATA_DIR = "skyring-data"
STORAGE_BACKENDS = ("sqlite", "memory")
LOG_LEVELS = ("debug", "info", "warning", "error")
_DAY_MS = 86_400_000


def _opt(default: Any, help: str, **constraints: Any) -> Any:  # noqa: A002 - argparse's word
    return field(default=default, metadata={"help": help, **constraints})


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8080, "port to listen on; 0 picks a free port", min=0, max=65535)
    node_id: str = _opt("", "this node's name; default <host>:<port>")
    storage: str = _opt("sqlite", "where timers are kept: sqlite (durable) or memory", choices=STORAGE_BACKENDS)
    data_dir: str = _opt(
        "", "directory for the sqlite store; default skyring-data, in a cluster skyring-data/<node-id>"
    )
    log_level: str = _opt("info", "log level", choices=LOG_LEVELS)
    max_timeout_ms: int = _opt(365 * _DAY_MS, "longest accepted timeout, in ms (31536000000 = 365 days)", min=1)
    max_body_bytes: int = _opt(1024 * 1024, "largest accepted request body, in bytes", min=1024)
    delivery_connect_timeout_s: float = _opt(5.0, "connect timeout for a callback", min=0.001)
    delivery_timeout_s: float = _opt(10.0, "total timeout for one callback attempt", min=0.001)
    delivery_max_attempts: int = _opt(5, "attempts per timer before it is dropped", min=1)
    delivery_backoff_s: float = _opt(1.0, "delay before the first retry; doubles each retry", min=0.0)
    delivery_backoff_max_s: float = _opt(300.0, "longest delay between attempts (also caps Retry-After)", min=0.0)
    delivery_concurrency: int = _opt(1024, "callbacks in flight at once on this node", min=1)
    delivery_per_host: int = _opt(128, "callbacks in flight at once to one receiver (capped by the above)", min=1)
    shutdown_timeout_s: float = _opt(10.0, "on shutdown, how long in-flight work may take to finish", min=0.0)
    nats: str = _opt("", "NATS server URL(s), comma-separated, to join a cluster; empty runs the node alone")
    cluster: str = _opt("skyring", "nodes with the same cluster name form one ring", pattern=r"[A-Za-z0-9_-]{1,64}")
    advertise_host: str = _opt("", "address other nodes use to reach this one; default --host (hostname if 0.0.0.0)")
    peer_port: int = _opt(0, "port of the node-to-node channel; 0 picks a free port", min=0, max=65535)
    heartbeat_s: float = _opt(1.0, "how often a node announces it is alive", min=0.01)
    failure_timeout_s: float = _opt(5.0, "a node not heard from this long is dropped from the ring", min=0.05)
    leave_grace_s: float = _opt(1.0, "on shutdown, how long to keep serving after announcing the leave", min=0.0)
    handoff_timeout_s: float = _opt(30.0, "on shutdown, how long handing timers to other nodes may take", min=0.1)
    forward_timeout_s: float = _opt(5.0, "how long a forwarded request may take at its owner", min=0.01)
    forward_retry_s: float = _opt(3.0, "how long to retry an unreachable owner before answering 503", min=0.0)
    local_ids: bool = _opt(False, "give creates without x-timer-id an id this node owns, so they need no hop")

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> Settings:
        """Build settings from ``SKYRING_*`` variables, then ``overrides`` (e.g. command-line flags).

        Raises:
            ValueError: a variable or override is malformed or out of range; the message names it.
        """
        values: dict[str, Any] = {}
        for name, value in overrides.items():
            if value is not None:
                values[name] = _convert(_FIELDS_BY_NAME[name], value, "--" + name.replace("_", "-"))
        for f in FIELDS:
            env_name = ENV_PREFIX + f.name.upper()
            if f.name not in values and env_name in environ:
                values[f.name] = _convert(f, environ[env_name], env_name)
        return cls(**values)

    def __post_init__(self) -> None:
        for f in FIELDS:
            _check(f, getattr(self, f.name), f.name)
        if self.failure_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"failure_timeout_s ({self.failure_timeout_s}) must be more than twice heartbeat_s ({self.heartbeat_s})"
            )

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @property
    def data_path(self) -> str:
        """``data_dir``, or its default: one directory per node id in a cluster, so nodes started side by
        side in one directory do not share (and lock) one store."""
        if self.data_dir:
            return self.data_dir
        if not self.nats_servers:
            return DEFAULT_DATA_DIR
        return os.path.join(DEFAULT_DATA_DIR, re.sub(r"[^A-Za-z0-9._-]", "_", self.node_id))

    @property
    def nats_servers(self) -> list[str]:
        return [url.strip() for url in self.nats.split(",") if url.strip()]


FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(Settings)
_FIELDS_BY_NAME = {f.name: f for f in FIELDS}
_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def field_type(f: dataclasses.Field[Any]) -> type:
    """The Python type of a settings field (annotations are strings under ``__future__``)."""
    return _TYPES[str(f.type)]


def _convert(f: dataclasses.Field[Any], raw: Any, source: str) -> Any:
    kind = field_type(f)
    value: Any
    if isinstance(raw, kind) and (kind is bool or not isinstance(raw, bool)):
        value = raw
    elif kind is bool:
        value = _BOOLEANS.get(str(raw).strip().lower())
        if value is None:
            raise ValueError(f"{source}={raw!r} must be true or false")
    else:
        try:
            value = kind(str(raw).strip())
        except ValueError:
            raise ValueError(f"{source}={raw!r} is not a valid {kind.__name__}") from None
    if kind is str and "choices" in f.metadata:
        value = value.lower()
    _check(f, value, source)
    return value


def _check(f: dataclasses.Field[Any], value: Any, source: str) -> None:
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        raise ValueError(f"{source}={value!r} must be one of {', '.join(meta['choices'])}")
    if "min" in meta and value < meta["min"]:
        raise ValueError(f"{source}={value!r} must be at least {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise ValueError(f"{source}={value!r} must be at most {meta['max']}")
    if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
        raise ValueError(f"{source}={value!r} must match {meta['pattern']}")
