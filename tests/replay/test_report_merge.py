"""``tensorverse report merge`` through the ``tensorverse`` entry point: results files of replays
(fake vLLM servers) aggregate into one table, JSON and Parquet; counts add up exactly; different
corpora are flagged; unreadable input exits 2."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tensorverse.testing.fake_vllm import FakeVLLM
from tests.replay.test_replay_runner import _replay, corpus_dir, greedy, make_case  # type: ignore[import-not-found]  # noqa: F401

from tensorverse.cli import main as cli_main
from tensorverse.replay.corpus import write_corpus


@pytest.fixture
def two_rigs(corpus_dir, tmp_path):  # noqa: F811 - the imported fixture, used
    """Two replays of one corpus: a mild and a strong candidate runtime."""
    paths = []
    for i, perturb in enumerate((0.5, 2.0)):
        out = tmp_path / f"rig{i}.json"
        _replay(corpus_dir, {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=perturb)}, reference="ref", out=out)
        paths.append(out)
    return paths


def test_merge_adds_counts_and_writes_json_and_parquet(two_rigs, tmp_path, capsys):
    a, b = (json.loads(p.read_text()) for p in two_rigs)
    merged_path, parquet = tmp_path / "merged.json", tmp_path / "merged.parquet"
    code = cli_main(["report", "merge", *map(str, two_rigs), "--out", str(merged_path), "--parquet", str(parquet)])
    printed = capsys.readouterr().out
    assert code == 0
    m = json.loads(merged_path.read_text())
    assert m["format"] == "tensorverse.replay-merge" and m["same_corpus"] is True
    assert len(m["rows"]) == 4  # (rig file, backend)
    cand = m["totals"]["cand"]
    assert cand["rigs"] == 2
    for k in ("positions", "flips", "departures", "free_turns", "diverged"):
        assert cand[k] == a["summary"]["cand"][k] + b["summary"]["cand"][k], k
    assert cand["flip_rate"] == pytest.approx(cand["flips"] / cand["positions"])
    klw = (a["summary"]["cand"]["kl"]["mean"] * a["summary"]["cand"]["positions"]
           + b["summary"]["cand"]["kl"]["mean"] * b["summary"]["cand"]["positions"])
    assert cand["kl_mean"] == pytest.approx(klw / cand["positions"])
    assert cand["kl_max"] == max(a["summary"]["cand"]["kl"]["max"], b["summary"]["cand"]["kl"]["max"])
    table = pq.read_table(parquet).to_pylist()
    assert len(table) == 4 and {r["backend"] for r in table} == {"ref", "cand"}
    assert sorted(r["flips"] for r in table if r["backend"] == "cand") == \
        sorted([a["summary"]["cand"]["flips"], b["summary"]["cand"]["flips"]])
    # the printed table: header, rule, one line per row
    lines = printed.strip().splitlines()
    assert lines[0].split()[:4] == ["rig", "corpus", "backend", "vllm"] and len(lines) == 2 + 4
    assert sum("ref (ref)" in line for line in lines) == 2
    assert "different corpora" not in printed


def test_merge_flags_different_corpora_and_rejects_bad_input(two_rigs, tmp_path, capsys):
    fake = FakeVLLM()
    other = write_corpus(tmp_path / "other", [make_case(fake, "o1", [[30, 31, 32]])],
                         tokenizer={"fingerprint": None}, name="other")
    third = tmp_path / "rig2.json"
    _replay(other, {"ref": FakeVLLM(), "cand": FakeVLLM()}, reference="ref", out=third)
    assert cli_main(["report", "merge", str(two_rigs[0]), str(third)]) == 0
    assert "different corpora" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    assert cli_main(["report", "merge", str(two_rigs[0]), str(bad)]) == 2
    assert "not a Tensorverse replay results file" in capsys.readouterr().err
    assert cli_main(["report", "merge", str(tmp_path / "missing.json")]) == 2
