"""The top-k panel of one position: the union of the members' top tokens, with each member's
probability and rank of each (forced and free mode build their panels with :func:`panel`)."""

from __future__ import annotations

import math
from typing import Any

from tensorverse.viz.rounding import sig

__all__ = ["panel", "TOPK", "UNION_CAP"]

TOPK = 6  # entries per backend in a top-k panel
UNION_CAP = 12  # most tokens one panel shows


def panel(members: list[tuple[int, Any]], k: int = TOPK, cap: int = UNION_CAP,
          engine: list[dict | None] | None = None) -> dict:
    """The top-k table at one position: union of every member's top-k, with each member's
    probability and rank for each of those tokens (None where unknown: top-k-only data).
    ``members``: ``(backend index, distribution)`` pairs (:class:`~tensorverse.viz.rows.Row` or
    :class:`~tensorverse.viz.rows.TopK`), the reference first.
    ``engine``: per member, the engine's batch when its row was computed (``e``: ``{"b": batch
    size, "s": step}`` or None), set only when some member has one."""
    union: list[int] = []
    seen: set[int] = set()
    for _, d in members:
        for t in d.top(k):
            if t not in seen:
                seen.add(t)
                union.append(t)
    probs: list[list[float | None]] = []
    ranks: list[list[int | None]] = []
    for _, d in members:
        lp = d.logp(union)
        probs.append([None if v is None else math.exp(v) for v in lp])
        ranks.append(d.rank(union))
    # order: by the first member's probability (the reference is listed first), then the best
    # probability any member gives
    def key(j: int) -> tuple:
        first = probs[0][j] if probs else None
        best = max((v for p in probs if (v := p[j]) is not None), default=0.0)
        return (-(first if first is not None else -1.0), -best, union[j])

    order = sorted(range(len(union)), key=key)[:cap]
    return {
        "m": [i for i, _ in members],
        "ids": [union[j] for j in order],
        "p": [[sig(p[j]) for j in order] for p in probs],
        "r": [[r[j] for j in order] for r in ranks],
        **({"e": engine} if engine and any(engine) else {}),
    }
