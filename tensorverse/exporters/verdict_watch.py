"""The verdict kept fresh for the admin listener: ``/verdict`` and the ``tensorverse_verdict*`` gauges.

A verdict is computed from every comparison in the store (:mod:`tensorverse.analysis.verdict`):
too much work for a scrape, and never on the event loop that relays the agent's requests. So a
:class:`VerdictWatch` computes it in a worker thread (the admin app's background task calls
:meth:`VerdictWatch.refresh` every ``refresh_s``) and readers only ever take the last snapshot
(:meth:`VerdictWatch.snapshot`). A failed computation keeps the previous verdicts and records
the error; the age of the snapshot is exported, so a stale verdict is visible.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tensorverse.analysis.verdict import ShadowVerdict, VerdictPolicy, turns_to_run, verdicts, verdicts_json

__all__ = ["VerdictWatch", "VerdictSnapshot", "DECIDED", "still_needed"]

#: verdicts after which a shadow only needs watching (`[capture] maintenance_per_minute`)
DECIDED = ("regression", "equivalent")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerdictSnapshot:
    computed_ns: int | None = None  # None: not computed yet
    seconds: float | None = None  # how long the computation took
    verdicts: list[ShadowVerdict] = field(default_factory=list)
    error: str | None = None

    def as_dict(self, policy: VerdictPolicy, spend: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """JSON-ready; ``spend``: the shadows' GPU time and money (`tensorverse.proxy.budget`),
        to which each shadow's projection is added: ``gpu_seconds_needed`` (and ``cost_needed``
        with a price), what it still takes to decide its verdict (:func:`still_needed`)."""
        out = {"computed_ns": self.computed_ns, "seconds": self.seconds, "error": self.error,
               **verdicts_json(self.verdicts, policy)}
        if spend is not None:
            by_backend = {v.backend: v for v in self.verdicts}
            out["gpu"] = {name: {**g, **still_needed(by_backend.get(name), g)} for name, g in spend.items()}
        return out

    def decided(self, backend: str) -> bool:
        """Whether ``backend``'s verdict is decided (``regression`` or ``equivalent``)."""
        return any(v.backend == backend and v.decision in DECIDED for v in self.verdicts)


def still_needed(v: ShadowVerdict | None, spend: Mapping[str, Any]) -> dict[str, float | None]:
    """A shadow's GPU-seconds (and money, when ``spend`` has it) still needed to decide its
    verdict: the turns it still runs (`tensorverse.analysis.verdict.turns_to_run`) at its
    GPU-seconds per turn so far; None where either is unknown."""
    turns = turns_to_run(v) if v is not None else None
    per_turn = spend.get("gpu_seconds_per_turn")
    seconds = None if turns is None or per_turn is None else (0.0 if turns == 0 else turns * float(per_turn))
    total, cost = spend.get("gpu_seconds_total"), spend.get("cost_total")
    money = None
    if seconds is not None and cost is not None:
        money = 0.0 if seconds == 0 else (cost / total * seconds if total else None)
    return {"gpu_seconds_needed": None if seconds is None else round(seconds, 3), "cost_needed": money}


class VerdictWatch:
    def __init__(self, store: Any, policy: VerdictPolicy | None = None, refresh_s: float = 60.0,
                 backends: Mapping[str, str] | None = None) -> None:
        self.store = store
        self.backends = dict(backends or {})  # the configured shadows: judged from their first turn
        self.policy = policy if policy is not None else VerdictPolicy()
        self.refresh_s = float(refresh_s)
        self._lock = threading.Lock()
        self._busy = threading.Lock()
        self._snap = VerdictSnapshot()
        from tensorverse.exporters.comparison_rows import StoreRows

        self._rows = StoreRows(store)  # each comparison decoded once, across refreshes
        #: the shadows' GPU spend for ``/verdict`` (set by the proxy: `ShadowBudget.stats`)
        self.spend: Callable[[], Mapping[str, Any]] | None = None

    def decided(self, backend: str) -> bool:
        """Whether the last snapshot decided ``backend`` (for the maintenance rate)."""
        return self.snapshot().decided(backend)

    def as_dict(self) -> dict[str, Any]:
        """``/verdict``: the last snapshot, with the shadows' GPU spend when the proxy tracks it."""
        return self.snapshot().as_dict(self.policy, self.spend() if self.spend is not None else None)

    def wait_idle(self) -> None:
        """Block until a computation in progress (in another thread) is over: before the store closes."""
        with self._busy:
            pass

    def snapshot(self) -> VerdictSnapshot:
        with self._lock:
            return self._snap

    def refresh(self) -> VerdictSnapshot:
        """Recompute now (blocking: call from a worker thread). One computation at a time."""
        with self._busy:
            t0 = time.perf_counter()
            try:
                vs = verdicts(self._rows.rows(), self.policy, known=self.backends)
                snap = VerdictSnapshot(computed_ns=time.time_ns(), seconds=time.perf_counter() - t0, verdicts=vs)
            except Exception as e:  # noqa: BLE001 - a verdict failure must not take the admin down
                log.warning("verdict: computation failed: %s", e)
                old = self.snapshot()
                snap = VerdictSnapshot(computed_ns=old.computed_ns, seconds=old.seconds, verdicts=old.verdicts,
                                       error=f"{type(e).__name__}: {e}")
            with self._lock:
                self._snap = snap
            return snap
