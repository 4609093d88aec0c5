"""compare_turn on hand-built stored runs: full rows vs top-k, reference choice, noise floor,
free-run divergence and tool-call verdicts, incomplete rows, refused and failed runs."""

from __future__ import annotations

import numpy as np
import pytest

from tensorverse.shadow.compare import compare_runs, compare_turn, select_reference
from tensorverse.shadow.runs import primary_run_id
from tensorverse.store.codec import encode_row

V = 50
N = 6
PIECES = ['<tool_call>', '{"name": "show_vlan", ', '"arguments": {"vlan": ', '201', '}}', '</tool_call>']
REF_TEXT = "".join(PIECES)
CAND_TEXT = REF_TEXT.replace("201", "202")


def ref_logits() -> np.ndarray:
    rng = np.random.default_rng(7)
    return (rng.standard_normal((N, V)) * 2).astype(np.float32)


def tokens_of(x: np.ndarray) -> list[int]:
    return [int(t) for t in np.argmax(x, axis=1)]


def topk(x: np.ndarray, k: int = 5) -> list[list[list[float]]]:
    out = []
    for row in x.astype(np.float64):
        lp = row - row.max()
        lp -= np.log(np.exp(lp).sum())
        order = np.argsort(-lp)[:k]
        out.append([[int(i), float(lp[i])] for i in order])
    return out


def put_rows(store, run_id: str, x: np.ndarray, skip: tuple[int, ...] = ()) -> None:
    store.write_rows(run_id, [(p, encode_row(x[p])) for p in range(x.shape[0]) if p not in skip]).result()


def run_record(rid, backend, role, mode, tokens, *, capture="full", top=None, text=None, rows=None,
               status="ok", **extra):
    return {"id": rid, "turn_id": "T", "backend": backend, "role": role, "mode": mode,
            "status": status, "capture": capture, "approximate": capture != "full",
            "token_ids": tokens, "text": text, "top_logprobs": top, "k": 5, "rows": rows, **extra}


@pytest.fixture
def turn_runs(store):
    R = ref_logits()
    T = tokens_of(R)
    C = R.copy()
    C[3, (T[3] + 1) % V] = R[3].max() + 0.5  # the candidate prefers another token at 3
    complete = {"expected": N, "present": N, "complete": True}
    free_tokens = T[:3] + [(T[3] + 1) % V, 4, 5]
    runs = [
        run_record(primary_run_id("T"), "prim", "primary", "recorded", T, capture="topk",
                   top=topk(R), text=REF_TEXT, pieces=PIECES),
        run_record("sec-f", "sec", "secondary", "forced", T, top=topk(R), rows=complete),
        run_record("sec-r", "sec", "secondary", "free", T, text=REF_TEXT),
        run_record("cand-f", "cand", "shadow", "forced", T, top=topk(C), rows=complete),
        run_record("cand-r", "cand", "shadow", "free", free_tokens, text=CAND_TEXT),
        run_record("down-f", "down", "shadow", "forced", [], status="failed", error="connect"),
        run_record("other-f", "other", "shadow", "forced", [], status="refused", error="refused: ..."),
    ]
    for r in runs:
        store.put_run(r).result()
    put_rows(store, "sec-f", R)
    put_rows(store, "cand-f", C)
    return R, C, T


def test_compare_turn_full_topk_free_and_noise(store, turn_runs):
    R, C, T = turn_runs
    out = compare_turn(store, "T")
    key = {(c["run_id"], c["ref_run_id"]): c for c in out}
    prim = primary_run_id("T")
    assert set(key) == {("cand-f", "sec-f"), ("cand-f", prim), ("sec-f", prim), ("sec-r", prim),
                        ("cand-r", prim)}

    full = key[("cand-f", "sec-f")]
    assert full["kind"] == "full" and full["approximate"] is False and full["status"] == "ok"
    assert full["flips"] == [3] and full["first_flip"] == 3
    assert full["summary"]["flips"] == 1 and full["summary"]["n"] == N
    assert full["regions"][3] == "tool_args"
    assert full["summary"]["flips_by_region"]["tool_args"] == 1
    assert full["metrics"]["kl"][3] > 0 and full["metrics"]["kl"][0] == pytest.approx(0, abs=1e-12)
    assert full["flip_tokens"][0] == {"position": 3, "token": T[3], "ref_top1": T[3],
                                      "cand_top1": (T[3] + 1) % V, "region": "tool_args",
                                      "flip_class": "runtime"}
    assert full["incomplete"] is False and full["positions"] is None

    floor = key[("sec-f", prim)]
    assert floor["kind"] == "topk" and floor["approximate"] and floor["noise_floor"] is True
    assert floor["flips"] == []
    cand_vs_prim = key[("cand-f", prim)]
    assert cand_vs_prim["flips"] == [3] and cand_vs_prim["noise_floor"] is False
    assert cand_vs_prim["noise"]["candidate_flips"] == 1 and cand_vs_prim["noise"]["secondary_flips"] == 0
    assert cand_vs_prim["noise"]["floor_backend"] == "sec"

    free = key[("cand-r", prim)]
    assert free["mode"] == "free" and free["divergence"]["position"] == 3
    assert free["common_prefix"] == 3 and free["diverged"] is True
    assert free["verdict"] == "value_mismatch"
    assert free["tool_calls"]["differences"][0]["path"] == "$.arguments.vlan"
    assert free["forced_departure"] == 3 and free["confirms_forced"] is True
    same = key[("sec-r", prim)]
    assert same["verdict"] == "match" and same["diverged"] is False and same["confirms_forced"] is True
    assert same["noise_floor"] is True

    # stored, keyed by (run, reference run)
    got = store.get_comparison("cand-f", "sec-f")
    assert got["flips"] == [3] and got["run_id"] == "cand-f" and got["ref_run_id"] == "sec-f"


