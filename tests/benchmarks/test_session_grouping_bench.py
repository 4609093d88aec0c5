"""``benchmarks/session_grouping.py`` groups real turnstone traffic as the proxy does: its driver
hands the answer to the `Sessions` addon the way the relay does (it once set a flow field the
addon no longer read, and every request became a session of its own in `make bench`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.turnstone

ROOT = Path(__file__).resolve().parents[2]


def test_the_session_grouping_benchmark_finds_one_session_per_compacting_conversation():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "session_grouping.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, (result, r.stderr[-2000:])
    assert result["conversations"] == 2 and result["compaction_requests"] > 0
    assert result["after"]["sessions"] == 2 and result["after"]["one_turn_sessions"] == 0
    assert result["before"]["sessions"] > 2  # the previous rule (exact prefix only) split them
