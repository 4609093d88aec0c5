"""Anytime-valid bounds on a mean excess: betting confidence sequences (docs/verdict.md).

The verdict (:mod:`tensorverse.analysis.verdict`) watches, turn after turn, one number per turn:
a shadow's excess over the noise floor at that turn (a tool-call break minus the secondary's, a
turn's excess flip rate), a value in [-1, 1]. It must stay valid when a user looks after every
turn for weeks, so a fixed-sample interval will not do. This module turns such a stream into

* a **lower bound** ``low``: with probability at least ``confidence``, ``low`` never exceeds the
  true mean excess, at any time of the watch (however often it is looked at);
* an **upper bound** ``high``: the same from above;

by testing every candidate mean ``m`` with a nonnegative martingale (a gambler's wealth, Ville's
inequality) and keeping the values not rejected. The method is the *betting confidence sequence*
of Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting" (JRSS-B
2024), one side at a time, with their aGRAPA bets (an approximation of the growth-rate-optimal
Kelly bet, from the data before each turn only) truncated at ``TRUNCATION`` of the largest bet
that keeps the wealth positive. Observations are mapped from [-1, 1] to [0, 1] (``x = (y+1)/2``).

For the lower side and a candidate mean ``m`` (on the [0, 1] scale)::

    wealth_t(m) = prod_{i<=t} (1 + lam_i(m) * (x_i - m)),
    lam_i(m)    = clip((mu_{i-1} - m) / (var_{i-1} + (mu_{i-1} - m)^2), 0, TRUNCATION / m)

with ``mu`` and ``var`` the running mean and variance regularised by one pseudo-observation
(``mu_0 = 1/2``, ``var_0 = 1/4``). Under any stream whose conditional means are all <= ``m``
(whatever their dependence: flips that cluster in a turn, turns that cluster in a session) the
wealth is a nonnegative supermartingale from 1, so the chance it ever reaches ``1/alpha`` is at
most ``alpha``. ``low`` is the largest value below which every candidate tried is rejected (a
grid of steps of 0.025, then bisection to 4e-7). The upper side bets the other way. Both sides use the same ``alpha`` = 1 - confidence.

Why not the maintained package: ``confseq`` (the authors' own, last released 2023) builds a C++
extension against pybind11 2.6 and pulls matplotlib; the part used here is the product above.
It is tested against a plain-loop implementation of the same formulas and by simulation
(coverage at every look, ``benchmarks/verdict.py``).

Pure functions, numpy only, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["TRUNCATION", "Bounds", "log_wealth", "log_wealth_path", "bounds", "grid_bounds", "turns_to_cross", "rejects"]

TRUNCATION = 0.75  # of the largest bet that keeps the wealth positive
_GRID = 81  # candidate means on the excess scale (-1..1, steps of 0.025), then bisection
_BISECT = 16  # halvings between the last rejected and the first kept value: 4e-7


@dataclass(frozen=True)
class Bounds:
    """Anytime-valid bounds on the mean excess (scale -1..1) after ``n`` observations."""

    n: int
    estimate: float | None  # the plain mean of the observations (None: none yet)
    low: float
    high: float
    log_wealth_zero: float  # the lower side's log-wealth against "excess <= 0"


def _to_unit(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 1:
        raise ValueError("observations must be one-dimensional")
    if y.size and (not np.all(np.isfinite(y)) or y.min() < -1 or y.max() > 1):
        raise ValueError("observations must lie in [-1, 1]")
    return (y + 1.0) / 2.0


def _predictable_moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mu_{i-1} and var_{i-1} for i = 1..t: each from the observations before it only."""
    t = x.size
    k = np.arange(1, t + 1, dtype=np.float64)
    mu = (0.5 + np.cumsum(x)) / (k + 1)  # mu_i after i observations
    mu_prev = np.concatenate(([0.5], mu[:-1]))
    dev = (x - mu_prev) ** 2
    var = (0.25 + np.cumsum(dev)) / (k + 1)
    var_prev = np.concatenate(([0.25], var[:-1]))
    return mu_prev, var_prev


def log_wealth_path(y: np.ndarray, m_excess: float, side: str) -> np.ndarray:
    """The log-wealth after each observation (one candidate mean): the test at every look."""
    x = _to_unit(y)
    if x.size == 0:
        return np.zeros(0)
    m = (float(m_excess) + 1.0) / 2.0
    mu, var = _predictable_moments(x)
    d = mu - m
    lam = d / (var + d * d)
    if side == "lower":
        f = 1.0 + np.clip(lam, 0.0, TRUNCATION / max(m, 1e-12)) * (x - m)
    elif side == "upper":
        f = 1.0 - np.clip(-lam, 0.0, TRUNCATION / max(1.0 - m, 1e-12)) * (x - m)
    else:
        raise ValueError("side is 'lower' or 'upper'")
    return np.cumsum(np.log(f))


