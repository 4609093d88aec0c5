"""The metrics: definitions, series at 0 from the start, updates from stored comparisons, the
histogram bulk path, and what a real proxy exposes on /metrics."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tests.exporters.exporters_support import store_comparisons  # type: ignore[import-not-found]
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tensorverse.analysis.regions import region_at
from tensorverse.config import parse_config
from tensorverse.exporters.metrics import (
    FLIP_CLASSES,
    KL_BUCKETS,
    METRICS,
    REGIONS,
    VERDICTS,
    Metrics,
    exported_names,
)
from tensorverse.store import records
from tensorverse.store.records import Run

LABEL_OK = {"backend", "role", "mode", "ref_role", "region", "class", "verdict", "reason", "outcome", "endpoint", "table",
            "decision", "bound", "job"}  # decision: 3 values, bound: estimate, low, high; job: compare, plan


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


def cfg(**extra):
    return parse_config({
        "primary": {"url": "http://p:8000", "name": "prim"},
        "admin": {"listen": "127.0.0.1:0"},
        "shadows": [{"name": "fi", "url": "http://a:1"}, {"name": "kv", "url": "http://b:1", "modes": ["forced"]},
                    {"name": "sec", "url": "http://c:1", "role": "secondary"}],
        **extra,
    })


def test_names_follow_prometheus_practice():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert re.fullmatch(r"tensorverse_[a-z0-9_]+", m.name), m.name
        assert not m.name.endswith("_total"), "counters are named without _total (the exposition adds it)"
        assert set(m.labels) <= LABEL_OK, (m.name, m.labels)  # bounded labels only
        assert not {"session", "session_id", "turn_id", "prompt"} & set(m.labels)
        if m.type == "histogram":
            assert list(m.buckets) == sorted(m.buckets)
        if "seconds" in m.name or "bytes" in m.name:
            assert m.name.endswith(("_seconds", "_bytes")), m.name  # base units, as a suffix
    assert "tensorverse_flips_total" in exported_names()
    assert "tensorverse_kl_divergence_nats_bucket" in exported_names()


def test_series_exist_at_zero_from_the_start():
    text = generate_latest(Metrics.from_config(cfg()).registry()).decode()
    s = samples(text)
    # every (backend, mode, reference, region) that the configuration implies
    for b, role in (("fi", "shadow"), ("kv", "shadow")):
        for rr in ("primary", "secondary"):
            for region in REGIONS:
                for cls in FLIP_CLASSES:
                    if cls == "unclassified":  # only comparisons stored before issue 19 have it
                        continue
                    assert s[("tensorverse_flips_total", tuple(sorted(
                        {"backend": b, "role": role, "mode": "forced", "ref_role": rr, "region": region,
                         "class": cls}.items())))] == 0
            assert value(text, "tensorverse_kl_divergence_nats_count", backend=b, role=role, ref_role=rr) == 0
    assert value(text, "tensorverse_compared_tokens_total", backend="fi", role="shadow", mode="free",
                 ref_role="primary") == 0
    # kv runs forced only: no free series; the secondary is never compared with itself
    assert not any(k[0] == "tensorverse_compared_tokens_total" and ("backend", "kv") in k[1] and ("mode", "free") in k[1]
                   for k in s)
    assert not any(("backend", "sec") in k[1] and ("ref_role", "secondary") in k[1] for k in s)
    for v in VERDICTS:
        assert value(text, "tensorverse_tool_call_verdicts_total", backend="fi", role="shadow", verdict=v) == 0
    assert value(text, "tensorverse_requests_total", backend="prim", role="primary", outcome="ok") == 0
    assert value(text, "tensorverse_shadow_turns_total", backend="sec", role="secondary", outcome="timed_out") == 0
    assert value(text, "tensorverse_shadow_skipped_total", reason="over_budget") == 0
    assert value(text, "tensorverse_capture_plugin_rows_dropped_total", reason="no_buffer") == 0
    assert value(text, "tensorverse_store_free_bytes") == 0  # no store: 0, still present


def test_no_secondary_and_no_topk_means_fewer_series():
    c = parse_config({"primary": {"url": "http://p:1"}, "recording": {"top_logprobs": 0},
                      "shadows": [{"name": "a", "url": "http://a:1"}]})
    text = generate_latest(Metrics.from_config(c).registry()).decode()
    refs = {dict(k[1]).get("ref_role") for k in samples(text) if k[0] == "tensorverse_compared_tokens_total"}
    assert refs == {"primary"}  # the free mode's; forced has no reference to compare with


def typed(results):
    """Comparison dicts as the typed records `compare_turn` returns and the store reads back."""
    return [records.comparison({"run_id": f"run-{i}", "ref_run_id": "ref", **r}) for i, r in enumerate(results)]


def forced(backend="fi", role="shadow", ref_role="primary", kl=(0.0, 0.5, 2e-5, 20.0), flips=(1, 3),
           by_region=None, noise=None):
    n = len(kl)
    return {"mode": "forced", "backend": backend, "role": role, "ref_role": ref_role, "status": "ok", "n": n,
            "kind": "topk", "flips": list(flips), "first_flip": flips[0] if flips else None,
            "summary": {"n": n, "flips": len(flips), "flips_by_region": by_region},
            "metrics": {"kl": list(kl)}, **({"noise": noise} if noise else {})}


def test_forced_comparison_updates():
    m = Metrics.from_config(cfg())
    m.observe_comparisons(typed([
        forced(by_region={"content": 1, "tool_args": 1}, noise={"verdict": "regression"}),
        forced(kl=(float("nan"), 1e-7), flips=(), by_region=None),
        forced(ref_role="secondary", flips=(2,), by_region=None),
        {"mode": "forced", "backend": "fi", "role": "shadow", "ref_role": "primary", "status": "error", "error": "x"},
    ]))
    text = generate_latest(m.registry()).decode()
    lab = dict(backend="fi", role="shadow", mode="forced", ref_role="primary")
    assert value(text, "tensorverse_compared_tokens_total", **lab) == 6
    # comparisons stored before flips had classes count as "unclassified"
    old = dict(**lab, **{"class": "unclassified"})
    assert value(text, "tensorverse_flips_total", **old, region="content") == 1
    assert value(text, "tensorverse_flips_total", **old, region="tool_args") == 1
    assert value(text, "tensorverse_flips_total", backend="fi", role="shadow", mode="forced", ref_role="secondary",
                 region="unknown", **{"class": "unclassified"}) == 1
    assert value(text, "tensorverse_comparisons_total", **lab, outcome="ok") == 2
    assert value(text, "tensorverse_comparisons_total", **lab, outcome="error") == 1
    assert value(text, "tensorverse_noise_verdicts_total", backend="fi", role="shadow", verdict="regression") == 1
    kl = dict(backend="fi", role="shadow", ref_role="primary")
    assert value(text, "tensorverse_kl_divergence_nats_count", **kl) == 5  # the NaN left out
    assert value(text, "tensorverse_kl_divergence_nats_sum", **kl) == pytest.approx(20.5 + 2e-5 + 1e-7)
    assert value(text, "tensorverse_kl_divergence_nats_bucket", **kl, le="1e-06") == 2  # 0 and 1e-7
    assert value(text, "tensorverse_kl_divergence_nats_bucket", **kl, le="3e-05") == 3
    assert value(text, "tensorverse_kl_divergence_nats_bucket", **kl, le="10.0") == 4
    assert value(text, "tensorverse_kl_divergence_nats_bucket", **kl, le="+Inf") == 5
    assert value(text, "tensorverse_first_flip_position_count", **lab) == 1
    assert value(text, "tensorverse_first_flip_position_bucket", **lab, le="1.0") == 1


def test_free_comparison_updates():
    m = Metrics.from_config(cfg())
    pieces = ["Hi", " there", "<tool_call>", '{"name": "', "get", '"}', "</tool_call>"]
    base = {"mode": "free", "backend": "fi", "role": "shadow", "ref_role": "primary", "status": "ok"}
    m.observe_comparisons(typed([
        {**base, "diverged": True, "common_prefix": 4, "first_flip": 4, "verdict": "wrong_func_name",
         "ref_tool_calls": 1, "cand_tool_calls": 1},
        {**base, "diverged": False, "common_prefix": 7, "first_flip": None, "verdict": "match",
         "ref_tool_calls": 0, "cand_tool_calls": 0},
        {**base, "diverged": True, "common_prefix": 0, "first_flip": 0, "verdict": "match",
         "ref_tool_calls": 1, "cand_tool_calls": 1, "region": "thinking"},
    ]), pieces=pieces)
    text = generate_latest(m.registry()).decode()
    lab = dict(backend="fi", role="shadow", mode="free", ref_role="primary")
    assert value(text, "tensorverse_compared_tokens_total", **lab) == 5 + 7 + 1
    old = dict(**lab, **{"class": "unclassified"})
    assert value(text, "tensorverse_flips_total", **old, region=region_at(pieces, 4)) == 1
    assert region_at(pieces, 4) == "tool_name"
    assert value(text, "tensorverse_flips_total", **old, region="thinking") == 1  # the result's own region wins
    v = dict(backend="fi", role="shadow")
    assert value(text, "tensorverse_tool_call_verdicts_total", **v, verdict="wrong_func_name") == 1
    assert value(text, "tensorverse_tool_call_verdicts_total", **v, verdict="none") == 1  # no call either side
    assert value(text, "tensorverse_tool_call_verdicts_total", **v, verdict="match") == 1
    assert value(text, "tensorverse_first_flip_position_sum", **lab) == 4


def test_runs_and_requests():
    m = Metrics.from_config(cfg())
    m.observe_runs([Run(id="r0", turn_id="t1", mode="recorded", backend="prim"),
                    Run(id="r1", turn_id="t1", mode="forced", backend="fi", status="ok", timings={"total_s": 0.3}),
                    Run(id="r2", turn_id="t1", mode="free", backend="fi", status="timeout"),
                    Run(id="r3", turn_id="t1", mode="free", backend="kv", status="weird")])
    m.observe_missing_rows([Run(id="r1", turn_id="t1", mode="forced", backend="fi",
                                rows={"expected": 10, "present": 7})])
    m.observe_request("ok", added_latency_s=0.0004, endpoint="chat.completions")
    m.observe_request("aborted")
    text = generate_latest(m.registry()).decode()
    assert value(text, "tensorverse_shadow_runs_total", backend="fi", role="shadow", mode="forced", outcome="ok") == 1
    assert value(text, "tensorverse_shadow_runs_total", backend="fi", role="shadow", mode="free", outcome="timeout") == 1
    assert value(text, "tensorverse_shadow_runs_total", backend="kv", role="shadow", mode="free", outcome="failed") == 1
    assert value(text, "tensorverse_shadow_run_duration_seconds_count", backend="fi", mode="forced") == 1
    assert value(text, "tensorverse_capture_rows_missing_total", backend="fi", mode="forced") == 3
    assert value(text, "tensorverse_requests_total", backend="prim", role="primary", outcome="aborted") == 1
    assert value(text, "tensorverse_proxy_added_latency_seconds_bucket", endpoint="chat.completions", le="0.0005") == 1
    assert value(text, "tensorverse_proxy_added_latency_seconds_bucket", endpoint="chat.completions", le="0.00025") == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(0, 50, allow_nan=False), st.sampled_from(list(KL_BUCKETS))), max_size=80))
def test_bulk_histogram_matches_prometheus_client(values):
    """The numpy bulk path puts each value in the same bucket as prometheus_client's Histogram."""
    from prometheus_client import CollectorRegistry, Histogram

    reg = CollectorRegistry()
    ref = Histogram("h", "h", buckets=KL_BUCKETS, registry=reg)
    for v in values:
        ref.observe(v)
    m = Metrics()
    m.kl.observe_many(("b", "shadow", "primary"), np.asarray(values, dtype=np.float64))
    want = {s.labels["le"]: s.value for fam in reg.collect() for s in fam.samples if s.name == "h_bucket"}
    got = {dict(k[1])["le"]: v for k, v in samples(generate_latest(m.registry()).decode()).items()
           if k[0] == "tensorverse_kl_divergence_nats_bucket" and dict(k[1]).get("backend") == "b"}
    if values:
        assert got == want
        total = value(generate_latest(m.registry()).decode(), "tensorverse_kl_divergence_nats_sum",
                      backend="b", role="shadow", ref_role="primary")
        assert total == pytest.approx(sum(values))


