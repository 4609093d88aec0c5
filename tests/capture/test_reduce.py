"""Evidence chosen at the source (capture/reduce.py): the compact form a row travels as is the
store's own compaction of that row, and every row that is evidence travels in full with its reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorverse.analysis.metrics import widen_bf16
from tensorverse.capture.optin import EvidenceSpec
from tensorverse.capture.reduce import decide, reduce_rows
from tensorverse.store.codec import row_checksum
from tensorverse.store.compact import compact_row, log_sum_exp

V = 4096


def _host(row: torch.Tensor) -> tuple[np.ndarray, str | None, str]:
    """The row as the tap's host buffer holds it, its codec dtype and its store dtype name."""
    if row.dtype is torch.bfloat16:
        return row.view(torch.int16).numpy().view(np.uint16), "bfloat16", "bfloat16"
    arr = row.numpy()
    return arr, None, str(arr.dtype)


def _decide(row: torch.Tensor, spec: EvidenceSpec):
    arr, codec_dtype, name = _host(row)
    return decide(reduce_rows(row, spec.k), 0, spec, dtype=name, fingerprint=row_checksum(arr, dtype=codec_dtype))


def _spec(k=20, close=0.1, forced=-1, requested=False):
    return EvidenceSpec(k, close, forced, requested)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_a_compact_row_is_the_stores_compaction_of_the_full_row(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    row = (torch.randn(V, generator=g) * 4).to(dtype)
    row[int(torch.randint(V, (1,), generator=g))] = 30.0  # a clear top-1: neither a flip nor close
    arr, codec_dtype, name = _host(row)
    x = widen_bf16(arr).astype(np.float32)
    top1 = int(np.argmax(x))
    d = _decide(row, _spec(forced=top1))
    assert d.reason is None
    ref = compact_row(x, k=20, extra=[top1, top1], dtype=name, fingerprint=row_checksum(arr, dtype=codec_dtype))
    got = d.compact
    assert (got.vocab, got.dtype, got.fingerprint, got.k) == (ref.vocab, ref.dtype, ref.fingerprint, ref.k)
    assert got.ids.tolist() == ref.ids.tolist()
    assert got.logits.tobytes() == ref.logits.tobytes()
    assert abs(got.lse - log_sum_exp(x)) <= 1e-13 * abs(log_sum_exp(x))
    assert abs(got.lse - ref.lse) <= 1e-13 * abs(ref.lse)


def test_ties_inside_the_window_are_ordered_by_the_lower_id_as_the_store_orders_them():
    row = torch.full((V,), -5.0)
    row[[700, 30, 2000, 9]] = 3.0  # four-way tie at the top
    row[[100, 200]] = 1.0
    d = _decide(row, _spec(k=3, close=0.0, forced=9))
    assert d.reason is None
    assert d.compact.ids.tolist() == [9, 30, 700]
    assert d.compact.ids.tolist() == compact_row(row.numpy(), k=3).ids.tolist()


def test_ties_that_reach_past_the_window_send_the_row_in_full():
    row = torch.full((V,), -5.0)
    row[0] = 9.0
    row[1:40] = 2.0  # 39 entries tied at the k-th value: past k + window
    assert _decide(row, _spec(k=5, close=0.0, forced=0)).reason == "ties"
    # the same tie inside the window is ordered exactly
    row[1:10] = 2.0
    row[10:40] = -5.0
    assert _decide(row, _spec(k=5, close=0.0, forced=0)).compact.ids.tolist() == [0, 1, 2, 3, 4]


def _distinct():
    return torch.linspace(-5.0, -1.0, V)  # no two entries equal


def test_a_forced_row_whose_top1_is_another_token_is_a_flip():
    row = _distinct()
    row[5], row[6] = 10.0, 4.0
    assert _decide(row, _spec(forced=6)).reason == "flip"
    assert _decide(row, _spec(forced=5)).reason is None


def test_an_exact_tie_at_the_top_flips_to_the_lower_id():
    row = _distinct()
    row[[5, 6]] = 10.0
    assert _decide(row, _spec(close=0.0, forced=6)).reason == "flip"
    assert _decide(row, _spec(close=0.0, forced=5)).reason is None


def test_a_close_call_is_a_gap_strictly_below_close_nats():
    row = _distinct()
    row[5], row[6] = 10.0, 9.75
    assert _decide(row, _spec(close=0.25, forced=5)).reason is None
    assert _decide(row, _spec(close=0.2500001, forced=5)).reason == "close"
    assert _decide(row, _spec(close=0.3, forced=-1)).reason == "close"  # free rows too


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_nan_or_infinity_is_sent_in_full(bad):
    row = torch.zeros(V)
    row[5] = 10.0
    row[77] = bad
    assert _decide(row, _spec(forced=-1)).reason == "nonfinite"


def test_a_requested_position_is_sent_in_full_whatever_it_holds():
    row = torch.zeros(V)
    row[5] = 10.0
    assert _decide(row, _spec(forced=5, requested=True)).reason == "requested"


def test_a_batch_reduces_as_its_rows_one_by_one():
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(5, V, generator=g) * 3
    batch = reduce_rows(rows, 20)
    for i in range(5):
        one = reduce_rows(rows[i], 20)
        assert batch.vals[i].tobytes() == one.vals[0].tobytes()
        assert batch.lse[i] == pytest.approx(one.lse[0], rel=1e-15)
        fp = row_checksum(rows[i].numpy())
        a = decide(batch, i, _spec(), dtype="float32", fingerprint=fp)
        b = decide(one, 0, _spec(), dtype="float32", fingerprint=fp)
        assert a.reason == b.reason
        assert a.compact.ids.tolist() == b.compact.ids.tolist()
        assert a.compact.logits.tobytes() == b.compact.logits.tobytes()


def test_k_past_the_window_is_refused():
    row = torch.zeros(16)
    r = reduce_rows(row, 4, window=2)
    with pytest.raises(ValueError):
        decide(r, 0, _spec(k=10), dtype="float32", fingerprint=0)


def test_k_above_the_vocabulary_keeps_the_whole_row_as_compaction_does():
    row = torch.linspace(-1.0, 1.0, 12)
    d = decide(reduce_rows(row, 50), 0, _spec(k=50, close=0.0), dtype="float32", fingerprint=0)
    assert d.compact.k == 12 and d.compact.ids.tolist() == compact_row(row.numpy(), k=12).ids.tolist()


# -- the edges of the window (WINDOW = 8 entries read past k) ----------------------------------


def test_a_forced_row_whose_top_is_tied_past_the_window_is_sent_in_full():
    row = torch.full((V,), -5.0)
    row[3:3 + 40] = 2.0  # 40 entries share the top: which is the top-1 is not known from 13
    assert _decide(row, _spec(k=5, close=0.0, forced=7)).reason == "ties"
    assert _decide(row, _spec(k=5, close=0.0, forced=3)).reason == "ties"  # even the lowest id


def test_a_top_tied_over_the_window_but_its_last_entry_is_known():
    row = torch.full((V,), -5.0)
    row[20:29] = 2.0  # 9 of the k + 8 = 10 entries read share the top; the 10th is lower
    d = _decide(row, _spec(k=2, close=0.0, forced=20))
    assert d.reason is None and d.compact.ids.tolist() == [20, 21]


def test_a_clear_top_with_the_rest_tied_travels_compact_at_k_1():
    row = torch.full((V,), 0.0)
    row[9] = 4.0  # the top-1 is known; everything after it is tied, past the window
    d = _decide(row, _spec(k=1, close=0.0, forced=9))
    assert d.reason is None and d.compact.ids.tolist() == [9]


def test_ties_below_the_kth_entry_do_not_matter():
    row = torch.full((V,), 0.0)
    row[4], row[8] = 9.0, 8.0  # the top 2 distinct; the rest tied, past the window
    assert _decide(row, _spec(k=2, close=0.0, forced=4)).compact.ids.tolist() == [4, 8]


def test_ties_with_the_kth_entry_inside_the_window_are_ordered():
    row = torch.full((V,), -5.0)
    row[0] = 9.0
    row[1:9] = 2.0  # tied with the k-th (k = 2): 8 entries, the window's last one is lower
    assert _decide(row, _spec(k=2, close=0.0, forced=0)).compact.ids.tolist() == [0, 1]


def test_a_row_no_wider_than_the_window_is_decided_whole_even_when_all_tied():
    row = torch.zeros(8)  # k + 8 covers the whole row: nothing lies past the window
    d = decide(reduce_rows(row, 20), 0, _spec(k=20, close=0.0, forced=0), dtype="float32", fingerprint=0)
    assert d.reason is None and d.compact.ids.tolist() == list(range(8))
    flip = decide(reduce_rows(row, 20), 0, _spec(k=20, close=0.0, forced=5), dtype="float32", fingerprint=0)
    assert flip.reason == "flip"  # the tie goes to the lower id, 0


def test_token_zero_can_be_forced_and_flip():
    row = _distinct()
    row[5] = 10.0
    assert _decide(row, _spec(forced=0)).reason == "flip"
    row[0] = 11.0
    assert _decide(row, _spec(forced=0)).reason is None


def test_a_two_entry_row_can_be_a_close_call():
    row = torch.tensor([1.0, 1.05])
    d = decide(reduce_rows(row, 1), 0, _spec(k=1, close=0.1), dtype="float32", fingerprint=0)
    assert d.reason == "close"
