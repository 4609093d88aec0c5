"""Fixtures of the shadow tests (the fake vLLM lives in ``shadow_fake.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # `import shadow_fake` under --import-mode=importlib


@pytest.fixture
def store(tmp_path):
    from tensorverse.store import Store

    s = Store.open(tmp_path / "store", durable=False)
    yield s
    s.close()