def test_proxy_exposes_every_declared_metric(make_pipeline):
    """A fresh proxy's /metrics has every family of METRICS, already at 0; after a few turns the
    counters agree with the comparisons in the store."""
    p = make_pipeline()
    fresh = p.scrape()
    names = {s[0] for s in samples(fresh)}
    assert exported_names() <= names, sorted(exported_names() - names)
    assert {n for n in names if n.startswith("tensorverse_")} <= exported_names()
    p.send(4)
    text = p.scrape()
    comps = store_comparisons(p.store)
    for backend in ("cand", "fp8-kv", "secondary"):
        for mode in ("forced", "free"):
            mine = [c for c in comps if c.backend == backend and c.mode == mode and c.ref_role == "primary"]
            assert mine
            if mode == "forced":
                flips, n = sum(len(c.flips) for c in mine), sum(c.n for c in mine)
            else:
                flips = sum(bool(c.diverged) or c.flip_class == "parser" for c in mine)
                n = sum(c.common_prefix + bool(c.diverged) for c in mine)
            role = "secondary" if backend == "secondary" else "shadow"
            lab = dict(backend=backend, role=role, mode=mode, ref_role="primary")
            assert value(text, "tensorverse_compared_tokens_total", **lab) == n
            got = sum(v for (name, labels), v in samples(text).items() if name == "tensorverse_flips_total"
                      and {k: v2 for k, v2 in labels if k not in ("region", "class")} == lab)
            assert got == flips
            by_class = {}
            for (name, labels), v in samples(text).items():
                d = dict(labels)
                if name == "tensorverse_flips_total" and {k: v2 for k, v2 in d.items()
                                                         if k not in ("region", "class")} == lab:
                    by_class[d["class"]] = by_class.get(d["class"], 0) + v
            want = {}
            for c in mine:
                for cls in (([c.flip_class] if c.flip_class else []) if mode == "free" else c.flip_classes or []):
                    want[cls] = want.get(cls, 0) + 1
            assert {k: v for k, v in by_class.items() if v} == want
            if backend == "secondary" and mode == "forced":
                assert set(want) <= {"tie", "near_tie", "noise"}  # the noise floor's flips are noise
    assert value(text, "tensorverse_requests_total", backend="primary", role="primary", outcome="ok") == 4
    # the parser check of each shadowed primary turn (made in the shadow worker), once per turn
    checked = [r for sess in p.store.iter_sessions() for t in p.store.iter_turns(sess.id)
               for r in p.store.iter_runs(t.id) if r.mode == "recorded" and r.parser_check]
    assert len(checked) == 4
    assert value(text, "tensorverse_parser_checks_total", backend="primary", outcome="match") + \
        value(text, "tensorverse_parser_checks_total", backend="primary", outcome="mismatch") == 4
    assert value(text, "tensorverse_parser_mismatch_total", backend="primary") == \
        sum(bool(r.parser_check["mismatch"]) for r in checked)
    assert value(text, "tensorverse_proxy_added_latency_seconds_count", endpoint="completions") == 4
    assert value(text, "tensorverse_shadow_runs_total", backend="cand", role="shadow", mode="forced", outcome="ok") == 4
    assert value(text, "tensorverse_store_size_bytes") > 0
    assert value(text, "tensorverse_store_records", table="comparisons") == len(comps)
    # the old names of the proxy's counters are still there
    assert value(text, "tensorverse_proxy_requests_total") == 4
    assert value(text, "tensorverse_shadow_queued_total") == 4


