"""Noise floor: candidate vs secondary flip rates."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats as _st

from tensorverse.analysis.metrics import AnalysisInputError, PositionMetrics
from tensorverse.analysis.noise import (
    REGRESSION,
    WITHIN_NOISE,
    KLComparison,
    _norm_ppf,
    compare_flip_rates,
    compare_kl_means,
    compare_to_noise,
)
from tests.refusals import refused


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


# --- exact checks of each rule: refusals and messages, the method, p-values, every field ----------

def _msg(text: str) -> str:
    return "^" + re.escape(text) + "$"


def _wald(x1, n1, x2, n2, alpha):
    """The two-sided (1 - alpha) unpooled interval of the rate difference (scipy's quantile)."""
    p1, p2 = x1 / n1, x2 / n2
    se = math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
    z = float(_st.norm.ppf(1 - alpha / 2))
    return p1 - p2 - z * se, p1 - p2 + z * se


def test_norm_ppf_refuses_the_ends():
    for p in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=_msg("p must lie in (0, 1)")):
            _norm_ppf(p)
    assert _norm_ppf(1e-300) < -30 and _norm_ppf(1 - 1e-16) > 8


def test_count_checks_name_the_run_and_the_bounds():
    # each refusal names the run it refuses
    with refused(AnalysisInputError, "dtype", "candidate:"):
        compare_flip_rates("x", 10, 1, 10)
    with refused(AnalysisInputError, "dtype", "secondary:"):
        compare_flip_rates(1, 10, 1, None)
    with refused(AnalysisInputError, "empty", "candidate:"):
        compare_flip_rates(0, 0, 1, 10)
    with refused(AnalysisInputError, "empty", "secondary:"):
        compare_flip_rates(0, 10, 0, -2)
    with refused(AnalysisInputError, "value", "candidate:"):
        compare_flip_rates(11, 10, 1, 10)
    with refused(AnalysisInputError, "value", "secondary:"):
        compare_flip_rates(1, 10, -1, 10)
    # the bounds themselves are fine: one position, no flip, every position a flip
    r = compare_flip_rates(1, 1, 0, 1, method="fisher")
    assert (r.candidate_flips, r.candidate_n, r.secondary_flips, r.secondary_n) == (1, 1, 0, 1)
    r = compare_flip_rates(10, 10, 0, 10, method="fisher")
    assert r.candidate_rate == 1.0 and r.p_value == pytest.approx(
        _fisher_exact_greater(10, 10, 0, 10), rel=1e-12)


def test_alpha_method_and_n_boot_checks():
    for alpha in (0.0, 1.0, 1.5, -0.1):
        with refused(AnalysisInputError, "value"):
            compare_flip_rates(1, 10, 1, 10, alpha=alpha)
    with refused(AnalysisInputError, "value"):
        compare_flip_rates(1, 10, 1, 10, method="magic")
    with refused(AnalysisInputError, "value"):
        compare_flip_rates(1, 10, 1, 10, method="bootstrap", n_boot=99)
    assert compare_flip_rates(1, 10, 1, 10, method="bootstrap", n_boot=100).method == "bootstrap"


def test_auto_takes_fisher_when_any_expected_count_is_below_5():
    # each case has exactly one of the four expected counts under 5 (the others far above)
    cases = [
        (2, 50, 61, 1000),     # n1 * pooled = 3
        (47, 50, 940, 1000),   # n1 * (1 - pooled) = 3
        (60, 1000, 3, 50),     # n2 * pooled = 3
        (940, 1000, 47, 50),   # n2 * (1 - pooled) = 3
    ]
    for x1, n1, x2, n2 in cases:
        pooled = (x1 + x2) / (n1 + n2)
        counts = sorted([n1 * pooled, n1 * (1 - pooled), n2 * pooled, n2 * (1 - pooled)])
        assert counts[0] < 5 <= counts[1]
        assert compare_flip_rates(x1, n1, x2, n2).method == "fisher"
    # all four at least 5: the z-test, also at exactly 5 (pooled 1/2, 10 positions each)
    assert compare_flip_rates(60, 1000, 10, 1000).method == "z"
    assert compare_flip_rates(6, 10, 4, 10).method == "z"
    assert compare_flip_rates(5, 9, 4, 10).method == "fisher"  # 9 * 9 / 19 < 5


def test_interval_is_the_unpooled_one_at_1_minus_alpha():
    for x1, n1, x2, n2, alpha in ((60, 1000, 10, 400, 0.05), (7, 30, 2, 50, 0.2)):
        lo, hi = _wald(x1, n1, x2, n2, alpha)
        for method in ("z", "fisher"):
            r = compare_flip_rates(x1, n1, x2, n2, alpha=alpha, method=method)
            assert r.ci_low == pytest.approx(lo, abs=1e-12)
            assert r.ci_high == pytest.approx(hi, abs=1e-12)


