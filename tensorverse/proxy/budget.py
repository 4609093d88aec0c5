"""What the shadows cost in GPU time, and the limits that spend it on the verdict.

A shadow runs on GPUs that cost money. Per shadow (``[[shadows]]``):

``gpus``
    the GPUs its server occupies (tensor x pipeline parallel size; default 1);
``gpu_seconds_per_day``
    at most this many GPU-seconds in any 24 hours (None: no budget). A turn is not started on a
    shadow whose last 24 hours reached it (counted: ``gpu_budget``).

And for all shadows, ``[capture] maintenance_per_minute``: once a shadow's verdict is decided
(``regression`` or ``equivalent``, from the verdict the admin listener keeps fresh), it runs at
most this many turns a minute (counted: ``maintenance``), enough to see the verdict change; 0
keeps its rate.

**What a GPU-second is here.** The wall time of each run's request to the shadow (the runs'
``timings.request_s``: forced and free) times ``gpus``. A server that batches several shadow
requests at once is charged for each of them, so the figure is an upper bound of the GPU time the
shadow used for Tensorverse; the probe and the wait for captured rows are not charged, nor are
turns that failed or timed out as a whole (their runs do not come back to the tee). With
``[verdict] gpu_price_per_hour`` the spend is also given in money.

**What it still needs.** :meth:`ShadowBudget.stats` gives each shadow's GPU-seconds per turn run
(since the proxy started); ``/verdict`` multiplies it by the turns the verdict still needs
(:func:`tensorverse.analysis.verdict.turns_to_run`): the GPU-seconds, and with a price the money,
an undecided shadow will take before it is decided if traffic and cost go on as they have.

Pure bookkeeping with an injected clock: the tee asks :meth:`ShadowBudget.reject_reason` before
a turn and calls :meth:`ShadowBudget.charge` after it, on the proxy's event loop.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from tensorverse.store.records import Run

__all__ = ["ShadowBudget", "DAY_S", "gpu_seconds_of"]

DAY_S = 86_400.0


def gpu_seconds_of(runs: Iterable[Run], gpus: int) -> float:
    """GPU-seconds of a shadow's runs: their requests' wall time times ``gpus``."""
    s = 0.0
    for r in runs:
        t = r.timings.get("request_s")
        if isinstance(t, (int, float)) and t > 0:
            s += float(t)
    return s * gpus


@dataclass
class ShadowBudget:
    """See the module docstring. ``gpus`` and ``per_day`` by shadow name; ``decided(name)``
    says whether its verdict is decided (set once the verdict is kept fresh)."""

    gpus: dict[str, int] = field(default_factory=dict)
    per_day: dict[str, float | None] = field(default_factory=dict)
    maintenance_per_minute: int = 0
    price_per_gpu_hour: float | None = None
    decided: Callable[[str], bool] = lambda name: False
    clock: Callable[[], float] = time.monotonic
    _spent: dict[str, deque] = field(default_factory=dict, repr=False)  # (t, gpu_seconds)
    _total: dict[str, float] = field(default_factory=dict, repr=False)
    _turns: dict[str, int] = field(default_factory=dict, repr=False)  # turns charged
    _recent: dict[str, deque] = field(default_factory=dict, repr=False)  # turn starts in maintenance

    def spent_today(self, name: str) -> float:
        """GPU-seconds charged to ``name`` in the last 24 hours."""
        q = self._spent.get(name)
        if not q:
            return 0.0
        now = self.clock()
        while q and now - q[0][0] >= DAY_S:
            q.popleft()
        return sum(s for _, s in q)

    def reject_reason(self, name: str) -> str | None:
        """None when a turn may start on ``name`` now (and, in maintenance, count it), else why not."""
        budget = self.per_day.get(name)
        if budget is not None and self.spent_today(name) >= budget:
            return "gpu_budget"
        if self.maintenance_per_minute and self.decided(name):
            q = self._recent.setdefault(name, deque())
            now = self.clock()
            while q and now - q[0] >= 60.0:
                q.popleft()
            if len(q) >= self.maintenance_per_minute:
                return "maintenance"
            q.append(now)
        return None

    def charge(self, name: str, runs: Iterable[Run]) -> float:
        """Charge ``name`` for its runs of one turn; returns the GPU-seconds charged."""
        s = gpu_seconds_of(runs, self.gpus.get(name, 1))
        self._turns[name] = self._turns.get(name, 0) + 1
        if s > 0:
            self._spent.setdefault(name, deque()).append((self.clock(), s))
            self._total[name] = self._total.get(name, 0.0) + s
        return s

    def cost(self, gpu_seconds: float) -> float | None:
        return None if self.price_per_gpu_hour is None else gpu_seconds / 3600.0 * self.price_per_gpu_hour

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per shadow: GPU-seconds in the last 24 h and since the proxy started, the turns charged
        and the GPU-seconds per turn, the budget, what is left of it, whether the verdict is
        decided, and the money with a price."""
        out = {}
        for name in dict.fromkeys([*self.gpus, *self.per_day, *self._total]):
            day = self.spent_today(name)
            budget = self.per_day.get(name)
            total = self._total.get(name, 0.0)
            turns = self._turns.get(name, 0)
            out[name] = {"gpus": self.gpus.get(name, 1), "gpu_seconds_day": round(day, 3),
                         "gpu_seconds_total": round(total, 3), "turns": turns,
                         "gpu_seconds_per_turn": round(total / turns, 6) if turns else None,
                         "budget_per_day": budget,
                         "budget_left": None if budget is None else round(max(0.0, budget - day), 3),
                         "decided": bool(self.decided(name)), "cost_total": self.cost(total)}
        return out
