"""Per-axis marginal effects over the hypercube: pure functions of the points' summaries.

For an axis (a setting that varies) and each of its values: the points that have that value,
with the other axes averaged over. Two averages are given, since they answer different
questions: ``flip_rate`` pools positions (every position weighs the same: "how often does a
token flip under FP8 KV") and ``mean_point_flip_rate`` averages the points' own rates (every
configuration weighs the same: a full grid's classic marginal). ``effect`` is a value's pooled
flip rate minus the axis's first (base) value's. Points that failed, and the reference point
itself (which is compared with nothing), are left out.

``flip_rate_ci`` is turn-clustered (:func:`tensorverse.analysis.intervals.cluster_bootstrap`):
each (case, turn) of the corpus is one cluster, its positions and flips summed over the value's
points (the same turn under two configurations is no independent trial), from the points'
``turn_counts``. For a value run by one point it is the interval the replay report gives that
point and the hypercube site gives the same turns. ``effect_ci`` is the paired interval of
``effect`` (:func:`tensorverse.analysis.intervals.cluster_bootstrap_difference`: the value's
turns and the base value's drawn together); for two values run by one point each it is the
hypercube site's ``vs_reference`` interval between those settings.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from tensorverse.analysis.intervals import cluster_bootstrap, cluster_bootstrap_difference

__all__ = ["marginals", "turn_clusters"]


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _by_turn(points: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], list[int]]:
    by: dict[tuple[str, int], list[int]] = {}
    for p in points:
        for c in p["summary"].get("turn_counts") or ():
            e = by.setdefault((str(c["case"]), int(c["turn"])), [0, 0])
            e[0] += int(c["flips"])
            e[1] += int(c["positions"])
    return by


def turn_clusters(points: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[int]]:
    """Flips and positions per (case, turn), summed over ``points`` (their summaries'
    ``turn_counts``), in a fixed order."""
    by = _by_turn(points)
    keys = sorted(by)
    return [by[k][0] for k in keys], [by[k][1] for k in keys]


def _effect_ci(points: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]]) -> list[float] | None:
    """The paired interval of ``points``' pooled flip rate minus ``base``'s, over the turns of
    either (0 flips and 0 positions where a side has none)."""
    a, b = _by_turn(points), _by_turn(base)
    keys = sorted(a.keys() | b.keys())
    z = [0, 0]
    return cluster_bootstrap_difference([a.get(k, z)[0] for k in keys], [a.get(k, z)[1] for k in keys],
                                        [b.get(k, z)[0] for k in keys], [b.get(k, z)[1] for k in keys]).bounds()


def marginals(points: Sequence[Mapping[str, Any]], axes: Mapping[str, Sequence[Any]]) -> dict[str, list[dict[str, Any]]]:
    """``points``: dicts with ``effective`` (settings), ``status``, ``reference`` and ``summary``
    (replay's summary). Returns, per axis, one row per value."""
    usable = [p for p in points if p.get("status") == "ok" and not p.get("reference")
              and p.get("summary")]
    out: dict[str, list[dict[str, Any]]] = {}
    for axis, values in axes.items():
        rows = []
        base_rate = None
        base: list[Mapping[str, Any]] = []
        for i, v in enumerate(values):
            sel = [p for p in usable if _same(p["effective"].get(axis), v)]
            pos = sum(p["summary"].get("positions") or 0 for p in sel)
            flips = sum(p["summary"].get("flips") or 0 for p in sel)
            rates = [p["summary"]["flip_rate"] for p in sel if p["summary"].get("flip_rate") is not None]
            klw = sum(((p["summary"].get("kl") or {}).get("mean") or 0.0) * (p["summary"].get("positions") or 0)
                      for p in sel)
            free = sum(p["summary"].get("free_turns") or 0 for p in sel)
            mism = sum(sum(n for k, n in (p["summary"].get("verdicts") or {}).items() if k != "match")
                       for p in sel)
            rate = flips / pos if pos else None
            if i == 0:
                base_rate, base = rate, sel
            rows.append({
                "value": v, "points": [p["name"] for p in sel], "positions": pos, "flips": flips,
                "flip_rate": rate, "flip_rate_ci": cluster_bootstrap(*turn_clusters(sel)).bounds(),
                "mean_point_flip_rate": sum(rates) / len(rates) if rates else None,
                "kl_mean": klw / pos if pos else None,
                "toolcall_mismatch_rate": mism / free if free else None,
                "effect": (rate - base_rate) if rate is not None and base_rate is not None else None,
                "effect_ci": _effect_ci(sel, base) if i > 0 and rate is not None and base_rate is not None else None,
            })
        out[axis] = rows
    return out
