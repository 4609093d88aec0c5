"""The rig run's per-position rows (tensorverse.rig.positions) against an independent float64
reference written here with plain loops, and the suite's setting selection."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensorverse.bundle.format import FREE_VERDICTS, TOPK_AT_FLIPS
from tensorverse.rig.positions import flips_of, turn_positions
from tensorverse.rig.run import RigRunError, _chosen, point_settings
from tensorverse.rig.suite import CPU_V1


def _kl(p_logits, q_logits):
    m1, m2 = max(p_logits), max(q_logits)
    lp = [x - m1 - math.log(math.fsum(math.exp(y - m1) for y in p_logits)) for x in p_logits]
    lq = [x - m2 - math.log(math.fsum(math.exp(y - m2) for y in q_logits)) for x in q_logits]
    return math.fsum(math.exp(a) * (a - b) for a, b in zip(lp, lq))


def _reference(row, tok):
    row = [float(x) for x in row]
    best = max(range(len(row)), key=lambda j: (row[j], -j))
    others = [row[j] for j in range(len(row)) if j != tok]
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))[:TOPK_AT_FLIPS]
    return best, row[tok] - max(others), order


def test_rows_match_an_independent_float64_reference():
    rng = np.random.default_rng(5)
    n, v = 9, 40
    ref = rng.normal(0, 2, (n, v)).astype(np.float32)
    cand = (ref + rng.normal(0, 0.8, (n, v))).astype(np.float32)
    tokens = ref.argmax(axis=1).tolist()
    noise = np.zeros(n, bool)
    rows = turn_positions("fp32", "c1", 3, tokens, cand, ref, noise_flips=noise)
    assert [r["position"] for r in rows] == list(range(n))
    assert any(r["flip"] for r in rows) and not all(r["flip"] for r in rows)
    for i, r in enumerate(rows):
        top1, margin, order = _reference(cand[i], tokens[i])
        assert (r["setting"], r["case"], r["turn"], r["token"]) == ("fp32", "c1", 3, tokens[i])
        assert r["top1"] == top1 and r["flip"] == (top1 != tokens[i])
        assert r["margin"] == pytest.approx(margin, abs=1e-12)
        assert (r["margin"] < 0) == r["flip"]
        assert r["kl"] == pytest.approx(_kl(ref[i].tolist(), cand[i].tolist()), rel=1e-9, abs=1e-13)
        if r["flip"]:
            assert r["flip_class"] == "runtime"
            assert r["topk_ids"] == order and r["topk_ids"][0] == top1
            assert r["topk_logits"] == [float(np.float32(cand[i][j])) for j in order]
        else:
            assert r["flip_class"] is None and r["topk_ids"] is None and r["topk_logits"] is None


def test_the_reference_setting_has_kl_zero_and_classes_tie_near_tie_noise():
    v = 8
    rows = np.zeros((4, v), np.float32)
    rows[:, 0] = 1.0
    rows[0, 3] = 1.0                      # tie: the lower id (0) wins; token 3 flips with margin 0
    rows[1, 3] = np.float32(1.0) + np.float32(2**-7)  # adjacent bfloat16 values: near_tie
    rows[2, 3] = 5.0                      # a clear flip where the noise point flips too
    rows[3, 3] = 5.0                      # a clear flip, the noise point does not: runtime
    tokens = [3, 0, 0, 0]
    out = turn_positions("bf16", "c", 0, tokens, rows, None, noise_flips=np.array([False, False, True, False]))
    assert [r["kl"] for r in out] == [0.0] * 4
    assert [r["flip"] for r in out] == [True, True, True, True]
    assert [r["flip_class"] for r in out] == ["tie", "near_tie", "noise", "runtime"]
    assert out[0]["margin"] == 0.0 and out[0]["top1"] == 0


def test_bf16_bit_patterns_are_widened_and_judged_on_the_bfloat16_grid():
    f = np.zeros((1, 4), np.float32)
    f[0, 1], f[0, 2] = 2.0, np.float32(2.0) + np.float32(2**-6)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    out = turn_positions("bf16", "c", 0, [1], bits, None)
    assert out[0]["top1"] == 2 and out[0]["flip_class"] == "near_tie" and out[0]["margin"] == -(2**-6)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="rows for 3 tokens"):
        turn_positions("s", "c", 0, [1, 2, 3], np.zeros((2, 5), np.float32), None)
    assert flips_of(np.eye(3, dtype=np.float32), [0, 2, 2]).tolist() == [False, True, False]


def test_settings_chosen_reference_first_noise_unless_off_unknown_refused():
    names = [s.name for s in _chosen(CPU_V1, ["fp32"], True)]
    assert names == ["bf16", "bf16_noise", "fp32"]
    assert [s.name for s in _chosen(CPU_V1, ["fp32"], False)] == ["bf16", "fp32"]
    assert [s.name for s in _chosen(CPU_V1, None, True)] == [s.name for s in CPU_V1.settings]
    with pytest.raises(RigRunError, match="no setting fp9"):
        _chosen(CPU_V1, ["fp9"], True)
    assert point_settings(CPU_V1.setting("threads_2")) == {"OMP_NUM_THREADS": "2"}
    assert point_settings(CPU_V1.setting("fp32")) == {"--dtype": "float32"}


def test_fp8_kv_is_refused_exactly_where_the_cpu_lacks_avx512_and_amx(monkeypatch):
    from tensorverse.rig import servers

    monkeypatch.setattr(servers, "cpu_has_fp8_kv_cache", lambda cpuinfo=None: False)
    why = CPU_V1.setting("fp8_kv_e4m3").refusal()
    assert why and servers.FP8_KV_REFUSAL in why
    monkeypatch.setattr(servers, "cpu_has_fp8_kv_cache", lambda cpuinfo=None: True)
    assert CPU_V1.setting("fp8_kv_e5m2").refusal() is None
    assert CPU_V1.setting("fp32").refusal() is None


def test_free_verdicts_are_the_tool_call_verdicts():
    from tensorverse.analysis.toolcalls import VERDICTS

    assert FREE_VERDICTS == VERDICTS
