"""The noise floor: is a candidate's divergence more than batching nondeterminism?

A *secondary* shadow runs the primary's exact config; its flips are the noise floor. A
candidate (other kernel, dtype, quantization...) is a **regression** when its flip rate is
significantly higher than the secondary's, and **within noise** otherwise. The test is
one-sided (H1: candidate rate > secondary rate):

- ``"z"``: the pooled two-proportion z-test (normal approximation);
- ``"fisher"``: Fisher's exact test (hypergeometric tail), right for small counts;
- ``"auto"`` (default): z-test when every expected count (flips and non-flips per run, under
  the pooled rate) is at least 5, Fisher's exact test otherwise;
- ``"bootstrap"``: a parametric bootstrap under H0 (both runs drawn at the pooled rate) for
  the p-value, and a percentile interval of the rate difference from resampling each run.

Positions are treated as independent trials (within a turn they are not quite: after a
flip, forced decoding keeps them aligned, so this is the usual approximation).
:func:`compare_kl_means` applies the same idea to mean KL (one-sided Welch z-test).
No I/O happens in this module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np

from tensorverse.analysis.metrics import AnalysisInputError, PositionMetrics

__all__ = [
    "REGRESSION",
    "WITHIN_NOISE",
    "NoiseComparison",
    "KLComparison",
    "compare_flip_rates",
    "compare_to_noise",
    "compare_kl_means",
]

REGRESSION = "regression"
WITHIN_NOISE = "within noise"


_NORMAL = NormalDist()


def _norm_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z (scipy's, accurate in the far tail; scipy is imported
    where it is used: the proxy imports this package and need not carry scipy)."""
    from scipy import stats

    return float(stats.norm.sf(z))


def _norm_ppf(p: float) -> float:
    """Inverse standard normal CDF (the standard library's `statistics.NormalDist`)."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must lie in (0, 1)")
    return _NORMAL.inv_cdf(p)


def _fisher_greater(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided Fisher exact p-value: P(X >= x1), X ~ Hypergeometric(N=n1+n2, K=x1+x2, n1)
    (scipy's hypergeometric survival function)."""
    from scipy import stats

    return min(1.0, float(stats.hypergeom.sf(x1 - 1, n1 + n2, x1 + x2, n1)))


@dataclass(frozen=True)
class NoiseComparison:
    """Candidate flip rate against the noise floor (the secondary's flip rate)."""

    verdict: str  # "regression" | "within noise"
    method: str  # "z" | "fisher" | "bootstrap"
    p_value: float
    alpha: float
    candidate_flips: int
    candidate_n: int
    secondary_flips: int
    secondary_n: int
    candidate_rate: float
    secondary_rate: float
    difference: float  # candidate_rate - secondary_rate
    ci_low: float  # two-sided (1 - alpha) interval of the difference
    ci_high: float
    statistic: float | None = None  # z for the z-test
    message: str = ""

    @property
    def regression(self) -> bool:
        return self.verdict == REGRESSION

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_counts(flips: int, n: int, name: str) -> tuple[int, int]:
    try:
        f, m = int(flips), int(n)
    except (TypeError, ValueError):
        raise AnalysisInputError(f"{name}: flip count and positions must be integers", "dtype") from None
    if m <= 0:
        raise AnalysisInputError(f"{name}: no positions to compare (n={m})", "empty")
    if not 0 <= f <= m:
        raise AnalysisInputError(f"{name}: flip count {f} outside [0, {m}]", "value")
    return f, m


