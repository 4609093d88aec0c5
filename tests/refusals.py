"""Asserting a refusal by its reason code (`tensorverse.refusal.Refusal`): the code is the
contract, the wording of the message is for people and may change."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest


@contextmanager
def refused(cls: type[Exception], reason: str, *names: str) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(cls)`` whose refusal must give ``reason``, and whose message must name
    each of ``names`` (the file, record or key it refuses), wherever in the wording."""
    with pytest.raises(cls) as e:
        yield e
    got = getattr(e.value, "reason", None)
    assert got == reason, f"refused for {got!r}, expected {reason!r}: {e.value}"
    for name in names:
        assert name in str(e.value), f"{name!r} not named in: {e.value}"
