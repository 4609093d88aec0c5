"""compare_turn on hand-built stored runs: full rows vs top-k, reference choice, noise floor,
free-run divergence and tool-call verdicts, incomplete rows, refused and failed runs."""

from __future__ import annotations

import numpy as np
import pytest

from tensorverse.shadow.compare import compare_runs, compare_turn, select_reference
from tensorverse.shadow.runs import primary_run_id
from tensorverse.store.codec import encode_row
from tensorverse.store.records import ForcedComparison, FreeComparison, Run
from tests.refusals import refused

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
        store.put_run(Run(**r)).result()
    put_rows(store, "sec-f", R)
    put_rows(store, "cand-f", C)
    return R, C, T


def test_a_turn_reads_a_forced_runs_rows_once_and_its_free_comparison_departs_where_the_rows_say(store, turn_runs,
                                                                                                  monkeypatch):
    from tensorverse.shadow.compare import compare_free

    R, C, T = turn_runs
    reads: list[str] = []
    read_row = store.read_row

    def counted(run_id, position):
        reads.append(run_id)
        return read_row(run_id, position)

    monkeypatch.setattr(store, "read_row", counted)
    out = compare_turn(store, "T", store_results=False)
    assert reads.count("cand-f") == N  # its forced comparison's pass only (a second pass stopped at 3)
    free = next(c for c in out if c.run_id == "cand-r")
    runs = {r.id: r for r in store.iter_runs("T")}
    alone = compare_free(runs["cand-r"], runs[primary_run_id("T")], forced=runs["cand-f"], store=store)
    assert (free.forced_departure, free.confirms_forced) == (alone.forced_departure, alone.confirms_forced) == (3, True)
    # the forced run's top-1 as its comparison read them is what decides...
    agree = {p: T[p] for p in range(N)}
    said = compare_free(runs["cand-r"], runs[primary_run_id("T")], forced=runs["cand-f"], store=store,
                        forced_top1=agree)
    assert (said.forced_departure, said.confirms_forced) == (None, False)
    # ...and a gap in them sends it back to the rows
    del agree[N - 1]
    reread = compare_free(runs["cand-r"], runs[primary_run_id("T")], forced=runs["cand-f"], store=store,
                          forced_top1=agree)
    assert reread.forced_departure == 3


def test_compare_turn_full_topk_free_and_noise(store, turn_runs):
    R, C, T = turn_runs
    out = compare_turn(store, "T")
    key = {(c.run_id, c.ref_run_id): c for c in out}
    prim = primary_run_id("T")
    assert set(key) == {("cand-f", "sec-f"), ("cand-f", prim), ("sec-f", prim), ("sec-r", prim),
                        ("cand-r", prim)}

    full = key[("cand-f", "sec-f")]
    assert full.kind == "full" and full.approximate is False and full.status == "ok"
    assert full.flips == [3] and full.first_flip == 3
    assert full.summary["flips"] == 1 and full.summary["n"] == N
    assert full.regions[3] == "tool_args"
    assert full.summary["flips_by_region"]["tool_args"] == 1
    assert full.metrics["kl"][3] > 0 and full.metrics["kl"][0] == pytest.approx(0, abs=1e-12)
    assert full.flip_tokens[0] == {"position": 3, "token": T[3], "ref_top1": T[3],
                                      "cand_top1": (T[3] + 1) % V, "region": "tool_args",
                                      "flip_class": "runtime"}
    assert full.incomplete is False and full.positions is None

    floor = key[("sec-f", prim)]
    assert floor.kind == "topk" and floor.approximate and floor.noise_floor is True
    assert floor.flips == []
    cand_vs_prim = key[("cand-f", prim)]
    assert cand_vs_prim.flips == [3] and cand_vs_prim.noise_floor is False
    assert cand_vs_prim.noise["candidate_flips"] == 1 and cand_vs_prim.noise["secondary_flips"] == 0
    assert cand_vs_prim.noise["floor_backend"] == "sec"

    free = key[("cand-r", prim)]
    assert free.mode == "free" and free.divergence["position"] == 3
    assert free.region == "tool_args"  # of the primary's output at the divergence, stored with it
    assert free.common_prefix == 3 and free.diverged is True
    assert free.verdict == "value_mismatch"
    assert free.tool_calls["differences"][0]["path"] == "$.arguments.vlan"
    assert free.forced_departure == 3 and free.confirms_forced is True
    same = key[("sec-r", prim)]
    assert same.verdict == "match" and same.diverged is False and same.confirms_forced is True
    assert same.noise_floor is True and same.region is None  # no divergence, no region

    # stored, keyed by (run, reference run)
    got = store.get_comparison("cand-f", "sec-f")
    assert got.flips == [3] and got.run_id == "cand-f" and got.ref_run_id == "sec-f"


def test_incomplete_rows_compare_the_common_positions(store, turn_runs):
    R, C, T = turn_runs
    partial = run_record("cand2-f", "cand2", "shadow", "forced", T, top=topk(C),
                         rows={"expected": N, "present": N - 1, "complete": False})
    store.put_run(Run(**partial)).result()
    put_rows(store, "cand2-f", C, skip=(4,))
    out = {(c.run_id, c.ref_run_id): c for c in compare_turn(store, "T", store_results=False)}
    c = out[("cand2-f", "sec-f")]
    assert c.incomplete is True and c.positions == [0, 1, 2, 3, 5] and c.n == 5
    assert c.flips == [3]


def test_reference_falls_back_to_reference_role_then_primary(store, turn_runs):
    runs = list(store.iter_runs("T"))
    forced = [r for r in runs if r.mode == "forced"]
    assert select_reference(forced).backend == "sec"
    assert select_reference(forced, roles={"sec": "shadow", "cand": "reference"}).backend == "cand"
    assert select_reference(forced, roles={"sec": "shadow"}) is None
    # no reference at all: candidates are compared with the primary's top-k only
    out = compare_runs(store, runs, roles={"sec": "shadow"}, store_results=False)
    refs = {c.ref_run_id for c in out}
    assert refs == {primary_run_id("T")}


def test_topk_comparison_when_one_side_has_no_rows(store, turn_runs):
    R, C, T = turn_runs
    store.put_run(Run(**run_record("tk-f", "tk", "shadow", "forced", T, capture="topk", top=topk(C)))).result()
    out = {(c.run_id, c.ref_run_id): c for c in compare_turn(store, "T", store_results=False)}
    c = out[("tk-f", "sec-f")]
    assert c.kind == "topk" and c.approximate is True and c.flips == [3]


def test_width_mismatch_is_an_error_result_not_an_exception(store, turn_runs):
    R, C, T = turn_runs
    store.put_run(Run(**run_record("w-f", "wide", "shadow", "forced", T, top=topk(C),
                                   rows={"expected": N, "present": N, "complete": True}))).result()
    put_rows(store, "w-f", np.pad(C, ((0, 0), (0, 3)), constant_values=-5.0))
    out = {(c.run_id, c.ref_run_id): c for c in compare_turn(store, "T", store_results=False)}
    c = out[("w-f", "sec-f")]
    assert c.status == "error" and "different vocabularies" in c.error


def test_no_primary_run_is_an_input_error(store):
    from tensorverse.analysis.metrics import AnalysisInputError

    store.put_run(Run(**run_record("x", "a", "shadow", "forced", [1]))).result()
    with pytest.raises(AnalysisInputError):
        compare_turn(store, "T")


