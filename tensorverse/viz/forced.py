"""Forced mode of a turn view: every forced run decoded the primary's tokens, so positions align.

Per backend the DESIGN metrics against the reference distribution (``kl``, ``delta_p``,
``margin``, ``rank``, ``flip``): read from a stored comparison of the same two runs when
:mod:`tensorverse.shadow.compare` wrote one, else computed, full-vocabulary when both sides have
rows, approximate from top-k logprobs otherwise; the flips with their class; a top-k panel per
position across all backends.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from tensorverse.analysis.metrics import AnalysisInputError, PositionMetrics, position_metrics, summarize
from tensorverse.analysis.regions import tag_regions
from tensorverse.analysis.flips import first_difference
from tensorverse.analysis.topk import topk_position_metrics
from tensorverse.store.records import Comparison, ForcedComparison
from tensorverse.viz.panels import panel
from tensorverse.viz.lane import ROLES_REFERENCE, Lane, comparison_flips
from tensorverse.viz.rounding import sig, sigs
from tensorverse.viz.rows import Row

if TYPE_CHECKING:
    from tensorverse.viz.turn import TurnBuilder

__all__ = ["CHUNK", "forced_panel", "forced_view", "stored_flip_count", "stored_columns", "put",
           "topk_metrics", "chunk_metrics", "summary_of"]

CHUNK = 16  # positions decoded together (rows of every backend: ~5 MB per position at 151,936)


def stored_flip_count(comparisons: Iterable[Comparison]) -> int | None:
    """Forced flips of a run from its stored comparisons: against a secondary/reference
    with full rows first (what the turn view shows), else any."""
    best: tuple | None = None
    for cmp in comparisons:
        if cmp.status != "ok" or not isinstance(cmp, ForcedComparison):
            continue
        flips = comparison_flips(cmp)
        if flips is None:
            continue
        key = (cmp.kind != "full", cmp.ref_role not in ROLES_REFERENCE)
        if best is None or key < best[0]:
            best = (key, flips)
    return None if best is None else best[1]


def stored_columns(comparisons: Iterable[Comparison], ref_run_id: str, n: int) -> dict | None:
    """Per-position metrics of a candidate run against the run ``ref_run_id`` from one of the
    candidate's stored comparisons (tensorverse.shadow.compare), when it covers this turn's
    ``n`` positions."""
    for cmp in comparisons:
        if cmp.ref_run_id != ref_run_id or cmp.status != "ok" or not isinstance(cmp, ForcedComparison):
            continue
        cols = cmp.metrics
        if cols is None:
            continue
        positions = list(range(n)) if cmp.positions is None else cmp.positions
        need = ("kl", "delta_p", "margin", "rank", "ref_top1", "cand_top1")
        if not all(isinstance(cols.get(k), list) and len(cols[k]) == len(positions) for k in need):
            continue
        if any(not 0 <= q < n for q in positions):
            continue
        classes, flips = cmp.flip_classes, cmp.flips
        by_pos = dict(zip(flips, classes)) if classes is not None and flips is not None \
            and len(classes) == len(flips) else {}
        return {"positions": positions, "cols": cols, "approximate": cmp.kind != "full",
                "classes": by_pos, "compact": set(cmp.compact_positions or ())}
    return None


def forced_panel(tb: TurnBuilder, p: int) -> dict | None:
    """The top-k panel at position ``p`` across every forced member, the reference first."""
    ref = tb.forced_members.get(tb.ref_name) if tb.ref_name else None
    order = list(tb.forced_members)
    if tb.ref_name in order:
        order.remove(tb.ref_name)
        order.insert(0, tb.ref_name)
    present, lanes = [], []
    for k in order:
        d = tb.dist(tb.forced_members[k], p, ref)
        if d is not None:
            present.append((tb.index[k], d))
            lanes.append(tb.forced_members[k])
    return panel(present, engine=tb.rows.engine(lanes, p)) if present else None


def _stored_columns(tb: TurnBuilder, cand: Lane, ref: Lane | None, n: int) -> dict | None:
    if ref is None or not cand.run_id or not ref.run_id:
        return None
    return stored_columns(tb.comparisons(cand.run_id), ref.run_id, n)


def forced_view(tb: TurnBuilder, inline: bool, used: set[int]) -> dict:
    """The forced part of the turn view (``{"available": False}`` without forced runs). Panels
    are built when ``inline``; the token ids the view shows are added to ``used``."""
    t = tb.turn
    tokens = t.lane.token_ids
    n = len(tokens)
    if not tb.inp.forced:
        return {"available": False}
    members = tb.forced_members
    for name, lane in tb.inp.forced.items():
        d = first_difference(tokens, lane.token_ids)
        if lane.token_ids and d is not None and d < len(lane.token_ids):
            tb.rows.warn(f"{name} (forced): emitted tokens differ from the primary's at "
                         f"position {d}; its forced metrics may be misaligned")
    ref_name = tb.ref_name
    ref_lane = members.get(ref_name) if ref_name else None
    regions = tag_regions(tb.pieces(t.lane)) if n else []
    cands = [k for k in members if k != ref_name] if ref_name else []
    arr: dict[str, dict[str, Any]] = {k: {"kl": [None] * n, "delta_p": [None] * n, "rank": [None] * n,
               "top1": [None] * n, "flip": [None] * n, "approx": [False] * n, "cls": {}} for k in cands}
    margin: list[float | None] = [None] * n
    ref_top1: list[int | None] = [None] * n
    slow = []
    for k in cands:
        cached = _stored_columns(tb, members[k], ref_lane, n)
        if cached is None:
            slow.append(k)
            continue
        cols = cached["cols"]
        arr[k]["cls"] = cached["classes"]
        lower = cols.get("rank_lower_bound") or [False] * len(cached["positions"])
        for q, p in enumerate(cached["positions"]):
            put(arr[k], p, kl=cols["kl"][q], delta_p=cols["delta_p"][q], rank=cols["rank"][q],
                lower=bool(lower[q]), top1=cols["cand_top1"][q],
                flip=cols["cand_top1"][q] != cols["ref_top1"][q],
                approx=cached["approximate"] or p in cached["compact"])  # compact rows: from their top k
            if margin[p] is None and cols["margin"][q] is not None:
                margin[p] = sig(cols["margin"][q])
                ref_top1[p] = cols["ref_top1"][q]
    # A candidate without rows is compared on top-k: take the reference's top-k from its
    # record when it has one, rather than decoding its rows.
    ref_topk = tb.topk(ref_lane) if ref_lane is not None else None
    if ref_topk is not None:
        for k in list(slow):
            cand_topk = None if tb.rows.has_rows(members[k]) else tb.topk(members[k])
            if cand_topk:
                slow.remove(k)
                topk_metrics(arr[k], ref_topk, cand_topk, tokens, margin, ref_top1, tb.rows.warn)
    panels: list[dict | None] | None = [None] * n if inline else None
    if slow or inline:
        for s in range(0, n, CHUNK):
            e = min(n, s + CHUNK)
            need = set(slow) | ({ref_name} if slow and ref_name else set())
            if inline:
                need = set(members)
            dists = {k: [tb.dist(members[k], p, ref_lane) for p in range(s, e)] for k in need}
            for k in slow:  # candidates exist only with a reference
                assert ref_name is not None
                chunk_metrics(arr[k], dists[ref_name], dists[k], tokens, s, e, margin, ref_top1, tb.rows.warn)
            if panels is not None:
                for j, p in enumerate(range(s, e)):
                    keys = [k for k in ([ref_name] if ref_name else []) + [k for k in members if k != ref_name]
                            if dists[k][j] is not None]
                    present = [(tb.index[k], dists[k][j]) for k in keys]
                    if present:
                        built = panel(present, engine=tb.rows.engine([members[k] for k in keys], p))
                        panels[p] = built
                        used.update(built["ids"])
    lanes_out: dict[str, dict] = {}
    flips: dict[int, dict] = {}
    for k in cands:
        a = arr[k]
        known = [i for i in range(n) if a["flip"][i] is not None]
        summary = summary_of(a, known, [regions[i] for i in known]) if known else None
        lanes_out[k] = {
            "kl": sigs(a["kl"]),
            "delta_p": sigs(a["delta_p"]),
            "rank": a["rank"],
            "top1": a["top1"],
            "flips": [i for i in known if a["flip"][i]],
            # why each flip happened (stored comparisons; null where none classified it)
            "flip_classes": [a["cls"].get(i) for i in known if a["flip"][i]],
            "approximate": any(a["approx"][i] for i in known),
            "coverage": len(known),
            "summary": summary,
        }
        used.update(x for x in a["top1"] if x is not None)
        for i in lanes_out[k]["flips"]:
            f = flips.setdefault(i, {"position": i, "backends": [], "kl": {}, "top1": {}, "classes": {},
                                     "margin": margin[i], "region": regions[i] if regions else None,
                                     "token": tokens[i], "ref_top1": ref_top1[i]})
            f["backends"].append(k)
            f["classes"][k] = a["cls"].get(i)
            f["kl"][k] = lanes_out[k]["kl"][i]
            f["top1"][k] = a["top1"][i]
    if ref_name is None:
        tb.rows.warn("forced: no reference distribution (no rows and no top-k logprobs)")
    return {
        "available": True,
        "reference": ref_name,
        "members": list(members),
        "tokens": tokens,
        "regions": regions,
        "margin": margin,
        "ref_top1": ref_top1,
        "lanes": lanes_out,
        "flips": [flips[i] for i in sorted(flips)],
        "panels": panels,
    }


def put(a: dict, p: int, *, kl: Any, delta_p: Any, rank: Any, lower: bool, top1: Any, flip: bool,
        approx: bool) -> None:
    """Set position ``p`` of a candidate's metric columns ``a``."""
    a["kl"][p] = None if kl is None else float(kl)
    a["delta_p"][p] = None if delta_p is None else float(delta_p)
    r = None if rank is None else int(rank)
    a["rank"][p] = -r if (r is not None and lower) else r  # negative: "at least |rank|"
    a["top1"][p] = None if top1 is None else int(top1)
    a["flip"][p] = bool(flip)
    a["approx"][p] = approx


