"""What a replay is asked to do: its options (`ReplayOptions`), the ``--backend NAME=URL`` parser,
and the name that stands for the corpus's recorded output."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tensorverse.shadow.backend import Backend
from tensorverse.store.records import RECORDED

__all__ = ["ReplayOptions", "parse_backend"]


def parse_backend(spec: str, *, capture: str = "auto", concurrency: int = 4,
                  timeout_s: float = 300.0) -> Backend:
    """``NAME=URL`` or ``NAME=URL#MODEL`` -> a Backend (its API key from
    ``TENSORVERSE_BACKEND_API_KEY_<NAME>`` or ``TENSORVERSE_BACKEND_API_KEY``)."""
    name, sep, url = spec.partition("=")
    if not sep or not name or not url:
        raise ValueError(f"--backend {spec!r}: use NAME=URL (e.g. fp32=http://127.0.0.1:8001/v1)")
    url, _, model = url.partition("#")
    key = (os.environ.get(f"TENSORVERSE_BACKEND_API_KEY_{name.upper().replace('-', '_')}")
           or os.environ.get("TENSORVERSE_BACKEND_API_KEY"))
    return Backend(name=name, url=url, model=model or None, api_key=key, capture=capture,
                   concurrency=concurrency, timeout_s=timeout_s)


@dataclass
class ReplayOptions:
    backends: list[Backend]
    reference: str | None = None
    modes: tuple[str, ...] = ("forced", "free")
    concurrency: int = 4
    out: Path | None = None
    store: Path | None = None
    retries: int = 3
    backoff_s: float = 0.5
    simulator: Any = None
    include_text: bool = False
    check_tokenizer: bool = True
    check_template: bool = True
    rows_timeout_s: float = 30.0
    progress: bool = True
    resume: bool = True
    cases: Sequence[str] | None = None
    html: Path | None = None  # write the HTML report into this directory

    def __post_init__(self) -> None:
        names = [b.name for b in self.backends]
        if not names:
            raise ValueError("replay needs at least one --backend")
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique: {names}")
        if RECORDED in names:
            raise ValueError(f"{RECORDED!r} names the corpus's reference output; pick another name")
        if self.reference is None:
            self.reference = names[0]
        if self.reference not in names:
            raise ValueError(f"--reference {self.reference!r} is not one of the backends {names}")
        for m in self.modes:
            if m not in ("forced", "free"):
                raise ValueError(f"unknown mode {m!r} (forced, free)")
        for b in self.backends:
            b.role = "reference" if b.name == self.reference else "shadow"