def test_only_the_comparisons_of_the_given_backends(store, turn_runs):
    prim = primary_run_id("T")
    cand = {(c.run_id, c.ref_run_id) for c in compare_turn(store, "T", backends=["cand"],
                                                                  store_results=False)}
    assert cand == {("cand-f", "sec-f"), ("cand-f", prim), ("cand-r", prim)}
    # the secondary is the reference and the noise floor: its call redoes everything
    sec = {(c.run_id, c.ref_run_id) for c in compare_turn(store, "T", backends=["sec"],
                                                                 store_results=False)}
    assert ("cand-f", "sec-f") in sec and ("sec-f", prim) in sec and ("cand-r", prim) in sec
    with_noise = [c for c in compare_turn(store, "T", backends=["cand"], store_results=False)
                  if c.run_id == "cand-f" and c.ref_run_id == prim][0]
    assert with_noise.noise["floor_backend"] == "sec"


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
        store.put_run(Run(**r)).result()
    put_rows(store, "sec-f", S)
    put_rows(store, "cand-f", C)
    out = {(c.run_id, c.ref_run_id): c for c in compare_turn(store, "T")}
    full = out[("cand-f", "sec-f")]
    assert full.kind == "full" and full.flips == [1, 2, 3, 4]
    assert full.flip_classes == ["tie", "near_tie", "noise", "runtime"], full.attribution
    assert full.flips_by_class == {"tie": 1, "near_tie": 1, "noise": 1, "parser": 0, "runtime": 1}
    assert [f["flip_class"] for f in full.flip_tokens] == full.flip_classes
    assert full.attribution["noise_source"] == "secondary:sec"
    assert full.attribution["details"][1]["steps"] == 1 and full.attribution["details"][1]["ref_dtype"] == "bfloat16"
    floor = out[("sec-f", primary_run_id("T"))]
    assert floor.noise_floor and floor.flips == [3] and floor.flip_classes == ["noise"]
    vs_primary = out[("cand-f", primary_run_id("T"))]
    assert vs_primary.kind == "topk" and set(vs_primary.flip_classes) <= {"noise", "runtime", "tie", "near_tie"}
    assert vs_primary.flip_classes[vs_primary.flips.index(3)] == "noise"
    ex = vs_primary.excess
    assert ex["runtime_flips"] == vs_primary.flips_by_class["runtime"] and ex["noise_flips"] == 1
    assert ex["low"] < ex["excess"] < ex["high"] and ex["floor_backend"] == "sec"
    free = out[("cand-r", primary_run_id("T"))]
    assert free.diverged is False and free.verdict != "match"
    assert free.flip_class == "parser" and free.flips_by_class["parser"] == 1


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
        store.put_run(Run(**r)).result()
    for rid in ("sec-f", "cand-f", "early-f"):
        put_rows(store, rid, R)
    out = {(c.run_id, c.ref_run_id): c for c in compare_turn(store, "T")}
    prim = primary_run_id("T")
    # no forced run flips anywhere: the noise can only come from the secondary's free run
    assert all(out[(f, prim)].flips == [] for f in ("sec-f", "cand-f", "early-f"))
    sec = out[("sec-r", prim)]
    assert sec.divergence["position"] == 4 and sec.flip_class == "noise"
    cand = out[("cand-r", prim)]
    assert cand.divergence["position"] == 4 and cand.diverged is True
    assert cand.flip_class == "noise" and cand.flips_by_class["noise"] == 1
    assert cand.flips_by_class["runtime"] == 0
    early = out[("early-r", prim)]
    assert early.divergence["position"] == 2
    assert early.flip_class == "runtime" and early.flips_by_class["runtime"] == 1


# -- compacted and pruned turns, the rows loaded, the comparison in chunks -------------------------

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
    with refused(TurnCompacted, "compacted", "turn T"):
        compare_turn(store, "T")
    mark({"turn_id": "T", "runs": {}, "rows_pruned": 1})
    with refused(TurnCompacted, "compacted"):
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
    with refused(AnalysisInputError, "shape"):
        load_rows(store, "c", [0, 1])


def test_chunked_comparison_equals_the_one_chunk_comparison(store, turn_runs, monkeypatch):
    """Rows are compared CHUNK positions at a time: the columns, flips and classes of a turn
    compared 2 positions at a time are the one-chunk ones, position for position."""
    import tensorverse.shadow.compare as C

    whole = {(c.run_id, c.ref_run_id): c for c in compare_turn(store, "T", store_results=False)}
    monkeypatch.setattr(C, "CHUNK", 2)
    parts = {(c.run_id, c.ref_run_id): c for c in compare_turn(store, "T", store_results=False)}
    assert parts.keys() == whole.keys()
    for k, c in whole.items():
        assert parts[k] == c, k
    full = whole[("cand-f", "sec-f")]
    assert full.kind == "full" and len(full.metrics["kl"]) == N and full.flips == [3]


# -- every field of the forced and free results, the refusals, the reference, the noise floor ------

COMPLETE = {"expected": N, "present": N, "complete": True}
RULE = {"ulps": 1, "nats": 0.0}  # DEFAULT_RULE.as_dict()


def _flipped(R: np.ndarray, at: tuple[int, ...]) -> tuple[np.ndarray, list[int]]:
    """R with another top-1 (the next token id) at the positions ``at``."""
    T = tokens_of(R)
    C = R.copy()
    for p in at:
        C[p, (T[p] + 1) % V] = R[p].max() + 1.0
    return C, [(t + 1) % V for t in T]


def _template(status):
    return {"status": status}


def test_forced_result_fields_roles_templates_and_no_pieces(store):
    """compare_forced called alone: no pieces (no regions anywhere), no noise run (no `noise`
    class, noise_source None), roles from the mapping before the records, the template mismatch
    of either side."""
    from tensorverse.shadow.compare import compare_forced

    R = ref_logits()
    T = tokens_of(R)
    C, alt = _flipped(R, (1, 4))
    ref = run_record("r-f", "r", "reference", "forced", T, top=topk(R), rows=COMPLETE)
    cand = run_record("c-f", "c", "shadow", "forced", T, top=topk(C), rows=COMPLETE,
                      template=_template("template_mismatch"))
    put_rows(store, "r-f", R)
    put_rows(store, "c-f", C)
    res = compare_forced(store, cand, ref, T, roles={"c": "canary", "r": "secondary"})
    assert type(res) is ForcedComparison and res.mode == "forced" and res.kind == "full" and res.status == "ok"
    assert (res.run_id, res.ref_run_id, res.turn_id, res.backend, res.ref_backend) == ("c-f", "r-f", "T", "c", "r")
    assert (res.role, res.ref_role, res.noise_floor) == ("canary", "secondary", False)
    assert res.template_mismatch is True
    assert res.flips == [1, 4] and res.flip_classes == ["runtime", "runtime"]
    assert res.regions is None and "flips_by_region" not in res.summary
    assert "flips_by_region_class" not in res.summary
    assert res.flip_tokens == [
        {"position": p, "token": T[p], "ref_top1": T[p], "cand_top1": alt[p], "region": None,
         "flip_class": "runtime"} for p in (1, 4)]
    assert res.attribution["rule"] == RULE and res.attribution["noise_source"] is None
    assert [d["position"] for d in res.attribution["details"]] == [1, 4]
    assert set(res.metrics) == {"top1_agree", "kl", "delta_p", "margin", "rank", "entropy",
                                   "ref_top1", "cand_top1"}
    assert res.metrics["ref_top1"] == T and res.metrics["cand_top1"] == [
        alt[p] if p in (1, 4) else T[p] for p in range(N)]
    assert res.metrics["top1_agree"] == [p not in (1, 4) for p in range(N)]
    assert res.metrics["rank"] == [1 if p in (1, 4) else 0 for p in range(N)]

    # no roles: the records' roles; the reference's template mismatch counts as well
    cand["template"] = _template("ok")
    ref["template"] = _template("template_mismatch")
    res = compare_forced(store, cand, ref, T)
    assert (res.role, res.ref_role, res.template_mismatch) == ("shadow", "reference", True)
    res = compare_forced(store, cand, ref, T, roles={"c": "secondary"})
    assert (res.role, res.ref_role) == ("secondary", "reference")
    ref["template"] = None
    assert compare_forced(store, cand, ref, T).template_mismatch is False


