"""Store -> view models for the multiverse viewer (no web code here).

:class:`ViewData` reads a store (read-only) and builds the JSON-ready dicts the web app and the
HTML export render: the sessions list, a session (its turns and timeline), a turn, and the top-k
panel of one position.

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

import math
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping, Sequence

import logging

import numpy as np

from tensorverse.analysis.metrics import AnalysisInputError, PositionMetrics, position_metrics, summarize
from tensorverse.analysis.multiverse import END, build_tree
from tensorverse.analysis.regions import tag_regions
from tensorverse.analysis.toolcalls import SEVERITY, compare_tool_calls, extract_tool_calls
from tensorverse.analysis.topk import topk_position_metrics
from tensorverse.store import RecordNotFound
from tensorverse.store.codec import CodecError, blob_info, decode_row
from tensorverse.viz.records import (
    FORCED,
    FREE,
    RECORDED,
    F,
    Lane,
    TurnRec,
    backend_infos,
    comparison_flips,
    lane_from_run,
    pick,
    topk_entry,
    turn_from_record,
)

__all__ = ["ViewData", "NotFound", "VERDICT_ORDER", "SORT_KEYS"]

log = logging.getLogger("tensorverse.viz")

#: Worst first. ``error``: a run failed; ``none``: no shadow run to judge.
VERDICT_ORDER: tuple[str, ...] = ("error",) + tuple(SEVERITY) + ("none",)
SORT_KEYS = ("time", "turns", "flips", "verdict", "backends")
TOPK = 6  # entries per backend in a top-k panel
UNION_CAP = 12  # most tokens one panel shows
CHUNK = 16  # positions decoded together (rows of every backend: ~5 MB per position at 151,936)
INLINE_ROWS = 512  # build panels with the view when they need at most this many rows
MAX_PROMPT_CHARS = 200_000


class NotFound(KeyError):
    """No such session or turn."""


# --------------------------------------------------------------------------- small helpers


def _sig(v: float | None, digits: int = 4) -> float | None:
    """A float rounded to ``digits`` significant digits (short JSON); None for NaN/None."""
    if v is None:
        return None
    v = float(v)
    if not math.isfinite(v):
        return None if math.isnan(v) else v
    return float(f"{v:.{digits}g}")


def _sigs(values: Iterable[float | None], digits: int = 4) -> list[float | None]:
    return [_sig(v, digits) for v in values]


def _worst(verdicts: Iterable[str | None]) -> str:
    seen = [v for v in verdicts if v]
    if not seen:
        return "none"
    rank = {v: i for i, v in enumerate(VERDICT_ORDER)}
    return min(seen, key=lambda v: rank.get(v, len(VERDICT_ORDER)))


class _Row:
    """A full-vocabulary logits row; its log-normaliser (float64) is computed on first use."""

    __slots__ = ("x", "_lse")

    def __init__(self, x: np.ndarray) -> None:
        x = np.asarray(x)
        if x.dtype == np.uint16:  # bfloat16 bit patterns
            x = (x.astype(np.uint32) << 16).view(np.float32)
        self.x = x.reshape(-1)
        self._lse: float | None = None

    @property
    def ok(self) -> bool:
        """No NaN or infinity in the row."""
        x = self.x
        return bool(x.size) and math.isfinite(float(x.max())) and math.isfinite(float(x.min()))

    @property
    def lse(self) -> float:
        if self._lse is None:
            x = self.x
            m = float(x.max()) if x.size else math.nan
            if math.isfinite(m) and math.isfinite(float(x.min())):
                # float32 exp, float64 sum: ample for probabilities shown to 4 digits
                self._lse = m + math.log(float(np.exp(x - np.float32(m)).sum(dtype=np.float64)))
            else:
                self._lse = math.nan
        return self._lse

    def top(self, k: int) -> list[int]:
        x = self.x
        k = min(k, x.size)
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]
        return idx.tolist()

    def logp(self, ids: Sequence[int]) -> list[float | None]:
        v = self.x[np.asarray(ids, dtype=np.int64)].astype(np.float64) - self.lse
        return v.tolist()

    def rank(self, ids: Sequence[int]) -> list[int | None]:
        vals = self.x[np.asarray(ids, dtype=np.int64)]
        return (self.x[None, :] > vals[:, None]).sum(axis=1).tolist()

    def topk_dict(self, k: int) -> dict[int, float]:
        ids = self.top(k)
        return dict(zip(ids, self.logp(ids)))


class _TopK:
    """A position's top-k logprobs from the API: ``{token id: logprob}``."""

    __slots__ = ("d", "_order")

    def __init__(self, d: dict[int, float]) -> None:
        self.d = d
        self._order = sorted(d, key=lambda t: (-d[t], t))

    @property
    def ok(self) -> bool:
        return bool(self.d)

    def top(self, k: int) -> list[int]:
        return self._order[:k]

    def logp(self, ids: Sequence[int]) -> list[float | None]:
        return [self.d.get(int(i)) for i in ids]

    def rank(self, ids: Sequence[int]) -> list[int | None]:
        out: list[int | None] = []
        for i in ids:
            v = self.d.get(int(i))
            out.append(None if v is None else sum(1 for w in self.d.values() if w > v))
        return out

    def topk_dict(self, k: int) -> dict[int, float]:
        return self.d


Dist = "_Row | _TopK"


def _margin(d: Any) -> float | None:
    top = d.top(2)
    lp = d.logp(top)
    if len(lp) < 2 or lp[0] is None or lp[1] is None:
        return None
    return math.exp(lp[0]) - math.exp(lp[1])


