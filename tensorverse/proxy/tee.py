"""The shadow tee: selected turns go to the shadow backends, off the agent's path.

After the primary's response is complete (the hooks run in the background, see
`tensorverse.proxy.flow`), the capture policy decides whether the turn is shadowed. A selected
turn is put on a bounded queue without waiting: when the queue is full it is dropped and
counted. Workers take turns off the queue and call the shadow runner once per backend, each
under the backend's concurrency limit and timeout. Failures, timeouts and garbage from a shadow
are counted and logged; nothing reaches the agent.

The runner is any async callable ``runner(turn, backends, store, *, modes)`` (the shadow
runner's ``shadow_turn``); tests and benchmarks pass their own. With ``metrics`` (a
`tensorverse.exporters.metrics.Metrics`), the run records a runner returns and the comparisons
its ``finish`` returns (once stored) update the Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence

from tensorverse.proxy.budget import ShadowBudget
from tensorverse.proxy.flow import OK, Addon, Flow, worth_logging
from tensorverse.shadow.runner import ROWS_TIMEOUT_S
from tensorverse.store.records import Comparison, Run, Turn

log = logging.getLogger("tensorverse.proxy.tee")


class TurnShadower(Protocol):
    """What the tee calls to shadow one turn on some backends (`PackageRunner` in production, a
    plain coroutine function in tests)."""

    def __call__(self, turn: Turn, backends: Sequence[Any], store: Any, *, modes: Sequence[str]) -> Awaitable[Any]: ...


@dataclass
class CapturePolicy:
    """Which turns are shadowed (config section ``[capture]``)."""

    enabled: bool = True
    only_with_tools: bool = False
    sample: float = 1.0
    per_minute: int = 0
    endpoints: tuple[str, ...] = ("chat.completions", "completions")
    rng: Callable[[], float] = random.random
    clock: Callable[[], float] = time.monotonic
    _recent: deque = field(default_factory=deque, repr=False)

    @classmethod
    def from_config(cls, capture: Any, **kw: Any) -> "CapturePolicy":
        return cls(
            enabled=capture.enabled,
            only_with_tools=capture.only_with_tools,
            sample=capture.sample,
            per_minute=capture.per_minute,
            endpoints=tuple(capture.endpoints),
            **kw,
        )

    def reject_reason(self, flow: Flow, turn: Turn | None) -> str | None:
        """None when the turn is selected, else why not (a counter name)."""
        if not self.enabled:
            return "disabled"
        if turn is None or flow.state != OK:
            return "not_ok"
        if flow.kind not in self.endpoints:
            return "endpoint"
        if turn.kind == "side":  # a title, summary or judge request: not the agent's turn
            return "side_request"
        if self.only_with_tools and not turn.tools_offered:
            return "no_tools"
        if not turn.prompt_token_ids or turn.output_token_ids is None:
            return "no_token_ids"
        if self.sample < 1.0 and self.rng() >= self.sample:
            return "sampled_out"
        if self.per_minute:
            now = self.clock()
            while self._recent and now - self._recent[0] >= 60.0:
                self._recent.popleft()
            if len(self._recent) >= self.per_minute:
                return "over_budget"
            self._recent.append(now)
        return None


@dataclass
class TeeBackend:
    """A shadow backend as the tee schedules it: the runner's backend object plus limits."""

    name: str
    backend: Any  # passed to the runner as is (tensorverse.shadow.backend.Backend)
    concurrency: int = 2
    timeout_s: float = 120.0  # per request to this backend (the runner's own timeout)
    modes: tuple[str, ...] | None = None
    _sem: asyncio.Semaphore | None = field(default=None, repr=False)

    def turn_deadline_s(self, modes: Sequence[str]) -> float:
        """The whole turn on this backend: a probe and one request per mode, each bounded by
        `timeout_s`, plus the wait for captured rows (at most the runner's, at most `timeout_s`).
        Cancelling earlier would lose run records."""
        return self.timeout_s * (len(modes) + 1) + min(ROWS_TIMEOUT_S, self.timeout_s)


