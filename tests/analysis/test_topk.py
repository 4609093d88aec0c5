"""Approximate metrics from top-k logprobs, against the full-vocabulary metrics."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from tensorverse.analysis.metrics import AnalysisInputError, position_metrics, summarize
from tensorverse.analysis.report import render_table, result_from_metrics
from tensorverse.analysis.topk import parse_top_logprobs, topk_logprobs, topk_position_metrics
from tests.refusals import refused


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
    with refused(AnalysisInputError, "format", "return_tokens_as_token_ids"):  # says how to ask for ids
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


# --- exact checks of each rule: parse errors, KL and entropy tails, margins, ranks, dtypes --------


def test_parse_errors_are_refused_with_their_reason():
    with refused(AnalysisInputError, "format", "True"):  # each refusal names the item it refuses
        parse_top_logprobs({True: -0.1})
    with refused(AnalysisInputError, "format"):
        parse_top_logprobs([(np.bool_(False), -0.1)])
    with refused(AnalysisInputError, "format", "'hello'"):
        parse_top_logprobs({"hello": -0.1})
    with refused(AnalysisInputError, "format", "'token_id:3'", "'x'"):
        parse_top_logprobs({"token_id:3": "x"})
    with refused(AnalysisInputError, "value"):
        parse_top_logprobs({"token_id:3": 0.5})
    with refused(AnalysisInputError, "value"):
        parse_top_logprobs([("token_id:3", math.nan)])
    with refused(AnalysisInputError, "format"):
        parse_top_logprobs(None)
    with refused(AnalysisInputError, "format"):
        parse_top_logprobs([{"token": "token_id:1"}])
    with refused(AnalysisInputError, "format"):
        parse_top_logprobs([{"logprob": -0.1}])
    with refused(AnalysisInputError, "format", "(1, -0.1, 7)"):
        parse_top_logprobs([(1, -0.1, 7)])
    with refused(AnalysisInputError, "format"):
        parse_top_logprobs([3])
    with refused(AnalysisInputError, "format"):
        parse_top_logprobs(5)
    # the sampled token of a chat content item: its own key is named
    with refused(AnalysisInputError, "format", "'token_id:8'"):
        parse_top_logprobs({"token": "token_id:8", "logprob": None, "top_logprobs": []})


def test_logprob_bounds_and_keys_without_the_prefix():
    # up to 1e-6 above 0 is float rounding of a certainty: clamped to 0, not refused
    assert parse_top_logprobs({1: 1e-6, 2: 5e-7, 3: -0.0}) == {1: 0.0, 2: 0.0, 3: 0.0}
    assert parse_top_logprobs({1: 2e-6 - 1e-6})[1] == 0.0
    for bad in (1.1e-6, 0.5, 1.0, 2.0, math.inf):
        with refused(AnalysisInputError, "value"):
            parse_top_logprobs({1: bad})
    # -9999 and below are vLLM's -inf; just above it stays finite
    assert parse_top_logprobs({1: -9999.0, 2: -1e5, 3: -9998.5}) == {1: -math.inf, 2: -math.inf, 3: -9998.5}
    # keys: a bare number string, an int, a numpy integer
    assert parse_top_logprobs({"42": -0.1, np.int32(7): -0.2, 9: -0.3}) == {42: -0.1, 7: -0.2, 9: -0.3}


def test_chat_content_item_needs_both_token_and_logprob_to_add_the_sampled_one():
    top = [{"token": "token_id:3", "logprob": -0.2}]
    assert parse_top_logprobs({"token": "token_id:8", "top_logprobs": top}) == {3: -0.2}
    assert parse_top_logprobs({"logprob": -4.0, "top_logprobs": top}) == {3: -0.2}
    assert parse_top_logprobs({"token": "token_id:8", "logprob": -4.0, "top_logprobs": None}) == {8: -4.0}
    # the top list wins over the sampled copy of the same token
    assert parse_top_logprobs({"token": "token_id:3", "logprob": -0.3, "top_logprobs": top}) == {3: -0.2}


def _log_softmax_rows(x):
    """Plain-Python float64 log-softmax of each row, and the ids sorted by (-logit, id)."""
    out = []
    for row in x.tolist():
        m = max(row)
        lse = m + math.log(math.fsum(math.exp(v - m) for v in row))
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))
        out.append((order, [v - lse for v in row]))
    return out


def test_topk_logprobs_exactly_k_entries_in_float64_even_from_float32():
    rng = np.random.default_rng(11)
    x = (rng.normal(0, 3, (4, 30)) + 5).astype(np.float32)
    x[0, 3] = x[0, 17] = x[0].max() + 1  # a tie at the top: the lower id first
    got = topk_logprobs(x, 6)
    assert len(got) == 4
    for d, (order, lps) in zip(got, _log_softmax_rows(x.astype(np.float64))):
        assert list(d) == order[:6]
        for j, v in d.items():
            assert type(j) is int and type(v) is float
            assert v == pytest.approx(lps[j], abs=1e-12)
    assert list(got[0])[:2] == [3, 17]
    # more than the vocabulary: the whole row
    assert [len(d) for d in topk_logprobs(x[:2], 99)] == [30, 30]
    # one row as a 1-D array
    one = topk_logprobs(x[1], 3)
    assert len(one) == 1 and list(one[0].items()) == list(got[1].items())[:3]


def test_kl_and_entropy_with_a_zero_probability_token_and_no_known_mass_in_common():
    # P's only token in common with Q has logprob -inf (vLLM's -9999): P's known mass in
    # common is 0, its tail 1; Q's tail there is 0.5.
    P = {1: -9999.0, 2: 0.0}
    Q = {1: math.log(0.5), 3: math.log(0.5)}
    m = topk_position_metrics([P], [Q], [2], tail_floor=0.0)
    assert m.kl[0] == pytest.approx(math.log(2.0), abs=1e-12)
    # P is certain of token 2: entropy 0, no tail term (its tail is exactly 0)
    assert m.entropy[0] == 0.0
    # no token in common at all: every mass is in the tail on both sides, KL 0
    m = topk_position_metrics([{1: math.log(0.7)}], [{2: math.log(0.9)}], [1])
    assert m.kl[0] == 0.0


def test_kl_with_one_token_in_common_uses_both_tails():
    P = {1: math.log(0.6), 2: math.log(0.3)}
    Q = {1: math.log(0.2), 5: math.log(0.7)}
    m = topk_position_metrics([P], [Q], [1])
    want = 0.6 * math.log(0.6 / 0.2) + 0.4 * math.log(0.4 / 0.8)
    assert m.kl[0] == pytest.approx(want, abs=1e-12)


def test_kl_terms_do_not_warn_when_both_sides_give_minus_inf():
    P = {1: -math.inf, 2: math.log(0.5), 3: math.log(0.5)}
    Q = {1: -math.inf, 2: math.log(0.25), 3: math.log(0.75)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = topk_position_metrics([P], [Q], [2])
    # -inf - -inf is NaN; the KL term of a token P gives 0 is 0, silently
    assert not [w for w in caught if "subtract" in str(w.message)]
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert m.kl[0] == pytest.approx(want, abs=1e-12)


def test_entropy_counts_the_tail_as_one_bucket():
    P = {1: math.log(0.5), 2: math.log(0.3), 4: -math.inf}
    m = topk_position_metrics([P], [P], [1])
    want = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    assert m.entropy[0] == pytest.approx(want, abs=1e-12)
    # a tail below the floor adds nothing
    m = topk_position_metrics([P], [P], [1], tail_floor=0.25)
    assert m.entropy[0] == pytest.approx(-(0.5 * math.log(0.5) + 0.3 * math.log(0.3)), abs=1e-12)


def test_margin_of_one_and_of_two_entries_and_ties_to_the_lower_id():
    m = topk_position_metrics([{4: math.log(0.9)}], [{4: math.log(0.8)}], [4])
    assert math.isnan(m.margin[0]) and m.ref_top1[0] == 4
    m = topk_position_metrics([{4: math.log(0.7), 6: math.log(0.2)}], [{4: -0.1}], [4])
    assert m.margin[0] == pytest.approx(0.5, abs=1e-12)
    # ties: the lowest token id is the top-1, whatever the order of the entries
    tie = {9: math.log(0.4), 2: math.log(0.4), 5: math.log(0.2)}
    m = topk_position_metrics([tie], [{5: -0.1, 9: math.log(0.4), 2: math.log(0.4)}], [2])
    assert m.ref_top1[0] == 2 and m.margin[0] == pytest.approx(0.0, abs=1e-15)
    assert m.cand_top1[0] == 5 and not m.top1_agree[0]


def test_rank_of_a_token_missing_from_the_candidate_is_k_when_k_is_given():
    P = {7: -0.1}
    Q = {1: -0.5, 2: -1.5, 3: -2.0}
    m = topk_position_metrics([P, P, P], [Q, Q, Q], [7, 7, 7], k=5)
    assert m.rank.tolist() == [5, 5, 5] and m.rank_lower_bound.all()
    m = topk_position_metrics([P], [Q], [7], k=0)
    assert m.rank[0] == 0 and m.rank_lower_bound[0]
    m = topk_position_metrics([P], [Q], [7], k=-3)
    assert m.rank[0] == 0 and m.rank_lower_bound[0]
    m = topk_position_metrics([P], [Q], [7])
    assert m.rank[0] == 3 and m.rank_lower_bound[0]
    # present in Q's top-k below k: exact
    m = topk_position_metrics([P], [Q], [2], k=5)
    assert m.rank[0] == 1 and not m.rank_lower_bound[0]


def test_metric_dtypes():
    P = {1: math.log(0.6), 2: math.log(0.3)}
    Q = {2: math.log(0.6), 1: math.log(0.3)}
    for tokens in (np.array([1, 2], np.int32), np.array([1, 2], np.uint8), [1, 2]):
        m = topk_position_metrics([P, P], [Q, {9: -0.1}], tokens)
        assert m.tokens.dtype == np.int64 and m.tokens.tolist() == [1, 2]
        assert m.ref_top1.dtype == np.int64 and m.cand_top1.dtype == np.int64
        assert m.rank.dtype == np.int64
        assert m.rank_lower_bound.dtype == bool and m.top1_agree.dtype == bool
        assert m.rank_lower_bound.tolist() == [False, True]
        assert m.ref_top1.tolist() == [1, 1] and m.cand_top1.tolist() == [2, 9]
        assert m.kl.dtype == np.float64 and m.entropy.dtype == np.float64


def test_metrics_error_messages():
    one = [{1: -0.1}]
    with refused(AnalysisInputError, "empty"):
        topk_position_metrics([], [], [])
    with refused(AnalysisInputError, "shape"):
        topk_position_metrics(one, one * 2, [1])
    with refused(AnalysisInputError, "shape"):
        topk_position_metrics(one * 2, one, [1])
    with refused(AnalysisInputError, "format"):
        topk_position_metrics(one * 2, one * 2, [[1, 2], [3]])
    with refused(AnalysisInputError, "dtype"):
        topk_position_metrics(one, one, [1.0])
    with refused(AnalysisInputError, "dtype"):
        topk_position_metrics(one, one, np.array([[1]], np.int64))
    with refused(AnalysisInputError, "token_id"):
        topk_position_metrics(one * 2, one * 2, [1, -1])
    # an empty top-k is refused naming its side and position
    with refused(AnalysisInputError, "empty", "reference", "position 1"):
        topk_position_metrics(one + [{}], one * 2, [1, 1])
    with refused(AnalysisInputError, "empty", "candidate", "position 0"):
        topk_position_metrics(one, [[]], [1])
    with refused(AnalysisInputError, "empty", "reference", "position 0"):
        topk_position_metrics([{}], [{}], [1])


def test_stored_form_reads_as_the_general_parser_reads_it():
    """The fast path for the stored ``[[id, logprob], ...]`` form gives what the general parser
    gives, and refuses what it refuses, over edge values (the sentinel, -0.0, tiny positives,
    NaN, bools, numpy scalars, tuples, duplicate ids)."""
    from tensorverse.analysis.topk import _general_top_logprobs

    rng = np.random.default_rng(5)
    odd = [0.0, -0.0, -9999.0, -1e5, -9998.999, 1e-7, 2e-6, math.nan, -math.inf, True, np.float32(-0.5), 3, "-1.5"]
    ids = [0, 7, 7, 151_935, -1, True, np.int64(4), "token_id:9", 2.0]
    seen = {"fast": 0, "refused": 0}
    for _ in range(2000):
        entry = []
        for _ in range(int(rng.integers(0, 6))):
            k = int(rng.integers(0, 200)) if rng.random() < 0.8 else ids[int(rng.integers(len(ids)))]
            v = float(-rng.exponential(3)) if rng.random() < 0.8 else odd[int(rng.integers(len(odd)))]
            item = [k, v] if rng.random() < 0.9 else ((k, v) if rng.random() < 0.5 else [k, v, 0])
            entry.append(item)
        try:
            want: object = _general_top_logprobs(entry)
        except AnalysisInputError:
            want = AnalysisInputError
        try:
            got: object = parse_top_logprobs(entry)
        except AnalysisInputError:
            got = AnalysisInputError
        assert repr(got) == repr(want), entry  # repr: -0.0 and -inf compared exactly
        seen["refused" if want is AnalysisInputError else "fast"] += 1
    assert seen["fast"] > 500 and seen["refused"] > 50


def test_the_stored_form_is_read_by_the_fast_path_itself():
    """``[[id, logprob], ...]`` with logprobs in (-9999, 0], 0.0 included, is read without the
    general parser; any other item sends the whole entry to it (None)."""
    from tensorverse.analysis.topk import _stored_pairs

    assert _stored_pairs([[7, 0.0], [3, -0.5], [9, -9998.5]]) == {7: 0.0, 3: -0.5, 9: -9998.5}
    assert _stored_pairs([]) == {}
    for bad in ([(7, -0.5)], [[7, -0.5, 1]], [[7.0, -0.5]], [[7, -1]], [[7, -9999.0]], [[7, 1e-7]]):
        assert _stored_pairs(bad) is None, bad