def _panel(members: list[tuple[int, Any]], k: int = TOPK, cap: int = UNION_CAP,
           engine: list[dict | None] | None = None) -> dict:
    """The top-k table at one position: union of every member's top-k, with each member's
    probability and rank for each of those tokens (None where unknown: top-k-only data).
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
        best = max((p[j] for p in probs if p[j] is not None), default=0.0)
        return (-(first if first is not None else -1.0), -best, union[j])

    order = sorted(range(len(union)), key=key)[:cap]
    return {
        "m": [i for i, _ in members],
        "ids": [union[j] for j in order],
        "p": [[_sig(p[j]) for j in order] for p in probs],
        "r": [[r[j] for j in order] for r in ranks],
        **({"e": engine} if engine and any(engine) else {}),
    }


# --------------------------------------------------------------------------- per-turn inputs


class _TurnInputs:
    """A turn's records, normalised: the primary's lane and each backend's forced/free lane."""

    def __init__(self, turn: TurnRec, runs: list[dict], backends: Mapping[str, dict]) -> None:
        self.turn = turn
        self.runs = runs
        self.forced: dict[str, Lane] = {}
        self.free: dict[str, Lane] = {}
        self.failed: list[Lane] = []
        self.warnings: list[str] = []
        # the primary's parser check (its output ids re-parsed; the latest recorded run's)
        self.parser_check: dict | None = None
        for r in sorted(runs, key=lambda r: r.get("created_ns") or 0):
            pc = pick(r, F.RUN_PARSER_CHECK)
            if pick(r, F.RUN_MODE) == RECORDED and isinstance(pc, Mapping):
                self.parser_check = dict(pc)
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
            rank = F.ROLES_REFERENCE.index(role) if role in F.ROLES_REFERENCE else len(F.ROLES_REFERENCE)
            return (rank, n)

        return [self.turn.primary] + sorted(names, key=key)

    def fingerprint(self) -> tuple:
        return (self.turn.raw.get("created_ns"), len(self.turn.lane.token_ids)) + tuple(
            sorted(
                (str(r.get("id")), r.get("created_ns"), str(r.get("status")),
                 len(pick(r, F.RUN_IDS) or ()), repr(pick(r, F.RUN_ROWS)))
                for r in self.runs
            )
        )


def _text_of(lane: Lane, vocab: Mapping[int, str]) -> str:
    if lane.text is not None:
        return lane.text
    if lane.pieces is not None:
        return "".join(lane.pieces)
    return "".join(vocab.get(t, "") for t in lane.token_ids)


def _extract(lane: Lane, vocab: Mapping[int, str] = {}) -> Any:
    """A branch's tool calls: from its text, else from its OpenAI ``tool_calls`` (the chat API
    moves calls out of the text; counting both would double them)."""
    text = _text_of(lane, vocab)
    ext = extract_tool_calls(text)
    if lane.tool_calls and not ext.calls and not ext.malformed:
        ext = extract_tool_calls(text, openai_tool_calls=lane.tool_calls)
    return ext


def _divergence(ref: Sequence[int], cand: Sequence[int]) -> int | None:
    n = min(len(ref), len(cand))
    for i in range(n):
        if ref[i] != cand[i]:
            return i
    return None if len(ref) == len(cand) else n


_SPECIAL = re.compile(r"<\|[^|<>]{1,40}\|>")


def _infer_pieces(ids: Sequence[int], text: str, vocab: Mapping[int, str]) -> tuple[list[str], list[bool]]:
    """Per-token text of a run that recorded only its whole ``text``, from the pieces known for
    the other tokens: known pieces are matched from both ends of the text; a single unknown
    token in between gets exactly the text left over. Several unknown tokens in a row share
    their span (the first carries it, marked inexact). Special tokens that the server left out
    of the text (``<|im_end|>`` with skip_special_tokens) are matched without consuming text."""
    n = len(ids)
    out = [""] * n
    exact = [True] * n
    cur, i = 0, 0
    while i < n:
        p = vocab.get(ids[i])
        if p is None:
            break
        if text.startswith(p, cur):
            cur += len(p)
        elif not _SPECIAL.fullmatch(p):
            break
        out[i] = p
        i += 1
    end, j = len(text), n
    while j > i:
        p = vocab.get(ids[j - 1])
        if p is None:
            break
        if cur <= end - len(p) and text.endswith(p, cur, end):
            end -= len(p)
        elif not _SPECIAL.fullmatch(p):
            break
        out[j - 1] = p
        j -= 1
    if j > i:
        out[i] = text[cur:end]
        # exact only for one token the vocabulary did not know (a known piece that did not
        # match means the text is not this token sequence's)
        if j - i > 1 or ids[i] in vocab:
            for k in range(i, j):
                exact[k] = False
    return out, exact


