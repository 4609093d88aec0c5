"""position_metrics against an independent extended-precision reference; validation; summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorverse.analysis import metrics as M
from tensorverse.analysis.metrics import (
    AnalysisInputError,
    PositionMetrics,
    position_metrics,
    reference_position_metrics,
    summarize,
)
from tests.refusals import refused

TOL = 1e-9

# --------------------------------------------------------------------------- the reference


def ref_row(x: np.ndarray, y: np.ndarray, t: int) -> dict:
    """The definitions, literally, in np.longdouble (80-bit on x86), one row at a time."""
    X = np.asarray(x).astype(np.longdouble)
    Y = np.asarray(y).astype(np.longdouble)
    mx, my = X.max(), Y.max()
    lse_x = mx + np.log(np.sum(np.exp(X - mx)))
    lse_y = my + np.log(np.sum(np.exp(Y - my)))
    lp = X - lse_x
    lq = Y - lse_y
    p = np.exp(lp)
    q = np.exp(lq)
    kl = np.sum(p * (lp - lq))
    ent = -np.sum(p * lp)
    top1 = int(np.flatnonzero(X == mx)[0])
    ctop1 = int(np.flatnonzero(Y == my)[0])
    others = np.delete(X, top1)
    p2 = np.exp(others.max() - lse_x) if others.size else np.longdouble(0)
    return {
        "kl": float(kl),
        "entropy": float(ent),
        "delta_p": float(q[t] - p[t]),
        "margin": float(p[top1] - p2),
        "rank": int(np.count_nonzero(Y > Y[t])),
        "ref_top1": top1,
        "cand_top1": ctop1,
    }


def assert_matches(ref: np.ndarray, cand: np.ndarray, tokens, m: PositionMetrics | None = None):
    if m is None:
        m = position_metrics(ref, cand, tokens)
    ref = np.atleast_2d(ref)
    cand = np.atleast_2d(cand)
    assert m.n == ref.shape[0]
    for i in range(ref.shape[0]):
        r = ref_row(ref[i], cand[i], int(tokens[i]))
        for k in ("kl", "entropy"):
            got = float(getattr(m, k)[i])
            want = max(r[k], 0.0)
            # absolute 1e-9, and relative 1e-9 where the value is large
            assert abs(got - want) <= TOL * max(1.0, abs(want)), (k, i, got, want)
        for k in ("delta_p", "margin"):
            got = float(getattr(m, k)[i])
            assert abs(got - r[k]) <= TOL, (k, i, got, r[k])
        assert int(m.rank[i]) == r["rank"], (i, m.rank[i], r["rank"])
        assert int(m.ref_top1[i]) == r["ref_top1"]
        assert int(m.cand_top1[i]) == r["cand_top1"]
        assert bool(m.top1_agree[i]) == (r["ref_top1"] == r["cand_top1"])
    return m


def bf16(a: np.ndarray) -> np.ndarray:
    """Round-toward-zero to bf16 (low 16 bits cleared), as float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def lm_rows(n: int, vocab: int, seed: int, scale: float = 1.0, noise: float = 0.02):
    """Realistic-ish bf16-exact rows: random LM head times hidden states, plus a perturbed
    candidate."""
    rng = np.random.default_rng(seed)
    W = rng.normal(0, 0.05, (vocab, 64)).astype(np.float32)
    h = rng.normal(0, scale, (n, 64)).astype(np.float32)
    x = bf16(h @ W.T)
    y = bf16(x + rng.normal(0, noise, x.shape).astype(np.float32))
    return x, y


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_random_rows_match_reference(dtype):
    rng = np.random.default_rng(1)
    n, v = 7, 3001
    x = (rng.normal(0, 3, (n, v))).astype(dtype)
    y = (x.astype(np.float64) + rng.normal(0, 0.5, (n, v))).astype(dtype)
    t = rng.integers(0, v, n)
    assert_matches(x, y, t)


