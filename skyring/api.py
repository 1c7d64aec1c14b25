"""HTTP handlers, the route table and the error middleware.

Compatible with the original Skyring: ``POST /timer`` → 201 + ``Location``, ``PUT /timer/<id>`` → 200,
``DELETE /timer/<id>`` → 202, ``GET /ping`` → 200, all with empty bodies. Extended with
``GET /timer/<id>``, ``GET /health`` and ``GET /metrics``. Every error is a JSON body
``{"error": code, "message": text}`` plus the original's ``x-skyring-reason`` header.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .codec import TimerRequest, check_timer_id, dumps, encode_error, parse_timer_request
from .errors import InvalidRequest, SkyringError, TimerExists
from .node import Node

__all__ = ["NODE_KEY", "error_middleware", "routes"]

logger = logging.getLogger(__name__)

NODE_KEY = web.AppKey("skyring.node", Node)
TIMER_ID_HEADER = "x-timer-id"
REASON_HEADER = "x-skyring-reason"
_JSON = "application/json"
_HTTP_ERROR_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    400: "bad_request",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _location(timer_id: str) -> dict[str, str]:
    return {"Location": f"/timer/{timer_id}"}


async def _parse(request: web.Request, node: Node) -> TimerRequest:
    try:
        body = await request.read()
    except (web.RequestPayloadError, HttpProcessingError) as exc:  # e.g. a body unlike its Content-Encoding
        raise InvalidRequest(f"request body cannot be read: {exc}", code="invalid_body") from None
    return parse_timer_request(
        body, max_timeout_ms=node.settings.max_timeout_ms, normalize_callback=node.transports.normalize
    )


async def create_timer(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    timer_id = request.headers.get(TIMER_ID_HEADER)
    if timer_id is not None:
        check_timer_id(timer_id)
    timer_id = await node.create(await _parse(request, node), timer_id)
    return web.Response(status=201, headers=_location(timer_id))


async def update_timer(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    timer_id = request.match_info["timer_id"]
    parsed = await _parse(request, node)
    await node.replace(timer_id, parsed)
    return web.Response(status=200, headers=_location(timer_id))


async def cancel_timer(request: web.Request) -> web.Response:
    timer_id = request.match_info["timer_id"]
    await request.app[NODE_KEY].cancel(timer_id)
    return web.Response(status=202, headers=_location(timer_id))


async def get_timer(request: web.Request) -> web.Response:
    body = request.app[NODE_KEY].view(request.match_info["timer_id"])
    return web.Response(body=body, content_type=_JSON)


async def ping(request: web.Request) -> web.Response:
    return web.Response()


async def health(request: web.Request) -> web.Response:
    report = request.app[NODE_KEY].health()
    status = 200 if report["status"] == "ok" else 503
    return web.Response(body=dumps(report), status=status, content_type=_JSON)


async def metrics(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    report = node.health()
    lines = [
        "# TYPE skyring_timers gauge",
        *(f'skyring_timers{{state="{state}"}} {count}' for state, count in report["timers"].items()),
        "# TYPE skyring_events_total counter",
        *(f'skyring_events_total{{event="{event}"}} {count}' for event, count in report["counters"].items()),
    ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def routes() -> list[web.RouteDef]:
    return [
        web.post("/timer", create_timer),
        web.post("/timer/", create_timer),
        web.get("/timer/{timer_id}", get_timer),
        web.put("/timer/{timer_id}", update_timer),
        web.delete("/timer/{timer_id}", cancel_timer),
        web.get("/ping", ping),
        web.get("/health", health),
        web.get("/metrics", metrics),
    ]


def _error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    reason = message.encode("ascii", "backslashreplace").decode("ascii")[:512]
    all_headers = {REASON_HEADER: reason.replace("\r", " ").replace("\n", " ")}
    if headers:
        all_headers.update(headers)
    return web.Response(status=status, body=encode_error(code, message), headers=all_headers, content_type=_JSON)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON error; nothing escapes as a bare 500."""
    try:
        return await handler(request)
    except SkyringError as exc:
        headers = _location(exc.timer_id) if isinstance(exc, TimerExists) else None
        return _error_response(exc.status, exc.code, str(exc), headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_ERROR_CODES.get(exc.status, "http_error")
        message = exc.reason if exc.status != 413 else "request body is too large"
        extra = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error_response(exc.status, code, message, extra)
    except Exception:
        logger.exception("unhandled error method=%s path=%s", request.method, request.path)
        return _error_response(500, "internal_error", "internal error; see the node's log")
