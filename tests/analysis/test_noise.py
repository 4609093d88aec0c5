"""Noise floor: candidate vs secondary flip rates."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from tensorverse.analysis.metrics import AnalysisInputError, PositionMetrics
from tensorverse.analysis.noise import (
    REGRESSION,
    WITHIN_NOISE,
    _norm_ppf,
    compare_flip_rates,
    compare_kl_means,
    compare_to_noise,
)


def _fisher_exact_greater(x1, n1, x2, n2) -> float:
    """Independent check: exact rational hypergeometric tail."""
    N, K = n1 + n2, x1 + x2
    total = Fraction(0)
    for x in range(x1, min(K, n1) + 1):
        total += Fraction(math.comb(K, x) * math.comb(N - K, n1 - x), math.comb(N, n1))
    return float(total)


@pytest.mark.parametrize("method", ["auto", "z", "fisher", "bootstrap"])
def test_clearly_different_rates_are_a_regression(method):
    r = compare_flip_rates(60, 1000, 10, 1000, method=method)
    assert r.verdict == REGRESSION and r.regression
    assert r.p_value < 1e-3
    assert r.ci_low > 0
    assert "regression" in r.message and "60/1000" in r.message


@pytest.mark.parametrize("method", ["auto", "z", "fisher", "bootstrap"])
def test_equal_rates_are_within_noise(method):
    r = compare_flip_rates(10, 1000, 10, 1000, method=method)
    assert r.verdict == WITHIN_NOISE and not r.regression
    assert r.p_value > 0.3
    assert r.ci_low < 0 < r.ci_high
    assert "within noise" in r.message


def test_candidate_better_than_noise_floor_is_within_noise():
    r = compare_flip_rates(1, 1000, 40, 1000)
    assert r.verdict == WITHIN_NOISE and r.p_value > 0.99


def test_z_statistic_value():
    # pooled p = 0.035; se = sqrt(.035 * .965 * 2 / 1000)
    r = compare_flip_rates(60, 1000, 10, 1000, method="z")
    se = math.sqrt(0.035 * 0.965 * 2 / 1000)
    assert r.statistic == pytest.approx(0.05 / se)
    assert r.p_value == pytest.approx(0.5 * math.erfc(r.statistic / math.sqrt(2)))


def test_auto_uses_fisher_for_small_counts_and_it_is_exact():
    r = compare_flip_rates(5, 20, 0, 20)
    assert r.method == "fisher"
    assert r.p_value == pytest.approx(_fisher_exact_greater(5, 20, 0, 20), rel=1e-12)
    assert r.verdict == REGRESSION  # p = 0.0237
    r = compare_flip_rates(2, 20, 0, 20)
    assert r.p_value == pytest.approx(_fisher_exact_greater(2, 20, 0, 20), rel=1e-12)
    assert r.verdict == WITHIN_NOISE  # p = 0.244


def test_no_flips_anywhere():
    for method in ("z", "fisher", "bootstrap", "auto"):
        r = compare_flip_rates(0, 500, 0, 500, method=method)
        assert r.verdict == WITHIN_NOISE


def test_bootstrap_is_seeded():
    a = compare_flip_rates(20, 400, 9, 400, method="bootstrap", seed=3)
    b = compare_flip_rates(20, 400, 9, 400, method="bootstrap", seed=3)
    assert a == b


def test_norm_ppf():
    assert _norm_ppf(0.975) == pytest.approx(1.959963984540054, abs=1e-12)
    assert _norm_ppf(0.5) == pytest.approx(0.0, abs=1e-15)
    assert _norm_ppf(0.001) == pytest.approx(-3.090232306167813, abs=1e-10)


def test_bad_counts():
    with pytest.raises(AnalysisInputError):
        compare_flip_rates(5, 0, 1, 10)
    with pytest.raises(AnalysisInputError):
        compare_flip_rates(11, 10, 1, 10)
    with pytest.raises(AnalysisInputError):
        compare_flip_rates(1, 10, 1, 10, method="magic")


def _pm(flips: int, n: int) -> PositionMetrics:
    agree = np.ones(n, bool)
    agree[:flips] = False
    z = np.zeros(n)
    i = np.zeros(n, np.int64)
    return PositionMetrics(top1_agree=agree, kl=z, delta_p=z, margin=z, rank=i, entropy=z,
                           ref_top1=i, cand_top1=i + (~agree))


def test_compare_to_noise_from_metrics_and_pooled_runs():
    r = compare_to_noise(_pm(30, 300), _pm(3, 300))
    assert r.verdict == REGRESSION and r.candidate_flips == 30 and r.secondary_n == 300
    r = compare_to_noise([_pm(2, 100), _pm(1, 100)], [_pm(2, 100), _pm(2, 100)])
    assert r.verdict == WITHIN_NOISE and r.candidate_n == 200
    assert r.as_dict()["verdict"] == WITHIN_NOISE


def test_compare_kl_means():
    rng = np.random.default_rng(0)
    sec = rng.exponential(1e-4, 500)
    assert compare_kl_means(rng.exponential(5e-4, 500), sec).verdict == REGRESSION
    assert compare_kl_means(rng.exponential(1e-4, 500), sec).verdict == WITHIN_NOISE
