"""The soak, shortened for CI (``benchmarks/reliability.py --duration 600`` runs it full length):
200 concurrent streaming agents with tool calls, recording and 3 shadows on. Zero failed primary
requests; every recorded turn reads back whole; dropped shadow work is counted exactly (turns
without shadow runs == the drop counters); the proxy's memory stays bounded."""

from __future__ import annotations

import os

from tests.reliability import harness as H
import pytest
from tests.reliability.soak import soak

AGENTS = int(os.environ.get("TENSORVERSE_SOAK_AGENTS", "200"))
DURATION_S = float(os.environ.get("TENSORVERSE_SOAK_S", "30"))


@pytest.mark.soak
def test_soak_shortened(tmp_path):
    r = soak(tmp_path, agents=AGENTS, duration_s=DURATION_S)
    H.record("soak-ci", load=f"{AGENTS} streaming tool-call agents, {DURATION_S:.0f} s, recording + 3 shadows",
             faults="none (load only)", bad_inputs=0, requests=r["requests_ok"] + r["requests_failed"],
             records_lost=r["turns_expected"] - r["turns_complete"], machine=H.machine(), **r)
    assert r["requests_failed"] == 0 and not r["errors"], r["errors"]
    assert r["requests_ok"] >= AGENTS  # every agent got through at least one turn
    assert r["turns_recorded"] == r["turns_complete"]  # every recorded turn reads back whole
    # every answered turn recorded (a client closing at [DONE] included: nothing lost)
    assert r["lost_flows"] == 0 and r["turns_complete"] == r["turns_expected"]
    assert r["lost_flows"] <= max(1, r["turns_expected"] // 500)
    sh = r["shadow"]
    skipped = sum(sh["skipped"].values())
    # dropped shadow work counted exactly: a turn has runs iff it was queued
    assert r["turns_with_runs"] == sh["queued"] == sh["turns_done"]
    assert r["turns_without_runs"] == sh["dropped_queue_full"] + skipped
    assert set(r["shadow_runs_per_turn"]) == {6}  # 3 shadows x (forced, free) for each shadowed turn
    assert r["proxy_exit"] == 0
    rss = r["rss_kb"]
    assert rss["end_of_load"] < rss["start"] + 300_000, rss  # bounded: no growth with requests served
    mem = r["memory"]  # the heap apart from the store's mapped pages (flat in the full soak: RELIABILITY.md)
    assert mem["anon_mb_end"] < mem["anon_mb_start"] + 100, mem
