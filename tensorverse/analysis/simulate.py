"""Clustered turn streams for proving the verdict's error rates by simulation (docs/verdict.md).

Real flips cluster: most turns of a shadow flip nowhere, a few hard turns (small margins, hard
contexts) flip many times, and the noise floor is hard on the same turns. :class:`Clustered`
draws such turns: each turn has ``positions`` uniform in ``[min_positions, max_positions]``; a
fraction ``hard`` of turns is hard, with a per-position flip rate drawn from a Beta of mean
``hard_rate`` (``concentration`` = a + b), shared by the shadow and the floor; easy turns flip at
``easy_rate``. A turn calls a tool with probability ``tool_call``; it breaks with probability
``break_hard`` on hard turns, ``break_easy`` on easy ones, for the shadow and the floor alike.
The shadow adds ``flip_excess`` (per position, on hard turns only, at a rate drawn per turn from a
Beta of mean ``flip_excess / hard`` and the same concentration, so the mean excess over turns is
``flip_excess``: the runtime's flips cluster in the hard turns as the noise's do) and ``break_excess`` (a break probability added on every
tool-calling turn). With both excesses 0 the shadow is noise-only (A/A).

:func:`fit` takes the parameters from real turns (:class:`tensorverse.analysis.verdict.TurnEvidence`
of a store): the fraction of turns with a flip, their mean flip rate, positions, tool-calling
share, break rates. Pure (numpy Generator in, arrays out).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from tensorverse.analysis.verdict import TurnEvidence

__all__ = ["Clustered", "Stream", "draw", "fit"]


@dataclass(frozen=True)
class Clustered:
    hard: float = 0.2
    hard_rate: float = 0.05
    concentration: float = 20.0
    easy_rate: float = 0.0
    min_positions: int = 50
    max_positions: int = 300
    tool_call: float = 0.6
    break_hard: float = 0.3
    break_easy: float = 0.005
    flip_excess: float = 0.0
    break_excess: float = 0.0

    def with_excess(self, *, flips: float = 0.0, breaks: float = 0.0) -> "Clustered":
        return replace(self, flip_excess=flips, break_excess=breaks)


@dataclass(frozen=True)
class Stream:
    """One simulated watch: per turn, the shadow's and the floor's counts."""

    positions: np.ndarray
    flips: np.ndarray
    floor_flips: np.ndarray
    tool_call: np.ndarray  # bool
    broke: np.ndarray  # bool
    floor_broke: np.ndarray  # bool
    hard: np.ndarray  # bool

    def flip_excess(self) -> np.ndarray:
        return (self.flips - self.floor_flips) / self.positions

    def break_excess(self) -> np.ndarray:
        t = self.tool_call
        return self.broke[t].astype(np.float64) - self.floor_broke[t].astype(np.float64)


def draw(p: Clustered, turns: int, rng: np.random.Generator) -> Stream:
    n = rng.integers(p.min_positions, p.max_positions + 1, size=turns)
    hard = rng.random(turns) < p.hard
    a = p.hard_rate * p.concentration
    b = (1.0 - p.hard_rate) * p.concentration
    rate = np.where(hard, rng.beta(a, b, size=turns) if a > 0 else 0.0, p.easy_rate)
    extra = np.zeros(turns)
    if p.flip_excess > 0 and p.hard > 0:
        mean = min(p.flip_excess / p.hard, 0.999)
        extra = np.where(hard, rng.beta(mean * p.concentration, (1 - mean) * p.concentration, size=turns), 0.0)
    cand_rate = np.clip(rate + extra, 0.0, 1.0)
    flips = rng.binomial(n, cand_rate)
    floor_flips = rng.binomial(n, rate)
    tc = rng.random(turns) < p.tool_call
    pb = np.where(hard, p.break_hard, p.break_easy)
    broke = rng.random(turns) < np.clip(pb + p.break_excess, 0.0, 1.0)
    floor_broke = rng.random(turns) < pb
    return Stream(n, flips, floor_flips, tc, broke, floor_broke, hard)


def fit(turns: Sequence[TurnEvidence], base: Clustered = Clustered()) -> Clustered:
    """Parameters of a noise-only shadow clustered like these real turns (excesses 0)."""
    forced = [(t.flips or 0, t.positions) for t in turns if t.positions]  # (flips, positions > 0)
    if not forced:
        return base
    rates = np.array([f / n for f, n in forced])
    hit = rates > 0
    pos = np.array([n for _, n in forced])
    tc = [t for t in turns if t.tool_call_turn and t.broke is not None]
    hard = float(hit.mean()) if hit.any() else base.hard
    hard_rate = float(rates[hit].mean()) if hit.any() else base.hard_rate
    tool_call = len(tc) / len(turns) if turns else base.tool_call
    return replace(base, hard=hard, hard_rate=hard_rate,
                   min_positions=int(pos.min()), max_positions=int(max(pos.max(), pos.min() + 1)),
                   tool_call=float(tool_call) or base.tool_call)
