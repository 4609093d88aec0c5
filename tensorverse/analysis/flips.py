"""Flips: where a candidate's choice departs from the reference's.

Forced mode (teacher forcing, aligned positions): a *flip* is a position where the candidate's
argmax differs from the reference's (``not top1_agree``); a run can have many.

Free mode (the candidate generates on its own): the *divergence point* is the first position
where the candidate's token differs from the reference's; everything before it is the
*common prefix*. After that point the two branches are no longer aligned, so position-wise
comparison stops meaning anything (the branches are compared as text / tool calls instead).
No I/O happens in this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tensorverse.analysis.metrics import AnalysisInputError, PositionMetrics

__all__ = ["FreeDivergence", "forced_flips", "first_forced_flip", "free_divergence", "first_difference"]


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first position where ``b`` leaves ``a`` (the shorter one's length when one is a prefix of
    the other); None when they are the same."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def forced_flips(m: PositionMetrics) -> list[int]:
    """Positions (0-based, ascending) where argmax Q != argmax P."""
    return np.flatnonzero(~np.asarray(m.top1_agree, dtype=bool)).tolist()


def first_forced_flip(m: PositionMetrics) -> int | None:
    """The first forced-mode flip position, or None when the run has none."""
    f = np.flatnonzero(~np.asarray(m.top1_agree, dtype=bool))
    return int(f[0]) if f.size else None


@dataclass(frozen=True)
class FreeDivergence:
    """Where a free-running candidate left the reference's token sequence.

    ``position``: the first index where the tokens differ, or where one sequence has ended
    and the other has not; None when both sequences are identical.
    ``common_prefix``: the number of leading tokens both share (== ``position`` when they
    diverge, == the common length when they do not).
    ``kind``: ``"token"`` (different tokens at ``position``), ``"length"`` (one branch stopped
    at ``position`` while the other went on), or None (identical).
    ``ref_token`` / ``cand_token``: the tokens at ``position`` (None for a branch that ended).
    """

    position: int | None
    common_prefix: int
    ref_len: int
    cand_len: int
    kind: str | None = None
    ref_token: int | None = None
    cand_token: int | None = None

    @property
    def diverged(self) -> bool:
        return self.position is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "common_prefix": self.common_prefix,
            "ref_len": self.ref_len,
            "cand_len": self.cand_len,
            "kind": self.kind,
            "ref_token": self.ref_token,
            "cand_token": self.cand_token,
        }


def _token_vector(tokens: Any, name: str) -> np.ndarray:
    try:
        a = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise AnalysisInputError(f"{name}: not a list of token ids ({exc})", "format") from None
    if a.ndim != 1:
        raise AnalysisInputError(f"{name}: expected a flat list of token ids, got shape {a.shape}", "shape")
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise AnalysisInputError(f"{name}: token ids must be integers, got {a.dtype}", "dtype")
    return a.astype(np.int64, copy=False)


def free_divergence(
    ref_tokens: Sequence[int] | np.ndarray, cand_tokens: Sequence[int] | np.ndarray
) -> FreeDivergence:
    """First position where a free-running candidate's tokens differ from the reference's.

    >>> free_divergence([5, 6, 7], [5, 6, 9]).position
    2
    >>> free_divergence([5, 6, 7], [5, 6]).kind
    'length'
    """
    r = _token_vector(ref_tokens, "ref_tokens")
    c = _token_vector(cand_tokens, "cand_tokens")
    common = min(r.size, c.size)
    diff = np.flatnonzero(r[:common] != c[:common])
    if diff.size:
        i = int(diff[0])
        return FreeDivergence(
            position=i,
            common_prefix=i,
            ref_len=int(r.size),
            cand_len=int(c.size),
            kind="token",
            ref_token=int(r[i]),
            cand_token=int(c[i]),
        )
    if r.size == c.size:
        return FreeDivergence(position=None, common_prefix=common, ref_len=int(r.size),
                              cand_len=int(c.size))
    return FreeDivergence(
        position=common,
        common_prefix=common,
        ref_len=int(r.size),
        cand_len=int(c.size),
        kind="length",
        ref_token=int(r[common]) if r.size > common else None,
        cand_token=int(c[common]) if c.size > common else None,
    )
