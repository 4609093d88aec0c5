"""The multiverse tree: where the backends' outputs for one prompt part ways.

A compressed trie (radix tree) over the output token sequences of several backends that share a
prompt. Each :class:`Node` holds a run of tokens that all its backends emitted, starting at output
position ``start``; after the run, the node either has children (one per distinct next token,
each listing the backends that took it) or its backends end there. A backend whose sequence stops
while others go on (stopped early, max_tokens, EOS) is listed in the node's ``ended``: that is the
*explicit end marker*; in :func:`branch_points` it appears under the key :data:`END` (``-1``, not a
valid token id).

* Identical sequences give a single node holding the whole sequence.
* When the sequences differ at position 0, the root has an empty segment and the children.
* A *branch point* is a node end where at least two options exist (two next tokens, or a next
  token and an end). Its position is the output position of the first token that differs.
* Children keep the order in which their first backend appears in the input mapping, so the
  reference (primary) backend, listed first, is always on the first child.
* Any number of branches >= 1 is accepted; the viewer is designed for 2-5. Empty sequences are
  fine (the backend ends at position 0). Token ids must be non-negative integers (numpy integers
  are accepted and converted); backend names must be non-empty strings.

Pure Python, no I/O; building is O(total tokens x branches).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["END", "BranchPoint", "Node", "Tree", "branch_points", "build_tree"]

#: Key used in :func:`branch_points` for "this backend's output ends here".
END = -1


@dataclass
class Node:
    """A run of shared tokens, followed by children (a branch point) and/or ended backends."""

    id: int
    start: int
    tokens: list[int]
    backends: list[str]
    children: list[Node] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)

    @property
    def end(self) -> int:
        """Output position just after this node's segment (where its options begin)."""
        return self.start + len(self.tokens)

    @property
    def is_branch_point(self) -> bool:
        return len(self.children) + (1 if self.ended else 0) >= 2

    def options(self) -> dict[int, list[str]]:
        """Next token id -> backends taking it (``END`` -> backends ending here)."""
        out: dict[int, list[str]] = {c.tokens[0]: list(c.backends) for c in self.children}
        if self.ended:
            out[END] = list(self.ended)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "start": self.start,
            "end": self.end,
            "tokens": list(self.tokens),
            "backends": list(self.backends),
            "ended": list(self.ended),
            "children": [c.to_dict() for c in self.children],
        }


class BranchPoint(NamedTuple):
    """``(position, {token_id or END: [backends]})``; unpacks as a 2-tuple."""

    position: int
    options: dict[int, list[str]]


@dataclass
class Tree:
    root: Node
    backends: list[str]
    lengths: dict[str, int]

    def nodes(self) -> Iterator[Node]:
        """All nodes, depth first, children in order (ids are this order)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def path(self, backend: str) -> list[Node]:
        """The nodes a backend's sequence runs through, root first."""
        if backend not in self.lengths:
            raise KeyError(backend)
        out = [self.root]
        while True:
            nxt = next((c for c in out[-1].children if backend in c.backends), None)
            if nxt is None:
                return out
            out.append(nxt)

    def sequence(self, backend: str) -> list[int]:
        """Rebuild a backend's token sequence by walking the tree."""
        seq: list[int] = []
        for node in self.path(backend):
            seq.extend(node.tokens)
        return seq

    def divergence(self, a: str, b: str) -> int | None:
        """First output position where backends ``a`` and ``b`` differ (a token differs, or one
        ends while the other continues); ``None`` when their sequences are identical."""
        pa, pb = self.path(a), self.path(b)
        k = 0
        while k < len(pa) and k < len(pb) and pa[k] is pb[k]:
            k += 1
        last = pa[k - 1]
        if k == len(pa) and k == len(pb):
            return None
        return last.end

    def branch_points(self) -> list[BranchPoint]:
        return branch_points(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backends": list(self.backends),
            "lengths": dict(self.lengths),
            "root": self.root.to_dict(),
            "branch_points": [
                {"position": bp.position, "options": [{"token": t, "backends": b} for t, b in bp.options.items()]}
                for bp in branch_points(self)
            ],
        }


def _validate(branches: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    if not isinstance(branches, Mapping):
        raise TypeError("branches must be a mapping of backend name -> token ids")
    if len(branches) == 0:
        raise ValueError("build_tree needs at least one branch")
    out: dict[str, list[int]] = {}
    for name, seq in branches.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"backend name must be a non-empty string, got {name!r}")
        if seq is None:
            seq = []
        ids: list[int] = []
        for t in seq:
            if isinstance(t, bool):
                raise ValueError(f"{name}: token id must be an integer, got {t!r}")
            try:
                v = operator.index(t)
            except TypeError:
                raise ValueError(f"{name}: token id must be an integer, got {t!r}") from None
            if v < 0:
                raise ValueError(f"{name}: token id must be >= 0, got {v}")
            ids.append(v)
        out[name] = ids
    return out


def build_tree(branches: Mapping[str, Sequence[int]]) -> Tree:
    """Build the multiverse tree of ``{backend: output token ids}`` (see the module docstring)."""
    seqs = _validate(branches)
    order = list(seqs)

    def fill(node: Node) -> list[Node]:
        """Extend ``node``'s segment as far as all its backends agree; create its children
        (returned, in order, still empty)."""
        group = node.backends
        pos = node.start
        # the shared run: longest common prefix of the group from ``pos``
        limit = min(len(seqs[b]) for b in group)
        first = seqs[group[0]]
        end = pos
        while end < limit and all(seqs[b][end] == first[end] for b in group):
            end += 1
        node.tokens = first[pos:end]
        by_token: dict[int, list[str]] = {}
        for b in group:
            s = seqs[b]
            if len(s) == end:
                node.ended.append(b)
            else:
                by_token.setdefault(s[end], []).append(b)
        children = []
        for _tok, members in by_token.items():  # dict keeps first-appearance (input) order
            children.append(Node(id=-1, start=end, tokens=[], backends=members))
        node.children = children
        return children

    # Depth-first, children in order, so that ids follow Tree.nodes() order.
    root = Node(id=0, start=0, tokens=[], backends=order)
    counter = 1
    stack = [root]
    while stack:
        node = stack.pop()
        if node.id < 0:
            node.id = counter
            counter += 1
        kids = fill(node)
        stack.extend(reversed(kids))
    return Tree(root=root, backends=order, lengths={b: len(s) for b, s in seqs.items()})


def branch_points(tree: Tree) -> list[BranchPoint]:
    """Every branch point as ``(position, {token_id: [backends], END: [backends ending]})``,
    sorted by position (ties: tree order)."""
    pts = [(n.end, i, n.options()) for i, n in enumerate(tree.nodes()) if n.is_branch_point]
    pts.sort(key=lambda x: (x[0], x[1]))
    return [BranchPoint(p, o) for p, _, o in pts]
