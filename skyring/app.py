"""The aiohttp application: routes, middleware, and the service's lifetime tied to the app's.

This is where tests inject their own transports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

from aiohttp import web

from .api import SERVICE_KEY, error_middleware, routes
from .service import Service
from .settings import Settings
from .transports import Transports

__all__ = ["SERVICE_KEY", "create_app"]


def create_app(settings: Settings, *, transports: Transports | None = None) -> web.Application:
    """An application serving one node. The node starts with the app and closes on cleanup.

    Args:
        settings: complete settings (``node_id`` and the bound ``port`` filled in).
        transports: delivery transports; by default those registered as entry points.
    """
    app = web.Application(middlewares=[error_middleware], client_max_size=settings.max_body_bytes)
    app.add_routes(routes())
    app.cleanup_ctx.append(partial(_service_lifetime, settings, transports))
    return app


async def _service_lifetime(
    settings: Settings, transports: Transports | None, app: web.Application
) -> AsyncIterator[None]:
    service = await Service.start(settings, transports=transports)
    app[SERVICE_KEY] = service
    yield
    await service.close()