def test_forced_rule_regions_by_class_and_first_flip_of_incomplete_rows(store):
    """The tie rule passed reaches both paths and the attribution; flips counted per region and
    class; with a row missing, summary.first_flip is the output position, not the row index."""
    from tensorverse.analysis.attribution import TieRule
    from tensorverse.shadow.compare import compare_forced

    R = ref_logits()
    T = tokens_of(R)
    C, alt = _flipped(R, (2, 3))  # both in tool_args
    loose = TieRule(ulps=0, nats=100.0)  # every flip with both logits known is a near tie
    ref = run_record("r-f", "r", "reference", "forced", T, top=topk(R, V))  # rows: not listed
    cand = run_record("c-f", "c", "shadow", "forced", T, top=topk(C, V),
                      rows={"expected": N, "present": N - 1, "complete": False})
    put_rows(store, "r-f", R)
    put_rows(store, "c-f", C, skip=(1,))
    res = compare_forced(store, cand, ref, T, pieces=PIECES, rule=loose)
    assert res.kind == "full" and res.positions == [0, 2, 3, 4, 5] and res.n == 5
    assert res.flips == [2, 3] and res.first_flip == 2 and res.summary["first_flip"] == 2
    assert res.flip_classes == ["near_tie", "near_tie"]
    assert res.attribution["rule"] == {"ulps": 0, "nats": 100.0}
    assert res.summary["flips_by_region_class"] == {"tool_args": {"near_tie": 2}}
    assert res.regions == ["tool_syntax", "tool_args", "tool_args", "tool_syntax", "tool_syntax"]
    assert [f["region"] for f in res.flip_tokens] == ["tool_args", "tool_args"]
    assert compare_forced(store, cand, ref, T, pieces=PIECES).flip_classes == ["runtime", "runtime"]
    assert compare_forced(store, cand, ref, T, pieces=PIECES[:3]).regions is None  # not one per position

    # top-k on both sides (the reference's whole distribution: both logprobs known at a flip)
    ref["capture"] = cand["capture"] = "topk"
    res = compare_forced(store, cand, ref, T, pieces=PIECES, rule=loose)
    assert res.kind == "topk" and res.incomplete is False and res.positions is None
    assert res.flips == [2, 3] and res.flip_classes == ["near_tie", "near_tie"]
    assert res.attribution["rule"] == {"ulps": 0, "nats": 100.0}
    assert [d["steps"] is not None for d in res.attribution["details"]] == [True, True]
    assert res.summary["flips_by_region_class"] == {"tool_args": {"near_tie": 2}}
    assert compare_forced(store, cand, ref, T, pieces=PIECES).flip_classes == ["runtime", "runtime"]


def _entry(first: int, rest: list[int]) -> list[list[float]]:
    """A top-k entry: ``first`` best, then ``rest`` in order (logprobs -0.1, -2, -3, ...)."""
    return [[first, -0.1]] + [[t, -2.0 - i] for i, t in enumerate(rest)]


def test_topk_k_is_the_smaller_one_and_bounds_the_ranks(store):
    """Top-k metrics get k = the smaller of both runs' k (None when neither has one): a token
    ranked k or lower, or missing, is a rank lower bound; a missing one's rank is k, or the
    entry's size without k."""
    from tensorverse.shadow.compare import compare_forced

    T = [10, 11, 12]
    ref_top = [_entry(10, [1, 2, 3, 4]), _entry(11, [1, 2, 3, 4]), _entry(12, [1, 2, 3, 4])]
    cand_top = [_entry(10, [1, 2, 3, 4]),
                _entry(20, [21, 22, 11, 23]),  # the token 4th: rank 3
                _entry(30, [31, 32, 33, 34])]  # the token missing
    ref = run_record("r-f", "r", "reference", "forced", T, capture="topk", top=ref_top)
    cand = run_record("c-f", "c", "shadow", "forced", T, capture="topk", top=cand_top)
    for ck, rk, rank, lower in ((3, 5, [0, 3, 3], [False, True, True]),
                                (5, 3, [0, 3, 3], [False, True, True]),
                                (5, None, [0, 3, 5], [False, False, True]),
                                (None, None, [0, 3, 5], [False, False, True])):
        cand["k"], ref["k"] = ck, rk
        m = compare_forced(store, cand, ref, T).metrics
        assert (m["rank"], m["rank_lower_bound"]) == (rank, lower), (ck, rk)
    assert set(m) == {"top1_agree", "kl", "delta_p", "margin", "rank", "entropy", "ref_top1",
                      "cand_top1", "rank_lower_bound"}


def test_forced_refusals_and_their_messages(store):
    import orjson

    from tensorverse.analysis.metrics import AnalysisInputError
    from tensorverse.shadow.compare import TurnCompacted, compare_forced
    from tensorverse.store import schema

    R = ref_logits()
    T = tokens_of(R)
    ref = run_record("r-f", "r", "reference", "forced", T, capture="none")
    cand = run_record("c-f", "c", "shadow", "forced", T, capture="topk", top=topk(R))
    with refused(AnalysisInputError, "missing", "c (topk)", "r (none)"):  # names both sides
        compare_forced(store, cand, ref, T)
    with refused(AnalysisInputError, "missing"):
        compare_forced(store, ref, cand, T)
    ref["capture"], cand["capture"] = "full", "full"
    with refused(AnalysisInputError, "missing"):  # no row stored on either side
        compare_forced(store, cand, ref, T)
    put_rows(store, "r-f", R)
    put_rows(store, "c-f", R)
    store.submit(lambda txn: txn.put(b"T", orjson.dumps({"turn_id": "T", "runs": {}}),
                                     db=store._dbs[schema.COMPACTED])).result()
    with refused(TurnCompacted, "compacted"):
        compare_forced(store, cand, ref, T)


def test_at_most_256_flip_details_and_flip_tokens(store):
    from tensorverse.shadow.compare import compare_forced

    n = 260
    R = np.tile(np.arange(8, dtype=np.float32), (n, 1))  # top-1 7 everywhere
    C = R[:, ::-1].copy()  # top-1 0 everywhere
    ref = run_record("r-f", "r", "reference", "forced", [7] * n, rows={"expected": n, "present": n,
                                                                    "complete": True})
    cand = run_record("c-f", "c", "shadow", "forced", [7] * n, rows=ref["rows"])
    put_rows(store, "r-f", R)
    put_rows(store, "c-f", C)
    res = compare_forced(store, cand, ref, [7] * n)
    assert res.flips == list(range(n))
    assert len(res.attribution["details"]) == 256 and len(res.flip_tokens) == 256
    assert res.flip_tokens[-1]["position"] == 255


def test_forced_departure_rows_then_top_logprobs(store):
    from tensorverse.shadow.compare import _forced_departure
    from tensorverse.store.records import run

    R = ref_logits()
    T = tokens_of(R)
    C0, _ = _flipped(R, (0,))
    C4, _ = _flipped(R, (4,))
    put_rows(store, "f0", C0)
    put_rows(store, "f4", C4, skip=(2,))

    def forced(rid, capture="full", top=None, status="ok"):
        return run(run_record(rid, "b", "shadow", "forced", T, capture=capture, top=top, status=status))

    assert _forced_departure(None, T, store) is None
    assert _forced_departure(forced("f0", status="failed", top=topk(C0)), T, store) is None
    assert _forced_departure(forced("f0", top=topk(R)), T, store) == 0  # rows first
    assert _forced_departure(forced("f0", top=topk(R)), T, None) is None  # no store: top-k
    assert _forced_departure(forced("f0", capture="topk", top=topk(R)), T, store) is None
    assert _forced_departure(forced("f0", capture="topk", top=topk(C4)), T, store) == 4
    # a missing row: the top-k decides
    assert _forced_departure(forced("f4", top=topk(C0)), T, store) == 0
    assert _forced_departure(forced("f4", top=None), T, store) is None
    assert _forced_departure(forced("none", capture="topk", top=topk(C4)[:N]), T, None) == 4
    assert _forced_departure(forced("none", capture="topk", top=topk(C4)[:N - 1]), T, None) is None
    empty = topk(C4)
    empty[2] = []
    assert _forced_departure(forced("none", capture="topk", top=empty), T, None) is None
    assert _forced_departure(forced("none", capture="topk", top=None), T, None) is None


