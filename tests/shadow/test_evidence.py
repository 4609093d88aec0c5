"""What the proxy asks of a shadow's plugin when evidence is chosen at the source
(shadow/evidence.py): the positions every run keeps in full, and the xargs that carry them."""

from __future__ import annotations

import pytest

from tensorverse.capture.optin import Positions, parse_extra_args
from tensorverse.shadow.evidence import (
    SourceEvidence,
    close_threshold,
    free_requested_positions,
    requested_positions,
    xargs,
)
from tensorverse.shadow.turn import TurnInput
from tensorverse.store.compaction import sampled

PIECES = ["Sure", ".", "<tool_call>", '{"name": "', "show", '_vlan", ', '"arguments": {"vlan": ', "201",
          "}}", "</tool_call>", "done"]


def _turn(top=None, pieces=PIECES, tid="t1"):
    return TurnInput(id=tid, prompt_token_ids=[1, 2], output_token_ids=list(range(100, 100 + len(PIECES))),
                     top_logprobs=top, pieces=pieces)


def test_the_tool_call_regions_of_the_primarys_answer_are_requested():
    got = requested_positions(_turn(), SourceEvidence(sample=0.0))
    assert got == list(range(2, 10))  # <tool_call> ... </tool_call>, not the content around it


def test_the_primarys_close_calls_are_requested_strictly_below_close_nats():
    top = [[[100, -0.1], [7, -3.0]]] * 11
    top[0] = [[100, -0.5], [7, -0.5625]]  # 0.0625 nats apart: close
    top[10] = [[110, -0.5], [7, -0.625]]  # 0.125 nats apart: not below 0.125
    top[1] = [[101, -0.0]]  # one entry: nothing to compare
    got = requested_positions(_turn(top=top, pieces=None), SourceEvidence(close_nats=0.125, sample=0.0, close_share=1.0))
    assert got == [0]


def test_close_calls_are_capped_at_close_share_the_closest_first_and_tv_close_follows():
    gaps = [0.05, 0.01, 0.5, 0.03, 0.02, 0.9, 0.08, 1.0, 2.0, 3.0, 0.04]
    top = [[[100 + p, -0.01], [7, -0.01 - g]] for p, g in enumerate(gaps)]
    t = _turn(top=top, pieces=None)
    ev = SourceEvidence(close_nats=0.1, close_share=0.2, sample=0.0)  # at most int(0.2 * 11) = 2
    assert requested_positions(t, ev) == [1, 4]  # gaps 0.01 and 0.02
    assert close_threshold(t, ev) == pytest.approx(0.03)  # the closest one left out: rows under it travel full
    assert close_threshold(t, SourceEvidence(close_nats=0.1, close_share=1.0)) == 0.1  # the cap not reached
    assert close_threshold(t, SourceEvidence(close_nats=0.1, close_share=0.0)) == pytest.approx(0.01)


def test_the_seeded_sample_is_the_one_compaction_keeps():
    t = _turn(pieces=None, tid="turn-xyz")
    ev = SourceEvidence(sample=0.3, seed=5)
    assert requested_positions(t, ev) == [p for p in range(11) if sampled(5, "turn-xyz", p, 0.3)]
    assert requested_positions(t, ev)  # 0.3 of 11 positions: some


def test_a_free_run_is_asked_for_the_sample_of_its_own_length_and_nothing_of_the_primarys():
    top = [[[100 + p, -0.01], [7, -0.02]] for p in range(11)]  # every position a close call
    t = _turn(top=top, tid="turn-xyz")  # with tool-call regions
    ev = SourceEvidence(sample=0.3, seed=5, close_share=1.0)
    assert requested_positions(t, ev) == list(range(11))
    assert free_requested_positions(t, ev, 40) == [p for p in range(40) if sampled(5, "turn-xyz", p, 0.3)]
    # where the runs overlap, the forced and the free run keep the same sampled positions
    assert [p for p in free_requested_positions(t, ev, 40) if p < 11] == \
        requested_positions(t, SourceEvidence(sample=0.3, seed=5, close_share=0.0, close_nats=0.0), pieces=[])
    assert free_requested_positions(t, SourceEvidence(sample=0.0), 40) == []
    assert free_requested_positions(t, ev, 0) == [] and free_requested_positions(t, ev, -3) == []


def test_pieces_of_another_length_are_ignored():
    assert requested_positions(_turn(pieces=PIECES[:-1]), SourceEvidence(sample=0.0)) == []


def test_xargs_read_back_as_the_plugin_reads_them():
    ev = SourceEvidence(k=16, close_nats=0.25)
    x = xargs(ev, [9, 1, 2, 3, 7, 2])
    assert x == {"tv_compact": 16, "tv_close": 0.25, "tv_full": "1-3,7,9"}
    opt = parse_extra_args({"tv_capture": "r", **x})
    assert opt.full == Positions.parse([1, 2, 3, 7, 9]) and opt.compact == 16 and opt.close_nats == 0.25
    assert "tv_full" not in xargs(ev, [])


