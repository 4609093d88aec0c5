"""Compaction (issue 26): the compact row form, what is kept as evidence, deltas through their
reference, readers on a compacted store, refusals, conflicts, pins, migration and kill -9."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tensorverse.cli import main
from tensorverse.shadow.compare import TurnCompacted, compare_turn
from tensorverse.store import Store, StoreVersionError
from tensorverse.store import schema as S
from tensorverse.store.codec import CodecError, blob_info, decode_row, encode_row
from tensorverse.store.compact import compact_row, decode_compact, encode_compact
from tensorverse.store.compaction import (EvidencePolicy, RowFacts, compact_store, compact_turn, plan_evidence,
                                          sampled)
from tensorverse.store.records import CompactedRun, Compaction, RecordError, comparison, run
from tensorverse.store.stored_rows import RowCompacted, StoredRows
from tensorverse.testing.shadow_workload import write_turn
from tensorverse.testing.records import store_session, tcomparison, tfree_comparison, trun, tsession, tturn
from tests.refusals import refused

V = 4096
N = 48
HOUR = 3600 * 10**9
POLICY = EvidencePolicy(after_s=0.0)


def rows(n: int, seed: int, *, rel: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """bf16-exact rows of a peaked random LM head and a near-identical shadow's."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((V, 32)).astype(np.float32) * np.float32(0.6)
    h = rng.standard_normal((n, 32)).astype(np.float32)
    hs = h + np.float32(rel) * np.abs(h) * rng.standard_normal((n, 32)).astype(np.float32)

    def bf16(x: np.ndarray) -> np.ndarray:
        u = np.ascontiguousarray(x, np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)

    return bf16(h @ w.T), bf16(hs @ w.T)


def workload(store: Store, turns: int = 2, flip_share: float = 0.1):
    out, originals = [], {}
    for i in range(turns):
        ref, shadow = rows(N, 10 + i)
        other, _ = rows(N, 50 + i)
        t = write_turn(store, f"t{i}", f"s{i}", 0, ref, shadow, other, flip_share=flip_share, seed=i,
                       created_ns=time.time_ns() - HOUR)
        out.append(t)
        for rid in t.run_ids.values():
            originals[rid] = {p: decode_row(b) for p, b in store.read_rows(rid)}
    return out, originals


