"""What the store holds, how fast it grows, and a budget it keeps: ``tensorverse store ...``.

:func:`usage` measures a store: live bytes per table (LMDB's own page counts: pages freed by a
deletion are reused, so the file does not shrink but the live bytes do), the logits rows' bytes
by backend and mode, and the growth rate over the sessions of the last ``window_s`` (their rows
and records, by creation time), hence the days left before the cap (or the filesystem) is full.

A :class:`RetentionPolicy` (``[retention]`` in the configuration, or ``store prune``'s options)
frees space in this order (after compaction, `tensorverse.store.compaction`): sessions older than
``max_age_s``; then, until the live bytes are under ``max_bytes``, the rows of the oldest sessions
(their records and comparisons stay), then the oldest sessions; **pinned** sessions
(``tensorverse store pin``) are never pruned. :func:`plan` estimates it from a :class:`StoreUsage` (pure: ``prune --dry-run``);
:func:`prune` does it, measuring the live bytes again after each deletion, one session per
transaction (`Store.delete_session`: a kill -9 leaves every session either whole or gone, never
half-pruned).
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tensorverse.store.store import Store


__all__ = ["SessionUsage", "StoreUsage", "RetentionPolicy", "PrunePlan", "PruneResult", "usage", "plan", "prune",
           "parse_duration", "parse_bytes", "RetentionKeeper"]

log = logging.getLogger("tensorverse.store.retention")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)


def parse_duration(text: str) -> float:
    """``"30d"``, ``"12h"``, ``"90m"`` -> seconds."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"expected a duration like 30d, 12h or 90m, got {text!r}")
    return float(m[1]) * _UNIT_S[m[2]]


def parse_bytes(text: str | int) -> int:
    """``"80G"``, ``"512MiB"``, ``1000`` -> bytes (K/M/G/T are powers of 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _BYTES.match(str(text))
    if not m:
        raise ValueError(f"expected a size like 80G or 512MiB, got {text!r}")
    unit = (m[2] or "b")[0].lower()
    return int(float(m[1]) * {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])


@dataclass(frozen=True)
class SessionUsage:
    id: str
    created_ns: int
    pinned: bool
    bytes: int  # its records and rows (keys and values)
    row_bytes: int = 0  # of which its rows (full and compact)


@dataclass(frozen=True)
class StoreUsage:
    path: str
    live_bytes: int  # pages in use across every table
    file_bytes: int  # the map's used extent (what the disk holds)
    max_size: int | None
    free_bytes: int  # the lesser of the cap's headroom and the filesystem's free space
    tables: dict[str, int]  # live bytes per table
    rows: dict[str, dict[str, dict[str, int]]]  # backend -> mode -> {"rows", "bytes"}
    sessions: list[SessionUsage] = field(default_factory=list)  # oldest first
    window_s: float = 86400.0
    bytes_per_day: float | None = None  # growth over the sessions created in the last window
    days_left: float | None = None  # free_bytes / bytes_per_day

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sessions"] = len(self.sessions)
        d["pinned_sessions"] = sum(s.pinned for s in self.sessions)
        return d


def usage(store: Store, *, window_s: float = 86400.0, now_ns: int | None = None) -> StoreUsage:
    """Measure ``store`` (read-only; one read transaction per session)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    st = store.stats()
    tables = store.table_bytes()
    rows: dict[str, dict[str, dict[str, int]]] = {}
    sessions: list[SessionUsage] = []
    for s in store.iter_sessions():
        total, by = store.session_bytes(s.id)
        rows_b = sum(b for _, b in by.values())
        for (backend, mode), (n, b) in by.items():
            cell = rows.setdefault(backend, {}).setdefault(mode, {"rows": 0, "bytes": 0})
            cell["rows"] += n
            cell["bytes"] += b
        sessions.append(SessionUsage(s.id, s.created_ns, bool(s.pinned), total, rows_b))
    sessions.sort(key=lambda x: (x.created_ns, x.id))
    cap = st.get("max_size")
    try:
        fs_free = shutil.disk_usage(str(store.path)).free
    except OSError:
        fs_free = 0
    live = sum(tables.values())
    free = fs_free if not cap else min(fs_free, max(0, int(cap) - live))
    rate = None
    if sessions:
        recent = [x for x in sessions if x.created_ns >= now_ns - window_s * 1e9]
        span_s = min(window_s, max(1.0, (now_ns - sessions[0].created_ns) / 1e9))
        rate = sum(x.bytes for x in recent) / span_s * 86400.0
    return StoreUsage(path=str(store.path), live_bytes=live, file_bytes=int(st.get("used_bytes") or 0),
                      max_size=cap, free_bytes=free, tables=tables, rows=rows, sessions=sessions,
                      window_s=window_s, bytes_per_day=rate, days_left=(free / rate) if rate else None)