def test_bf16_exact_rows_match_reference():
    x, y = lm_rows(9, 5000, seed=2, scale=4.0)
    t = np.r_[x[:5].argmax(1), np.random.default_rng(0).integers(0, 5000, 4)]
    assert_matches(x, y, t)


def test_full_vocabulary_bf16_rows():
    x, y = lm_rows(3, 151_936, seed=3, scale=3.0)
    t = x.argmax(1)
    t[1] = 7
    assert_matches(x, y, t)


def test_huge_logits_shifted_path():
    rng = np.random.default_rng(4)
    v = 2000
    base = np.round(rng.normal(0, 2, (4, v)) * 64) / 64  # exact in float32 even +-1e4
    x = np.stack([base[0] + 1e4, base[1] - 1e4, base[2] * 1e3, base[3]]).astype(np.float32)
    y = np.stack([
        base[0] + 1e4 + rng.normal(0, 0.1, v),  # both shifted
        base[1],  # same distribution, one shifted and one not: KL == 0
        base[2] * 1e3 + rng.normal(0, 1.0, v),  # +-1e4-scale spread: near one-hot
        base[3] - 1e4,  # candidate shifted, reference not
    ]).astype(np.float32)
    t = np.array([3, 5, int(np.argmax(x[2])), 11])
    m = assert_matches(x, y, t)
    assert abs(m.kl[3]) < 1e-9


def test_logits_of_magnitude_1e4_both_signs():
    rng = np.random.default_rng(5)
    x = rng.uniform(-1e4, 1e4, (3, 1500)).astype(np.float32)
    y = x.copy()
    y[:, ::7] += rng.normal(0, 50, y[:, ::7].shape).astype(np.float32)
    assert_matches(x, y, np.array([0, int(np.argmax(x[1])), 99]))


def test_near_the_noshift_boundary():
    rng = np.random.default_rng(6)
    v = 1000
    rows = []
    for top in (63.9, 64.0, 64.1, -63.9, -64.1, -700.0, 700.0):
        r = rng.normal(0, 3, v)
        r += top - r.max()
        rows.append(r)
    x = np.array(rows, dtype=np.float64)
    y = x + rng.normal(0, 0.3, x.shape)
    assert_matches(x, y, rng.integers(0, v, len(rows)))


def test_ties_are_deterministic():
    v = 50
    x = np.zeros((3, v), np.float32)
    x[0, [4, 9, 20]] = 5.0  # three-way tie for first: top1 = 4, margin 0
    x[1, [0, 1]] = [2.0, 2.0]
    x[2] = 1.0  # all equal
    y = x.copy()
    y[0, 9] = 5.0
    y[0, 4] = 4.0  # candidate's max is now the tie 9, 20 -> top1 9 (flip)
    t = np.array([20, 1, 3])
    m = assert_matches(x, y, t)
    assert m.ref_top1.tolist() == [4, 0, 0]
    assert m.cand_top1.tolist() == [9, 0, 0]
    assert m.margin.tolist() == [0.0, 0.0, 0.0]
    # rank = entries strictly greater: token 20 ties the candidate's top -> 0;
    # token 3 in an all-equal row -> 0
    assert m.rank.tolist() == [0, 0, 0]


def test_rank_counts_strictly_greater():
    y = np.array([[0.0, 3.0, 3.0, 1.0, 3.0, 2.0]])
    x = np.zeros_like(y)
    m = position_metrics(x, y, [5])
    assert m.rank[0] == 3
    m = position_metrics(x, y, [3])
    assert m.rank[0] == 4
    m = position_metrics(x, y, [2])
    assert m.rank[0] == 0


def test_one_hot_ish_row():
    v = 4000
    x = np.full((2, v), -40.0, np.float32)
    x[0, 17] = 40.0
    x[1, 3] = 30.0
    y = x.copy()
    y[0, 17] = 39.0
    y[1, 3] = 31.0
    y[1, 4] = 25.0
    m = assert_matches(x, y, np.array([17, 4]))
    assert m.margin[0] == pytest.approx(1.0, abs=1e-9)
    assert m.top1_agree.all()


