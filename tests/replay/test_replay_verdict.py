"""The replay's verdict and `--fail-on 'NAME:verdict=DECISION'` (issue 25)."""

from __future__ import annotations

import pytest

from tensorverse.replay.report import check_thresholds, parse_threshold
from tests.replay.test_replay_runner import _replay, corpus_dir  # noqa: F401 - the fixture
from tensorverse.testing.fake_vllm import FakeVLLM


def test_replay_results_carry_each_candidates_verdict(corpus_dir):  # noqa: F811
    res = _replay(corpus_dir, {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)}, reference="ref")
    by = {s["backend"]: s for s in res["verdict"]["shadows"]}
    assert set(by) == {"cand"}  # the reference is the basis, not a candidate
    v = by["cand"]
    turns = [t for c in res["cases"] for t in c["turns"]]
    assert v["turns"] == len(turns) == 4
    # the turn-level flip excess: the mean over turns of each turn's runtime flips per position
    per_turn = [t["backends"]["cand"]["forced"]["flip_classes"].count("runtime") / t["backends"]["cand"]["forced"]["n"]
                for t in turns]
    assert v["flip_excess"]["estimate"] == pytest.approx(sum(per_turn) / len(per_turn))
    assert v["runtime_flips"] == res["summary"]["cand"]["runtime_flips"]
    assert v["floor_backend"] is None and v["decision"] == "undecided"  # 4 turns decide nothing


def test_verdict_rules_parse_and_apply():
    r = parse_threshold("fp8:verdict=regression")
    assert r == {"spec": "fp8:verdict=regression", "backend": "fp8", "metric": "verdict", "op": "==",
                 "value": "regression"}
    assert parse_threshold("verdict != equivalent")["op"] == "!="
    with pytest.raises(ValueError, match="one of regression, equivalent, undecided"):
        parse_threshold("fp8:verdict=bad")
    results = {"summary": {"fp8": {}, "fp32": {}, "ref": {"reference": True}},
               "verdict": {"shadows": [{"backend": "fp8", "decision": "regression"},
                                       {"backend": "fp32", "decision": "undecided"}]}}
    failed = check_thresholds(results, [parse_threshold("verdict=regression")])
    assert [f["backend"] for f in failed] == ["fp8"] and failed[0]["message"] == "fp8: verdict = regression (verdict=regression)"
    failed = check_thresholds(results, [parse_threshold("verdict!=equivalent")])
    assert sorted(f["backend"] for f in failed) == ["fp32", "fp8"]
    assert check_thresholds(results, [parse_threshold("fp32:verdict=regression")]) == []
    assert check_thresholds(results, [parse_threshold("zz:verdict=regression")])[0]["actual"] is None
