"""Flip classes (tie, near_tie, noise, parser, runtime) and the excess flip rate (issue 19)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorverse.analysis.attribution import (
    FLIP_CLASSES,
    FlipAttribution,
    FlipClass,
    TieRule,
    classify_forced,
    classify_forced_topk,
    classify_free,
    excess_flip_rate,
    flips_by_class,
    grid_steps,
    margin_class,
    noise_flips,
    parser_check,
    row_dtype,
    topk_pair,
)
from tensorverse.analysis.metrics import AnalysisInputError, position_metrics
from tensorverse.analysis.report import analyze
from tests.refusals import refused

ROOT = Path(__file__).resolve().parents[2]
V = 64


def bf16_next(x: float, k: int = 1) -> np.float32:
    """The bfloat16 value k steps above x (x bf16-exact, positive), as float32."""
    bits = np.array([x], np.float32).view(np.uint32)[0] >> 16
    return np.array([(int(bits) + k) << 16], np.uint32).view(np.float32)[0]


def row_with(a: float, b: float, dtype=np.float32) -> np.ndarray:
    """A reference row whose top-1 is token 3 (logit a) and whose runner-up is token 7 (b)."""
    r = np.full(V, -4.0, dtype)
    r[3], r[7] = a, b
    return r


def forced_class(ref_row: np.ndarray, rule: TieRule = TieRule(), noise=None) -> FlipClass:  # noqa: B008 - frozen
    """Classify the flip of a candidate that prefers token 7 over the reference's top-1."""
    ref = ref_row.reshape(1, -1)
    r1 = np.argmax(ref.astype(np.float64) if ref.dtype != np.uint16 else
                   (ref.astype(np.uint32) << 16).view(np.float32), axis=1)
    got = classify_forced(ref, r1, [7 if r1[0] != 7 else 3], noise=noise, rule=rule)
    assert len(got) == 1
    return got[0].flip_class


# --------------------------------------------------------------------------- tie and near_tie


def test_exact_tie_in_bfloat16():
    row = row_with(2.5, 2.5)  # argmax: the lower id (3); the candidate picks 7
    assert row_dtype(row) == "bfloat16"
    assert forced_class(row) is FlipClass.TIE


@pytest.mark.parametrize("x", [2.5, 13.75, 0.3125, 1.0, 100.0, 1e-3])
def test_near_tie_is_one_bf16_ulp_and_not_two(x):
    x = float(np.float32(bf16_next(x, 0)))  # bf16-exact
    one, two = bf16_next(x, 1), bf16_next(x, 2)
    row = row_with(one, x)
    assert row_dtype(row) == "bfloat16"
    assert grid_steps(one, x, "bfloat16") == 1
    assert forced_class(row) is FlipClass.NEAR_TIE
    assert forced_class(row_with(two, x)) is FlipClass.RUNTIME  # one ulp beyond the rule
    # the float32 grid is finer: the same margin, with one float32-only bit set, is not near
    f32 = row_with(one, x)
    f32[0] = np.float32(1.0) + np.float32(2 ** -20)  # makes the row float32 (not bf16-exact)
    assert row_dtype(f32) == "float32"
    assert forced_class(f32) is FlipClass.RUNTIME


def test_near_tie_across_a_binade_boundary_and_signs():
    below_one = np.float32(1.0 - 2 ** -8)  # the bfloat16 value just below 1.0
    assert grid_steps(1.0, below_one, "bfloat16") == 1
    assert forced_class(row_with(1.0, below_one)) is FlipClass.NEAR_TIE
    assert forced_class(row_with(1.0, np.float32(1.0 - 2 ** -7))) is FlipClass.RUNTIME  # 2 steps
    tiny = np.array([1 << 16], np.uint32).view(np.float32)[0]  # smallest positive bf16
    assert grid_steps(tiny, -tiny, "bfloat16") == 2 and grid_steps(0.0, -0.0, "bfloat16") == 0
    assert forced_class(row_with(0.0, -0.0)) is FlipClass.TIE  # +0 == -0