def test_identical_rows_give_zero():
    x, _ = lm_rows(5, 777, seed=7)
    m = position_metrics(x, x.copy(), x.argmax(1))
    assert np.all(m.kl >= 0) and np.all(m.kl < 1e-12)
    assert np.all(np.abs(m.delta_p) < 1e-15)
    assert m.top1_agree.all() and (m.rank == 0).all()


def test_single_entry_vocabulary():
    m = position_metrics(np.array([[1.5]]), np.array([[-2.0]]), [0])
    assert m.kl[0] == 0.0 and m.margin[0] == 1.0 and m.entropy[0] == 0.0
    assert m.rank[0] == 0 and m.delta_p[0] == 0.0


def test_mixed_dtypes_and_block_boundaries(monkeypatch):
    # small block and chunk sizes force partial blocks and partial chunks
    monkeypatch.setattr(M, "_BLOCK", 3)
    monkeypatch.setattr(M, "_CHUNK", 64)
    x, y = lm_rows(8, 1000, seed=8, scale=5.0)
    t = np.arange(8) * 97
    assert_matches(x, y.astype(np.float64), t)
    assert_matches(x.astype(np.float16), y, t)


def test_one_dimensional_input_is_one_position():
    rng = np.random.default_rng(9)
    x = rng.normal(size=300)
    y = x + rng.normal(0, 0.1, 300)
    m = position_metrics(x, y, [5])
    assert m.n == 1
    assert_matches(x[None], y[None], [5], m)


def test_memmap_and_noncontiguous_inputs(tmp_path):
    x, y = lm_rows(6, 900, seed=10)
    np.save(tmp_path / "x.npy", x)
    xm = np.load(tmp_path / "x.npy", mmap_mode="r")
    yf = np.asfortranarray(y)
    t = x.argmax(1)
    assert_matches(xm, yf, t)
    big = np.zeros((12, 900), np.float32)
    big[::2] = x
    assert_matches(big[::2], y, t)


def test_reference_implementation_agrees():
    x, y = lm_rows(4, 1200, seed=11, scale=2.0)
    t = np.array([1, 2, 3, 4])
    assert_matches(x, y, t, reference_position_metrics(x, y, t))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 5),
    v=st.integers(1, 300),
    scale=st.sampled_from([0.01, 1.0, 10.0, 300.0, 3e4]),
    offset=st.sampled_from([0.0, 60.0, -200.0, 5e3]),
    noise=st.sampled_from([0.0, 1e-3, 0.5, 5.0]),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_against_reference(n, v, scale, offset, noise, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, scale, (n, v))
    y = x + rng.normal(0, noise * max(scale, 1.0), (n, v))
    if np.dtype(dtype) == np.float16:
        x = np.clip(x, -6e4, 6e4)
        y = np.clip(y, -6e4, 6e4)
    x = x.astype(dtype)
    y = y.astype(dtype)
    assert_matches(x, y, rng.integers(0, v, n))


# --------------------------------------------------------------------------- rows()


def test_rows_have_exactly_the_design_names():
    x, y = lm_rows(3, 200, seed=12)
    m = position_metrics(x, y, [0, 1, 2])
    rows = m.rows()
    assert len(rows) == 3
    assert set(rows[0]) == {"position", "token", "top1_agree", "flip", "kl", "delta_p",
                            "margin", "rank", "entropy", "ref_top1", "cand_top1"}
    for i, r in enumerate(rows):
        assert r["position"] == i and r["token"] == i
        assert r["flip"] == (not r["top1_agree"])
        assert isinstance(r["kl"], float) and isinstance(r["rank"], int)
        assert isinstance(r["top1_agree"], bool)


# --------------------------------------------------------------------------- validation


def _err(ref, cand, tokens) -> str:
    with pytest.raises(AnalysisInputError) as ei:
        position_metrics(ref, cand, tokens)
    assert isinstance(ei.value, ValueError)
    return str(ei.value)