def test_compact_row_is_exact_and_checked():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(V) * 3).astype(np.float32)
    x[7] = x[9] = x.max() + 1  # a tie at the top: the lower id first
    c = compact_row(x, k=20, extra=[5, 7, 4095])
    assert c.top(3)[:2] == [7, 9] and c.k == 20 and c.vocab == V
    assert list(c.ids[20:]) == sorted({5, 4095} - set(c.top(20)))
    ref = x.astype(np.float64)
    lse = ref.max() + np.log(np.exp(ref - ref.max()).sum())
    assert abs(c.lse - lse) < 1e-12
    order = np.argsort(-x, kind="stable")[:20]
    assert c.top(20) == order.tolist()
    for t, lp in c.logprobs().items():
        assert lp == float(x[t]) - c.lse  # the logit itself, bit for bit
    assert c.rank([int(order[4]), 5 if 5 not in order else 4095]) == [4, None]
    assert abs(c.tail_mass - (1 - np.exp(ref[order] - lse).sum())) < 1e-12
    blob = encode_compact(c)
    assert len(blob) < 300 and decode_compact(blob) == c
    for i in (0, 5, len(blob) // 2, len(blob) - 1):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(CodecError):
            decode_compact(bytes(bad))
    with pytest.raises(CodecError, match="truncated"):
        decode_compact(blob[:10])
    with pytest.raises(ValueError):
        compact_row(x, k=0)


def test_plan_keeps_flips_divergences_close_calls_kl_and_a_seeded_sample():
    runs = [run({"id": "f", "turn_id": "T", "backend": "c", "mode": "forced", "token_ids": list(range(100))}),
            run({"id": "r", "turn_id": "T", "backend": "c", "mode": "free", "token_ids": list(range(60))})]
    kl = [0.0] * 100
    kl[33], kl[70] = 0.5, 0.9
    comps = [comparison({"run_id": "f", "ref_run_id": "x", "mode": "forced", "flips": [3, 40],
                         "metrics": {"kl": kl}}),
             comparison({"run_id": "r", "ref_run_id": "p", "mode": "free", "first_flip": 12})]
    facts = [RowFacts("f", p, 0.01 * p) for p in range(100)] + [RowFacts("r", 5, float("nan"))]
    pol = EvidencePolicy(close_nats=0.1, close_share=0.03, top_kl=1, sample=0.05, seed=3)
    plan = plan_evidence("T", runs, comps, facts, pol, 100)
    sample = {p for p in range(100) if sampled(3, "T", p, 0.05)}
    assert 0 < len(sample) < 20
    close = {0, 1, 2}  # the 3 closest under 0.1 nats (3 % of 100)
    assert set(plan.forced) == {3, 40, 70, 12} | close | sample
    assert plan.forced[3] >= {"flip", "close"} - ({"close"} if 3 not in close else set())
    assert "kl" in plan.forced[70] and "divergence" in plan.forced[12]
    assert {"divergence"} <= plan.free["r"][12] and "close" in plan.free["r"][5]  # a NaN row: kept
    again = plan_evidence("T", runs, comps, facts, pol, 100)
    assert again.forced == plan.forced  # the sample is seeded


def test_compaction_keeps_evidence_exact_and_compacts_the_rest(store):
    turns, originals = workload(store)
    before = {rid: msgspec.json.encode(list(store.iter_comparisons(rid))) for t in turns for rid in t.run_ids.values()}
    row_bytes = sum(len(b) for rid in originals for _, b in store.read_rows(rid))
    results = compact_store(store, POLICY)
    assert [r.status for r in results] == ["compacted", "compacted"]
    assert sum(r.bytes_before for r in results) == row_bytes
    assert sum(r.bytes_after for r in results) < row_bytes / 5
    src = StoredRows(store)
    for t in turns:
        rec = store.compaction(t.turn_id)
        ref_id = t.run_ids[("secondary", "forced")]
        assert rec.reference_run == ref_id
        for p in t.flips:  # every flip full on both sides, bit for bit
            assert "flip" in rec.reasons[str(p)]
            for backend in ("secondary", "twin", "candidate"):
                rid = t.run_ids[(backend, "forced")]
                assert src.row(rid, p).tobytes() == originals[rid][p].tobytes()
        twin = rec.runs[t.run_ids[("twin", "forced")]]
        assert twin.delta == twin.full and twin.delta_ref == ref_id  # bit-identical: all deltas
        for (_backend, mode), rid in t.run_ids.items():
            info = rec.runs[rid]
            kept = set(info.full)
            assert info.compact == N - len(kept) if mode == "forced" else True
            for p, x in originals[rid].items():
                if p in kept:
                    assert src.form(rid, p) == "full"
                    assert src.row(rid, p).tobytes() == x.tobytes()
                    assert (p in info.delta) == blob_info(store.read_row(rid, p))["needs_ref"]
                else:
                    with pytest.raises(RowCompacted) as e:
                        src.row(rid, p)
                    c = e.value.compact
                    assert c.top(20) == np.argsort(-x, kind="stable")[:20].tolist()
                    assert c.fingerprint == blob_info(encode_row(x))["crc32"]
                    assert src.form(rid, p) == "compact"
        for rid in t.run_ids.values():  # comparisons untouched
            assert msgspec.json.encode(list(store.iter_comparisons(rid))) == before[rid]
        with refused(TurnCompacted, "compacted"):
            compare_turn(store, t.turn_id)
    assert all(r.status == "skipped" for r in compact_store(store, POLICY))  # once


def test_compaction_skips_pinned_recent_and_uncompared_turns(store):
    turns, _ = workload(store, turns=2)
    store.pin_session("s0").result()
    assert compact_turn(store, "t0", POLICY).why == "pinned"
    assert compact_turn(store, "t1", replace(POLICY, after_s=7200)).why == "recent"
    store.put_run(trun("late", "t1", "late", "forced", capture="full", token_ids=turns[1].tokens)).result()
    store.write_rows("late", [(0, encode_row(np.zeros(V, np.float32)))]).result()
    assert compact_turn(store, "t1", POLICY).why == "not compared yet"
    store.put_run(trun("late", "t1", "candidate", "forced", capture="full", token_ids=turns[1].tokens,
                       created_ns=1)).result()  # an older try: not evidence
    assert compact_turn(store, "t1", POLICY).status == "compacted"
    assert store.compaction("t1").runs["late"].full == []
    assert [r.turn_id for r in compact_store(store, POLICY) if r.status == "compacted"] == []  # t0 pinned
    assert store.compaction("t0") is None


def test_a_row_changed_meanwhile_is_a_conflict_and_nothing_is_written(store, monkeypatch):
    turns, originals = workload(store, turns=1)
    rid = turns[0].run_ids[("candidate", "forced")]
    real = store.apply_compaction

    def racing(turn_id, record, changes):
        store.write_rows(rid, [(1, encode_row(originals[rid][1] + 1))]).result()
        return real(turn_id, record, changes)

    monkeypatch.setattr(store, "apply_compaction", racing)
    r = compact_turn(store, "t0", POLICY)
    assert r.status == "conflict" and "changed" in r.why
    assert store.compaction("t0") is None
    assert store.read_compact_rows(rid) == [] and len(store.read_rows(rid)) == N


def test_delete_session_takes_compact_rows_and_record(store):
    turns, _ = workload(store, turns=1)
    compact_store(store, POLICY)
    rid = turns[0].run_ids[("candidate", "forced")]
    assert store.read_compact_rows(rid)
    assert store.delete_session("s0").result()
    assert store.read_compact_rows(rid) == [] and store.compaction("t0") is None
    assert all(v == 0 for k, v in store.stats()["entries"].items() if k not in ("meta", "backends"))


def test_stats_and_cli_compact(tmp_path, capsys):
    path = tmp_path / "s"
    with Store.open(path, durable=False) as st:
        workload(st, turns=2)
    assert main(["store", "--store", str(path), "compact", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["turns"] == 2 and dry["bytes_after"] < dry["bytes_before"]
    with Store.open(path, readonly=True) as st:
        assert st.compaction("t0") is None
    assert main(["store", "compact", "--store", str(path), "--after", "2h"]) == 0
    out = capsys.readouterr().out  # an hour old: not due
    assert "compacted 0 turn(s)" in out and "at least 7200 s ago" in out
    assert main(["store", "compact", "--store", str(path), "--after", "1m", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "compacted 1 turn(s)" in out and "compact; row bytes" in out
    assert main(["store", "--store", str(path), "compact", "--after", "1m", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["turns"] == 1
    assert main(["store", "--store", str(path), "stats", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["tables"]["rows_compact"] > 0
    assert main(["store", "--store", str(path), "compact", "--after", "soon"]) == 2
    assert "duration" in capsys.readouterr().err
    assert main(["store", "--store", str(tmp_path / "none"), "compact"]) == 2
    assert "no Tensorverse store" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()  # not created by the attempt


def test_format_4_store_migrates_to_5_and_its_turn_compacts(tmp_path):
    """A store written by the format-4 code (fixtures/make_format4_store.py, run at commit
    e6224c7): a read-only open of the unmigrated copy refuses it; a writable open migrates it to 5
    (``rows_compact`` and ``compacted`` created empty); its turn reads with the upstream logprobs
    in the canonical shape, its rows decode bit-exactly and its comparisons are those that code
    computed. Compaction then acts on those comparisons: the flip and the divergence at position 2
    stay full in every run, and every row reads back bit-exactly or as its compact form."""
    import shutil

    from tensorverse.store import records

    from tests.store.fixtures.fixture_rows import row

    tid = "18493fba64ef0000f4000000000001"
    primary = f"{tid}~primary"
    written = {"r4-ref-forced": [row(3, 4), row(7, 8), row(11, 12), row(5, 6, plain=True)],
               "r4-cand-forced": [row(3, 4), row(7, 8, 0.75), row(12, 11, 0.0625), row(5, 6)],
               "r4-cand-free": [row(3, 4), row(7, 8, 0.75), row(12, 11, 0.0625), row(9, 10)]}
    src = Path(__file__).parent / "fixtures" / "format4-store"
    shutil.copytree(src, tmp_path / "ro")
    with pytest.raises(StoreVersionError, match="has format 4"):
        Store.open(tmp_path / "ro", readonly=True)
    shutil.copytree(src, tmp_path / "s")
    with Store.open(tmp_path / "s") as st:
        assert st.format_version == S.FORMAT_VERSION == 5
        assert {k: st.stats()["entries"][k] for k in ("rows_compact", "compacted")} == {"rows_compact": 0, "compacted": 0}
        assert st.get_session("s4").tags == {"agent": "turnstone", "case": "c4"}
        turn = st.get_turn(tid)
        assert (turn.backend, turn.kind, turn.output_token_ids, turn.text) == (
            "vllm-main", "main", [3, 7, 11, 5], "The link is up")
        assert "upstream_logprobs" not in turn.choices[0]
        assert turn.choices[0]["logprobs"] == [
            {"token": 3, "logprob": -0.125, "top": [[3, -0.125], [4, -2.25]]},
            {"token": 7, "logprob": -0.25, "top": [[7, -0.25], [8, -1.5]]},
            {"token": 11, "logprob": -0.5, "top": [[11, -0.5], [12, -1.0]]},
            {"token": 5, "logprob": -0.0625, "top": [[5, -0.0625], [6, -3.0]]}]
        runs = {r.id: r for r in st.iter_runs(tid)}
        assert sorted(runs) == sorted([primary, *written])
        assert [(r.backend, r.mode, r.token_ids) for r in map(runs.get, [primary, *written])] == [
            ("vllm-main", "recorded", [3, 7, 11, 5]), ("ref", "forced", [3, 7, 11, 5]),
            ("cand", "forced", [3, 7, 11, 5]), ("cand", "free", [3, 7, 12, 9])]
        blobs = {rid: dict(st.read_rows(rid)) for rid in written}
        for rid, xs in written.items():
            assert sorted(blobs[rid]) == [0, 1, 2, 3]
            for p, x in enumerate(xs):
                assert decode_row(blobs[rid][p]).tobytes() == x.tobytes(), (rid, p)
        assert blob_info(blobs["r4-ref-forced"][3])["mode"] == "plain"
        assert blob_info(blobs["r4-ref-forced"][0])["mode"] == "bf16"
        full = st.get_comparison("r4-cand-forced", "r4-ref-forced")
        assert (full.kind, full.status, full.flips) == ("full", "ok", [2])
        assert st.get_comparison("r4-cand-forced", primary).flips == [2]
        assert st.get_comparison("r4-ref-forced", primary).flips == []
        free = st.get_comparison("r4-cand-free", primary)
        assert (free.first_flip, free.divergence["position"], free.confirms_forced) == (2, 2, True)
        for kind in records.KINDS:
            for rec in st.records(kind):
                cls = records.record_type(kind, rec)
                assert records.unknown_fields(rec, cls) == [], (kind, rec)
                records.decode(rec, cls)

        assert compact_turn(st, tid, POLICY).status == "compacted"
        rec = st.compaction(tid)
        assert {"flip", "divergence"} <= set(rec.reasons["2"])
        assert "divergence" in rec.free_reasons["r4-cand-free"]["2"]
        src_rows = StoredRows(st)
        for rid, xs in written.items():
            kept = rec.runs[rid].full
            assert 2 in kept and rec.runs[rid].compact == 4 - len(kept) > 0
            for p, x in enumerate(xs):
                if p in kept:
                    assert src_rows.row(rid, p).tobytes() == x.tobytes(), (rid, p)
                    continue
                with pytest.raises(RowCompacted) as e:
                    src_rows.row(rid, p)
                c = e.value.compact
                assert c.fingerprint == blob_info(blobs[rid][p])["crc32"] and c.vocab == 32
                assert c.top(1) == [int(np.argmax(x))] and c.k == 20
                np.testing.assert_array_equal(c.logits[: c.k], np.sort(x)[::-1][: c.k])


_KILLED = r"""
import sys
from tensorverse.store import Store
from tensorverse.store.compaction import EvidencePolicy, compact_store
with Store.open(sys.argv[1]) as st:
    print("start", flush=True)
    compact_store(st, EvidencePolicy(after_s=0.0), progress=lambda r: print(r.status, flush=True))
"""


def test_kill_9_while_compacting_leaves_whole_turns(tmp_path):
    """A turn is compacted in one transaction: after a SIGKILL mid-run, each turn is either
    compacted (record, compact rows, kept rows) or as captured (every full row), never half."""
    path = tmp_path / "s"
    with Store.open(path) as st:
        turns, originals = workload(st, turns=8)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.readline().strip() == "start"
    for _ in range(2):
        assert proc.stdout.readline().strip() == "compacted", "the compaction ended before it was killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    done = 0
    with Store.open(path, readonly=True) as st:
        src = StoredRows(st)
        for t in turns:
            rec = st.compaction(t.turn_id)
            done += rec is not None
            for rid in t.run_ids.values():
                full = {p for p, _ in st.read_rows(rid)}
                compact = {p for p, _ in st.read_compact_rows(rid)}
                assert full | compact == set(originals[rid]) and not full & compact
                if rec is None:
                    assert not compact
                else:
                    assert full == set(rec.runs[rid].full)
                for p in full:
                    assert src.row(rid, p).tobytes() == originals[rid][p].tobytes()
    assert 2 <= done < 8
    from tests.reliability.harness import record

    record("fault-kill9-compaction", load="8 shadowed turns (6 runs x 48 rows each), compacted turn by turn",
           faults="SIGKILL of `compact_store` after its second turn", bad_inputs=0, requests=0, requests_failed=0,
           records_lost=0, turns_compacted_before_kill=done, turns_half_compacted=0,
           note="every turn left compacted whole or as captured; every full row bit-identical")


def test_viewer_and_export_read_a_compacted_store(store, tmp_path):
    """The viewer renders a compacted turn (flips where they were, every position with its
    numbers, compacted positions said so) and the logits export gives each position its form."""
    import pyarrow.parquet as pq

    from tensorverse.exporters.export import export_store
    from tensorverse.viz.data import ViewData

    turns, originals = workload(store, turns=1)
    before = ViewData(store).turn_view("t0")
    compact_store(store, POLICY)
    after = ViewData(store).turn_view("t0")
    t = turns[0]
    fb, fa = before["forced"], after["forced"]
    assert fa["available"] and fa["reference"] == "secondary"
    assert fa["lanes"]["candidate"]["flips"] == fb["lanes"]["candidate"]["flips"] == t.flips
    kept = set(store.compaction("t0").runs[t.run_ids[("candidate", "forced")]].full)
    for p in range(N):  # numbers everywhere: exact where kept, from the kept top-k elsewhere
        assert fa["lanes"]["candidate"]["kl"][p] is not None
        if p in kept:
            assert fa["lanes"]["candidate"]["kl"][p] == fb["lanes"]["candidate"]["kl"][p]
    assert any("compacted positions" in w for w in after["warnings"])
    p = next(q for q in range(N) if q not in kept)
    panel_b, panel_a = fb["panels"][p], fa["panels"][p]
    assert panel_a["ids"][:5] == panel_b["ids"][:5]
    names = [b["name"] for b in after["backends"]]
    col = [names[i] for i in panel_a["m"]].index("candidate")
    col_b = [names[i] for i in panel_b["m"]].index("candidate")
    for j, tid in enumerate(panel_a["ids"][:5]):  # the kept top-k: the same probabilities
        assert panel_a["p"][col][j] == pytest.approx(panel_b["p"][col_b][panel_b["ids"].index(tid)], abs=1e-6)

    res = export_store(store, tmp_path / "x", fmt="parquet", tables=["logits"])
    rows = pq.read_table(res["logits"]["path"]).to_pylist()
    assert len(rows) == 6 * N  # every position of every run, compacted or not
    rid = t.run_ids[("candidate", "forced")]
    mine = {r["position"]: r for r in rows if r["run_id"] == rid}
    for q, r in mine.items():
        if q in kept:
            assert r["form"] == "full" and np.array_equal(np.float32(r["logits"]), originals[rid][q])
        else:
            assert r["form"] == "compact" and r["logits"] is None
            assert r["kept_ids"][:20] == np.argsort(-originals[rid][q], kind="stable")[:20].tolist()
            assert r["lse"] == pytest.approx(float(np.log(np.exp(originals[rid][q].astype(np.float64)).sum())))


def test_viewer_says_where_retention_pruned_rows(store):
    from tensorverse.viz.data import ViewData

    turns, _ = workload(store, turns=1)
    flips = ViewData(store).turn_view("t0")["forced"]["lanes"]["candidate"]["flips"]
    assert store.drop_session_rows("s0").result() > 0
    tv = ViewData(store).turn_view("t0")
    assert any("rows pruned by [retention]" in w for w in tv["warnings"])
    assert tv["forced"]["lanes"]["candidate"]["flips"] == flips  # from the recorded top-k
    with refused(TurnCompacted, "compacted"):
        compare_turn(store, "t0")


# -- exact values: the evidence plan's reasons, the policy, compact rows and compact_turn's record -

def _sample(seed: int, turn: str, n: int, share: float) -> set[int]:
    """The documented sample, computed here: crc32 of "seed:turn:position" under share * 2**32."""
    import zlib

    return {p for p in range(n) if zlib.crc32(f"{seed}:{turn}:{p}".encode()) < share * 2**32}


def test_plan_reasons_exactly():
    runs = [run({"id": "f", "turn_id": "T", "backend": "c", "mode": "forced", "token_ids": list(range(100))}),
            run({"id": "g", "turn_id": "T", "backend": "d", "mode": "forced", "token_ids": list(range(100))}),
            run({"id": "r", "turn_id": "T", "backend": "c", "mode": "free", "token_ids": list(range(60))}),
            run({"id": "r2", "turn_id": "T", "backend": "d", "mode": "free", "token_ids": list(range(50))})]
    kl = [None] + [0.01] * 49
    kl[5] = kl[30] = 0.7  # a tie: the first (stable) of them, at position 10 + 5
    kl[40] = float("inf")
    comps = [comparison({"run_id": "g", "ref_run_id": "x", "mode": "forced", "status": "error", "flips": [77]}),
             comparison({"run_id": "f", "ref_run_id": "x", "mode": "forced", "flips": [3, 40],
                         "positions": list(range(10, 60)), "metrics": {"kl": kl}}),
             comparison({"run_id": "g", "ref_run_id": "x", "mode": "forced", "flips": [], "metrics": {"kl": [0.0] * 100}}),
             comparison({"run_id": "g", "ref_run_id": "p", "mode": "forced", "flips": [], "metrics": None}),
             comparison({"run_id": "r", "ref_run_id": "p", "mode": "free", "first_flip": 12}),
             comparison({"run_id": "r2", "ref_run_id": "p", "mode": "free", "first_flip": None})]
    facts = [RowFacts("f", p, 0.01 * p + 0.001) for p in range(100)]
    facts += [RowFacts("g", p, 0.0005 if p == 50 else 1.0) for p in range(100)]
    facts += [RowFacts("r", 5, float("nan")), RowFacts("r", 6, 0.05), RowFacts("r", 9, 0.08), RowFacts("r", 20, 0.09)]
    facts += [RowFacts("r2", 7, 0.1), RowFacts("r2", 8, 0.5)]
    pol = EvidencePolicy(close_nats=0.1, close_share=0.05, top_kl=2, sample=0.05, seed=3)
    plan = plan_evidence("T", runs, comps, facts, pol, 100)
    want: dict[int, set[str]] = {}

    def add(d, p, why):
        d.setdefault(p, set()).add(why)

    for p in (3, 40):
        add(want, p, "flip")
    add(want, 50, "kl")  # inf, the highest
    add(want, 15, "kl")
    add(want, 12, "divergence")
    for p in (50, 0, 1, 2, 3):  # the 5 smallest gaps of the 11 under 0.1 (5 % of 100), any forced run
        add(want, p, "close")
    for p in _sample(3, "T", 100, 0.05):
        add(want, p, "sample")
    assert plan.forced == want
    free_r: dict[int, set[str]] = {12: {"divergence"}}
    for p in (5, 6, 9):  # 3 of 60: the NaN row first
        add(free_r, p, "close")
    for p in _sample(3, "T", 60, 0.05):
        add(free_r, p, "sample")
    free_r2: dict[int, set[str]] = {}
    for p in _sample(3, "T", 50, 0.05):  # 0.1 is not under close_nats
        add(free_r2, p, "sample")
    assert plan.free == {"r": free_r, **({"r2": free_r2} if free_r2 else {})}
    assert plan.kept(runs[0]) == want and plan.kept(runs[2]) == free_r and plan.kept(
        run({"id": "zz", "turn_id": "T", "backend": "e", "mode": "free"})) == {}
    assert _sample(3, "T", 100, 0.05) and _sample(3, "T", 100, 0.05) != _sample(4, "T", 100, 0.05)
    assert not sampled(3, "T", 1, 0.0) and all(sampled(3, "T", p, 1.0) for p in range(50))


def test_policy_bounds():
    for ok in ({"topk": 1}, {"topk": 4096}, {"close_nats": 0.0}, {"top_kl": 0}, {"after_s": 0.0},
               {"sample": 0.0}, {"sample": 1.0}, {"close_share": 0.0}, {"close_share": 1.0}):
        EvidencePolicy(**ok)
    for bad, msg in (({"topk": 0}, "topk"), ({"topk": 4097}, "topk"), ({"close_nats": -0.01}, "close_nats"),
                     ({"top_kl": -1}, "top_kl"), ({"after_s": -1.0}, "after_s"), ({"sample": -0.1}, "sample"),
                     ({"sample": 1.1}, "sample"), ({"close_share": -0.1}, "close_share"),
                     ({"close_share": 1.5}, "close_share")):
        with pytest.raises(ValueError, match=msg):
            EvidencePolicy(**bad)


def test_gap_of_a_row():
    from tensorverse.store.compaction import _gap

    assert _gap(np.array([2.0], np.float32)) == float("inf")
    assert _gap(np.array([1.0, -3.0, 2.5, 0.5], np.float32)) == 1.5
    assert _gap(np.array([-4.0, -1.0, -1.0], np.float32)) == 0.0
    assert np.isnan(_gap(np.array([np.inf, 1.0, 0.0], np.float32)))
    assert np.isnan(_gap(np.array([np.nan, 1.0, 0.0], np.float32)))


def test_compact_row_edges_and_bfloat16():
    x = np.array([0.5, 3.0, 3.0, -1.0, 3.0, 2.0], np.float32)
    c = compact_row(x, k=2, extra=[0, 5, 6, -1, 1])
    assert c.top(5) == [1, 2] and list(c.ids) == [1, 2, 0, 5]  # ties by id; extras in range, sorted, new
    assert c.logits.dtype == np.float32 and c.ids.dtype == np.int32
    assert c.rank([1, 2, 0, 5, 4]) == [0, 0, None, None, None]
    assert compact_row(x, k=6).top(6) == [1, 2, 4, 5, 0, 3]
    assert compact_row(x.reshape(2, 3), k=3).vocab == 6
    assert compact_row(x, k=3).top(3) == [1, 2, 4]  # a tie at the k-th value: the lowest ids
    assert compact_row(np.array([1.0, np.nan, 2.0], np.float32), k=1).top(1) == [2]
    with pytest.raises(ValueError, match="empty row"):
        compact_row(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="k must be in 1..6"):
        compact_row(x, k=7)
    with pytest.raises(ValueError, match="dtype"):
        compact_row(x, dtype="int8")
    b = compact_row(x, k=2, dtype="bfloat16", fingerprint=0xDEADBEEF)
    back = decode_compact(encode_compact(b))
    assert back.dtype == "bfloat16" and back.fingerprint == 0xDEADBEEF and back.k == 2 and back == b
    assert back != compact_row(x, k=3) and back != "row"
    assert compact_row(x, k=2).fingerprint == blob_info(encode_row(x))["crc32"]
    assert np.isnan(compact_row(np.array([np.inf, 0.0], np.float32), k=1).lse)
    assert compact_row(np.array([0.0, 0.0], np.float32), k=2).lse == pytest.approx(np.log(2), abs=1e-15)


def _reblob(body: bytes) -> bytes:
    import struct
    import zlib

    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("read", ["decode_compact", "check_compact"])
def test_decode_compact_refuses_each_bad_field(read):
    """Ingest's check (check_compact) refuses exactly what a decode refuses, with the same words."""
    import struct

    from tensorverse.store import compact

    check = getattr(compact, read)
    good = encode_compact(compact_row(np.arange(8, dtype=np.float32), k=3))
    body = bytearray(good[:-4])
    assert decode_compact(_reblob(bytes(body)), record="r@1").top(3) == [7, 6, 5]
    assert compact.check_compact(_reblob(bytes(body)), record="r@1") is None
    cases = {0: (b"XVCR", "magic"), 4: (b"\x02", "version"), 5: (b"\x09", "malformed"),  # dtype code
             6: (struct.pack("<H", 0), "malformed"),  # k = 0
             8: (struct.pack("<H", 1), "malformed"),  # 4 entries said, 3 there
             10: (struct.pack("<I", 7), "malformed")}  # an id outside a vocabulary of 7
    for off, (val, reason) in cases.items():
        b = bytearray(body)
        b[off:off + len(val)] = val
        with pytest.raises(CodecError) as e:
            check(_reblob(bytes(b)), record="r@1")
        assert e.value.reason == reason and str(e.value).startswith("compact row 'r@1': ")
    neg = bytearray(body)
    neg[26:30] = struct.pack("<i", -1)
    with pytest.raises(CodecError) as e:
        check(_reblob(bytes(neg)))
    assert e.value.reason == "malformed"
    edge = bytearray(body)
    edge[26:30] = struct.pack("<i", 0)  # id 0 is in the vocabulary
    check(_reblob(bytes(edge)))
    assert 0 in decode_compact(_reblob(bytes(edge))).ids
    with pytest.raises(CodecError) as e:
        check(good[:29])
    assert e.value.reason == "truncated" and str(e.value).startswith("compact row: ")
    with pytest.raises(CodecError) as e:
        check(good[:29], record="r@1")
    assert e.value.reason == "truncated" and str(e.value).startswith("compact row 'r@1': ")
    with pytest.raises(CodecError) as e:
        check(good[:-1] + bytes([good[-1] ^ 1]))
    assert e.value.reason == "checksum"
    assert len(good) == 26 + 8 * 3 + 4


def test_each_skip_says_which_turn_and_why(store):
    turns, _ = workload(store, turns=1)
    from tensorverse.store.compaction import CompactionResult

    assert compact_turn(store, "t0", replace(POLICY, after_s=7200)) == CompactionResult("t0", "skipped", "recent")
    now = time.time_ns()
    assert compact_turn(store, "t0", replace(POLICY, after_s=3599), now_ns=now).status == "compacted"
    assert compact_turn(store, "t0", POLICY) == CompactionResult("t0", "skipped", "compacted already")
    store.put_session(tsession("sx", created_ns=1)).result()
    store.put_turn(tturn("tx", "sx", 0, created_ns=1)).result()
    store.put_run(trun("tx.rec", "tx", "p", "recorded", token_ids=[1])).result()
    assert compact_turn(store, "tx", POLICY) == CompactionResult("tx", "skipped", "no rows")
    store.pin_session("sx").result()
    assert compact_turn(store, "tx", POLICY) == CompactionResult("tx", "skipped", "pinned")
    out = compact_store(store, POLICY)
    assert out == []  # t0 is done, sx is pinned


def test_the_record_and_result_exactly(store):
    from dataclasses import asdict

    turns, originals = workload(store, turns=1)
    t = turns[0]
    sizes = {rid: {p: len(b) for p, b in store.read_rows(rid)} for rid in t.run_ids.values()}
    now = time.time_ns()
    r = compact_turn(store, "t0", POLICY, now_ns=now)
    rec = store.compaction("t0")
    assert isinstance(rec, Compaction) and rec.rows_pruned is None  # compacted, not pruned
    assert rec.turn_id == "t0" and rec.at_ns == now and rec.policy == asdict(POLICY)
    assert r.turn_id == "t0" and r.status == "compacted" and r.why == ""
    assert r.bytes_before == rec.bytes_before == sum(sum(s.values()) for s in sizes.values())
    after = sum(len(b) for rid in t.run_ids.values() for _, b in store.read_rows(rid)) + \
        sum(len(b) for rid in t.run_ids.values() for _, b in store.read_compact_rows(rid))
    assert r.bytes_after == rec.bytes_after == after
    assert r.rows_delta == sum(len(x.delta) for x in rec.runs.values())
    assert r.rows_full == sum(len(x.full) - len(x.delta) for x in rec.runs.values())
    assert r.rows_compact == sum(x.compact for x in rec.runs.values()) == \
        sum(len(store.read_compact_rows(rid)) for rid in t.run_ids.values())
    assert r.rows_full + r.rows_delta + r.rows_compact == 6 * N
    for (backend, mode), rid in t.run_ids.items():
        x = rec.runs[rid]
        assert (x.backend, x.mode, x.topk) == (backend, mode, 20)
        assert x.full == sorted(x.full) and set(x.delta) <= set(x.full)
        assert (x.delta_ref is None) == (not x.delta)
        assert x.compact == N - len(x.full)
    free = t.run_ids[("candidate", "free")]
    assert rec.free_reasons[free][str(t.flips[0])] == ["divergence"] or "divergence" in \
        rec.free_reasons[free][str(t.flips[0])]
    run_tokens = store.get_run(free).token_ids
    src = StoredRows(store)
    for p, _ in store.read_compact_rows(free):  # the run's own token and the primary's, kept
        c = src.compact(free, p)
        assert {run_tokens[p], t.tokens[p]} <= set(int(i) for i in c.ids)


def test_no_deltas_when_the_policy_says_so_and_deltas_are_not_recompacted(store):
    turns, originals = workload(store, turns=2)
    r = compact_turn(store, "t0", replace(POLICY, delta=False))
    assert r.status == "compacted" and r.rows_delta == 0
    assert all(x.delta == [] and x.delta_ref is None for x in store.compaction("t0").runs.values())
    t1 = turns[1]
    twin, ref = t1.run_ids[("twin", "forced")], t1.run_ids[("secondary", "forced")]
    store.write_rows(twin, [(0, encode_row(originals[twin][0], ref=originals[ref][0]))]).result()
    assert compact_turn(store, "t1", POLICY).why == f"row {twin}@0 is a delta already"


# -- the record's reasons by mode, compact rows' dtypes, ties and messages, the plan's edges -------

def test_a_compaction_record_gives_the_reasons_of_a_position_by_its_runs_mode():
    rec = Compaction(turn_id="t", runs={"f": CompactedRun(mode="forced"), "r": CompactedRun(mode="free")},
                     reasons={"3": ["close", "flip"], "7": ["sample"]},
                     free_reasons={"r": {"3": ["divergence"], "9": ["close"]}})
    assert rec.reasons_at("f", 3) == ["close", "flip"] and rec.reasons_at("f", 7) == ["sample"]
    assert rec.reasons_at("f", 9) == [] and rec.reasons_at("zz", 7) == ["sample"]  # unknown: forced
    assert rec.reasons_at("r", 3) == ["divergence"] and rec.reasons_at("r", 9) == ["close"]
    assert rec.reasons_at("r", 7) == []
    assert Compaction(turn_id="t", runs={"r": CompactedRun(mode="free")}).reasons_at("r", 3) == []
    assert Compaction(turn_id="t", runs={"r": CompactedRun(mode="free")},
                      free_reasons={"q": {"3": ["x"]}}).reasons_at("r", 3) == []
    assert Compaction(turn_id="t").reasons_at("f", 3) == []
    got = rec.reasons_at("f", 3)
    got.append("mine")  # a copy, not the record's list
    assert rec.reasons["3"] == ["close", "flip"]


def test_a_compaction_record_is_stored_typed_and_read_back_equal(store):
    store_session(store, "s", runs=(("primary", "forced"),), rows=0)
    rec = Compaction(turn_id="s-t0", at_ns=5, reference_run="s-t0-primary",
                     runs={"s-t0-primary": CompactedRun(backend="primary", mode="forced", full=[1], compact=2, topk=20)},
                     reasons={"1": ["flip"]}, bytes_before=300, bytes_after=100)
    store.apply_compaction("s-t0", rec, []).result()
    assert store.compaction("s-t0") == rec
    with pytest.raises(RecordError) as e:  # a dict is refused, as by every write
        store.apply_compaction("s-t0", {"turn_id": "s-t0"}, [])
    assert e.value.reason == "kind"


def test_compact_row_lookups_and_lse_edges():
    import math

    from tensorverse.store.compact import CompactRow, log_sum_exp

    x = np.array([0.5, 3.0, 2.0, -1.0, 1.0], np.float32)
    c = compact_row(x, k=3, extra=[3])
    lse = math.log(sum(math.exp(float(v)) for v in x))
    assert list(c.ids) == [1, 2, 4, 3]
    got = c.logp([1, 3, 0, np.int64(4)])
    assert got[2] is None and len(got) == 4
    for g, v in zip([got[0], got[1], got[3]], [3.0, -1.0, 1.0]):
        assert abs(g - (v - lse)) < 1e-12
    assert c.rank([1, 2, 4, 3, 0]) == [0, 1, 2, None, None]  # the k-th itself has a rank
    assert compact_row(x, k=1).rank([1, 2]) == [0, None]
    tie = compact_row(np.array([3.0, 3.0, 1.0], np.float32), k=1, extra=[1])
    assert list(tie.ids) == [0, 1] and tie.rank([1, 0]) == [0, 0]  # at the k-th's logit: ranked
    none = CompactRow(vocab=3, dtype="float32", fingerprint=0, lse=0.0, k=0, ids=np.array([1], np.int32),
                      logits=np.array([2.0], np.float32))
    assert none.rank([1, 2]) == [None, None]
    assert math.isnan(log_sum_exp(np.zeros(0))) and math.isnan(log_sum_exp(np.array([0.0, -np.inf])))
    assert math.isnan(compact_row(np.array([1.0, -np.inf], np.float32), k=1).lse)
    assert log_sum_exp(np.array([[0.0, 1.0], [2.0, 3.0]])) == pytest.approx(
        math.log(sum(math.exp(v) for v in (0.0, 1.0, 2.0, 3.0))), abs=1e-12)


def test_top_ids_tie_at_the_kth_value_one_of_many_and_the_stable_fallback():
    x = np.array([5.0, 3.0, 3.0, 3.0, 1.0], np.float32)
    c = compact_row(x, k=3)
    assert list(c.ids) == [0, 1, 2] and c.k == 3
    rng = np.random.default_rng(5)
    big = rng.standard_normal(1000).astype(np.float32)
    assert list(compact_row(big, k=1).ids) == [max(range(1000), key=lambda i: (big[i], -i))]
    flat = rng.integers(0, 4, 3000).astype(np.float32)  # k = the whole row: many ties, by id
    want = sorted(range(3000), key=lambda i: (-float(flat[i]), i))
    assert compact_row(flat, k=3000).ids.tolist() == want


def test_compact_row_casts_checks_and_messages():
    x64 = np.array([0.1, 0.2, 0.3], np.float64)
    c = compact_row(x64, k=3)
    f32 = x64.astype(np.float32)
    assert c.logits.dtype == np.float32 and c.logits.tolist() == [f32[2], f32[1], f32[0]]
    assert c.fingerprint == blob_info(encode_row(f32))["crc32"]
    with pytest.raises(ValueError, match="^an empty row has no compact form$"):
        compact_row(np.zeros(0, np.float32))
    wide = np.arange(65536, dtype=np.float32)
    with pytest.raises(ValueError, match=r"^k must be in 1\.\.65535, got 65536$"):
        compact_row(wide, k=65536)
    many = compact_row(wide, k=1, extra=range(65536))  # 65535 extras: the most a blob holds
    assert many.k == 1 and len(many.ids) == 65536 and many.ids[0] == 65535
    with pytest.raises(ValueError, match="^too many extra ids$"):
        compact_row(np.arange(65537, dtype=np.float32), k=1, extra=range(65537))


def test_encode_compact_layout_whatever_the_array_dtypes_and_decode_dtypes():
    import struct
    import zlib

    from tensorverse.store.compact import CompactRow

    c = CompactRow(vocab=9, dtype="float16", fingerprint=0x12345678, lse=1.25, k=2,
                   ids=np.array([4, 1, 7], np.int64), logits=np.array([2.5, 1.5, -0.5], np.float64))
    body = struct.pack("<4sBBHHIId", b"TVCR", 1, 3, 2, 1, 9, 0x12345678, 1.25) + struct.pack("<3i", 4, 1, 7) + \
        struct.pack("<3f", 2.5, 1.5, -0.5)
    assert encode_compact(c) == body + struct.pack("<I", zlib.crc32(body))
    back = decode_compact(encode_compact(c))
    assert back.ids.dtype == np.int32 and back.logits.dtype == np.float32
    assert back.ids.tolist() == [4, 1, 7] and back.logits.tolist() == [2.5, 1.5, -0.5]
    empty = struct.pack("<4sBBHHIId", b"TVCR", 1, 1, 1, 0, 4, 0, 0.0)  # 30 bytes: not truncated
    with pytest.raises(CodecError, match="^compact row: 30 bytes for 1 entries$"):
        decode_compact(empty + struct.pack("<I", zlib.crc32(empty)))
    bad = bytearray(encode_compact(c))
    bad[27] ^= 1
    with pytest.raises(CodecError, match=r"^compact row 'r': checksum mismatch \(corrupt or truncated\)$"):
        decode_compact(bytes(bad), record="r")


def test_policy_messages_whole():
    for bad, msg in (({"topk": 0}, r"^topk must be in 1\.\.4096$"),
                     ({"top_kl": -1}, "^close_nats, top_kl and after_s must be >= 0$"),
                     ({"sample": 2.0}, r"^sample and close_share must be in \[0, 1\]$")):
        with pytest.raises(ValueError, match=msg):
            EvidencePolicy(**bad)


def test_sample_boundary_closest_cap_and_ties_and_delta_refs():
    import zlib

    from tensorverse.store.compaction import _closest, _delta_refs, _gap

    crc = zlib.crc32(b"0:T:0")
    assert not sampled(0, "T", 0, crc / 2**32) and sampled(0, "T", 0, (crc + 1) / 2**32)  # strictly under
    gaps = {5: 0.0, 2: 0.0, 9: 0.05}
    assert _closest(gaps, 0.0, 100) == [] and _closest(gaps, 0.01, 100) == [2]
    assert _closest(gaps, 0.02, 100) == [2, 5] and _closest({9: 0.05, 5: 0.01}, 0.01, 100) == [5]
    assert _gap(np.array([1.0, 3.0], np.float32)) == 2.0
    runs = [run({"id": "ref", "turn_id": "T", "backend": "sec", "mode": "forced"}),
            run({"id": "cand", "turn_id": "T", "backend": "cand", "mode": "forced"}),
            run({"id": "cfree", "turn_id": "T", "backend": "cand", "mode": "free"}),
            run({"id": "lone", "turn_id": "T", "backend": "x", "mode": "free"})]
    assert _delta_refs(runs, "ref") == {"cand": "ref", "cfree": "cand"}
    assert _delta_refs(runs, None) == {"cfree": "cand"}


def test_plan_close_calls_take_the_smallest_gap_of_a_position_and_free_gaps_by_value():
    runs = [run({"id": "f", "turn_id": "T", "backend": "c", "mode": "forced", "token_ids": list(range(100))}),
            run({"id": "g", "turn_id": "T", "backend": "d", "mode": "forced", "token_ids": list(range(100))}),
            run({"id": "r", "turn_id": "T", "backend": "c", "mode": "free", "token_ids": list(range(100))})]
    facts = [RowFacts("f", 4, 0.01), RowFacts("g", 4, 0.09), RowFacts("f", 8, 0.05),
             RowFacts("r", 5, 0.09), RowFacts("r", 6, 0.01)]
    pol = EvidencePolicy(close_nats=0.1, close_share=0.01, top_kl=0, sample=0.0)
    plan = plan_evidence("T", runs, [], facts, pol, 100)
    assert plan.forced == {4: {"close"}} and plan.free == {"r": {6: {"close"}}}


def test_plan_kl_ties_on_a_long_column_go_to_the_first_positions():
    rng = np.random.default_rng(8)
    kl = [float(v) for v in rng.integers(1, 4, 3000)]
    runs = [run({"id": "f", "turn_id": "T", "backend": "c", "mode": "forced", "token_ids": list(range(3000))})]
    comps = [comparison({"run_id": "f", "ref_run_id": "x", "mode": "forced", "metrics": {"kl": kl}})]
    pol = EvidencePolicy(close_nats=0.0, top_kl=5, sample=0.0)
    plan = plan_evidence("T", runs, comps, [], pol, 3000)
    want = sorted(range(3000), key=lambda p: (-kl[p], p))[:5]  # the highest, ties in position order
    assert plan.forced == {p: {"kl"} for p in want}


# -- compact_turn's skips and rows, due_turns' cutoff, compact_store's report and freed space ------

class _Spy:
    """A store that counts ``note_space_freed``, loses the turns in ``gone`` (``get_turn`` raises
    KeyError) and, with ``conflict``, has every ``apply_compaction`` raise CompactionConflict."""

    def __init__(self, st, gone=(), conflict=None):
        self._st, self.gone, self.conflict, self.freed = st, set(gone), conflict, 0

    def __getattr__(self, name):
        return getattr(self._st, name)

    def note_space_freed(self):
        self.freed += 1
        self._st.note_space_freed()

    def get_turn(self, tid):
        if tid in self.gone:
            raise KeyError(tid)
        return self._st.get_turn(tid)

    def apply_compaction(self, *a, **k):
        if self.conflict is not None:
            from tensorverse.store.store import CompactionConflict
            raise CompactionConflict(self.conflict)
        return self._st.apply_compaction(*a, **k)


def _rowless_sessions(store):
    """now 5 s, after_s 2 s: the cutoff is 3 s. sp (1 s) pinned; sa (2 s) old; sb exactly at the
    cutoff (due), its turn recorded at 4 s (recent); sc one ns after the cutoff (not due)."""
    for sid, tid, s_ns, t_ns in (("sp", "tp", 10**9, 10**9), ("sa", "ta", 2 * 10**9, 2 * 10**9),
                                 ("sb", "tb", 3 * 10**9, 4 * 10**9), ("sc", "tc", 3 * 10**9 + 1, 3 * 10**9 + 1)):
        store.put_session(tsession(sid, created_ns=s_ns)).result()
        store.put_turn(tturn(tid, sid, 0, created_ns=t_ns)).result()
    store.pin_session("sp").result()
    return 5 * 10**9, EvidencePolicy(after_s=2.0)


def test_due_turns_cutoff_is_inclusive_pins_are_skipped_and_compact_store_passes_now(store):
    from tensorverse.store.compaction import CompactionResult, due_turns

    now, pol = _rowless_sessions(store)
    assert list(due_turns(store, pol, now_ns=now)) == ["ta", "tb"]
    assert compact_store(store, pol, now_ns=now) == [CompactionResult("ta", "skipped", "no rows"),
                                                     CompactionResult("tb", "skipped", "recent")]


def test_compact_store_reports_a_gone_turn_and_frees_space_only_after_compacting(store):
    from tensorverse.store.compaction import CompactionResult

    now, pol = _rowless_sessions(store)
    spy = _Spy(store, gone={"ta"})
    assert compact_store(spy, pol, now_ns=now) == [CompactionResult("ta", "skipped", "gone: 'ta'"),
                                                   CompactionResult("tb", "skipped", "recent")]
    assert spy.freed == 0  # nothing compacted


def test_compact_store_frees_space_once_when_it_compacted_and_never_on_a_dry_run(store):
    workload(store, turns=1)
    spy = _Spy(store)
    assert [r.status for r in compact_store(spy, POLICY, dry_run=True)] == ["compacted"]
    assert spy.freed == 0 and store.compaction("t0") is None
    assert [r.status for r in compact_store(spy, POLICY)] == ["compacted"]
    assert spy.freed == 1
    assert compact_store(spy, POLICY) == [] and spy.freed == 1  # nothing left to do


def test_compact_turn_age_boundary_and_runs_without_rows(store):
    from tensorverse.store.compaction import CompactionResult

    store.put_session(tsession("s0")).result()
    store.put_turn(tturn("t", "s0", 0, created_ns=1)).result()
    store.put_run(trun("t.rec", "t", "p", "recorded", token_ids=[1])).result()
    store.put_run(trun("t.f", "t", "c", "forced", token_ids=[1])).result()
    pol = EvidencePolicy(after_s=1.0)
    assert compact_turn(store, "t", pol, now_ns=10**9) == CompactionResult("t", "skipped", "recent")
    # exactly after_s old: due; the forced run has no rows, so there is nothing to compact
    assert compact_turn(store, "t", pol, now_ns=10**9 + 1) == CompactionResult("t", "skipped", "no rows")


def test_compact_turn_not_compared_yet_with_and_without_a_primary(store):
    from tensorverse.store.compaction import CompactionResult

    store.put_session(tsession("s0", created_ns=1)).result()
    for tid, with_primary in (("ta", True), ("tb", False)):
        store.put_turn(tturn(tid, "s0", 0 if with_primary else 1, created_ns=1)).result()
        if with_primary:
            store.put_run(trun(f"{tid}.rec", tid, "p", "recorded", token_ids=[1])).result()
        store.put_run(trun(f"{tid}.f", tid, "c", "forced", token_ids=[1])).result()
        store.write_rows(f"{tid}.f", [(0, encode_row(np.array([1.0, 2.0, 3.0], np.float32)))]).result()
        assert compact_turn(store, tid, POLICY) == CompactionResult(tid, "skipped", "not compared yet")


def test_compact_turn_delta_already_and_conflict_whole(store):
    from tensorverse.store.compaction import CompactionResult

    turns, originals = workload(store, turns=2)
    t0 = turns[0]
    twin, ref = t0.run_ids[("twin", "forced")], t0.run_ids[("secondary", "forced")]
    store.write_rows(twin, [(0, encode_row(originals[twin][0], ref=originals[ref][0]))]).result()
    assert compact_turn(store, "t0", POLICY) == CompactionResult("t0", "skipped", f"row {twin}@0 is a delta already")
    assert compact_turn(_Spy(store, conflict="moved"), "t1", POLICY) == CompactionResult("t1", "conflict", "moved")
    assert store.compaction("t1") is None


def _hand_turn(store, *, corrupt: bool = False) -> None:
    """Turn th: primary th.rec (tokens 1, 2), forced th.ref (rows 0-2) and th.cand (rows 0-1),
    th.cand compared with th.ref; every row is 0..7 in float16 (top-2 gap 1 nat)."""
    store.put_session(tsession("s0", created_ns=1)).result()
    store.put_turn(tturn("th", "s0", 0, created_ns=1)).result()
    for rid, mode, backend, toks in (("th.rec", "recorded", "p", [1, 2]), ("th.ref", "forced", "sec", [1, 2, 0]),
                                     ("th.cand", "forced", "cand", [3])):
        store.put_run(trun(rid, "th", backend, mode, token_ids=toks)).result()
    blob = encode_row(np.arange(8, dtype=np.float16))
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x10
    store.write_rows("th.ref", [(0, bytes(bad) if corrupt else blob), (1, blob), (2, blob)]).result()
    store.write_rows("th.cand", [(0, blob), (1, blob)]).result()
    store.put_comparison("th.cand", "th.ref", tcomparison("th.cand", "th.ref", kind="full")).result()


# the hand turn's policies: nothing is evidence / every position is a close call (gap 1 < 2 nats)
HAND = EvidencePolicy(topk=4, close_nats=0.0, top_kl=0, sample=0.0, after_s=0.0)
HAND_CLOSE = replace(HAND, close_nats=2.0, close_share=1.0)


def test_compact_turn_float16_rows_topk_and_extras_at_the_ends_of_the_token_lists(store):
    """Nothing is evidence (no flips, KL, close calls or sample): every row is compacted, with
    top-4 ids, the run's token and the primary's where the row's position has one, the stored
    dtype (float16) and the stored blob's checksum."""
    from tensorverse.store.compact import decode_compact
    from tensorverse.store.compaction import CompactionResult

    _hand_turn(store)
    x = encode_row(np.arange(8, dtype=np.float16))  # top 4: ids 7, 6, 5, 4
    blobs = {("th.ref", p): x for p in (0, 1, 2)} | {("th.cand", p): x for p in (0, 1)}
    r = compact_turn(store, "th", HAND)
    got = {(rid, p): b for rid in ("th.ref", "th.cand") for p, b in store.read_compact_rows(rid)}
    assert set(got) == set(blobs)
    before = sum(len(b) for b in blobs.values())
    assert r == CompactionResult("th", "compacted", "", 0, 0, 5, before, sum(len(b) for b in got.values()))
    want_ids = {("th.ref", 0): [7, 6, 5, 4, 1], ("th.ref", 1): [7, 6, 5, 4, 2], ("th.ref", 2): [7, 6, 5, 4, 0],
                ("th.cand", 0): [7, 6, 5, 4, 1, 3], ("th.cand", 1): [7, 6, 5, 4, 2]}
    for key, blob in got.items():
        c = decode_compact(blob)
        assert (c.k, c.vocab, c.dtype, c.fingerprint) == (4, 8, "float16", blob_info(blobs[key])["crc32"])
        assert c.ids.tolist() == want_ids[key], key
    rec = store.compaction("th")
    assert rec.reference_run == "th.ref" and rec.reasons == {} and rec.free_reasons == {}
    assert rec.runs == {"th.ref": CompactedRun(backend="sec", mode="forced", compact=3, topk=4),
                        "th.cand": CompactedRun(backend="cand", mode="forced", compact=2, topk=4)}


def test_compact_turn_names_a_corrupt_row(store):
    _hand_turn(store, corrupt=True)
    with pytest.raises(CodecError, match=r"^logits record 'th\.ref@0': blob checksum mismatch"):
        compact_turn(store, "th", HAND)
    assert store.compaction("th") is None


def test_compact_turn_close_calls_are_the_runs_rows(store):
    # gap 1 < 2 nats everywhere; close_share 1.0 of the primary's 2 positions: positions 0 and 1
    _hand_turn(store)
    r = compact_turn(store, "th", HAND_CLOSE)
    rec = store.compaction("th")
    assert rec.reasons == {"0": ["close"], "1": ["close"]} and rec.free_reasons == {}
    assert rec.runs["th.ref"].full == [0, 1] and rec.runs["th.ref"].compact == 1
    assert rec.runs["th.cand"].full == [0, 1] and rec.runs["th.cand"].compact == 0
    assert (r.rows_full + r.rows_delta, r.rows_compact) == (4, 1)


def test_compact_turn_samples_by_the_turn_id(store):
    # crc32("0:th:0") / 2**32 = 0.9990, crc32("0:th:1") / 2**32 = 0.5343: only position 1 is under 0.6
    _hand_turn(store)
    compact_turn(store, "th", replace(HAND, sample=0.6))
    rec = store.compaction("th")
    assert rec.reasons == {"1": ["sample"]}
    assert rec.runs["th.ref"].full == [1] and rec.runs["th.cand"].full == [1]


def test_compact_turn_without_a_full_reference_and_a_two_dimensional_row(store):
    # only top-k comparisons: no reference run; th.ref's row 1 stored as shape (1, 8): flattened
    from tensorverse.store.compact import decode_compact

    _hand_turn(store)
    store.write_rows("th.ref", [(1, encode_row(np.arange(8, dtype=np.float16).reshape(1, 8)))]).result()
    store.put_comparison("th.cand", "th.ref", tcomparison("th.cand", "th.ref", kind="topk")).result()
    store.put_comparison("th.ref", "th.rec", tcomparison("th.ref", "th.rec", kind="topk")).result()
    r = compact_turn(store, "th", HAND)
    assert (r.status, r.rows_full, r.rows_delta, r.rows_compact) == ("compacted", 0, 0, 5)
    assert store.compaction("th").reference_run is None
    c = decode_compact(dict(store.read_compact_rows("th.ref"))[1])
    assert (c.vocab, c.k, c.ids.tolist()) == (8, 4, [7, 6, 5, 4, 2])


def test_compact_turn_an_older_retry_of_a_backend_is_compacted_whole_and_a_tie_goes_to_the_later_id(store):
    _hand_turn(store)  # runs are read in id order: th.cand0 after th.cand
    blob = encode_row(np.arange(8, dtype=np.float16))
    store.put_run(trun("th.cand0", "th", "cand", "forced", token_ids=[3], created_ns=1)).result()
    store.write_rows("th.cand0", [(0, blob), (1, blob)]).result()
    pol = HAND_CLOSE
    r = compact_turn(store, "th", pol, dry_run=True)  # th.cand (newer, compared) is the evidence
    assert (r.status, r.rows_full + r.rows_delta, r.rows_compact) == ("compacted", 4, 3)
    compact_turn(store, "th", pol)
    rec = store.compaction("th")
    assert rec.runs["th.cand0"].full == [] and rec.runs["th.cand0"].compact == 2
    assert rec.runs["th.cand"].full == [0, 1]


def test_compact_turn_a_retry_as_old_as_the_compared_run_is_the_latest(store):
    from tensorverse.store.compaction import CompactionResult

    _hand_turn(store)
    same = store.get_run("th.cand").created_ns
    store.put_run(trun("th.cand0", "th", "cand", "forced", token_ids=[3], created_ns=same)).result()
    store.write_rows("th.cand0", [(0, encode_row(np.arange(8, dtype=np.float16)))]).result()
    assert compact_turn(store, "th", POLICY) == CompactionResult("th", "skipped", "not compared yet")


def test_compact_turn_no_delta_against_a_row_of_another_shape(store):
    _hand_turn(store)
    store.write_rows("th.cand", [(0, encode_row(np.arange(9, dtype=np.float16)))]).result()  # 9 ids, not 8
    assert compact_turn(store, "th", HAND_CLOSE).status == "compacted"
    cand = store.compaction("th").runs["th.cand"]
    assert cand.full == [0, 1] and 0 not in cand.delta
    assert decode_row(store.read_row("th.cand", 0)).tolist() == list(range(9))


# -- the top-2 gap, rows that do not decode, free close calls and delta lengths in compact_turn ----


def _f16_blob(bits, *, crc_row: int | None = None, planes=None) -> bytes:
    """A float16 'plain' blob built by hand from the layout in codec.py's docstring: head
    ``<4sBBBBII`` (magic, version 1, dtype 3, mode 0, ndim 1, row crc, ref crc 0), the shape
    (uint64), 2 planes, each ``<BI`` (method 0 raw / 2 zero, length), the payloads, and the
    crc32 of all that. ``planes`` replaces the two plane payloads (raw) as given."""
    import struct
    import zlib

    pk = np.asarray(bits, dtype="<u2")
    crc = zlib.crc32(pk.tobytes()) if crc_row is None else crc_row
    if planes is None:
        planes = [(pk & 0xFF).astype(np.uint8).tobytes(), (pk >> 8).astype(np.uint8).tobytes()]
        table = b"".join(struct.pack("<BI", 2, 0) if not any(p) else struct.pack("<BI", 0, len(p)) for p in planes)
        payload = b"".join(p for p in planes if any(p))
    else:
        table = b"".join(struct.pack("<BI", 0, len(p)) for p in planes)
        payload = b"".join(planes)
    body = struct.pack("<4sBBBBII", b"TVLG", 1, 3, 0, 1, crc, 0) + struct.pack("<Q", pk.size) + bytes([2]) + \
        table + payload
    return body + struct.pack("<I", zlib.crc32(body))


F16_ONE = 0x3C00  # 1.0 in float16
F16_ARANGE8 = [0x0000, 0x3C00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600, 0x4700]  # 0.0 .. 7.0


def test_gap_is_the_top_two_whatever_order_numpys_partition_leaves_the_tail_in():
    """``np.partition(x, size - 2)`` puts the largest entry last; a partition at ``size - 3``
    only puts the largest two in the last two places, in any order. numpy's scalar introselect
    leaves [0, 2, 1] as it is there: the gap must still be 2 - 1 = 1. numpy uses that select for
    long double on every CPU, and for float32 on a CPU without its SIMD select (without AVX2 or
    AVX-512); this machine's SIMD select happens to leave the last two in order, so the test
    reads long-double rows."""
    from tensorverse.store.compaction import _gap

    cases = [[0.0, 2.0, 1.0], [0.0, 1.0, 3.0, 2.0], [0.0, 1.0, 2.0, 4.0, 3.0], [0.0, 1.0, 3.0, 2.0, 5.0, 4.0]]
    for c in cases:
        assert _gap(np.array(c, np.longdouble)) == 1.0, c
        assert _gap(np.array(c, np.float32)) == 1.0, c


def test_compact_turn_names_a_row_that_passes_the_blob_checksum_but_does_not_decode(store):
    """th.ref@0 is a well-framed blob (its trailing crc32 is right, so ``blob_info`` reads it)
    whose row checksum is wrong, or whose raw planes are 7 and 9 bytes for 8 entries: the
    decoding's error names the record."""
    import zlib

    _hand_turn(store)
    good = np.array(F16_ARANGE8, np.uint16)
    planes = (good & 0xFF).astype(np.uint8).tobytes() + (good >> 8).astype(np.uint8).tobytes()
    crc = zlib.crc32(good.astype("<u2").tobytes())
    assert decode_row(_f16_blob(good)).tolist() == list(range(8))  # the helper builds real blobs
    cases = {_f16_blob(good, crc_row=crc ^ 1): "decoded row checksum mismatch",
             _f16_blob(good, planes=[planes[:7], planes[7:]]): "plane 0: raw data of 7 bytes, expected 8"}
    for blob, what in cases.items():
        assert blob_info(blob)["mode"] == "plain"  # passes the framing and the blob checksum
        store.write_rows("th.ref", [(0, blob)]).result()
        with pytest.raises(CodecError) as e:
            compact_turn(store, "th", HAND)
        assert str(e.value) == f"logits record 'th.ref@0': {what}"
        assert store.compaction("th") is None


def test_compact_turn_a_free_close_call_not_kept_in_the_forced_run_stays_full(store):
    """th.free (backend cand, like the forced th.cand) has a close call at 0 (gap 0.5 < 0.75)
    where every forced row's gap is 1: only th.free keeps position 0. Its delta reference's
    row 0 (th.cand@0) is compacted, so th.free@0 must stay full, not become a delta against it
    (a delta would cost 47 bytes against its 55)."""
    _hand_turn(store)
    close = F16_ARANGE8[:7] + [0x4680]  # 0 .. 6, 6.5
    free0, free1 = _f16_blob(close), _f16_blob(F16_ARANGE8)
    store.put_run(trun("th.free", "th", "cand", "free", token_ids=[1, 2])).result()
    store.write_rows("th.free", [(0, free0), (1, free1)]).result()
    store.put_comparison("th.free", "th.rec", tfree_comparison("th.free", "th.rec", kind="full")).result()
    r = compact_turn(store, "th", replace(HAND, close_nats=0.75, close_share=1.0))
    rec = store.compaction("th")
    assert rec.reasons == {} and rec.free_reasons == {"th.free": {"0": ["close"]}}
    assert rec.runs["th.free"] == CompactedRun(backend="cand", mode="free", full=[0], compact=1, topk=4)
    assert rec.runs["th.cand"].full == [] and rec.runs["th.cand"].compact == 2
    assert store.read_row("th.free", 0) == free0 and not blob_info(store.read_row("th.free", 0))["needs_ref"]
    assert (r.rows_full, r.rows_delta, r.rows_compact) == (1, 0, 6)


def test_compact_turn_a_delta_as_long_as_the_stored_row_is_not_taken(store):
    """th.cand@0 is 1.0 eight times (plane 0 zero, plane 1 raw: 16 + 8 + 1 + 10 + 8 + 4 = 47
    bytes); th.ref@0 is the same but one ulp up in its first entry. The delta (zigzag 1 in one
    entry: plane 0 raw, plane 1 zero) is 47 bytes too: not smaller, so the row stays as stored.
    Row 1 (0..7 in both runs) is a delta: its difference is all zero."""
    _hand_turn(store)
    row = [F16_ONE] * 8
    ref = [F16_ONE + 1] + [F16_ONE] * 7
    cand0 = _f16_blob(row)
    assert len(cand0) == 47
    enc = encode_row(np.array(row, np.uint16).view(np.float16), ref=np.array(ref, np.uint16).view(np.float16))
    assert blob_info(enc)["needs_ref"] and len(enc) == 47  # the premise: a delta exactly as long
    store.write_rows("th.ref", [(0, _f16_blob(ref))]).result()
    store.write_rows("th.cand", [(0, cand0)]).result()
    r = compact_turn(store, "th", HAND_CLOSE)
    cand = store.compaction("th").runs["th.cand"]
    assert (cand.full, cand.delta, cand.delta_ref) == ([0, 1], [1], "th.ref")
    assert store.read_row("th.cand", 0) == cand0
    assert blob_info(store.read_row("th.cand", 1))["needs_ref"]
    assert (r.rows_full, r.rows_delta) == (3, 1)


def test_compact_turn_a_delta_longer_than_the_stored_row_is_not_taken(store):
    """th.cand@0 is 1.0 4096 times (zstd makes it a few dozen bytes); th.ref@0 is 1.0 one ulp
    up or down at random in every entry: the delta is a dense plane of 1s and 2s, hundreds of
    bytes, which the codec still writes as a delta (under 1 byte an entry). It is longer than
    the stored row: the row stays as stored."""
    _hand_turn(store)
    rng = np.random.default_rng(27)
    row = np.full(4096, F16_ONE, np.uint16).view(np.float16)
    ref = (F16_ONE + rng.choice(np.array([-1, 1]), 4096)).astype(np.uint16).view(np.float16)
    cand0 = encode_row(row)
    enc = encode_row(row, ref=ref)
    assert blob_info(enc)["needs_ref"] and len(enc) > len(cand0) + 100  # the premise
    store.write_rows("th.ref", [(0, encode_row(ref))]).result()
    store.write_rows("th.cand", [(0, cand0)]).result()
    compact_turn(store, "th", HAND_CLOSE)
    cand = store.compaction("th").runs["th.cand"]
    assert (cand.full, cand.delta, cand.delta_ref) == ([0, 1], [1], "th.ref")
    assert store.read_row("th.cand", 0) == cand0


def test_a_viewer_reading_rows_while_retention_prunes_them_shows_none_and_says_so(store):
    """`tensorverse view` runs beside a live proxy: a turn's rows can be pruned between the
    viewer's first look at a run and its next position. That position is shown as having no
    row (the stored comparisons keep the numbers), never an error page."""
    from tensorverse.viz.lane import Lane
    from tensorverse.viz.rows import RowReader

    workload(store, turns=1)
    r = next(r for r in store.iter_runs("t0") if r.mode == "forced" and r.backend == "candidate")
    lane = Lane(backend=r.backend, mode=r.mode, run_id=r.id, token_ids=list(r.token_ids), capture=r.capture)
    warnings: list[str] = []
    reader = RowReader(store, warnings)
    assert reader.has_rows(lane)  # the viewer's first look: rows there
    assert store.drop_session_rows("s0").result() > 0
    assert reader.get(lane, 1) is None
    assert any("rows pruned by [retention]" in w for w in warnings)
