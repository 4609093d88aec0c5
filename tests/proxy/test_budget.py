"""GPU-seconds per shadow (proxy/budget.py): a shadow over its daily budget starts no turn, a
decided one drops to the maintenance rate, and the spend is on /metrics and /verdict."""

from __future__ import annotations

import httpx
import pytest

from tensorverse.proxy.budget import DAY_S, ShadowBudget, gpu_seconds_of
from tensorverse.proxy.tee import TeeBackend
from tensorverse.store.records import Run

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _runs(*seconds):
    return [Run(id=f"r{i}", turn_id="t", backend="s1", mode="forced", timings={"request_s": s})
            for i, s in enumerate(seconds)]


def test_gpu_seconds_are_request_time_times_gpus_and_skip_runs_without_timing():
    assert gpu_seconds_of(_runs(0.5, 0.25), 4) == 3.0
    assert gpu_seconds_of([Run(id=f"r{i}", turn_id="t", backend="s1", mode="free", timings=t)
                           for i, t in enumerate(({}, {"request_s": None}, {"request_s": -1}))], 2) == 0.0


def test_a_shadow_over_its_daily_budget_starts_nothing_until_the_day_rolls_over():
    clock = Clock()
    b = ShadowBudget(gpus={"fp8": 2}, per_day={"fp8": 10.0, "fa": None}, clock=clock)
    assert b.reject_reason("fp8") is None
    assert b.charge("fp8", _runs(3.0, 1.5)) == 9.0
    assert b.reject_reason("fp8") is None  # 9 of 10
    clock.t += 100
    b.charge("fp8", _runs(0.5))
    assert b.reject_reason("fp8") == "gpu_budget"  # 10 of 10
    assert b.reject_reason("fa") is None  # no budget
    clock.t += DAY_S - 101
    assert b.reject_reason("fp8") == "gpu_budget"
    clock.t += 1  # the first charge is 24 h old
    assert b.spent_today("fp8") == 1.0 and b.reject_reason("fp8") is None
    s = b.stats()["fp8"]
    assert (s["gpu_seconds_day"], s["gpu_seconds_total"], s["budget_left"], s["gpus"]) == (1.0, 10.0, 9.0, 2)


def test_a_decided_shadow_runs_at_the_maintenance_rate_and_an_undecided_one_at_its_own():
    clock = Clock()
    decided = {"fp8"}
    b = ShadowBudget(maintenance_per_minute=2, decided=lambda n: n in decided, clock=clock)
    assert [b.reject_reason("fp8") for _ in range(3)] == [None, None, "maintenance"]
    assert [b.reject_reason("fa") for _ in range(5)] == [None] * 5
    clock.t += 60
    assert b.reject_reason("fp8") is None
    decided.clear()  # the verdict moved back to undecided: full rate again
    assert [b.reject_reason("fp8") for _ in range(4)] == [None] * 4
    assert ShadowBudget(decided=lambda n: True).reject_reason("x") is None  # 0: no maintenance limit


def test_spend_in_money_with_a_price():
    b = ShadowBudget(gpus={"a": 1}, price_per_gpu_hour=3.6)
    b.charge("a", _runs(500.0))
    assert b.stats()["a"]["cost_total"] == 0.5
    assert ShadowBudget(gpus={"a": 1}).stats()["a"]["cost_total"] is None


class Runner:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, turn, backends, store, *, modes):
        self.calls += 1
        return _runs(0.4, 0.2)


def test_the_tee_stops_a_shadow_at_its_budget_and_exports_the_spend(fake, make_proxy, settle):
    runner = Runner()
    proxy = make_proxy(fake.url, runner=runner, tee_backends=[TeeBackend("s1", "s1")],
                       shadows=[{"name": "s1", "url": "http://127.0.0.1:9", "gpus": 2, "gpu_seconds_per_day": 2.0}],
                       verdict={"gpu_price_per_hour": 36.0})
    with httpx.Client(timeout=30) as c:
        for _ in range(3):
            assert c.post(proxy.url + "/v1/chat/completions", json=BODY).status_code == 200
            settle(proxy)
        metrics = c.get(proxy.admin_url + "/metrics").text
        verdict = c.get(proxy.admin_url + "/verdict").json()
    st = proxy.tee.stats()
    # 1.2 GPU-seconds per turn: the first two run (0, then 1.2 < 2), the third is over budget
    assert runner.calls == 2
    assert st["backend"]["s1"]["ok"] == 2 and st["backend"]["s1"]["gpu_budget"] == 1
    assert st["gpu"]["s1"]["gpu_seconds_total"] == 2.4
    assert 'tensorverse_shadow_gpu_seconds_total{backend="s1"} 2.4' in metrics
    assert 'tensorverse_shadow_gpu_budget_left_seconds{backend="s1"} 0.0' in metrics
    assert 'tensorverse_shadow_turns_total{backend="s1",outcome="gpu_budget",role="shadow"} 1.0' in metrics
    assert verdict["gpu"]["s1"]["gpu_seconds_total"] == 2.4
    assert verdict["gpu"]["s1"]["cost_total"] == pytest.approx(0.024)
    assert verdict["gpu"]["s1"]["decided"] is False
    assert (verdict["gpu"]["s1"]["turns"], verdict["gpu"]["s1"]["gpu_seconds_per_turn"]) == (2, 1.2)
    assert verdict["gpu"]["s1"]["gpu_seconds_needed"] is None  # no comparison yet: no verdict to project


