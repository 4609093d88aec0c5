"""The admin listener: capture ingest, proxy metrics and stats, on its own address.

``POST /ingest``   binary frames of captured logits rows from the capture plugin's HTTP sink
                   (`tensorverse.capture.frames`), ``Authorization: Bearer <admin token>``.
                   All frames of a body are checked before any is written; rows are written one
                   transaction per capture id and the reply is sent once they are committed.
                   Frames already seen (same origin and seq: a retried batch) are skipped.
``GET /metrics``   Prometheus text: the proxy's counters (``tensorverse_proxy_*``,
                   ``tensorverse_shadow_*``, ``tensorverse_store_*``), read at scrape time.
``GET /stats``     the same counters as one JSON object.
``GET /healthz``   ``ok``.

Listens on 127.0.0.1 by default (``[admin] listen``); without a token, ingest is refused.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import OrderedDict, defaultdict
from typing import Any, Callable

import orjson
from aiohttp import web

log = logging.getLogger("tensorverse.proxy.admin")


class Ingest:
    def __init__(self, store: Any, token: str | None, *, max_bytes: int = 256 << 20, dedupe: int = 200_000) -> None:
        self.store = store
        self.token = token
        self.max_bytes = max_bytes
        self._seen: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._dedupe = dedupe
        self.counters = {"batches": 0, "rows": 0, "duplicates": 0, "rejected": 0, "unauthorized": 0,
                         "store_full": 0, "store_errors": 0}

    def _authorized(self, request: web.Request) -> bool:
        if not self.token:
            return False
        auth = request.headers.get("Authorization", "")
        scheme, _, value = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    @staticmethod
    def _json(status: int, **body: Any) -> web.Response:
        return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

    async def handle(self, request: web.Request) -> web.Response:
        from tensorverse.capture.frames import FrameError, parse_frames
        from tensorverse.store import StoreFullError

        if not self.token:
            self.counters["unauthorized"] += 1
            return self._json(403, error="ingest is disabled: set [admin] token or token_env")
        if not self._authorized(request):
            self.counters["unauthorized"] += 1
            return self._json(401, error="missing or wrong bearer token")
        if self.store is None:
            return self._json(503, error="no store configured")
        if request.content_length is not None and request.content_length > self.max_bytes:
            self.counters["rejected"] += 1
            return self._json(413, error=f"body over {self.max_bytes} bytes")
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > self.max_bytes:
                self.counters["rejected"] += 1
                return self._json(413, error=f"body over {self.max_bytes} bytes")
        try:
            frames = parse_frames(bytes(body))
        except FrameError as e:
            self.counters["rejected"] += 1
            return self._json(400, error=str(e))
        by_run: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
        dup = 0
        for f in frames:
            key = (f.origin, f.seq)
            if f.seq and key in self._seen:
                dup += 1
                continue
            by_run[f.capture_id].append((f.position, f.blob))
        try:
            futures = [self.store.write_rows(run_id, rows) for run_id, rows in by_run.items()]
            await asyncio.gather(*(asyncio.wrap_future(fut) for fut in futures))
        except StoreFullError as e:
            self.counters["store_full"] += 1
            return self._json(507, error=f"store full: {e}")
        except Exception as e:  # noqa: BLE001
            self.counters["store_errors"] += 1
            log.warning("ingest: cannot store rows: %s", e)
            return self._json(500, error=f"cannot store rows: {type(e).__name__}")
        for f in frames:  # remember only what was committed
            if f.seq:
                self._seen[(f.origin, f.seq)] = None
        while len(self._seen) > self._dedupe:
            self._seen.popitem(last=False)
        rows = sum(len(r) for r in by_run.values())
        self.counters["batches"] += 1
        self.counters["rows"] += rows
        self.counters["duplicates"] += dup
        return self._json(200, rows=rows, duplicates=dup, runs=len(by_run))


def _flatten(prefix: str, value: Any, out: list[tuple[str, dict[str, str], float]], labels: dict[str, str]) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        out.append((prefix, labels, float(value)))
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}_{k}", v, out, labels)


class _StatsCollector:
    """Prometheus collector over the proxy's plain counters (nothing to update per request)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self):  # noqa: ANN201 - prometheus_client protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._stats()
        proxy = s.get("proxy", {})
        for key, value in proxy.items():
            yield CounterMetricFamily(f"tensorverse_proxy_{key}", f"proxy: {key.replace('_', ' ')}", value=value)
        rec = s.get("recorder", {})
        for key, value in rec.items():
            yield CounterMetricFamily(f"tensorverse_recorder_{key}", f"recorder: {key.replace('_', ' ')}", value=value)
        sh = s.get("shadow")
        if sh:
            yield CounterMetricFamily("tensorverse_shadow_queued", "turns queued for the shadows", value=sh["queued"])
            yield CounterMetricFamily("tensorverse_shadow_dropped", "turns dropped: shadow queue full",
                                      value=sh["dropped_queue_full"])
            yield GaugeMetricFamily("tensorverse_shadow_queue_depth", "turns waiting for the shadows",
                                    value=sh["queue_depth"])
            skipped = CounterMetricFamily("tensorverse_shadow_skipped", "turns not shadowed, by reason",
                                          labels=["reason"])
            for reason, n in sh["skipped"].items():
                skipped.add_metric([reason], n)
            yield skipped
            runs = CounterMetricFamily("tensorverse_shadow_turns", "shadow turns by backend and outcome",
                                       labels=["backend", "outcome"])
            for backend, outcomes in sh["backend"].items():
                for outcome, n in outcomes.items():
                    runs.add_metric([backend, outcome], n)
            yield runs
        ing = s.get("ingest", {})
        for key, value in ing.items():
            yield CounterMetricFamily(f"tensorverse_ingest_{key}", f"ingest: {key.replace('_', ' ')}", value=value)
        ses = s.get("sessions", {})
        if ses:
            yield CounterMetricFamily("tensorverse_sessions_created", "sessions created", value=ses.get("created", 0))


def make_admin_app(stats: Callable[[], dict[str, Any]], ingest: Ingest | None) -> web.Application:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats))  # type: ignore[arg-type]

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats_json(_: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(stats()), content_type="application/json")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=(ingest.max_bytes if ingest else 1 << 20) + 1)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats_json)
    app.router.add_get("/healthz", healthz)
    if ingest is not None:
        app.router.add_post("/ingest", ingest.handle)
    return app