def test_row_positions_trusts_a_complete_rows_record():
    from tensorverse.shadow.compare import _row_positions
    from tensorverse.store.records import run

    class Rows:
        def __init__(self, have):
            self.have, self.reads = set(have), 0

        def read_row(self, run_id, p):
            self.reads += 1
            if p not in self.have:
                raise KeyError(p)
            return b""

    def r(rows):
        return run(run_record("x", "b", "shadow", "forced", [1] * N, rows=rows))

    s = Rows({0, 2})
    assert _row_positions(s, r(COMPLETE), N) == list(range(N)) and s.reads == 0
    assert _row_positions(s, r({**COMPLETE, "expected": N - 1}), N) == [0, 2] and s.reads == N
    assert _row_positions(s, r({**COMPLETE, "complete": False}), N) == [0, 2]
    assert _row_positions(s, r(None), N) == [0, 2]


def test_select_reference_prefers_full_rows_then_the_backend_name():
    from tensorverse.shadow.compare import _has_topk, latest_runs
    from tensorverse.store.records import run

    def f(backend, capture, role="secondary"):
        return run_record(backend + "-f", backend, role, "forced", [1], capture=capture)

    forced = [f("a", "topk"), f("c", "full"), f("b", "full"), f("d", "full", role="reference")]
    assert select_reference(forced).backend == "b"
    assert select_reference([f("a", "topk"), f("c", "topk")]).backend == "a"
    assert select_reference([f("d", "full", role="reference"), f("e", "topk", "reference")]).backend == "d"

    runs = [run_record("new", "b", "shadow", "forced", [1], created_ns=5),
            run_record("old", "b", "shadow", "forced", [1], created_ns=3),
            run_record("same", "b", "shadow", "free", [1], created_ns=4),
            run_record("same2", "b", "shadow", "free", [1], created_ns=4)]
    got = latest_runs(runs)
    assert {k: v.id for k, v in got.items()} == {("b", "forced"): "new", ("b", "free"): "same2"}

    assert _has_topk(None, 1) is False
    assert _has_topk(run(f("a", "topk") | {"top_logprobs": [[[1, -0.1]]]}), 2) is False
    assert _has_topk(run(f("a", "topk") | {"top_logprobs": [[[1, -0.1]], []]}), 2) is False
    assert _has_topk(run(f("a", "topk") | {"top_logprobs": [[[1, -0.1]], [[2, -0.1]]]}), 2) is True


def _free_pair(T, cand_tokens, *, top=None, **prim):
    prim = run_record(primary_run_id("T"), "prim", "primary", "recorded", T, capture="topk", top=top,
                      text=REF_TEXT, **prim)
    cand = run_record("c-r", "c", "shadow", "free", cand_tokens, text=REF_TEXT)
    return cand, prim


def test_free_result_fields_and_the_tie_at_the_divergence_point():
    """The primary's top-k at the divergence point gives both logits: equal ones are a tie; the
    rule passed decides near ties; every constant field of a free comparison."""
    from tensorverse.analysis.attribution import TieRule
    from tensorverse.shadow.compare import compare_free

    T = [10, 11, 12, 13, 14, 15]
    top = [_entry(t, [1, 2, 3]) for t in T]
    top[3] = [[13, -0.5], [40, -0.5], [41, -3.0]]  # 13 and 40 tie at 3
    cand, prim = _free_pair(T, T[:3] + [40, 41, 42], top=top, finish_reason="tool_calls")
    cand["template"] = _template("template_mismatch")
    cand["finish_reason"] = "length"
    res = compare_free(cand, prim)
    assert type(res) is FreeComparison
    assert (res.run_id, res.ref_run_id, res.turn_id) == ("c-r", primary_run_id("T"), "T")
    assert (res.finish_reason, res.ref_finish_reason) == ("length", "tool_calls")
    assert {k: getattr(res, k) for k in ("mode", "kind", "backend", "ref_backend", "role", "ref_role",
                                "noise_floor", "approximate", "status", "template_mismatch")} == {
        "mode": "free", "kind": "tokens", "backend": "c", "ref_backend": "prim", "role": "shadow",
        "ref_role": "primary", "noise_floor": False, "approximate": False, "status": "ok",
        "template_mismatch": True}
    assert res.first_flip == 3 and res.flip_class == "tie"
    assert res.attribution == {"rule": RULE, "flip": {
        "position": 3, "flip_class": "tie", "mode": "free", "ref_token": 13, "cand_token": 40,
        "margin": 0.0, "steps": 0, "ref_dtype": "float32"}}
    assert res.forced_departure is None and res.confirms_forced is None
    top[3] = [[13, -0.5], [40, -0.75], [41, -3.0]]
    assert compare_free(cand, prim).flip_class == "runtime"
    res = compare_free(cand, prim, rule=TieRule(ulps=0, nats=0.5), roles={"c": "canary"})
    assert res.flip_class == "near_tie" and res.attribution["rule"] == {"ulps": 0, "nats": 0.5}
    assert res.attribution["flip"]["margin"] == 0.25 and res.role == "canary"
    assert compare_free(cand, prim, roles={"c": "secondary"}).noise_floor is True
    cand["template"] = None
    assert compare_free(cand, prim).template_mismatch is False


def test_free_flips_without_usable_logits_of_the_primary():
    """A length divergence, a top-k entry that cannot be read, top-k shorter than the divergence
    point or none at all: no margin, so the class comes from noise, the parser check, or runtime."""
    from tensorverse.shadow.compare import compare_free

    T = [10, 11, 12, 13, 14, 15]
    top = [_entry(t, [1, 2, 3]) for t in T]
    longer, _ = _free_pair(T, T + [7], top=top)
    shorter, prim = _free_pair(T, T[:4], top=top)
    for cand in (longer, shorter):
        res = compare_free(cand, prim)
        assert res.divergence["kind"] == "length" and res.flip_class == "runtime", cand
    assert compare_free(longer, prim).first_flip == N and compare_free(shorter, prim).first_flip == 4
    assert compare_free(shorter, prim, noise_positions={4}).flip_class == "noise"
    diverged = run_record("c-r", "c", "shadow", "free", T[:3] + [40, 41, 42], text=REF_TEXT)
    top[3] = "not an entry"
    assert compare_free(diverged, prim).flip_class == "runtime"
    for tops in (top[:3], None):
        _, p = _free_pair(T, T, top=tops)
        res = compare_free(diverged, p)
        assert res.flip_class == "runtime" and res.attribution["flip"]["margin"] is None
    # the primary's parser check found a mismatch: a flip without a margin is a parser flip
    _, p = _free_pair(T, T, top=None, parser_check={"mismatch": True})
    assert compare_free(diverged, p).flip_class == "parser"
    assert compare_free(diverged, p, noise_positions={3}).flip_class == "noise"
    _, p = _free_pair(T, T, top=None, parser_check={"mismatch": False})
    assert compare_free(diverged, p).flip_class == "runtime"


