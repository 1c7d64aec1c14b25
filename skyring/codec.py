"""JSON in and out: request validation, the compact stored form of a timer, response bodies.

The only module that imports orjson. No I/O; imports ``errors`` and ``timers`` only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson

from .errors import InvalidRequest
from .timers import Timer, TimerState

__all__ = [
    "TimerRequest",
    "check_timer_id",
    "decode_spec",
    "decode_timers",
    "dumps",
    "encode_data",
    "encode_error",
    "encode_timer_batches",
    "encode_timer_view",
    "encode_timers",
    "loads",
    "parse_timer_request",
]

CallbackNormalizer = Callable[[dict[str, Any]], dict[str, Any]]

_TIMER_ID = re.compile(r"[A-Za-z0-9._~:@+=-]{1,128}")
_TIMEOUT_RULE = "timeout is required and must be a positive integer number of milliseconds"


class TimerRequest(NamedTuple):
    """A validated create or replace body."""

    timeout_ms: int
    spec: bytes  #: data and normalised callback, as stored (see ``decode_spec``)


def loads(raw: bytes) -> Any:
    return orjson.loads(raw)


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def check_timer_id(timer_id: str) -> str:
    """Return ``timer_id`` if it is a valid client-chosen id, else raise ``InvalidRequest``."""
    if not _TIMER_ID.fullmatch(timer_id):
        raise InvalidRequest(
            "x-timer-id must be 1-128 characters from A-Z a-z 0-9 . _ ~ : @ + = -", code="invalid_timer_id"
        )
    return timer_id


def parse_timer_request(body: bytes, *, max_timeout_ms: int, normalize_callback: CallbackNormalizer) -> TimerRequest:
    """Validate a ``POST /timer`` or ``PUT /timer/<id>`` body.

    Args:
        body: the raw request body.
        max_timeout_ms: the largest accepted ``timeout``.
        normalize_callback: checks ``callback`` against its transport and returns its canonical form;
            raises ``InvalidRequest``.

    Raises:
        InvalidRequest: with a code naming the broken rule.
    """
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("body must be a JSON object with timeout and callback", code="invalid_body")
    timeout_ms = _parse_timeout(doc.get("timeout"), max_timeout_ms)
    callback = doc.get("callback")
    if not isinstance(callback, dict):
        raise InvalidRequest("callback is required and must be an object", code="invalid_callback")
    normalized = normalize_callback(callback)
    try:
        spec = orjson.dumps([doc.get("data"), normalized])
    except orjson.JSONEncodeError:  # parsed (depth <= 1024) but too deep to encode again (orjson's limit is 254)
        raise InvalidRequest("data is nested too deeply", code="invalid_data") from None
    return TimerRequest(timeout_ms, _exact(spec))


def _parse_timeout(value: Any, max_timeout_ms: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequest(_TIMEOUT_RULE, code="invalid_timeout")
    if value > max_timeout_ms:
        raise InvalidRequest(f"timeout must be at most {max_timeout_ms} milliseconds", code="invalid_timeout")
    return value


def decode_spec(spec: bytes) -> tuple[Any, dict[str, Any]]:
    """The ``(data, callback)`` stored in a timer's ``spec``."""
    data, callback = orjson.loads(spec)
    return data, callback


def encode_data(data: Any) -> tuple[bytes, str | None]:
    """A callback body and its content type: strings as UTF-8 text, other values as JSON, null as nothing."""
    if data is None:
        return b"", None
    if isinstance(data, str):
        return data.encode(), "text/plain; charset=utf-8"
    return orjson.dumps(data), "application/json"


def encode_error(code: str, message: str) -> bytes:
    return orjson.dumps({"error": code, "message": message})


def encode_timer_view(timer: Timer, state: TimerState, *, now_ms: float, node_id: str) -> bytes:
    """The ``GET /timer/<id>`` body."""
    data, callback = decode_spec(timer.spec)
    view = {
        "id": timer.id,
        "state": state.value,
        "timeout_ms": timer.timeout_ms,
        "created_ms": timer.created_ms,
        "deadline_ms": timer.deadline_ms,
        "remaining_ms": max(0, timer.deadline_ms - math.ceil(now_ms)),  # whole ms left, never above timeout_ms
        "attempts": timer.attempts,
        "next_attempt_ms": timer.due_ms if state is not TimerState.DELIVERING else None,
        "data": data,
        "callback": callback,
        "node": node_id,
    }
    return orjson.dumps(view)


def encode_timers(timers: list[Timer]) -> bytes:
    """A batch of timers for moving between nodes, deadlines and attempt counts intact."""
    return orjson.dumps([[*timer[:5], orjson.Fragment(timer.spec)] for timer in timers])


def encode_timer_batches(timers: list[Timer], *, max_bytes: int, max_count: int) -> list[tuple[list[Timer], bytes]]:
    """``timers`` as encoded batches of at most ``max_count`` timers and ``max_bytes`` each (a single
    timer larger than that makes a batch of its own, which the sender cannot send)."""
    batches = []
    pending = [timers[i : i + max_count] for i in range(0, len(timers), max_count)]
    while pending:
        batch = pending.pop()
        encoded = encode_timers(batch)
        if len(encoded) > max_bytes and len(batch) > 1:
            half = len(batch) // 2
            pending += [batch[:half], batch[half:]]
        else:
            batches.append((batch, encoded))
    return batches


def decode_timers(raw: bytes) -> list[Timer]:
    """The inverse of ``encode_timers``. Raises ``ValueError`` on a malformed batch."""
    try:
        return [
            Timer(int(due), str(timer_id), int(deadline), int(timeout), int(attempts), _exact(orjson.dumps(spec)))
            for due, timer_id, deadline, timeout, attempts, spec in orjson.loads(raw)
        ]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed timer batch: {exc}") from None


def _exact(encoded: bytes) -> bytes:
    # orjson's result keeps its ~4 KiB build buffer allocated; a pending timer holds its spec for
    # hours, so keep an exact-size copy instead (270 bytes of RSS against 4,100 for a 210-byte spec).
    return bytes(memoryview(encoded))
