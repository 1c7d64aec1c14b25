"""The aiohttp application: routes, middleware, and the node's lifetime tied to the app's.

This is where tests inject their own transports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

from aiohttp import web

from .api import NODE_KEY, error_middleware, routes
from .node import Node
from .settings import Settings
from .storage import open_storage
from .transports import Transports

__all__ = ["NODE_KEY", "create_app"]


def create_app(settings: Settings, *, transports: Transports | None = None) -> web.Application:
    """An application serving one node. The node opens on app startup and closes on cleanup.

    Args:
        settings: complete settings (``node_id`` filled in).
        transports: delivery transports; by default those registered as entry points.
    """
    app = web.Application(middlewares=[error_middleware], client_max_size=settings.max_body_bytes)
    app.add_routes(routes())
    app.cleanup_ctx.append(partial(_node_lifetime, settings, transports))
    return app


async def _node_lifetime(
    settings: Settings, transports: Transports | None, app: web.Application
) -> AsyncIterator[None]:
    transports = transports or Transports.from_entry_points(settings)
    storage = await open_storage(settings)
    node = Node(settings, storage=storage, transports=transports)
    try:
        await node.start()
    except BaseException:
        await node.close()
        raise
    app[NODE_KEY] = node
    yield
    await node.close()