def test_free_tool_calls_of_the_primary_come_from_its_openai_tool_calls():
    from tensorverse.shadow.compare import compare_free

    T = [10, 11, 12]
    prim = run_record(primary_run_id("T"), "prim", "primary", "recorded", T, capture="topk",
                      tool_calls=[{"id": "1", "type": "function", "function": {
                          "name": "show_vlan", "arguments": '{"vlan": 201}'}}])
    cand = run_record("c-r", "c", "shadow", "free", T, text=REF_TEXT)
    res = compare_free(cand, prim)
    assert res.ref_tool_calls == 1 and res.cand_tool_calls == 1 and res.verdict == "match"
    assert res.flip_class is None and res.attribution["flip"] is None
    assert res.flips_by_class == {"tie": 0, "near_tie": 0, "noise": 0, "parser": 0, "runtime": 0}
    cand["text"] = CAND_TEXT
    assert compare_free(cand, prim).verdict == "value_mismatch"


def test_the_region_of_a_free_divergence_comes_from_the_pieces_given_else_the_primarys():
    from tensorverse.shadow.compare import compare_free

    T = [10, 11, 12, 13, 14, 15]
    cand, prim = _free_pair(T, T[:3] + [40, 41, 42], pieces=PIECES)
    assert compare_free(cand, prim).region == "tool_args"  # PIECES[3] is the vlan's value
    assert compare_free(cand, prim, pieces=["word"] * 6).region == "content"  # the pieces given win
    cand, prim = _free_pair(T, T[:3] + [40, 41, 42])  # a primary without pieces
    assert compare_free(cand, prim).region is None
    assert compare_free(cand, prim, pieces=PIECES).region == "tool_args"
    same, prim = _free_pair(T, list(T), pieces=PIECES)
    assert compare_free(same, prim).region is None  # no divergence


def test_compare_runs_gives_its_pieces_to_the_free_comparisons(store, turn_runs):
    prim = primary_run_id("T")
    runs = list(store.iter_runs("T"))
    assert _keyed(compare_runs(store, runs, store_results=False))[("cand-r", prim)].region == "tool_args"
    out = _keyed(compare_runs(store, runs, pieces=["word"] * N, store_results=False))
    assert out[("cand-r", prim)].region == "content"


def test_free_departure_from_forced_rows_reduced_at_the_source(store):
    """The forced run's rows as the plugin sends them with evidence at the source: compact up to
    the flip (their top-1 is read from the compact form), the flip itself in full."""
    from tensorverse.shadow.compare import compare_free

    R = ref_logits()
    T = tokens_of(R)
    C, alt = _flipped(R, (3,))
    assert _put_rows_reduced_at_source(store, "c-f", C, T, close=0.0) == 1  # the flip only
    assert store.read_compact_row("c-f", 0) is not None
    forced = run_record("c-f", "c", "shadow", "forced", T, top=topk(R), rows=COMPLETE)
    cand, prim = _free_pair(T, T[:3] + [alt[3], 1, 1], top=topk(R))
    res = compare_free(cand, prim, forced=forced, store=store)
    assert res.forced_departure == 3 and res.confirms_forced is True


def test_free_departure_reads_the_forced_rows_from_the_store(store):
    from tensorverse.shadow.compare import compare_free

    R = ref_logits()
    T = tokens_of(R)
    C, alt = _flipped(R, (3,))
    put_rows(store, "c-f", C)
    forced = run_record("c-f", "c", "shadow", "forced", T, top=topk(R), rows=COMPLETE)  # top-k: no flip
    cand, prim = _free_pair(T, T[:3] + [alt[3], 1, 1], top=topk(R))
    res = compare_free(cand, prim, forced=forced, store=store)
    assert res.forced_departure == 3 and res.confirms_forced is True
    res = compare_free(cand, prim, forced={**forced, "status": "failed"}, store=store)
    assert res.forced_departure is None and res.confirms_forced is None
    res = compare_free(cand, prim, forced=forced)  # no store: the forced run's top-k
    assert res.forced_departure is None and res.confirms_forced is False


def _keyed(out):
    return {(c.run_id, c.ref_run_id): c for c in out}


def test_compare_runs_error_results_skipped_runs_roles_and_noise(store, turn_runs):
    """The fixture's turn with more runs: a forced run with rows of two widths (an error result
    in forced and in free mode), one without tokens, one without top-k, one whose top-k cannot be
    read, one sorted after the secondary, one whose rows and top-k disagree, free runs without a
    forced run or with a failed one, a failed free run sorted first; roles passed through."""
    R, C, T = turn_runs
    prim = primary_run_id("T")
    C3, alt = _flipped(R, (3,))
    bad_top = topk(C)
    bad_top[0] = "garbage"
    free_tokens = T[:3] + [alt[3], 4, 5]
    extra = [
        run_record("mix-f", "mix", "shadow", "forced", T, top=topk(C), rows=COMPLETE),
        run_record("mix-r", "mix", "shadow", "free", free_tokens, text=REF_TEXT),
        run_record("empty-f", "empty", "shadow", "forced", [], rows=COMPLETE, top=topk(C)),
        run_record("notk-f", "notk", "shadow", "forced", T, rows=COMPLETE),
        run_record("bad-f", "bad", "shadow", "forced", T, rows=COMPLETE, top=bad_top),
        run_record("zed-f", "zed", "shadow", "forced", T, rows=COMPLETE, top=topk(C)),
        run_record("rows-f", "rows", "shadow", "forced", T, rows=COMPLETE, top=topk(R)),
        run_record("rows-r", "rows", "shadow", "free", free_tokens, text=REF_TEXT),
        run_record("solo-r", "solo", "shadow", "free", free_tokens, text=REF_TEXT),
        run_record("down-r", "down", "shadow", "free", free_tokens, text=REF_TEXT),
        run_record("aaa-r", "aaa", "shadow", "free", [], status="failed", error="connect"),
    ]
    for r in extra:
        store.put_run(Run(**r)).result()
    store.write_rows("mix-f", [(0, encode_row(C[0])), (1, encode_row(C[1, :10]))]
                     + [(p, encode_row(C[p])) for p in range(2, N)]).result()
    for rid in ("empty-f", "notk-f", "bad-f", "zed-f"):
        put_rows(store, rid, C)
    put_rows(store, "rows-f", C3)
    out = _keyed(compare_turn(store, "T", roles={"cand": "canary"}, store_results=False))
    assert set(out) == {
        ("cand-f", "sec-f"), ("cand-f", prim), ("sec-f", prim), ("sec-r", prim), ("cand-r", prim),
        ("mix-f", "sec-f"), ("mix-f", prim), ("mix-r", prim), ("notk-f", "sec-f"),
        ("bad-f", "sec-f"), ("bad-f", prim), ("zed-f", "sec-f"), ("zed-f", prim),
        ("rows-f", "sec-f"), ("rows-f", prim), ("rows-r", prim), ("solo-r", prim), ("down-r", prim)}
    widths = "AnalysisInputError: run mix-f: rows of different widths [10, 50]"
    assert out[("mix-f", "sec-f")] == ForcedComparison(turn_id="T", backend="mix", ref_backend="sec",
                                                       status="error", error=widths, run_id="mix-f",
                                                       ref_run_id="sec-f")
    assert out[("mix-r", prim)] == FreeComparison(turn_id="T", backend="mix", ref_backend="prim", status="error",
                                                  error=widths, run_id="mix-r", ref_run_id=prim)
    assert out[("bad-f", prim)] == ForcedComparison(turn_id="T", backend="bad", ref_backend="prim", status="error",
                                                    error="AnalysisInputError: top-k logprobs: cannot read entry "
                                                          "of type str",
                                                    run_id="bad-f", ref_run_id=prim)
    assert out[("bad-f", "sec-f")].status == "ok"
    floor = out[("sec-f", prim)]
    assert floor.noise_floor is True and floor.noise is None and floor.excess is None
    assert floor.attribution["noise_source"] == "secondary:sec" and floor.regions == [
        "tool_syntax", "tool_name", "tool_args", "tool_args", "tool_syntax", "tool_syntax"]
    for ref in ("sec-f", prim):
        c = out[("cand-f", ref)]
        assert c.role == "canary" and c.attribution["noise_source"] == "secondary:sec"
        assert c.regions == floor.regions, ref
    assert out[("cand-r", prim)].role == "canary"
    for b in ("zed", "cand"):
        assert out[(b + "-f", prim)].noise["floor_backend"] == "sec"
        assert out[(b + "-f", prim)].excess["floor_backend"] == "sec"
    rows = out[("rows-r", prim)]
    assert rows.forced_departure == 3 and rows.confirms_forced is True
    for b in ("solo", "down"):  # no forced run; a failed one
        r = out[(b + "-r", prim)]
        assert r.forced_departure is None and r.confirms_forced is None and r.first_flip == 3

    # a backend that is no pivot: its failed comparison with the primary is still returned
    only_bad = _keyed(compare_runs(store, list(store.iter_runs("T")), backends=["bad"], store_results=False))
    assert set(only_bad) == {("bad-f", "sec-f"), ("bad-f", prim)}
    assert only_bad[("bad-f", prim)].status == "error"


