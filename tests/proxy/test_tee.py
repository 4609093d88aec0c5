"""The shadow tee: the agent never waits for, or sees, a shadow."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tensorverse.proxy.tee import CapturePolicy, TeeBackend
from tensorverse.store.records import Turn

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}


class Runner:
    def __init__(self, behaviour="ok", delay=0.0):
        self.behaviour = behaviour
        self.delay = delay
        self.calls: list[tuple[str, str, tuple]] = []

    async def __call__(self, turn, backends, store, *, modes):
        self.calls.append((turn.id, backends[0], tuple(modes)))
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.behaviour == "error":
            raise RuntimeError("shadow exploded")
        if self.behaviour == "garbage":
            raise ValueError("shadow answered garbage: b'\\x00\\xff'")
        return {"ok": True}


def _post(proxy, n=1, headers=None):
    times = []
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            t = time.perf_counter()
            r = c.post(proxy.url + "/v1/chat/completions", json=BODY, headers=headers or {})
            times.append(time.perf_counter() - t)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
    return times


@pytest.mark.parametrize("behaviour", ["hang", "error", "garbage"])
def test_bad_shadow_does_not_affect_agent(fake, make_proxy, settle, turns, loop, behaviour):
    runner = Runner(behaviour)
    backends = [TeeBackend("s1", "s1", concurrency=1, timeout_s=0.5), TeeBackend("s2", "s2", concurrency=1, timeout_s=0.5)]
    proxy = make_proxy(fake.url, runner=runner, tee_backends=backends)
    times = _post(proxy, 3)
    assert max(times) < 0.5  # never waited for a shadow (hang = 3600 s, timeout 0.5 s)
    settle(proxy, timeout=10)
    st = proxy.tee.stats()
    assert st["queued"] == 3
    outcome = "timed_out" if behaviour == "hang" else "failed"
    assert st["backend"]["s1"][outcome] == 3 and st["backend"]["s2"][outcome] == 3
    assert {c[1] for c in runner.calls} == {"s1", "s2"}
    assert all(t.state == "ok" for t in turns(proxy))


def test_full_queue_drops_and_counts(fake, make_proxy, settle):
    runner = Runner("hang")
    proxy = make_proxy(fake.url, runner=runner, tee_backends=[TeeBackend("s1", "s1", timeout_s=30)],
                       shadow={"queue_size": 2, "workers": 1})
    times = _post(proxy, 6)
    assert max(times) < 0.5
    deadline = time.monotonic() + 5
    while proxy.tee.stats()["dropped_queue_full"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    st = proxy.tee.stats()
    # one turn in the worker, two waiting, three dropped
    assert st["queued"] == 3 and st["dropped_queue_full"] == 3
    with httpx.Client() as c:
        metrics = c.get(proxy.admin_url + "/metrics").text
    assert "tensorverse_shadow_dropped_total 3.0" in metrics


def test_runner_gets_recorded_turn_and_modes(fake, make_proxy, settle):
    runner = Runner()
    proxy = make_proxy(fake.url, runner=runner,
                       tee_backends=[TeeBackend("s1", "B1"), TeeBackend("sec", "B2", modes=("free",))],
                       capture={"modes": ["forced"]})
    _post(proxy, 1)
    settle(proxy)
    calls = sorted(runner.calls, key=lambda c: c[1])
    assert [(c[1], c[2]) for c in calls] == [("B1", ("forced",)), ("B2", ("free",))]
    turn = proxy.store.get_turn(calls[0][0])  # committed before the runner was called
    assert turn.output_token_ids == [1000 + i for i in range(8)]


def test_policy_only_with_tools_and_budget(fake, make_proxy, settle):
    runner = Runner()
    proxy = make_proxy(fake.url, runner=runner, tee_backends=[TeeBackend("s1", "s1")],
                       capture={"only_with_tools": True, "per_minute": 2})
    with httpx.Client(timeout=30) as c:
        c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})  # no tools
        c.post(proxy.url + "/v1/chat/completions", json=BODY, headers={"X-Fake-Status": "500"})  # failed
    _post(proxy, 3)
    settle(proxy)
    st = proxy.tee.stats()
    assert st["queued"] == 2
    assert st["skipped"] == {"no_tools": 1, "not_ok": 1, "over_budget": 1}


def test_policy_sampling():
    vals = iter([0.1, 0.9, 0.3, 0.6])
    p = CapturePolicy(sample=0.5, rng=lambda: next(vals))

    class F:
        state = "ok"
        kind = "chat.completions"

    turn = Turn(id="t", prompt_token_ids=[1], output_token_ids=[2])
    assert [p.reject_reason(F, turn) for _ in range(4)] == [None, "sampled_out", None, "sampled_out"]
    assert p.reject_reason(F, Turn(id="t", prompt_token_ids=None, output_token_ids=None)) == "no_token_ids"


def test_slow_shadows_do_not_slow_the_primary(fake, make_proxy):
    """Three shadows that take 50 ms each: primary latency is what it is without shadows."""
    base = make_proxy(fake.url)
    runner = Runner(delay=0.05)
    teed = make_proxy(fake.url, runner=runner,
                      tee_backends=[TeeBackend(f"s{i}", f"s{i}", concurrency=4) for i in range(3)])
    _post(base, 5), _post(teed, 5)  # warm up
    a: list[float] = []
    b: list[float] = []
    for _ in range(40):  # alternately, so a change of the machine's load hits both alike
        a += _post(base, 1)
        b += _post(teed, 1)
    assert sorted(b)[20] < sorted(a)[20] * 1.5 + 0.002


def test_busy_seconds_count_each_workers_time_on_turns_for_the_headroom(fake, make_proxy, settle):
    runner = Runner(delay=0.3)
    proxy = make_proxy(fake.url, runner=runner, tee_backends=[TeeBackend("s1", "s1", concurrency=2)],
                       shadow={"workers": 2})
    _post(proxy, 4)
    time.sleep(0.15)
    mid = proxy.tee.stats()
    assert mid["workers"] == 2
    assert mid["busy_s"] >= 0.2  # the turns in progress count before they end
    settle(proxy, timeout=10)
    st = proxy.tee.stats()
    assert 4 * 0.3 <= st["busy_s"] < 4 * 0.3 + 1.0  # four turns of 0.3 s, each counted once
    with httpx.Client() as c:
        metrics = c.get(proxy.admin_url + "/metrics").text
    assert "tensorverse_shadow_workers 2.0" in metrics
    busy = float(next(line.split()[1] for line in metrics.splitlines()
                      if line.startswith("tensorverse_shadow_busy_seconds_total ")))
    assert busy >= st["busy_s"]


def test_a_captured_run_asks_the_api_for_the_primarys_recorded_k_unless_configured():
    """``[[shadows]] captured_logprobs`` defaults to ``[recording] top_logprobs``: the answer's
    top-k of a captured run only meets the primary's recorded top-k; ``logprobs`` stays for runs
    without capture."""
    from tensorverse.config import parse_config
    from tensorverse.proxy.tee import tee_backends_from_config

    def backends(recording_k, **shadow):
        cfg = parse_config({"primary": {"url": "http://p:8000"}, "recording": {"top_logprobs": recording_k},
                            "shadows": [{"name": "s", "url": "http://s:8000", **shadow}]})
        (tb,) = tee_backends_from_config(cfg)
        return tb.backend.captured_logprobs, tb.backend.logprobs

    assert backends(5) == (5, 20)
    assert backends(0) == (1, 20)  # the primary records no top-k: each position's argmax
    assert backends(5, captured_logprobs=12, logprobs=7) == (12, 7)
    assert backends(5, captured_logprobs=0) == (0, 20)
