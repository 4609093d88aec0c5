"""`tensorverse verdict` over a real LMDB store and over its exported tables (issue 25)."""

from __future__ import annotations

import json
import shutil

import pytest

from tensorverse.cli import main
from tensorverse.exporters.export import export_store
from tensorverse.store import Store
from tests.exporters.verdict_store import build_store

@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("verdict") / "store"
    build_store(d)
    return d


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_verdict_from_a_store(store_dir, capsys):
    out = _json(capsys, ["verdict", "--store", str(store_dir), "--json"])
    by = {s["backend"]: s for s in out["shadows"]}
    assert set(by) == {"bad", "good", "secondary"}
    assert [s["backend"] for s in out["shadows"]][-1] == "secondary"
    bad, good, sec = by["bad"], by["good"], by["secondary"]
    assert bad["turns"] == 40 and bad["tool_call_turns"] == 40
    assert bad["tool_call_break_excess"]["estimate"] == pytest.approx(10 / 40)
    assert bad["flip_excess"]["estimate"] == pytest.approx(8 * (6 / 40) / 40)
    assert bad["tool_flip_excess"]["estimate"] == pytest.approx(8 * (2 / 10) / 40)
    assert bad["tool_call_breaks"] == 10 and bad["floor_backend"] == "secondary"
    assert bad["runtime_flips"] == 48 and bad["positions"] == 1600
    assert bad["decision"] == "regression"
    assert bad["tool_call_break_excess"]["low"] > 0
    assert good["decision"] == "undecided" and good["tool_call_break_excess"]["estimate"] == 0
    assert good["turns_needed"] > 0
    # 40 tool-calling turns over 19.5 minutes
    assert good["tool_call_turns_per_hour"] == pytest.approx(39 / (39 * 30 / 3600))
    assert good["hours_needed"] == pytest.approx(good["turns_needed"] / good["tool_call_turns_per_hour"])
    assert sec["floor_backend"] is None and sec["decision"] != "regression"


