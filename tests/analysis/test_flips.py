"""Forced-mode flips and the free-mode divergence point on hand-built cases."""

from __future__ import annotations

import numpy as np
import pytest

from tests.refusals import refused

from tensorverse.analysis.flips import (
    first_difference,
    FreeDivergence,
    first_forced_flip,
    forced_flips,
    free_divergence,
)
from tensorverse.analysis.metrics import AnalysisInputError, position_metrics, summarize


def _rows_with_argmax(tops, vocab=10, value=5.0):
    a = np.zeros((len(tops), vocab), np.float32)
    a[np.arange(len(tops)), tops] = value
    return a


def test_forced_flips_exact_indices():
    ref_tops = [1, 2, 3, 4, 5, 6, 7]
    cand_tops = [1, 9, 3, 4, 0, 6, 8]
    m = position_metrics(_rows_with_argmax(ref_tops), _rows_with_argmax(cand_tops), ref_tops)
    assert forced_flips(m) == [1, 4, 6]
    assert first_forced_flip(m) == 1
    s = summarize(m)
    assert s["flips"] == 3 and s["first_flip"] == 1


def test_no_flips():
    tops = [3, 3, 0]
    m = position_metrics(_rows_with_argmax(tops), _rows_with_argmax(tops) * 2, tops)
    assert forced_flips(m) == []
    assert first_forced_flip(m) is None


def test_flip_from_a_tie_broken_differently():
    # reference ties 2 and 5 (top1 = 2); candidate nudges 5 above 2 -> flip at 0 only
    ref = np.zeros((2, 8))
    ref[0, [2, 5]] = 3.0
    ref[1, 1] = 1.0
    cand = ref.copy()
    cand[0, 5] = 3.0001
    m = position_metrics(ref, cand, [2, 1])
    assert forced_flips(m) == [0]
    assert m.margin[0] == 0.0


def test_flip_without_changing_the_reference_token_rank():
    # the forced token is not the reference's argmax: flips are about argmaxes only
    ref = np.array([[0.0, 2.0, 1.0]])
    cand = np.array([[0.0, 2.0, 1.5]])
    m = position_metrics(ref, cand, [2])
    assert forced_flips(m) == []
    assert m.rank[0] == 1


def test_free_divergence_token():
    d = free_divergence([10, 11, 12, 13, 14], [10, 11, 12, 99, 14])
    assert d == FreeDivergence(position=3, common_prefix=3, ref_len=5, cand_len=5,
                               kind="token", ref_token=13, cand_token=99)
    assert d.diverged


def test_free_divergence_at_first_token():
    d = free_divergence([1, 2], [2, 2])
    assert d.position == 0 and d.common_prefix == 0


def test_free_divergence_identical():
    d = free_divergence([4, 5, 6], np.array([4, 5, 6]))
    assert d.position is None and d.common_prefix == 3 and d.kind is None
    assert not d.diverged


def test_free_divergence_one_branch_stops_early():
    d = free_divergence([1, 2, 3, 4], [1, 2])
    assert (d.position, d.common_prefix, d.kind) == (2, 2, "length")
    assert d.ref_token == 3 and d.cand_token is None
    d = free_divergence([1, 2], [1, 2, 7])
    assert (d.position, d.common_prefix, d.kind) == (2, 2, "length")
    assert d.ref_token is None and d.cand_token == 7


def test_free_divergence_empty():
    assert free_divergence([], []).position is None
    d = free_divergence([], [5])
    assert d.position == 0 and d.kind == "length"


def test_free_divergence_as_dict():
    d = free_divergence([1, 2, 3], [1, 5, 3]).as_dict()
    assert d["position"] == 1 and d["common_prefix"] == 1 and d["kind"] == "token"


def test_free_divergence_bad_input():
    with pytest.raises(AnalysisInputError):
        free_divergence([1.5, 2.0], [1, 2])
    with pytest.raises(AnalysisInputError):
        free_divergence([[1, 2]], [1, 2])


@pytest.mark.parametrize("a,b,want", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1], 1),
    ([], [], None), ([], [5], 0), ([4], [5], 0),
])
def test_first_difference(a, b, want):
    """Where the viewer's timeline, the template check and the forced run's own check say two
    token sequences part (one function for the three)."""
    assert first_difference(a, b) == want
    assert first_difference(b, a) == want


# --------------------------------------------------------------------------- records, token checks and dtypes exactly


def test_free_divergence_records_every_field_on_each_path():
    from tensorverse.analysis.flips import free_divergence

    tok = free_divergence([5, 6, 7, 8], [5, 6, 9])
    assert tok.as_dict() == {"position": 2, "common_prefix": 2, "ref_len": 4, "cand_len": 3, "kind": "token",
                             "ref_token": 7, "cand_token": 9}
    same = free_divergence([5, 6], np.array([5, 6], np.uint16))
    assert same.as_dict() == {"position": None, "common_prefix": 2, "ref_len": 2, "cand_len": 2, "kind": None,
                              "ref_token": None, "cand_token": None}
    longer = free_divergence([5], [5, 6, 7])
    assert longer.as_dict() == {"position": 1, "common_prefix": 1, "ref_len": 1, "cand_len": 3, "kind": "length",
                                "ref_token": None, "cand_token": 6}
    assert [type(v) for v in tok.as_dict().values()] == [int] * 4 + [str, int, int]


def test_token_errors_name_the_argument_and_the_reason():
    from tensorverse.analysis.flips import free_divergence
    from tensorverse.analysis.metrics import AnalysisInputError

    with refused(AnalysisInputError, "shape", "ref_tokens"):
        free_divergence([[1, 2]], [1])
    with refused(AnalysisInputError, "dtype", "cand_tokens"):
        free_divergence([1], [1.5])
    with refused(AnalysisInputError, "format", "ref_tokens"):
        free_divergence([1, [2, 3]], [1])


def test_token_vectors_are_int64_and_not_copied_when_they_already_are():
    from tensorverse.analysis.flips import _token_vector

    assert _token_vector([], "x").dtype == np.int64
    assert _token_vector(np.array([3], np.uint8), "x").dtype == np.int64
    a = np.array([1, 2], np.int64)
    assert _token_vector(a, "x") is a


def test_forced_flips_read_agreement_as_booleans():
    from types import SimpleNamespace

    from tensorverse.analysis.flips import first_forced_flip, forced_flips

    m = SimpleNamespace(top1_agree=np.array([1, 0, 1, 0]))  # 0/1 integers: ~ must be a boolean not
    assert forced_flips(m) == [1, 3] and first_forced_flip(m) == 1
    assert first_forced_flip(SimpleNamespace(top1_agree=[1, 1])) is None