def topk_metrics(a: dict, ref: list, cand: list, tokens: Sequence[int], margin: list, ref_top1: list,
                 warn: Callable[[str], None]) -> None:
    """Approximate metrics from two lanes' recorded top-k (no rows decoded)."""
    n = min(len(tokens), len(ref), len(cand))
    for s in range(0, n, 256):
        e = min(n, s + 256)
        chunk_metrics(a, ref[s:e], cand[s:e], tokens, s, e, margin, ref_top1, warn)


def chunk_metrics(a: dict, ref: list, cand: list, tokens: Sequence[int], s: int, e: int,
                  margin: list, ref_top1: list, warn: Callable[[str], None]) -> None:
    """Metrics of positions ``s`` to ``e`` from the reference's and the candidate's
    distributions there: full-vocabulary where both are rows, approximate from top-k where
    either is not; into ``a``, and the reference's margin and top token where not yet known."""
    full = [j for j in range(e - s) if isinstance(ref[j], Row) and isinstance(cand[j], Row)
            and ref[j].x.size == cand[j].x.size]
    done = set(full)
    parts = []
    if full:
        try:
            m = position_metrics(np.stack([ref[j].x for j in full]), np.stack([cand[j].x for j in full]),
                                 [tokens[s + j] for j in full])
            parts.append((full, m, False))
        except AnalysisInputError as exc:
            warn(f"metrics skipped for positions {s}-{e - 1}: {exc}")
    rest = [j for j in range(e - s) if j not in done and ref[j] is not None and cand[j] is not None]
    if rest:
        try:
            m = topk_position_metrics([ref[j].topk_dict(20) for j in rest],
                                      [cand[j].topk_dict(20) for j in rest],
                                      [tokens[s + j] for j in rest])
            parts.append((rest, m, True))
        except AnalysisInputError as exc:
            warn(f"approximate metrics skipped for positions {s}-{e - 1}: {exc}")
    for js, m, approx in parts:
        lower = m.rank_lower_bound
        for q, j in enumerate(js):
            p = s + j
            put(a, p, kl=m.kl[q], delta_p=m.delta_p[q], rank=m.rank[q],
                lower=bool(lower[q]) if lower is not None else False, top1=m.cand_top1[q],
                flip=not bool(m.top1_agree[q]), approx=approx)
            if margin[p] is None and math.isfinite(float(m.margin[q])):
                margin[p] = sig(float(m.margin[q]))
                ref_top1[p] = int(m.ref_top1[q])