def test_noise_and_excess_errors_are_kept_in_the_result(store, turn_runs, monkeypatch):
    import tensorverse.shadow.compare as C
    from tensorverse.analysis.metrics import AnalysisInputError

    def boom(*a, **k):
        raise AnalysisInputError("boom", "value")

    monkeypatch.setattr(C, "compare_flip_rates", boom)
    monkeypatch.setattr(C, "excess_flip_rate", boom)
    c = _keyed(compare_turn(store, "T", store_results=False))[("cand-f", primary_run_id("T"))]
    assert c.noise == {"error": "boom"} and c.excess == {"error": "boom"}


def test_the_noise_floor_follows_the_roles_given(store, turn_runs):
    """roles make `sec` the secondary although its record says shadow, and the primary is the
    primary whatever its record says: its comparison is the noise floor."""
    prim = primary_run_id("T")
    runs = list(store.iter_runs("T"))
    for r in runs:
        if r.id == "sec-f":
            r.role = "shadow"
        if r.id == prim:
            r.role = None
    out = _keyed(compare_runs(store, runs, roles={"sec": "secondary"}, store_results=False))
    floor = out[("sec-f", prim)]
    assert (floor.role, floor.ref_role, floor.noise_floor) == ("secondary", "primary", True)
    assert out[("cand-f", prim)].noise["floor_backend"] == "sec"
    assert out[("cand-f", "sec-f")].attribution["noise_source"] == "secondary:sec"


def test_no_noise_run_without_a_secondary_of_the_turns_length(store, turn_runs):
    prim = primary_run_id("T")
    runs = list(store.iter_runs("T"))
    for r in runs:
        if r.id == "sec-f":
            r.token_ids = r.token_ids[:3]
    out = _keyed(compare_runs(store, runs, store_results=False))
    assert ("sec-f", prim) not in out and out[("cand-f", prim)].noise is None
    assert out[("cand-f", "sec-f")].attribution["noise_source"] is None
    assert out[("cand-f", prim)].attribution["noise_source"] is None


def test_no_comparison_with_a_primary_without_top_k_or_tokens(store, turn_runs):
    from tensorverse.store import RecordNotFound

    prim = primary_run_id("T")
    runs = list(store.iter_runs("T"))
    for r in runs:
        if r.id == prim:
            r.top_logprobs = None
    assert set(_keyed(compare_runs(store, runs, store_results=False))) == {
        ("cand-f", "sec-f"), ("sec-r", prim), ("cand-r", prim)}
    for r in runs:
        if r.id == prim:
            r.top_logprobs, r.token_ids = [], []
    out = _keyed(compare_runs(store, runs, store_results=False))
    assert set(out) == {("cand-f", "sec-f"), ("sec-r", prim), ("cand-r", prim)}
    assert out[("cand-f", "sec-f")].error == ("AnalysisInputError: no position has a captured "
                                                 "row on both sides")
    # stored by default, not when told
    with pytest.raises(RecordNotFound):
        store.get_comparison("cand-r", prim)
    compare_turn(store, "T", store_results=False)
    with pytest.raises(RecordNotFound):
        store.get_comparison("cand-r", prim)
    compare_runs(store, list(store.iter_runs("T")))
    assert store.get_comparison("cand-r", prim).verdict == "value_mismatch"


def test_a_turn_without_a_recorded_primary_run_is_refused(store):
    from tensorverse.analysis.metrics import AnalysisInputError

    with refused(AnalysisInputError, "missing"):
        compare_runs(store, [run_record("x", "a", "shadow", "forced", [1])])


def test_a_primary_with_full_rows_is_compared_on_its_rows(store, turn_runs):
    """A recorded primary whose rows are in the store (capture full): the comparisons with it
    read them; without its top-k there are none, and no noise run either."""
    R, C, T = turn_runs
    prim = primary_run_id("T")
    put_rows(store, prim, R)
    runs = list(store.iter_runs("T"))
    for r in runs:
        if r.id == prim:
            r.capture, r.rows = "full", COMPLETE
    out = _keyed(compare_runs(store, runs, store_results=False))
    assert out[("sec-f", prim)].kind == "full" and out[("cand-f", prim)].kind == "full"
    assert out[("cand-f", prim)].flips == [3] and out[("sec-f", prim)].flips == []
    for r in runs:
        if r.id == prim:
            r.top_logprobs = None
    out = _keyed(compare_runs(store, runs, store_results=False))
    assert set(out) == {("cand-f", "sec-f"), ("sec-r", prim), ("cand-r", prim)}
    assert out[("cand-f", "sec-f")].attribution["noise_source"] is None


def test_forced_departure_a_chunk_with_a_missing_row_falls_back_to_top_k(store):
    """Rows are read CHUNK positions at a time: a missing row anywhere in a chunk sends the search
    to the top-k, even where an earlier row of that chunk departs."""
    from tensorverse.shadow.compare import CHUNK, _forced_departure
    from tensorverse.store.records import run

    n = 2 * CHUNK + 2
    R = np.tile(np.arange(8, dtype=np.float32), (n, 1))  # top-1 7 everywhere
    R[CHUNK + 1] = R[CHUNK + 1, ::-1]  # the rows depart at CHUNK + 1 ...
    tokens = [7] * n
    top = [[[7, -0.1], [0, -3.0]]] * n
    store.write_rows("f", [(p, encode_row(R[p])) for p in range(n) if p != CHUNK + 5]).result()
    forced = run(run_record("f", "b", "shadow", "forced", tokens, top=top))
    assert _forced_departure(forced, tokens, store) is None  # ... in a chunk missing CHUNK + 5
    store.write_rows("f", [(CHUNK + 5, encode_row(R[CHUNK + 5]))]).result()
    assert _forced_departure(forced, tokens, store) == CHUNK + 1


def _put_rows_reduced_at_source(store, run_id: str, x: np.ndarray, forced: list[int], close: float = 0.1) -> int:
    """What the capture plugin stores with ``tv_compact=20``: each row reduced where it was
    captured (capture/reduce.py), compact unless it is evidence; returns the rows kept in full."""
    import torch

    from tensorverse.capture.optin import EvidenceSpec
    from tensorverse.capture.reduce import decide, reduce_rows
    from tensorverse.store.codec import row_checksum
    from tensorverse.store.compact import encode_compact

    out, full = [], 0
    for p in range(x.shape[0]):
        d = decide(reduce_rows(torch.from_numpy(x[p]), 20), 0, EvidenceSpec(20, close, forced[p], False),
                   dtype="float32", fingerprint=row_checksum(x[p]))
        if d.compact is None:
            out.append((p, encode_row(x[p]), None, False))
            full += 1
        else:
            out.append((p, encode_compact(d.compact), None, True))
    store.write_rows(run_id, out).result()
    return full