def test_text_output_and_one_shadow(store_dir, capsys):
    assert main(["verdict", "--store", str(store_dir), "--shadow", "bad"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("bad (shadow, noise floor: secondary): REGRESSION after 40")
    assert "position-level, descriptive only: 48/1600" in text
    assert main(["verdict", "--store", str(store_dir), "--shadow", "nope"]) == 2
    assert "no comparisons of backend 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_verdict_from_exports_equals_the_store(store_dir, tmp_path, capsys, fmt):
    want = _json(capsys, ["verdict", "--store", str(store_dir), "--json"])
    with Store.open(store_dir, readonly=True) as st:
        export_store(st, tmp_path / "a", fmt=fmt, tables=["comparisons"])
    got_dir = _json(capsys, ["verdict", "--comparisons", str(tmp_path / "a"), "--json"])
    assert got_dir == want
    # two replicas that exported the same store: every comparison counts once
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    f = tmp_path / "b" / f"comparisons.{fmt}"
    got_two = _json(capsys, ["verdict", "--comparisons", str(tmp_path / "a"), str(f), "--json"])
    assert got_two == want


def test_a_fleet_of_replicas_is_one_verdict(store_dir, tmp_path, capsys):
    """Two replicas' stores hold different halves of the traffic; their exports decide as one."""
    build_store(tmp_path / "a", turns=20, prefix="a")
    build_store(tmp_path / "b", turns=20, prefix="b", first=20)
    for name in ("a", "b"):
        with Store.open(tmp_path / name, readonly=True) as st:
            export_store(st, tmp_path / f"x{name}", fmt="jsonl", tables=["comparisons"])
    fleet = _json(capsys, ["verdict", "--comparisons", str(tmp_path / "xa"), str(tmp_path / "xb"), "--json"])
    whole = _json(capsys, ["verdict", "--store", str(store_dir), "--json"])
    assert fleet == whole


def test_bad_inputs_are_refused(tmp_path, capsys):
    assert main(["verdict", "--store", str(tmp_path / "none")]) == 2
    assert "no Tensorverse store" in capsys.readouterr().err
    old = tmp_path / "comparisons.jsonl"
    old.write_text(json.dumps({"run_id": "r", "backend": "x", "mode": "free"}) + "\n")
    assert main(["verdict", "--comparisons", str(old)]) == 2
    err = capsys.readouterr().err
    assert "lacks column(s) turn_created_ns" in err and "export the store again" in err
    assert main(["verdict", "--comparisons", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["verdict", "--store", str(tmp_path), "--margin", "0"]) == 2
    assert "tool_call_break_margin" in capsys.readouterr().err


def test_margins_from_the_config(store_dir, tmp_path, capsys):
    cfg = tmp_path / "tv.toml"
    cfg.write_text('[primary]\nurl = "http://127.0.0.1:9"\n[verdict]\nconfidence = 0.99\ntool_call_break_margin = 0.3\n')
    out = _json(capsys, ["verdict", "--store", str(store_dir), "--config", str(cfg), "--json"])
    assert out["confidence"] == 0.99 and out["tool_call_break_margin"] == 0.3
    good = next(s for s in out["shadows"] if s["backend"] == "good")
    assert good["decision"] == "equivalent"  # 40 clean turns rule out a 30 % excess
    bad_cfg = tmp_path / "bad.toml"
    bad_cfg.write_text('[primary]\nurl = "http://127.0.0.1:9"\n[verdict]\nconfidence = 2\n')
    assert main(["verdict", "--store", str(store_dir), "--config", str(bad_cfg)]) == 2
    assert "verdict.confidence" in capsys.readouterr().err


def test_store_rows_decode_each_comparison_once_and_follow_the_store(tmp_path, monkeypatch):
    from tensorverse.exporters.comparison_rows import StoreRows, from_store
    from tests.exporters.verdict_store import fill_store

    with Store.open(tmp_path / "s", durable=False) as st:
        fill_store(st, turns=6)
        sr = StoreRows(st)
        key = lambda r: (r.run_id, r.ref_run_id, r.session_id)  # noqa: E731
        assert sorted(map(key, sr.rows())) == sorted(map(key, from_store(st)))
        calls = []
        real = st.get_comparison
        monkeypatch.setattr(st, "get_comparison", lambda *a: calls.append(a) or real(*a))
        assert len(sr.rows()) == 36 and calls == []  # nothing new: nothing decoded
        fill_store(st, turns=2, prefix="b", first=6)  # a new session of 2 turns
        rows = sr.rows()
        assert len(rows) == 48 and len(calls) == 12
        assert sorted(map(key, rows)) == sorted(map(key, from_store(st)))
        st.delete_session("sess1").result()  # retention removed the first session
        assert sorted(map(key, sr.rows())) == sorted(map(key, from_store(st))) and len(sr.rows()) == 12
        assert sorted(sr._rows) == sorted(sr._created) == sorted({r.turn_id for r in sr.rows()})


def test_store_rows_keep_nothing_for_turns_without_comparisons(tmp_path):
    """A proxy relays far more turns than it shadows (the tee sheds past its capacity): the
    verdict's rows hold the compared turns only, so its memory grows with the comparisons."""
    from tensorverse.exporters.comparison_rows import StoreRows
    from tensorverse.testing.records import store_session

    with Store.open(tmp_path / "s", durable=False) as st:
        store_session(st, "shadowed", turns=2, rows=0, compare=("fp32", "primary"))
        store_session(st, "shed", turns=50, rows=0)  # recorded, never compared
        sr = StoreRows(st)
        assert {r.turn_id for r in sr.rows()} == {"shadowed-t0", "shadowed-t1"}
        assert sorted(sr._rows) == sorted(sr._created) == ["shadowed-t0", "shadowed-t1"]
