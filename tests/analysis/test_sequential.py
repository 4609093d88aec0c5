"""The betting confidence sequences (tensorverse.analysis.sequential), value by value (issue 27).

Every expected number here is recomputed in the test from the formulas of the module docstring:
a plain loop for the wealth, the documented grid (steps of 0.025) and 16 halvings for the
bounds, the documented 200 bets for the turns still needed. None is taken from the module."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensorverse.analysis import sequential
from tensorverse.analysis.sequential import Bounds

TRUNC = 0.75


def _loop_path(y, m_excess, side):
    """The log-wealth after each observation, one observation at a time."""
    m = (m_excess + 1) / 2
    total, sq, logw, out = 0.0, 0.0, 0.0, []
    mu_prev, var_prev = 0.5, 0.25
    for i, yi in enumerate(y, start=1):
        x = (yi + 1) / 2
        d = mu_prev - m
        lam = d / (var_prev + d * d)
        if side == "lower":
            lam = min(max(lam, 0.0), TRUNC / m if m > 0 else math.inf)
            logw += math.log(1 + lam * (x - m))
        else:
            lam = min(max(-lam, 0.0), TRUNC / (1 - m) if m < 1 else math.inf)
            logw += math.log(1 - lam * (x - m))
        out.append(logw)
        sq += (x - mu_prev) ** 2
        total += x
        mu_prev = (0.5 + total) / (i + 1)
        var_prev = (0.25 + sq) / (i + 1)
    return out


def _loop(y, m_excess, side):
    p = _loop_path(y, m_excess, side)
    return p[-1] if p else 0.0


def _ref_edge(y, side, alpha):
    """The documented search: candidates -1, -0.975, ..., 1 (from +1 down for the upper side),
    then 16 halvings between the last rejected and the first kept candidate."""
    thr = math.log(1 / alpha)
    grid = [-1 + 0.025 * k for k in range(81)]
    if side == "upper":
        grid = grid[::-1]
    rej = [_loop(y, g, side) >= thr for g in grid]
    if not rej[0]:
        return grid[0]
    if all(rej):
        return grid[-1]
    k = rej.index(False)
    inside, outside = grid[k - 1], grid[k]
    for _ in range(16):
        mid = (inside + outside) / 2
        if _loop(y, mid, side) >= thr:
            inside = mid
        else:
            outside = mid
    return inside


def _ref_turns(y, m_excess, side, alpha):
    now = _loop(y, m_excess, side)
    need = math.log(1 / alpha) - now
    if need <= 0:
        return 0.0
    xs = [(v + 1) / 2 for v in y] or [0.5]
    m = (m_excess + 1) / 2
    s = 1.0 if side == "lower" else -1.0
    cap = TRUNC / (m if side == "lower" else 1 - m)
    best = max(sum(math.log1p(cap * j / 200 * s * (x - m)) for x in xs) / len(xs) for j in range(1, 201))
    return None if best <= 1e-12 else need / best


# a stream with structure: mostly zeros, some breaks, some breaks of the floor, some fractions
_Y = [0.0, 1.0, 0.0, 0.0, -1.0, 0.5, 0.0, 1.0, 0.0, 0.25, 0.0, 1.0, -0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 0.75, 0.0] * 3


@pytest.mark.parametrize("side", ["lower", "upper"])
@pytest.mark.parametrize("m", [-0.9, -0.3, 0.0, 0.005, 0.4, 0.95])
def test_log_wealth_path_is_the_loop_at_every_look(side, m):
    got = sequential.log_wealth_path(np.array(_Y), m, side)
    assert got.shape == (len(_Y),)
    np.testing.assert_allclose(got, _loop_path(_Y, m, side), rtol=0, atol=1e-12)
    assert sequential.log_wealth(np.array(_Y), m, side).tolist() == pytest.approx([_loop(_Y, m, side)], abs=1e-12)


def test_the_extreme_candidates():
    # "mean <= -1" against one observation at 0: x = 1/2, m = 0, lam_1 = 0.5 / (0.25 + 0.25) = 1
    # (no cap at m = 0), wealth 1 + 1 * 0.5
    assert sequential.log_wealth_path(np.array([0.0]), -1.0, "lower").tolist() == pytest.approx([math.log(1.5)])
    assert sequential.log_wealth(np.array([0.0]), -1.0, "lower").tolist() == pytest.approx([math.log(1.5)])
    assert sequential.log_wealth_path(np.array([0.0]), 1.0, "upper").tolist() == pytest.approx([math.log(1.5)])
    assert sequential.log_wealth(np.array([0.0]), 1.0, "upper").tolist() == pytest.approx([math.log(1.5)])
    # "mean <= 1" is never rejected: no bet is placed, the wealth stays 1
    assert sequential.log_wealth_path(np.array([1.0, 0.0, -1.0]), 1.0, "lower").tolist() == [0.0, 0.0, 0.0]
    assert sequential.log_wealth_path(np.array([1.0, 0.0, -1.0]), -1.0, "upper").tolist() == [0.0, 0.0, 0.0]
    # a candidate above every running mean: no bet at all
    assert sequential.log_wealth_path(np.array([1.0, 1.0]), 0.8, "lower").tolist() == [0.0, 0.0]
    # one at -0.2 (m = 0.4) after x = 1, 1: lam_1 = 0.1 / 0.26, lam_2 = 0.35 / (0.25 + 0.35^2), then
    # capped at 0.75 / 0.4
    lam1 = 0.1 / (0.25 + 0.01)
    lam2 = min(0.35 / (0.25 + 0.35 ** 2), TRUNC / 0.4)
    assert sequential.log_wealth_path(np.array([1.0, 1.0]), -0.2, "lower").tolist() == pytest.approx(
        [math.log(1 + lam1 * 0.6), math.log(1 + lam1 * 0.6) + math.log(1 + lam2 * 0.6)], abs=1e-12)


def test_the_cap_binds_on_both_sides():
    # a stream of zeros: the running variance shrinks as 0.25 / (k + 1) and the bet
    # d / (var + d^2) at m = 0.5 -+ 0.05 grows past the cap 0.75 / m (0.75 / (1 - m)), 191 times of 200
    y = [0.0] * 200
    for side, m in (("lower", -0.1), ("upper", 0.1)):
        np.testing.assert_allclose(sequential.log_wealth_path(np.array(y), m, side), _loop_path(y, m, side),
                                   rtol=0, atol=1e-10)
        assert sequential.log_wealth(np.array(y), m, side)[0] == pytest.approx(_loop(y, m, side), abs=1e-10)
    # at the cap every turn after the first multiplies the wealth by 1 + 0.75 / 0.45 * 0.05
    path = sequential.log_wealth_path(np.array(y), -0.1, "lower")
    assert path[-1] - path[-2] == pytest.approx(math.log(1 + TRUNC / 0.45 * 0.05), abs=1e-12)
    path = sequential.log_wealth_path(np.array(y), 0.1, "upper")
    assert path[-1] - path[-2] == pytest.approx(math.log(1 + TRUNC / 0.45 * 0.05), abs=1e-12)


@pytest.mark.parametrize("side", ["lower", "upper"])
def test_log_wealth_of_many_candidates_in_chunks(side):
    """100,000 observations: the candidates are taken 40 at a time, 81 of them in 3 chunks."""
    rng = np.random.default_rng(27)
    y = rng.choice([-1.0, 0.0, 0.0, 0.0, 0.0, 1.0], size=100_000)
    grid = np.linspace(-0.999, 0.999, 81)
    got = sequential.log_wealth(y, grid, side)
    assert got.shape == (81,)
    # the same formulas, one candidate at a time, written out here
    x = (y + 1) / 2
    k = np.arange(1, x.size + 1)
    mu_prev = np.r_[0.5, ((0.5 + np.cumsum(x)) / (k + 1))[:-1]]
    var_prev = np.r_[0.25, ((0.25 + np.cumsum((x - mu_prev) ** 2)) / (k + 1))[:-1]]
    want = []
    for g in grid:
        m = (g + 1) / 2
        d = mu_prev - m
        lam = d / (var_prev + d * d)
        if side == "lower":
            want.append(np.log1p(np.clip(lam, 0, TRUNC / m) * (x - m)).sum())
        else:
            want.append(np.log1p(-np.clip(-lam, 0, TRUNC / (1 - m)) * (x - m)).sum())
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-6)


def test_empty_streams_and_shapes():
    assert sequential.log_wealth_path(np.array([]), 0.0, "lower").shape == (0,)
    assert sequential.log_wealth(np.array([]), [0.1, 0.2, 0.3], "upper").tolist() == [0.0, 0.0, 0.0]
    assert sequential.log_wealth(np.array([0.0]), 0.0, "lower").shape == (1,)
    assert sequential.grid_bounds(np.array([]), 0.05) == (-1.0, 1.0)
    assert sequential.bounds(np.array([]), 0.05) == Bounds(n=0, estimate=None, low=-1.0, high=1.0, log_wealth_zero=0.0)
    assert sequential.bounds([], 0.05) == Bounds(n=0, estimate=None, low=-1.0, high=1.0, log_wealth_zero=0.0)


def test_observations_are_checked_at_the_edges():
    edge = np.array([-1.0, 1.0])
    assert sequential.log_wealth_path(edge, 0.0, "lower").tolist() == pytest.approx(_loop_path([-1.0, 1.0], 0.0, "lower"))
    for bad in ([-1.0 - 1e-12], [1.0 + 1e-12], [math.inf], [-math.inf], [0.0, math.nan]):
        with pytest.raises(ValueError, match=r"^observations must lie in \[-1, 1\]$"):
            sequential.log_wealth(np.array(bad), 0.0, "lower")
        with pytest.raises(ValueError, match=r"^observations must lie in \[-1, 1\]$"):
            sequential.log_wealth_path(np.array(bad), 0.0, "upper")
    with pytest.raises(ValueError, match="^observations must be one-dimensional$"):
        sequential.log_wealth(np.zeros((2, 2)), 0.0, "lower")
    with pytest.raises(ValueError, match="^observations must be one-dimensional$"):
        sequential.log_wealth(np.float64(0.0), 0.0, "lower")


def test_the_side_is_checked():
    for f in (sequential.log_wealth, sequential.log_wealth_path):
        for side in ("both", "Lower", ""):
            with pytest.raises(ValueError, match="^side is 'lower' or 'upper'$"):
                f(np.array([0.0, 1.0]), 0.0, side)
    with pytest.raises(ValueError, match="^side is 'lower' or 'upper'$"):
        sequential.log_wealth(np.array([]), 0.0, "up")  # checked before the stream is looked at


@pytest.mark.parametrize("alpha", [0.05, 0.2])
def test_bounds_are_the_documented_search(alpha):
    for y in (_Y, [0.0] * 50, [1.0, 0.0, 0.0, 1.0, 0.0] * 8, [-1.0, -1.0, 0.0, -0.5] * 10):
        b = sequential.bounds(np.array(y), alpha)
        assert b.n == len(y)
        assert b.estimate == pytest.approx(sum(y) / len(y), abs=1e-15)
        assert b.low == pytest.approx(_ref_edge(y, "lower", alpha), abs=1e-12)
        assert b.high == pytest.approx(_ref_edge(y, "upper", alpha), abs=1e-12)
        assert b.log_wealth_zero == pytest.approx(_loop(y, 0.0, "lower"), abs=1e-12)
        assert sequential.grid_bounds(np.array(y), alpha) == (b.low, b.high)


def test_bounds_at_the_ends_of_the_scale():
    # nothing above -1 to bet on: -1 is kept, the lower bound is -1 itself; the same at +1
    assert sequential.grid_bounds(np.array([-1.0] * 30), 0.05)[0] == -1.0
    assert sequential.grid_bounds(np.array([1.0] * 30), 0.05)[1] == 1.0
    assert sequential.grid_bounds(np.array([-1.0] * 30), 0.05)[1] == pytest.approx(
        _ref_edge([-1.0] * 30, "upper", 0.05), abs=1e-12)
    # a lower bound between the first two candidates (-1 and -0.975): found by halving from -1
    y = [-0.98] * 200
    low = sequential.grid_bounds(np.array(y), 0.05)[0]
    assert -1.0 < low < -0.975 and low == pytest.approx(_ref_edge(y, "lower", 0.05), abs=1e-12)
    # one observation at a loose level: both bounds move off the ends
    assert sequential.grid_bounds(np.array([0.0]), 0.7) == pytest.approx(
        (_ref_edge([0.0], "lower", 0.7), _ref_edge([0.0], "upper", 0.7)), abs=1e-12)
    assert sequential.grid_bounds(np.array([0.0]), 0.7)[0] > -1.0
    # alpha = 1: a wealth of 1 already "rejects", every candidate is rejected on both sides
    assert sequential.grid_bounds(np.zeros(10), 1.0) == (1.0, -1.0)
    assert sequential.rejects(np.zeros(3), 0.5, "lower", 1.0) is True
    assert sequential.rejects(np.zeros(3), -0.5, "upper", 1.0) is True


def test_rejects_at_the_threshold():
    y = np.array(_Y)
    lw = _loop(_Y, 0.0, "lower")
    assert lw > 0
    # alpha with log(1/alpha) just below and just above the wealth
    assert sequential.rejects(y, 0.0, "lower", math.exp(-lw) * (1 + 1e-9)) is True
    assert sequential.rejects(y, 0.0, "lower", math.exp(-lw) * (1 - 1e-9)) is False
    up = _loop(_Y, 0.6, "upper")
    assert sequential.rejects(y, 0.6, "upper", math.exp(-up) * (1 + 1e-9)) is True
    assert sequential.rejects(y, 0.6, "upper", math.exp(-up) * (1 - 1e-9)) is False


@pytest.mark.parametrize("y,m,side,alpha", [
    ([0.0] * 10, 0.005, "upper", 0.05),
    ([0.0] * 10, 0.0, "lower", 0.05),  # no excess: the lower test never rejects
    ([1.0, 0.0, 0.0, 0.0] * 5, 0.0, "lower", 0.05),
    ([1.0, 0.0, 0.0, 0.0] * 5, 0.005, "upper", 0.05),
    ([1.0, 0.0, -1.0, 0.0, 0.0] * 4, 0.3, "upper", 0.1),
    ([1.0, 0.0, 1.0] * 20, 0.0, "lower", 0.05),  # already rejects: 0
    ([0.0] * 400, 0.01, "upper", 0.05),
    ([], 0.005, "upper", 0.05),  # no stream: zeros from here on
    ([], 0.0, "lower", 0.05),
    ([], 0.0, "lower", 1.0),  # nothing needed at alpha = 1
    ([0.5, -0.25, 0.0], -0.4, "lower", 0.2),
    ([1.0, -1.0] * 150 + [1.0], 0.0, "lower", 0.05),  # a weak signal: the smallest of the 200 bets is best
])
def test_turns_to_cross_is_the_gap_over_the_best_growth(y, m, side, alpha):
    got = sequential.turns_to_cross(np.array(y), m, side, alpha)
    want = _ref_turns(y, m, side, alpha)
    if want is None:
        assert got is None
    else:
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_turns_to_cross_closed_form_without_a_stream():
    # no observation: x = 1/2 from now on, m = (0.005 + 1) / 2, the upper bet at its cap 0.75 / (1 - m)
    m = 1.005 / 2
    g = math.log1p(TRUNC / (1 - m) * (m - 0.5))
    assert sequential.turns_to_cross(np.array([]), 0.005, "upper", 0.05) == pytest.approx(math.log(20) / g, rel=1e-12)
    assert sequential.turns_to_cross(np.array([]), -0.005, "lower", 0.05) == pytest.approx(math.log(20) / g, rel=1e-12)
