"""Backend capabilities and tokenizer fingerprints, cached across turns: :class:`RunnerCache`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tensorverse.shadow.backend import Backend

__all__ = ["RunnerCache", "SHARED_CACHE"]


@dataclass
class _Caps:
    """What a backend can do for a run: force ids (``forcing``), capture rows through a sink
    (``capture``); ``probed`` whether the server was asked (not when configured, or when the
    probe failed), ``detail`` the probe's words, ``at`` when (monotonic seconds)."""

    forcing: bool = True
    capture: bool = True
    probed: bool = False
    detail: str = ""
    at: float = field(default_factory=time.monotonic)


class RunnerCache:
    """Backend capabilities and tokenizer fingerprints, kept ``ttl_s`` seconds, keyed by
    (name, url, model). :func:`shadow_turn` shares one per process, so a proxy that calls it once
    per turn and backend probes each backend once, not once per turn."""

    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self.caps: dict[tuple, _Caps] = {}
        self.fps: dict[tuple, tuple[float, dict[str, Any]]] = {}
        # the text of each token id a backend's /detokenize gave (a dictionary does not change:
        # a turn asks only for ids no earlier turn asked for), and when it answered that it has none
        self.pieces: dict[tuple, tuple[float, dict[int, str]]] = {}
        self.no_detokenize: dict[tuple, float] = {}

    @staticmethod
    def key(b: Backend) -> tuple:
        return (b.name, b.base_url, b.model)

    def get_caps(self, b: Backend) -> _Caps | None:
        c = self.caps.get(self.key(b))
        if c is not None and time.monotonic() - c.at > self.ttl_s:
            self.caps.pop(self.key(b), None)
            return None
        return c

    def get_fp(self, b: Backend) -> dict[str, Any] | None:
        e = self.fps.get(self.key(b))
        if e is None or time.monotonic() - e[0] > self.ttl_s:
            return None
        return e[1]

    def put_fp(self, b: Backend, fp: dict[str, Any]) -> None:
        self.fps[self.key(b)] = (time.monotonic(), fp)

    def pieces_of(self, b: Backend) -> dict[int, str]:
        """The token texts known for ``b`` (a dict to add to), fresh for ``ttl_s``."""
        e = self.pieces.get(self.key(b))
        if e is None or time.monotonic() - e[0] > self.ttl_s:
            e = self.pieces[self.key(b)] = (time.monotonic(), {})
        return e[1]

    def lacks_detokenize(self, b: Backend) -> bool:
        at = self.no_detokenize.get(self.key(b))
        return at is not None and time.monotonic() - at <= self.ttl_s

    def clear(self) -> None:
        self.caps.clear()
        self.fps.clear()
        self.pieces.clear()
        self.no_detokenize.clear()


SHARED_CACHE = RunnerCache()
