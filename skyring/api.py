"""HTTP handlers, the route table and the error middleware.

Compatible with the original Skyring: ``POST /timer`` → 201 + ``Location``, ``PUT /timer/<id>`` → 200,
``DELETE /timer/<id>`` → 202, ``GET /ping`` → 200, all with empty bodies. Extended with
``GET /timer/<id>``, ``GET /health``, ``GET /cluster`` and ``GET /metrics``. Every error is a JSON body
``{"error": code, "message": text}`` plus the original's ``x-skyring-reason`` header. Timer operations
go through the router, which answers them here or at the owning node.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .codec import check_timer_id, dumps
from .errors import InvalidRequest, SkyringError
from .router import Reply, error_reply, reply_for
from .service import Service

__all__ = ["SERVICE_KEY", "error_middleware", "routes"]

logger = logging.getLogger(__name__)

SERVICE_KEY = web.AppKey("skyring.service", Service)
TIMER_ID_HEADER = "x-timer-id"
_JSON = "application/json"
_HTTP_ERROR_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _respond(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, headers=reply.headers, body=reply.body or None)


async def _body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except (web.RequestPayloadError, HttpProcessingError) as exc:  # e.g. a body unlike its Content-Encoding
        raise InvalidRequest(f"request body cannot be read: {exc}", code="invalid_body") from None


async def create_timer(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    timer_id = request.headers.get(TIMER_ID_HEADER)
    generated = timer_id is None
    if timer_id is None:
        timer_id = service.router.new_id(local=service.settings.local_ids)
    else:
        check_timer_id(timer_id)
    body = await _body(request)
    return _respond(await service.router.handle("create", timer_id, body, generated=generated))


async def update_timer(request: web.Request) -> web.Response:
    body = await _body(request)
    return _respond(await request.app[SERVICE_KEY].router.handle("replace", request.match_info["timer_id"], body))


async def cancel_timer(request: web.Request) -> web.Response:
    return _respond(await request.app[SERVICE_KEY].router.handle("cancel", request.match_info["timer_id"]))


async def get_timer(request: web.Request) -> web.Response:
    return _respond(await request.app[SERVICE_KEY].router.handle("get", request.match_info["timer_id"]))


async def ping(request: web.Request) -> web.Response:
    return web.Response()


async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    report = service.node.health()
    report["ring"] = {"checksum": service.router.ring.checksum, "members": len(service.router.ring.members)}
    status = 200 if report["status"] == "ok" else 503
    return web.Response(body=dumps(report), status=status, content_type=_JSON)


async def cluster(request: web.Request) -> web.Response:
    return web.Response(body=dumps(request.app[SERVICE_KEY].cluster_view()), content_type=_JSON)


async def metrics(request: web.Request) -> web.Response:
    report = request.app[SERVICE_KEY].node.health()
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
        web.get("/cluster", cluster),
        web.get("/metrics", metrics),
    ]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON error; nothing escapes as a bare 500."""
    try:
        return await handler(request)
    except SkyringError as exc:
        return _respond(reply_for(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_ERROR_CODES.get(exc.status, "http_error")
        message = exc.reason if exc.status != 413 else "request body is too large"
        extra = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _respond(error_reply(exc.status, code, message, extra))
    except Exception:
        logger.exception("unhandled error method=%s path=%s", request.method, request.path)
        return _respond(error_reply(500, "internal_error", "internal error; see the node's log"))