def test_flip_classes_and_parser_checks():
    """Issue 19: flips carry a bounded `class` label; the primary's parser checks are counted."""
    m = Metrics.from_config(cfg())
    c = forced(flips=(0, 1, 2), by_region={"content": 3})
    c["summary"]["flips_by_class"] = {"tie": 1, "near_tie": 0, "noise": 1, "parser": 0, "runtime": 1}
    c["summary"]["flips_by_region_class"] = {"content": {"tie": 1, "runtime": 1}, "tool_args": {"noise": 1}}
    base = {"mode": "free", "backend": "fi", "role": "shadow", "ref_role": "primary", "status": "ok"}
    m.observe_comparisons(typed([
        c,
        {**base, "diverged": True, "common_prefix": 2, "first_flip": 2, "verdict": "match",
         "ref_tool_calls": 0, "cand_tool_calls": 0, "region": "content", "flip_class": "near_tie"},
        {**base, "diverged": False, "common_prefix": 6, "first_flip": None, "verdict": "value_mismatch",
         "ref_tool_calls": 1, "cand_tool_calls": 1, "flip_class": "parser"},
        {**base, "diverged": True, "common_prefix": 0, "first_flip": 0, "verdict": "match",
         "region": "thinking", "flip_class": "made-up"},  # unknown values never make a new series
    ]))
    m.observe_parser_check(Run(id="t1~primary", turn_id="t1", backend="prim", mode="recorded",
                               parser_check={"mismatch": True}))
    m.observe_parser_check(Run(id="t2~primary", turn_id="t2", backend="prim", mode="recorded",
                               parser_check={"mismatch": False}))
    m.observe_parser_check(Run(id="t3~primary", turn_id="t3", backend="prim",
                               mode="recorded"))  # no check made: nothing counted
    text = generate_latest(m.registry()).decode()
    lab = dict(backend="fi", role="shadow", mode="forced", ref_role="primary")
    assert value(text, "tensorverse_flips_total", **lab, region="content", **{"class": "tie"}) == 1
    assert value(text, "tensorverse_flips_total", **lab, region="content", **{"class": "runtime"}) == 1
    assert value(text, "tensorverse_flips_total", **lab, region="tool_args", **{"class": "noise"}) == 1
    free = dict(lab, mode="free")
    assert value(text, "tensorverse_flips_total", **free, region="content", **{"class": "near_tie"}) == 1
    assert value(text, "tensorverse_flips_total", **free, region="unknown", **{"class": "parser"}) == 1
    assert value(text, "tensorverse_flips_total", **free, region="thinking", **{"class": "unclassified"}) == 1
    classes = {dict(k[1])["class"] for k in samples(text) if k[0] == "tensorverse_flips_total"}
    assert classes <= set(FLIP_CLASSES)
    assert value(text, "tensorverse_parser_checks_total", backend="prim", outcome="mismatch") == 1
    assert value(text, "tensorverse_parser_checks_total", backend="prim", outcome="match") == 1
    assert value(text, "tensorverse_parser_mismatch_total", backend="prim") == 1