def test_float32_float16_and_bf16_bit_patterns():
    x = np.float32(3.1)  # not bf16-exact
    nxt = np.nextafter(x, np.float32(10))
    assert forced_class(row_with(nxt, x)) is FlipClass.NEAR_TIE
    assert forced_class(row_with(np.nextafter(nxt, np.float32(10)), x)) is FlipClass.RUNTIME
    h = np.float16(5.0)
    assert forced_class(row_with(np.nextafter(h, np.float16(9)), h, np.float16)) is FlipClass.NEAR_TIE
    assert forced_class(row_with(np.float16(5.0078125), h, np.float16)) is FlipClass.RUNTIME  # 2 ulps
    bits = (row_with(bf16_next(2.0, 1), 2.0).view(np.uint32) >> 16).astype(np.uint16)
    assert row_dtype(bits) == "bfloat16"
    assert forced_class(bits) is FlipClass.NEAR_TIE


def test_rule_options():
    x = 2.5
    one = bf16_next(x, 1)
    assert forced_class(row_with(one, x), TieRule(ulps=0)) is FlipClass.RUNTIME
    three = bf16_next(x, 3)
    assert forced_class(row_with(three, x), TieRule(ulps=3)) is FlipClass.NEAR_TIE
    margin = float(bf16_next(x, 5)) - x
    assert forced_class(row_with(bf16_next(x, 5), x), TieRule(nats=margin)) is FlipClass.NEAR_TIE
    assert forced_class(row_with(bf16_next(x, 5), x), TieRule(nats=margin / 2)) is FlipClass.RUNTIME
    with pytest.raises(AnalysisInputError):
        TieRule(ulps=-1)
    with pytest.raises(AnalysisInputError):
        TieRule(nats=float("nan"))


def test_precedence_tie_before_noise_before_runtime():
    rows = np.stack([row_with(2.5, 2.5), row_with(bf16_next(2.5, 1), 2.5), row_with(4.0, 2.5),
                     row_with(4.0, 2.5)])
    r1 = np.full(4, 3)
    c1 = np.full(4, 7)
    got = classify_forced(rows, r1, c1, noise=[True, True, True, False])
    assert [g.flip_class.value for g in got] == ["tie", "near_tie", "noise", "runtime"]
    assert got[0].margin == 0.0 and got[1].steps == 1 and got[3].margin == pytest.approx(1.5)
    # no noise run: nothing is noise
    assert [g.flip_class.value for g in classify_forced(rows, r1, c1)][2] == "runtime"
    assert flips_by_class(got) == {"tie": 1, "near_tie": 1, "noise": 1, "parser": 0, "runtime": 1}
    assert list(flips_by_class([])) == list(FLIP_CLASSES)


def test_topk_reference_judged_on_logprobs():
    entries = [{3: -0.5, 7: -0.5}, {3: -0.25, 7: float(np.nextafter(np.float32(-0.25), np.float32(-1)))},
               {3: -0.1, 9: -3.0}, {3: -0.1, 7: -2.0}]
    got = classify_forced_topk(entries, [3, 3, 3, 3], [7, 7, 7, 7], noise=[False, False, False, True])
    assert [g.flip_class.value for g in got] == ["tie", "near_tie", "runtime", "noise"]
    assert got[2].margin is None  # the candidate's token is not in the reference's top-k