def test_z_test_without_any_variance():
    for x in (0, 500):
        r = compare_flip_rates(x, 500, x, 500, method="z")
        assert r.p_value == 1.0 and r.statistic == 0.0
        assert r.message.endswith("one-sided two-proportion z-test: z=0.00, p=1 >= 0.05")


def test_the_verdict_needs_a_higher_rate_and_p_strictly_below_alpha():
    # equal rates: z = 0, p = 0.5 < alpha = 0.9, but no excess
    r = compare_flip_rates(10, 100, 10, 100, method="z", alpha=0.9)
    assert r.p_value == pytest.approx(0.5, abs=1e-15) and r.verdict == WITHIN_NOISE
    assert r.message.endswith("p=0.5 < 0.9")


def _bootstrap(x1, n1, x2, n2, alpha, b, seed):
    """The documented parametric bootstrap, from its definition: b null draws of each run at
    the pooled rate, then b draws of each run at its own rate, from default_rng(seed); the
    p-value (1 + #{null difference >= observed}) / (b + 1), compared exactly (as fractions);
    the interval the linear-interpolation percentiles of the resampled differences."""
    rng = np.random.default_rng(seed)
    pooled = (x1 + x2) / (n1 + n2)
    a1 = rng.binomial(n1, pooled, b).tolist()
    a2 = rng.binomial(n2, pooled, b).tolist()
    obs = Fraction(x1, n1) - Fraction(x2, n2)
    count = sum(1 for u, v in zip(a1, a2) if Fraction(u, n1) - Fraction(v, n2) >= obs)
    p = (1 + count) / (b + 1)
    d1 = rng.binomial(n1, x1 / n1, b).tolist()
    d2 = rng.binomial(n2, x2 / n2, b).tolist()
    d = sorted(u / n1 - v / n2 for u, v in zip(d1, d2))

    def q(level):
        h = (b - 1) * level
        lo = math.floor(h)
        hi = min(lo + 1, b - 1)
        return d[lo] + (h - lo) * (d[hi] - d[lo])

    return p, count, q(alpha / 2), q(1 - alpha / 2)


@pytest.mark.parametrize("case", [(20, 400, 9, 400, 0.05, 20000, 0), (30, 300, 30, 300, 0.05, 5000, 4),
                                  (12, 90, 20, 250, 0.1, 3000, 7)])
def test_bootstrap_p_value_and_interval_from_the_definition(case):
    x1, n1, x2, n2, alpha, b, seed = case
    p, count, lo, hi = _bootstrap(x1, n1, x2, n2, alpha, b, seed)
    kw = {} if (b, seed) == (20000, 0) else {"n_boot": b, "seed": seed}  # the defaults
    r = compare_flip_rates(x1, n1, x2, n2, alpha=alpha, method="bootstrap", **kw)
    assert 0 < count < b
    assert r.p_value == p
    assert r.ci_low == pytest.approx(lo, abs=1e-12) and r.ci_high == pytest.approx(hi, abs=1e-12)
    assert r.statistic is None


def test_bootstrap_p_value_equal_to_alpha_is_not_significant():
    p, count, _, _ = _bootstrap(14, 200, 6, 200, 0.05, 199, 3)
    assert 0 < p < 1
    r = compare_flip_rates(14, 200, 6, 200, method="bootstrap", n_boot=199, seed=3, alpha=p)
    assert r.p_value == p and r.difference > 0
    assert r.verdict == WITHIN_NOISE
    assert r.message.endswith(f"one-sided parametric bootstrap: p={p:.3g} >= {p:g}")


def test_every_field_and_the_message_of_each_method():
    r = compare_flip_rates(60, 1000, 10, 400, method="z", alpha=0.01)
    p1, p2 = 0.06, 10 / 400
    pooled = 70 / 1400
    z = (p1 - p2) / math.sqrt(pooled * (1 - pooled) * (1 / 1000 + 1 / 400))
    pz = float(_st.norm.sf(z))
    lo, hi = _wald(60, 1000, 10, 400, 0.01)
    d = r.as_dict()
    assert d.pop("p_value") == pytest.approx(pz, rel=1e-12)
    assert d.pop("statistic") == pytest.approx(z, rel=1e-12)
    assert d.pop("ci_low") == pytest.approx(lo, abs=1e-12)
    assert d.pop("ci_high") == pytest.approx(hi, abs=1e-12)
    assert d.pop("difference") == pytest.approx(p1 - p2, abs=1e-15)
    assert d == {
        "verdict": REGRESSION, "method": "z", "alpha": 0.01,
        "candidate_flips": 60, "candidate_n": 1000, "secondary_flips": 10, "secondary_n": 400,
        "candidate_rate": p1, "secondary_rate": p2,
        "message": (f"regression: candidate flips 60/1000 (6.00%) vs noise floor 10/400 (2.50%); "
                    f"one-sided two-proportion z-test: z={z:.2f}, p={pz:.3g} < 0.01"),
    }
    assert type(d["alpha"]) is float
    pf = _fisher_exact_greater(2, 20, 1, 30)
    r = compare_flip_rates(2, 20, 1, 30, alpha=0.1)
    assert r.method == "fisher" and r.statistic is None
    assert r.p_value == pytest.approx(pf, rel=1e-12)
    assert r.message == (f"within noise: candidate flips 2/20 (10.00%) vs noise floor 1/30 (3.33%); "
                         f"one-sided Fisher exact test: p={r.p_value:.3g} >= 0.1")
    pb, _, _, _ = _bootstrap(40, 500, 10, 500, 0.05, 500, 2)
    r = compare_flip_rates(40, 500, 10, 500, method="bootstrap", n_boot=500, seed=2)
    assert r.message == ("regression: candidate flips 40/500 (8.00%) vs noise floor 10/500 (2.00%); "
                         f"one-sided parametric bootstrap: p={pb:.3g} < 0.05")


