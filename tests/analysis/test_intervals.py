"""The project's intervals (analysis/intervals.py): Wilson against its formula, the cluster
bootstrap against a plain resampling of clusters, the cluster-robust interval against the direct
sum over turns and by simulation on clustered turns, and their edges."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from tensorverse.analysis.intervals import (
    CONFIDENCE,
    REPLICATES,
    SEED,
    ClusterMoments,
    Interval,
    cluster_bootstrap,
    cluster_bootstrap_difference,
    cluster_robust,
    cluster_robust_difference,
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


# --------------------------------------------------------------------------- cluster-robust


def test_cluster_robust_variance_from_moments_is_the_sum_of_squared_residuals_over_turns():
    # by hand: r = 4/50 = 0.08; residuals x - r n = -0.8, 1.4, -0.8, 0.2; squares sum to 3.28
    m = ClusterMoments.of([0, 3, 0, 1], [10, 20, 10, 10])
    assert m == ClusterMoments(4.0, 4.0, 50.0, 10.0, 70.0, 700.0)
    assert m.variance() == pytest.approx(4 / 3 * 3.28 / 2500, rel=1e-14)
    iv = cluster_robust(m)
    h = NormalDist().inv_cdf(0.975) * math.sqrt(4 / 3 * 3.28 / 2500)
    assert (iv.estimate, iv.low, iv.high, iv.clusters, iv.positions) == (0.08, 0.0, pytest.approx(0.08 + h, rel=1e-14), 4, 50)
    # on many turns, against the residuals summed directly (no expansion into moments)
    rng = np.random.default_rng(3)
    n = rng.integers(30, 400, size=500)
    x = np.where(rng.random(500) < 0.15, rng.binomial(n, 0.07), 0)
    r = x.sum() / n.sum()
    direct = 500 / 499 * float(((x - r * n) ** 2).sum()) / float(n.sum()) ** 2
    assert ClusterMoments.of(x, n).variance() == pytest.approx(direct, rel=1e-10)


def test_cluster_moments_add_up_turn_by_turn_as_counters_do():
    a, b = ([0, 3, 0, 1], [10, 20, 10, 10]), ([2, 0, 5], [40, 15, 60])
    ma, mb = ClusterMoments.of(*a), ClusterMoments.of(*b)
    both = ClusterMoments.of(a[0] + b[0], a[1] + b[1])
    assert both == ClusterMoments(*(u + v for u, v in zip(vars(ma).values(), vars(mb).values())))


def test_cluster_robust_edges():
    assert cluster_robust(ClusterMoments.of([], [])).estimate is None
    one = cluster_robust(ClusterMoments.of([3], [10]))
    assert one.estimate == 0.3 and one.bounds() is None  # one turn: no interval
    none = cluster_robust(ClusterMoments.of([0, 0], [0, 0]))
    assert none.estimate is None and none.clusters == 2
    flat = cluster_robust(ClusterMoments.of([2] * 30, [10] * 30))  # every turn alike: no spread
    assert flat.estimate == 0.2 and flat.low == pytest.approx(0.2, abs=1e-8) and flat.high == pytest.approx(0.2, abs=1e-8)
    full = cluster_robust(ClusterMoments.of([10, 1], [10, 10]))
    assert full.high == 1.0 and full.low == 0.0  # clipped to a rate
    with pytest.raises(ValueError):
        cluster_robust(ClusterMoments.of([1, 0], [5, 5]), confidence=1.0)
    with pytest.raises(ValueError):
        ClusterMoments.of([1, 2], [10])


def test_cluster_robust_difference_adds_the_two_variances_and_is_not_clipped():
    m, base = ClusterMoments.of([0, 3, 0, 1], [10, 20, 10, 10]), ClusterMoments.of([1, 1, 0, 0], [10, 20, 10, 10])
    d = cluster_robust_difference(m, base, confidence=0.9)
    h = NormalDist().inv_cdf(0.95) * math.sqrt(m.variance() + base.variance())
    assert d.estimate == pytest.approx(0.04, abs=1e-15)
    assert d.low == pytest.approx(0.04 - h, rel=1e-14) and d.high == pytest.approx(0.04 + h, rel=1e-14)
    assert d.low < 0 and (d.clusters, d.positions) == (4, 50)
    assert cluster_robust_difference(m, ClusterMoments.of([1], [10])).bounds() is None
    assert cluster_robust_difference(m, ClusterMoments.of([], [])).estimate is None


def test_cluster_robust_lower_bound_is_a_sound_alert_on_clustered_turns_and_wilsons_is_not():
    """What an alert on a lower bound needs: over simulated hours of clustered turns (20 % hard
    turns flip at a Beta-drawn rate, the rest never; simulate.Clustered), the cluster-robust
    lower bound of the flip rate lies above the true rate in at most 2.5 % of hours, the
    position-level Wilson bound of the same counts in about 30 %; and the lower bound of a shadow's
    excess over the floor (same turns, no excess) lies above 0 as rarely."""
    from tensorverse.analysis.attribution import excess_flip_rate
    from tensorverse.analysis.simulate import Clustered, draw

    p = Clustered()
    truth = p.hard * p.hard_rate
    rng = np.random.default_rng(20261206)
    for turns in (20, 200):
        hours = 400
        robust_above = wilson_above = excess_above = newcombe_above = 0
        for _ in range(hours):
            s = draw(p, turns, rng)
            m, floor = ClusterMoments.of(s.flips, s.positions), ClusterMoments.of(s.floor_flips, s.positions)
            robust_above += cluster_robust(m).low > truth
            wilson_above += wilson(int(s.flips.sum()), int(s.positions.sum()))[0] > truth
            excess_above += cluster_robust_difference(m, floor).low > 0
            n = int(s.positions.sum())
            newcombe_above += excess_flip_rate(int(s.flips.sum()), n, int(s.floor_flips.sum()), n).low > 0
        assert robust_above / hours <= 0.025, (turns, robust_above)
        assert excess_above / hours <= 0.025, (turns, excess_above)
        assert wilson_above / hours >= 0.2, (turns, wilson_above)
        print(f"{turns} turns: lower bound above the truth in {robust_above / hours:.3f} of hours "
              f"(Wilson over positions {wilson_above / hours:.3f}); excess lower bound above 0 in "
              f"{excess_above / hours:.3f} (Newcombe over positions {newcombe_above / hours:.3f})")


def test_cluster_moments_are_summed_in_float64_whatever_the_input_type():
    # 5,000 turns of 4,097 positions: n^2 = 16,785,409 is past float32's integers, and its sum too
    n = np.full(5000, 4097, dtype=np.float32)
    x = np.full(5000, 4097, dtype=np.float32)  # every position flipped: x = n
    m = ClusterMoments.of(x, n)
    assert (m.numerator, m.positions) == (5000 * 4097.0, 5000 * 4097.0)
    assert m.positions_sq == m.cross == m.numerator_sq == 5000 * 4097.0 ** 2


def test_cluster_robust_counts_every_path_and_needs_only_one_position():
    one_position = ClusterMoments.of([1, 0], [1, 0])  # two turns, one position between them
    assert one_position.variance() == 0.0
    iv = cluster_robust(one_position)
    assert (iv.estimate, iv.low, iv.high, iv.clusters, iv.positions) == (1.0, 1.0, 1.0, 2, 1)
    assert ClusterMoments.of([0, 0], [0, 0]).variance() is None  # no positions: no variance
    empty = cluster_robust(ClusterMoments.of([0, 0], [0, 0]))
    assert (empty.estimate, empty.clusters, empty.positions) == (None, 2, 0)
    one = cluster_robust(ClusterMoments.of([3], [10]))
    assert (one.clusters, one.positions) == (1, 10)
    m = ClusterMoments.of([0, 3, 0, 1], [10, 20, 10, 10])
    no_base = cluster_robust_difference(m, ClusterMoments.of([], []))
    assert (no_base.estimate, no_base.clusters, no_base.positions) == (None, 4, 50)
    one_base = cluster_robust_difference(m, ClusterMoments.of([1], [10]))
    assert (one_base.estimate, one_base.low, one_base.clusters, one_base.positions) == (pytest.approx(0.08 - 0.1), None, 4, 50)
    for confidence in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError):
            cluster_robust(m, confidence=confidence)


def test_a_difference_needs_positions_on_both_sides_and_one_is_enough():
    one, m = ClusterMoments.of([1, 0], [1, 0]), ClusterMoments.of([0, 3, 0, 1], [10, 20, 10, 10])
    none_first = cluster_robust_difference(ClusterMoments.of([0, 0], [0, 0]), m)
    assert (none_first.estimate, none_first.clusters, none_first.positions) == (None, 2, 0)
    assert cluster_robust_difference(one, m).estimate == pytest.approx(1.0 - 0.08)
    assert cluster_robust_difference(m, one).estimate == pytest.approx(0.08 - 1.0)