def log_wealth(y: np.ndarray, m_excess: np.ndarray | float, side: str) -> np.ndarray:
    """The gambler's log-wealth after the whole stream, for each candidate mean (excess scale).

    ``side="lower"`` bets that the mean is above ``m`` (large wealth rejects "mean <= m"),
    ``side="upper"`` that it is below."""
    if side not in ("lower", "upper"):
        raise ValueError("side is 'lower' or 'upper'")
    x = _to_unit(y)
    m = (np.atleast_1d(np.asarray(m_excess, dtype=np.float64)) + 1.0) / 2.0
    if x.size == 0:
        return np.zeros(m.shape)
    mu, var = _predictable_moments(x)
    out = np.zeros(m.shape)
    step = max(1, 4_000_000 // max(1, x.size))  # bounded memory: columns of m at a time
    for j in range(0, m.size, step):
        mm = m[j:j + step][None, :]
        d = mu[:, None] - mm
        lam = d / (var[:, None] + d * d)
        if side == "lower":
            cap = TRUNCATION / np.maximum(mm, 1e-12)
            lam = np.clip(lam, 0.0, cap)
            f = 1.0 + lam * (x[:, None] - mm)
        else:
            cap = TRUNCATION / np.maximum(1.0 - mm, 1e-12)
            lam = np.clip(-lam, 0.0, cap)
            f = 1.0 - lam * (x[:, None] - mm)
        out[j:j + step] = np.log(f).sum(axis=0)
    return out


def rejects(y: np.ndarray, m_excess: float, side: str, alpha: float) -> bool:
    """Does the stream reject "mean <= m" (lower side) or "mean >= m" (upper side) at ``alpha``?"""
    return bool(log_wealth(y, m_excess, side)[0] >= math.log(1.0 / alpha))


def _edge(y: np.ndarray, side: str, alpha: float) -> float:
    """The bound of one side: a coarse grid of candidate means, then bisection between the last
    rejected and the first kept grid value (the rejection is monotone there in practice)."""
    thr = math.log(1.0 / alpha)
    grid = np.linspace(-1.0, 1.0, _GRID)
    rej = log_wealth(y, grid, side) >= thr
    if side == "upper":  # walk down from +1 instead of up from -1
        grid, rej = grid[::-1], rej[::-1]
    if not rej[0]:
        return float(grid[0])
    if rej.all():
        return float(grid[-1])
    k = int(np.argmin(rej))
    inside, outside = float(grid[k - 1]), float(grid[k])  # rejected, kept
    for _ in range(_BISECT):
        mid = (inside + outside) / 2
        if log_wealth(y, mid, side)[0] >= thr:
            inside = mid
        else:
            outside = mid
    return inside


def grid_bounds(y: np.ndarray, alpha: float) -> tuple[float, float]:
    """(low, high): the lower and the upper anytime-valid bound, each at level ``alpha``."""
    y = np.asarray(y, dtype=np.float64)
    if y.size == 0:
        return -1.0, 1.0
    return _edge(y, "lower", alpha), _edge(y, "upper", alpha)


def bounds(y: np.ndarray, alpha: float) -> Bounds:
    y = np.asarray(y, dtype=np.float64)
    low, high = grid_bounds(y, alpha)
    return Bounds(n=int(y.size), estimate=float(y.mean()) if y.size else None, low=low, high=high,
                  log_wealth_zero=float(log_wealth(y, 0.0, "lower")[0]))


def turns_to_cross(y: np.ndarray, m_excess: float, side: str, alpha: float) -> float | None:
    """About how many more observations until the ``side`` test of ``m`` rejects, if the stream
    goes on as it has (its empirical distribution; a stream of zeros when there is none): the
    gap to ``log(1/alpha)`` over the expected log-growth of the bet that is best for that
    distribution within the truncation. 0 when it already rejects; None when it never would."""
    y = np.asarray(y, dtype=np.float64)
    x = _to_unit(y) if y.size else np.array([0.5])
    m = (m_excess + 1.0) / 2.0
    now = float(log_wealth(y, m_excess, side)[0]) if y.size else 0.0
    need = math.log(1.0 / alpha) - now
    if need <= 0:
        return 0.0
    s = 1.0 if side == "lower" else -1.0
    cap = TRUNCATION / (m if side == "lower" else 1.0 - m)
    lams = np.linspace(0.0, cap, 201)[1:]
    growth = np.log1p(np.outer(lams, s * (x - m))).mean(axis=1)
    g = float(growth.max())
    if not g > 1e-12:
        return None
    return need / g
