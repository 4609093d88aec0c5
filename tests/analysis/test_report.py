"""`tensorverse.analysis.report` in-process: the result fields, the table exactly, the loaders
and the CLI entry (`test_analyze_cli.py` runs it as a subprocess)."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from scipy.special import rel_entr

from tensorverse.analysis import report
from tensorverse.analysis.attribution import TieRule
from tensorverse.analysis.metrics import AnalysisInputError
from tensorverse.analysis.report import (
    analyze,
    load_logits,
    load_tokens,
    render_table,
    result_from_metrics,
    run_analyze,
)
from tests.refusals import refused

# 3 positions x 4 tokens. Position 1 flips by one nat (ref top1 1, cand top1 2); position 2 is
# an exact tie in the reference (tokens 0 and 1 at 1.0; numpy takes 0) that the candidate breaks.
REF = np.array([[3, 1, 0, 0], [0, 2, 1, 0], [1, 1, 0, 0]], dtype=np.float32)
CAND = np.array([[3, 1, 0, 0], [0, 1, 2, 0], [0, 1, 0, 0]], dtype=np.float32)
TOKENS = [0, 1, 0]


def _kl(p_logits, q_logits):
    p = np.exp(np.asarray(p_logits, np.float64) - np.max(p_logits))
    q = np.exp(np.asarray(q_logits, np.float64) - np.max(q_logits))
    return float(np.sum(rel_entr(p / p.sum(), q / q.sum())))


def test_analyze_result_fields_and_classes():
    res = analyze(REF, CAND, TOKENS, regions=["content", "tool_args", "tool_name"])
    assert set(res) == {"mode", "n", "vocab", "approximate", "flips", "positions", "summary",
                        "attribution"}
    assert res["mode"] == "forced" and res["n"] == 3 and res["vocab"] == 4
    assert res["approximate"] is False
    assert res["flips"] == [1, 2]
    rows = res["positions"]
    assert [r["position"] for r in rows] == [0, 1, 2]
    assert [r["region"] for r in rows] == ["content", "tool_args", "tool_name"]
    assert [r["flip_class"] for r in rows] == [None, "runtime", "tie"]
    for i, r in enumerate(rows):  # the reference is P, the candidate Q
        assert r["kl"] == pytest.approx(_kl(REF[i], CAND[i]), rel=1e-5, abs=1e-9)
    assert res["summary"]["flips_by_class"] == {"tie": 1, "near_tie": 0, "noise": 0, "parser": 0,
                                                "runtime": 1}
    assert res["summary"]["flips_by_region"] == {"content": 0, "tool_name": 1, "tool_args": 1}
    assert res["attribution"] == {"rule": {"ulps": 1, "nats": 0.0}, "noise": False}
    # no regions: no region key, no by-region summary
    res = analyze(REF, CAND, TOKENS)
    assert all("region" not in r for r in res["positions"])
    assert "flips_by_region" not in res["summary"]


def test_analyze_noise_and_rule_are_passed_through():
    # the noise run flips at position 1 as the candidate does: that flip is noise
    noise = REF.copy()
    noise[1] = [0, 1, 3, 0]
    res = analyze(REF, CAND, TOKENS, noise=noise)
    assert [r["flip_class"] for r in res["positions"]] == [None, "noise", "tie"]
    assert res["attribution"] == {"rule": {"ulps": 1, "nats": 0.0}, "noise": True}
    # a 1.5-nat rule makes the one-nat flip a near tie
    res = analyze(REF, CAND, TOKENS, rule=TieRule(nats=1.5))
    assert [r["flip_class"] for r in res["positions"]] == [None, "near_tie", "tie"]
    assert res["attribution"] == {"rule": {"ulps": 1, "nats": 1.5}, "noise": False}
    # one position: a 1-D noise row is taken as that row
    res = analyze(REF[1:2], CAND[1:2], [1], noise=noise[1])
    assert [r["flip_class"] for r in res["positions"]] == ["noise"]
    res = analyze(REF[1:2], CAND[1:2], [1], noise=REF[1])
    assert [r["flip_class"] for r in res["positions"]] == ["runtime"]
    # a single 1-D row is one position of the row's vocabulary
    res = analyze(REF[1], CAND[1], [1])
    assert res["n"] == 1 and res["vocab"] == 4 and res["flips"] == [0]


def test_analyze_refuses_bad_noise():
    with refused(AnalysisInputError, "dtype"):
        analyze(REF, CAND, TOKENS, noise=np.zeros((3, 4), dtype=np.int64))
    with refused(AnalysisInputError, "shape"):
        analyze(REF, CAND, TOKENS, noise=np.zeros((2, 4), dtype=np.float32))
    with refused(AnalysisInputError, "shape"):
        analyze(REF, CAND, TOKENS, noise=np.zeros(4, dtype=np.float32))


def test_result_from_metrics_without_vocab_or_attributions():
    from tensorverse.analysis.metrics import position_metrics

    m = position_metrics(REF, CAND, TOKENS)
    res = result_from_metrics(m)
    assert res["vocab"] is None and res["flips"] == [1, 2] and res["n"] == 3
    assert res["approximate"] is False
    assert all("flip_class" not in r and "region" not in r for r in res["positions"])
    assert "flips_by_class" not in res["summary"]
    res = result_from_metrics(m, ["content"] * 3, 4)
    assert res["vocab"] == 4 and [r["region"] for r in res["positions"]] == ["content"] * 3


# --------------------------------------------------------------------------- the table, exactly

def _row(position, kl, flip=False, **kw):
    r = {"position": position, "token": 7, "ref_top1": 7, "cand_top1": 8 if flip else 7,
         "flip": flip, "kl": kl, "delta_p": 0.0, "margin": 0.5, "rank": 0, "entropy": 1.0}
    r.update(kw)
    return r


def _dist(values):
    keys = ["mean", "se", "max", "p99.9", "p99", "p95", "p90", "p50", "p10", "p5", "p1", "p0.1",
            "min"]
    return dict(zip(keys, values))


def test_render_table_in_full():
    rows = [
        _row(0, 0.00123, token=7, ref_top1=7, cand_top1=7, delta_p=-0.0005, margin=1.5, rank=0,
             entropy=0.25, flip_class=None, region="content"),
        _row(1, float("nan"), flip=True, token=None, ref_top1=3, cand_top1=9, delta_p=0.25,
             margin=None, rank=">= 5", entropy=1.0, flip_class="runtime", region="tool_args"),
    ]
    dp = _dist([0.01, 0.002, 0.05, 0.04, None, 0.03, 0.02, 0.0, -0.01, float("nan"), -0.015,
                -0.0175, -0.02])
    dp.update(rms=0.03, rms_se=0.004)
    summary = {
        "n": 2, "approximate": True,
        "kl": _dist([0.5, 0.25, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, float("nan"), None, 0.2, 0.1, 0.0]),
        "delta_p": dp,
        "same_top_p": {"p": 0.5, "se": 0.1},
        "flips": 1, "first_flip": 1,
        "flips_by_class": {"tie": 0, "runtime": 1},
        "flips_by_region": {"content": 0, "tool_args": 1},
        "positions_by_region": {"content": 1, "tool_args": 1},
    }
    result = {"n": 2, "vocab": 50, "approximate": True, "positions": rows, "summary": summary}
    want = "\n".join([
        "2 positions x 50 vocabulary (APPROXIMATE: top-k logprobs only)",
        "",
        "   pos    token ref_top1 cand_top1 flip          kl     delta_p    margin    rank  entropy"
        "    class  region",
        "     0        7        7         7       1.2300e-03  -5.000e-04   1.50000       0   0.2500"
        "           content",
        "     1      n/a        3         9 FLIP         n/a  +2.500e-01       n/a    >= 5   1.0000"
        "  runtime  tool_args",
        "",
        "====== KL divergence statistics ======",
        "Mean    KLD:   0.500000 ±   0.250000",
        "Maximum KLD:   1.000000",
        "99.9%   KLD:   0.900000",
        "99.0%   KLD:   0.800000",
        "95.0%   KLD:   0.700000",
        "90.0%   KLD:   0.600000",
        "Median  KLD:   0.500000",
        "10.0%   KLD: n/a",
        " 5.0%   KLD: n/a",
        " 1.0%   KLD:   0.200000",
        " 0.1%   KLD:   0.100000",
        "Minimum KLD:   0.000000",
        "",
        "====== Token probability statistics ======",
        "Mean    Δp:    1.000 ±    0.200 %",
        "Maximum Δp:    5.000 %",
        "99.9%   Δp:    4.000 %",
        "99.0%   Δp: n/a %",
        "95.0%   Δp:    3.000 %",
        "90.0%   Δp:    2.000 %",
        "Median  Δp:    0.000 %",
        "10.0%   Δp:   -1.000 %",
        " 5.0%   Δp: n/a %",
        " 1.0%   Δp:   -1.500 %",
        " 0.1%   Δp:   -1.750 %",
        "Minimum Δp:   -2.000 %",
        "RMS Δp    :    3.000 ±    0.400 %",
        "Same top p:   50.000 ±   10.000 %",
        "",
        "Flips (argmax differs): 1 of 2, first at position 1",
        "Flips by class: tie 0, runtime 1",
        "Flips by region: content 0/1, tool_args 1/1",
        "NOTE: approximate metrics from top-k logprobs; KL is a lower bound.",
    ]) + "\n"
    assert render_table(result) == want


def test_render_table_minimal():
    dp = _dist([None] * 13)
    dp.update(rms=None, rms_se=None)
    summary = {"n": 1, "kl": _dist([0.5, None] + [0.5] * 11), "delta_p": dp,
               "same_top_p": {"p": 1.0, "se": None}, "flips": 0, "first_flip": None}
    result = {"positions": [_row(0, 0.5)], "summary": summary, "vocab": 0, "approximate": False}
    out = render_table(result).split("\n")
    assert out[0] == "1 positions"
    assert out[2] == ("   pos    token ref_top1 cand_top1 flip          kl     delta_p    margin"
                      "    rank  entropy")
    assert out[3] == ("     0        7        7         7       5.0000e-01  +0.000e+00   0.50000"
                      "       0   1.0000")
    assert out[4] == ""
    assert "Mean    KLD:   0.500000" in out
    assert "Mean    Δp: n/a %" in out and "Maximum Δp: n/a %" in out and "Minimum Δp: n/a %" in out
    assert "RMS Δp    : n/a %" in out and "Same top p:  100.000 %" in out
    assert out[-2] == "Flips (argmax differs): 0 of 1" and out[-1] == ""


def _shown_positions(text):
    lines = text.split("\n")
    start = next(i for i, l in enumerate(lines) if l.lstrip().startswith("pos ")) + 1
    out = []
    for line in lines[start:]:
        if not line or not line.lstrip()[0].isdigit():
            break
        out.append(int(line.split()[0]))
    return out


def _table_result(n, kls, flips):
    rows = [_row(i, kls[i], flip=i in flips) for i in range(n)]
    dp = _dist([0.0] * 13)
    dp.update(rms=0.0, rms_se=0.0)
    summary = {"n": n, "kl": _dist([0.0] * 13), "delta_p": dp, "same_top_p": {"p": 1.0, "se": 0.0},
               "flips": len(flips), "first_flip": min(flips) if flips else None}
    return {"n": n, "positions": rows, "summary": summary}


def test_long_tables_show_every_flip_and_the_20_highest_kl():
    # 65 positions, KL rising with the position; the last one's KL is NaN (sorted last)
    kls = [i / 1000 for i in range(65)]
    kls[64] = float("nan")
    out = render_table(_table_result(65, kls, {3, 50}))
    want = [3] + list(range(44, 64))  # the flips, and positions 44..63 (the 20 highest KL)
    assert _shown_positions(out) == want
    assert ("(showing 21 of 65 positions: every flip and the 20 highest KL; use --json for all)"
            in out.split("\n"))
    # 64 positions are all shown, with no note
    out = render_table(_table_result(64, [i / 1000 for i in range(64)], {3}))
    assert _shown_positions(out) == list(range(64)) and "showing" not in out


# --------------------------------------------------------------------------- loaders

def test_load_logits(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "a.npy", a)
    got = load_logits(tmp_path / "a.npy")
    assert isinstance(got, np.memmap) and got.dtype == np.float32
    assert np.array_equal(got, a)
    p = tmp_path / "nope.npy"
    # each refusal names the side and the file it refuses
    with refused(AnalysisInputError, "file", "logits:", str(p)):
        load_logits(p)
    with refused(AnalysisInputError, "file", "ref:", str(p)):
        load_logits(str(p), "ref")
    with refused(AnalysisInputError, "file", "cand:", str(tmp_path)):
        load_logits(tmp_path, "cand")
    (tmp_path / "t.npy").write_text("hello")
    with refused(AnalysisInputError, "file", "ref:", str(tmp_path / "t.npy")):
        load_logits(tmp_path / "t.npy", "ref")
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object))  # a pickle inside: refused
    with refused(AnalysisInputError, "file", str(tmp_path / "o.npy")):
        load_logits(tmp_path / "o.npy")
    np.savez(tmp_path / "z.npz", a=a)
    with refused(AnalysisInputError, "file", "noise:", str(tmp_path / "z.npz")):
        load_logits(tmp_path / "z.npz", "noise")


def test_load_tokens(tmp_path):
    def write(name, text, mode="w"):
        p = tmp_path / name
        if mode == "w":
            p.write_text(text)
        else:
            p.write_bytes(text)
        return p

    assert load_tokens(write("a.json", "[1, 2, 0]")) == ([1, 2, 0], None)
    assert load_tokens(write("b.json", '{"tokens": [5], "regions": ["content"]}')) == ([5], ["content"])
    assert load_tokens(write("c.json", '{"tokens": [5], "regions": null}')) == ([5], None)
    assert load_tokens(write("c2.json", '{"tokens": []}')) == ([], None)
    p = tmp_path / "none.json"
    with refused(AnalysisInputError, "file", str(p)):
        load_tokens(p)
    p = write("bad.json", "{not json")
    with refused(AnalysisInputError, "file", str(p)):
        load_tokens(p)
    p = write("bin.json", b"[1, \xff]", mode="b")
    with refused(AnalysisInputError, "file", str(p)):
        load_tokens(p)
    p = write("d.json", '{"ids": [1]}')
    with refused(AnalysisInputError, "format", str(p)):
        load_tokens(p)
    for regions in ('"content"', '["content", 3]'):
        p = write("e.json", '{"tokens": [1, 2], "regions": %s}' % regions)
        with refused(AnalysisInputError, "format"):
            load_tokens(p)
    for body in ('{"tokens": 3}', '"x"'):
        p = write("f.json", body)
        with refused(AnalysisInputError, "format"):
            load_tokens(p)
    p = write("g.json", "[1, true]")
    with refused(AnalysisInputError, "dtype"):
        load_tokens(p)
    p = write("h.json", "[0, 1, 2.5]")
    with refused(AnalysisInputError, "dtype"):
        load_tokens(p)


# --------------------------------------------------------------------------- the CLI entry

@pytest.fixture
def files(tmp_path):
    np.save(tmp_path / "ref.npy", REF)
    np.save(tmp_path / "cand.npy", CAND)
    noise = REF.copy()
    noise[1] = [0, 1, 3, 0]
    np.save(tmp_path / "noise.npy", noise)
    (tmp_path / "tokens.json").write_text(json.dumps(TOKENS))
    return {k: str(tmp_path / f"{k}.{'json' if k == 'tokens' else 'npy'}")
            for k in ("ref", "cand", "noise", "tokens")}


def test_run_analyze_json_and_table(files, capsys):
    assert run_analyze(files["ref"], files["cand"], files["tokens"], as_json=True) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.endswith("\n") and out.count("\n") == 1
    d = json.loads(out)
    assert d["n"] == 3 and d["vocab"] == 4 and d["flips"] == [1, 2]
    assert [r["flip_class"] for r in d["positions"]] == [None, "runtime", "tie"]
    assert d["attribution"] == {"rule": {"ulps": 1, "nats": 0.0}, "noise": False}
    assert run_analyze(files["ref"], files["cand"], files["tokens"], as_json=True,
                       noise_path=files["noise"], rule=TieRule(ulps=0, nats=0.5)) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["flip_class"] for r in d["positions"]] == [None, "noise", "tie"]
    assert d["attribution"] == {"rule": {"ulps": 0, "nats": 0.5}, "noise": True}
    with open(files["tokens"].replace("tokens.json", "t2.json"), "w") as fh:
        json.dump({"tokens": TOKENS, "regions": ["content", "tool_args", "tool_args"]}, fh)
    assert run_analyze(files["ref"], files["cand"], files["tokens"].replace("tokens.json", "t2.json"),
                       as_json=True) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["region"] for r in d["positions"]] == ["content", "tool_args", "tool_args"]
    assert d["summary"]["flips_by_region"] == {"content": 0, "tool_args": 2}
    assert run_analyze(files["ref"], files["cand"], files["tokens"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("3 positions x 4 vocabulary\n")
    assert "Flips (argmax differs): 2 of 3, first at position 1\n" in out


@pytest.mark.parametrize("which, needle", [
    ("ref", "ref: file not found: "), ("cand", "cand: file not found: "),
    ("noise", "noise: file not found: "), ("tokens", "tokens: file not found: "),
])
def test_run_analyze_errors_name_the_input(files, capsys, tmp_path, which, needle):
    paths = dict(files)
    paths[which] = str(tmp_path / "missing")
    assert run_analyze(paths["ref"], paths["cand"], paths["tokens"], as_json=True,
                       noise_path=paths["noise"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"tensorverse analyze: error: {needle}{tmp_path / 'missing'}\n"


def test_run_analyze_out_of_memory_and_broken_pipe(files, capsys, monkeypatch):
    def oom(*a, **k):
        raise MemoryError

    with monkeypatch.context() as mp:
        mp.setattr(report, "analyze", oom)
        assert run_analyze(files["ref"], files["cand"], files["tokens"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "tensorverse analyze: error: out of memory\n"

    class Broken:
        def write(self, s):
            raise BrokenPipeError

        def flush(self):
            raise BrokenPipeError

    broken = Broken()
    with monkeypatch.context() as mp:
        mp.setattr(sys, "stdout", broken)
        assert run_analyze(files["ref"], files["cand"], files["tokens"], as_json=True) == 0
        replaced = sys.stdout
        assert replaced is not broken and replaced.name == "/dev/null" and replaced.writable()
        replaced.close()


def test_dumps_with_and_without_orjson(monkeypatch):
    obj = {"x": [float("nan"), 1.5, float("inf")], "n": {"a": np.int64(1)}}
    assert json.loads(report._dumps(obj)) == {"x": [None, 1.5, None], "n": {"a": 1}}
    monkeypatch.setitem(sys.modules, "orjson", None)  # import orjson now raises ImportError
    obj = {"x": [float("nan"), 1.5, -float("inf")], "n": {"a": 1, "b": "s"}}
    assert report._dumps(obj) == '{"x": [null, 1.5, null], "n": {"a": 1, "b": "s"}}'
    assert not math.isnan(json.loads(report._dumps({"v": 2.0}))["v"])


def test_render_table_infinities_and_rows_without_a_region():
    inf = float("inf")
    rows = [_row(0, inf, margin=inf, entropy=inf, delta_p=-inf, region="content"),
            _row(1, 0.5, flip=True)]  # no region: an empty label
    dp = _dist([inf] * 13)
    dp.update(rms=inf, rms_se=inf)
    summary = {"n": 2, "kl": _dist([inf] * 13), "delta_p": dp, "same_top_p": {"p": inf, "se": inf},
               "flips": 1, "first_flip": 1}
    # n is the result's, even when it is not the number of rows given
    out = render_table({"n": 5, "positions": rows, "summary": summary}).split("\n")
    assert out[0] == "5 positions"
    assert out[3] == ("     0        7        7         7              inf        -inf       inf"
                      "       0      inf  content")
    assert out[4] == ("     1        7        7         8 FLIP  5.0000e-01  +0.000e+00   0.50000"
                      "       0   1.0000  ")
    kld = [l for l in out if "KLD:" in l]
    assert len(kld) == 12 and kld[0] == "Mean    KLD:        inf ±        inf"
    assert all(l.endswith("KLD:        inf") for l in kld[1:])
    dpl = [l for l in out if "Δp" in l]
    assert len(dpl) == 13 and dpl[0] == "Mean    Δp:      inf ±      inf %"
    assert all(l.endswith("Δp:      inf %") for l in dpl[1:-1])
    assert dpl[-1] == "RMS Δp    :      inf ±      inf %"
    assert "Same top p:      inf ±      inf %" in out
    assert "Flips (argmax differs): 1 of 2, first at position 1" in out


def test_long_tables_put_every_nan_kl_last():
    kls = [i / 1000 for i in range(80)]
    for i in (50, 60, 70, 75, 79):
        kls[i] = float("nan")
    out = render_table(_table_result(80, kls, set()))
    finite = sorted((i for i in range(80) if kls[i] == kls[i]), key=lambda i: -kls[i])[:20]
    assert _shown_positions(out) == sorted(finite)
    assert sorted(finite) == [56, 57, 58, 59, 61, 62, 63, 64, 65, 66, 67, 68, 69, 71, 72, 73, 74, 76,
                              77, 78]
