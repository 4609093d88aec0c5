"""Serving a test server's aiohttp application on the loopback interface: the one step every fake
of this package takes to start (the primary's, the shadows', turnstone's scripted chat server and
its recording hop)."""

from __future__ import annotations

from typing import Any

from aiohttp import web


async def serve(app: web.Application, port: int = 0, *, backlog: int = 128,
                **runner_kw: Any) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``127.0.0.1:port`` (0: a free port); the runner (``await
    runner.cleanup()`` stops it) and the port it listens on. ``runner_kw``: aiohttp's
    ``AppRunner`` options (``access_log=None``, ``handler_cancellation=True``)."""
    runner = web.AppRunner(app, **runner_kw)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=backlog)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
