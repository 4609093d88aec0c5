"""The verdict (issue 25): turn-level anytime-valid bounds, decisions, rows from stores and exports."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tensorverse.analysis import sequential
from tensorverse.analysis.attribution import excess_flip_rate
from tensorverse.analysis.simulate import Clustered, draw
from tensorverse.analysis.verdict import TurnEvidence, VerdictPolicy, decide, fixed_sample_interval


# --------------------------------------------------------------------------- the betting bounds


def _loop_log_wealth(y, m_excess, side):
    """The formulas of the module docstring, one observation at a time (independent of numpy's
    vectorised version): the plain loop of tests/analysis/test_sequential.py."""
    from tests.analysis.test_sequential import _loop  # type: ignore[import-not-found]

    return _loop(y, m_excess, side)


@pytest.mark.parametrize("side", ["lower", "upper"])
def test_log_wealth_matches_a_plain_loop(side):
    rng = np.random.default_rng(3)
    y = rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], size=400) * rng.random(400)
    for m in (-0.2, 0.0, 0.004, 0.3):
        got = sequential.log_wealth(y, m, side)[0]
        assert got == pytest.approx(_loop_log_wealth(y, m, side), abs=1e-9)
        assert sequential.log_wealth_path(y, m, side)[-1] == pytest.approx(got, abs=1e-9)


def test_bounds_bracket_the_mean_and_shrink():
    y = np.zeros(50)
    b50 = sequential.bounds(y, 0.05)
    b2000 = sequential.bounds(np.zeros(2000), 0.05)
    assert b50.low < 0 < b50.high and b2000.low < 0 < b2000.high
    assert b2000.high < b50.high / 10
    # every value below low is rejected by the lower test, the value just above it is not
    for b, yy in ((b50, y), (b2000, np.zeros(2000))):
        assert sequential.rejects(yy, b.low - 1e-3, "lower", 0.05)
        assert not sequential.rejects(yy, b.low + 0.002, "lower", 0.05)
        assert sequential.rejects(yy, b.high + 1e-3, "upper", 0.05)


def test_out_of_range_observations_are_refused():
    with pytest.raises(ValueError):
        sequential.bounds(np.array([0.5, 2.0]), 0.05)
    with pytest.raises(ValueError):
        sequential.bounds(np.array([np.nan]), 0.05)


# --------------------------------------------------------------------------- coverage on clustered data


def _newcombe(s):
    e = excess_flip_rate(int(s.flips.sum()), int(s.positions.sum()), int(s.floor_flips.sum()),
                         int(s.positions.sum()))
    return e.low, e.high


def test_position_level_interval_fails_where_flips_cluster_and_the_turn_level_ones_hold():
    """The issue's measurement: 20 % of turns hit hard, 300 turns of 50-300 positions. Today's
    position-level interval (positions as independent trials) covers the true excess far less
    than 95 %; the turn-level bounds (anytime-valid, and the one-look cluster bootstrap) do."""
    # a noise-free floor (vLLM-CPU's secondary is bit-identical), runtime flips in 20 % of turns
    p = Clustered(hard=0.2, hard_rate=0.0, concentration=8).with_excess(flips=0.004)
    rng = np.random.default_rng(25)
    truth = 0.004
    cover = {"position": 0, "sequence": 0, "bootstrap": 0}
    runs = 150
    for _ in range(runs):
        s = draw(p, 300, rng)
        lo, hi = _newcombe(s)
        cover["position"] += lo <= truth <= hi
        b = sequential.bounds(s.flip_excess(), 0.05)
        cover["sequence"] += b.low <= truth <= b.high
        lo, hi = fixed_sample_interval(s.flip_excess(), n_resamples=999)
        cover["bootstrap"] += lo <= truth <= hi
    rates = {k: v / runs for k, v in cover.items()}
    assert rates["position"] < 0.6, rates
    assert rates["sequence"] >= 0.95, rates
    assert rates["bootstrap"] >= 0.88, rates  # 0.93 expected: 150 datasets leave +-2 %


def test_noise_only_shadow_watched_after_every_turn_rarely_looks_like_a_regression():
    p = Clustered(hard=0.2, hard_rate=0.06, concentration=8, break_hard=0.4)
    rng = np.random.default_rng(7)
    false_turn, false_flips, false_position = 0, 0, 0
    runs = 200
    for _ in range(runs):
        s = draw(p, 600, rng)
        path = sequential.log_wealth_path(s.break_excess(), 0.0, "lower")
        false_turn += bool(path.size) and path.max() >= math.log(20)
        false_flips += sequential.log_wealth_path(s.flip_excess(), 0.0, "lower").max() >= math.log(20)
        # today's rule, looked at every 25 turns: the Newcombe lower bound above 0
        for t in range(25, 601, 25):
            e = excess_flip_rate(int(s.flips[:t].sum()), int(s.positions[:t].sum()),
                                 int(s.floor_flips[:t].sum()), int(s.positions[:t].sum()))
            if e.low > 0:
                false_position += 1
                break
    assert false_turn / runs <= 0.05
    assert false_flips / runs <= 0.05
    # what the old rule does on the same flips, looked at only 24 times (measured: 11 %)
    assert false_position / runs > 0.08


def test_a_real_excess_is_found():
    p = Clustered().with_excess(breaks=0.12)
    rng = np.random.default_rng(11)
    found = 0
    for _ in range(50):
        s = draw(p, 400, rng)
        found += sequential.rejects(s.break_excess(), 0.0, "lower", 0.05)
    assert found >= 45


# --------------------------------------------------------------------------- decisions


def _ev(i, *, tool=True, broke=False, floor_broke=False, flips=0, floor_flips=0, n=40, t0=0, step=60e9):
    return TurnEvidence(turn_id=f"t{i:05d}", session_id=f"s{i // 5}", created_ns=int(t0 + i * step),
                        positions=n, flips=flips, floor_positions=n, floor_flips=floor_flips,
                        tool_positions=10, tool_flips=min(flips, 10), floor_tool_positions=10,
                        floor_tool_flips=min(floor_flips, 10),
                        tool_call_turn=tool, broke=broke if tool else None,
                        floor_broke=floor_broke if tool else None)


def test_decisions():
    pol = VerdictPolicy()
    bad = decide("fp8", "shadow", [_ev(i, broke=i % 2 == 0, flips=3) for i in range(60)], pol, floor_backend="sec")
    assert bad.decision == "regression"
    assert bad.tool_call_break_excess.low > 0 and bad.turns_needed == 0
    good = decide("fp32", "shadow", [_ev(i) for i in range(1200)], pol, floor_backend="sec")
    assert good.decision == "equivalent"
    assert good.tool_call_break_excess.high < pol.tool_call_break_margin
    early = decide("fp32", "shadow", [_ev(i) for i in range(10)], pol, floor_backend="sec")
    assert early.decision == "undecided"
    assert 600 < early.turns_needed < 1000
    # 10 tool-calling turns a minute apart: 60 an hour
    assert early.tool_call_turns_per_hour == pytest.approx(60.0)
    assert early.hours_needed == pytest.approx(early.turns_needed / 60.0)


def test_breaks_the_floor_shares_are_not_an_excess():
    pol = VerdictPolicy()
    both = [_ev(i, broke=i % 3 == 0, floor_broke=i % 3 == 0) for i in range(300)]
    v = decide("cand", "shadow", both, pol, floor_backend="sec")
    assert v.decision != "regression"
    assert v.tool_call_break_excess.estimate == 0.0
    assert v.tool_call_breaks == 100 and v.floor_tool_call_breaks == 100
    # without the floor the same breaks are a regression
    alone = [_ev(i, broke=i % 3 == 0) for i in range(300)]
    assert decide("cand", "shadow", alone, pol).decision == "regression"


def test_turns_not_calling_tools_do_not_count_for_the_primary_endpoint():
    ev = [_ev(i, tool=False, flips=5) for i in range(100)]
    v = decide("cand", "shadow", ev, VerdictPolicy(), floor_backend="sec")
    assert v.tool_call_turns == 0 and v.turns == 100
    assert v.decision == "undecided"
    assert v.flip_excess.estimate == pytest.approx(5 / 40)
    assert v.flip_excess.low > 0  # flips are shown with their own bounds, beside the decision


def test_policy_is_checked():
    with pytest.raises(ValueError):
        VerdictPolicy(confidence=1.0)
    with pytest.raises(ValueError):
        VerdictPolicy(tool_call_break_margin=0.0)


def test_verdict_json_is_plain(tmp_path):
    from tensorverse.verdict_cli import verdicts_json

    v = decide("x", "shadow", [_ev(i) for i in range(5)], VerdictPolicy(), floor_backend="sec")
    d = verdicts_json([v], VerdictPolicy())
    json.dumps(d, allow_nan=False)
    s = d["shadows"][0]
    for k in ("backend", "decision", "turns", "tool_call_turns", "turns_needed", "method"):
        assert k in s
    for k in ("tool_call_break_excess", "flip_excess"):
        assert set(s[k]) >= {"estimate", "low", "high"}


def test_per_turn_values_subtract_the_floor_exactly():
    e = TurnEvidence(turn_id="t", session_id="s", created_ns=0, positions=40, flips=6, floor_positions=20,
                     floor_flips=1, tool_positions=10, tool_flips=3, floor_tool_positions=5, floor_tool_flips=2,
                     tool_call_turn=True, broke=False, floor_broke=True)
    assert e.flip_excess() == pytest.approx(6 / 40 - 1 / 20)
    assert e.tool_flip_excess() == pytest.approx(3 / 10 - 2 / 5)
    assert e.break_excess() == -1.0
    bare = TurnEvidence(turn_id="t", session_id=None, created_ns=0, positions=8, flips=2, tool_positions=4,
                        tool_flips=1, tool_call_turn=True, broke=True)
    assert bare.flip_excess() == 0.25 and bare.tool_flip_excess() == 0.25 and bare.break_excess() == 1.0
    none = TurnEvidence(turn_id="t", session_id=None, created_ns=0, tool_call_turn=False, broke=True)
    assert none.flip_excess() is None and none.tool_flip_excess() is None and none.break_excess() is None


def test_tool_region_counts_by_class():
    from tensorverse.analysis.verdict import _tool_counts

    by = {"tool_name": {"runtime": 1, "tie": 2}, "tool_args": {"runtime": 3}, "content": {"runtime": 9}}
    pos = {"tool_name": 4, "tool_args": 6, "content": 30}
    assert _tool_counts(by, pos, "runtime") == (10, 4)
    assert _tool_counts(by, pos, None) == (10, 6)  # every class (the secondary's flips)
    assert _tool_counts(None, pos, "runtime") == (10, None)
    assert _tool_counts(by, None, "runtime") == (None, None)


@pytest.mark.parametrize("kw", [{"confidence": 0.49}, {"confidence": 1.0}, {"tool_call_break_margin": 1.0},
                                {"flip_margin": 0.0}, {"flip_margin": 1.0}])
def test_policy_edges_are_refused(kw):
    with pytest.raises(ValueError):
        VerdictPolicy(**kw)
    VerdictPolicy(confidence=0.5, tool_call_break_margin=0.999, flip_margin=1e-6)  # the edges that are allowed
