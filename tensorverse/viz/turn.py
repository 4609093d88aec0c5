"""One turn's view: :class:`TurnBuilder` holds a turn's lanes, their token pieces, the rows
reader and the forced reference, and assembles the turn view from its prompt, its forced part
(:mod:`tensorverse.viz.forced`) and its free tree (:mod:`tensorverse.viz.free`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from tensorverse.store.records import BackendInfo, Comparison
from tensorverse.viz.forced import forced_panel, forced_view
from tensorverse.viz.free import FreeTree
from tensorverse.viz.lanes import TurnInputs
from tensorverse.viz.pieces import infer_free_pieces, known_pieces, lane_pieces
from tensorverse.viz.lane import FORCED, FREE, ROLES_REFERENCE, Lane, TurnRec, topk_entry
from tensorverse.viz.rows import RowReader, TopK

__all__ = ["TurnBuilder", "prompt_view", "MAX_PROMPT_CHARS"]

MAX_PROMPT_CHARS = 200_000


class TurnBuilder:
    """Everything about one turn: its lanes, reference, tree; builds the view and panels.

    ``comparisons(run id)``: the stored comparisons of a run (forced metrics and flip classes
    are read from them when present)."""

    def __init__(self, store: Any, comparisons: Callable[[str], list[Comparison]], inp: TurnInputs,
                 backends: Mapping[str, BackendInfo]) -> None:
        self.comparisons = comparisons
        self.inp = inp
        self.turn = inp.turn
        self.warnings = list(inp.warnings)
        self.rows = RowReader(store, self.warnings)
        self.names = inp.order
        self.index = {n: i for i, n in enumerate(self.names)}
        self.backends = backends
        self._topk_cache: dict[int, list | None] = {}
        prim = self.turn.lane
        self.vocab: dict[int, str] = known_pieces([prim, *inp.forced.values(), *inp.free.values()])
        # Free runs usually come with their text but no per-token pieces: recover them.
        self.inferred = infer_free_pieces(inp.free.values(), self.vocab)
        self.forced_members = {self.turn.primary: prim,
                               **{k: inp.forced[k] for k in self.names if k in inp.forced}}
        self.free_lanes = {self.turn.primary: prim,
                           **{k: inp.free[k] for k in self.names if k in inp.free}}
        self.ref_name = self._reference()
        self.free_tree = FreeTree(self)

    # ---- distributions

    def pieces(self, lane: Lane) -> list[str]:
        return lane_pieces(lane, self.inferred, self.vocab)

    def topk(self, lane: Lane) -> list | None:
        """The lane's recorded top-k per position (None: none, or unreadable)."""
        key = id(lane)
        if key not in self._topk_cache:
            out: list[TopK | None] | None = None
            if lane.topk is not None:
                out = []
                for entry in lane.topk:
                    d = topk_entry(entry)
                    out.append(TopK(d) if d else None)
                if all(e is None for e in out):
                    self.rows.warn(f"{lane.backend} ({lane.mode}): top-k logprobs unreadable "
                                   "(keyed by token text, not ids?)")
                    out = None
            self._topk_cache[key] = out
        return self._topk_cache[key]

    def dist(self, lane: Lane, pos: int, ref: Lane | None = None) -> Any:
        """The lane's distribution at ``pos``: its logits row when stored, else its top-k."""
        row = self.rows.get(lane, pos, ref)
        if row is not None:
            return row
        tk = self.topk(lane)
        if tk is not None and pos < len(tk) and tk[pos] is not None:
            return tk[pos]
        return None

    def _reference(self) -> str | None:
        """Whose distribution is P in forced mode, as :func:`tensorverse.shadow.compare.
        select_reference` chooses: the turn's stated reference; else a secondary's forced run,
        else a reference's (rows preferred); else the primary (its rows, else its top-k); else
        any backend with rows."""
        t, members = self.turn, self.forced_members
        if len(members) < 2:
            return None
        if t.reference in members:
            return t.reference
        for role in ROLES_REFERENCE:
            cands = sorted((n for n, l in members.items() if n != t.primary and l.role == role and l.ok),
                           key=lambda n: (not self.rows.has_rows(members[n]), n))
            if cands:
                return cands[0]
        if self.rows.has_rows(t.lane) or self.topk(t.lane) is not None:
            return t.primary
        for n, lane in members.items():
            if self.rows.has_rows(lane):
                return n
        return t.primary

    def _row_cost(self) -> int:
        """Rows the panels of this turn would decode."""
        n = len(self.turn.lane.token_ids)
        cost = sum(n for l in self.forced_members.values() if self.rows.has_rows(l)) if self.inp.forced else 0
        cost += sum(len(l.token_ids) for l in self.free_lanes.values() if self.rows.has_rows(l))
        return cost

    # ---- panels (built on request when the view is lazy)

    def forced_panel(self, p: int) -> dict | None:
        return forced_panel(self, p)

    def free_panel(self, node_id: int, p: int) -> dict | None:
        return self.free_tree.panel(node_id, p)

    # ---- the whole view

    def build(self, inline_panels: bool | None, inline_rows: int) -> dict:
        """The turn view. ``inline_panels``: True builds every top-k panel now, None builds them
        when they need at most ``inline_rows`` rows."""
        t = self.turn
        inline = inline_panels if inline_panels is not None else self._row_cost() <= inline_rows
        used: set[int] = set()
        forced = forced_view(self, inline, used)
        free = self.free_tree.view(inline, used)
        lanes = []
        for n in self.names:
            fl = t.lane if n == t.primary else self.inp.forced.get(n)
            fr = t.lane if n == t.primary else self.inp.free.get(n)
            info = self.backends.get(n)
            failed = [l for l in self.inp.failed if l.backend == n]
            any_lane = fl or fr or (failed[0] if failed else None)
            lanes.append({
                "name": n,
                "role": "primary" if n == t.primary else (any_lane.role if any_lane else
                                                          (info.role if info else None) or "shadow"),
                "model": info.model if info else None,
                "forced": fl is not None and bool(self.inp.forced),
                "free": fr is not None,
                "rows": {"forced": bool(fl and self.rows.has_rows(fl)),
                         "free": bool(fr and self.rows.has_rows(fr))},
                "errors": [f"{l.mode}: {l.status}" + (f": {l.error}" if l.error else "")
                           for l in failed],
            })
        for lane in self.free_lanes.values():
            used.update(lane.token_ids)
        vocab = {str(i): self.vocab[i] for i in sorted(used) if i in self.vocab}
        return {
            "kind": "turn",
            "session_id": t.session_id,
            "turn": {"id": t.id, "index": t.index, "created_ns": t.created_ns, "state": t.state,
                     "primary": t.primary, "tokens": len(t.lane.token_ids)},
            "prompt": prompt_view(t),
            "backends": lanes,
            "vocab": vocab,
            "lazy_panels": not inline,
            "forced": forced,
            "free": free,
            "default_mode": FORCED if forced["available"] else FREE,
            "parser_check": self.inp.parser_check,
            "warnings": list(self.warnings),
        }


def prompt_view(t: TurnRec) -> dict:
    """The turn's prompt as shown: its messages (content parts joined, tool calls appended) and
    its prompt text, each cut at :data:`MAX_PROMPT_CHARS` characters (the messages in all)."""
    import orjson

    msgs = []
    total = 0
    for m in t.messages or []:
        if not isinstance(m, Mapping):
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts / Anthropic blocks
            parts = []
            for p in content:
                if isinstance(p, Mapping):
                    parts.append(str(p.get("text") or p.get("content") or
                                     (orjson.dumps(p).decode() if p.get("type") != "image_url" else "[image]")))
                else:
                    parts.append(str(p))
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            content = orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS).decode()
        extra = m.get("tool_calls")
        if extra:
            content = (content or "") + "\n" + orjson.dumps(extra, option=orjson.OPT_NON_STR_KEYS).decode()
        content = (content or "")[: max(0, MAX_PROMPT_CHARS - total)]
        total += len(content)
        msgs.append({"role": str(m.get("role", "")), "content": content})
    text = t.prompt_text[:MAX_PROMPT_CHARS] if t.prompt_text else None
    return {"messages": msgs, "text": text,
            "token_count": None if t.prompt_ids is None else len(t.prompt_ids)}
