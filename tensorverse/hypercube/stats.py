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

**Method:** :func:`tensorverse.analysis.intervals.cluster_bootstrap` (a cluster bootstrap of the
ratio estimator, percentile interval, fixed seed; its docstring says why), the same interval the
replay report and the matrix report give for the same turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensorverse.analysis.intervals import CONFIDENCE, REPLICATES, SEED, Interval, cluster_bootstrap
from tensorverse.hypercube.merge import Hypercube

__all__ = ["Interval", "Marginal", "cluster_bootstrap", "marginals", "paired_clusters", "REPLICATES", "SEED",
           "CONFIDENCE", "METHOD"]

METHOD = "cluster bootstrap over (rig, case, turn), percentile interval"


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
            if other is None or other == s.name:  # noqa: B023 - called in this iteration
                return None
            d, nn = paired_clusters(cube, s.name, other)  # noqa: B023 - called in this iteration
            return cluster_bootstrap(d, nn, replicates=replicates, seed=seed)

        out.append(Marginal(setting=s.name, axis=s.axis, rigs=rigs, positions=positions, flips=flips,
                            turns=len(keys), turns_with_flip=int((k > 0).sum()), flip_rate=rate,
                            vs_reference=vs(cube.reference), vs_noise=vs(cube.noise)))
    return out

