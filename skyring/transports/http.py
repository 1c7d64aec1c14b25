"""The built-in ``http`` transport: a webhook call over one pooled keep-alive client session.

Maps aiohttp's exceptions to ``DeliveryError``; nothing of aiohttp escapes this module.
"""

from __future__ import annotations

import email.utils
import functools
import re
import time
from typing import Any

import aiohttp
from yarl import URL

from .. import __version__
from ..codec import encode_data
from ..errors import DeliveryError, InvalidRequest
from ..settings import Settings
from . import Delivery

__all__ = ["METHODS", "HttpTransport", "parse_retry_after"]

METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
MAX_URI_LENGTH = 8192
MAX_HEADERS = 64
MAX_HEADER_BYTES = 8192
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_URI_CHAR = re.compile(r"[\x00-\x20\x7f]")  # controls (tab included) and space
# Set by skyring or by the HTTP stack; a timer's own headers may not change them.
_RESERVED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te"})
_URI_RULE = "callback.uri must be an absolute http:// or https:// URL"
_RETRYABLE_STATUSES = frozenset({408, 425, 429})
# aiohttp would add Content-Type: application/octet-stream to an empty body, and ask for compression.
_NO_AUTO_HEADERS = ("Content-Type", "Accept-Encoding")


class HttpTransport:
    """Delivers ``data`` to ``callback.uri`` with ``callback.method``.

    Success is a 2xx. Network errors, timeouts, 408/425/429 and 5xx are retryable; any other status
    (including 3xx: redirects are not followed) is final.
    """

    def __init__(self, settings: Settings) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=settings.delivery_timeout_s, sock_connect=settings.delivery_connect_timeout_s
        )
        self._timeout_s = settings.delivery_timeout_s
        self._user_agent = f"skyring/{__version__}"
        self._connector_limits = (settings.delivery_concurrency, settings.delivery_per_host)
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        limit, per_host = self._connector_limits
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=per_host, keepalive_timeout=30)
        return aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            cookie_jar=aiohttp.DummyCookieJar(),  # one target must not set cookies another one receives
            auto_decompress=False,
        )

    def normalize(self, callback: dict[str, Any]) -> dict[str, Any]:
        method = callback.get("method")
        if not isinstance(method, str) or method.upper() not in METHODS:
            raise InvalidRequest(
                f"callback.method must be one of {', '.join(sorted(METHODS))} (any case)", code="invalid_method"
            )
        uri = callback.get("uri")
        normalized: dict[str, Any] = {"method": method.upper(), "uri": _check_uri(uri)}
        headers = callback.get("headers")
        if headers is not None:
            normalized["headers"] = _check_headers(headers)
        return normalized

    def destination(self, callback: dict[str, Any]) -> str:
        return _destination(callback["uri"])

    async def deliver(self, delivery: Delivery) -> None:
        if self._session is None:
            self._session = self._open_session()
        callback = delivery.callback
        body, content_type = encode_data(delivery.data)
        headers = {
            "User-Agent": self._user_agent,
            "X-Skyring-Timer-Id": delivery.timer_id,
            "X-Skyring-Deadline": str(delivery.deadline_ms),
            "X-Skyring-Attempt": str(delivery.attempt),
        }
        if content_type is not None:
            headers["Content-Type"] = content_type
        headers.update(callback.get("headers", ()))
        try:
            async with self._session.request(
                callback["method"],
                callback["uri"],
                data=body,
                headers=headers,
                skip_auto_headers=_NO_AUTO_HEADERS,
                allow_redirects=False,
            ) as response:
                status = response.status
                retry_after = response.headers.get("Retry-After")
                await response.read()  # drain, so the connection goes back to the pool
        except TimeoutError:
            raise DeliveryError(f"no answer within {self._timeout_s}s", retryable=True) from None
        except aiohttp.ClientError as exc:
            raise DeliveryError(f"{type(exc).__name__}: {exc}", retryable=True) from None
        if 200 <= status < 300:
            return
        raise DeliveryError(
            f"HTTP {status}",
            retryable=status >= 500 or status in _RETRYABLE_STATUSES,
            retry_after_s=parse_retry_after(retry_after),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


@functools.lru_cache(maxsize=4096)
def _destination(uri: str) -> str:
    url = URL(uri)
    return f"{url.scheme}://{url.host}:{url.port}"


def _check_uri(uri: Any) -> str:
    if isinstance(uri, str) and len(uri) <= MAX_URI_LENGTH:
        return _check_uri_text(uri)  # cached: most clients use a handful of callback URLs
    raise InvalidRequest(_URI_RULE, code="invalid_uri")


@functools.lru_cache(maxsize=4096)
def _check_uri_text(uri: str) -> str:
    if _BAD_URI_CHAR.search(uri):
        raise InvalidRequest(_URI_RULE, code="invalid_uri")
    try:
        url = URL(uri)
        # .host decodes IDNA lazily and .port checks the range: both raise ValueError (UnicodeError) here.
        valid = url.scheme in ("http", "https") and bool(url.host) and bool(url.port)  # port 0 is unreachable
    except (ValueError, TypeError):
        valid = False
    if not valid:
        raise InvalidRequest(_URI_RULE, code="invalid_uri")
    return uri


def _check_headers(headers: Any) -> dict[str, str]:
    rule = "callback.headers must be an object of header names to string values"
    if not isinstance(headers, dict) or len(headers) > MAX_HEADERS:
        raise InvalidRequest(f"{rule}, at most {MAX_HEADERS}", code="invalid_headers")
    size = 0
    for name, value in headers.items():
        if not isinstance(value, str) or not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
            raise InvalidRequest(f"{rule}; {name!r} is not a valid header", code="invalid_headers")
        lower = name.lower()
        if lower in _RESERVED or lower.startswith("x-skyring-"):
            raise InvalidRequest(f"callback.headers may not set {name!r}", code="invalid_headers")
        try:
            size += len(name) + len(value.encode("latin-1"))
        except UnicodeEncodeError:
            raise InvalidRequest(f"callback.headers[{name!r}] must be latin-1 text", code="invalid_headers") from None
    if size > MAX_HEADER_BYTES:
        raise InvalidRequest(f"callback.headers may hold at most {MAX_HEADER_BYTES} bytes", code="invalid_headers")
    return dict(headers)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())
