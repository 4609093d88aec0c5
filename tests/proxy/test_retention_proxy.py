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
    proxy = make_proxy(fake.url, retention={"max_age": "30d", "interval_s": 0.2})
    fill_store(proxy.store, turns=5)  # a session from 2023: past max_age
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
        assert r.status_code == 200
        settle(proxy)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ids = [s["id"] for s in proxy.store.iter_sessions()]
            if "sess1" not in ids:
                break
            time.sleep(0.1)
        m = _samples(c.get(proxy.admin_url + "/metrics").text)
        stats = c.get(proxy.admin_url + "/stats").json()
    assert "sess1" not in ids and len(ids) == 1  # the agent's fresh session stays
    assert m["tensorverse_store_pruned_sessions_total"] == 1
    assert m["tensorverse_store_pruned_bytes_total"] > 0
    assert m["tensorverse_store_over_budget"] == 0 and m["tensorverse_store_prune_errors_total"] == 0
    assert stats["retention"]["sessions_pruned"] == 1


def test_retention_is_off_by_default(fake, make_proxy):
    proxy = make_proxy(fake.url)
    assert proxy.retention is None
    m = _samples(httpx.get(proxy.admin_url + "/metrics", timeout=30).text)
    assert m["tensorverse_store_pruned_sessions_total"] == 0
    assert m["tensorverse_store_days_left"] != m["tensorverse_store_days_left"]  # NaN: unknown
