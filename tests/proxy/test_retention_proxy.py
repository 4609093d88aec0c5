"""[retention] in a running proxy (issue 26, first part): old sessions pruned off the relay's
path, the counters on /metrics, the primary path untouched meanwhile."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.exporters.verdict_store import fill_store


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_the_proxy_prunes_old_sessions_and_says_so(fake, make_proxy, settle):
    # a session from 2023, past max_age, written before the keeper's first pass (a pass between
    # the session and its turns would prune the session and refuse the turns)
    proxy = make_proxy(fake.url, retention={"max_age": "30d", "interval_s": 0.2},
                       prepare=lambda st: fill_store(st, turns=5))
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
        assert r.status_code == 200
        settle(proxy)
        # the pass is over when its counters say so: the session is gone from the store as soon
        # as its deletion commits, a moment before the keeper counts it
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ids = [s.id for s in proxy.store.iter_sessions()]
            stats = c.get(proxy.admin_url + "/stats").json()
            if "sess1" not in ids and stats["retention"]["sessions_pruned"]:
                break
            time.sleep(0.1)
        m = _samples(c.get(proxy.admin_url + "/metrics").text)
    assert "sess1" not in ids and len(ids) == 1  # the agent's fresh session stays
    assert m["tensorverse_store_pruned_sessions_total"] == 1
    assert m["tensorverse_store_pruned_bytes_total"] > 0
    assert m["tensorverse_store_over_budget"] == 0 and m["tensorverse_store_prune_errors_total"] == 0
    assert stats["retention"]["sessions_pruned"] == 1


def test_pruning_is_off_by_default_and_compaction_on(fake, make_proxy):
    proxy = make_proxy(fake.url)
    assert proxy.retention.policy.max_age_s is None and proxy.retention.policy.max_bytes is None
    assert proxy.retention.evidence.after_s == 120.0  # [retention] compact = true by default
    m = _samples(httpx.get(proxy.admin_url + "/metrics", timeout=30).text)
    assert m["tensorverse_store_pruned_sessions_total"] == 0
    assert m["tensorverse_store_days_left"] != m["tensorverse_store_days_left"]  # NaN: unknown
    assert make_proxy(fake.url, retention={"compact": False}).retention is None


def test_the_proxy_compacts_compared_turns_and_says_so(fake, make_proxy, settle):
    import numpy as np

    from tensorverse.store.stored_rows import RowCompacted, StoredRows
    from tensorverse.testing.shadow_workload import write_turn

    rng = np.random.default_rng(0)
    ref = (rng.standard_normal((24, 512)) * 4).astype(np.float32)
    written = []  # the turn whole before the keeper's first pass

    def prepare(st):
        written.append(write_turn(st, "old-turn", "old-session", 0, ref, ref.copy(), ref[::-1].copy(),
                                  flip_share=0.0, seed=0, created_ns=time.time_ns() - 3600 * 10**9))

    proxy = make_proxy(fake.url, retention={"interval_s": 0.2, "compact_after_s": 60}, prepare=prepare)
    t = written[0]
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
        assert r.status_code == 200  # the relay unaffected
        settle(proxy)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proxy.store.compaction("old-turn") is None:
            time.sleep(0.1)
        text = c.get(proxy.admin_url + "/metrics").text
        m = _samples(text)
    rid = t.run_ids[("candidate", "forced")]
    kept = set(proxy.store.compaction("old-turn").runs[rid].full)
    lost = next(p for p in range(24) if p not in kept)
    try:
        StoredRows(proxy.store).row(rid, lost)
        raise AssertionError("a compacted row read as full")
    except RowCompacted as e:
        assert e.compact.top(1) == [int(np.argmax(ref[lost]))]
    assert m["tensorverse_store_compacted_turns_total"] == 1
    assert m["tensorverse_store_compacted_rows_total"] > 100 and m["tensorverse_store_compacted_bytes_total"] > 0
    # planned by the analysis worker (a process of its own), committed by the proxy
    jobs = {s.labels["job"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "tensorverse_analysis_jobs_total"}
    assert jobs["plan"] >= 1 and m["tensorverse_analysis_in_thread_total"] == 0
