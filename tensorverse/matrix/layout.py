"""Where a matrix run's files live under its output directory (one directory per point)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["run_dir"]


def run_dir(out: Path, key: str) -> Path:
    return Path(out) / "runs" / key
