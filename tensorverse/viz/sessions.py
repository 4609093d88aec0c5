"""Session listing and search: a turn's brief (tokens, divergence and verdict per backend), a
session's summary over its briefs, the search, filters, sorts and paging of the sessions list."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from tensorverse.analysis.toolcalls import SEVERITY, compare_tool_calls
from tensorverse.analysis.flips import first_difference
from tensorverse.viz.lanes import TurnInputs, extract_calls
from tensorverse.store.records import Session
from tensorverse.viz.lane import Lane

__all__ = ["VERDICT_ORDER", "SORT_KEYS", "worst", "tags", "session_matches", "sort_key", "turn_brief",
           "session_summary", "first_divergences", "page_bounds", "sessions_page"]

#: Worst first. ``error``: a run failed; ``none``: no shadow run to judge.
VERDICT_ORDER: tuple[str, ...] = ("error",) + tuple(SEVERITY) + ("none",)
SORT_KEYS = ("time", "turns", "flips", "verdict", "backends")


def worst(verdicts: Iterable[str | None]) -> str:
    """The worst of the verdicts given, in :data:`VERDICT_ORDER` ("none" when there is none)."""
    seen = [v for v in verdicts if v]
    if not seen:
        return "none"
    rank = {v: i for i, v in enumerate(VERDICT_ORDER)}
    return min(seen, key=lambda v: rank.get(v, len(VERDICT_ORDER)))


def tags(raw: Any) -> dict[str, str]:
    """A session's tags as ``{key: value}`` (a bare tag has the value "")."""
    if isinstance(raw, Mapping):
        return {str(k): "" if v is None else str(v) for k, v in raw.items()}
    if isinstance(raw, (list, tuple)):
        return {str(t): "" for t in raw}
    return {}


def session_matches(s: Session, ql: str) -> bool:
    """Whether the lower-cased query ``ql`` is in the session's id or one of its ``key=value`` tags."""
    if ql in s.id.lower():
        return True
    return any(ql in f"{k}={v}".lower() for k, v in tags(s.tags).items())


def sort_key(sort: str) -> Callable[[dict], Any]:
    """The key of a session summary for one of :data:`SORT_KEYS`."""
    rank = {v: i for i, v in enumerate(VERDICT_ORDER)}
    if sort == "flips":
        return lambda i: (i["flips"], i["forced_flips"] or 0, i["created_ns"])
    if sort == "verdict":  # "desc" = worst first
        return lambda i: (-rank.get(i["worst"], len(rank)), i["flips"], i["created_ns"])
    if sort == "backends":
        return lambda i: (len(i["backends"]), i["created_ns"])
    if sort == "turns":
        return lambda i: (i["turns"], i["created_ns"])
    return lambda i: i["created_ns"]


def turn_brief(inp: TurnInputs, forced_flips: Callable[[Lane | None], int | None]) -> dict:
    """A turn's brief for the timeline and the session summaries (tokens and text only, no
    rows): per backend where its free run left the primary's answer, the verdict on its tool
    calls, its forced flips (``forced_flips(forced lane)``: from stored comparisons) and its
    failures."""
    t = inp.turn
    prim = t.lane
    ref_calls = extract_calls(prim)
    per: dict[str, dict] = {}
    for name in inp.order[1:]:
        free = inp.free.get(name)
        entry: dict[str, Any] = {"divergence": None, "verdict": None,
                                 "forced_flips": forced_flips(inp.forced.get(name)),
                                 "status": "ok"}
        if free is not None:
            entry["divergence"] = first_difference(prim.token_ids, free.token_ids)
            entry["verdict"] = compare_tool_calls(ref_calls, extract_calls(free)).verdict
            entry["status"] = free.status
        failed = [l for l in inp.failed if l.backend == name]
        if failed:
            last = failed[-1]
            entry["status"] = last.status
            entry["error"] = f"{last.mode}: {last.status}" + (f": {last.error}" if last.error else "")
            # no verdict can be had without a free run: the failure stands for it
            if (free is None or not free.ok) and last.status != "refused":
                entry["verdict"] = "error"
        per[name] = entry
    return {
        "id": t.id,
        "index": t.index,
        "created_ns": t.created_ns,
        "state": t.state,
        "tokens": len(prim.token_ids),
        "primary": t.primary,
        "backends": per,
        "worst": worst(e["verdict"] for e in per.values()),
        "flips": sum(1 for e in per.values() if e["divergence"] is not None),
        "parser_mismatch": bool((inp.parser_check or {}).get("mismatch")),
    }


def session_summary(s: Session, briefs: Sequence[dict]) -> dict:
    """A session's line in the sessions list, from its record and its turns' briefs."""
    names: list[str] = []
    for b in briefs:
        for n in [b["primary"], *b["backends"]]:
            if n not in names:
                names.append(n)
    forced = [e["forced_flips"] for b in briefs for e in b["backends"].values()
              if e["forced_flips"] is not None]
    return {
        "id": s.id,
        "created_ns": s.created_ns,
        "updated_ns": s.updated_ns,
        "tags": tags(s.tags),
        "turns": len(briefs),
        "backends": names,
        "worst": worst(b["worst"] for b in briefs if b["worst"] != "none"),
        "flips": sum(b["flips"] for b in briefs),
        "forced_flips": sum(forced) if forced else None,
        "first_divergence_turn": next((b["index"] for b in briefs if b["flips"]), None),
    }


def first_divergences(names: Sequence[str], briefs: Sequence[dict]) -> dict[str, int | None]:
    """Per backend but the first (the primary), the index of the first turn its free run left
    the primary's answer (None: never)."""
    first: dict[str, int | None] = {}
    for n in names[1:]:
        first[n] = next((b["index"] for b in briefs
                         if (b["backends"].get(n) or {}).get("divergence") is not None), None)
    return first


def page_bounds(sort: str, order: str, offset: int, limit: int) -> tuple[int, int]:
    """``offset`` and ``limit`` clamped (a page holds 1 to 200 sessions); ValueError for an
    unknown sort or order."""
    if sort not in SORT_KEYS:
        raise ValueError(f"sort must be one of {', '.join(SORT_KEYS)}")
    if order not in ("asc", "desc"):
        raise ValueError("order must be asc or desc")
    return max(0, int(offset)), max(1, min(200, int(limit)))


def sessions_page(raw: Iterable[Session], summarise: Callable[[Session], dict], *, q: str, sort: str,
                  order: str, offset: int, limit: int, verdict: str, backend: str) -> dict:
    """One page of the sessions list from the session records (in creation order) and
    ``summarise`` (a record -> its summary). Sorting by time or turns only summarises the page
    shown; the other sorts and the filters summarise every session."""
    ql = q.strip().lower()
    raw = [s for s in raw if not ql or session_matches(s, ql)]
    if sort not in ("time", "turns") or verdict or backend:
        items = [summarise(s) for s in raw]
        if verdict:
            items = [i for i in items if i["worst"] == verdict]
        if backend:
            items = [i for i in items if backend in i["backends"]]
        items.sort(key=sort_key(sort), reverse=(order == "desc"))
        total = len(items)
        page = items[offset: offset + limit]
    else:
        if sort == "turns":
            raw.sort(key=lambda s: (s.turns, s.created_ns),
                     reverse=(order == "desc"))
        elif order == "desc":
            raw.reverse()  # the store iterates in creation order
        total = len(raw)
        page = [summarise(s) for s in raw[offset: offset + limit]]
    return {"total": total, "offset": offset, "limit": limit, "sort": sort, "order": order,
            "items": page, "verdicts": list(VERDICT_ORDER)}