def compare_flip_rates(
    candidate_flips: int,
    candidate_n: int,
    secondary_flips: int,
    secondary_n: int,
    *,
    alpha: float = 0.05,
    method: str = "auto",
    n_boot: int = 20000,
    seed: int = 0,
) -> NoiseComparison:
    """Is the candidate's flip rate significantly above the secondary's (noise floor)?"""
    x1, n1 = _check_counts(candidate_flips, candidate_n, "candidate")
    x2, n2 = _check_counts(secondary_flips, secondary_n, "secondary")
    if not 0.0 < alpha < 1.0:
        raise AnalysisInputError(f"alpha must lie in (0, 1), got {alpha}", "value")
    if method not in ("auto", "z", "fisher", "bootstrap"):
        raise AnalysisInputError(f"unknown method {method!r} (auto, z, fisher, bootstrap)", "value")
    p1, p2 = x1 / n1, x2 / n2
    diff = p1 - p2
    pooled = (x1 + x2) / (n1 + n2)
    if method == "auto":
        expected = min(n1 * pooled, n1 * (1 - pooled), n2 * pooled, n2 * (1 - pooled))
        method = "z" if expected >= 5 else "fisher"

    zcrit = _norm_ppf(1 - alpha / 2)
    se_u = math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
    ci_low, ci_high = diff - zcrit * se_u, diff + zcrit * se_u
    stat: float | None = None

    if method == "z":
        se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
        if se == 0.0:
            p_value = 1.0  # both runs all-flip or no-flip: no evidence of a difference
            stat = 0.0
        else:
            stat = diff / se
            p_value = _norm_sf(stat)
    elif method == "fisher":
        p_value = _fisher_greater(x1, n1, x2, n2)
    else:
        rng = np.random.default_rng(seed)
        b = int(n_boot)
        if b < 100:
            raise AnalysisInputError("n_boot must be at least 100", "value")
        null1 = rng.binomial(n1, pooled, b) / n1
        null2 = rng.binomial(n2, pooled, b) / n2
        p_value = (1 + int(np.count_nonzero(null1 - null2 >= diff - 1e-15))) / (b + 1)
        d = rng.binomial(n1, p1, b) / n1 - rng.binomial(n2, p2, b) / n2
        ci_low, ci_high = (float(v) for v in np.quantile(d, [alpha / 2, 1 - alpha / 2]))

    verdict = REGRESSION if (p_value < alpha and diff > 0) else WITHIN_NOISE
    name = {"z": "one-sided two-proportion z-test", "fisher": "one-sided Fisher exact test",
            "bootstrap": "one-sided parametric bootstrap"}[method]
    detail = f"z={stat:.2f}, " if stat is not None and method == "z" else ""
    cmp = "<" if p_value < alpha else ">="
    message = (
        f"{verdict}: candidate flips {x1}/{n1} ({100 * p1:.2f}%) vs noise floor "
        f"{x2}/{n2} ({100 * p2:.2f}%); {name}: {detail}p={p_value:.3g} {cmp} {alpha:g}"
    )
    return NoiseComparison(
        verdict=verdict,
        method=method,
        p_value=float(p_value),
        alpha=float(alpha),
        candidate_flips=x1,
        candidate_n=n1,
        secondary_flips=x2,
        secondary_n=n2,
        candidate_rate=p1,
        secondary_rate=p2,
        difference=diff,
        ci_low=float(ci_low),
        ci_high=float(ci_high),
        statistic=None if stat is None else float(stat),
        message=message,
    )


def _flip_counts(m: PositionMetrics | Sequence[PositionMetrics]) -> tuple[int, int]:
    runs = [m] if isinstance(m, PositionMetrics) else list(m)
    flips = sum(int(np.count_nonzero(r.flip)) for r in runs)
    n = sum(r.n for r in runs)
    return flips, n


def compare_to_noise(
    candidate: PositionMetrics | Sequence[PositionMetrics],
    secondary: PositionMetrics | Sequence[PositionMetrics],
    **kwargs: Any,
) -> NoiseComparison:
    """:func:`compare_flip_rates` on forced-mode metrics (one run, or several pooled)."""
    x1, n1 = _flip_counts(candidate)
    x2, n2 = _flip_counts(secondary)
    return compare_flip_rates(x1, n1, x2, n2, **kwargs)


@dataclass(frozen=True)
class KLComparison:
    verdict: str
    p_value: float
    alpha: float
    candidate_mean: float
    secondary_mean: float
    statistic: float
    message: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_kl_means(
    candidate_kl: np.ndarray | Sequence[float],
    secondary_kl: np.ndarray | Sequence[float],
    *,
    alpha: float = 0.05,
) -> KLComparison:
    """One-sided Welch z-test: is the candidate's mean KL above the secondary's?
    (KL is heavy-tailed: use it with a few hundred positions or more.)"""
    a = np.asarray(candidate_kl, dtype=np.float64)
    b = np.asarray(secondary_kl, dtype=np.float64)
    if a.size < 2 or b.size < 2:
        raise AnalysisInputError("compare_kl_means: need at least 2 positions per run", "empty")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise AnalysisInputError("compare_kl_means: non-finite KL values", "non_finite")
    ma, mb = float(a.mean()), float(b.mean())
    se = math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    if se == 0.0:
        z = math.inf if ma > mb else 0.0
        p = 0.0 if ma > mb else 1.0
    else:
        z = (ma - mb) / se
        p = _norm_sf(z)
    verdict = REGRESSION if p < alpha and ma > mb else WITHIN_NOISE
    msg = (f"{verdict}: mean KL {ma:.6g} (n={a.size}) vs noise floor {mb:.6g} (n={b.size}); "
           f"one-sided Welch z-test z={z:.2f}, p={p:.3g}")
    return KLComparison(verdict, float(p), float(alpha), ma, mb, float(z), msg)