@dataclass(frozen=True)
class RetentionPolicy:
    max_age_s: float | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError("max_age must be positive")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError("max_bytes must be positive")


REASONS = ("age", "rows", "bytes")  # past max_age; rows dropped for max_bytes; deleted for max_bytes


@dataclass(frozen=True)
class PrunePlan:
    delete: list[tuple[str, str, int]]  # (session id, reason (REASONS), bytes freed)
    live_bytes_after: int
    over_budget: bool  # max_bytes still exceeded after every unpinned session is gone

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.delete)


def plan(u: StoreUsage, policy: RetentionPolicy, *, now_ns: int | None = None) -> PrunePlan:
    """What to delete, in order: expired unpinned sessions, then while the live bytes exceed
    ``max_bytes`` the rows of the oldest unpinned sessions, then those sessions themselves."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    out: list[tuple[str, str, int]] = []
    live = u.live_bytes
    gone: set[str] = set()
    if policy.max_age_s is not None:
        cutoff = now_ns - policy.max_age_s * 1e9
        for s in u.sessions:
            if s.created_ns < cutoff and not s.pinned:
                out.append((s.id, "age", s.bytes))
                gone.add(s.id)
                live -= s.bytes
    if policy.max_bytes is not None:
        rowless: dict[str, int] = {}
        for s in u.sessions:  # first the rows of the oldest sessions (records and comparisons stay)
            if live <= policy.max_bytes:
                break
            if s.id in gone or s.pinned or not s.row_bytes:
                continue
            out.append((s.id, "rows", s.row_bytes))
            rowless[s.id] = s.row_bytes
            live -= s.row_bytes
        for s in u.sessions:  # then the oldest sessions themselves
            if live <= policy.max_bytes:
                break
            if s.id in gone or s.pinned:
                continue
            out.append((s.id, "bytes", s.bytes - rowless.get(s.id, 0)))
            gone.add(s.id)
            live -= s.bytes - rowless.get(s.id, 0)
    over = policy.max_bytes is not None and live > policy.max_bytes
    return PrunePlan(delete=out, live_bytes_after=max(0, live), over_budget=over)


@dataclass(frozen=True)
class PruneResult:
    deleted: list[tuple[str, str]]  # (session id, reason: age / bytes), in order
    bytes_freed: int  # live bytes before minus after
    live_bytes: int  # after
    over_budget: bool  # max_bytes still exceeded: the rest is pinned
    rows_dropped: list[str] = field(default_factory=list)  # sessions whose rows went (max_bytes), in order

    def by_reason(self) -> dict[str, int]:
        out = {r: sum(1 for _, why in self.deleted if why == r) for r in ("age", "bytes")}
        return {"age": out["age"], "rows": len(self.rows_dropped), "bytes": out["bytes"]}


def _live(store: Store) -> int:
    return sum(store.table_bytes().values())


def prune(store: Store, policy: RetentionPolicy, *, now_ns: int | None = None,
          progress: Callable[[int], None] | None = None) -> PruneResult:
    """Keep the budget: delete expired unpinned sessions; then, while the live bytes exceed
    ``max_bytes`` (measured again after every step, so what is freed is exact), drop the rows
    of the oldest unpinned sessions (`Store.drop_session_rows`: turns, runs and comparisons stay),
    then delete the oldest unpinned sessions. One transaction per session and step: an
    interruption leaves whole sessions only."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    before = _live(store)
    deleted: list[tuple[str, str]] = []

    def drop(sid: str, why: str) -> None:
        if store.delete_session(sid).result():
            deleted.append((sid, why))
            if progress is not None:
                progress(len(deleted))

    if policy.max_age_s is not None:
        cutoff = int(now_ns - policy.max_age_s * 1e9)
        for s in list(store.iter_sessions(until_ns=cutoff)):
            if not s.pinned:
                drop(s.id, "age")
    live = _live(store)
    over = False
    rows_dropped: list[str] = []
    if policy.max_bytes is not None and live > policy.max_bytes:
        over = True
        unpinned = [s for s in store.iter_sessions() if not s.pinned]
        for s in unpinned:  # the rows of the oldest sessions first: records and comparisons stay
            if store.drop_session_rows(s.id).result():
                rows_dropped.append(s.id)
                live = _live(store)
                if live <= policy.max_bytes:
                    over = False
                    break
        if over:
            for s in unpinned:
                drop(s.id, "bytes")
                live = _live(store)
                if live <= policy.max_bytes:
                    over = False
                    break
    if deleted or rows_dropped:
        store.note_space_freed()
    return PruneResult(deleted=deleted, bytes_freed=max(0, before - live), live_bytes=live, over_budget=over,
                       rows_dropped=[sid for sid in rows_dropped if sid not in {d for d, _ in deleted}])