def summary_of(a: dict, known: list[int], regions: list[str]) -> dict | None:
    """The run summary (DESIGN) over the positions that have metrics."""

    def arr(name: str) -> np.ndarray:
        return np.array([a[name][i] if a[name][i] is not None else np.nan for i in known], dtype=np.float64)

    flips = np.array([bool(a["flip"][i]) for i in known])
    k = len(known)
    m = PositionMetrics(
        top1_agree=~flips, kl=arr("kl"), delta_p=arr("delta_p"), margin=np.full(k, np.nan),
        rank=np.array([abs(a["rank"][i] or 0) for i in known], dtype=np.int64), entropy=np.full(k, np.nan),
        ref_top1=np.zeros(k, np.int64), cand_top1=np.zeros(k, np.int64),
        approximate=any(a["approx"][i] for i in known),
    )
    try:
        s = summarize(m, regions)
    except AnalysisInputError:
        return None
    first = s.get("first_flip")
    return {
        "n": s["n"],
        "approximate": s["approximate"],
        "kl_mean": sig(s["kl"]["mean"]),
        "kl_se": sig(s["kl"]["se"]),
        "kl_max": sig(s["kl"]["max"]),
        "kl_p99": sig(s["kl"].get("p99")),
        "rms_delta_p": sig(s["delta_p"].get("rms")),
        "same_top_p": sig(s["same_top_p"]["p"], 6),
        "same_top_p_se": sig(s["same_top_p"]["se"]),
        "flips": s["flips"],
        "first_flip": None if first is None else known[first],
        "flips_by_region": s.get("flips_by_region", {}),
    }
