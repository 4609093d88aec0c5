"""The frames ``/ingest`` has stored lately, by ``(origin, seq)``, so that a batch the capture sink
sends again (a POST retried after its answer was lost, when the first was committed) is not stored
twice (``tensorverse.capture.frames``: a frame's seq increases from 1 within its origin, one
capturing process).

Per origin: the highest seq stored and a ring of one bit per seq over the ``window`` seqs up to it
(``window / 8`` bytes), for at most ``origins`` origins, the least recently heard from forgotten
first. A frame older than its origin's window, or from a forgotten origin, is taken as new. A set
of ints did the same in about 100 bytes a frame (20 MiB for a window of 200,000 frames, filled
after some 700 shadowed turns of the production-load benchmark); this holds 8 KiB per capturing
process at the default window, which covers 64 batches of the sink's largest (1,024 frames) where
a retry resends one. Thread-safe (the proxy stores bodies in threads when it has no ingest worker).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["SeenFrames"]


class _Window:
    """One origin's highest stored seq and its ring of bits (bit ``seq % window``)."""

    __slots__ = ("hi", "bits")

    def __init__(self, hi: int, nbytes: int) -> None:
        self.hi = hi
        self.bits = bytearray(nbytes)


class SeenFrames:
    """See the module docstring. ``key in seen`` for ``(origin, seq)``; :meth:`add` once stored."""

    def __init__(self, window: int = 1 << 16, origins: int = 1024) -> None:
        if window < 8 or window % 8:
            raise ValueError(f"window must be a positive multiple of 8, got {window}")
        if origins < 1:
            raise ValueError(f"origins must be >= 1, got {origins}")
        self.window = window
        self.origins = origins
        self._by: OrderedDict[int, _Window] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[int, int]) -> bool:
        with self._lock:
            return self._contains(*key)

    def _contains(self, origin: int, seq: int) -> bool:
        w = self._by.get(origin)
        if w is None:
            return False
        hi = w.hi
        if seq > hi or seq <= hi - self.window:
            return False
        i = seq % self.window
        return bool(w.bits[i >> 3] & (1 << (i & 7)))

    def add(self, origin: int, seq: int) -> None:
        """Remember frame ``seq`` of ``origin`` (a seq below its origin's window is not kept)."""
        with self._lock:
            self._add(origin, seq)

    def _add(self, origin: int, seq: int) -> None:
        w = self._by.get(origin)
        if w is None:
            w = self._by[origin] = _Window(seq, self.window >> 3)
            while len(self._by) > self.origins:
                self._by.popitem(last=False)
        else:
            self._by.move_to_end(origin)
        bits, hi = w.bits, w.hi
        if seq > hi:  # the window moves up: its new slots held seqs a window older
            if seq - hi >= self.window:
                bits[:] = bytes(len(bits))
            else:
                for s in range(hi + 1, seq + 1):
                    i = s % self.window
                    bits[i >> 3] &= ~(1 << (i & 7)) & 0xFF
            w.hi = seq
        elif seq <= hi - self.window:
            return
        i = seq % self.window
        bits[i >> 3] |= 1 << (i & 7)

    def nbytes(self) -> int:
        """The bit rings' bytes (what the window costs beyond a few objects per origin)."""
        return sum(len(w.bits) for w in self._by.values())

    def __len__(self) -> int:
        """Origins remembered."""
        return len(self._by)
