"""The project's intervals (analysis/intervals.py): Wilson against its formula, the cluster
bootstrap against a plain resampling of clusters, and their edges."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from tensorverse.analysis.intervals import CONFIDENCE, REPLICATES, SEED, Interval, cluster_bootstrap, wilson


def _wilson_by_hand(k: int, n: int, confidence: float) -> tuple[float, float]:
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return c - h, c + h


@pytest.mark.parametrize("k,n", [(0, 1), (0, 50), (1, 50), (25, 50), (50, 50), (3, 1000), (999, 1000)])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_wilson_is_the_score_interval(k, n, confidence):
    lo, hi = wilson(k, n, confidence)
    want = _wilson_by_hand(k, n, confidence)
    assert lo == pytest.approx(max(0.0, want[0]), abs=1e-12) and hi == pytest.approx(min(1.0, want[1]), abs=1e-12)


def test_wilson_of_no_trials_is_none_and_impossible_counts_are_refused():
    assert wilson(0, 0) is None
    with pytest.raises(ValueError):
        wilson(3, 2)
    with pytest.raises(ValueError):
        wilson(-1, 2)


def test_cluster_bootstrap_edges():
    assert cluster_bootstrap([], []).estimate is None
    one = cluster_bootstrap([3], [10])
    assert one.estimate == 0.3 and one.low is None and one.bounds() is None  # one cluster: no interval
    same = cluster_bootstrap([0] * 50, [10] * 50)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    iv = cluster_bootstrap([1, 0, 0, 0, 5, 0], [10] * 6)
    assert iv.low <= iv.estimate <= iv.high and 0 <= iv.low and iv.high <= 0.5
    with pytest.raises(ValueError):
        cluster_bootstrap([1, 2], [10])


def test_cluster_bootstrap_is_a_resampling_of_clusters():
    """The multinomial-over-distinct-pairs draw is the plain bootstrap of clusters: its
    percentiles agree with a direct resampling (another generator) within Monte Carlo error."""
    rng = np.random.default_rng(7)
    n = rng.integers(20, 80, size=60)
    k = np.where(rng.random(60) < 0.2, rng.integers(1, 6, size=60), 0)
    iv = cluster_bootstrap(k, n, replicates=20000)
    idx = np.random.default_rng(99).integers(0, 60, size=(20000, 60))
    stats = k[idx].sum(axis=1) / n[idx].sum(axis=1)
    lo, hi = np.quantile(stats, [(1 - CONFIDENCE) / 2, 1 - (1 - CONFIDENCE) / 2])
    assert iv.estimate == pytest.approx(k.sum() / n.sum(), rel=1e-15)
    assert iv.low == pytest.approx(lo, abs=0.003) and iv.high == pytest.approx(hi, abs=0.003)
    tol = 0.1 * stats.std()  # the 2.5 and 10 percentiles lie about 0.7 standard deviations apart
    assert abs(iv.low - lo) < tol and abs(iv.high - hi) < tol


def test_cluster_bootstrap_does_not_depend_on_the_order_of_the_clusters():
    k, n = [0, 3, 0, 1, 0, 7, 0, 0], [12, 30, 9, 14, 20, 25, 11, 16]
    a = cluster_bootstrap(k, n)
    b = cluster_bootstrap(k[::-1], n[::-1])
    assert a == b


def test_clustered_interval_is_wider_than_the_position_level_one_when_flips_sit_in_few_turns():
    k = [8] + [0] * 39  # 8 flips, all in one of 40 turns of 25 positions
    n = [25] * 40
    iv = cluster_bootstrap(k, n)
    lo, hi = wilson(8, 1000)
    assert iv.low == 0.0 < lo and iv.high > hi


def test_interval_bounds_round_for_the_reports():
    assert Interval(0.1, 0.01234567891, 0.2, 5, 100).bounds() == [0.012346, 0.2]
    assert Interval(None, None, None, 0, 0).bounds() is None


def test_cluster_bootstrap_defaults_are_the_documented_ones():
    k, n = [0, 3, 0, 1, 0, 7, 0, 0], [12, 30, 9, 14, 20, 25, 11, 16]
    assert (REPLICATES, SEED, CONFIDENCE) == (2000, 20261202, 0.95)
    assert cluster_bootstrap(k, n) == cluster_bootstrap(k, n, replicates=2000, seed=20261202, confidence=0.95)
    assert cluster_bootstrap(k, n, confidence=0.5).high < cluster_bootstrap(k, n).high


def test_clusters_without_positions_have_no_estimate():
    iv = cluster_bootstrap([0, 0], [0, 0])
    assert (iv.estimate, iv.low, iv.high, iv.clusters, iv.positions) == (None, None, None, 2, 0)


def test_an_interval_missing_either_bound_has_no_bounds():
    assert Interval(0.1, 0.0, None, 2, 10).bounds() is None
    assert Interval(0.1, None, 0.2, 2, 10).bounds() is None
    assert Interval(0.1, 0.05, 0.2, 2, 10).as_dict() == {"estimate": 0.1, "low": 0.05, "high": 0.2, "clusters": 2,
                                                          "positions": 10}
