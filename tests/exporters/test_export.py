"""Parquet and JSONL export: read back with pyarrow and DuckDB, the figures equal the store's."""

from __future__ import annotations

import json
import time

import duckdb
import pyarrow.parquet as pq
import pytest
from tests.exporters.exporters_support import ROOT, store_comparisons  # type: ignore[import-not-found]

from tensorverse.cli import main
from tensorverse.exporters.export import SCHEMA, ExportError, export_store, parse_since
from tensorverse.store.records import Turn
from tensorverse.testing.records import trun, tsession


@pytest.fixture
def built(make_pipeline):
    p = make_pipeline()
    p.send(5)
    return p


def test_parquet_roundtrip_matches_the_store(built, tmp_path):
    out = tmp_path / "pq"
    result = export_store(built.store, out, fmt="parquet")
    comps = store_comparisons(built.store)
    forced = [c for c in comps if c.mode == "forced" and c.status == "ok"]
    assert result["comparisons"]["rows"] == len(comps)
    assert result["positions"]["rows"] == sum(c.n for c in forced)
    assert result["sessions"]["rows"] == 5 and result["turns"]["rows"] == 5
    for table, cols in SCHEMA.items():
        if table in result:
            assert pq.read_schema(out / f"{table}.parquet").names == list(cols)

    con = duckdb.connect()
    pos = str(out / "positions.parquet")
    cmp_ = str(out / "comparisons.parquet")
    # flips per (backend, reference) from the per-position rows == the store's flip lists
    got = dict(((b, r), f) for b, r, f in con.execute(
        f"select backend, ref_role, sum(flip::int) from '{pos}' group by all").fetchall())
    for (b, r), f in got.items():
        assert f == sum(len(c.flips) for c in forced if c.backend == b and c.ref_role == r)
    # KL mean per comparison from the positions == the stored summary
    rows = con.execute(f"select run_id, ref_run_id, avg(kl), max(kl), count(*) from '{pos}' group by all").fetchall()
    by_key = {(c.run_id, c.ref_run_id): c for c in forced}
    for run_id, ref_run_id, mean, mx, n in rows:
        s = by_key[(run_id, ref_run_id)].summary
        assert mean == pytest.approx(s["kl"]["mean"], rel=1e-12) and mx == pytest.approx(s["kl"]["max"])
        assert n == s["n"]
    # the comparisons table agrees with the positions table
    agg = con.execute(f"select sum(flips), sum(n) from '{cmp_}' where mode = 'forced' and status = 'ok'").fetchone()
    assert agg == (sum(len(c.flips) for c in forced), sum(c.n for c in forced))
    # flip classes (issue 19): every flipped position has one, equal to the store's, and the
    # comparisons' per-class counts agree with the positions
    by_class = dict(((b, r, k), f) for b, r, k, f in con.execute(
        f"select backend, ref_role, flip_class, count(*) from '{pos}' where flip group by all").fetchall())
    want: dict = {}
    for c in forced:
        for k in c.flip_classes:
            want[(c.backend, c.ref_role, k)] = want.get((c.backend, c.ref_role, k), 0) + 1
    assert by_class == want and None not in {k for _, _, k in by_class}
    assert con.execute(f"select count(*) from '{pos}' where not flip and flip_class is not null").fetchone() == (0,)
    for run_id, ref_run_id, fbc, rt in con.execute(
            f"select run_id, ref_run_id, flips_by_class, runtime_flips from '{cmp_}' where mode = 'forced' "
            "and status = 'ok'").fetchall():
        assert json.loads(fbc) == by_key[(run_id, ref_run_id)].flips_by_class and rt == json.loads(fbc)["runtime"]
    ex = con.execute(f"select excess_low, excess, excess_high from '{cmp_}' where excess is not null").fetchall()
    assert ex and all(lo <= e <= hi for lo, e, hi in ex)
    # the primary's parser check, per turn
    checked = con.execute(f"select count(*) from '{out / 'runs.parquet'}' where mode = 'recorded' "
                          "and parser_verdict is not null").fetchone()[0]
    assert checked == 5
    # and pyarrow reads the same
    t = pq.read_table(pos)
    assert t.num_rows == result["positions"]["rows"]
    assert set(t.column("region").to_pylist()) - {None} <= {"thinking", "content", "tool_syntax", "tool_name", "tool_args"}
    # the primary's token at each position came from the turn
    turns = {r["turn_id"]: r["output_token_ids"] for r in pq.read_table(out / "turns.parquet").to_pylist()}
    for r in t.slice(0, 50).to_pylist():
        assert r["token"] == turns[r["turn_id"]][r["position"]]
    # texts stay out unless asked for
    assert set(pq.read_table(out / "runs.parquet").column("text").to_pylist()) == {None}


def test_jsonl_equals_parquet(built, tmp_path):
    export_store(built.store, tmp_path / "pq", fmt="parquet")
    export_store(built.store, tmp_path / "js", fmt="jsonl", include_text=True)
    for table in ("sessions", "turns", "runs", "comparisons", "positions"):
        a = pq.read_table(tmp_path / "pq" / f"{table}.parquet").to_pylist()
        lines = (tmp_path / "js" / f"{table}.jsonl").read_text().splitlines()
        b = [json.loads(x) for x in lines]
        assert len(a) == len(b)
        for x, y in zip(a, b):
            for k in SCHEMA[table]:
                if k == "text":
                    continue
                if isinstance(x[k], float):
                    assert y[k] == pytest.approx(x[k], rel=1e-12), (table, k)
                else:
                    assert x[k] == y[k], (table, k)
    runs = [json.loads(x) for x in (tmp_path / "js" / "runs.jsonl").read_text().splitlines()]
    assert any(r["text"] for r in runs)  # include_text
    con = duckdb.connect()
    n = con.execute(f"select count(*) from read_json_auto('{tmp_path / 'js' / 'positions.jsonl'}')").fetchone()[0]
    assert n == len(pq.read_table(tmp_path / "pq" / "positions.parquet"))