def test_topk_logprobs_are_judged_on_the_float32_grid_even_when_bf16_exact():
    """Issue 27: docs/attribution.md says top-k logprobs are judged on their own grid, float32.
    Two logprobs that happen to be bfloat16-exact are still float32 values: -0.5 and -0.50390625
    (one bfloat16 step, 0.0039 apart) are 65,536 float32 steps apart, a runtime flip; -1.0 and
    the float32 value just below it (1.2e-7 apart) are one step apart, a near tie."""
    below_half = -0.5 - 2 ** -8  # bfloat16-exact: one bf16 step below -0.5
    assert grid_steps(-0.5, below_half, "bfloat16") == 1
    below_one = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    assert below_one == pytest.approx(-1.0 - 1.19e-7, abs=1e-9)
    entries = [{3: -0.5, 7: below_half}, {3: -1.0, 7: below_one}]
    got = classify_forced_topk(entries, [3, 3], [7, 7])
    assert [g.flip_class for g in got] == [FlipClass.RUNTIME, FlipClass.NEAR_TIE]
    assert [g.ref_dtype for g in got] == ["float32", "float32"]
    assert [g.steps for g in got] == [65536, 1]
    # the free-run path reads the same pair from the primary's top-k
    pair = topk_pair({3: -0.5, 7: below_half}, 3, 7)
    assert pair == (-0.5, below_half, "float32")
    free = classify_free(position=2, ref_token=3, cand_token=7, ref_logits=pair)
    assert free.flip_class is FlipClass.RUNTIME and free.steps == 65536
    pair = topk_pair({3: -1.0, 7: below_one}, 3, 7)
    assert classify_free(position=2, ref_token=3, cand_token=7, ref_logits=pair).flip_class is FlipClass.NEAR_TIE
    # logprobs that float32 cannot hold (float64 JSON from another server) use float64's grid
    f64 = float(np.nextafter(-0.1, -1.0))
    g = classify_forced_topk([{3: -0.1, 7: f64}], [3], [7])[0]
    assert g.ref_dtype == "float64" and g.steps == 1 and g.flip_class is FlipClass.NEAR_TIE
    # full rows keep their own dtype: a bf16-exact float32 row is still judged as bfloat16
    assert forced_class(row_with(-0.5, below_half)) is FlipClass.NEAR_TIE


# --------------------------------------------------------------------------- parser and free


TOOL = '<tool_call>{"name": "show_vlan", "arguments": {"vlan": 201}}</tool_call>'


def test_parser_check_same_ids_broken_parse():
    ok = parser_check(TOOL, "", [{"type": "function", "function": {"name": "show_vlan",
                                                                     "arguments": '{"vlan": 201}'}}])
    assert not ok.mismatch and ok.verdict == "match" and ok.parsed_calls == ok.emitted_calls == 1
    # the parser emitted an empty argument delta: same tokens, broken tool call
    bad = parser_check(TOOL, "", [{"type": "function", "function": {"name": "show_vlan", "arguments": ""}}])
    assert bad.mismatch and bad.verdict != "match" and bad.differences
    # no tool parser on the server: the markup stays in the content, which is what the agent got
    assert not parser_check(TOOL, TOOL, []).mismatch
    # a free run with the primary's exact ids whose tool calls differ is a parser flip
    flip = classify_free(position=None, tool_calls_differ=True)
    assert flip is not None and flip.flip_class is FlipClass.PARSER and flip.position is None
    assert classify_free(position=None, tool_calls_differ=False) is None
    # a diverged free run on a primary turn whose own parse mismatched: parser, after ties/noise
    assert classify_free(position=4, ref_token=1, cand_token=2, primary_parser_mismatch=True
                         ).flip_class is FlipClass.PARSER
    assert classify_free(position=4, ref_token=1, cand_token=2, noise_positions={4},
                         primary_parser_mismatch=True).flip_class is FlipClass.NOISE
    assert classify_free(position=4, ref_token=1, cand_token=2, ref_logits=(-0.5, -0.5, "float32"),
                         noise_positions={4}).flip_class is FlipClass.TIE
    assert classify_free(position=4, ref_token=1, cand_token=2).flip_class is FlipClass.RUNTIME


# --------------------------------------------------------------------------- batch order


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    # bf16-exact logits on a coarse grid: ties and adjacent values are frequent
    ref = (rng.integers(-8, 9, (n, V)) * 0.0625).astype(np.float32)
    for i in range(n):
        if draw(st.booleans()):  # a near tie at the top
            j = int(np.argmax(ref[i]))
            k = (j + 1 + int(rng.integers(0, V - 1))) % V
            ref[i, k] = bf16_next(float(ref[i, j]), -1) if ref[i, j] > 0 else ref[i, j]
    cand = ref + (rng.integers(-1, 2, (n, V)) * 0.0625).astype(np.float32)
    noise = rng.random(n) < 0.3
    perm = np.array(draw(st.permutations(list(range(n)))))
    return ref, cand, noise, perm


