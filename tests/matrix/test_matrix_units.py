"""Fast tests of the matrix's pure parts: spec parsing and errors, server argv/env, ddmin,
marginals, the HTML page (no vLLM)."""

from __future__ import annotations


import pytest

from tensorverse.matrix.bisect import CachedOracle, ddmin
from tensorverse.matrix.html import render_html
from tensorverse.matrix.hypercube import marginals
from tensorverse.matrix.launcher import build_command, build_env
from tensorverse.matrix.spec import SpecError, parse_spec, settings_key

BASE = {"model": {"path": "/m/qwen3", "served_name": "q"},
        "server": {"options": {"--dtype": "bfloat16"}, "env": {"OMP_NUM_THREADS": "1"}}}


def spec(**kw):
    return parse_spec({**BASE, **kw})


def test_grid_points_named_points_and_reference():
    s = spec(axes={"--dtype": ["bfloat16", "float32"], "VLLM_BATCH_INVARIANT": ["0", "1"]},
             points=[{"name": "fp8kv", "settings": {"--kv-cache-dtype": "fp8"}}])
    names = [p.name for p in s.all_points()]
    assert names == ["dtype=bfloat16,VLLM_BATCH_INVARIANT=0", "dtype=bfloat16,VLLM_BATCH_INVARIANT=1",
                     "dtype=float32,VLLM_BATCH_INVARIANT=0", "dtype=float32,VLLM_BATCH_INVARIANT=1", "fp8kv"]
    assert s.reference == names[0]
    eff = s.effective(s.point("fp8kv").settings)
    assert eff == {"--dtype": "bfloat16", "--kv-cache-dtype": "fp8", "OMP_NUM_THREADS": "1"}
    assert s.axis_values()["--kv-cache-dtype"] == [None, "fp8"]


@pytest.mark.parametrize("bad,where", [
    ({"axes": {"--Dtype": ["x"]}}, "axes"),
    ({"axes": {"--dtype": []}}, "--dtype: an axis needs at least one value"),
    ({"axes": {"--port": [1, 2]}}, "set by tensorverse matrix itself"),
    ({"axes": {"--tensor-parallel-size": [1, "two"]}}, "--tensor-parallel-size must be a whole number"),
    ({"points": [{"name": "a", "settings": {"--pipeline-parallel-size": 0}}]}, "--pipeline-parallel-size must"),
    ({"points": [{"name": "a", "settings": {"NCCL ALGO": "x"}}]}, "points[0].settings"),
    ({"points": [{"name": "a", "setings": {}}]}, "points[0].setings: unknown key"),
    ({"points": [{"name": "a"}, {"name": "a"}]}, "names repeat"),
    ({"axes": {"--dtype": ["a"]}, "matrix": {"reference": "nope"}}, "matrix.reference"),
    ({"server": {"options": {"NCCL_ALGO": "x"}}}, "server.options"),
    ({}, "give [axes]"),
])
def test_spec_errors_name_the_key(bad, where):
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, **bad})
    assert where in str(e.value) and e.value.reason == "invalid"  # the message naming the key is the contract


def test_a_spec_file_unread_not_toml_or_asking_for_an_unknown_point_is_refused_with_its_reason(tmp_path):
    from tensorverse.matrix.spec import load_spec

    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "missing.toml")
    assert e.value.reason == "unreadable"
    (tmp_path / "bad.toml").write_text("[model\n")
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "bad.toml")
    assert e.value.reason == "syntax"
    with pytest.raises(SpecError) as e:
        spec(axes={"--dtype": ["bfloat16"]}).point("fp8kv")
    assert e.value.reason == "unknown_point"


def test_settings_key_depends_on_effective_settings_only():
    s = spec(axes={"--dtype": ["bfloat16", "float32"]}, points=[{"name": "again", "settings": {}}])
    assert settings_key(s, {}, "c") == settings_key(s, {"--dtype": "bfloat16"}, "c")  # the base value
    assert settings_key(s, {}, "c") != settings_key(s, {"--dtype": "float32"}, "c")
    assert settings_key(s, {}, "c") != settings_key(s, {}, "other corpus")