def test_logits_rows(built, tmp_path):
    res = export_store(built.store, tmp_path / "lg", fmt="parquet", tables=["runs", "logits"])
    t = pq.read_table(tmp_path / "lg" / "logits.parquet")
    assert res["logits"]["rows"] == t.num_rows > 0
    r = t.slice(0, 1).to_pylist()[0]
    assert r["vocab"] == len(r["logits"]) == 64
    from tensorverse.shadow.compare import load_rows

    row = load_rows(built.store, r["run_id"], [r["position"]])[0]
    assert r["logits"] == pytest.approx(row.tolist())


def test_since(built, tmp_path):
    assert parse_since(None) == 0
    now = time.time_ns()
    assert parse_since("2h", now_ns=now) == now - 7200 * 10**9
    assert parse_since("2026-11-30") == parse_since("2026-11-30T00:00:00Z")
    assert parse_since("1700000000") == 1700000000 * 10**9
    with pytest.raises(ExportError):
        parse_since("last tuesday")
    res = export_store(built.store, tmp_path / "future", fmt="jsonl", since_ns=time.time_ns() + 10**12)
    assert all(v["rows"] == 0 for v in res.values())
    res = export_store(built.store, tmp_path / "recent", fmt="jsonl", since_ns=parse_since("1h"))
    assert res["sessions"]["rows"] == 5


def test_cli(built, tmp_path, capsys):
    store = str(built.store.path)
    built.store.submit(lambda txn: None).result(10)
    assert main(["export", "parquet", "--store", store, "--out", str(tmp_path / "a"), "--since", "7d"]) == 0
    assert "positions.parquet" in capsys.readouterr().out
    assert main(["export", "--format", "jsonl", "--store", store, "--out", str(tmp_path / "b"),
                 "--tables", "sessions,comparisons"]) == 0
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["comparisons.jsonl", "sessions.jsonl"]
    assert main(["export", "jsonl", "--store", store, "--out", str(tmp_path / "c"), "--since", "soon"]) == 2
    assert "--since" in capsys.readouterr().err
    assert main(["export", "jsonl", "--store", str(tmp_path / "nope"), "--out", str(tmp_path / "d")]) == 2
    assert main(["export"]) == 2  # no kind, no --format: help


def test_schema_is_documented():
    docs = (ROOT / "docs" / "metrics.md").read_text()
    for table, cols in SCHEMA.items():
        assert f"`{table}`" in docs, table
        for col in cols:
            assert f"`{col}`" in docs, (table, col)


def test_engine_states_in_parquet(tmp_path):
    """Rows captured with an engine state: the ``engine`` table has one row per captured row
    and the ``positions`` table the batch size of both sides; rows without one give nulls."""
    import numpy as np

    from tensorverse.shadow.compare import compare_forced
    from tensorverse.store import Store
    from tensorverse.store.codec import encode_row
    from tensorverse.store.engine_state import RUNNER_V1, EngineState

    rng = np.random.default_rng(3)
    tokens = [1, 2, 3]
    with Store.open(tmp_path / "s") as store:
        store.put_session(tsession("s", created_ns=time.time_ns())).result()
        store.put_turn(Turn(id="t", session_id="s", index=0, prompt_token_ids=[9], output_token_ids=tokens)).result()
        runs = {}
        for rid, batch in (("ref", 1), ("cand", 8)):
            run = trun(rid, "t", rid, "forced", session_id="s", status="ok", capture="full", token_ids=tokens,
                       rows={"expected": 3, "present": 3, "complete": True})
            store.put_run(run).result()
            runs[rid] = run
            rows = [(p, encode_row(rng.standard_normal(16).astype(np.float32)),
                     EngineState(RUNNER_V1, 10 + p, batch, p % batch, 0) if p < 2 or rid == "ref" else None)
                    for p in range(3)]
            store.write_rows(rid, rows).result()
        store.put_comparison("cand", "ref", compare_forced(store, runs["cand"], runs["ref"], tokens)).result()
        res = export_store(store, tmp_path / "pq", fmt="parquet")
    eng = pq.read_table(tmp_path / "pq" / "engine.parquet")
    assert eng.schema.names == list(SCHEMA["engine"]) and res["engine"]["rows"] == 5
    got = sorted((r["run_id"], r["position"], r["batch_size"], r["step"], r["runner"], r["context_tokens"])
                 for r in eng.to_pylist())
    assert got == [("cand", 0, 8, 10, "v1", None), ("cand", 1, 8, 11, "v1", None),
                   ("ref", 0, 1, 10, "v1", None), ("ref", 1, 1, 11, "v1", None), ("ref", 2, 1, 12, "v1", None)]
    pos = pq.read_table(tmp_path / "pq" / "positions.parquet").to_pylist()
    assert [(r["position"], r["batch_size"], r["ref_batch_size"]) for r in pos] == [(0, 8, 1), (1, 8, 1), (2, None, 1)]