def test_mismatched_shapes():
    assert "shapes differ" in _err(np.zeros((2, 5)), np.zeros((2, 6)), [0, 0])
    assert "shapes differ" in _err(np.zeros((3, 5)), np.zeros((2, 5)), [0, 0])


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["ref", "cand"])
def test_non_finite_names_the_row(bad, which, offset):
    # offset 1e4: the row also takes the shifted (huge logits) path
    x = np.full((40, 300), offset, np.float32)
    y = np.full((40, 300), offset, np.float32)
    (x if which == "ref" else y)[23, 150] = bad
    msg = _err(x, y, np.zeros(40, int))
    assert msg.startswith(which) and "row 23" in msg and "column 150" in msg


def test_minus_inf_where_the_other_side_has_no_mass():
    # -inf in the candidate at an entry where the reference's exp underflows to 0
    x = np.zeros((1, 10))
    x[0, 0] = 800.0
    y = np.zeros((1, 10))
    y[0, 5] = -np.inf
    assert "row 0" in _err(x, y, [0])


def test_wrong_dtypes():
    assert "floating dtype" in _err(np.zeros((2, 3), int), np.zeros((2, 3)), [0, 0])
    assert "floating dtype" in _err(np.zeros((2, 3)), np.zeros((2, 3), bool), [0, 0])
    assert "floating dtype" in _err(np.zeros((2, 3), complex), np.zeros((2, 3)), [0, 0])


def test_empty_inputs():
    assert "empty" in _err(np.zeros((0, 5)), np.zeros((0, 5)), [])
    assert "empty" in _err(np.zeros((2, 0)), np.zeros((2, 0)), [0, 0])
    assert "2-D" in _err(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)), [0, 0])


def test_bad_tokens():
    x = np.zeros((3, 10))
    assert "outside the vocabulary" in _err(x, x, [0, 10, 1])
    assert "outside the vocabulary" in _err(x, x, [0, -1, 1])
    assert "3 positions" in _err(x, x, [0, 1])
    assert "integers" in _err(x, x, [0.0, 1.5, 2.0])
    assert "flat list" in _err(x, x, [[0], [1], [2]])


# --------------------------------------------------------------------------- summaries


def _metrics(kl, agree=None, delta_p=None) -> PositionMetrics:
    kl = np.asarray(kl, dtype=np.float64)
    n = kl.size
    agree = np.ones(n, bool) if agree is None else np.asarray(agree, bool)
    dp = np.zeros(n) if delta_p is None else np.asarray(delta_p, np.float64)
    top = np.zeros(n, np.int64)
    return PositionMetrics(
        top1_agree=agree, kl=kl, delta_p=dp, margin=np.full(n, 0.5),
        rank=np.zeros(n, np.int64), entropy=np.full(n, 1.0), ref_top1=top,
        cand_top1=np.where(agree, 0, 1).astype(np.int64), tokens=np.zeros(n, np.int64),
    )


def test_summary_percentiles_and_se():
    m = _metrics(np.arange(11.0))  # 0..10
    s = summarize(m)
    k = s["kl"]
    assert k["mean"] == 5.0
    # population variance 10; se = sqrt(10 / (n - 1)) = 1
    assert k["se"] == pytest.approx(1.0)
    assert k["max"] == 10.0 and k["min"] == 0.0
    assert k["p50"] == 5.0 and k["p90"] == 9.0 and k["p10"] == 1.0
    assert k["p99.9"] == pytest.approx(9.99) and k["p0.1"] == pytest.approx(0.01)
    assert k["p99"] == pytest.approx(9.9) and k["p95"] == pytest.approx(9.5)
    assert k["p5"] == pytest.approx(0.5) and k["p1"] == pytest.approx(0.1)
    assert s["n"] == 11 and s["approximate"] is False


