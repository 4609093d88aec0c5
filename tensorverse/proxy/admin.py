"""The admin listener: capture ingest, proxy metrics and stats, on its own address.

``POST /ingest``   binary frames of captured logits rows from the capture plugin's HTTP sink
                   (`tensorverse.capture.frames`), ``Authorization: Bearer <admin token>``:
                   `tensorverse.proxy.ingest` (checked whole, stored in the ingest worker
                   process, answered once committed; a retried batch is not stored twice).
``GET /metrics``   Prometheus text (`tensorverse.exporters.metrics`; every metric is in
                   ``docs/metrics.md``): divergence metrics updated as comparisons are stored,
                   plus the proxy's counters and the store's gauges read at scrape time.
``GET /stats``     the same counters as one JSON object.
``GET /verdict``   each shadow's verdict (regression / equivalent / undecided, docs/verdict.md)
                   as ``tensorverse verdict --json`` prints it, plus when it was computed: the
                   last snapshot, recomputed from the store in a worker thread every
                   ``[verdict] refresh_s`` (never on the relay's loop).
``GET /healthz``   ``ok``.

Listens on 127.0.0.1 by default (``[admin] listen``); without a token, ingest is refused.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import orjson
from aiohttp import web

from tensorverse.proxy.ingest import Ingest


def make_admin_app(stats: Callable[[], dict[str, Any]], ingest: Ingest | None, *,
                   metrics: Any = None, store: Any = None, verdict: Any = None) -> web.Application:
    """The admin app. ``metrics``: the process's `tensorverse.exporters.metrics.Metrics` (a bare
    one when None: the scrape-time families only); ``store``: for the store gauges; ``verdict``:
    a `tensorverse.exporters.verdict_watch.VerdictWatch`, refreshed in a worker thread every
    ``refresh_s`` while the app runs, served at ``/verdict`` and as gauges."""
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    from tensorverse.exporters.metrics import Metrics

    registry = (metrics if metrics is not None else Metrics()).registry(stats, store, verdict)

    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats_json(_: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(stats()), content_type="application/json")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def verdict_json(_: web.Request) -> web.Response:
        if verdict is None:
            return web.json_response({"error": "no store: the verdict needs one"}, status=404)
        return web.Response(body=orjson.dumps(verdict.as_dict()), content_type="application/json")

    async def refresh_verdict(app: web.Application) -> Any:
        async def loop() -> None:
            while True:
                snap = await asyncio.get_running_loop().run_in_executor(None, verdict.refresh)
                # at most a tenth of the time computing: a huge store is refreshed less often
                await asyncio.sleep(max(verdict.refresh_s, 10 * (snap.seconds or 0.0)))

        task = asyncio.get_running_loop().create_task(loop())
        yield
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, verdict.wait_idle)  # the store closes next

    app = web.Application(client_max_size=(ingest.max_bytes if ingest else 1 << 20) + 1)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/stats", stats_json)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/verdict", verdict_json)
    if verdict is not None:
        app.cleanup_ctx.append(refresh_verdict)
    if ingest is not None:
        app.router.add_post("/ingest", ingest.handle)
    return app