def test_evidence_chosen_at_the_source_gives_the_flips_classes_and_margins_of_full_capture(tmp_path):
    """Issue 37: the same turn stored twice, every row in full and reduced at the source: every
    flip, its class, its margin and every top-1 are identical; KL where a side is compact is a
    lower bound of the full KL; the positions so computed are named."""
    from tensorverse.store import Store

    R = _bf16(ref_logits())
    T = tokens_of(R)
    S, C = R.copy(), R.copy()
    alt = [(t + 1) % V for t in T]
    S[1, alt[1]] = S[1, T[1]]
    if alt[1] < T[1]:
        alt[1] = (T[1] + 2) % V if (T[1] + 2) % V > T[1] else alt[1]
        S[1, alt[1]] = S[1, T[1]]
    for p in (1, 3, 4):
        C[p, alt[p]] = R[p].max() + 1.0
    S[3, alt[3]] = R[3].max() + 1.0
    S[5, alt[5]] = R[5].max() + 1.0  # only the secondary flips at 5: its row full, the candidate's compact
    results = {}
    for form in ("full", "source"):
        with Store.open(tmp_path / form) as st:
            for r in [run_record(primary_run_id("T"), "prim", "primary", "recorded", T, capture="topk", top=topk(R),
                                 text=REF_TEXT, pieces=PIECES),
                      run_record("sec-f", "sec", "secondary", "forced", T, top=topk(S)),
                      run_record("cand-f", "cand", "shadow", "forced", T, top=topk(C))]:
                st.put_run(Run(**r)).result()
            if form == "full":
                put_rows(st, "sec-f", S)
                put_rows(st, "cand-f", C)
            else:
                assert _put_rows_reduced_at_source(st, "sec-f", S, T) == 3  # its tie (1), its flips (3, 5)
                assert _put_rows_reduced_at_source(st, "cand-f", C, T) == 3  # its flips
            results[form] = {(c.run_id, c.ref_run_id): c for c in compare_turn(st, "T")}[("cand-f", "sec-f")]
    full, src = results["full"], results["source"]
    assert full.compact_positions is None and not full.approximate
    assert src.compact_positions == [0, 2, 4, 5] and src.approximate  # 4: only the candidate flips there
    for key in ("flips", "flip_classes", "flips_by_class", "flip_tokens", "first_flip", "n"):
        assert getattr(src, key) == getattr(full, key), key
    assert src.flips == [1, 4, 5] and src.flip_classes[:2] == ["tie", "runtime"]  # both flip alike at 3
    fd, sd = full.attribution["details"], src.attribution["details"]
    assert sd[0] == fd[0]  # the tie at 1: the secondary's row travelled in full (a close call)
    assert sd[2] == fd[2]  # at 5 the secondary's row travelled in full (its flip): margin and steps exact
    # at 4 the secondary's row travelled compact and the candidate's top-1 is not in its top 20:
    # the class is exact, the margin unknown (at least the gap to the secondary's 20th logit)
    assert {k: v for k, v in sd[1].items() if k not in ("margin", "steps", "ref_dtype")} == \
        {k: v for k, v in fd[1].items() if k not in ("margin", "steps", "ref_dtype")}
    assert sd[1]["margin"] is None and fd[1]["margin"] >= float(np.sort(S[4])[-1] - np.sort(S[4])[-20])
    for col in ("top1_agree", "delta_p", "margin", "rank"):
        for p in range(N):
            a, b = full.metrics[col][p], src.metrics[col][p]
            assert a == pytest.approx(b, rel=1e-6, abs=1e-9), (col, p)
    for p in range(N):
        if p in src.compact_positions:
            assert src.metrics["kl"][p] <= full.metrics["kl"][p] + 1e-12
        else:
            assert src.metrics["kl"][p] == full.metrics["kl"][p]


def test_compact_rows_classify_like_full_rows_under_any_tie_rule_and_without_a_noise_run(tmp_path):
    """Evidence at the source compared by `compare_forced` itself (no noise run) under two tie
    rules. At 2 the secondary alone flips, by one bfloat16 step (its row full, the candidate's
    compact): a near tie by default, a runtime flip with ``ulps=0``. At 4 the candidate alone flips
    far (its row full, the secondary's compact). Flips, classes and their details equal full
    capture's under each rule."""
    from tensorverse.analysis.attribution import DEFAULT_RULE, TieRule
    from tensorverse.shadow.compare import compare_forced
    from tensorverse.store import Store

    R = _bf16(ref_logits())
    T = tokens_of(R)
    S, C = R.copy(), R.copy()
    assert S[2, T[2]] > 0
    up = np.array([(int(S[2, T[2]].view(np.uint32) >> 16) + 1) << 16], np.uint32).view(np.float32)[0]
    S[2, (T[2] + 1) % V] = up  # one bfloat16 step above the forced token
    C[4, (T[4] + 1) % V] = R[4].max() + 1.0
    runs = {"sec-f": run_record("sec-f", "sec", "secondary", "forced", T, top=topk(S)),
            "cand-f": run_record("cand-f", "cand", "shadow", "forced", T, top=topk(C))}
    out = {}
    for form in ("full", "source"):
        with Store.open(tmp_path / form) as st:
            for r in runs.values():
                st.put_run(Run(**r)).result()
            for rid, x in (("sec-f", S), ("cand-f", C)):
                if form == "full":
                    put_rows(st, rid, x)
                else:
                    _put_rows_reduced_at_source(st, rid, x, T)
            for name, rule in (("default", DEFAULT_RULE), ("ulps0", TieRule(ulps=0))):
                out[form, name] = compare_forced(st, runs["cand-f"], runs["sec-f"], T, rule=rule)
    for name, classes in (("default", ["near_tie", "runtime"]), ("ulps0", ["runtime", "runtime"])):
        full, src = out["full", name], out["source", name]
        assert {2, 4} <= set(src.compact_positions)
        assert full.flips == src.flips == [2, 4]
        assert full.flip_classes == src.flip_classes == classes, name
        assert src.flips_by_class == full.flips_by_class
        fd, sd = full.attribution["details"], src.attribution["details"]
        assert sd[0] == fd[0]  # the secondary's row at 2 travelled in full: margin and steps exact
        assert sd[1]["flip_class"] == fd[1]["flip_class"] == "runtime"


def _partition_kl(p_row: np.ndarray, q_row: np.ndarray, known: set[int]) -> float:
    """KL(P||Q) over one bucket per id in ``known`` and one tail bucket, in float64 from the full
    rows (independent of analysis/topk.py but for its documented tail floor)."""
    from tensorverse.analysis.topk import TAIL_FLOOR

    def logsoftmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        return x - (x.max() + np.log(np.exp(x - x.max()).sum()))

    lp, lq = logsoftmax(p_row), logsoftmax(q_row)
    ids = sorted(known)
    kl = sum(np.exp(lp[j]) * (lp[j] - lq[j]) for j in ids)
    pt = max(1.0 - sum(np.exp(lp[j]) for j in ids), TAIL_FLOOR)
    qt = max(1.0 - sum(np.exp(lq[j]) for j in ids), TAIL_FLOOR)
    return float(max(kl + pt * (np.log(pt) - np.log(qt)), 0.0))