@pytest.mark.parametrize("bad", [{"k": 0}, {"k": 5000}, {"close_nats": -1.0}, {"sample": 1.5}])
def test_a_bad_policy_is_refused(bad):
    with pytest.raises(ValueError):
        SourceEvidence(**bad)


def test_a_workload_reduced_at_the_source_compares_as_full_capture(tmp_path):
    """The shadow workload (three shadows, forced and free) stored twice, in full and reduced at
    the source as the plugin reduces it: identical flips, classes and free verdicts, and only the
    evidence rows in full."""
    import numpy as np

    from tensorverse.store import Store
    from tensorverse.testing.shadow_workload import prepare_turn, store_turn

    rng = np.random.default_rng(3)
    ref = (rng.standard_normal((40, 600)) * 3).astype(np.float32)
    shadow = ref + (rng.standard_normal((40, 600)) * 1e-3).astype(np.float32)
    other = (rng.standard_normal((40, 600)) * 3).astype(np.float32)
    out = {}
    for form, ev in (("full", None), ("source", SourceEvidence(sample=0.0))):
        prep = prepare_turn("t", "s", 0, ref, shadow, other, flip_share=0.1, seed=1, created_ns=1, evidence=ev)
        with Store.open(tmp_path / form) as st:
            out[form] = {(c.backend, c.mode, c.ref_role): c for c in store_turn(st, prep).comparisons}
            if ev is not None:
                full_rows = {k: sum(1 for r in blobs if not r[3]) for k, (_, _, blobs) in prep.runs.items()}
    assert set(out["full"]) == set(out["source"])
    for k, c in out["full"].items():
        for field in ("flips", "flip_classes", "first_flip", "diverged", "flip_class"):
            assert getattr(out["source"][k], field, None) == getattr(c, field, None), (k, field)
    cand = out["full"][("candidate", "forced", "secondary")]
    assert len(cand.flips) >= 3
    assert full_rows[("candidate", "forced")] >= len(cand.flips)  # its flips travelled in full
    assert full_rows[("twin", "forced")] <= 2  # an agreeing shadow: only its close calls


def _gapped(gaps, extra_entries=0):
    top = [[[100 + p, -0.01], [7, -0.01 - g]] for p, g in enumerate(gaps)]
    t = TurnInput(id="t1", prompt_token_ids=[1], output_token_ids=list(range(len(gaps))),
                  top_logprobs=top + [[[1, -0.01], [2, -0.011]]] * extra_entries)
    return t


def test_the_cap_is_at_least_one_close_call_and_none_at_a_zero_share():
    t = _gapped([0.05, 0.01, 0.5, 0.03, 0.02, 0.9, 0.08, 1.0, 2.0, 3.0, 0.04])
    assert requested_positions(t, SourceEvidence(close_share=0.05, sample=0.0)) == [1]  # int(0.55) = 0 -> 1
    assert close_threshold(t, SourceEvidence(close_share=0.05)) == pytest.approx(0.02)
    assert requested_positions(t, SourceEvidence(close_share=0.0, sample=0.0)) == []


def test_exactly_the_cap_under_close_nats_keeps_close_nats():
    t = _gapped([0.05, 0.5, 0.9, 1.0, 2.0])
    assert close_threshold(t, SourceEvidence(close_nats=0.1, close_share=0.2)) == 0.1  # 1 under, cap 1


def test_top_k_entries_past_the_output_are_not_requested():
    t = _gapped([0.5, 0.5, 0.5], extra_entries=4)  # a recorded top-k longer than the answer
    assert requested_positions(t, SourceEvidence(close_share=1.0, sample=0.0)) == []


def test_pieces_given_are_used_over_the_turns_own():
    t = _turn(pieces=None)
    assert requested_positions(t, SourceEvidence(sample=0.0), pieces=PIECES) == list(range(2, 10))


@pytest.mark.parametrize("ps,spec", [([5, 6], "5-6"), ([1, 2, 3, 4], "1-4"), ([0, 2, 3, 9], "0,2-3,9")])
def test_tv_full_ranges_are_exact(ps, spec):
    assert xargs(SourceEvidence(), ps)["tv_full"] == spec


def test_xargs_carry_the_turns_close_threshold():
    assert xargs(SourceEvidence(close_nats=0.1), [], close=0.03)["tv_close"] == 0.03


@pytest.mark.parametrize("ok", [{"k": 1}, {"k": 4096}, {"close_nats": 0.0}, {"close_share": 0.0}, {"close_share": 1.0},
                                {"sample": 0.0}, {"sample": 1.0}])
def test_the_edges_of_the_policy_are_accepted(ok):
    SourceEvidence(**ok)


@pytest.mark.parametrize("bad", [{"k": 4097}, {"close_share": -0.01}, {"close_share": 1.01}, {"sample": -0.01},
                                 {"close_nats": float("nan")}])
def test_past_the_edges_of_the_policy_is_refused(bad):
    with pytest.raises(ValueError):
        SourceEvidence(**bad)
