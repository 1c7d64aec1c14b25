"""Runs a node: bind, start, announce readiness, wait for the shutdown trigger, stop in order.

The only module that installs signal handlers (in ``run``); ``serve`` takes a trigger instead, so
tests can drive it in-process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web

from .app import SERVICE_KEY, create_app
from .errors import SkyringError
from .service import advertised_host, host_port
from .settings import Settings

__all__ = ["READY_PREFIX", "STARTUP_FAILURE", "run", "serve"]

logger = logging.getLogger(__name__)

READY_PREFIX = "skyring ready"
STARTUP_FAILURE = 3
FORCED_EXIT = 1


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024, reuse_port=False)


async def serve(
    settings: Settings,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until ``shutdown_trigger()`` completes, then shut down gracefully.

    Order: bind (fails fast on a busy port) → open storage and recover timers → accept requests →
    print the ready line → wait → stop accepting and finish requests → stop firing, finish
    deliveries within ``shutdown_timeout_s`` → flush storage.

    Raises:
        OSError: the address cannot be bound.
        SkyringError: storage cannot be opened.
    """
    sock = _bind(settings.host, settings.port)
    port = sock.getsockname()[1]
    settings = settings.replace(port=port, node_id=settings.node_id or host_port(advertised_host(settings), port))
    runner = web.AppRunner(
        create_app(settings), handle_signals=False, access_log=None, shutdown_timeout=settings.shutdown_timeout_s
    )
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        # Objects alive now live as long as the process: keep them out of every future GC pass.
        gc.freeze()
        url = "http://" + host_port(settings.host, port)
        line = f"{READY_PREFIX} node={settings.node_id} url={url}"
        print(line, file=sys.stderr, flush=True)
        if on_ready is not None:
            on_ready(url)
        await shutdown_trigger()
        logger.info("shutting down node=%s", settings.node_id)
        # Leave while still listening: requests keep being answered (or forwarded) during the grace.
        await runner.app[SERVICE_KEY].leave()
    finally:
        await runner.cleanup()
        sock.close()
    logger.info("stopped node=%s", settings.node_id)


def run(settings: Settings) -> int:
    """Serve with SIGINT/SIGTERM handling; returns the process exit code.

    The first signal starts a graceful shutdown; a second one exits at once.
    """
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every platform we test
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_run(settings))


async def _run(settings: Settings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("second %s: exiting without finishing", signal.Signals(signum).name)
            os._exit(FORCED_EXIT)
        logger.info("%s received: shutting down", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await serve(settings, shutdown_trigger=stop.wait)
    except OSError as exc:
        logger.error("cannot listen on %s:%s: %s", settings.host, settings.port, exc)
        return STARTUP_FAILURE
    except (SkyringError, RuntimeError) as exc:  # storage cannot be opened, a transport cannot load
        logger.error("startup failed: %s", exc)
        return STARTUP_FAILURE
    return 0