def test_a_compact_side_keeping_ids_outside_the_full_sides_top_k_meets_their_exact_values(tmp_path):
    """Where one side travelled compact and the other in full, the full side is reduced with the
    compact side's kept ids added, so every id the compact side knows is known on both, also one
    far outside the full side's own top 20: the KL over that partition is what float64 gives from
    the two full rows. At 2 the candidate's row is compact and its second choice is the
    reference's 31st; at 4 the reference's is compact and its second choice is the candidate's
    last (the candidate flips there, far: a runtime flip, or noise where a noise run flips too).
    Flips against a compact reference are judged on the grid of the reference's stored dtype: at
    1 (float32) its second choice is two float32 steps below its first, a runtime flip; at 3
    (bfloat16) one bfloat16 step, a near tie (a runtime flip under a rule without near ties)."""
    from tensorverse.analysis.attribution import TieRule
    from tensorverse.shadow.compare import compare_forced
    from tensorverse.store import Store
    from tensorverse.store.codec import row_checksum
    from tensorverse.store.compact import compact_row, encode_compact

    R = ref_logits()
    R[3] = _bf16(R[3])
    first, second = np.argsort(-R, axis=1, kind="stable")[:, 0], np.argsort(-R, axis=1, kind="stable")[:, 1]
    R[1, second[1]] = np.nextafter(np.nextafter(R[1, first[1]], np.float32(-np.inf)), np.float32(-np.inf))
    top3 = R[3, first[3]]
    R[3, second[3]] = np.array([int(top3.view(np.uint32)) + (-0x10000 if top3 > 0 else 0x10000)],
                               np.uint32).view(np.float32)[0]  # one bfloat16 step below
    T = tokens_of(R)
    assert T == first.tolist()
    C = R.copy()
    X = int(np.argsort(-R[2], kind="stable")[30])
    C[2, X] = C[2].max() - 0.5  # the candidate's second choice at 2, outside the reference's top 20
    Y = int(second[4])  # the reference's second choice at 4
    C[4, Y] = C[4].min() - 1.0  # the candidate's last
    Z = next(j for j in range(V) if j not in (T[4], Y))
    C[4, Z] = R[4].max() + 1.0  # the candidate flips at 4, far
    for p in (1, 3):
        C[p, second[p]] = R[p].max() + 1.0  # and at 1 and 3, to the reference's second choice
    assert int(np.argmax(C[2])) == T[2] and Y not in np.argsort(-C[4])[:20]

    def put(st, rid: str, x: np.ndarray, compact_at: dict[int, str]) -> dict[int, list[int]]:
        kept = {}
        rows = [(p, encode_row(x[p])) for p in range(N) if p not in compact_at]
        for p, dtype in compact_at.items():
            c = compact_row(x[p], k=20, extra=[T[p]], dtype=dtype, fingerprint=row_checksum(x[p]))
            rows.append((p, encode_compact(c), None, True))
            kept[p] = c.ids.tolist()
        st.write_rows(rid, rows).result()
        return kept

    with Store.open(tmp_path / "s") as st:
        runs = {"sec-f": run_record("sec-f", "sec", "secondary", "forced", T),
                "cand-f": run_record("cand-f", "cand", "shadow", "forced", T)}
        for r in runs.values():
            st.put_run(Run(**r)).result()
        kept_ref = put(st, "sec-f", R, {1: "float32", 3: "bfloat16", 4: "float32"})
        kept_cand = put(st, "cand-f", C, {2: "float32"})
        out = compare_forced(st, runs["cand-f"], runs["sec-f"], T)
        noisy = compare_forced(st, runs["cand-f"], runs["sec-f"], T, noise_positions={4})
        no_ties = compare_forced(st, runs["cand-f"], runs["sec-f"], T, rule=TieRule(ulps=0))
    assert X in kept_cand[2] and Y in kept_ref[4] and out.compact_positions == [1, 2, 3, 4]
    assert out.flips == noisy.flips == [1, 3, 4]
    # judged on the stored dtype's grid; a noise run flipping where the reference travelled
    # compact makes the flip noise there too
    assert out.flip_classes == ["runtime", "near_tie", "runtime"]
    assert noisy.flip_classes == ["runtime", "near_tie", "noise"]
    assert no_ties.flip_classes == ["runtime", "runtime", "runtime"]  # the rule reaches them too
    d = {a["position"]: a for a in out.attribution["details"]}
    assert (d[1]["ref_dtype"], d[1]["steps"], d[3]["ref_dtype"], d[3]["steps"]) == ("float32", 2, "bfloat16", 1)
    kl = out.metrics["kl"]
    assert kl[2] == pytest.approx(_partition_kl(R[2], C[2], set(kept_cand[2])), rel=1e-5, abs=1e-9)
    assert kl[4] == pytest.approx(_partition_kl(R[4], C[4], set(kept_ref[4])), rel=1e-5, abs=1e-9)
    # without the other side's ids the same positions would read otherwise (the test can fail)
    assert abs(_partition_kl(R[2], C[2], set(kept_cand[2]) - {X}) - kl[2]) > 1e-3
    assert abs(_partition_kl(R[4], C[4], set(kept_ref[4]) - {Y}) - kl[4]) > 1e-3
    # full and compact positions merged back in order: approximate, every rank exact here (the
    # forced token is kept on both sides), as booleans
    lower = out.metrics["rank_lower_bound"]
    assert lower == [False] * N and {type(v) for v in lower} == {bool}
    assert out.summary["approximate"] is True and out.approximate is True


def test_the_forced_tokens_rank_against_a_compact_row_is_exact_or_says_it_is_a_lower_bound(tmp_path):
    """At 1 the reference travelled compact and the candidate, which flips, in full with the
    forced token 25th: its rank is counted on the full row (it read 20 when counted among the
    compact form's ids, as if exact). At 2 the candidate's row is compact (k = 5) and the forced
    token is 8th: its rank is at least 5, and says so."""
    from tensorverse.shadow.compare import compare_forced
    from tensorverse.store import Store
    from tensorverse.store.codec import row_checksum
    from tensorverse.store.compact import compact_row, encode_compact

    R = ref_logits()
    T = tokens_of(R)
    C = R.copy()
    order = np.argsort(-C[1], kind="stable")
    C[1, T[1]] = (C[1, order[24]] + C[1, order[25]]) / 2  # 24 entries above it
    order = np.argsort(-C[2], kind="stable")
    C[2, T[2]] = (C[2, order[7]] + C[2, order[8]]) / 2  # 7 entries above it
    truth = [int(np.count_nonzero(C[p] > C[p, T[p]])) for p in range(N)]
    assert truth[1:3] == [24, 7]

    def compact(x: np.ndarray, p: int, k: int) -> bytes:
        return encode_compact(compact_row(x[p], k=k, extra=[T[p]], fingerprint=row_checksum(x[p])))

    with Store.open(tmp_path / "s") as st:
        runs = {"sec-f": run_record("sec-f", "sec", "secondary", "forced", T),
                "cand-f": run_record("cand-f", "cand", "shadow", "forced", T)}
        for r in runs.values():
            st.put_run(Run(**r)).result()
        st.write_rows("sec-f", [(p, encode_row(R[p])) for p in range(N) if p != 1]
                      + [(1, compact(R, 1, 20), None, True)]).result()
        st.write_rows("cand-f", [(p, encode_row(C[p])) for p in range(N) if p != 2]
                      + [(2, compact(C, 2, 5), None, True)]).result()
        out = compare_forced(st, runs["cand-f"], runs["sec-f"], T)
    assert out.compact_positions == [1, 2]
    rank, lower = out.metrics["rank"], out.metrics["rank_lower_bound"]
    assert rank[1] == 24 and not lower[1]
    assert rank[2] >= 5 and lower[2] and rank[2] <= truth[2]
    assert [r for p, r in enumerate(rank) if p not in (1, 2)] == [t for p, t in enumerate(truth) if p not in (1, 2)]
