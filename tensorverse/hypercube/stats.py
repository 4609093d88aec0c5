"""Each setting's marginal effect over the merged rigs, with turns as the unit: pure functions.

For a setting ``s`` the figures are, pooled over every rig that ran it:

* its flip rate (flips / positions) with a 95 % interval;
* its effect **vs the reference**: flip rate of ``s`` minus the reference setting's, paired: over
  the (rig, case, turn) where both ran (the reference runs on every rig), so
  ``sum(flips_s - flips_ref) / sum(positions)``;
* its effect **vs the noise point**: the same against the suite's same-config noise setting, over
  the rigs that ran both (none where no rig ran a noise point).

**The unit is the turn, not the position.** Flips cluster: a turn whose context drifts toward a
near tie flips at several positions, and a hard turn flips on every rig and under most settings,
so positions are far from independent trials and a binomial interval over positions is too
narrow (issue 25 measured a position-level interval covering the true excess in well under
60 % of simulated datasets). Each (rig, case, turn) is one cluster: its positions and its
flips (or the paired difference of flips) go together.

**Method: a cluster bootstrap of the ratio estimator, percentile interval, fixed seed**
(:func:`cluster_bootstrap`). The estimate is the ratio ``sum(numerator) / sum(positions)`` over
clusters; each of :data:`REPLICATES` replicates draws as many clusters as there are, with
replacement, and recomputes the ratio; the interval is the 2.5 and 97.5 percentiles (widened,
if need be, to hold the estimate). Chosen over the ratio estimator's cluster-robust
(linearised, sandwich) variance because flip rates sit near 0 and their differences are bounded
and skewed: a symmetric normal interval from a linearised variance crosses the bounds and
ignores the skew that few heavy turns give, while the percentile interval keeps both. Its known
weakness, undercoverage when nearly all flips sit in very few clusters, is shared with the
sandwich variance; neither is anytime-valid (the verdict's bounds, ``tensorverse verdict``,
are). The seed is fixed (:data:`SEED`), so the same bundles give the same site, and
replicates are drawn as multinomial counts over the *distinct* (numerator, positions) pairs of
the clusters (an exact reformulation of resampling clusters: most clusters of a setting are
alike, so this is fast at any number of turns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tensorverse.hypercube.merge import Hypercube

__all__ = ["Interval", "Marginal", "cluster_bootstrap", "marginals", "paired_clusters", "REPLICATES", "SEED",
           "CONFIDENCE", "METHOD"]

REPLICATES = 2000
SEED = 20261202
CONFIDENCE = 0.95
METHOD = "cluster bootstrap over (rig, case, turn), percentile interval"


@dataclass(frozen=True)
class Interval:
    """An estimate and its interval (None: fewer than two clusters, no interval)."""

    estimate: float | None
    low: float | None
    high: float | None
    clusters: int
    positions: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "clusters": self.clusters,
                "positions": self.positions}


def cluster_bootstrap(numerator: Sequence[float], positions: Sequence[int], *, replicates: int = REPLICATES,
                      confidence: float = CONFIDENCE, seed: int = SEED) -> Interval:
    """``sum(numerator) / sum(positions)`` over clusters, with the percentile interval of a
    cluster bootstrap (clusters drawn with replacement, ``replicates`` times, ``seed`` fixed)."""
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(positions, dtype=np.float64)
    c = int(num.shape[0])
    total = float(den.sum())
    if c == 0 or total <= 0:
        return Interval(None, None, None, c, int(total))
    est = float(num.sum()) / total
    if c < 2:
        return Interval(est, None, None, c, int(total))
    pairs, counts = np.unique(np.stack([num, den], axis=1), axis=0, return_counts=True)
    if pairs.shape[0] == 1:  # every cluster alike: every replicate is the estimate
        return Interval(est, est, est, c, int(total))
    rng = np.random.default_rng(seed)
    w = rng.multinomial(c, counts / c, size=replicates).astype(np.float64)  # replicates x distinct pairs
    dens = w @ pairs[:, 1]
    stats = (w @ pairs[:, 0]) / np.where(dens > 0, dens, 1.0)
    alpha = 1.0 - confidence
    lo, hi = (float(x) for x in np.quantile(stats, [alpha / 2, 1 - alpha / 2]))
    return Interval(est, min(lo, est), max(hi, est), c, int(total))


@dataclass(frozen=True)
class Marginal:
    """One setting over every rig that ran it."""

    setting: str
    axis: str
    rigs: int
    positions: int
    flips: int
    turns: int
    turns_with_flip: int
    flip_rate: Interval
    vs_reference: Interval | None  # None for the reference itself
    vs_noise: Interval | None  # None for the noise point itself, or without one

    def as_dict(self) -> dict[str, object]:
        return {"setting": self.setting, "axis": self.axis, "rigs": self.rigs, "positions": self.positions,
                "flips": self.flips, "turns": self.turns, "turns_with_flip": self.turns_with_flip,
                "flip_rate": self.flip_rate.as_dict(),
                "vs_reference": self.vs_reference.as_dict() if self.vs_reference else None,
                "vs_noise": self.vs_noise.as_dict() if self.vs_noise else None}


def _by_cluster(cube: Hypercube, setting: str) -> dict[tuple[int, str, int], tuple[int, int]]:
    return {(t.rig, t.case, t.turn): (t.positions, t.flips) for t in cube.turn_counts if t.setting == setting}


def paired_clusters(cube: Hypercube, setting: str, other: str) -> tuple[np.ndarray, np.ndarray]:
    """Per (rig, case, turn) where both ran: flips of ``setting`` minus flips of ``other``, and
    the positions (the same on both: every setting that ran has every position)."""
    a, b = _by_cluster(cube, setting), _by_cluster(cube, other)
    keys = sorted(a.keys() & b.keys())
    d = np.array([a[k][1] - b[k][1] for k in keys], dtype=np.float64)
    n = np.array([a[k][0] for k in keys], dtype=np.float64)
    return d, n


def marginals(cube: Hypercube, *, replicates: int = REPLICATES, seed: int = SEED) -> list[Marginal]:
    """One :class:`Marginal` per setting of the cube, in its order."""
    out = []
    for s in cube.settings:
        own = _by_cluster(cube, s.name)
        keys = sorted(own)
        n = np.array([own[k][0] for k in keys], dtype=np.float64)
        k = np.array([own[k][1] for k in keys], dtype=np.float64)
        rigs, positions, flips = cube.pooled(s.name)
        rate = cluster_bootstrap(k, n, replicates=replicates, seed=seed)

        def vs(other: str | None) -> Interval | None:
            if other is None or other == s.name:
                return None
            d, nn = paired_clusters(cube, s.name, other)
            return cluster_bootstrap(d, nn, replicates=replicates, seed=seed)

        out.append(Marginal(setting=s.name, axis=s.axis, rigs=rigs, positions=positions, flips=flips,
                            turns=len(keys), turns_with_flip=int((k > 0).sum()), flip_rate=rate,
                            vs_reference=vs(cube.reference), vs_noise=vs(cube.noise)))
    return out