def test_summary_same_top_and_rms():
    agree = [True] * 8 + [False, False]
    dp = [0.3, -0.4, 0, 0, 0, 0, 0, 0, 0, 0]
    s = summarize(_metrics(np.zeros(10), agree, dp))
    assert s["same_top_p"]["p"] == pytest.approx(0.8)
    assert s["same_top_p"]["se"] == pytest.approx(math.sqrt(0.8 * 0.2 / 9))
    # RMS = sqrt((0.09 + 0.16) / 10) = 0.158113...
    assert s["delta_p"]["rms"] == pytest.approx(math.sqrt(0.025))
    d2 = np.array(dp) ** 2
    mse_se = math.sqrt(d2.var() / 9)
    assert s["delta_p"]["rms_se"] == pytest.approx(mse_se / (2 * math.sqrt(0.025)))
    assert s["flips"] == 2 and s["first_flip"] == 8 and s["flip_rate"] == pytest.approx(0.2)


def test_summary_flips_by_region():
    agree = [True, False, True, False, False, True]
    regions = ["thinking", "thinking", "content", "tool_args", "tool_args", "tool_syntax"]
    s = summarize(_metrics(np.zeros(6), agree), regions)
    assert s["flips_by_region"] == {"thinking": 1, "content": 0, "tool_args": 2,
                                    "tool_syntax": 0}
    assert s["positions_by_region"]["tool_args"] == 2
    assert s["first_flip"] == 1
    with pytest.raises(AnalysisInputError):
        summarize(_metrics(np.zeros(6), agree), regions[:5])


def test_summary_of_one_position_and_no_flips():
    s = summarize(_metrics([0.25]))
    assert s["kl"]["mean"] == 0.25 and s["kl"]["se"] is None
    assert s["same_top_p"] == {"p": 1.0, "se": None}
    assert s["flips"] == 0 and s["first_flip"] is None


def test_summary_of_real_metrics_is_consistent():
    x, y = lm_rows(30, 400, seed=13, scale=3.0, noise=0.3)
    m = position_metrics(x, y, x.argmax(1))
    s = summarize(m)
    assert s["kl"]["mean"] == pytest.approx(float(m.kl.mean()))
    assert s["kl"]["min"] <= s["kl"]["p50"] <= s["kl"]["max"]
    assert s["flips"] == int((~m.top1_agree).sum())


