"""The admin listener: capture ingest, proxy metrics and stats, on its own address.

``POST /ingest``   binary frames of captured logits rows from the capture plugin's HTTP sink
                   (`tensorverse.capture.frames`), ``Authorization: Bearer <admin token>``.
                   All frames of a body are checked before any is written (in a thread when
                   the body is over 256 KiB: its crc32s would otherwise hold the relay's loop);
                   rows are written one transaction per capture id and the reply is sent once
                   they are committed.
                   Frames already seen (same origin and seq: a retried batch) are skipped.
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
import hmac
import logging
from collections import OrderedDict, defaultdict
from typing import Any, Callable

import orjson
from aiohttp import web

from tensorverse.proxy.dedupe import SeenFrames

log = logging.getLogger("tensorverse.proxy.admin")


class Ingest:
    def __init__(self, store: Any, token: str | None, *, max_bytes: int = 256 << 20,
                 dedupe_window: int = 1 << 16) -> None:
        self.store = store
        self.token = token
        self.max_bytes = max_bytes
        # the frames stored lately, per capturing process: a batch sent again is not stored twice
        self._seen = SeenFrames(dedupe_window)
        self.counters = {"batches": 0, "rows": 0, "duplicates": 0, "rejected": 0, "unauthorized": 0,
                         "store_full": 0, "store_errors": 0, "bytes": 0, "rows_dropped_store_full": 0,
                         "rows_dropped_store_error": 0, "rows_compact": 0}
        # the capturing processes' own counters (sink header), latest per origin, for /metrics
        self._plugins: OrderedDict[int, dict[str, int]] = OrderedDict()

    _PLUGIN_KEYS = ("rows_captured", "dropped_no_buffer", "dropped_sink", "dropped_encode")
    #: bodies larger than this are parsed and checked in a thread, not on the loop that relays
    OFF_LOOP_BYTES = 256 << 10

    def _note_plugin_stats(self, request: web.Request) -> None:
        from tensorverse.capture.sink import STATS_HEADER

        raw = request.headers.get(STATS_HEADER)
        if not raw or len(raw) > 4096:
            return
        try:
            d = orjson.loads(raw)
            origin = int(d["origin"])
            vals = {k: int(d.get(k) or 0) for k in self._PLUGIN_KEYS}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return
        self._plugins[origin] = vals
        self._plugins.move_to_end(origin)
        while len(self._plugins) > 1024:
            self._plugins.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        """The counters, plus ``plugins``: the capture plugins' counters summed over processes."""
        plugins = {k: sum(p[k] for p in self._plugins.values()) for k in self._PLUGIN_KEYS}
        return {**self.counters, "plugins": plugins}

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
        from tensorverse.store.compact import check_compact
        from tensorverse.store.schema import check_id

        if not self.token:
            self.counters["unauthorized"] += 1
            return self._json(403, error="ingest is disabled: set [admin] token or token_env")
        if not self._authorized(request):
            self.counters["unauthorized"] += 1
            return self._json(401, error="missing or wrong bearer token")
        self._note_plugin_stats(request)
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
        self.counters["bytes"] += len(body)

        def checked(buf: bytes) -> list:
            frames = parse_frames(buf)
            for i, f in enumerate(frames):  # ids the store would refuse are the sender's error
                try:
                    check_id(f.capture_id, "capture")
                    if f.compact:  # 180 bytes: checked here, so the store holds no garbage
                        check_compact(f.blob, record=f"{f.capture_id}@{f.position}")
                except ValueError as e:
                    raise FrameError(f"frame {i}: {e}") from None
            return frames

        try:
            # a big body is checked off the relay's loop (crc32 of megabytes: ~0.7 ms per MB)
            frames = (await asyncio.to_thread(checked, bytes(body)) if len(body) > self.OFF_LOOP_BYTES
                      else checked(bytes(body)))
        except FrameError as e:
            self.counters["rejected"] += 1
            return self._json(400, error=str(e))
        by_run: dict[str, list[tuple]] = defaultdict(list)
        dup = 0
        fresh: list[tuple[int, int]] = []  # (origin, seq) of the frames to store
        for f in frames:
            if f.seq:
                key = (f.origin, f.seq)
                if key in self._seen:
                    dup += 1
                    continue
                fresh.append(key)
            by_run[f.capture_id].append((f.position, f.blob, f.engine, f.compact))
        try:
            futures = [self.store.write_rows(run_id, rows) for run_id, rows in by_run.items()]
            await asyncio.gather(*(asyncio.wrap_future(fut) for fut in futures))
        except StoreFullError as e:
            self.counters["store_full"] += 1
            self.counters["rows_dropped_store_full"] += sum(len(r) for r in by_run.values())
            return self._json(507, error=f"store full: {e}")
        except Exception as e:  # noqa: BLE001
            self.counters["store_errors"] += 1
            self.counters["rows_dropped_store_error"] += sum(len(r) for r in by_run.values())
            log.warning("ingest: cannot store rows: %s", e)
            return self._json(500, error=f"cannot store rows: {type(e).__name__}")
        for origin, seq in fresh:  # remember only what was committed
            self._seen.add(origin, seq)
        rows = sum(len(r) for r in by_run.values())
        self.counters["batches"] += 1
        self.counters["rows"] += rows
        self.counters["rows_compact"] += sum(1 for r in by_run.values() for row in r if row[3])
        self.counters["duplicates"] += dup
        return self._json(200, rows=rows, duplicates=dup, runs=len(by_run))


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

    async def metrics(_: web.Request) -> web.Response:
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
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats_json)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/verdict", verdict_json)
    if verdict is not None:
        app.cleanup_ctx.append(refresh_verdict)
    if ingest is not None:
        app.router.add_post("/ingest", ingest.handle)
    return app