@settings(max_examples=60, deadline=None)
@given(batches())
def test_classes_never_depend_on_row_order(b):
    ref, cand, noise, perm = b
    tokens = np.argmax(ref, axis=1)
    m = position_metrics(ref, cand, tokens)
    got = {a.position: a for a in classify_forced(ref, m.ref_top1, m.cand_top1, noise=noise)}
    mp = position_metrics(ref[perm], cand[perm], tokens[perm])
    permuted = classify_forced(ref[perm], mp.ref_top1, mp.cand_top1, noise=noise[perm],
                               positions=perm.tolist())
    assert {a.position: a for a in permuted} == got
    assert flips_by_class(permuted) == flips_by_class(got.values())


# --------------------------------------------------------------------------- excess flip rate


def test_excess_interval_matches_newcombe_1998():
    # Newcombe (1998), Statistics in Medicine 17:873, Table II, method 10 (hybrid score):
    # 56/70 - 48/80: 0.0524 to 0.3339; 9/10 - 3/10: 0.1705 to 0.8090.
    for (x1, n1, x2, n2), (lo, hi) in {(56, 70, 48, 80): (0.0524, 0.3339),
                                       (9, 10, 3, 10): (0.1705, 0.8090)}.items():
        e = excess_flip_rate(x1, n1, x2, n2)
        assert e.excess == pytest.approx(x1 / n1 - x2 / n2)
        assert (round(e.low, 4), round(e.high, 4)) == (lo, hi)


def test_excess_interval_shape():
    same = excess_flip_rate(100, 10_000, 100, 10_000)
    assert same.low < 0 < same.high and same.excess == 0
    real = excess_flip_rate(500, 10_000, 100, 10_000)
    assert 0 < real.low < real.excess < real.high
    wide = excess_flip_rate(1, 20, 1, 100)
    assert wide.low < 0  # small counts: no claim
    assert excess_flip_rate(0, 5, 0, 5).low < 0 < excess_flip_rate(0, 5, 0, 5).high
    with pytest.raises(AnalysisInputError):
        excess_flip_rate(3, 2, 0, 5)
    with pytest.raises(AnalysisInputError):
        excess_flip_rate(1, 5, 0, 0)


# --------------------------------------------------------------------------- analyze --noise