def test_flip_classes_of_a_comparison_are_read_from_its_top_and_from_the_summary_of_older_ones():
    """A forced comparison stores ``flips_by_class`` at its top (2026-12-05); one stored before has
    it in its summary only: both count by class, region unknown."""
    m = Metrics.from_config(cfg())
    new = forced(flips=(0, 1, 2), backend="new")
    new["flips_by_class"] = {"tie": 2, "runtime": 1}
    old = forced(flips=(0, 1), backend="old")
    old["summary"]["flips_by_class"] = {"noise": 2}
    m.observe_comparisons(typed([new, old]))
    text = generate_latest(m.registry()).decode()
    lab = dict(role="shadow", mode="forced", ref_role="primary", region="unknown")
    assert value(text, "tensorverse_flips_total", backend="new", **lab, **{"class": "tie"}) == 2
    assert value(text, "tensorverse_flips_total", backend="new", **lab, **{"class": "runtime"}) == 1
    assert value(text, "tensorverse_flips_total", backend="old", **lab, **{"class": "noise"}) == 2


def test_moment_counters_are_the_cluster_moments_of_the_compared_turns():
    """Per backend, mode, reference and class: the sums of (positions)^2, (flips)^2 and
    flips x positions over ok comparisons, so that the rules' turn-clustered interval equals
    `intervals.cluster_robust` of the same turns (error comparisons count nowhere)."""
    from tensorverse.analysis.intervals import ClusterMoments

    m = Metrics.from_config(cfg())
    turns = [(4, {"runtime": 2, "tie": 1}), (10, {"runtime": 3}), (7, {}), (2, {"runtime": 1, "noise": 1})]
    comps = []
    for n, by_class in turns:
        c = forced(kl=(0.0,) * n, flips=tuple(range(sum(by_class.values()))))
        c["flips_by_class"] = by_class
        comps.append(c)
    comps.append({"mode": "forced", "backend": "fi", "role": "shadow", "ref_role": "primary", "status": "error", "error": "x"})
    base = {"mode": "free", "backend": "fi", "role": "shadow", "ref_role": "primary", "status": "ok"}
    comps += [{**base, "diverged": True, "common_prefix": 5, "first_flip": 5, "flip_class": "runtime"},
              {**base, "diverged": False, "common_prefix": 9, "first_flip": None}]
    m.observe_comparisons(typed(comps))
    text = generate_latest(m.registry()).decode()
    lab = dict(backend="fi", role="shadow", mode="forced", ref_role="primary")
    want = ClusterMoments.of([b.get("runtime", 0) for _, b in turns], [n for n, _ in turns])
    assert value(text, "tensorverse_comparisons_total", **lab, outcome="ok") == want.clusters == 4
    assert value(text, "tensorverse_compared_tokens_total", **lab) == want.positions == 23
    assert value(text, "tensorverse_compared_tokens_squared_total", **lab) == want.positions_sq == 169
    runtime = dict(lab, **{"class": "runtime"})
    assert value(text, "tensorverse_flips_squared_total", **runtime) == want.numerator_sq == 14
    assert value(text, "tensorverse_flips_times_tokens_total", **runtime) == want.cross == 40
    assert value(text, "tensorverse_flips_squared_total", **lab, **{"class": "tie"}) == 1
    assert value(text, "tensorverse_flips_times_tokens_total", **lab, **{"class": "noise"}) == 2
    assert value(text, "tensorverse_flips_squared_total", **lab, **{"class": "near_tie"}) == 0  # at 0 from the start
    free = dict(lab, mode="free")  # a free comparison: one flip at most, over its prefix and the divergence
    assert value(text, "tensorverse_compared_tokens_squared_total", **free) == 6 * 6 + 9 * 9
    assert value(text, "tensorverse_flips_squared_total", **free, **{"class": "runtime"}) == 1
    assert value(text, "tensorverse_flips_times_tokens_total", **free, **{"class": "runtime"}) == 6
