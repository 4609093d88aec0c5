"""Fixtures of the exporter tests (helpers in exporters_support.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest


from tests.exporters.exporters_support import Pipeline

from tensorverse.proxy.loop import LoopThread


@pytest.fixture
def loop():
    lt = LoopThread("exporters-loop", asyncio.new_event_loop)
    yield lt
    lt.stop()


@pytest.fixture
def make_pipeline(loop, tmp_path):
    made: list[Pipeline] = []

    def make(**config: Any) -> Pipeline:
        p = Pipeline(loop, tmp_path / f"p{len(made)}", **config)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


