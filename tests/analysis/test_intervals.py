"""The project's intervals (analysis/intervals.py): Wilson against its formula, the cluster
bootstrap against a plain resampling of clusters, and their edges."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from tensorverse.analysis.intervals import (
    CONFIDENCE,
    REPLICATES,
    SEED,
    Interval,
    cluster_bootstrap,
    cluster_bootstrap_difference,
    wilson,
)


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


def test_difference_of_proportional_sides_is_the_bootstrap_of_the_paired_difference():
    """Each side ran every turn (one run each, or r times as many runs on the base): the
    difference is one ratio of sums and its interval is :func:`cluster_bootstrap`'s, exactly."""
    k, n = [0, 3, 0, 1, 0, 7, 0, 0], [12, 30, 9, 14, 20, 25, 11, 16]
    b = [1, 0, 0, 1, 0, 2, 0, 0]
    assert cluster_bootstrap_difference(k, n, b, n) == cluster_bootstrap(np.subtract(k, b), n)
    b2, n2 = [2 * x + (i % 2) for i, x in enumerate(b)], [2 * x for x in n]  # two base runs a turn
    iv = cluster_bootstrap_difference(k, n, b2, n2)
    assert iv == cluster_bootstrap(np.subtract(k, np.divide(b2, 2.0)), n)
    assert iv.estimate == pytest.approx(sum(k) / sum(n) - sum(b2) / sum(n2), rel=1e-12)


def test_difference_of_unequal_sides_resamples_turns_on_both_sides_together():
    """Turns one side lacks (0 and 0): the estimate is the pooled difference and the interval a
    joint resampling of the turns (against a direct resampling, another generator)."""
    rng = np.random.default_rng(3)
    c = 50
    n = rng.integers(20, 60, size=c)
    q = np.where(rng.random(c) < 0.2, 0, n)  # the base lacks a fifth of the turns
    k = np.where(rng.random(c) < 0.3, rng.integers(1, 6, size=c), 0)
    b = np.where((rng.random(c) < 0.2) & (q > 0), 1, 0)
    iv = cluster_bootstrap_difference(k, n, b, q, replicates=20000)
    assert iv.estimate == pytest.approx(k.sum() / n.sum() - b.sum() / q.sum(), rel=1e-12)
    idx = np.random.default_rng(99).integers(0, c, size=(20000, c))
    stats = k[idx].sum(1) / n[idx].sum(1) - b[idx].sum(1) / q[idx].sum(1)
    lo, hi = np.quantile(stats, [0.025, 0.975])
    tol = 0.1 * stats.std()
    assert abs(iv.low - lo) < tol and abs(iv.high - hi) < tol and iv.positions == int(n.sum())


def test_difference_edges():
    assert cluster_bootstrap_difference([], [], [], []).estimate is None
    assert cluster_bootstrap_difference([1], [10], [0], [0]).estimate is None  # no base positions
    one = cluster_bootstrap_difference([1], [10], [0], [5])
    assert one.estimate == pytest.approx(0.1) and one.bounds() is None
    with pytest.raises(ValueError):
        cluster_bootstrap_difference([1, 2], [3, 4], [1], [3])


def test_paired_difference_covers_the_true_effect_on_clustered_turns():
    """Coverage by simulation on clustered data: turns differ in difficulty (a hard turn flips at
    several positions under both settings), the candidate adds a fixed per-position rate; the 95 %
    interval holds the true difference in at least 90 % of 300 simulated corpora of 60 turns."""
    rng = np.random.default_rng(2026)
    hits, sims = 0, 300
    for _ in range(sims):
        n = rng.integers(20, 80, size=60)
        hard = rng.random(60) < 0.15  # a few hard turns: near ties everywhere
        base_p = np.where(hard, 0.08, 0.002)
        b = rng.binomial(n, base_p)
        k = rng.binomial(n, base_p + 0.01)
        true = 0.01
        iv = cluster_bootstrap_difference(k, n, b, n, replicates=500)
        hits += iv.low <= true <= iv.high
    assert hits / sims >= 0.90


def test_difference_refusals_and_sides_without_positions_exactly():
    assert cluster_bootstrap_difference([], [], [], []) == Interval(None, None, None, 0, 0)
    assert cluster_bootstrap_difference([0], [0], [1], [5]) == Interval(None, None, None, 1, 0)  # no positions
    assert cluster_bootstrap_difference([1], [10], [0], [0]) == Interval(None, None, None, 1, 10)  # no base
    # one position a side is enough
    assert cluster_bootstrap_difference([1], [1], [0], [5]).estimate == 1.0
    assert cluster_bootstrap_difference([1], [10], [0], [1]).estimate == pytest.approx(0.1)
    with pytest.raises(ValueError, match="four 1-D arrays"):
        cluster_bootstrap_difference([[1, 2]], [[3, 4]], [[1, 0]], [[3, 4]])


