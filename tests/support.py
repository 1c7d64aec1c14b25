"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
from typing import Any

from skyring.settings import Settings

#: One millisecond in seconds, scaled for slow machines with SKYRING_TEST_TIME_FACTOR.
MS = 0.001 * float(os.environ.get("SKYRING_TEST_TIME_FACTOR", "1"))


def node_settings(**overrides: Any) -> Settings:
    """Settings for an in-process node: memory storage, fast retries."""
    values: dict[str, Any] = {
        "port": 0,
        "node_id": "test-node",
        "storage": "memory",
        "delivery_backoff_s": 0.05,
        "delivery_backoff_max_s": 0.5,
        "delivery_timeout_s": 2.0,
        "shutdown_timeout_s": 2.0,
    }
    values.update(overrides)
    return Settings(**values)


def timer_body(
    uri: str, *, timeout_ms: int = 100, data: Any = None, method: str = "post", **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"timeout": timeout_ms, "callback": {"transport": "http", "method": method, "uri": uri}}
    if data is not None:
        body["data"] = data
    body.update(extra)
    return body
