"""Assemble the proxy from a `Config`: core + addons (sessions, recorder, injection, shadow tee)
+ the admin listener; and `run` it until SIGINT/SIGTERM (``tensorverse proxy --config FILE``).

SIGTERM/SIGINT stop the proxy gracefully (`Proxy.shutdown`): it stops accepting connections,
lets the primary streams in flight finish, records their turns, gives the shadow queue what is
left of the deadline (``TENSORVERSE_SHUTDOWN_DEADLINE_S``, default 30 s) and reports the shadow
work it drops (a log line and the ``tensorverse proxy stopped: {...}`` line on stdout); the store
commits everything submitted before it closes. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from typing import Any

import orjson
from aiohttp import web

from tensorverse.config import Config
from tensorverse.exporters.metrics import Metrics
from tensorverse.proxy.request_metrics import RequestMetrics
from tensorverse.proxy.admin import make_admin_app
from tensorverse.proxy.ingest import Ingest, IngestWorker
from tensorverse.proxy.core import ProxyCore
from tensorverse.proxy.inject import Injector
from tensorverse.proxy.recorder import Recorder
from tensorverse.proxy.sessions import Sessions
from tensorverse.proxy.tee import (CapturePolicy, ShadowTee, TurnShadower, budget_from_config, runner_from_config,
                                   tee_backends_from_config)
from tensorverse.store.records import BackendInfo

log = logging.getLogger("tensorverse.proxy")

DEFAULT_SHUTDOWN_DEADLINE_S = 30.0


class Proxy:
    """The whole proxy. ``await start()`` then ``await close()``; ``port``/``admin_port`` after start.

    ``store``: an open `tensorverse.store.Store` (default: opened from ``[store]``; pass one to
    share it, or ``False`` for none). ``runner``: the shadow runner (default: the shadow
    package's, `tensorverse.proxy.tee.PackageRunner`); ``tee_backends``: override the shadows.
    """

    def __init__(self, config: Config, *, store: Any = None, runner: TurnShadower | None = None,
                 tee_backends: list | None = None) -> None:
        self.config = config
        self._own_store = store is None
        if store is None:
            from tensorverse.store import Store

            store = Store.open(config.store.path, max_size=config.store.max_size_bytes, durable=config.store.durable)
        self.store = store or None
        c = config
        self.metrics = Metrics.from_config(c)  # Prometheus metrics, served on the admin listener
        self.sessions = Sessions(
            self.store,
            header=c.sessions.header,
            tags_header=c.sessions.tags_header,
            tags=c.sessions.tags,
            idle_timeout_s=c.sessions.idle_timeout_s,
            max_tracked=c.sessions.max_tracked,
            client_id_headers=c.sessions.client_id_headers,
        )
        addons: list[Any] = []
        if c.recording.enabled:
            self.recorder: Recorder | None = Recorder(
                self.store, primary=c.primary.name, redacted_headers=c.recording.redacted(),
                max_unparsed_bytes=c.recording.max_unparsed_bytes,
            )
            self.injector: Injector | None = Injector(
                return_token_ids=c.recording.return_token_ids, top_logprobs=c.recording.top_logprobs
            )
            addons += [self.sessions, self.recorder, self.injector]
        else:
            self.recorder = self.injector = None
        if tee_backends is None:
            tee_backends = tee_backends_from_config(c) if c.shadows else []
        # comparisons and compaction plans in worker processes, off the relay's GIL
        self.analysis: Any = None
        if self.store is not None and c.shadow.analysis_workers > 0 and getattr(self.store, "path", None):
            from tensorverse.shadow.analysis_workers import AnalysisWorkers

            self.analysis = AnalysisWorkers(self.store.path, c.shadow.analysis_workers)
        if runner is None and tee_backends and c.capture.enabled and c.recording.enabled:
            runner = runner_from_config(c, self.store, tee_backends, metrics=self.metrics, analysis=self.analysis)
        self.tee = ShadowTee(
            runner if c.capture.enabled else None,
            tee_backends,
            store=self.store,
            policy=CapturePolicy.from_config(c.capture),
            modes=c.capture.modes,
            queue_size=c.shadow.queue_size,
            workers=c.shadow.workers,
            metrics=self.metrics,
            budget=budget_from_config(c) if tee_backends else None,
        )
        if c.recording.enabled and tee_backends:
            if runner is None:
                log.warning("no shadow runner available: %d shadow backend(s) configured but not run",
                            len(tee_backends))
            addons.append(self.tee)
        addons.append(RequestMetrics(self.metrics))  # last: its request hook times the others too
        self.core = ProxyCore(
            c.primary.url,
            addons,
            max_body_bytes=c.proxy.max_body_bytes,
            connect_timeout_s=c.proxy.connect_timeout_s,
            read_timeout_s=c.proxy.read_timeout_s,
            upstream_prefix=c.proxy.upstream_prefix,
            max_connections=c.proxy.max_connections,
            head_timeout_s=c.proxy.head_timeout_s,
            body_timeout_s=c.proxy.body_timeout_s,
            max_client_connections=c.proxy.max_client_connections,
            strip_header_prefixes=("x-tensorverse-",) if c.proxy.strip_tensorverse_headers else (),
        )
        # captured frames stored in a worker process, off the relay's GIL ([admin] ingest_process)
        worker = None
        if self.store is not None and c.admin.ingest_process and getattr(self.store, "path", None):
            worker = IngestWorker(self.store.path, max_size=getattr(self.store, "max_size", None),
                                  durable=getattr(self.store, "durable", c.store.durable))
        self.ingest = Ingest(self.store, c.admin.resolved_token(), max_bytes=c.admin.max_ingest_bytes,
                             worker=worker)
        self._admin_runner: web.AppRunner | None = None
        self.retention = None
        self._retention_task: asyncio.Task | None = None
        if self.store is not None and (c.retention.enabled or c.retention.compact):
            from tensorverse.store.retention import RetentionKeeper, RetentionPolicy

            self.retention = RetentionKeeper(self.store, RetentionPolicy(
                max_age_s=c.retention.max_age_seconds(), max_bytes=c.retention.max_bytes_value()),
                c.retention.interval_s, evidence=c.retention.evidence_policy(),
                planner=self.analysis.planner(self.store) if self.analysis is not None else None)
        self.port: int | None = None
        self.admin_port: int | None = None

    def stats(self) -> dict[str, Any]:
        s = self.core.stats()
        s["ingest"] = self.ingest.stats()
        s["in_flight"] = self.core.in_flight
        if self.retention is not None:
            s["retention"] = self.retention.stats()
        if self.analysis is not None:
            s["analysis"] = dict(self.analysis.counters)
        return s

    async def _keep_retention(self) -> None:
        """[retention]: compact and prune in a worker thread when due (never on the relay's loop)."""
        loop = asyncio.get_running_loop()
        keeper = self.retention
        assert keeper is not None  # the task is started only with a keeper
        while True:
            if keeper.due():
                await loop.run_in_executor(None, keeper.run_once)
            await asyncio.sleep(min(5.0, keeper.interval_s))

    async def start(self) -> None:
        c = self.config
        if self.store is not None:
            await self._register_backends()
        self.port = await self.core.start(c.proxy.host, c.proxy.port)
        if self.retention is not None:
            self._retention_task = asyncio.get_running_loop().create_task(self._keep_retention())
        if c.admin.enabled:
            watch = None
            if self.store is not None:
                from tensorverse.exporters.verdict_watch import VerdictWatch

                watch = VerdictWatch(self.store, c.verdict.policy(), c.verdict.refresh_s,
                                     backends={b.name: b.role for b in c.selected_backends()})
                if self.tee.budget is not None:  # decided shadows drop to the maintenance rate
                    self.tee.budget.decided = watch.decided
                    watch.spend = self.tee.budget.stats
            self._admin_runner = web.AppRunner(make_admin_app(self.stats, self.ingest, metrics=self.metrics,
                                                            store=self.store, verdict=watch), access_log=None)
            await self._admin_runner.setup()
            site = web.TCPSite(self._admin_runner, c.admin.host, c.admin.port)
            await site.start()
            sockets = getattr(site._server, "sockets", None)  # an asyncio Server's listening sockets
            self.admin_port = sockets[0].getsockname()[1] if sockets else c.admin.port
        if c.admin.resolved_token() is None:
            log.info("admin token not set: the capture ingest endpoint is disabled")
        log.info("tensorverse proxy on %s:%s -> %s (admin %s:%s, store %s, %d shadow(s))",
                 c.proxy.host, self.port, c.primary.url, c.admin.host, self.admin_port, c.store.path,
                 len(self.tee.backends))

    async def _register_backends(self) -> None:
        """Backend records (never credentials): the shadow runner finds the primary's URL here
        for its tokenizer check, and the viewer labels lanes with roles and settings."""
        c = self.config
        backends = [BackendInfo(name=c.primary.name, url=c.primary.url, role="primary",
                                settings=dict(c.primary.settings))]
        backends += [BackendInfo(name=s.name, url=s.url, role=s.role, model=s.model) for s in c.shadows]
        store = self.store
        if store is None:
            return
        try:
            for info in backends:
                await asyncio.wrap_future(store.put_backend(info.name, info))
        except Exception as e:  # noqa: BLE001 - a full or broken store never stops the proxy
            log.warning("could not record backends in the store: %s", e)

    async def shutdown(self, deadline_s: float = DEFAULT_SHUTDOWN_DEADLINE_S) -> dict[str, Any]:
        """Graceful stop within ``deadline_s``: no new connections; primary streams in flight
        finish; their turns are recorded; queued shadow work runs in what is left of the
        deadline, and what does not is dropped and reported. Returns the report."""
        t0 = time.monotonic()
        left = lambda: max(0.0, deadline_s - (time.monotonic() - t0))  # noqa: E731
        self.core.stop_listening()  # the listening socket closes: new connections are refused
        in_flight = self.core.in_flight
        streams_done = await self.core.wait_idle(left())
        await self.core.drain(left())  # background hooks: turns recorded, shadow work queued
        tee = self.tee.stats()
        shadow_done = await self.tee.drain(left()) if self.tee.runner is not None else True
        tee = self.tee.stats()
        dropped = max(0, tee["queued"] - tee["turns_done"]) if self.tee.runner is not None else 0
        report = {"in_flight_at_signal": in_flight, "streams_finished": streams_done,
                  "streams_cut": self.core.in_flight, "shadow_drained": shadow_done,
                  "shadow_dropped_at_shutdown": dropped,
                  "shadow_dropped_queue_full": tee["dropped_queue_full"], "shadow_queued": tee["queued"],
                  "shadow_skipped": sum(tee["skipped"].values()),
                  "shadow_turns_done": tee["turns_done"], "seconds": round(time.monotonic() - t0, 3)}
        if dropped:
            log.warning("shutdown: %d queued shadow turn(s) dropped (deadline %.0f s)", dropped, deadline_s)
        await self.close(max(left(), 0.1))  # streams still running past the deadline are cut then
        self.shutdown_report = report
        return report

    async def close(self, timeout: float = 5.0) -> None:
        """Stop; requests still in flight after ``timeout`` seconds are cut."""
        await self.core.close(timeout)
        if self._retention_task is not None:
            self._retention_task.cancel()
            try:
                await self._retention_task
            except asyncio.CancelledError:
                pass
            self._retention_task = None
            if self.retention is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.retention.wait_idle)
        if self.analysis is not None:  # after the tee and the keeper: nothing asks it any more
            await asyncio.get_running_loop().run_in_executor(None, self.analysis.close)
            self.analysis = None
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        await asyncio.get_running_loop().run_in_executor(None, self.ingest.close)  # no body in flight now
        if self._own_store and self.store is not None:
            self.store.close()
            self.store = None


# Garbage collector thresholds of a proxy process. Each stream's parsed events and each turn are
# thousands of small containers that live for the whole stream (or, for shadowed turns, until the
# shadows ran), so with Python's defaults (700, 10, 10) the collector runs every few events and
# repeatedly walks everything that is in flight: measured at half the proxy's CPU at 200
# concurrent streams. Young collections every 50k allocations and rare full ones cost a few %.
GC_THRESHOLDS = (50_000, 50, 100)


def tune_runtime(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Process-wide settings for a process that runs the proxy (`serve` calls it; so does the
    overhead benchmark): the objects of the startup (modules, configuration) are moved out of
    the collector's way (`gc.freeze`) and the collection thresholds raised. Cycles are still
    collected. The soft limit on open files is raised to the hard one, so that the client
    connection cap (``proxy.max_client_connections``), not the file table, bounds connections."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):  # no such limit here, or not ours to change
        log.info("the open-files limit stays as it is")


def shutdown_deadline_s() -> float:
    try:
        return float(os.environ.get("TENSORVERSE_SHUTDOWN_DEADLINE_S", DEFAULT_SHUTDOWN_DEADLINE_S))
    except ValueError:
        return DEFAULT_SHUTDOWN_DEADLINE_S


async def serve(config: Config) -> None:
    proxy = Proxy(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals > 1 and task is not None:  # a second signal: stop now
            task.cancel()

    task: asyncio.Task | None = None
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
            pass
    await proxy.start()
    tune_runtime()
    print(f"tensorverse proxy listening on {config.proxy.host}:{proxy.port} -> {config.primary.url}", flush=True)
    try:
        await stop.wait()
        log.info("stopping: draining in-flight requests and shadow work (deadline %.0f s)", shutdown_deadline_s())
        task = asyncio.ensure_future(proxy.shutdown(shutdown_deadline_s()))
        report = await task
        print("tensorverse proxy stopped: " + orjson.dumps(report).decode(), flush=True)
    except asyncio.CancelledError:
        log.warning("stopped at once (second signal)")
    finally:
        await proxy.close()  # a no-op after a completed shutdown


def run(config: Config) -> int:
    from tensorverse.proxy.loop import run as run_on_proxy_loop

    run_on_proxy_loop(serve(config))
    return 0
