"""Fixtures of the shadow tests (the fake vLLM lives in ``shadow_fake.py``)."""

from __future__ import annotations


import pytest




@pytest.fixture
def store(tmp_path):
    from tensorverse.store import Store

    s = Store.open(tmp_path / "store", durable=False)
    yield s
    s.close()