def test_difference_passes_its_confidence_replicates_and_seed_on():
    k, n, b = [0, 3, 0, 1, 0, 7, 0, 0], [12, 30, 9, 14, 20, 25, 11, 16], [1, 0, 0, 1, 0, 2, 0, 0]
    kw = dict(confidence=0.8, replicates=300, seed=5)
    assert cluster_bootstrap_difference(k, n, b, n, **kw) == cluster_bootstrap(np.subtract(k, b), n, **kw)
    q = [x + (i == 1) for i, x in enumerate(n)]  # not proportional: the joint draw, with the same knobs
    a1, a2 = cluster_bootstrap_difference(k, n, b, q, **kw), cluster_bootstrap_difference(k, n, b, q, **kw)
    assert a1 == a2 and a1.clusters == 8 and a1.positions == sum(n)
    wide = cluster_bootstrap_difference(k, n, b, q, replicates=300, seed=5)  # 95 %: wider than 80 %
    assert wide.low < a1.low and wide.high > a1.high


def test_a_replicate_that_draws_no_position_of_a_side_is_left_out():
    """Two turns, each run by one side only: a replicate drawing one turn twice has no difference
    and is dropped; one drawing both has 1/1 - 1/1 = 0. With a single replicate (seed 0 draws
    both turns, seed 3 one twice) the interval is [0, 0] or none."""
    args = ([1, 0], [1, 0], [0, 1], [0, 1])
    assert cluster_bootstrap_difference(*args, replicates=1, seed=0) == Interval(0.0, 0.0, 0.0, 2, 1)
    assert cluster_bootstrap_difference(*args, replicates=1, seed=3) == Interval(0.0, None, None, 2, 1)
    assert cluster_bootstrap_difference(*args) == Interval(0.0, 0.0, 0.0, 2, 1)


def test_each_path_of_the_cluster_bootstrap_counts_its_clusters_and_positions():
    assert cluster_bootstrap([3], [10]) == Interval(0.3, None, None, 1, 10)  # one cluster: no interval
    assert cluster_bootstrap([1] * 4, [5] * 4) == Interval(0.2, 0.2, 0.2, 4, 20)  # every cluster alike
    two = cluster_bootstrap([0, 2], [4, 4])  # two clusters are enough for an interval
    assert (two.estimate, two.clusters, two.positions) == (0.25, 2, 8) and two.low == 0.0 and two.high == 0.5


def test_a_cluster_without_positions_counts_as_nothing_in_a_replicate():
    # a replicate that drew only the cluster without positions has rate 0 (nothing flipped), not
    # a division by zero: a quarter of the replicates draw it twice
    assert cluster_bootstrap([0, 1], [0, 5]) == Interval(0.2, 0.0, 0.2, 2, 5)


def test_inputs_of_any_float_type_are_summed_in_float64():
    num32 = np.full(10, 0.1, dtype=np.float32)  # float32's own sum of these is off by ~1e-7
    den32 = np.full(10, 0.3, dtype=np.float32)
    want = math.fsum(num32.astype(np.float64)) / math.fsum(den32.astype(np.float64))
    assert float(num32.sum()) != math.fsum(num32.astype(np.float64))  # the premise
    assert float(den32.sum()) != math.fsum(den32.astype(np.float64))
    assert cluster_bootstrap(num32, den32).estimate == pytest.approx(want, rel=1e-12)
    base = np.full(10, 0.2, dtype=np.float32)
    want_diff = want - math.fsum(base.astype(np.float64)) / math.fsum(den32.astype(np.float64) * 2)
    got = cluster_bootstrap_difference(num32, den32, base, den32 * np.float32(2))
    assert got.estimate == pytest.approx(want_diff, rel=1e-9)
    uneven = np.array([0.3, 0.7] * 5, dtype=np.float32)  # not proportional: the two-ratio path
    want_uneven = want - math.fsum(base.astype(np.float64)) / math.fsum(uneven.astype(np.float64))
    assert cluster_bootstrap_difference(num32, den32, base, uneven).estimate == pytest.approx(want_uneven, rel=1e-12)


def test_counts_of_unequal_lengths_or_not_one_dimensional_are_refused():
    with pytest.raises(ValueError):
        cluster_bootstrap([1], [5, 6])  # one numerator: the refusal comes before the one-cluster answer
    with pytest.raises(ValueError):
        cluster_bootstrap([[1, 2]], [[5, 6]])  # alike, but two-dimensional
