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


def test_the_watched_verdict_decides_the_maintenance_rate():
    from tensorverse.analysis.verdict import ShadowVerdict
    from tensorverse.exporters.verdict_watch import VerdictSnapshot

    fields = ShadowVerdict.__dataclass_fields__
    def v(name, decision):
        return ShadowVerdict(**{f: None for f in fields if f not in ("backend", "decision")},
                             backend=name, decision=decision)
    snap = VerdictSnapshot(verdicts=[v("a", "regression"), v("b", "undecided"), v("c", "equivalent")])
    assert [snap.decided(n) for n in ("a", "b", "c", "d")] == [True, False, True, False]