def test_the_watched_verdict_decides_the_maintenance_rate():
    from tensorverse.analysis.verdict import ShadowVerdict
    from tensorverse.exporters.verdict_watch import VerdictSnapshot

    fields = ShadowVerdict.__dataclass_fields__
    def v(name, decision):
        return ShadowVerdict(**{f: None for f in fields if f not in ("backend", "decision")},
                             backend=name, decision=decision)
    snap = VerdictSnapshot(verdicts=[v("a", "regression"), v("b", "undecided"), v("c", "equivalent")])
    assert [snap.decided(n) for n in ("a", "b", "c", "d")] == [True, False, True, False]


def _verdict(name, decision, *, turns=0, tool_call_turns=0, turns_needed=None):
    from tensorverse.analysis.verdict import Interval, ShadowVerdict

    fields = ShadowVerdict.__dataclass_fields__
    none = Interval(turns=0, estimate=None, low=-1.0, high=1.0)
    given = {"backend": name, "decision": decision, "turns": turns, "tool_call_turns": tool_call_turns,
             "turns_needed": turns_needed, "hours_needed": None, "tool_call_break_excess": none,
             "flip_excess": none, "tool_flip_excess": none}
    return ShadowVerdict(**{f: None for f in fields if f not in given}, **given)


def test_verdict_says_what_an_undecided_shadow_still_costs_in_gpu_seconds_and_money():
    """Issue 37: the verdict reports the GPU time (and money) a shadow took and still needs. 40
    tool-calling turns still needed, a quarter of its turns call tools: 160 turns to run, at 1.5
    GPU-seconds a turn (two turns charged, 3 s) = 240 s, at 3.6 an hour = 0.24."""
    from tensorverse.analysis.verdict import VerdictPolicy, turns_to_run
    from tensorverse.exporters.verdict_watch import VerdictSnapshot

    b = ShadowBudget(gpus={"fp8": 2, "fa": 1, "new": 1}, price_per_gpu_hour=3.6)
    b.charge("fp8", _runs(0.5, 0.25))  # 1.5 GPU-seconds (2 GPUs)
    b.charge("fp8", _runs(0.75))
    b.charge("fa", _runs(10.0))
    spend = b.stats()
    assert (spend["fp8"]["turns"], spend["fp8"]["gpu_seconds_per_turn"]) == (2, 1.5)
    assert (spend["new"]["turns"], spend["new"]["gpu_seconds_per_turn"]) == (0, None)
    fp8 = _verdict("fp8", "undecided", turns=80, tool_call_turns=20, turns_needed=40)
    fa = _verdict("fa", "equivalent", turns=30, tool_call_turns=9)
    assert (turns_to_run(fp8), turns_to_run(fa)) == (160.0, 0.0)
    assert turns_to_run(_verdict("x", "undecided", turns=5, tool_call_turns=0, turns_needed=3)) is None
    assert turns_to_run(_verdict("x", "undecided", turns=5, tool_call_turns=5, turns_needed=None)) is None
    assert turns_to_run(_verdict("x", "undecided", turns=0, tool_call_turns=4, turns_needed=8)) == 8.0  # free runs only
    gpu = VerdictSnapshot(verdicts=[fp8, fa]).as_dict(VerdictPolicy(), spend)["gpu"]
    assert (gpu["fp8"]["gpu_seconds_needed"], gpu["fp8"]["cost_needed"]) == (240.0, pytest.approx(0.24))
    assert (gpu["fa"]["gpu_seconds_needed"], gpu["fa"]["cost_needed"]) == (0.0, 0.0)  # decided: nothing more
    assert (gpu["new"]["gpu_seconds_needed"], gpu["new"]["cost_needed"]) == (None, None)  # no verdict, no turn yet
    assert gpu["fp8"]["gpu_seconds_total"] == 3.0  # the spend as it was
    no_price = VerdictSnapshot(verdicts=[fp8]).as_dict(VerdictPolicy(), ShadowBudget(gpus={"fp8": 1}).stats())
    assert no_price["gpu"]["fp8"]["cost_needed"] is None