def test_widen_bf16_is_exact_and_leaves_other_rows_alone():
    """uint16 bfloat16 bit patterns widen to the float32 values they stand for, bit for bit."""
    import numpy as np

    from tensorverse.analysis.metrics import widen_bf16

    x = np.array([1.0, -2.5, 0.15625, np.inf, -0.0, 3.0e38], dtype=np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # these values are bf16-exact
    np.testing.assert_array_equal(widen_bf16(bits).view(np.uint32), x.view(np.uint32) & 0xFFFF0000)
    assert widen_bf16(x) is x


# --------------------------------------------------------------------------- dtypes, messages, edge rows, summaries
# (each test below checks values, dtypes or messages exactly; expected values come from the
# longdouble reference `ref_row`, plain Python loops or the definitions.)


def test_second_max_next_to_the_top1_inside_a_tile(monkeypatch):
    # top-1 at index 1 of a tile with the runner-up at index 0, and top-1 at the tile's
    # second-to-last entry with the runner-up at its last one: both neighbours must be searched.
    rows = np.array([
        [1.0, 2.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0],
        [-5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 2.0, 1.0],
        [-5.0, -4.0, 1.0, 2.0, -1.0, 0.0, -3.0, -2.0],  # with a 4-wide tile: index 1 of tile 0
    ])
    cand = rows[:, ::-1].copy()
    t = np.array([0, 7, 2])
    m = assert_matches(rows, cand, t)
    for i in range(3):  # the margin, literally: p(top1) - p(top2) under P, in plain floats
        e = [math.exp(v) for v in rows[i]]
        p = sorted((v / sum(e) for v in e), reverse=True)
        assert m.margin[i] == pytest.approx(p[0] - p[1], abs=1e-12)
    monkeypatch.setattr(M, "_CHUNK", 4)  # two tiles per row: the same rows across a tile edge
    assert_matches(rows, cand, t)
    shifted = np.array([[-1.0, 1.0, 2.0, 0.0, -9.0, -9.0, -9.0, -9.0]])  # top-1 at 2 of tile 0
    assert_matches(shifted, shifted[:, ::-1].copy(), [3])


def test_metrics_arrays_have_their_documented_dtypes():
    x, y = lm_rows(3, 50, seed=14)
    for m in (position_metrics(x, y, [1, 2, 3]), reference_position_metrics(x, y, [1, 2, 3])):
        assert m.ref_top1.dtype == np.int64 and m.cand_top1.dtype == np.int64
        assert m.rank.dtype == np.int64 and m.top1_agree.dtype == bool
        assert m.tokens.dtype == np.int64 and m.tokens.tolist() == [1, 2, 3]
        r = m.rows()[0]
        assert type(r["ref_top1"]) is int and type(r["cand_top1"]) is int and type(r["token"]) is int


def test_reference_implementation_on_huge_logits_one_hot_rows_and_one_entry():
    rng = np.random.default_rng(15)
    x = rng.normal(0, 2, (3, 300)) + np.array([[1e3], [-1e3], [0.0]])
    x[2] = -50.0
    x[2, 7] = 50.0  # one-hot: entropy far below 1
    y = x + rng.normal(0, 0.3, x.shape)
    t = np.array([4, 9, 7])
    m = assert_matches(x, y, t, reference_position_metrics(x, y, t))
    assert m.entropy[2] < 1e-30
    one = reference_position_metrics(np.array([[1.5]]), np.array([[-2.0]]), [0])
    assert one.margin[0] == 1.0 and one.kl[0] == 0.0 and one.entropy[0] == 0.0


def test_non_finite_messages_exactly():
    x = np.zeros((3, 6))
    x[2] = [0.0, np.nan, np.inf, np.inf, -np.inf, 0.0]
    y = np.zeros((3, 6))
    want = "ref: row 2 contains non-finite logits (1 NaN, 2 +inf, 1 -inf; first at column 1)"
    for f in (position_metrics, reference_position_metrics):
        with pytest.raises(AnalysisInputError) as ei:
            f(x, y, [0, 0, 0])
        assert str(ei.value) == want
    y[1, 3] = -np.inf
    want = "cand: row 1 contains non-finite logits (1 -inf; first at column 3)"
    for f in (position_metrics, reference_position_metrics):
        with pytest.raises(AnalysisInputError) as ei:
            f(np.zeros((3, 6)), y, [0, 0, 0])
        assert str(ei.value) == want
    # a later block: the row number counts from the start of the run
    y = np.zeros((11, 6))
    y[10, 5] = np.nan
    with pytest.raises(AnalysisInputError) as ei:
        position_metrics(np.zeros((11, 6)), y, [0] * 11)
    assert str(ei.value) == "cand: row 10 contains non-finite logits (1 NaN; first at column 5)"


def test_validation_messages_name_the_side():
    assert _err(None, np.zeros((1, 2)), [0]) == "ref: no logits given"
    assert _err(np.zeros((1, 2)), None, [0]) == "cand: no logits given"
    assert _err(np.zeros((1, 2), int), np.zeros((1, 2)), [0]) == (
        "ref: logits must be a floating dtype (float16/float32/float64), got int64")
    assert _err(np.zeros((1, 2)), np.zeros((1, 2), np.float32)[:, :, None], [0]) == (
        "cand: logits must be 2-D (positions x vocabulary), got shape (1, 2, 1)")
    assert _err(np.zeros((2, 5)), np.zeros((2, 6)), [0, 0]) == (
        "ref and cand shapes differ: (2, 5) vs (2, 6) (both must be positions x vocabulary)")
    msg = _err([[1.0, 2.0], [1.0]], np.zeros((2, 2)), [0, 0])
    assert msg.startswith("ref: not an array of logits (")
    msg = _err(np.zeros((2, 2)), [[1.0, 2.0], [1.0]], [0, 0])
    assert msg.startswith("cand: not an array of logits (")
    assert _err(np.zeros((1, 2)), np.zeros((1, 2)), None) == "tokens: no reference token ids given"
    assert _err(np.zeros((2, 2)), np.zeros((2, 2)), [[0], [1, 0]]).startswith(
        "tokens: not a list of token ids (")
    assert _err(np.zeros((1, 2)), np.zeros((1, 2)), [1.0]) == (
        "tokens: token ids must be integers, got float64")
    assert _err(np.zeros((3, 4)), np.zeros((3, 4)), [4, -1, 9]) == (
        "tokens: token id 4 at position 0 is outside the vocabulary [0, 4) (3 out of range)")


def test_python_lists_are_logits():
    x = [[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]]
    y = [[0.5, 1.0, 2.0], [0.0, 2.0, 0.0]]
    m = position_metrics(x, y, [2, 0])
    assert_matches(np.array(x), np.array(y), [2, 0], m)


def test_metrics_do_not_depend_on_the_callers_floating_point_error_state():
    # exp(-800) underflows: a caller's np.errstate(all="raise") must not turn it into an error
    x = np.zeros((2, 40))
    x[:, 5] = 800.0
    y = np.zeros((2, 40))
    y[0, 1] = -np.inf
    with np.errstate(all="raise"):
        m = position_metrics(x, np.zeros((2, 40)), [5, 0])
        # the refusal says where: the side, the row, what is non-finite and its first column
        with refused(AnalysisInputError, "non_finite", "cand: row 0", "1 -inf", "first at column 1"):
            position_metrics(x, y, [5, 0])
    assert_matches(x, np.zeros((2, 40)), [5, 0], m)


def test_rows_of_approximate_metrics_and_without_tokens():
    n = 3
    base = dict(
        top1_agree=np.array([True, False, True]), kl=np.array([0.0, 0.5, 0.25]),
        delta_p=np.array([0.0, np.nan, 0.1]), margin=np.full(n, 0.5),
        rank=np.array([0, 5, 2], np.int64), entropy=np.ones(n),
        ref_top1=np.zeros(n, np.int64), cand_top1=np.array([0, 1, 0], np.int64),
    )
    lb = np.array([False, True, False])
    rows = PositionMetrics(**base, approximate=True, rank_lower_bound=lb).rows()
    assert [r["rank"] for r in rows] == [0, ">= 5", 2]
    assert all(r["approximate"] is True for r in rows)
    assert [r["token"] for r in rows] == [None, None, None]  # no tokens given: None, not 0
    assert len(rows) == n and len(PositionMetrics(**base)) == n
    exact = PositionMetrics(**base, rank_lower_bound=lb).rows()  # not approximate: flags ignored
    assert [r["rank"] for r in exact] == [0, 5, 2] and "approximate" not in exact[0]


def test_widen_bf16_gives_float32():
    bits = np.array([0x3F80, 0xC020, 0x0000], np.uint16)  # 1.0, -2.5, 0.0
    w = M.widen_bf16(bits)
    assert w.dtype == np.float32
    assert w.tolist() == [1.0, -2.5, 0.0]


def _summary_metrics(kl, delta_p, *, entropy=None, margin=None, agree=None, approximate=False,
                     lb=None) -> PositionMetrics:
    kl = np.asarray(kl)
    n = kl.size
    agree = np.ones(n, bool) if agree is None else np.asarray(agree, bool)
    return PositionMetrics(
        top1_agree=agree, kl=kl, delta_p=np.asarray(delta_p, np.float64),
        margin=np.full(n, 0.5) if margin is None else np.asarray(margin, np.float64),
        rank=np.zeros(n, np.int64),
        entropy=np.ones(n) if entropy is None else np.asarray(entropy, np.float64),
        ref_top1=np.zeros(n, np.int64), cand_top1=np.where(agree, 0, 1).astype(np.int64),
        approximate=approximate, rank_lower_bound=lb,
    )


def test_summary_of_two_positions_has_standard_errors():
    s = summarize(_summary_metrics([1.0, 3.0], [0.0, 0.0], agree=[True, False]))
    # population variance 1 over n - 1 = 1: se 1
    assert (s["kl"]["n"], s["kl"]["mean"], s["kl"]["se"]) == (2, 2.0, 1.0)
    assert s["same_top_p"] == {"p": 0.5, "se": math.sqrt(0.5 * 0.5 / 1)}
    # every delta_p zero: rms 0 and its se 0 (not a division by zero)
    assert s["delta_p"]["rms"] == 0.0 and s["delta_p"]["rms_se"] == 0.0
    assert s["delta_p"]["mean"] == 0.0 and s["delta_p"]["n"] == 2


def test_summary_of_one_nonzero_delta_p_has_no_se():
    s = summarize(_summary_metrics([0.5], [-0.25]))
    assert s["delta_p"]["rms"] == 0.25 and s["delta_p"]["rms_se"] is None
    assert s["delta_p"]["mean"] == -0.25 and s["delta_p"]["se"] is None


def test_summary_of_approximate_metrics_with_unknown_delta_p():
    nan = float("nan")
    m = _summary_metrics([0.1, 0.2, 0.3], [nan, nan, nan], approximate=True,
                         lb=np.array([True, False, True]),
                         entropy=[1.0, np.inf, 2.0], margin=[np.nan, np.nan, np.nan])
    s = summarize(m)
    want = {"n": 0, "mean": None, "se": None, "max": None}
    want.update({f"p{p:g}": None for p in (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)})
    want.update({"min": None, "rms": None, "rms_se": None})
    assert s["delta_p"] == want and list(s["delta_p"]) == list(want)
    assert (s["kl_bound"], s["rank_lower_bounds"], s["delta_p_unknown"]) == ("lower", 2, 3)
    assert s["approximate"] is True
    assert s["mean_entropy"] == 1.5  # the infinite entry left out
    assert s["mean_margin"] is None  # nothing finite
    no_lb = summarize(_summary_metrics([0.1], [nan], approximate=True))
    assert no_lb["rank_lower_bounds"] == 0 and no_lb["delta_p_unknown"] == 1
    exact = summarize(_summary_metrics([0.1, 0.2], [0.0, 0.1], entropy=[0.5, 1.0], margin=[0.25, 0.5]))
    assert exact["mean_entropy"] == 0.75 and exact["mean_margin"] == 0.375
    assert "kl_bound" not in exact and "rank_lower_bounds" not in exact


def test_summary_statistics_are_taken_in_float64():
    kl = np.array([0.1, 0.2, 0.3, 0.7], np.float16)
    s = summarize(_summary_metrics(kl, np.zeros(4)))
    vals = [float(v) for v in kl]  # the float16 values, exactly, as Python floats
    mean = sum(vals) / 4
    se = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4 / 3)
    assert s["kl"]["mean"] == pytest.approx(mean, rel=1e-15, abs=0)
    assert s["kl"]["se"] == pytest.approx(se, rel=1e-12, abs=0)


def test_summary_messages():
    m = _summary_metrics([0.0, 0.0], [0.0, 0.0])
    with refused(AnalysisInputError, "empty"):
        summarize(_summary_metrics(np.zeros(0), np.zeros(0)))
    with refused(AnalysisInputError, "shape"):
        summarize(m, ["content"])
    with refused(AnalysisInputError, "format"):
        summarize(m, ["content", 3])
    s = summarize(m, ["zeta", "alpha"])  # labels outside REGIONS: sorted, after the known ones
    assert list(s["flips_by_region"]) == ["alpha", "zeta"]
