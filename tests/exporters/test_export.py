"""Parquet and JSONL export: read back with pyarrow and DuckDB, the figures equal the store's."""

from __future__ import annotations

import json
import time

import duckdb
import pyarrow.parquet as pq
import pytest
from exporters_support import ROOT, store_comparisons  # type: ignore[import-not-found]

from tensorverse.cli import main
from tensorverse.exporters.export import SCHEMA, ExportError, export_store, parse_since


@pytest.fixture
def built(make_pipeline):
    p = make_pipeline()
    p.send(5)
    return p


def test_parquet_roundtrip_matches_the_store(built, tmp_path):
    out = tmp_path / "pq"
    result = export_store(built.store, out, fmt="parquet")
    comps = store_comparisons(built.store)
    forced = [c for c in comps if c["mode"] == "forced" and c["status"] == "ok"]
    assert result["comparisons"]["rows"] == len(comps)
    assert result["positions"]["rows"] == sum(c["n"] for c in forced)
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
        assert f == sum(len(c["flips"]) for c in forced if c["backend"] == b and c["ref_role"] == r)
    # KL mean per comparison from the positions == the stored summary
    rows = con.execute(f"select run_id, ref_run_id, avg(kl), max(kl), count(*) from '{pos}' group by all").fetchall()
    by_key = {(c["run_id"], c["ref_run_id"]): c for c in forced}
    for run_id, ref_run_id, mean, mx, n in rows:
        s = by_key[(run_id, ref_run_id)]["summary"]
        assert mean == pytest.approx(s["kl"]["mean"], rel=1e-12) and mx == pytest.approx(s["kl"]["max"])
        assert n == s["n"]
    # the comparisons table agrees with the positions table
    agg = con.execute(f"select sum(flips), sum(n) from '{cmp_}' where mode = 'forced' and status = 'ok'").fetchone()
    assert agg == (sum(len(c["flips"]) for c in forced), sum(c["n"] for c in forced))
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
