"""What the proxy asks of a shadow's plugin when evidence is chosen at the source
(shadow/evidence.py): the positions every run keeps in full, and the xargs that carry them."""

from __future__ import annotations

import pytest

from tensorverse.capture.optin import Positions, parse_extra_args
from tensorverse.shadow.evidence import SourceEvidence, requested_positions, xargs
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
    got = requested_positions(_turn(top=top, pieces=None), SourceEvidence(close_nats=0.125, sample=0.0))
    assert got == [0]


def test_the_seeded_sample_is_the_one_compaction_keeps():
    t = _turn(pieces=None, tid="turn-xyz")
    ev = SourceEvidence(sample=0.3, seed=5)
    assert requested_positions(t, ev) == [p for p in range(11) if sampled(5, "turn-xyz", p, 0.3)]
    assert requested_positions(t, ev)  # 0.3 of 11 positions: some


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