class ShadowTee(Addon):
    name = "shadow"

    def __init__(
        self,
        runner: TurnShadower | None,
        backends: Sequence[TeeBackend],
        *,
        store: Any = None,
        policy: CapturePolicy | None = None,
        modes: Sequence[str] = ("forced", "free"),
        queue_size: int = 256,
        workers: int = 4,
        wait_for_turn_s: float = 30.0,
        metrics: Any = None,
        budget: ShadowBudget | None = None,
    ) -> None:
        self.runner = runner
        self.metrics = metrics
        self.backends = list(backends)
        self.store = store
        self.policy = policy or CapturePolicy()
        self.modes = tuple(modes)
        self.queue_size = queue_size
        self.n_workers = workers
        self.wait_for_turn_s = wait_for_turn_s
        #: GPU-seconds per shadow and the maintenance rate once decided (`tensorverse.proxy.budget`)
        self.budget = budget
        self._queue: asyncio.Queue | None = None
        self._workers: list[asyncio.Task] = []
        self._busy_since: dict[int, float] = {}  # worker -> when its turn began (the busy time so far counts)
        self.counters: dict[str, Any] = {
            "queued": 0,
            "dropped_queue_full": 0,
            "skipped": {},
            "turns_done": 0,
            "busy_s": 0.0,  # worker-seconds spent on turns: over workers x wall time, the pipeline's load
            "backend": {b.name: {"ok": 0, "failed": 0, "timed_out": 0} for b in self.backends},
        }

    def stats(self) -> dict[str, Any]:
        busy = self.counters["busy_s"] + sum(time.monotonic() - t0 for t0 in self._busy_since.values())
        out = {**self.counters, "busy_s": round(busy, 3), "workers": self.n_workers if self._workers else 0,
               "queue_depth": self._queue.qsize() if self._queue else 0, "queue_size": self.queue_size}
        if self.budget is not None:
            out["gpu"] = self.budget.stats()
        return out

    async def start(self) -> None:
        self._queue = asyncio.Queue(maxsize=self.queue_size)
        for b in self.backends:
            b._sem = asyncio.Semaphore(b.concurrency)
        if self.runner is not None and self.backends:
            self._workers = [asyncio.get_running_loop().create_task(self._work(i)) for i in range(self.n_workers)]

    async def stop(self) -> None:
        close = getattr(self.runner, "close", None)
        for w in self._workers:
            w.cancel()
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        if close is not None:
            try:
                await close()
            except Exception:
                log.exception("shadow runner failed to close")

    async def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued turn is done (tests, shutdown); True if it emptied in time."""
        if self._queue is None:
            return True
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # -- the primary's side: never waits ----------------------------------------------------------
    async def response_done(self, flow: Flow) -> None:
        if self.runner is None or not self.backends or self._queue is None:
            return
        turn = flow.turn
        reason = self.policy.reject_reason(flow, turn)
        if reason is not None:
            skipped = self.counters["skipped"]
            skipped[reason] = skipped.get(reason, 0) + 1
            return
        try:
            self._queue.put_nowait((turn, flow.turn_future))
        except asyncio.QueueFull:
            self.counters["dropped_queue_full"] += 1
            n = self.counters["dropped_queue_full"]
            if worth_logging(n):
                log.warning("shadow queue full (%d): dropped turn %s (%d dropped so far)",
                            self.queue_size, turn.id if turn is not None else None, n)
            return
        self.counters["queued"] += 1

    # -- the shadows' side ------------------------------------------------------------------------
    async def _work(self, worker: int) -> None:
        assert self._queue is not None
        while True:
            turn, fut = await self._queue.get()
            self._busy_since[worker] = t0 = time.monotonic()
            try:
                await self._process(turn, fut)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("shadow tee: turn %s failed", turn.id)
            finally:
                del self._busy_since[worker]
                self.counters["busy_s"] += time.monotonic() - t0
                self._queue.task_done()

    async def _process(self, turn: Turn, fut: Any) -> None:
        if fut is not None and not fut.done():  # the turn must be committed before runs refer to it
            try:
                async with asyncio.timeout(self.wait_for_turn_s):  # no extra task, unlike wait_for
                    await asyncio.wrap_future(fut)
            except Exception:  # noqa: BLE001 - store full/failed: shadow anyway, results may not store
                pass
        if len(self.backends) == 1:
            await self._run_one(turn, self.backends[0])
        else:
            await asyncio.gather(*(self._run_one(turn, b) for b in self.backends))
        finish = getattr(self.runner, "finish", None)
        if finish is not None:  # e.g. compare the turn's runs once all backends are done
            try:
                results = await finish(turn, self.store)
            except Exception as e:  # noqa: BLE001
                log.warning("shadow tee: finishing turn %s failed: %s", turn.id, e)
            else:
                if self.metrics is not None:
                    try:  # the comparisons, stored by now
                        self.metrics.observe_comparisons(results)
                    except Exception:
                        log.exception("shadow tee: metrics of turn %s", turn.id)
        self.counters["turns_done"] += 1

    async def _run_one(self, turn: Turn, b: TeeBackend) -> None:
        c = self.counters["backend"][b.name]
        assert b._sem is not None and self.runner is not None
        if self.budget is not None:
            why = self.budget.reject_reason(b.name)
            if why is not None:  # over its GPU budget, or decided and at its maintenance rate
                c[why] = c.get(why, 0) + 1
                return
        async with b._sem:
            try:
                modes = b.modes or self.modes
                deadline = b.turn_deadline_s(modes)
                async with asyncio.timeout(deadline):  # no extra task, unlike wait_for
                    runs = await self.runner(turn, [b.backend], self.store, modes=modes)
                c["ok"] += 1
                recs = [r for r in runs if isinstance(r, Run)] if isinstance(runs, list) else []
                if self.budget is not None and recs:
                    self.budget.charge(b.name, (r for r in recs if r.mode in ("forced", "free")))
                if self.metrics is not None and recs:
                    try:
                        self.metrics.observe_runs(recs)
                    except Exception:
                        log.exception("shadow tee: metrics of %s runs", b.name)
            except asyncio.TimeoutError:
                c["timed_out"] += 1
                log.warning("shadow %s: turn %s timed out after %.1f s", b.name, turn.id, deadline)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - shadow failures never surface
                c["failed"] += 1
                log.warning("shadow %s: turn %s failed: %s: %s", b.name, turn.id, type(e).__name__, e)


def _backend(sb: Any, *, recorded_k: int, topk_only: bool = False) -> Any:
    """``recorded_k``: ``[recording] top_logprobs``, the default of ``captured_logprobs``."""
    from tensorverse.shadow.backend import Backend

    return Backend(
        name=sb.name,
        url=sb.url,
        model=sb.model,
        api_key=sb.resolved_api_key(),
        role=sb.role,
        timeout_s=sb.timeout_s,
        capture="topk" if topk_only else sb.capture,
        concurrency=sb.concurrency,
        logprobs=sb.logprobs,
        captured_logprobs=sb.captured_logprobs if sb.captured_logprobs is not None else max(1, recorded_k),
        headers=dict(sb.headers),
    )


def budget_from_config(cfg: Any) -> ShadowBudget:
    """The shadows' GPU bookkeeping: ``[[shadows]] gpus``, ``gpu_seconds_per_day``, ``[capture]
    maintenance_per_minute``, ``[verdict] gpu_price_per_hour`` (`tensorverse.proxy.budget`)."""
    shadows = cfg.selected_backends()
    return ShadowBudget(gpus={s.name: s.gpus for s in shadows},
                        per_day={s.name: s.gpu_seconds_per_day for s in shadows},
                        maintenance_per_minute=cfg.capture.maintenance_per_minute,
                        price_per_gpu_hour=cfg.verdict.gpu_price_per_hour)


def tee_backends_from_config(cfg: Any) -> list[TeeBackend]:
    """The configured shadows (those `capture.backends` selects) as tee backends, with the shadow
    runner's `Backend` objects (their own credentials: never the client's)."""
    topk = cfg.capture.logits == "topk"
    return [
        TeeBackend(sb.name, _backend(sb, topk_only=topk, recorded_k=cfg.recording.top_logprobs),
                   sb.concurrency, sb.timeout_s,
                   tuple(sb.modes) if sb.modes else None)
        for sb in cfg.selected_backends()
    ]


class PackageRunner:
    """The tee's runner over `tensorverse.shadow.runner.ShadowRunner`: one runner for the
    process (it caches each backend's capabilities and tokenizer fingerprint), called once per
    (turn, backend); `finish` compares the turn's runs once every backend is done."""

    def __init__(self, store: Any, backends: Sequence[Any], primary: Any = None, *, metrics: Any = None,
                 workers: Any = None, **kwargs: Any) -> None:
        from tensorverse.shadow.runner import ShadowRunner

        self._runner = ShadowRunner(store, list(backends), primary=primary, **kwargs)
        self.metrics = metrics
        # the proxy's analysis workers (`tensorverse.shadow.analysis_workers`): comparisons off
        # the relay's GIL; None: in a thread
        self.workers = workers

    async def __call__(self, turn: Turn, backends: Sequence[Any], store: Any, *, modes: Sequence[str]) -> list[Run]:
        runs = await self._runner.run_turn(turn, modes=modes, backends=list(backends))
        bad = [r for r in runs[1:] if r.status != "ok"]
        if bad and len(bad) == len(runs) - 1:
            if self.metrics is not None:  # the tee counts this turn as failed and sees no runs
                self.metrics.observe_runs(runs)
            raise RuntimeError("; ".join(f"{r.mode}: {r.status} {r.error or ''}".strip()
                                         for r in bad))
        return runs

    async def finish(self, turn: Turn, store: Any) -> list[Comparison]:
        """Compare (and store) the turn's runs; returns the comparisons (a free one holds the
        ``region`` of its divergence, for the flip metrics), and counts the runs' missing rows."""
        if self.workers is None:
            return await asyncio.to_thread(self._compare, store, turn.id)
        from tensorverse.shadow.compare import put_comparisons

        results = await self.workers.compare(store, turn.id)
        await asyncio.to_thread(put_comparisons, store, results)
        return await asyncio.to_thread(self._observe, store, turn.id, results)

    def _compare(self, store: Any, turn_id: str) -> list[Comparison]:
        from tensorverse.shadow.compare import compare_turn

        return self._observe(store, turn_id, compare_turn(store, turn_id))

    def _observe(self, store: Any, turn_id: str, results: list[Comparison]) -> list[Comparison]:
        """The proxy's metrics of a compared turn that the comparisons do not hold: the primary's
        parser check, rows that never arrived."""
        from tensorverse.shadow.runs import primary_run_id

        if self.metrics is not None:
            try:  # the primary's parser check (issue 19), once per turn
                self.metrics.observe_parser_check(store.get_run(primary_run_id(turn_id)))
            except KeyError:
                pass

            compared = {r.run_id for r in results}
            runs = [r for r in store.iter_runs(turn_id) if r.id in compared]
            self.metrics.observe_missing_rows(runs)
        return results

    async def close(self) -> None:
        await self._runner.close()


def runner_from_config(cfg: Any, store: Any, tee_backends: Sequence[TeeBackend], *, metrics: Any = None,
                       analysis: Any = None) -> Any:
    """The shadow package's runner for this configuration (None when it is not installed)."""
    try:
        from tensorverse.shadow.backend import Backend
    except ImportError:  # pragma: no cover
        return None
    primary = Backend(name=cfg.primary.name, url=cfg.primary.url, role="primary",
                      api_key=cfg.primary.resolved_api_key())
    positions = None if cfg.capture.positions == "all" else cfg.capture.positions
    evidence = None
    if cfg.capture.logits == "evidence":
        from tensorverse.shadow.evidence import SourceEvidence

        r = cfg.retention
        evidence = SourceEvidence(k=r.topk, close_nats=r.close_nats, close_share=r.close_share,
                                  sample=r.sample, seed=r.seed)
    try:
        return PackageRunner(store, [b.backend for b in tee_backends], primary, metrics=metrics,
                             forced_positions=positions, free_positions=positions,
                             workers=analysis, evidence=evidence)
    except ImportError:  # pragma: no cover
        log.warning("the shadow runner is not available: shadows are not run")
        return None
