"""Approximate metrics from top-k logprobs, against the full-vocabulary metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensorverse.analysis.metrics import AnalysisInputError, position_metrics, summarize
from tensorverse.analysis.report import render_table, result_from_metrics
from tensorverse.analysis.topk import parse_top_logprobs, topk_logprobs, topk_position_metrics


def _peaked(n, vocab, seed, noise=0.05):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, vocab))
    x[np.arange(n), rng.integers(0, vocab, n)] += 9.0  # most mass on a few tokens
    x[np.arange(n), rng.integers(0, vocab, n)] += 7.0
    y = x + rng.normal(0, noise, x.shape)
    return x, y


def test_close_to_full_metrics_when_k_covers_most_mass():
    x, y = _peaked(20, 300, seed=1)
    t = x.argmax(1)
    full = position_metrics(x, y, t)
    k = 120
    approx = topk_position_metrics(topk_logprobs(x, k), topk_logprobs(y, k), t)
    assert approx.approximate
    # coarsening can only lose divergence (data-processing inequality)
    assert np.all(approx.kl <= full.kl + 1e-12)
    assert np.allclose(approx.kl, full.kl, rtol=0.2, atol=1e-4)
    assert np.array_equal(approx.top1_agree, full.top1_agree)
    assert np.array_equal(approx.ref_top1, full.ref_top1)
    assert np.allclose(approx.delta_p, full.delta_p, atol=1e-12)
    assert np.allclose(approx.margin, full.margin, atol=1e-12)
    assert np.array_equal(approx.rank, full.rank)
    assert not approx.rank_lower_bound.any()
    assert np.all(approx.entropy <= full.entropy + 1e-9)


def test_exact_when_k_is_the_whole_vocabulary():
    x, y = _peaked(5, 40, seed=2, noise=0.5)
    t = np.array([0, 5, 9, 13, 39])
    full = position_metrics(x, y, t)
    approx = topk_position_metrics(topk_logprobs(x, 40), topk_logprobs(y, 40), t)
    assert np.allclose(approx.kl, full.kl, atol=1e-9)
    assert np.allclose(approx.entropy, full.entropy, atol=1e-9)
    assert np.array_equal(approx.rank, full.rank)


def test_token_missing_from_one_side():
    # P knows tokens 1, 2, 3; Q knows 1, 2, 4. Token 3 falls into the tail on both sides.
    P = {1: math.log(0.6), 2: math.log(0.3), 3: math.log(0.05)}
    Q = {1: math.log(0.5), 2: math.log(0.3), 4: math.log(0.1)}
    m = topk_position_metrics([P], [Q], [3])
    pt, qt = 1 - 0.9, 1 - 0.8
    want = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(1.0) + pt * math.log(pt / qt)
    assert m.kl[0] == pytest.approx(want, abs=1e-12)
    assert math.isnan(m.delta_p[0])  # q(3) unknown
    assert m.rank[0] == 3 and m.rank_lower_bound[0]
    row = m.rows()[0]
    assert row["rank"] == ">= 3" and row["approximate"] is True
    assert m.margin[0] == pytest.approx(0.3)
    assert m.top1_agree[0]


def test_rank_lower_bound_with_requested_k():
    # candidate reported top-2 plus the forced token 7 (rank unknown beyond 2)
    Q = {1: -0.5, 2: -1.5, 7: -6.0}
    P = {7: -0.1, 1: -3.0}
    m = topk_position_metrics([P], [Q], [7], k=2)
    assert m.rank[0] == 2 and m.rank_lower_bound[0]
    m = topk_position_metrics([P], [Q], [7])
    assert m.rank[0] == 2 and not m.rank_lower_bound[0]
    assert not m.top1_agree[0]


def test_parse_api_forms():
    assert parse_top_logprobs({"token_id:5": -0.1, "token_id:9": -2.5}) == {5: -0.1, 9: -2.5}
    assert parse_top_logprobs({5: -0.1}) == {5: -0.1}
    chat = [{"token": "token_id:3", "logprob": -0.2, "bytes": [1]},
            {"token": "token_id:4", "logprob": -9999.0}]
    assert parse_top_logprobs(chat) == {3: -0.2, 4: -math.inf}
    item = {"token": "token_id:8", "logprob": -4.0, "top_logprobs": chat}
    assert parse_top_logprobs(item) == {3: -0.2, 4: -math.inf, 8: -4.0}
    assert parse_top_logprobs([(1, -0.3)]) == {1: -0.3}
    with pytest.raises(AnalysisInputError, match="return_tokens_as_token_ids"):
        parse_top_logprobs({"hello": -0.1})
    with pytest.raises(AnalysisInputError):
        parse_top_logprobs(None)
    with pytest.raises(AnalysisInputError):
        parse_top_logprobs({"token_id:1": "x"})


def test_api_shaped_input_end_to_end():
    x, y = _peaked(3, 60, seed=3)
    t = x.argmax(1)
    ref = [{f"token_id:{k}": v for k, v in d.items()} for d in topk_logprobs(x, 20)]
    cand = [[{"token": f"token_id:{k}", "logprob": v} for k, v in d.items()]
            for d in topk_logprobs(y, 20)]
    m = topk_position_metrics(ref, cand, t)
    full = position_metrics(x, y, t)
    assert np.array_equal(m.top1_agree, full.top1_agree)
    assert np.all(m.kl <= full.kl + 1e-12)


def test_summary_and_table_flag_approximate():
    x, y = _peaked(6, 50, seed=4)
    t = x.argmax(1)
    m = topk_position_metrics(topk_logprobs(x, 5), topk_logprobs(y, 5), t)
    s = summarize(m)
    assert s["approximate"] is True and s["kl_bound"] == "lower"
    assert s["rank_lower_bounds"] == int(m.rank_lower_bound.sum())
    res = result_from_metrics(m)
    assert res["approximate"] is True
    assert "APPROXIMATE" in render_table(res)


def test_length_mismatch_and_empty():
    with pytest.raises(AnalysisInputError):
        topk_position_metrics([{1: -0.1}], [{1: -0.1}, {2: -0.1}], [1])
    with pytest.raises(AnalysisInputError):
        topk_position_metrics([], [], [])
    with pytest.raises(AnalysisInputError):
        topk_position_metrics([{}], [{1: -0.1}], [1])
