"""`tensorverse analyze` end to end, through a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tensorverse.analysis.report import analyze, render_table

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "tensorverse.cli", "analyze", *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    n, v = 12, 500
    ref = rng.normal(0, 3, (n, v)).astype(np.float32)
    cand = ref + rng.normal(0, 0.3, (n, v)).astype(np.float32)
    tokens = ref.argmax(1).tolist()
    np.save(tmp_path / "ref.npy", ref)
    np.save(tmp_path / "cand.npy", cand)
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    return tmp_path, ref, cand, tokens


def test_json_output(files):
    d, ref, cand, tokens = files
    p = run_cli("--ref", str(d / "ref.npy"), "--cand", str(d / "cand.npy"),
                "--tokens", str(d / "tokens.json"), "--json")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert {"positions", "summary"} <= set(out)
    assert len(out["positions"]) == 12
    want = analyze(ref, cand, tokens)
    for got, exp in zip(out["positions"], want["positions"]):
        assert got["kl"] == pytest.approx(exp["kl"], abs=1e-12)
        assert got["rank"] == exp["rank"] and got["flip"] == exp["flip"]
    assert out["summary"]["n"] == 12
    assert out["summary"]["flips"] == want["summary"]["flips"]
    assert out["summary"]["kl"]["mean"] == pytest.approx(want["summary"]["kl"]["mean"])


def test_table_output_and_regions(files):
    d, ref, cand, tokens = files
    regions = ["thinking"] * 4 + ["tool_args"] * 8
    (d / "t2.json").write_text(json.dumps({"tokens": tokens, "regions": regions}))
    p = run_cli("--ref", str(d / "ref.npy"), "--cand", str(d / "cand.npy"),
                "--tokens", str(d / "t2.json"))
    assert p.returncode == 0, p.stderr
    assert "Mean    KLD" in p.stdout and "Same top p" in p.stdout
    assert "Flips by region" in p.stdout and "tool_args" in p.stdout
    p = run_cli("--ref", str(d / "ref.npy"), "--cand", str(d / "cand.npy"),
                "--tokens", str(d / "t2.json"), "--json")
    out = json.loads(p.stdout)
    assert set(out["summary"]["flips_by_region"]) == {"thinking", "tool_args"}
    assert out["positions"][0]["region"] == "thinking"


def _expect_error(d: Path, ref: str, cand: str, tokens: str, needle: str):
    p = run_cli("--ref", str(d / ref), "--cand", str(d / cand), "--tokens", str(d / tokens),
                "--json")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stdout == ""
    assert "error" in p.stderr and needle in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_mismatched_shapes(files):
    d, ref, *_ = files
    np.save(d / "small.npy", ref[:, :400])
    _expect_error(d, "ref.npy", "small.npy", "tokens.json", "shapes differ")


def test_nan_row(files):
    d, ref, *_ = files
    bad = ref.copy()
    bad[5, 17] = np.nan
    np.save(d / "nan.npy", bad)
    _expect_error(d, "ref.npy", "nan.npy", "tokens.json", "row 5")


def test_int_dtype(files):
    d, ref, *_ = files
    np.save(d / "int.npy", ref.astype(np.int32))
    _expect_error(d, "int.npy", "ref.npy", "tokens.json", "floating dtype")


def test_empty(files):
    d, *_ = files
    np.save(d / "empty.npy", np.zeros((0, 500), np.float32))
    (d / "none.json").write_text("[]")
    _expect_error(d, "empty.npy", "empty.npy", "none.json", "empty")


def test_bad_tokens_file(files):
    d, *_ = files
    (d / "garbage.json").write_text("{not json")
    _expect_error(d, "ref.npy", "cand.npy", "garbage.json", "JSON")
    (d / "floats.json").write_text(json.dumps([1.5] * 12))
    _expect_error(d, "ref.npy", "cand.npy", "floats.json", "integer")
    (d / "short.json").write_text(json.dumps([1, 2, 3]))
    _expect_error(d, "ref.npy", "cand.npy", "short.json", "12 positions")
    (d / "oov.json").write_text(json.dumps([0] * 11 + [500]))
    _expect_error(d, "ref.npy", "cand.npy", "oov.json", "outside the vocabulary")


def test_missing_file(files):
    d, *_ = files
    _expect_error(d, "nope.npy", "cand.npy", "tokens.json", "not found")
    _expect_error(d, "ref.npy", "cand.npy", "nope.json", "not found")


def test_not_an_npy(files):
    d, *_ = files
    (d / "text.npy").write_text("hello")
    _expect_error(d, "text.npy", "cand.npy", "tokens.json", "cannot read")


def test_render_table_long_run_is_abridged():
    rng = np.random.default_rng(1)
    ref = rng.normal(0, 3, (200, 50))
    cand = ref + rng.normal(0, 0.5, ref.shape)
    out = render_table(analyze(ref, cand, ref.argmax(1)))
    assert "showing" in out and "of 200 positions" in out
