"""Per-setting summaries of a bundle's tables: a pure function, used by the writer and by the
checker (which recomputes every summary and refuses a bundle whose summary differs).

For one setting: ``positions``, ``flips`` (forced positions whose top-1 is not the recorded
token), ``flip_rate``, ``flips_by_class``, ``turns`` and ``turns_with_flip`` (the unit the
hypercube's intervals use), ``kl_mean`` / ``kl_max`` (KL from the rig's reference setting,
exactly rounded sums: :func:`math.fsum`, so the figure does not depend on row order), and for the
free runs ``free_turns``, ``free_diverged``, ``tool_call_breaks`` (free runs whose tool-call verdict
is not ``match``) and ``free_errors``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from tensorverse.bundle.format import FLIP_CLASSES

__all__ = ["summarize", "summarize_setting"]


def summarize_setting(positions: Iterable[Mapping[str, Any]], free: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The summary of one setting from its position rows and free rows (dicts with the tables'
    column names)."""
    n = flips = 0
    by_class = {c: 0 for c in FLIP_CLASSES}
    turns: set[tuple[str, int]] = set()
    flipped: set[tuple[str, int]] = set()
    kls: list[float] = []
    for r in positions:
        n += 1
        key = (r["case"], r["turn"])
        turns.add(key)
        if r["flip"]:
            flips += 1
            flipped.add(key)
            by_class[r["flip_class"]] += 1
        kls.append(r["kl"])
    free_turns = diverged = breaks = errors = 0
    for r in free:
        free_turns += 1
        if r["status"] != "ok":
            errors += 1
            continue
        diverged += bool(r["diverged"])
        breaks += r["verdict"] != "match"
    return {
        "positions": n, "flips": flips, "flip_rate": flips / n if n else None,
        "flips_by_class": by_class, "turns": len(turns), "turns_with_flip": len(flipped),
        "kl_mean": math.fsum(kls) / n if n else None, "kl_max": max(kls) if kls else None,
        "free_turns": free_turns, "free_diverged": diverged, "tool_call_breaks": breaks, "free_errors": errors,
    }


def summarize(positions: Iterable[Mapping[str, Any]], free: Iterable[Mapping[str, Any]],
              ran: Sequence[str]) -> dict[str, Any]:
    """``{setting: summary}`` for every setting that ran, in ``ran``'s order."""
    pos_by: dict[str, list[Mapping[str, Any]]] = {s: [] for s in ran}
    free_by: dict[str, list[Mapping[str, Any]]] = {s: [] for s in ran}
    for r in positions:
        pos_by.setdefault(r["setting"], []).append(r)
    for r in free:
        free_by.setdefault(r["setting"], []).append(r)
    return {s: summarize_setting(pos_by[s], free_by[s]) for s in ran}
