"""The turnstone agent (PyPI 1.9.0, Python >= 3.13) for tests and benchmarks (`tests/proxy/test_turnstone.py`,
``benchmarks/session_grouping.py``): its environment, cached like the vLLM rig, and one
non-interactive session driven by ``turnstone_drive.sh`` (its header lists the safety layers:
every approval-gated tool is denied)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

VERSION = "1.9.0"
#: the team's driver (shared/tools/turnstone_drive.sh), kept beside this file so that a clean
#: clone (CI) has it; TENSORVERSE_TURNSTONE_DRIVE points at another copy
DRIVE = Path(os.environ.get("TENSORVERSE_TURNSTONE_DRIVE", Path(__file__).resolve().parent / "turnstone_drive.sh"))


def venv() -> Path:
    """The cached turnstone environment (``$TENSORVERSE_CACHE/turnstone-1.9.0``), created on first use."""
    root = Path(os.environ.get("TENSORVERSE_CACHE", Path.home() / ".cache" / "tensorverse"))
    path = root / f"turnstone-{VERSION}"
    if not (path / "bin" / "turnstone").exists():
        if not DRIVE.exists():
            raise RuntimeError(f"turnstone driver missing: {DRIVE} (set TENSORVERSE_TURNSTONE_DRIVE)")
        root.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["bash", str(DRIVE), "--setup"], env={**os.environ, "TS_VENV": str(path)},
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"turnstone setup failed ({r.returncode}): {r.stderr[-2000:]}")
    return path


@dataclass
class Run:
    rc: int
    dir: Path
    stdout: str
    transcript: dict


def drive(base_url: str, model: str, prompt: str, workdir: Path, *, files: dict[str, str] | None = None,
          context_window: int = 32768, max_tokens: int = 256, timeout: int = 600, extra_env: dict | None = None) -> Run:
    (workdir / "work").mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (workdir / "work" / name).write_text(text)
    env = {**os.environ, "TS_VENV": str(venv()), "TS_WORKDIR": str(workdir), "TS_QUIET": "1",
           "TS_CONTEXT_WINDOW": str(context_window), "TS_MAX_TOKENS": str(max_tokens), "TS_TIMEOUT": str(timeout),
           **(extra_env or {})}
    r = subprocess.run(["bash", str(DRIVE), base_url, model, prompt], env=env, capture_output=True, text=True,
                       timeout=timeout + 120)
    tpath = workdir / "transcript.json"
    transcript = json.loads(tpath.read_text()) if tpath.exists() else {}
    return Run(r.returncode, workdir, r.stdout + r.stderr, transcript)