def test_analyze_classes_every_flip(tmp_path):
    x = 2.5
    ref = np.stack([row_with(x, x), row_with(bf16_next(x, 1), x), row_with(4.0, x), row_with(4.0, x),
                    row_with(4.0, x)])
    cand = ref.copy()
    cand[:4, 7] = 9.0  # positions 0-3 flip to token 7; position 4 agrees
    noise = ref.copy()
    noise[2, 7] = 9.0  # the noise run flips at position 2 only
    tokens = [3] * 5
    res = analyze(ref, cand, tokens, noise=noise)
    assert [p["flip_class"] for p in res["positions"]] == ["tie", "near_tie", "noise", "runtime", None]
    assert res["summary"]["flips_by_class"] == {"tie": 1, "near_tie": 1, "noise": 1, "parser": 0, "runtime": 1}
    # without a noise run nothing is noise
    assert [p["flip_class"] for p in analyze(ref, cand, tokens)["positions"]][2] == "runtime"

    for name, a in (("ref", ref), ("cand", cand), ("noise", noise)):
        np.save(tmp_path / f"{name}.npy", a)
    (tmp_path / "t.json").write_text(json.dumps(tokens))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base = [sys.executable, "-m", "tensorverse.cli", "analyze", "--ref", str(tmp_path / "ref.npy"),
            "--cand", str(tmp_path / "cand.npy"), "--tokens", str(tmp_path / "t.json")]
    r = subprocess.run([*base, "--noise", str(tmp_path / "noise.npy"), "--json"], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [p["flip_class"] for p in out["positions"]] == ["tie", "near_tie", "noise", "runtime", None]
    assert out["summary"]["flips_by_class"]["runtime"] == 1
    r = subprocess.run([*base, "--near-tie-ulps", "0", "--json"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=120)
    assert [p["flip_class"] for p in json.loads(r.stdout)["positions"]][:2] == ["tie", "runtime"]
    r = subprocess.run([*base, "--noise", str(tmp_path / "t.json")], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=120)
    assert r.returncode == 2 and "noise" in r.stderr
    r = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert "Flips by class: tie 1, near_tie 1, noise 0, parser 0, runtime 2" in r.stdout


# --------------------------------------------------------------------------- edges: refused inputs, every record's fields


def test_rule_validation_and_records():
    with refused(AnalysisInputError, "value"):
        TieRule(ulps=-1)
    with refused(AnalysisInputError, "value"):
        TieRule(nats=-0.5)
    assert TieRule(ulps=2, nats=0.25).as_dict() == {"ulps": 2, "nats": 0.25}
    with refused(AnalysisInputError, "dtype"):
        row_dtype(np.arange(4, dtype=np.int32))
    flip = FlipAttribution(3, FlipClass.NEAR_TIE, "forced", 3, 7, 0.0625, 1, "bfloat16")
    assert flip.as_dict() == {"position": 3, "flip_class": "near_tie", "mode": "forced", "ref_token": 3,
                              "cand_token": 7, "margin": 0.0625, "steps": 1, "ref_dtype": "bfloat16"}
    from tensorverse.analysis.attribution import _values_dtype

    assert _values_dtype([]) == "float64" and _values_dtype([-0.5]) == "float32"
    assert flips_by_class(["tie", None, "runtime"]) == {"tie": 1, "near_tie": 0, "noise": 0, "parser": 0, "runtime": 1}


def test_forced_inputs_as_a_row_and_as_columns():
    [one] = classify_forced(row_with(2.0, 1.0), [3], [7])  # one row, not a matrix
    assert (one.position, one.flip_class, one.ref_token, one.cand_token) == (0, FlipClass.RUNTIME, 3, 7)
    entries = [{3: -0.5, 7: -0.75}, {3: -0.1, 7: -3.0}]
    got = classify_forced_topk(entries, [[3], [3]], [[7], [3]], positions=[10, 11], rule=TieRule(nats=0.3))
    assert [g.as_dict() for g in got] == [{"position": 10, "flip_class": "near_tie", "mode": "forced", "ref_token": 3,
                                           "cand_token": 7, "margin": 0.25, "steps": 4194304, "ref_dtype": "float32"}]
    with refused(AnalysisInputError, "shape"):
        classify_forced_topk(entries[:1], [3, 3], [7, 7])
    assert noise_flips([[1], [2]], [[1], [3]]).tolist() == [False, True]
    with refused(AnalysisInputError, "shape"):
        noise_flips([1, 2], [1])


def test_free_flip_records_and_unusable_logits():
    assert classify_free(position=None) is None  # identical tokens, no tool-call difference
    parser = classify_free(position=None, tool_calls_differ=True)
    assert parser.mode == "free" and parser.flip_class is FlipClass.PARSER
    plain = classify_free(position=4, ref_token=1, cand_token=2)
    assert plain.as_dict() == {"position": 4, "flip_class": "runtime", "mode": "free", "ref_token": 1, "cand_token": 2,
                               "margin": None, "steps": None, "ref_dtype": None}
    for bad in ((float("nan"), -1.0, "float32"), (-1.0, float("inf"), "float32"), (-1.0, None, "float32")):
        f = classify_free(position=4, ref_token=1, cand_token=2, ref_logits=bad)
        assert f.flip_class is FlipClass.RUNTIME and f.margin is None and f.steps is None, bad
    near = classify_free(position=4, ref_token=1, cand_token=2, ref_logits=(-0.5, -0.75, "float32"),
                         rule=TieRule(nats=0.3))
    assert near.as_dict() == {"position": 4, "flip_class": "near_tie", "mode": "free", "ref_token": 1, "cand_token": 2,
                              "margin": 0.25, "steps": 4194304, "ref_dtype": "float32"}
    assert topk_pair({3: -0.5, 7: -0.75}, None, 7) is None and topk_pair(None, 3, 7) is None
    assert topk_pair({3: -0.5}, 3, 7) is None


def test_parser_check_keeps_32_differences():
    args = {f"a{i}": i for i in range(40)}
    text = '<tool_call>{"name": "f", "arguments": ' + json.dumps(args) + "}</tool_call>"
    emitted = [{"type": "function", "function": {"name": "f", "arguments": json.dumps({k: v + 1 for k, v in args.items()})}}]
    pc = parser_check(text, "", emitted)
    assert pc.mismatch and len(pc.differences) == 32


def test_excess_rate_inputs_and_record():
    for bad, side in (((1, 10.5, 0, 10), "runtime:"), ((0, 10, 1, 10.5), "noise:"), ((0, 0, 0, 10), "runtime:"),
                      ((11, 10, 0, 10), "runtime:"), ((0, 10, -1, 10), "noise:")):
        with refused(AnalysisInputError, "value", side):  # the message names the side refused
            excess_flip_rate(*bad)
    for c in (0.0, 1.0, 1.5):
        with refused(AnalysisInputError, "value"):
            excess_flip_rate(1, 10, 0, 10, confidence=c)
    assert excess_flip_rate(0, 1, 0, 1).excess == 0.0  # one position, all flips: valid inputs
    assert excess_flip_rate(5, 5, 0, 5).rate == 1.0
    r = excess_flip_rate(56, 70, 48, 80).as_dict()
    assert {k: r[k] for k in ("runtime_flips", "n", "noise_flips", "noise_n", "confidence", "method")} == {
        "runtime_flips": 56, "n": 70, "noise_flips": 48, "noise_n": 80, "confidence": 0.95, "method": "newcombe_wilson"}
    assert r["rate"] == 0.8 and r["noise_rate"] == 0.6 and r["excess"] == pytest.approx(0.2)
    half = excess_flip_rate(56, 70, 48, 80, confidence=0.5)
    assert r["low"] < half.low < half.excess < half.high < r["high"]  # a narrower interval at 50 %


def test_forced_records_messages_and_grids():
    [f] = classify_forced(np.stack([row_with(2.0, 1.0)]), [[3]], [[7]])  # top-1 arrays as columns
    assert f.as_dict() == {"position": 0, "flip_class": "runtime", "mode": "forced", "ref_token": 3, "cand_token": 7,
                           "margin": 1.0, "steps": 128, "ref_dtype": "bfloat16"}
    two = np.stack([row_with(2.0, 1.0)] * 2)
    with refused(AnalysisInputError, "shape"):
        classify_forced(two, [3, 3], [7])
    with refused(AnalysisInputError, "shape"):
        classify_forced(two, [3, 3], [7, 7], positions=[5])
    with refused(AnalysisInputError, "shape"):
        classify_forced(two, [3, 3], [7, 7], noise=[True])
    with refused(AnalysisInputError, "value"):
        grid_steps(1.0, 2.0, "bf8")
    assert margin_class(1.0, 1.0, "float32") == (FlipClass.TIE, 0, 0.0)
    pc = parser_check(TOOL, "", [{"type": "function", "function": {"name": "show_vlan", "arguments": '{"vlan": 201}'}}])
    assert pc.as_dict() == {"mismatch": False, "verdict": "match", "parsed_calls": 1, "emitted_calls": 1,
                            "differences": []}


def test_a_sparse_reference_classifies_as_the_full_row_where_it_kept_the_candidates_token():
    from tensorverse.analysis.attribution import classify_forced, classify_forced_sparse

    row = np.linspace(-3.0, 0.0, 40).astype(np.float32)
    row[7] = 5.0
    row[8] = np.nextafter(np.float32(5.0), np.float32(-np.inf))  # one float32 step below: a near tie
    kept = {int(t): float(row[t]) for t in np.argsort(-row)[:5]}
    full = classify_forced(np.stack([row, row]), [7, 7], [8, 0], positions=[3, 3])  # 0: far below the top 5
    sparse = classify_forced_sparse([(kept, "float32")] * 2, [7, 7], [8, 0], positions=[3, 3])
    assert sparse[0] == full[0] and sparse[0].flip_class.value == "near_tie"
    assert sparse[1].flip_class == full[1].flip_class and sparse[1].flip_class.value == "runtime"
    assert sparse[1].margin is None and sparse[1].steps is None and full[1].margin is not None
    noisy = classify_forced_sparse([(kept, "float32")], [7], [0], noise=[True])
    assert noisy[0].flip_class.value == "noise"
