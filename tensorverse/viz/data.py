"""Store -> view models for the multiverse viewer (no web code here).

:class:`ViewData` reads a store (read-only) and builds the JSON-ready dicts the web app and the
HTML export render: the sessions list, a session (its turns and timeline), a turn, and the top-k
panel of one position. It reads the records, caches what it built and hands the building to the
modules beside it:

* :mod:`~tensorverse.viz.sessions`  turn briefs, session summaries, the sessions list's search,
  filters, sorts and pages;
* :mod:`~tensorverse.viz.lanes`     a turn's records normalised into one lane per backend and mode;
* :mod:`~tensorverse.viz.turn`      one turn's view, from its forced part
  (:mod:`~tensorverse.viz.forced`) and its free tree (:mod:`~tensorverse.viz.free`);
* :mod:`~tensorverse.viz.rows`      logits rows decoded from the store, top-k logprobs;
* :mod:`~tensorverse.viz.pieces`    the text of each token; :mod:`~tensorverse.viz.panels` the
  top-k panel of a position.

What is shown is derived from raw records: the primary's answer (the turn, and the shadow
runner's ``recorded`` run), each backend's runs (token ids, pieces, text, top-k logprobs) and the
stored logits rows, through :mod:`tensorverse.analysis`. Two things are read from comparison
records when :mod:`tensorverse.shadow.compare` already stored them, because recomputing them
means decoding every row: the per-position forced metrics against the same reference run (the
same :func:`~tensorverse.analysis.metrics.position_metrics` output; recomputed from rows when
absent), and the flip counts of the sessions list and the timeline.

A turn view has two modes:

``forced``  every forced run decoded the primary's tokens, so positions align: per backend the
            DESIGN metrics against the reference distribution (``kl``, ``delta_p``, ``margin``,
            ``rank``, ``flip``), full-vocabulary when both sides have rows, approximate from top-k
            logprobs otherwise; a top-k panel per position across all backends.
``free``    the multiverse tree of the primary's answer and each backend's free run: shared
            prefixes once, branch points with the backends following each branch, the flip's
            margin and kl, top-k panels of the backends sharing each context, and the tool calls
            of every branch with their verdict against the primary's.

Top-k panels need every backend's row at a position. For short turns (or an export) they are
built with the view; for long ones the view says ``lazy_panels`` and each panel is built on
request (:meth:`ViewData.panel`), a handful of rows at a time. Views are cached per turn and
rebuilt when anything they are built from changes: whether they are current is checked with a
stamp (a hash of the raw bytes of the turn, its runs, their comparisons and the backends, read
through the store's indexes in one read transaction, nothing parsed), so a request for a cached
view or a panel costs a few milliseconds however long the turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Mapping

from tensorverse.store import RecordNotFound
from tensorverse.viz.forced import stored_flip_count
from tensorverse.viz.lanes import TurnInputs
from tensorverse.store.records import BackendInfo, Comparison, Run, Session, Turn
from tensorverse.viz.lane import FORCED, FREE, Lane, backend_infos, turn_from_record
from tensorverse.viz.sessions import (
    first_divergences,
    page_bounds,
    session_summary,
    sessions_page,
    turn_brief,
)
from tensorverse.viz.turn import TurnBuilder

if TYPE_CHECKING:
    from tensorverse.store import Store

__all__ = ["ViewData", "NotFound"]

log = logging.getLogger("tensorverse.viz")

INLINE_ROWS = 512  # build panels with the view when they need at most this many rows


class NotFound(KeyError):
    """No such session or turn."""


class ViewData:
    """Builds the viewer's view models from a store. Thread-safe; caches turn views."""

    def __init__(self, store: Store, *, cache_turns: int = 64, summary_ttl_s: float = 5.0,
                 inline_rows: int = INLINE_ROWS) -> None:
        self.store = store
        self.inline_rows = inline_rows
        self._lock = threading.Lock()
        self._turns: OrderedDict[str, tuple[bytes | tuple, dict]] = OrderedDict()
        self._builders: OrderedDict[str, tuple[bytes | tuple, TurnBuilder]] = OrderedDict()
        self._cache_turns = cache_turns
        self._briefs: dict[str, tuple[bytes | tuple, dict]] = {}
        self._sessions: dict[str, tuple[float, Any, dict]] = {}
        self._summary_ttl = summary_ttl_s
        self._verdict: tuple[float, dict] | None = None

    # ---- store access (a read-only store lacks the databases nothing was written to yet)

    def _safe(self, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except KeyError as exc:
            if isinstance(exc, RecordNotFound):
                raise
            return default

    def _backend_records(self) -> dict[str, BackendInfo]:
        return self._safe(lambda: backend_infos(self.store.iter_backends()), {})

    def _session(self, sid: str) -> Session:
        try:
            return self.store.get_session(sid)
        except (KeyError, ValueError):
            raise NotFound(f"no session {sid!r}") from None

    def _turn_record(self, tid: str) -> Turn:
        try:
            return self.store.get_turn(tid)
        except (KeyError, ValueError):
            raise NotFound(f"no turn {tid!r}") from None

    def _runs(self, tid: str) -> list[Run]:
        return self._safe(lambda: list(self.store.iter_runs(tid)), [])

    def _turn_records(self, sid: str) -> list[Turn]:
        return self._safe(lambda: list(self.store.iter_turns(sid)), [])

    def _comparisons(self, run_id: str) -> list[Comparison]:
        return self._safe(lambda: list(self.store.iter_comparisons(run_id)), [])

    def _inputs(self, turn: Turn, backends: Mapping[str, BackendInfo]) -> TurnInputs:
        return TurnInputs(turn_from_record(turn, backends), self._runs(turn.id), backends)

    # ---- backends

    def backends(self) -> list[dict]:
        out = []
        for name, info in sorted(self._backend_records().items()):
            out.append({
                "name": name,
                "role": info.role or "shadow",
                "model": info.model,
                "capture": info.capture,
                "settings": info.settings,
            })
        return out

    # ---- turn briefs (cheap: tokens and text only) -> timeline and session summaries

    def _turn_brief(self, turn: Turn, backends: Mapping[str, BackendInfo]) -> dict:
        tid = turn.id
        stamp = self._stamp(tid)
        if stamp is not None:
            with self._lock:
                hit = self._briefs.get(tid)
            if hit and hit[0] == stamp:
                return hit[1]
            try:  # read after the stamp, so the brief is at least as new as it
                turn = self._turn_record(tid)
            except NotFound:
                pass
        inp = self._inputs(turn, backends)
        fp = stamp if stamp is not None else inp.fingerprint()
        with self._lock:
            hit = self._briefs.get(inp.turn.id)
        if hit and hit[0] == fp:
            return hit[1]
        brief = turn_brief(inp, self._forced_flip_hint)
        with self._lock:
            self._briefs[inp.turn.id] = (fp, brief)
        return brief

    def _forced_flip_hint(self, lane: Lane | None) -> int | None:
        """Forced flips of a run from its stored comparisons (None: no run, or none stored)."""
        if lane is None or not lane.run_id:
            return None
        return stored_flip_count(self._comparisons(lane.run_id))

    # ---- sessions

    def _session_summary(self, s: Session, backends: Mapping[str, BackendInfo]) -> dict:
        sid = s.id
        key = (s.updated_ns, s.turns)
        now = time.monotonic()
        with self._lock:
            hit = self._sessions.get(sid)
        if hit and hit[1] == key and now - hit[0] < self._summary_ttl:
            return hit[2]
        briefs = [self._turn_brief(t, backends) for t in self._turn_records(sid)]
        out = session_summary(s, briefs)
        with self._lock:
            self._sessions[sid] = (now, key, out)
        return out

    def list_sessions(self, *, q: str = "", sort: str = "time", order: str = "desc",
                      offset: int = 0, limit: int = 50, verdict: str = "",
                      backend: str = "") -> dict:
        """One page of sessions. ``q`` matches the id and tags (``key=value``, any case);
        ``verdict`` keeps sessions whose worst verdict is that one; ``backend`` keeps sessions
        that ran that backend. Sorting by time or turns only summarises the page shown; the
        other sorts and filters summarise every session (cached)."""
        offset, limit = page_bounds(sort, order, offset, limit)
        backends = self._backend_records()
        raw = self._safe(lambda: list(self.store.iter_sessions()), [])
        return sessions_page(raw, lambda s: self._session_summary(s, backends), q=q, sort=sort,
                             order=order, offset=offset, limit=limit, verdict=verdict, backend=backend)

    def verdict(self, ttl_s: float = 30.0) -> dict:
        """Every shadow's verdict (docs/verdict.md) with the default policy: the banner of the
        sessions page. Recomputed at most every ``ttl_s`` (it reads every comparison)."""
        import time

        from tensorverse.analysis.verdict import VerdictPolicy, verdicts, verdicts_json
        from tensorverse.exporters.comparison_rows import from_store

        with self._lock:
            cached = self._verdict
        if cached is not None and time.monotonic() - cached[0] < ttl_s:
            return cached[1]
        policy = VerdictPolicy()
        out = verdicts_json(self._safe(lambda: verdicts(from_store(self.store), policy), []), policy)
        with self._lock:
            self._verdict = (time.monotonic(), out)
        return out

    def session_view(self, sid: str) -> dict:
        s = self._session(sid)
        backends = self._backend_records()
        summary = self._session_summary(s, backends)
        briefs = [self._turn_brief(t, backends) for t in self._turn_records(sid)]
        names = summary["backends"]
        return {
            "kind": "session",
            "session": summary,
            "turns": briefs,
            "timeline": {"backends": names, "first_divergence": first_divergences(names, briefs)},
            "backends_info": {b["name"]: b for b in self.backends()},
        }

    # ---- a turn

    def _stamp(self, tid: str) -> bytes | None:
        """The store's version token of everything a turn's view and brief are built from
        (`Store.turn_stamp`); None for a store object without it or an absent turn: then the
        caller reads and parses the records (the slower path)."""
        stamp = getattr(self.store, "turn_stamp", None)
        if stamp is None:
            return None
        try:
            return stamp(tid)
        except (ValueError, TypeError):  # not a valid turn id
            return None

    def _builder(self, tid: str) -> tuple[bytes | tuple, TurnBuilder]:
        stamp = self._stamp(tid)
        if stamp is not None:
            with self._lock:
                hit = self._builders.get(tid)
                if hit and hit[0] == stamp:
                    self._builders.move_to_end(tid)
                    return hit
        # Read after the stamp: the records are at least as new as it (a write in between
        # only costs a rebuild on the next request, never a stale view).
        turn = self._turn_record(tid)
        backends = self._backend_records()
        inp = self._inputs(turn, backends)
        fp = stamp if stamp is not None else inp.fingerprint()
        with self._lock:
            hit = self._builders.get(tid)
            if hit and hit[0] == fp:
                self._builders.move_to_end(tid)
                return hit
        b = (fp, TurnBuilder(self.store, self._comparisons, inp, backends))
        with self._lock:
            self._builders[tid] = b
            self._builders.move_to_end(tid)
            while len(self._builders) > 4:  # each holds a few decoded rows
                self._builders.popitem(last=False)
        return b

    def turn_view(self, tid: str, *, inline_panels: bool | None = None) -> dict:
        """The turn view (see the module docstring). ``inline_panels``: True builds every top-k
        panel now (the export), None decides by size."""
        fp, builder = self._builder(tid)
        with self._lock:
            hit = self._turns.get(tid)
            if hit and hit[0] == fp and (not inline_panels or not hit[1]["lazy_panels"]):
                self._turns.move_to_end(tid)
                return hit[1]
        view = builder.build(inline_panels, self.inline_rows)
        with self._lock:
            self._turns[tid] = (fp, view)
            while len(self._turns) > self._cache_turns:
                self._turns.popitem(last=False)
        return view

    def panel(self, tid: str, mode: str, pos: int, node: int | None = None) -> dict:
        """The top-k panel of one position: ``mode`` forced, or free with the tree ``node``."""
        _, builder = self._builder(tid)
        if mode == FORCED:
            if not builder.inp.forced:
                raise ValueError("this turn has no forced runs")
            if not 0 <= pos < len(builder.turn.lane.token_ids):
                raise ValueError(f"position {pos} is outside the turn")
            return {"mode": mode, "position": pos, "panel": builder.forced_panel(pos)}
        if mode == FREE:
            if node is None:
                raise ValueError("free mode needs the tree node (n=)")
            return {"mode": mode, "node": node, "position": pos, "panel": builder.free_panel(node, pos)}
        raise ValueError("mode must be forced or free")

    def export_bundle(self, sid: str) -> dict:
        """Everything the HTML export of one session embeds: the session and all its turns,
        with every top-k panel built."""
        sv = self.session_view(sid)
        turns = {b["id"]: self.turn_view(b["id"], inline_panels=True) for b in sv["turns"]}
        return {"kind": "tensorverse-export", "version": 1, "generated_ns": time.time_ns(),
                "session": sv, "turns": turns}