class _Rows:
    """Decoded rows of a turn's runs, fetched position by position (a small LRU)."""

    def __init__(self, store: Any, warnings: list[str], size: int = 32) -> None:
        self.store = store
        self.warnings = warnings
        self.size = size
        self._cache: OrderedDict[tuple[str, int], _Row | None] = OrderedDict()
        self._has: dict[str, bool] = {}
        self._lock = threading.Lock()

    def has_rows(self, lane: Lane | None) -> bool:
        """Whether the run stored rows (its record says so, checked at its first positions)."""
        if lane is None or not lane.run_id:
            return False
        rid = lane.run_id
        if rid not in self._has:
            if lane.capture in ("topk", "none") and not lane.positions:
                self._has[rid] = False
            else:
                probe = list(lane.positions or [])[:2] + list(range(min(4, max(1, len(lane.token_ids)))))
                self._has[rid] = any(self._blob(rid, p) is not None for p in probe)
        return self._has[rid]

    def _blob(self, rid: str, pos: int) -> bytes | None:
        try:
            return self.store.read_row(rid, pos)
        except (RecordNotFound, KeyError, ValueError):
            return None

    def get(self, lane: Lane, pos: int, ref: Lane | None = None) -> _Row | None:
        if not self.has_rows(lane):
            return None
        rid = lane.run_id
        key = (rid, pos)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        row = None
        blob = self._blob(rid, pos)
        if blob is not None:
            record = f"run {rid} position {pos}"
            try:
                try:
                    x = decode_row(blob, record=record)
                except CodecError:
                    # a delta blob needs the row it was encoded against: the reference's
                    if not blob_info(blob, record=record)["needs_ref"] or ref is None or ref is lane:
                        raise
                    r = self.get(ref, pos)
                    x = decode_row(blob, ref=None if r is None else r.x, record=record)
                row = _Row(x)
                if not row.ok:
                    self.warn(f"{lane.backend} ({lane.mode}): row {pos} holds NaN/inf; skipped")
                    row = None
            except CodecError as exc:
                self.warn(f"{lane.backend} ({lane.mode}): {exc}")
        with self._lock:
            self._cache[key] = row
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return row

    def warn(self, msg: str) -> None:
        if msg not in self.warnings and len(self.warnings) < 50:
            self.warnings.append(msg)

    def engine(self, lanes: Sequence[Lane | None], pos: int) -> list[dict | None]:
        """Per lane, the engine state stored with its row at ``pos``, for the top-k panel."""
        out: list[dict | None] = []
        for lane in lanes:
            st = None
            if lane is not None and lane.run_id and hasattr(self.store, "read_engine_state"):
                try:
                    st = self.store.read_engine_state(lane.run_id, pos)
                except Exception:  # noqa: BLE001 - a panel without it is still a panel
                    st = None
            out.append(None if st is None else {"b": st.batch_size, "s": st.step})
        return out


# --------------------------------------------------------------------------- the view builder


