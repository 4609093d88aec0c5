"""Free mode of a turn view: the multiverse tree of the primary's answer and each backend's free
run (:func:`tensorverse.analysis.multiverse.build_tree`).

Shared prefixes once, branch points with the backends following each branch, the flip's margin
and kl, top-k panels of the backends sharing each context, and the tool calls of every branch
with their verdict against the primary's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from tensorverse.analysis.metrics import AnalysisInputError, position_metrics
from tensorverse.analysis.multiverse import END, build_tree
from tensorverse.analysis.regions import tag_regions
from tensorverse.analysis.toolcalls import compare_tool_calls
from tensorverse.analysis.topk import topk_position_metrics
from tensorverse.viz.lanes import extract_calls
from tensorverse.viz.panels import panel
from tensorverse.store.records import Comparison, FreeComparison
from tensorverse.viz.lane import FREE
from tensorverse.viz.rounding import sig
from tensorverse.viz.rows import Row, margin

if TYPE_CHECKING:
    from tensorverse.viz.turn import TurnBuilder

__all__ = ["FreeTree", "stored_flip_class", "node_texts"]


def stored_flip_class(comparisons: Iterable[Comparison]) -> str | None:
    """The class of a free run's flip from its stored comparisons (None: none stored, or no
    flip)."""
    for cmp in comparisons:
        if isinstance(cmp, FreeComparison) and cmp.mode == FREE and cmp.status == "ok":
            return cmp.flip_class
    return None


def node_texts(node: Any, inferred: Mapping[str, tuple[list[str], list[bool]]],
               vocab: Mapping[int, str]) -> dict:
    """Per-token text of a node whose tokens have no exact piece (a free run's text split
    where the token boundaries are unknown): ``texts`` and the ``inexact`` offsets."""
    lead = next((b for b in node.backends if b in inferred), None)
    if lead is None or all(t in vocab for t in node.tokens):
        return {}
    pieces, exact = inferred[lead]
    sl = slice(node.start, node.end)
    return {"texts": pieces[sl],
            "inexact": [i for i, ok in enumerate(exact[sl]) if not ok]}


class FreeTree:
    """The multiverse tree of one turn's free lanes; builds the free part of its view and the
    top-k panel of a position in a node."""

    def __init__(self, tb: TurnBuilder) -> None:
        self.tb = tb
        self.tree = build_tree({k: l.token_ids for k, l in tb.free_lanes.items()})
        self.parent: dict[int, Any] = {}
        self.nodes: dict[int, Any] = {}
        for node in self.tree.nodes():
            self.nodes[node.id] = node
            for c in node.children:
                self.parent[c.id] = node

    def flip_class(self, backend: str) -> str | None:
        """The class of a backend's free-run flip, from its stored comparison (None: none stored,
        or no flip)."""
        lane = self.tb.inp.free.get(backend)
        if lane is None or not lane.run_id:
            return None
        return stored_flip_class(self.tb.comparisons(lane.run_id))

    def _group_ref(self, group: Sequence[str], p: int) -> str:
        """Whose distribution is the reference among backends sharing a context: the forced
        reference when it is in the group and has a distribution there, else the first of the
        group (the primary when present)."""
        tb = self.tb
        r = tb.ref_name
        if r in group and r in tb.free_lanes and tb.dist(tb.free_lanes[r], p) is not None:
            return r
        return group[0]

    def _group(self, node: Any, p: int) -> list[str]:
        """Backends that share the context of position ``p`` in ``node``: at a branch point (the
        first token of a child) the parent's, whose members chose between the branches."""
        par = self.parent.get(node.id)
        return list(par.backends if (p == node.start and par is not None) else node.backends)

    def panel(self, node_id: int, p: int) -> dict | None:
        """The top-k panel at position ``p`` of tree node ``node_id``."""
        tb = self.tb
        node = self.nodes.get(node_id)
        if node is None or not node.start <= p < node.end:
            raise ValueError(f"no position {p} in tree node {node_id}")
        group = self._group(node, p)
        ref_b = self._group_ref(group, p)
        present, lanes = [], []
        for b in [ref_b] + [g for g in group if g != ref_b]:
            d = tb.dist(tb.free_lanes[b], p)
            if d is not None:
                present.append((tb.index[b], d))
                lanes.append(tb.free_lanes[b])
        return panel(present, engine=tb.rows.engine(lanes, p)) if present else None

    def view(self, inline: bool, used: set[int]) -> dict:
        """The free part of the turn view. Panels are built when ``inline``; the token ids the
        view shows are added to ``used``."""
        tb = self.tb
        regions = {k: (tag_regions(tb.pieces(l)) if l.token_ids else []) for k, l in tb.free_lanes.items()}
        depth: dict[int, int] = {self.tree.root.id: 0}
        nodes = []
        branch_points = []
        for node in self.tree.nodes():
            par = self.parent.get(node.id)
            if par is not None:
                depth[node.id] = depth[par.id] + 1
            panels = None
            if inline:
                panels = [self.panel(node.id, p) for p in range(node.start, node.end)]
                for pn in panels:
                    if pn:
                        used.update(pn["ids"])
            nodes.append({
                "id": node.id,
                "parent": None if par is None else par.id,
                "depth": depth[node.id],
                "start": node.start,
                "end": node.end,
                "tokens": node.tokens,
                "backends": node.backends,
                "ended": node.ended,
                "children": [c.id for c in node.children],
                "regions": regions[node.backends[0]][node.start: node.end],
                "panels": panels,
                **node_texts(node, tb.inferred, tb.vocab),
            })
            if node.is_branch_point:
                branch_points.append(self._branch_point(node, used))
        branch_points.sort(key=lambda b: (b["position"], b["node"]))
        return {
            "available": True,
            "lengths": self.tree.lengths,
            "root": self.tree.root.id,
            "nodes": nodes,
            "branch_points": branch_points,
            "toolcalls": self._toolcalls(),
        }

    def _branch_point(self, node: Any, used: set[int]) -> dict:
        tb = self.tb
        p = node.end
        ref_b = self._group_ref(node.backends, p)
        options = [{"token": c.tokens[0], "backends": list(c.backends), "node": c.id} for c in node.children]
        if node.ended:
            options.append({"token": END, "backends": list(node.ended), "node": None})
        ref_d = tb.dist(tb.free_lanes[ref_b], p)
        ref_margin = sig(margin(ref_d)) if ref_d is not None else None
        kl: dict[str, float | None] = {}
        t_ref = next((o["token"] for o in options if ref_b in o["backends"]), END)
        if t_ref == END:  # the reference ended here: measure at the first branch's token
            t_ref = node.children[0].tokens[0]
        used.update(o["token"] for o in options if o["token"] != END)
        if ref_d is not None:
            for b in node.backends:
                if b == ref_b:
                    continue
                d = tb.dist(tb.free_lanes[b], p)
                if d is None:
                    continue
                try:
                    if isinstance(ref_d, Row) and isinstance(d, Row) and ref_d.x.size == d.x.size:
                        m = position_metrics(ref_d.x[None, :], d.x[None, :], [t_ref])
                    else:
                        m = topk_position_metrics([ref_d.topk_dict(20)], [d.topk_dict(20)], [t_ref])
                    kl[b] = sig(float(m.kl[0]))
                except AnalysisInputError:
                    pass
        # the class of each backend's flip here: those that left the reference's branch
        classes = {b: self.flip_class(b) for o in options if ref_b not in o["backends"]
                   for b in o["backends"] if b in tb.inp.free}
        return {"position": p, "node": node.id, "reference": ref_b, "options": options,
                "margin": ref_margin, "kl": kl, "classes": classes}

    def _toolcalls(self) -> list[dict]:
        tb = self.tb
        prim = tb.turn.lane
        ref = extract_calls(prim, tb.vocab)
        out = []
        for node in self.tree.nodes():
            if not node.ended:
                continue
            is_ref = tb.turn.primary in node.ended
            ext = ref if is_ref else extract_calls(tb.free_lanes[node.ended[0]], tb.vocab)
            out.append({
                "node": node.id,
                "backends": list(node.ended),
                "reference": is_ref,
                "extraction": ext.to_dict(),
                "verdict": None if is_ref else compare_tool_calls(ref, ext).to_dict(),
                "classes": {b: self.flip_class(b) for b in node.ended if b in tb.inp.free},
                "status": {b: tb.free_lanes[b].status for b in node.ended},
            })
        out.sort(key=lambda e: (not e["reference"], tb.index.get(e["backends"][0], 0)))
        return out