def test_command_and_environment():
    cmd = build_command("py", "/m", "q", 8000, {"--dtype": "float32", "--enable-prefix-caching": False,
                                                "--enforce-eager": True, "--x": [1, 2], "NCCL_ALGO": "Ring"})
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[cmd.index("--x") + 1: cmd.index("--x") + 3] == ["1", "2"]
    assert "NCCL_ALGO" not in cmd and cmd[cmd.index("--max-logprobs") + 1] == "-1"
    env = build_env({"NCCL_ALGO": "Ring", "GONE": "", "--kv-cache-memory-bytes": 1, "FLAG": True},
                    "dir:/s", base={"GONE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "TENSORVERSE_CAPTURE": "0"})
    assert env == {"NCCL_ALGO": "Ring", "FLAG": "1", "TENSORVERSE_CAPTURE_SINK": "dir:/s"}


def test_ddmin_finds_the_one_culprit_in_fewer_calls_than_the_grid():
    for k in (2, 3, 5, 8):
        changes = [f"s{i}" for i in range(k)]
        for culprit in changes:
            calls = []

            def oracle(c, culprit=culprit):
                calls.append(c)  # noqa: B023 - called in this iteration
                return culprit in c

            r = ddmin(changes, oracle)
            assert r.minimal == [culprit]
            assert len(calls) + 2 < 2 ** k or k == 2  # + good and bad; k=2: 3 of 4
            assert len(set(calls)) == len(calls)  # the cache: no set asked twice


def test_ddmin_interaction_of_two_settings_is_one_minimal():
    changes = list("abcdef")
    r = ddmin(changes, lambda c: {"b", "e"} <= c)
    assert sorted(r.minimal) == ["b", "e"]
    for drop in r.minimal:  # 1-minimal: removing either loses the flip
        assert not {"b", "e"} <= set(r.minimal) - {drop}


def test_ddmin_unresolved_runs_count_as_passing():
    o = CachedOracle(lambda c: None if "a" in c and len(c) == 1 else "b" in c)
    r = ddmin(["a", "b", "c"], o)
    assert r.minimal == ["b"]


def _pt(name, eff, flips, positions, ref=False, status="ok"):
    """A point whose flips sit in the first turns of ten turns of positions/10 each (as replay's
    summary counts them: ``turn_counts``)."""
    per = positions // 10
    counts = [{"case": f"c{t % 2}", "turn": t // 2, "positions": per, "flips": min(per, max(0, flips - t * per))}
              for t in range(10)] if positions else []
    return {"name": name, "effective": eff, "reference": ref, "status": status,
            "summary": {"positions": positions, "flips": flips, "flip_rate": flips / positions if positions else None,
                        "kl": {"mean": 1e-6}, "free_turns": 2, "verdicts": {"match": 1, "value_mismatch": 1},
                        "turn_counts": counts}}


def test_marginals_pool_positions_and_average_points():
    pts = [_pt("ref", {"d": "bf16", "p": True}, 0, 0, ref=True),
           _pt("a", {"d": "bf16", "p": False}, 0, 100),
           _pt("b", {"d": "fp32", "p": True}, 10, 100),
           _pt("c", {"d": "fp32", "p": False}, 30, 300),
           _pt("x", {"d": "fp32", "p": False}, 0, 0, status="start_failed")]
    m = marginals(pts, {"d": ["bf16", "fp32"], "p": [True, False]})
    bf, fp = m["d"]
    assert bf["points"] == ["a"] and bf["flip_rate"] == 0.0
    assert fp["points"] == ["b", "c"] and fp["flip_rate"] == pytest.approx(40 / 400)
    assert fp["mean_point_flip_rate"] == pytest.approx((0.1 + 0.1) / 2)
    assert fp["effect"] == pytest.approx(0.1) and fp["flip_rate_ci"][0] < 0.1 < fp["flip_rate_ci"][1]
    assert bf["flip_rate_ci"] == [0.0, 0.0]
    assert m["p"][1]["flips"] == 30 and m["p"][1]["toolcall_mismatch_rate"] == 0.5


def test_marginal_interval_clusters_the_same_turn_across_points():
    """Two points of one value flip in the same turn: that turn is one cluster of 2 x its
    positions (not two independent ones), so the interval is the cluster bootstrap of the
    summed turns."""
    from tensorverse.analysis.intervals import cluster_bootstrap

    pts = [_pt("ref", {"d": "bf16"}, 0, 0, ref=True), _pt("b", {"d": "fp32"}, 10, 100), _pt("c", {"d": "fp32"}, 10, 100)]
    fp = marginals(pts, {"d": ["bf16", "fp32"]})["d"][1]
    want = cluster_bootstrap([20] + [0] * 9, [20] * 10).bounds()
    assert fp["flip_rate_ci"] == want and fp["flip_rate"] == pytest.approx(0.1)


def test_marginal_effect_interval_is_the_paired_one_the_hypercube_gives_for_one_point_a_value():
    """One point a value over the same turns: ``effect_ci`` is the cluster bootstrap of the
    turn-by-turn difference of flips, the hypercube site's ``vs_reference`` interval; the base
    value has none."""
    from tensorverse.analysis.intervals import cluster_bootstrap

    pts = [_pt("ref", {"d": "a"}, 0, 0, ref=True), _pt("b", {"d": "bf16"}, 10, 100), _pt("c", {"d": "fp32"}, 30, 100)]
    bf, fp = marginals(pts, {"d": ["bf16", "fp32"]})["d"]
    assert bf["effect_ci"] is None
    d = [10 - 10, 10 - 0, 10 - 0] + [0] * 7  # fp32 flips in its first 3 turns, bf16 in its first one
    assert fp["effect_ci"] == cluster_bootstrap(d, [10] * 10).bounds()
    assert fp["effect"] == pytest.approx(0.2) and fp["effect_ci"][0] <= 0.2 <= fp["effect_ci"][1]


def test_marginal_effect_interval_with_more_points_on_one_side_weighs_each_side_by_its_points():
    pts = [_pt("ref", {"d": "a"}, 0, 0, ref=True), _pt("b", {"d": "bf16"}, 10, 100),
           _pt("c", {"d": "fp32"}, 30, 100), _pt("e", {"d": "fp32"}, 20, 100)]
    from tensorverse.analysis.intervals import cluster_bootstrap

    fp = marginals(pts, {"d": ["bf16", "fp32"]})["d"][1]
    assert fp["effect"] == pytest.approx(50 / 200 - 10 / 100)
    # two fp32 points a turn (20 positions) against one bf16 point (10): fp32's flips minus
    # twice bf16's, over fp32's positions, turn by turn
    a = [10 + 10, 10 + 10, 10 + 0] + [0] * 7
    b = [10] + [0] * 9
    assert fp["effect_ci"] == cluster_bootstrap([x - 2 * y for x, y in zip(a, b)], [20] * 10).bounds()
    assert fp["effect_ci"][0] <= fp["effect"] <= fp["effect_ci"][1]


def test_html_heat_map_escapes_and_colours():
    pts = [_pt("<b>ref</b>", {"d": "bf16", "p": "1"}, 0, 0, ref=True), _pt("a", {"d": "bf16", "p": "2"}, 0, 10),
           _pt("b", {"d": "<i>fp32</i>", "p": "1"}, 5, 10), _pt("c", {"d": "<i>fp32</i>", "p": "2"}, 1, 10)]
    axes = {"d": ["bf16", "<i>fp32</i>"], "p": ["1", "2"]}
    rep = {"served_name": "q", "points": pts, "corpus": {"cases": 1, "name": "c"}, "reference": "<b>ref</b>",
           "axes": axes, "marginals": marginals(pts, axes)}
    page = render_html(rep)
    assert "<b>ref</b>" not in page and "&lt;b&gt;ref&lt;/b&gt;" in page and "<i>" not in page
    assert "id='heatmap'" in page and "50.00%" in page and "rgb(255,55,55)" in page  # the worst cell is the reddest
    assert "<script" not in page


def test_forced_turn_flips_margin_and_kl_on_rows():
    import numpy as np

    from tensorverse.replay.entries import forced_turn, free_turn

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(6, 50)).astype(np.float32)
    cand = ref.copy()
    tokens = [int(t) for t in ref.argmax(1)]
    assert forced_turn(ref, cand, tokens)["flips"] == [] and max(forced_turn(ref, cand, tokens)["kl"]) == 0
    a, b = np.argsort(ref[3])[-2:]  # make position 3 a near tie, then flip it
    ref[3, b] = ref[3, a] + 1e-3
    cand[3] = ref[3]
    cand[3, a] += 0.01
    f = forced_turn(ref, cand, tokens)
    assert f["flips"] == [3] and f["first_flip"] == 3 and f["n"] == 6 and f["top1_agree"] == 5
    d = f["first_flip_detail"]
    assert d["ref_top1"] == b and d["cand_top1"] == a and 0 < d["margin"] < 1e-3 and d["kl"] > 0
    run = {"status": "ok", "token_ids": [1, 2, 9], "text": '<tool_call>\n{"name": "ping", "arguments": {"h": "b"}}\n</tool_call>'}
    fr = free_turn([1, 2, 3], '<tool_call>\n{"name": "ping", "arguments": {"h": "a"}}\n</tool_call>', run, "basis")
    assert fr["diverged"] and fr["first_flip"] == 2 and fr["verdict"] == "value_mismatch"
    assert free_turn([1], "", {"status": "failed", "error": "x"}, "basis")["error"] == "x"


def test_html_named_points_only_get_one_cell_each():
    pts = [_pt("base", {"d": "bf16"}, 0, 0, ref=True), _pt("fp32", {"d": "fp32"}, 3, 10)]
    rep = {"served_name": "q", "points": pts, "corpus": {"cases": 1, "name": "c"}, "reference": "base",
           "axes": {"d": ["bf16", "fp32"]}, "grid_axes": [], "marginals": {}}
    page = render_html(rep)
    heat = page[page.index("id='heatmap'"):page.index("</table>")]
    assert "<th>base</th><th>fp32</th>" in heat and "30.00%" in heat


def test_parallel_points_run_at_most_n_at_once_after_the_reference(tmp_path, monkeypatch):
    """`[matrix] parallel = 2`: the reference runs alone first (its output is everyone's basis),
    then the other points at most two at a time, each once; a point with the same effective
    settings as another shares its run (scheduling only: no vLLM)."""
    import threading
    import time as _time

    from tensorverse.matrix import grid
    from tensorverse.replay.corpus import write_corpus

    corpus = write_corpus(tmp_path / "corpus", [], name="empty")
    s = spec(axes={"--dtype": ["bfloat16", "float32", "float16"], "--block-size": [16, 32]},
             points=[{"name": "twin", "settings": {"--dtype": "float32", "--block-size": 16}}],
             matrix={"parallel": 2})
    lock = threading.Lock()
    running: list[str] = []
    log: list[tuple[str, str, int]] = []

    def run_config(req, log_=None, **_kw):
        with lock:
            running.append(req.label)
            log.append(("start", req.label, len(running)))
        _time.sleep(0.05)
        with lock:
            running.remove(req.label)
            log.append(("end", req.label, len(running)))
        return {"status": "ok", "label": req.label, "basis": req.basis is not None}

    from tensorverse.matrix import run as run_mod

    # the local executor (matrix/executor.py) runs each point with run.run_config
    monkeypatch.setattr(run_mod, "run_config", lambda req, log=None: run_config(req))
    monkeypatch.setattr(grid, "load_run", lambda out, key: None)
    monkeypatch.setattr(grid, "reference_basis", lambda out, rec, corp: {"c": {"0": [1, 2]}})
    points = s.all_points()
    ref = s.point(s.reference)
    runs = grid.ensure_runs(s, str(corpus), tmp_path / "out", points, ref)
    assert set(runs) == {p.name for p in points}
    assert log[0] == ("start", ref.name, 1) and log[1] == ("end", ref.name, 0)  # alone, first
    assert max(n for ev, _, n in log if ev == "start") == 2  # two at once, never more
    started = [name for ev, name, _ in log if ev == "start"]
    assert len(started) == len(set(started)) == len(points) - 1  # each configuration once: "twin"
    assert runs["twin"] is runs["dtype=float32,block-size=16"]  # has the grid point's settings: its run
    assert not runs[ref.name]["basis"] and all(r["basis"] for name, r in runs.items() if name != ref.name)


def test_forced_turn_classes_every_flip():
    """Issue 19: matrix points carry a class per flip (ties judged on the reference's rows)."""
    import numpy as np

    from tensorverse.replay.entries import forced_turn

    ref = np.full((3, 16), -2.0, np.float32)
    ref[:, 4] = 1.0
    ref[0, 9] = 1.0      # an exact tie with the top-1 (token 4 wins: the lower id)
    ref[1, 9] = 0.99609375  # the bfloat16 value just below 1.0: a near tie
    ref[2, 9] = 0.5      # far
    cand = ref.copy()
    cand[:, 9] = 3.0
    out = forced_turn(ref, cand, [4, 4, 4])
    assert out["flips"] == [0, 1, 2] and out["flip_classes"] == ["tie", "near_tie", "runtime"]
    assert out["first_flip_detail"]["flip_class"] == "tie"


def test_a_point_needing_more_cores_than_the_machine_has_is_recorded_without_a_start(tmp_path):
    from pathlib import Path

    from tensorverse.matrix.run import RunRequest, load_run, run_config

    corpus = str(Path(__file__).resolve().parents[2] / "corpus" / "netops-sample")
    s = spec(points=[{"name": "tp", "settings": {"--tensor-parallel-size": 512}}])
    req = RunRequest(s, corpus, tmp_path, {"--tensor-parallel-size": 512}, "tp")
    rec = run_config(req)
    assert rec["status"] == "start_failed" and "512 ranks" in rec["error"]
    assert "--distributed-executor-backend" in rec["command"]
    assert load_run(tmp_path, req.key)["status"] == "start_failed"  # a result: not retried
    assert not list(tmp_path.rglob("server.log"))  # nothing was started