def test_incomplete_rows_compare_the_common_positions(store, turn_runs):
    R, C, T = turn_runs
    partial = run_record("cand2-f", "cand2", "shadow", "forced", T, top=topk(C),
                         rows={"expected": N, "present": N - 1, "complete": False})
    store.put_run(partial).result()
    put_rows(store, "cand2-f", C, skip=(4,))
    out = {(c["run_id"], c["ref_run_id"]): c for c in compare_turn(store, "T", store_results=False)}
    c = out[("cand2-f", "sec-f")]
    assert c["incomplete"] is True and c["positions"] == [0, 1, 2, 3, 5] and c["n"] == 5
    assert c["flips"] == [3]


def test_reference_falls_back_to_reference_role_then_primary(store, turn_runs):
    runs = list(store.iter_runs("T"))
    forced = [r for r in runs if r["mode"] == "forced"]
    assert select_reference(forced).backend == "sec"
    assert select_reference(forced, roles={"sec": "shadow", "cand": "reference"}).backend == "cand"
    assert select_reference(forced, roles={"sec": "shadow"}) is None
    # no reference at all: candidates are compared with the primary's top-k only
    out = compare_runs(store, runs, roles={"sec": "shadow"}, store_results=False)
    refs = {c["ref_run_id"] for c in out}
    assert refs == {primary_run_id("T")}


def test_topk_comparison_when_one_side_has_no_rows(store, turn_runs):
    R, C, T = turn_runs
    store.put_run(run_record("tk-f", "tk", "shadow", "forced", T, capture="topk", top=topk(C))).result()
    out = {(c["run_id"], c["ref_run_id"]): c for c in compare_turn(store, "T", store_results=False)}
    c = out[("tk-f", "sec-f")]
    assert c["kind"] == "topk" and c["approximate"] is True and c["flips"] == [3]


def test_width_mismatch_is_an_error_result_not_an_exception(store, turn_runs):
    R, C, T = turn_runs
    store.put_run(run_record("w-f", "wide", "shadow", "forced", T, top=topk(C),
                             rows={"expected": N, "present": N, "complete": True})).result()
    put_rows(store, "w-f", np.pad(C, ((0, 0), (0, 3)), constant_values=-5.0))
    out = {(c["run_id"], c["ref_run_id"]): c for c in compare_turn(store, "T", store_results=False)}
    c = out[("w-f", "sec-f")]
    assert c["status"] == "error" and "different vocabularies" in c["error"]


def test_no_primary_run_is_an_input_error(store):
    from tensorverse.analysis.metrics import AnalysisInputError

    store.put_run(run_record("x", "a", "shadow", "forced", [1])).result()
    with pytest.raises(AnalysisInputError):
        compare_turn(store, "T")


def test_only_the_comparisons_of_the_given_backends(store, turn_runs):
    prim = primary_run_id("T")
    cand = {(c["run_id"], c["ref_run_id"]) for c in compare_turn(store, "T", backends=["cand"],
                                                                  store_results=False)}
    assert cand == {("cand-f", "sec-f"), ("cand-f", prim), ("cand-r", prim)}
    # the secondary is the reference and the noise floor: its call redoes everything
    sec = {(c["run_id"], c["ref_run_id"]) for c in compare_turn(store, "T", backends=["sec"],
                                                                 store_results=False)}
    assert ("cand-f", "sec-f") in sec and ("sec-f", prim) in sec and ("cand-r", prim) in sec
    with_noise = [c for c in compare_turn(store, "T", backends=["cand"], store_results=False)
                  if c["run_id"] == "cand-f" and c["ref_run_id"] == prim][0]
    assert with_noise["noise"]["floor_backend"] == "sec"