def test_compare_to_noise_passes_the_options_on():
    r = compare_to_noise(_pm(30, 300), _pm(3, 300), method="fisher", alpha=0.2)
    assert r.method == "fisher" and r.alpha == 0.2
    assert r.p_value == pytest.approx(_fisher_exact_greater(30, 300, 3, 300), rel=1e-12)


def _welch(a, b):
    def mean_var(xs):
        m = math.fsum(xs) / len(xs)
        return m, math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    ma, va = mean_var(a)
    mb, vb = mean_var(b)
    z = (ma - mb) / math.sqrt(va / len(a) + vb / len(b))
    return ma, mb, z, float(_st.norm.sf(z))


def test_kl_means_fields_and_message_from_a_plain_welch_test():
    a = [0.30, 0.10, 0.25, 0.40, 0.05, 0.20]
    b = [0.20, 0.15, 0.10, 0.30, 0.22]
    ma, mb, z, p = _welch(a, b)
    assert 0.05 < p < 0.5 and ma > mb  # a higher mean, not significant at the default 0.05
    r = compare_kl_means(a, b)
    assert isinstance(r, KLComparison)
    d = r.as_dict()
    assert d.pop("candidate_mean") == pytest.approx(ma, rel=1e-14)
    assert d.pop("secondary_mean") == pytest.approx(mb, rel=1e-14)
    assert d.pop("statistic") == pytest.approx(z, rel=1e-12)
    assert d.pop("p_value") == pytest.approx(p, rel=1e-12)
    assert d == {"verdict": WITHIN_NOISE, "alpha": 0.05,
                 "message": (f"within noise: mean KL {ma:.6g} (n=6) vs noise floor {mb:.6g} (n=5); "
                             f"one-sided Welch z-test z={z:.2f}, p={p:.3g}")}
    assert compare_kl_means(a, b, alpha=0.5).verdict == REGRESSION
    # equal means: z = 0, p = 0.5 below alpha, but no excess
    # (binary fractions: the two means are equal to the last bit)
    r = compare_kl_means([0.25, 0.75], [0.5, 0.5, 0.25, 0.75], alpha=0.9)
    assert r.candidate_mean == r.secondary_mean == 0.5
    assert (r.statistic, r.p_value, r.verdict) == (0.0, 0.5, WITHIN_NOISE)


def test_kl_means_of_float32_values_are_float64():
    rng = np.random.default_rng(5)
    a = rng.exponential(1e-3, 1001).astype(np.float32)
    b = rng.exponential(1e-3, 999).astype(np.float32)
    ma, mb, z, _ = _welch([float(v) for v in a], [float(v) for v in b])
    r = compare_kl_means(a, b)
    assert r.candidate_mean == pytest.approx(ma, rel=1e-13)
    assert r.secondary_mean == pytest.approx(mb, rel=1e-13)
    assert r.statistic == pytest.approx(z, rel=1e-10)


def test_kl_means_without_variance():
    r = compare_kl_means([2.0, 2.0], [1.0, 1.0, 1.0])
    assert (r.statistic, r.p_value, r.verdict) == (math.inf, 0.0, REGRESSION)
    assert r.message.endswith("one-sided Welch z-test z=inf, p=0")
    for a, b in (([1.0, 1.0], [1.0, 1.0]), ([1.0, 1.0], [2.0, 2.0])):
        r = compare_kl_means(a, b)
        assert (r.statistic, r.p_value, r.verdict) == (0.0, 1.0, WITHIN_NOISE)
    # p = 0 is not below an alpha of 0
    assert compare_kl_means([2.0, 2.0], [1.0, 1.0], alpha=0.0).verdict == WITHIN_NOISE


def test_kl_means_refusals():
    for a, b in (([0.1], [0.1, 0.2]), ([0.1, 0.2], [0.1]), ([], [])):
        with refused(AnalysisInputError, "empty"):
            compare_kl_means(a, b)
    r = compare_kl_means([0.1, 0.2], [0.1, 0.3])
    assert r.verdict == WITHIN_NOISE
    for a, b in (([0.1, math.inf], [0.1, 0.2]), ([0.1, 0.2], [math.nan, 0.2])):
        with refused(AnalysisInputError, "non_finite"):
            compare_kl_means(a, b)