class ViewData:
    """Builds the viewer's view models from a store. Thread-safe; caches turn views."""

    def __init__(self, store: Any, *, cache_turns: int = 64, summary_ttl_s: float = 5.0,
                 inline_rows: int = INLINE_ROWS) -> None:
        self.store = store
        self.inline_rows = inline_rows
        self._lock = threading.Lock()
        self._turns: OrderedDict[str, tuple[tuple, dict]] = OrderedDict()
        self._builders: OrderedDict[str, tuple[tuple, _TurnBuilder]] = OrderedDict()
        self._cache_turns = cache_turns
        self._briefs: dict[str, tuple[tuple, dict]] = {}
        self._sessions: dict[str, tuple[float, Any, dict]] = {}
        self._summary_ttl = summary_ttl_s

    # ---- store access (a read-only store lacks the databases nothing was written to yet)

    def _safe(self, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except KeyError as exc:
            if isinstance(exc, RecordNotFound):
                raise
            return default

    def _backend_records(self) -> dict[str, dict]:
        return self._safe(lambda: backend_infos(self.store.iter_backends()), {})

    def _session(self, sid: str) -> dict:
        try:
            return self.store.get_session(sid)
        except (KeyError, ValueError):
            raise NotFound(f"no session {sid!r}") from None

    def _turn_record(self, tid: str) -> dict:
        try:
            return self.store.get_turn(tid)
        except (KeyError, ValueError):
            raise NotFound(f"no turn {tid!r}") from None

    def _runs(self, tid: str) -> list[dict]:
        return self._safe(lambda: list(self.store.iter_runs(tid)), [])

    def _turn_records(self, sid: str) -> list[dict]:
        return self._safe(lambda: list(self.store.iter_turns(sid)), [])

    def _comparisons(self, run_id: str) -> list[dict]:
        return self._safe(lambda: list(self.store.iter_comparisons(run_id)), [])

    def _inputs(self, turn: dict, backends: Mapping[str, dict]) -> _TurnInputs:
        return _TurnInputs(turn_from_record(turn, backends), self._runs(str(turn["id"])), backends)

    # ---- backends

    def backends(self) -> list[dict]:
        out = []
        for name, info in sorted(self._backend_records().items()):
            out.append({
                "name": name,
                "role": pick(info, F.BACKEND_ROLE, "shadow"),
                "model": pick(info, F.BACKEND_MODEL),
                "capture": pick(info, F.BACKEND_CAPTURE),
                "settings": pick(info, F.BACKEND_SETTINGS) or {},
            })
        return out

    # ---- turn briefs (cheap: tokens and text only) -> timeline and session summaries

    def _turn_brief(self, turn: dict, backends: Mapping[str, dict]) -> dict:
        tid = str(turn.get("id"))
        stamp = self._stamp(tid)
        if stamp is not None:
            with self._lock:
                hit = self._briefs.get(tid)
            if hit and hit[0] == stamp:
                return hit[1]
            try:  # read after the stamp, so the brief is at least as new as it
                turn = self.store.get_turn(tid)
            except (KeyError, ValueError):
                pass
        inp = self._inputs(turn, backends)
        fp = stamp if stamp is not None else inp.fingerprint()
        with self._lock:
            hit = self._briefs.get(inp.turn.id)
        if hit and hit[0] == fp:
            return hit[1]
        brief = self._build_brief(inp)
        with self._lock:
            self._briefs[inp.turn.id] = (fp, brief)
        return brief

    def _forced_flip_hint(self, lane: Lane | None) -> int | None:
        """Forced flips of a run from its stored comparisons: against a secondary/reference
        with full rows first (what the turn view shows), else any."""
        if lane is None or not lane.run_id:
            return None
        best: tuple | None = None
        for cmp in self._comparisons(lane.run_id):
            if pick(cmp, F.CMP_STATUS, "ok") != "ok" or pick(cmp, F.CMP_MODE, FORCED) != FORCED:
                continue
            flips = comparison_flips(cmp)
            if flips is None:
                continue
            key = (pick(cmp, F.CMP_KIND) != "full", cmp.get("ref_role") not in F.ROLES_REFERENCE)
            if best is None or key < best[0]:
                best = (key, flips)
        return None if best is None else best[1]

    def _build_brief(self, inp: _TurnInputs) -> dict:
        t = inp.turn
        prim = t.lane
        ref_calls = _extract(prim)
        per: dict[str, dict] = {}
        for name in inp.order[1:]:
            free = inp.free.get(name)
            entry: dict[str, Any] = {"divergence": None, "verdict": None,
                                     "forced_flips": self._forced_flip_hint(inp.forced.get(name)),
                                     "status": "ok"}
            if free is not None:
                entry["divergence"] = _divergence(prim.token_ids, free.token_ids)
                entry["verdict"] = compare_tool_calls(ref_calls, _extract(free)).verdict
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
            "worst": _worst(e["verdict"] for e in per.values()),
            "flips": sum(1 for e in per.values() if e["divergence"] is not None),
            "parser_mismatch": bool((inp.parser_check or {}).get("mismatch")),
        }

    # ---- sessions

    def _session_summary(self, s: dict, backends: Mapping[str, dict]) -> dict:
        sid = str(s["id"])
        key = (s.get("updated_ns"), s.get("turns"))
        now = time.monotonic()
        with self._lock:
            hit = self._sessions.get(sid)
        if hit and hit[1] == key and now - hit[0] < self._summary_ttl:
            return hit[2]
        briefs = [self._turn_brief(t, backends) for t in self._turn_records(sid)]
        names: list[str] = []
        for b in briefs:
            for n in [b["primary"], *b["backends"]]:
                if n not in names:
                    names.append(n)
        forced = [e["forced_flips"] for b in briefs for e in b["backends"].values()
                  if e["forced_flips"] is not None]
        out = {
            "id": sid,
            "created_ns": int(pick(s, F.SESSION_CREATED, 0) or 0),
            "updated_ns": pick(s, F.SESSION_UPDATED),
            "tags": _tags(pick(s, F.SESSION_TAGS)),
            "turns": len(briefs),
            "backends": names,
            "worst": _worst(b["worst"] for b in briefs if b["worst"] != "none"),
            "flips": sum(b["flips"] for b in briefs),
            "forced_flips": sum(forced) if forced else None,
            "first_divergence_turn": next((b["index"] for b in briefs if b["flips"]), None),
        }
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
        if sort not in SORT_KEYS:
            raise ValueError(f"sort must be one of {', '.join(SORT_KEYS)}")
        if order not in ("asc", "desc"):
            raise ValueError("order must be asc or desc")
        offset = max(0, int(offset))
        limit = max(1, min(200, int(limit)))
        backends = self._backend_records()
        ql = q.strip().lower()
        raw = [s for s in self._safe(lambda: list(self.store.iter_sessions()), [])
               if not ql or _session_matches(s, ql)]
        if sort not in ("time", "turns") or verdict or backend:
            items = [self._session_summary(s, backends) for s in raw]
            if verdict:
                items = [i for i in items if i["worst"] == verdict]
            if backend:
                items = [i for i in items if backend in i["backends"]]
            items.sort(key=_sort_key(sort), reverse=(order == "desc"))
            total = len(items)
            page = items[offset: offset + limit]
        else:
            if sort == "turns":
                raw.sort(key=lambda s: (int(pick(s, F.SESSION_TURNS, 0) or 0),
                                        int(pick(s, F.SESSION_CREATED, 0) or 0)),
                         reverse=(order == "desc"))
            elif order == "desc":
                raw.reverse()  # the store iterates in creation order
            total = len(raw)
            page = [self._session_summary(s, backends) for s in raw[offset: offset + limit]]
        return {"total": total, "offset": offset, "limit": limit, "sort": sort, "order": order,
                "items": page, "verdicts": list(VERDICT_ORDER)}

    def session_view(self, sid: str) -> dict:
        s = self._session(sid)
        backends = self._backend_records()
        summary = self._session_summary(s, backends)
        briefs = [self._turn_brief(t, backends) for t in self._turn_records(sid)]
        names = summary["backends"]
        first: dict[str, int | None] = {}
        for n in names[1:]:
            first[n] = next((b["index"] for b in briefs
                             if (b["backends"].get(n) or {}).get("divergence") is not None), None)
        return {
            "kind": "session",
            "session": summary,
            "turns": briefs,
            "timeline": {"backends": names, "first_divergence": first},
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

    def _builder(self, tid: str) -> tuple[tuple, _TurnBuilder]:
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
        b = (fp, _TurnBuilder(self, inp, backends))
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
        view = builder.build(inline_panels)
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


def _tags(tags: Any) -> dict[str, str]:
    if isinstance(tags, Mapping):
        return {str(k): "" if v is None else str(v) for k, v in tags.items()}
    if isinstance(tags, (list, tuple)):
        return {str(t): "" for t in tags}
    return {}


def _session_matches(s: Mapping[str, Any], ql: str) -> bool:
    if ql in str(s.get("id", "")).lower():
        return True
    return any(ql in f"{k}={v}".lower() for k, v in _tags(pick(s, F.SESSION_TAGS)).items())


def _sort_key(sort: str) -> Callable[[dict], Any]:
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


# --------------------------------------------------------------------------- turn builder


class _TurnBuilder:
    """Everything about one turn: its lanes, reference, tree; builds the view and panels."""

    def __init__(self, owner: ViewData, inp: _TurnInputs, backends: Mapping[str, dict]) -> None:
        self.owner = owner
        self.inp = inp
        self.turn = inp.turn
        self.warnings = list(inp.warnings)
        self.rows = _Rows(owner.store, self.warnings)
        self.names = inp.order
        self.index = {n: i for i, n in enumerate(self.names)}
        self.backends = backends
        self._topk_cache: dict[int, list | None] = {}
        self.vocab: dict[int, str] = {}
        prim = self.turn.lane
        for lane in [prim, *inp.forced.values(), *inp.free.values()]:
            texts = pick(lane.raw, F.TOKEN_TEXTS)
            if isinstance(texts, Mapping):
                for t, p in texts.items():
                    if str(t).isdigit() and isinstance(p, str):
                        self.vocab.setdefault(int(t), p)
            if lane.pieces is not None:
                for t, p in zip(lane.token_ids, lane.pieces):
                    self.vocab.setdefault(t, p)
        # Free runs usually come with their text but no per-token pieces: recover them.
        self.inferred: dict[str, tuple[list[str], list[bool]]] = {}
        for lane in inp.free.values():
            if lane.pieces is None and lane.text is not None and lane.token_ids:
                pieces, exact = _infer_pieces(lane.token_ids, lane.text, self.vocab)
                self.inferred[lane.backend] = (pieces, exact)
                for t, p, ok in zip(lane.token_ids, pieces, exact):
                    if ok:
                        self.vocab.setdefault(t, p)
        self.forced_members = {self.turn.primary: prim,
                               **{k: inp.forced[k] for k in self.names if k in inp.forced}}
        self.free_lanes = {self.turn.primary: prim,
                           **{k: inp.free[k] for k in self.names if k in inp.free}}
        self.ref_name = self._reference()
        self.tree = build_tree({k: l.token_ids for k, l in self.free_lanes.items()})
        self.parent: dict[int, Any] = {}
        self.nodes: dict[int, Any] = {}
        for node in self.tree.nodes():
            self.nodes[node.id] = node
            for c in node.children:
                self.parent[c.id] = node

    # ---- distributions

    def _pieces(self, lane: Lane) -> list[str]:
        if lane.pieces is not None:
            return lane.pieces
        if lane.mode == FREE and lane.backend in self.inferred:
            return self.inferred[lane.backend][0]
        return [self.vocab.get(t, "") for t in lane.token_ids]

    def _topk(self, lane: Lane) -> list | None:
        key = id(lane)
        if key not in self._topk_cache:
            out = None
            if lane.topk is not None:
                out = []
                for entry in lane.topk:
                    d = topk_entry(entry)
                    out.append(_TopK(d) if d else None)
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
        tk = self._topk(lane)
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
        for role in F.ROLES_REFERENCE:
            cands = sorted((n for n, l in members.items() if n != t.primary and l.role == role and l.ok),
                           key=lambda n: (not self.rows.has_rows(members[n]), n))
            if cands:
                return cands[0]
        if self.rows.has_rows(t.lane) or self._topk(t.lane) is not None:
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

    # ---- the whole view

    def build(self, inline_panels: bool | None = None) -> dict:
        t = self.turn
        inline = inline_panels if inline_panels is not None else self._row_cost() <= self.owner.inline_rows
        self._ids_used: set[int] = set()
        forced = self._forced(inline)
        free = self._free(inline)
        lanes = []
        for n in self.names:
            fl = t.lane if n == t.primary else self.inp.forced.get(n)
            fr = t.lane if n == t.primary else self.inp.free.get(n)
            info = self.backends.get(n, {})
            failed = [l for l in self.inp.failed if l.backend == n]
            any_lane = fl or fr or (failed[0] if failed else None)
            lanes.append({
                "name": n,
                "role": "primary" if n == t.primary else (any_lane.role if any_lane else
                                                          pick(info, F.BACKEND_ROLE, "shadow")),
                "model": pick(info, F.BACKEND_MODEL),
                "forced": fl is not None and bool(self.inp.forced),
                "free": fr is not None,
                "rows": {"forced": bool(fl and self.rows.has_rows(fl)),
                         "free": bool(fr and self.rows.has_rows(fr))},
                "errors": [f"{l.mode}: {l.status}" + (f": {l.error}" if l.error else "")
                           for l in failed],
            })
        used = set(self._ids_used)
        for lane in self.free_lanes.values():
            used.update(lane.token_ids)
        vocab = {str(i): self.vocab[i] for i in sorted(used) if i in self.vocab}
        return {
            "kind": "turn",
            "session_id": t.session_id,
            "turn": {"id": t.id, "index": t.index, "created_ns": t.created_ns, "state": t.state,
                     "primary": t.primary, "tokens": len(t.lane.token_ids)},
            "prompt": self._prompt(),
            "backends": lanes,
            "vocab": vocab,
            "lazy_panels": not inline,
            "forced": forced,
            "free": free,
            "default_mode": FORCED if forced["available"] else FREE,
            "parser_check": self.inp.parser_check,
            "warnings": list(self.warnings),
        }

    def _prompt(self) -> dict:
        import orjson

        t = self.turn
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

    # ---- forced mode

    def forced_panel(self, p: int) -> dict | None:
        ref = self.forced_members.get(self.ref_name) if self.ref_name else None
        order = list(self.forced_members)
        if self.ref_name in order:
            order.remove(self.ref_name)
            order.insert(0, self.ref_name)
        present, lanes = [], []
        for k in order:
            d = self.dist(self.forced_members[k], p, ref)
            if d is not None:
                present.append((self.index[k], d))
                lanes.append(self.forced_members[k])
        return _panel(present, engine=self.rows.engine(lanes, p)) if present else None

    def _cached_columns(self, cand: Lane, ref: Lane, n: int) -> dict | None:
        """Per-position metrics of ``cand`` against ``ref`` from a stored comparison of exactly
        these two runs (tensorverse.shadow.compare), when it covers this turn's positions."""
        if not cand.run_id or not ref.run_id:
            return None
        for cmp in self.owner._comparisons(cand.run_id):
            if cmp.get("ref_run_id") != ref.run_id or pick(cmp, F.CMP_STATUS, "ok") != "ok":
                continue
            cols = pick(cmp, F.CMP_METRICS)
            if not isinstance(cols, Mapping):
                continue
            positions = pick(cmp, F.CMP_POSITIONS)
            positions = list(range(n)) if positions is None else [int(x) for x in positions]
            need = ("kl", "delta_p", "margin", "rank", "ref_top1", "cand_top1")
            if not all(isinstance(cols.get(k), list) and len(cols[k]) == len(positions) for k in need):
                continue
            if any(not 0 <= q < n for q in positions):
                continue
            classes = pick(cmp, F.CMP_FLIP_CLASSES)
            flips = pick(cmp, F.CMP_FLIPS)
            by_pos = dict(zip(flips, classes)) if isinstance(classes, list) and isinstance(flips, list) \
                and len(classes) == len(flips) else {}
            return {"positions": positions, "cols": cols, "approximate": pick(cmp, F.CMP_KIND) != "full",
                    "classes": by_pos}
        return None

    def free_class(self, backend: str) -> str | None:
        """The class of a backend's free-run flip, from its stored comparison (None: none stored,
        or no flip)."""
        lane = self.inp.free.get(backend)
        if lane is None or not lane.run_id:
            return None
        for cmp in self.owner._comparisons(lane.run_id):
            if pick(cmp, F.CMP_MODE) == FREE and pick(cmp, F.CMP_STATUS, "ok") == "ok":
                c = pick(cmp, F.CMP_FLIP_CLASS)
                return c if isinstance(c, str) else None
        return None

    def _forced(self, inline: bool) -> dict:
        t = self.turn
        tokens = t.lane.token_ids
        n = len(tokens)
        if not self.inp.forced:
            return {"available": False}
        members = self.forced_members
        for name, lane in self.inp.forced.items():
            d = _divergence(tokens, lane.token_ids)
            if lane.token_ids and d is not None and d < len(lane.token_ids):
                self.rows.warn(f"{name} (forced): emitted tokens differ from the primary's at "
                               f"position {d}; its forced metrics may be misaligned")
        ref_name = self.ref_name
        ref_lane = members.get(ref_name) if ref_name else None
        regions = tag_regions(self._pieces(t.lane)) if n else []
        cands = [k for k in members if k != ref_name] if ref_name else []
        arr = {k: {"kl": [None] * n, "delta_p": [None] * n, "rank": [None] * n,
                   "top1": [None] * n, "flip": [None] * n, "approx": [False] * n, "cls": {}} for k in cands}
        margin: list[float | None] = [None] * n
        ref_top1: list[int | None] = [None] * n
        slow = []
        for k in cands:
            cached = self._cached_columns(members[k], ref_lane, n)
            if cached is None:
                slow.append(k)
                continue
            cols = cached["cols"]
            arr[k]["cls"] = cached["classes"]
            lower = cols.get("rank_lower_bound") or [False] * len(cached["positions"])
            for q, p in enumerate(cached["positions"]):
                self._put(arr[k], p, kl=cols["kl"][q], delta_p=cols["delta_p"][q], rank=cols["rank"][q],
                          lower=bool(lower[q]), top1=cols["cand_top1"][q],
                          flip=cols["cand_top1"][q] != cols["ref_top1"][q], approx=cached["approximate"])
                if margin[p] is None and cols["margin"][q] is not None:
                    margin[p] = _sig(cols["margin"][q])
                    ref_top1[p] = cols["ref_top1"][q]
        # A candidate without rows is compared on top-k: take the reference's top-k from its
        # record when it has one, rather than decoding its rows.
        ref_topk = self._topk(ref_lane) if ref_lane is not None else None
        if ref_topk is not None:
            for k in [k for k in slow if not self.rows.has_rows(members[k]) and self._topk(members[k])]:
                slow.remove(k)
                self._topk_metrics(arr[k], ref_topk, self._topk(members[k]), tokens, margin, ref_top1)
        panels: list[dict | None] | None = [None] * n if inline else None
        if slow or inline:
            for s in range(0, n, CHUNK):
                e = min(n, s + CHUNK)
                need = set(slow) | ({ref_name} if slow and ref_name else set())
                if inline:
                    need = set(members)
                dists = {k: [self.dist(members[k], p, ref_lane) for p in range(s, e)] for k in need}
                for k in slow:
                    self._chunk_metrics(arr[k], dists[ref_name], dists[k], tokens, s, e, margin, ref_top1)
                if inline:
                    for j, p in enumerate(range(s, e)):
                        keys = [k for k in ([ref_name] if ref_name else []) + [k for k in members if k != ref_name]
                                if dists[k][j] is not None]
                        present = [(self.index[k], dists[k][j]) for k in keys]
                        if present:
                            panels[p] = _panel(present, engine=self.rows.engine([members[k] for k in keys], p))
                            self._ids_used.update(panels[p]["ids"])
        lanes_out: dict[str, dict] = {}
        flips: dict[int, dict] = {}
        for k in cands:
            a = arr[k]
            known = [i for i in range(n) if a["flip"][i] is not None]
            summary = _summary_of(a, known, [regions[i] for i in known]) if known else None
            lanes_out[k] = {
                "kl": _sigs(a["kl"]),
                "delta_p": _sigs(a["delta_p"]),
                "rank": a["rank"],
                "top1": a["top1"],
                "flips": [i for i in known if a["flip"][i]],
                # why each flip happened (stored comparisons; null where none classified it)
                "flip_classes": [a["cls"].get(i) for i in known if a["flip"][i]],
                "approximate": any(a["approx"][i] for i in known),
                "coverage": len(known),
                "summary": summary,
            }
            self._ids_used.update(x for x in a["top1"] if x is not None)
            for i in lanes_out[k]["flips"]:
                f = flips.setdefault(i, {"position": i, "backends": [], "kl": {}, "top1": {}, "classes": {},
                                         "margin": margin[i], "region": regions[i] if regions else None,
                                         "token": tokens[i], "ref_top1": ref_top1[i]})
                f["backends"].append(k)
                f["classes"][k] = a["cls"].get(i)
                f["kl"][k] = lanes_out[k]["kl"][i]
                f["top1"][k] = a["top1"][i]
        if ref_name is None:
            self.rows.warn("forced: no reference distribution (no rows and no top-k logprobs)")
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

    @staticmethod
    def _put(a: dict, p: int, *, kl: Any, delta_p: Any, rank: Any, lower: bool, top1: Any, flip: bool,
             approx: bool) -> None:
        a["kl"][p] = None if kl is None else float(kl)
        a["delta_p"][p] = None if delta_p is None else float(delta_p)
        r = None if rank is None else int(rank)
        a["rank"][p] = -r if (r is not None and lower) else r  # negative: "at least |rank|"
        a["top1"][p] = None if top1 is None else int(top1)
        a["flip"][p] = bool(flip)
        a["approx"][p] = approx

    def _topk_metrics(self, a: dict, ref: list, cand: list, tokens: Sequence[int], margin: list,
                      ref_top1: list) -> None:
        """Approximate metrics from two lanes' recorded top-k (no rows decoded)."""
        n = min(len(tokens), len(ref), len(cand))
        for s in range(0, n, 256):
            e = min(n, s + 256)
            self._chunk_metrics(a, ref[s:e], cand[s:e], tokens, s, e, margin, ref_top1)

    def _chunk_metrics(self, a: dict, ref: list, cand: list, tokens: Sequence[int], s: int, e: int,
                       margin: list, ref_top1: list) -> None:
        full = [j for j in range(e - s) if isinstance(ref[j], _Row) and isinstance(cand[j], _Row)
                and ref[j].x.size == cand[j].x.size]
        done = set(full)
        parts = []
        if full:
            try:
                m = position_metrics(np.stack([ref[j].x for j in full]), np.stack([cand[j].x for j in full]),
                                     [tokens[s + j] for j in full])
                parts.append((full, m, False))
            except AnalysisInputError as exc:
                self.rows.warn(f"metrics skipped for positions {s}-{e - 1}: {exc}")
        rest = [j for j in range(e - s) if j not in done and ref[j] is not None and cand[j] is not None]
        if rest:
            try:
                m = topk_position_metrics([ref[j].topk_dict(20) for j in rest],
                                          [cand[j].topk_dict(20) for j in rest],
                                          [tokens[s + j] for j in rest])
                parts.append((rest, m, True))
            except AnalysisInputError as exc:
                self.rows.warn(f"approximate metrics skipped for positions {s}-{e - 1}: {exc}")
        for js, m, approx in parts:
            lower = m.rank_lower_bound
            for q, j in enumerate(js):
                p = s + j
                self._put(a, p, kl=m.kl[q], delta_p=m.delta_p[q], rank=m.rank[q],
                          lower=bool(lower[q]) if lower is not None else False, top1=m.cand_top1[q],
                          flip=not bool(m.top1_agree[q]), approx=approx)
                if margin[p] is None and math.isfinite(float(m.margin[q])):
                    margin[p] = _sig(float(m.margin[q]))
                    ref_top1[p] = int(m.ref_top1[q])

    # ---- free mode: the multiverse tree

    def _group_ref(self, group: Sequence[str], p: int) -> str:
        """Whose distribution is the reference among backends sharing a context: the forced
        reference when it is in the group and has a distribution there, else the first of the
        group (the primary when present)."""
        r = self.ref_name
        if r in group and r in self.free_lanes and self.dist(self.free_lanes[r], p) is not None:
            return r
        return group[0]

    def _group(self, node: Any, p: int) -> list[str]:
        """Backends that share the context of position ``p`` in ``node``: at a branch point (the
        first token of a child) the parent's, whose members chose between the branches."""
        par = self.parent.get(node.id)
        return list(par.backends if (p == node.start and par is not None) else node.backends)

    def free_panel(self, node_id: int, p: int) -> dict | None:
        node = self.nodes.get(node_id)
        if node is None or not node.start <= p < node.end:
            raise ValueError(f"no position {p} in tree node {node_id}")
        group = self._group(node, p)
        ref_b = self._group_ref(group, p)
        present, lanes = [], []
        for b in [ref_b] + [g for g in group if g != ref_b]:
            d = self.dist(self.free_lanes[b], p)
            if d is not None:
                present.append((self.index[b], d))
                lanes.append(self.free_lanes[b])
        return _panel(present, engine=self.rows.engine(lanes, p)) if present else None

    def _free(self, inline: bool) -> dict:
        regions = {k: (tag_regions(self._pieces(l)) if l.token_ids else []) for k, l in self.free_lanes.items()}
        depth: dict[int, int] = {self.tree.root.id: 0}
        nodes = []
        branch_points = []
        for node in self.tree.nodes():
            par = self.parent.get(node.id)
            if par is not None:
                depth[node.id] = depth[par.id] + 1
            panels = None
            if inline:
                panels = [self.free_panel(node.id, p) for p in range(node.start, node.end)]
                for pn in panels:
                    if pn:
                        self._ids_used.update(pn["ids"])
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
                **self._node_texts(node),
            })
            if node.is_branch_point:
                branch_points.append(self._branch_point(node))
        branch_points.sort(key=lambda b: (b["position"], b["node"]))
        return {
            "available": True,
            "lengths": self.tree.lengths,
            "root": self.tree.root.id,
            "nodes": nodes,
            "branch_points": branch_points,
            "toolcalls": self._toolcalls(),
        }

    def _node_texts(self, node: Any) -> dict:
        """Per-token text of a node whose tokens have no exact piece (a free run's text split
        where the token boundaries are unknown): ``texts`` and the ``inexact`` offsets."""
        lead = next((b for b in node.backends if b in self.inferred), None)
        if lead is None or all(t in self.vocab for t in node.tokens):
            return {}
        pieces, exact = self.inferred[lead]
        sl = slice(node.start, node.end)
        return {"texts": pieces[sl],
                "inexact": [i for i, ok in enumerate(exact[sl]) if not ok]}

    def _branch_point(self, node: Any) -> dict:
        p = node.end
        ref_b = self._group_ref(node.backends, p)
        options = [{"token": c.tokens[0], "backends": list(c.backends), "node": c.id} for c in node.children]
        if node.ended:
            options.append({"token": END, "backends": list(node.ended), "node": None})
        ref_d = self.dist(self.free_lanes[ref_b], p)
        margin = _sig(_margin(ref_d)) if ref_d is not None else None
        kl: dict[str, float | None] = {}
        t_ref = next((o["token"] for o in options if ref_b in o["backends"]), END)
        if t_ref == END:  # the reference ended here: measure at the first branch's token
            t_ref = node.children[0].tokens[0]
        self._ids_used.update(o["token"] for o in options if o["token"] != END)
        if ref_d is not None:
            for b in node.backends:
                if b == ref_b:
                    continue
                d = self.dist(self.free_lanes[b], p)
                if d is None:
                    continue
                try:
                    if isinstance(ref_d, _Row) and isinstance(d, _Row) and ref_d.x.size == d.x.size:
                        m = position_metrics(ref_d.x[None, :], d.x[None, :], [t_ref])
                    else:
                        m = topk_position_metrics([ref_d.topk_dict(20)], [d.topk_dict(20)], [t_ref])
                    kl[b] = _sig(float(m.kl[0]))
                except AnalysisInputError:
                    pass
        # the class of each backend's flip here: those that left the reference's branch
        classes = {b: self.free_class(b) for o in options if ref_b not in o["backends"]
                   for b in o["backends"] if b in self.inp.free}
        return {"position": p, "node": node.id, "reference": ref_b, "options": options,
                "margin": margin, "kl": kl, "classes": classes}

    def _toolcalls(self) -> list[dict]:
        prim = self.turn.lane
        ref = _extract(prim, self.vocab)
        out = []
        for node in self.tree.nodes():
            if not node.ended:
                continue
            is_ref = self.turn.primary in node.ended
            ext = ref if is_ref else _extract(self.free_lanes[node.ended[0]], self.vocab)
            out.append({
                "node": node.id,
                "backends": list(node.ended),
                "reference": is_ref,
                "extraction": ext.to_dict(),
                "verdict": None if is_ref else compare_tool_calls(ref, ext).to_dict(),
                "classes": {b: self.free_class(b) for b in node.ended if b in self.inp.free},
                "status": {b: self.free_lanes[b].status for b in node.ended},
            })
        out.sort(key=lambda e: (not e["reference"], self.index.get(e["backends"][0], 0)))
        return out


def _summary_of(a: dict, known: list[int], regions: list[str]) -> dict | None:
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
        "kl_mean": _sig(s["kl"]["mean"]),
        "kl_se": _sig(s["kl"]["se"]),
        "kl_max": _sig(s["kl"]["max"]),
        "kl_p99": _sig(s["kl"].get("p99")),
        "rms_delta_p": _sig(s["delta_p"].get("rms")),
        "same_top_p": _sig(s["same_top_p"]["p"], 6),
        "same_top_p_se": _sig(s["same_top_p"]["se"]),
        "flips": s["flips"],
        "first_flip": None if first is None else known[first],
        "flips_by_region": s.get("flips_by_region", {}),
    }
