"""A turn's lanes: its records normalised into the primary's lane and each backend's forced and
free lane (:class:`TurnInputs`), and a lane's tool calls (:func:`extract_calls`)."""

from __future__ import annotations

from typing import Any, Mapping

from tensorverse.analysis.toolcalls import extract_tool_calls
from tensorverse.viz.pieces import text_of
from tensorverse.store.records import BackendInfo, Run
from tensorverse.viz.lane import FORCED, RECORDED, ROLES_REFERENCE, Lane, TurnRec, lane_from_run

__all__ = ["TurnInputs", "extract_calls"]


class TurnInputs:
    """A turn's records, normalised: the primary's lane and each backend's forced/free lane."""

    def __init__(self, turn: TurnRec, runs: list[Run], backends: Mapping[str, BackendInfo]) -> None:
        self.turn = turn
        self.runs = runs
        self.forced: dict[str, Lane] = {}
        self.free: dict[str, Lane] = {}
        self.failed: list[Lane] = []
        self.warnings: list[str] = []
        # the primary's parser check (its output ids re-parsed; the latest recorded run's)
        self.parser_check: dict | None = None
        for r in sorted(runs, key=lambda r: r.created_ns):
            if r.mode == RECORDED and r.parser_check is not None:
                self.parser_check = dict(r.parser_check)
        prim = turn.lane
        lanes = sorted((lane_from_run(r, backends) for r in runs), key=lambda l: l.created_ns)
        for lane in lanes:  # later runs of the same backend and mode win
            if lane.mode == RECORDED or lane.backend == turn.primary:
                self._merge_primary(prim, lane)
                continue
            if not lane.ok:
                self.failed.append(lane)
                if not lane.token_ids:
                    continue
            target = self.forced if lane.mode == FORCED else self.free
            target[lane.backend] = lane
        def superseded(l: Lane) -> bool:  # a later run of the same backend and mode succeeded
            cur = (self.forced if l.mode == FORCED else self.free).get(l.backend)
            return cur is not None and cur is not l and cur.ok and cur.created_ns >= l.created_ns

        self.failed = [l for l in self.failed if not superseded(l)]
        self.order = self._order()

    @staticmethod
    def _merge_primary(prim: Lane, run: Lane) -> None:
        """The shadow runner's ``recorded`` run (or any run under the primary's name) backs the
        primary's lane: its normalised top-k, pieces and, when the primary's rows were captured,
        its run id. The tokens shown stay the recorded answer."""
        if not prim.token_ids and run.token_ids:
            prim.token_ids = run.token_ids
        same = run.token_ids == prim.token_ids
        if run.run_id and (prim.run_id is None or run.mode == RECORDED):
            prim.run_id = run.run_id
            prim.capture = run.capture
            prim.positions = run.positions
        if run.topk is not None and same:
            prim.topk = run.topk
        if run.pieces is not None and same:
            prim.pieces = run.pieces
        if prim.text is None and run.text is not None:
            prim.text = run.text
        if prim.tool_calls is None and run.tool_calls is not None:
            prim.tool_calls = run.tool_calls

    def _order(self) -> list[str]:
        """Backend order: the primary first, then secondaries, references, the rest by name."""
        names = set(self.forced) | set(self.free) | {l.backend for l in self.failed}
        names.discard(self.turn.primary)
        roles = {l.backend: l.role for l in [*self.failed, *self.free.values(), *self.forced.values()]}

        def key(n: str) -> tuple:
            role = roles.get(n, "shadow")
            rank = ROLES_REFERENCE.index(role) if role in ROLES_REFERENCE else len(ROLES_REFERENCE)
            return (rank, n)

        return [self.turn.primary] + sorted(names, key=key)

    def fingerprint(self) -> tuple:
        return (self.turn.created_ns, len(self.turn.lane.token_ids)) + tuple(
            sorted(
                (r.id, r.created_ns, r.status, len(r.token_ids), repr(r.rows))
                for r in self.runs
            )
        )


def extract_calls(lane: Lane, vocab: Mapping[int, str] = {}) -> Any:
    """A branch's tool calls: from its text, else from its OpenAI ``tool_calls`` (the chat API
    moves calls out of the text; counting both would double them)."""
    text = text_of(lane, vocab)
    ext = extract_tool_calls(text)
    if lane.tool_calls and not ext.calls and not ext.malformed:
        ext = extract_tool_calls(text, openai_tool_calls=lane.tool_calls)
    return ext