class RetentionKeeper:
    """The budget kept by a running proxy (``[retention]``): :meth:`run_once` prunes (call it
    from a worker thread, never the relay's loop) and keeps the counters that ``/metrics``
    exports; :meth:`due` says whether it is time (every ``interval_s``, or at once when the
    store refuses writes for lack of space). ``days_left``: at the live bytes' growth since the
    previous run, how long until ``max_bytes`` (else the cap, else the filesystem) is reached."""

    def __init__(self, store: Store, policy: RetentionPolicy, interval_s: float = 300.0,
                 evidence: Any = None, planner: Any = None) -> None:
        self.store = store
        self.policy = policy
        self.evidence = evidence  # tensorverse.store.compaction.EvidencePolicy, or None: no compaction
        # who plans each turn's compaction (tensorverse.store.compaction.Planner; the proxy's
        # analysis workers), None: this thread
        self.planner = planner
        self.turns_compacted = 0
        self.rows_compacted = 0
        self.bytes_compacted = 0
        self.interval_s = float(interval_s)
        self.runs = 0
        self.errors = 0
        self.sessions_pruned = 0
        self.sessions_rows_dropped = 0
        self.bytes_pruned = 0
        self.over_budget = False
        self.days_left: float | None = None
        self._last: tuple[float, int] | None = None  # (monotonic time, live bytes) after the last run
        self._due_at = 0.0
        self._busy = threading.Lock()

    def wait_idle(self) -> None:
        """Block until a run in progress (in another thread) is over: before the store closes."""
        with self._busy:
            pass

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if now >= self._due_at:
            return True
        try:
            return bool(self.store.stats().get("full"))
        except Exception:  # noqa: BLE001 - a closed store: nothing to do
            return False

    def run_once(self, now_ns: int | None = None) -> PruneResult | None:
        with self._busy:
            return self._run(now_ns)

    def _run(self, now_ns: int | None) -> PruneResult | None:
        t = time.monotonic()
        self._due_at = t + self.interval_s
        self.runs += 1
        try:
            live_before = _live(self.store)
            if self.evidence is not None:  # non-evidence rows go first
                from tensorverse.store.compaction import compact_store

                for c in compact_store(self.store, self.evidence, now_ns=now_ns, planner=self.planner):
                    if c.status == "compacted":
                        self.turns_compacted += 1
                        self.rows_compacted += c.rows_compact
                        self.bytes_compacted += c.bytes_saved
            r = prune(self.store, self.policy, now_ns=now_ns)
        except Exception as e:  # noqa: BLE001 - retention must never take the proxy down
            self.errors += 1
            log.warning("retention: compaction or prune failed: %s", e)
            return None
        self.sessions_pruned += len(r.deleted)
        self.sessions_rows_dropped += len(r.rows_dropped)
        self.bytes_pruned += r.bytes_freed
        self.over_budget = r.over_budget
        if self._last is not None and t > self._last[0]:
            grown = live_before - self._last[1]  # what was written since the previous run
            rate = grown / (t - self._last[0])
            limit = self.policy.max_bytes or self.store.stats().get("max_size")
            if limit is None:
                try:
                    limit = r.live_bytes + shutil.disk_usage(str(self.store.path)).free
                except OSError:
                    limit = None
            self.days_left = ((limit - r.live_bytes) / rate / 86400.0) if rate > 0 and limit else None
        self._last = (t, r.live_bytes)
        return r

    def stats(self) -> dict[str, Any]:
        return {"runs": self.runs, "errors": self.errors, "sessions_pruned": self.sessions_pruned,
                "sessions_rows_dropped": self.sessions_rows_dropped,
                "turns_compacted": self.turns_compacted, "rows_compacted": self.rows_compacted,
                "bytes_compacted": self.bytes_compacted,
                "bytes_pruned": self.bytes_pruned, "over_budget": self.over_budget, "days_left": self.days_left}