def _bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (kept as float32): the rows vLLM captures."""
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def test_flip_classes_in_stored_comparisons(store):
    """Issue 19: every flip of a stored comparison has a class. Positions: 1 = an exact tie in the
    secondary's bf16 row, 2 = adjacent bf16 values (near tie), 3 = the secondary flips against the
    primary too (noise), 4 = only the candidate flips (runtime). The secondary's own flip is noise;
    the candidate's free run with the primary's exact ids but other tool calls is a parser flip."""
    R = _bf16(ref_logits())
    T = tokens_of(R)
    S = R.copy()  # the secondary's rows (the primary's config): equal, except where noted
    C = R.copy()
    alt = [(t + 1) % V for t in T]
    S[1, alt[1]] = S[1, T[1]]  # a tie: argmax stays T[1] only if T[1] < alt[1]
    if alt[1] < T[1]:
        alt[1] = (T[1] + 2) % V if (T[1] + 2) % V > T[1] else alt[1]
        S[1, alt[1]] = S[1, T[1]]
    bits = S[2, T[2]].view(np.uint32) >> 16
    S[2, alt[2]] = np.array([(int(bits) - 1) << 16], np.uint32).view(np.float32)[0]  # 1 bf16 step below
    for p in (1, 2, 3, 4):
        C[p, alt[p]] = R[p].max() + 1.0  # the candidate prefers alt[p]
    Sprime = S.copy()
    Sprime[3, alt[3]] = R[3].max() + 1.0  # the secondary flips at 3 (against the primary's top-k)
    complete = {"expected": N, "present": N, "complete": True}
    runs = [
        run_record(primary_run_id("T"), "prim", "primary", "recorded", T, capture="topk", top=topk(R),
                   text=REF_TEXT, pieces=PIECES),
        run_record("sec-f", "sec", "secondary", "forced", T, top=topk(Sprime), rows=complete),
        run_record("cand-f", "cand", "shadow", "forced", T, top=topk(C), rows=complete),
        run_record("cand-r", "cand", "shadow", "free", T, text=CAND_TEXT),  # same ids, other calls
    ]
    for r in runs:
        store.put_run(r).result()
    put_rows(store, "sec-f", S)
    put_rows(store, "cand-f", C)
    out = {(c["run_id"], c["ref_run_id"]): c for c in compare_turn(store, "T")}
    full = out[("cand-f", "sec-f")]
    assert full["kind"] == "full" and full["flips"] == [1, 2, 3, 4]
    assert full["flip_classes"] == ["tie", "near_tie", "noise", "runtime"], full["attribution"]
    assert full["summary"]["flips_by_class"] == {"tie": 1, "near_tie": 1, "noise": 1, "parser": 0, "runtime": 1}
    assert [f["flip_class"] for f in full["flip_tokens"]] == full["flip_classes"]
    assert full["attribution"]["noise_source"] == "secondary:sec"
    assert full["attribution"]["details"][1]["steps"] == 1 and full["attribution"]["details"][1]["ref_dtype"] == "bfloat16"
    floor = out[("sec-f", primary_run_id("T"))]
    assert floor["noise_floor"] and floor["flips"] == [3] and floor["flip_classes"] == ["noise"]
    vs_primary = out[("cand-f", primary_run_id("T"))]
    assert vs_primary["kind"] == "topk" and set(vs_primary["flip_classes"]) <= {"noise", "runtime", "tie", "near_tie"}
    assert vs_primary["flip_classes"][vs_primary["flips"].index(3)] == "noise"
    ex = vs_primary["excess"]
    assert ex["runtime_flips"] == vs_primary["flips_by_class"]["runtime"] and ex["noise_flips"] == 1
    assert ex["low"] < ex["excess"] < ex["high"] and ex["floor_backend"] == "sec"
    free = out[("cand-r", primary_run_id("T"))]
    assert free["diverged"] is False and free["verdict"] != "match"
    assert free["flip_class"] == "parser" and free["flips_by_class"]["parser"] == 1


def test_free_run_diverging_where_the_secondarys_free_run_diverges_is_noise(store):
    """Issue 27: a free run that diverges where the secondary's free run diverges is `noise`
    (docs/attribution.md), even where no forced run flips: the secondary's forced rows equal the
    primary's, its free run goes another way at position 4 (batching), and so does the
    candidate's; the candidate's other free run diverges at 2, where the secondary did not."""
    R = ref_logits()
    T = tokens_of(R)
    complete = {"expected": N, "present": N, "complete": True}
    off = lambda t, d: (t + d) % V  # noqa: E731
    runs = [
        run_record(primary_run_id("T"), "prim", "primary", "recorded", T, capture="topk",
                   top=topk(R), text=REF_TEXT, pieces=PIECES),
        run_record("sec-f", "sec", "secondary", "forced", T, top=topk(R), rows=complete),
        run_record("sec-r", "sec", "secondary", "free", T[:4] + [off(T[4], 1), 1], text=REF_TEXT),
        run_record("cand-f", "cand", "shadow", "forced", T, top=topk(R), rows=complete),
        run_record("cand-r", "cand", "shadow", "free", T[:4] + [off(T[4], 2), 2], text=REF_TEXT),
        run_record("early-f", "early", "shadow", "forced", T, top=topk(R), rows=complete),
        run_record("early-r", "early", "shadow", "free", T[:2] + [off(T[2], 3), 3, 3, 3], text=REF_TEXT),
    ]
    for r in runs:
        store.put_run(r).result()
    for rid in ("sec-f", "cand-f", "early-f"):
        put_rows(store, rid, R)
    out = {(c["run_id"], c["ref_run_id"]): c for c in compare_turn(store, "T")}
    prim = primary_run_id("T")
    # no forced run flips anywhere: the noise can only come from the secondary's free run
    assert all(out[(f, prim)]["flips"] == [] for f in ("sec-f", "cand-f", "early-f"))
    sec = out[("sec-r", prim)]
    assert sec["divergence"]["position"] == 4 and sec["flip_class"] == "noise"
    cand = out[("cand-r", prim)]
    assert cand["divergence"]["position"] == 4 and cand["diverged"] is True
    assert cand["flip_class"] == "noise" and cand["flips_by_class"]["noise"] == 1
    assert cand["flips_by_class"]["runtime"] == 0
    early = out[("early-r", prim)]
    assert early["divergence"]["position"] == 2
    assert early["flip_class"] == "runtime" and early["flips_by_class"]["runtime"] == 1


# -- from `make mutants` on shadow/compare.py ---------------------------------------------------

def test_a_compacted_or_pruned_turn_is_refused_with_its_reason(store, turn_runs):
    import orjson

    from tensorverse.shadow.compare import TurnCompacted, _refuse_compacted
    from tensorverse.store import schema

    _refuse_compacted(store, "T")  # not compacted: nothing
    _refuse_compacted(store, None)
    _refuse_compacted(object(), "T")  # a store without compaction (a replay's in-memory one)

    def mark(rec):
        store.submit(lambda txn: txn.put(b"T", orjson.dumps(rec), db=store._dbs[schema.COMPACTED])).result()

    mark({"turn_id": "T", "runs": {}})
    with pytest.raises(TurnCompacted) as e:
        compare_turn(store, "T")
    assert str(e.value) == ("turn T: its rows were compacted; its stored comparisons are the exact ones "
                            "(computed from the full rows) and are not recomputed")
    mark({"turn_id": "T", "runs": {}, "rows_pruned": 1})
    with pytest.raises(TurnCompacted, match="^turn T: its rows were pruned by \\[retention\\]; "):
        compare_turn(store, "T")


def test_load_rows_gives_one_float32_matrix_and_refuses_mixed_widths(store):
    from tensorverse.analysis.metrics import AnalysisInputError
    from tensorverse.shadow.compare import load_rows

    empty = load_rows(store, "none", [])
    assert empty.shape == (0, 0) and empty.dtype == np.float32
    x = ref_logits()
    put_rows(store, "a", x)
    got = load_rows(store, "a", [4, 1])
    assert got.dtype == np.float32 and got.shape == (2, V) and np.array_equal(got, x[[4, 1]])
    bits = (np.arange(V, dtype=np.uint16) * 7) & 0x7F7F  # bfloat16 rows come back widened
    store.write_rows("b", [(0, encode_row(bits, dtype="bfloat16"))]).result()
    assert np.array_equal(load_rows(store, "b", [0])[0], (bits.astype(np.uint32) << 16).view(np.float32))
    store.write_rows("c", [(0, encode_row(x[0])), (1, encode_row(x[1, :10]))]).result()
    with pytest.raises(AnalysisInputError, match=r"^run c: rows of different widths \[10, 50\]"):
        load_rows(store, "c", [0, 1])


def test_chunked_comparison_equals_the_one_chunk_comparison(store, turn_runs, monkeypatch):
    """Rows are compared CHUNK positions at a time: the columns, flips and classes of a turn
    compared 2 positions at a time are the one-chunk ones, position for position."""
    import tensorverse.shadow.compare as C

    whole = {(c["run_id"], c["ref_run_id"]): c for c in compare_turn(store, "T", store_results=False)}
    monkeypatch.setattr(C, "CHUNK", 2)
    parts = {(c["run_id"], c["ref_run_id"]): c for c in compare_turn(store, "T", store_results=False)}
    assert parts.keys() == whole.keys()
    for k, c in whole.items():
        assert parts[k] == c, k
    full = whole[("cand-f", "sec-f")]
    assert full["kind"] == "full" and len(full["metrics"]["kl"]) == N and full["flips"] == [3]
