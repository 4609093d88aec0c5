"""Floats rounded for the view models' JSON: a few significant digits, None for NaN."""

from __future__ import annotations

import math
from typing import Iterable

__all__ = ["sig", "sigs"]


def sig(v: float | None, digits: int = 4) -> float | None:
    """A float rounded to ``digits`` significant digits (short JSON); None for NaN/None."""
    if v is None:
        return None
    v = float(v)
    if not math.isfinite(v):
        return None if math.isnan(v) else v
    return float(f"{v:.{digits}g}")


def sigs(values: Iterable[float | None], digits: int = 4) -> list[float | None]:
    return [sig(v, digits) for v in values]
