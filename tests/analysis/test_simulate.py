"""The clustered turn streams of the verdict's simulations (tensorverse/analysis/simulate.py).

`draw` is checked by what it must produce, on large seeded samples (tens of thousands of turns,
a fraction of a second): the ranges, the shares of hard, tool-calling and broken turns, the mean
and spread of the Beta flip rates, where the excess goes. The bounds are 6 standard errors wide
or more, computed in the test from the documented model, so a seed cannot make a test flaky.
`fit` is checked on hand-made turns, the expected parameters computed by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensorverse.analysis.simulate import Clustered, Stream, draw, fit
from tensorverse.analysis.verdict import TurnEvidence


def _se_mean(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / math.sqrt(values.size))


def _near(values: np.ndarray, want: float, sd: float | None = None, k: float = 6.0) -> None:
    """The mean of `values` is `want` within k standard errors (of the data, or of `sd`)."""
    values = np.asarray(values, dtype=np.float64)
    se = _se_mean(values) if sd is None else sd / math.sqrt(values.size)
    assert abs(float(values.mean()) - want) <= k * se + 1e-12, (float(values.mean()), want, se)


def test_the_default_parameters():
    # the documented simulations (docs/verdict.md, benchmarks/verdict.py) use these defaults
    p = Clustered()
    assert (p.hard, p.hard_rate, p.concentration, p.easy_rate) == (0.2, 0.05, 20.0, 0.0)
    assert (p.min_positions, p.max_positions) == (50, 300)
    assert (p.tool_call, p.break_hard, p.break_easy) == (0.6, 0.3, 0.005)
    assert (p.flip_excess, p.break_excess) == (0.0, 0.0)


def test_with_excess_sets_both_excesses_and_keeps_the_rest():
    base = Clustered(hard=0.3, hard_rate=0.1, flip_excess=0.7, break_excess=0.8)
    q = base.with_excess(flips=0.01, breaks=0.02)
    assert (q.flip_excess, q.break_excess) == (0.01, 0.02)
    assert (q.hard, q.hard_rate) == (0.3, 0.1)
    # the defaults are no excess at all (an A/A shadow)
    assert base.with_excess() == Clustered(hard=0.3, hard_rate=0.1)
    assert base.with_excess(flips=0.03).break_excess == 0.0
    assert base.with_excess(breaks=0.04).flip_excess == 0.0


def test_stream_excesses_are_per_turn_differences():
    s = Stream(
        positions=np.array([10, 20, 40, 5]),
        flips=np.array([3, 0, 4, 5]),
        floor_flips=np.array([1, 2, 4, 0]),
        tool_call=np.array([True, False, True, True]),
        broke=np.array([True, True, False, False]),
        floor_broke=np.array([False, False, True, False]),
        hard=np.array([True, False, True, False]),
    )
    want = [(3 - 1) / 10, (0 - 2) / 20, 0.0, 1.0]
    assert s.flip_excess().tolist() == pytest.approx(want, abs=1e-15)
    be = s.break_excess()
    # only the tool-calling turns, as floats (booleans would not subtract)
    assert be.dtype == np.float64
    assert be.tolist() == [1.0, -1.0, 0.0]


def test_positions_span_both_ends_inclusive():
    rng = np.random.default_rng(1)
    s = draw(Clustered(min_positions=3, max_positions=5), 3000, rng)
    assert s.positions.shape == (3000,)
    assert set(s.positions.tolist()) == {3, 4, 5}
    s = draw(Clustered(min_positions=7, max_positions=7), 200, rng)
    assert set(s.positions.tolist()) == {7}
    for arr in (s.flips, s.floor_flips, s.tool_call, s.broke, s.floor_broke, s.hard):
        assert arr.shape == (200,)


def test_shares_of_hard_tool_calling_and_broken_turns():
    n = 40000
    p = Clustered(hard=0.3, tool_call=0.45, break_hard=0.25, break_easy=0.05)
    s = draw(p, n, np.random.default_rng(2))
    for arr, share in ((s.hard, 0.3), (s.tool_call, 0.45)):
        _near(arr, share, sd=math.sqrt(share * (1 - share)))
    h, e = s.hard, ~s.hard
    for arr in (s.broke, s.floor_broke):
        _near(arr[h], 0.25, sd=math.sqrt(0.25 * 0.75))
        _near(arr[e], 0.05, sd=math.sqrt(0.05 * 0.95))
    # independent draws: the shadow's and the floor's breaks are not the same array
    assert not np.array_equal(s.broke, s.floor_broke)


def test_hard_turns_flip_at_a_beta_rate_shared_by_the_shadow_and_the_floor():
    n = 40000
    a_mean, conc = 0.05, 20.0
    p = Clustered(hard=0.5, hard_rate=a_mean, concentration=conc, easy_rate=0.0,
                  min_positions=400, max_positions=400)
    s = draw(p, n, np.random.default_rng(3))
    h = s.hard
    r_floor = s.floor_flips[h] / 400
    r_shadow = s.flips[h] / 400
    beta_var = a_mean * (1 - a_mean) / (conc + 1)
    # per-turn rate = Beta + binomial noise: Var = E[r(1-r)]/n + Var(Beta)
    binom_var = (a_mean * (1 - a_mean) - beta_var) / 400
    sd = math.sqrt(beta_var + binom_var)
    _near(r_floor, a_mean, sd=sd)
    _near(r_shadow, a_mean, sd=sd)
    # the spread is the Beta's (concentration = a + b), not a fixed rate's binomial spread
    assert float(r_floor.var(ddof=1)) == pytest.approx(beta_var + binom_var, rel=0.05)
    # the floor and the shadow share each turn's rate: their per-turn rates correlate
    corr = float(np.corrcoef(r_floor, r_shadow)[0, 1])
    want = beta_var / (beta_var + binom_var)
    assert corr == pytest.approx(want, abs=0.03)
    # easy turns flip at easy_rate = 0: never
    assert not s.flips[~h].any() and not s.floor_flips[~h].any()


def test_easy_turns_flip_at_the_easy_rate():
    n = 20000
    p = Clustered(hard=0.0, easy_rate=0.02, min_positions=100, max_positions=100)
    s = draw(p, n, np.random.default_rng(4))
    assert not s.hard.any()
    sd = math.sqrt(0.02 * 0.98 / 100)
    _near(s.floor_flips / 100, 0.02, sd=sd)
    _near(s.flips / 100, 0.02, sd=sd)


def test_no_hard_rate_means_hard_turns_do_not_flip():
    s = draw(Clustered(hard=0.5, hard_rate=0.0), 2000, np.random.default_rng(5))
    assert s.hard.any()
    assert not s.flips.any() and not s.floor_flips.any()


def test_the_flip_excess_lives_in_the_hard_turns_with_the_documented_mean():
    n = 40000
    p = Clustered(hard=0.25, hard_rate=0.04, concentration=10.0, easy_rate=0.0,
                  min_positions=500, max_positions=500).with_excess(flips=0.02)
    s = draw(p, n, np.random.default_rng(6))
    exc = s.flip_excess()
    # the mean excess over all turns is flip_excess
    _near(exc, 0.02)
    # per hard turn it is flip_excess / hard (Beta of that mean), none on easy turns
    _near(exc[s.hard], 0.02 / 0.25)
    assert not s.flips[~s.hard].any()
    # its spread is a Beta's of concentration 10 (two Betas and binomial noise added)
    m = 0.02 / 0.25
    var_extra = m * (1 - m) / (10 + 1)
    assert float(exc[s.hard].var(ddof=1)) > var_extra


def test_a_flip_excess_beyond_every_hard_turn_is_capped():
    # flip_excess / hard = 2.5 > 1: the Beta's mean is capped just below 1
    p = Clustered(hard=0.2, hard_rate=0.05, min_positions=200, max_positions=200).with_excess(flips=0.5)
    s = draw(p, 4000, np.random.default_rng(7))
    h = s.hard
    rate = s.flips[h] / 200
    assert rate.max() <= 1.0
    assert float(rate.mean()) > 0.98
    assert not s.flips[~h].any()


def test_a_flip_excess_without_hard_turns_adds_nothing():
    s = draw(Clustered(hard=0.0).with_excess(flips=0.1), 500, np.random.default_rng(8))
    assert not s.flips.any() and not s.floor_flips.any()


def test_the_break_excess_is_added_to_every_turns_break_probability():
    n = 40000
    p = Clustered(hard=0.4, break_hard=0.3, break_easy=0.1).with_excess(breaks=0.15)
    s = draw(p, n, np.random.default_rng(9))
    h = s.hard
    _near(s.broke[h], 0.45, sd=math.sqrt(0.45 * 0.55))
    _near(s.broke[~h], 0.25, sd=math.sqrt(0.25 * 0.75))
    _near(s.floor_broke[h], 0.3, sd=math.sqrt(0.3 * 0.7))
    _near(s.floor_broke[~h], 0.1, sd=math.sqrt(0.1 * 0.9))
    # clipped at 1: a break probability beyond 1 breaks every turn
    s = draw(Clustered(break_hard=0.5, break_easy=0.5).with_excess(breaks=0.7), 300,
             np.random.default_rng(10))
    assert s.broke.all()
    # and at 0: a negative excess below the rate never breaks
    s = draw(Clustered(break_hard=0.2, break_easy=0.2).with_excess(breaks=-0.5), 300,
             np.random.default_rng(11))
    assert not s.broke.any() and s.floor_broke.any()


def test_draw_is_seeded():
    p = Clustered().with_excess(flips=0.01, breaks=0.02)
    a = draw(p, 50, np.random.default_rng(12))
    b = draw(p, 50, np.random.default_rng(12))
    for name in ("positions", "flips", "floor_flips", "tool_call", "broke", "floor_broke", "hard"):
        assert np.array_equal(getattr(a, name), getattr(b, name))


def _te(i, positions=None, flips=None, tool=False, broke=None):
    return TurnEvidence(turn_id=f"t{i}", session_id=None, created_ns=i, positions=positions,
                        flips=flips, tool_call_turn=tool, broke=broke)


def test_fit_takes_the_clustering_of_real_turns():
    turns = [
        _te(0, positions=100, flips=0, tool=True, broke=False),
        _te(1, positions=40, flips=4, tool=True, broke=True),
        _te(2, positions=200, flips=10),
        _te(3, positions=80, flips=None, tool=True, broke=None),  # None flips count 0
        _te(4, tool=True, broke=False),  # no forced run: not in the rates, in the tool share
    ]
    base = Clustered(concentration=7.0, easy_rate=0.001, break_hard=0.9, flip_excess=0.3,
                     tool_call=0.9)
    q = fit(turns, base)
    # forced turns: 0, 1, 2, 3; with a flip: 1 (0.1) and 2 (0.05)
    assert q.hard == pytest.approx(2 / 4)
    assert q.hard_rate == pytest.approx((4 / 40 + 10 / 200) / 2)
    assert (q.min_positions, q.max_positions) == (40, 200)
    # tool-calling turns with a known break: 0, 1, 4, over all 5 turns
    assert q.tool_call == pytest.approx(3 / 5)
    # the rest comes from the base
    assert (q.concentration, q.easy_rate, q.break_hard, q.flip_excess) == (7.0, 0.001, 0.9, 0.3)
    assert isinstance(q.min_positions, int) and isinstance(q.max_positions, int)
    assert isinstance(q.hard, float) and isinstance(q.tool_call, float)


def test_fit_without_flips_or_tool_calls_keeps_the_bases_rates():
    base = Clustered(hard=0.33, hard_rate=0.077, tool_call=0.44)
    q = fit([_te(0, positions=60, flips=0), _te(1, positions=60, flips=None)], base)
    assert (q.hard, q.hard_rate, q.tool_call) == (0.33, 0.077, 0.44)
    # one length only: the range is widened by one position
    assert (q.min_positions, q.max_positions) == (60, 61)


def test_fit_without_forced_turns_is_the_base():
    base = Clustered(hard=0.11)
    assert fit([], base) is base
    assert fit([_te(0, tool=True, broke=True), _te(1, positions=0, flips=0)], base) is base
    assert fit([]) == Clustered()
