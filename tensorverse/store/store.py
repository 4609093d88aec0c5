"""The capture store: one LMDB environment, one writer thread, many lock-free readers.

Records (backends, sessions, turns, runs, logits rows, comparisons) are JSON-like dicts stored
with orjson, except rows, which are codec blobs. Turns are stored zstd-compressed (compressed on
the writer thread, which zstd runs without the GIL: a turn holds the whole message history and
its logprobs as the upstream wrote them) and returned in their canonical shape
(`tensorverse.store.turns.read_turn`). Every `put_*`/`write_rows` returns a
`concurrent.futures.Future` that resolves once the record is committed; each call is one
atomic record (with its index entries), so a crash never exposes half of one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import lmdb
import orjson

from tensorverse.store import blobs, schema
from tensorverse.store.engine_state import EngineState
from tensorverse.store.turns import read_turn
from tensorverse.store.writer import ResizeLock, StoreFullError, Writer, adopt_map_size

log = logging.getLogger("tensorverse.store")

DEFAULT_MAP_SIZE = 64 << 20
_PAGE = 256  # keys read per read transaction while iterating, so resizes are never starved


class StoreVersionError(RuntimeError):
    """The store was written by a newer Tensorverse, or a migration is missing."""


class StoreNotReadyError(StoreVersionError):
    """Read-only open of a store that its writer is still creating (no format version yet)."""


class RecordNotFound(KeyError):
    """No record with that id."""


class CompactionConflict(RuntimeError):
    """A turn's rows changed (or were compacted) while its compaction was computed."""


@dataclass(frozen=True)
class RowChange:
    """One row of `Store.apply_compaction`: the blob it was computed from (length and trailing
    checksum) and what replaces it: a compact row, or a re-encoded full row."""

    run_id: str
    position: int
    expect_len: int
    expect_tail: bytes
    compact: bytes | None = None
    full: bytes | None = None


_dumps, _compress, _loads = blobs.dumps, blobs.compress, blobs.loads


_STORE_KEPT = ("created_ns", "turns", "side_turns", "tool_call_turns", "updated_ns", "edits", "pinned")


def _count(session: dict, turn: dict, sign: int) -> None:
    """A session's ``side_turns`` / ``tool_call_turns`` counters for one turn added (+1) or
    removed (-1). Side requests are never tool-call turns."""
    if turn.get("kind") == "side":
        session["side_turns"] = max(0, int(session.get("side_turns", 0)) + sign)
    elif turn.get("tool_calls"):
        session["tool_call_turns"] = max(0, int(session.get("tool_call_turns", 0)) + sign)


class Store:
    """See the module docstring. Open with `Store.open(path)`; close with `close()`."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        max_size: int | None = None,
        readonly: bool = False,
        durable: bool = True,
        ready_timeout_s: float = 10.0,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.max_size = max_size
        if max_size is not None:
            map_size = min(map_size, max_size)
        if not readonly:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif not (self.path / "data.mdb").exists():
            raise FileNotFoundError(f"no Tensorverse store at {self.path}")
        self._map_size = map_size
        self._durable = durable
        self._env = self._open_env()
        self._resize_lock = ResizeLock()
        self._refused_sessions: OrderedDict[str, None] = OrderedDict()
        self._writer: Writer | None = None
        if not readonly:
            # The map may have been grown by an earlier run: never shrink below the file.
            used = (self.path / "data.mdb").stat().st_size
            if used > self._env.info()["map_size"]:
                self._env.set_mapsize(used)
            self._create()
            self._migrate()
            self._writer = Writer(self._env, self._resize_lock, max_size=max_size)
        else:
            self._wait_created(ready_timeout_s)
            self._check_version()

    def _open_env(self) -> lmdb.Environment:
        return lmdb.open(
            str(self.path),
            map_size=self._map_size,
            max_dbs=len(schema.ALL_DBS) + 2,
            readonly=self.readonly,
            mode=0o600,
            sync=self._durable,
            metasync=self._durable,
            lock=True,
        )

    def _create(self) -> None:
        """Every named database and, in a new store, the format version: one transaction, so a
        reader sees either no store yet or a whole one (never databases without a version)."""
        with self._env.begin(write=True) as txn:
            self._dbs = {name: self._env.open_db(name, txn=txn, create=True) for name in schema.ALL_DBS}
            if self._version(txn) is None:
                txn.put(b"format_version", str(schema.FORMAT_VERSION).encode(), db=self._dbs[schema.META])

    def _wait_created(self, timeout_s: float) -> None:
        """Read-only: a store whose writer has created ``data.mdb`` but not yet committed its
        first transaction (a reader started beside a new proxy) is waited for, up to
        ``timeout_s``, then refused with :class:`StoreNotReadyError`."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            with self._env.begin() as txn:
                present = {k for k, _ in txn.cursor()}
            if schema.META in present:
                self._dbs = {name: self._env.open_db(name, create=False) for name in schema.ALL_DBS
                             if name in present}
                with self._env.begin() as txn:
                    if self._version(txn) is not None:
                        return
            if time.monotonic() >= deadline:
                self._env.close()
                raise StoreNotReadyError(f"store {self.path} is being created by its writer (no format version "
                                         f"after {timeout_s:g} s); open it again once the writer is up")
            time.sleep(0.05)

    @classmethod
    def open(cls, path: str | os.PathLike, **kwargs: Any) -> "Store":
        return cls(path, **kwargs)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._env.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- format version and migrations --------------------------------------------------

    def _version(self, txn: lmdb.Transaction) -> int | None:
        raw = txn.get(b"format_version", db=self._dbs[schema.META])
        return None if raw is None else int(raw)

    def _migrate(self) -> None:
        with self._env.begin() as txn:
            version = self._version(txn)
        assert version is not None  # stamped by _create
        if version > schema.FORMAT_VERSION:
            raise StoreVersionError(
                f"store {self.path} has format {version}, newer than this Tensorverse "
                f"({schema.FORMAT_VERSION}); upgrade Tensorverse to read it"
            )
        while version < schema.FORMAT_VERSION:
            step = schema.MIGRATIONS.get(version)
            if step is None:
                raise StoreVersionError(f"no migration from store format {version}")
            with self._env.begin(write=True) as txn:  # one migration, one transaction
                step(txn, self._dbs)
                version += 1
                txn.put(b"format_version", str(version).encode(), db=self._dbs[schema.META])
                txn.put(
                    f"migrated:{version}".encode(),
                    _dumps({"at_ns": time.time_ns()}),
                    db=self._dbs[schema.META],
                )
            log.info("tensorverse store %s migrated to format %d", self.path, version)

    def _check_version(self) -> None:
        with self._read() as txn:
            version = self._version(txn) if schema.META in self._dbs else None
        if version != schema.FORMAT_VERSION:
            raise StoreVersionError(
                f"store {self.path} has format {version}; this Tensorverse reads "
                f"{schema.FORMAT_VERSION} (open it writable once to migrate)"
            )

    @property
    def format_version(self) -> int | None:
        with self._read() as txn:
            return self._version(txn)

    # -- writes ---------------------------------------------------------------------------

    def submit(self, op: schema.Migration | Any) -> Future:
        """Run `op(txn)` on the writer thread; low level, prefer the `put_*` methods."""
        if self._writer is None:
            raise PermissionError(f"store {self.path} is open read-only")
        return self._writer.submit(op)

    def _put_json(self, db: bytes, key: bytes, value: dict, *extra: tuple[bytes, bytes, bytes]) -> Future:
        blob = _dumps(value)  # serialise on the caller's thread, not the writer's

        def op(txn: lmdb.Transaction) -> None:
            txn.put(key, blob, db=self._dbs[db])
            for xdb, xkey, xval in extra:
                txn.put(xkey, xval, db=self._dbs[xdb])

        return self.submit(op)

    def put_backend(self, name: str, info: dict) -> Future:
        return self._put_json(schema.BACKENDS, schema.check_id(name, "backend"), {**info, "name": name})

    def put_session(self, session: dict) -> Future:
        """Create or replace a session; `id` and `created_ns` are filled in if missing. Replacing
        keeps what the store maintains itself: the turn counters, the hand edits and the creation
        time (the proxy may submit the same new session's record twice: once with a conversation's
        first turn, once with a side request of it that finished first)."""
        session = {"created_ns": time.time_ns(), "tags": {}, **session}
        if "id" not in session:  # not setdefault: no id is made for records that have one
            session["id"] = schema.new_id()
        sid = session["id"]
        skey = schema.check_id(sid, "session")
        blob = _dumps(session)

        def op(txn: lmdb.Transaction) -> None:
            raw = txn.get(skey, db=self._dbs[schema.SESSIONS])
            if raw is None:
                txn.put(skey, blob, db=self._dbs[schema.SESSIONS])
                txn.put(schema.session_time_key(session["created_ns"], sid), b"", db=self._dbs[schema.SESSIONS_BY_TIME])
                return
            old = orjson.loads(raw)
            kept = {k: old[k] for k in _STORE_KEPT if k in old}
            txn.put(skey, _dumps({**session, **kept}), db=self._dbs[schema.SESSIONS])

        fut = self.submit(op)
        fut.add_done_callback(lambda f: self._note_refused_session(sid, f))
        return fut

    def _note_refused_session(self, sid: str, fut: Future) -> None:
        """Remember sessions refused because the store was full: their turns are refused the
        same way (`StoreFullError`), not reported as writes to a missing session."""
        if not fut.cancelled() and isinstance(fut.exception(), StoreFullError):
            self._refused_sessions[sid] = None
            while len(self._refused_sessions) > 10_000:
                self._refused_sessions.popitem(last=False)

    def put_turn(self, turn: dict) -> Future:
        """Store a turn of a session (`session_id`, `index`) and bump the session's counters.

        The session must exist (created by `put_session`) — checked in the same transaction.
        When another turn already holds that index (the session was merged or split by hand while
        a proxy kept writing it), the turn takes the session's next free index instead.
        Counters: ``turns`` (one past the highest index), ``side_turns`` (turns of ``kind``
        ``side``), ``tool_call_turns`` (other turns whose answer calls a tool).
        """
        turn = {"created_ns": time.time_ns(), **turn}
        if "id" not in turn:  # not setdefault: no id is made for records that have one
            turn["id"] = schema.new_id()
        tid, sid, index = turn["id"], turn["session_id"], int(turn["index"])
        tkey = schema.check_id(tid, "turn")
        skey = schema.check_id(sid, "session")
        blob = _dumps(turn)

        def op(txn: lmdb.Transaction) -> str:
            raw = txn.get(skey, db=self._dbs[schema.SESSIONS])
            if raw is None:
                if sid in self._refused_sessions:
                    raise StoreFullError(f"turn {tid}: its session {sid} was not stored (store full)")
                raise RecordNotFound(f"turn {tid}: session {sid} does not exist")
            session = orjson.loads(raw)
            data = blob
            held = txn.get(schema.turn_index_key(sid, index), db=self._dbs[schema.TURNS_BY_SESSION])
            if held is not None and held != tkey:
                moved = {**turn, "index": max(int(session.get("turns", 0)), index + 1)}
                moved["index_requested"] = index
                data = _dumps(moved)
                idx = moved["index"]
            else:
                idx = index
            session["turns"] = max(int(session.get("turns", 0)), idx + 1)
            _count(session, turn, +1)
            session["updated_ns"] = turn["created_ns"]
            txn.put(skey, _dumps(session), db=self._dbs[schema.SESSIONS])
            txn.put(tkey, _compress(data), db=self._dbs[schema.TURNS])
            txn.put(schema.turn_index_key(sid, idx), tkey, db=self._dbs[schema.TURNS_BY_SESSION])
            return tid

        return self.submit(op)

    # -- by-hand corrections of the grouping (recorded in the sessions' ``edits``) --------------

    def move_turn(self, turn_id: str, session_id: str, index: int | None = None, *, kind: str | None = None,
                  by: str = "user", reason: str = "", drop_empty: bool = False) -> Future:
        """Move one turn into another session (at ``index``, default its next free one), in one
        transaction; both sessions get an ``edits`` entry, the turn a ``moved_from`` entry.
        ``kind`` relabels it (``side``/``main``); ``drop_empty`` deletes the session it leaves
        when that has no turn left (its record then lives on in the target's edit)."""

        def op(txn: lmdb.Transaction) -> int:
            return self._move(txn, [turn_id], session_id, index, kind=kind, by=by, reason=reason,
                              op="move", drop_empty=drop_empty)

        return self.submit(op)

    def merge_sessions(self, into: str, other: str, *, by: str = "user", reason: str = "") -> Future:
        """Move every turn of ``other`` after the turns of ``into``, in ``other``'s order, and
        delete ``other``; recorded in ``into``'s ``edits`` (with ``other``'s record) and in
        each moved turn's ``moved_from``. Runs (shadow runs, rows, comparisons) stay with their
        turns. Resolves to the number of turns moved."""
        if into == other:
            raise ValueError("a session cannot be merged into itself")

        def op(txn: lmdb.Transaction) -> int:
            self._session_in(txn, other)
            tids = [v.decode() for _, v in self._scan(txn, schema.TURNS_BY_SESSION, schema.child_prefix(other, "session"))]
            return self._move(txn, tids, into, None, by=by, reason=reason, op="merge", drop_empty=True,
                              source=other)

        return self.submit(op)

    def split_session(self, session_id: str, at: int, *, new_id: str | None = None, by: str = "user",
                      reason: str = "") -> Future:
        """Move the turns of ``session_id`` from index ``at`` on into a new session (same tags,
        ``grouping`` = ``split``), renumbered from 0; recorded in both sessions' ``edits``.
        Resolves to the new session's id."""
        nid = new_id or schema.new_id()
        nkey = schema.check_id(nid, "session")

        def op(txn: lmdb.Transaction) -> str:
            src = self._session_in(txn, session_id)
            pairs = [(schema.row_position(k), v.decode()) for k, v in
                     self._scan(txn, schema.TURNS_BY_SESSION, schema.child_prefix(session_id, "session"))]
            tids = [t for i, t in pairs if i >= at]
            if not tids:
                raise ValueError(f"session {session_id} has no turn at index {at} or later")
            if txn.get(nkey, db=self._dbs[schema.SESSIONS]) is not None:
                raise ValueError(f"session {nid} exists")
            first = _loads(txn.get(tids[0].encode(), db=self._dbs[schema.TURNS]))
            created = int(first.get("created_ns") or time.time_ns())
            new = {"id": nid, "created_ns": created, "tags": src.get("tags", {}), "grouping": "split",
                   "endpoint": src.get("endpoint"), "turns": 0, "split_from": session_id}
            txn.put(nkey, _dumps(new), db=self._dbs[schema.SESSIONS])
            txn.put(schema.session_time_key(created, nid), b"", db=self._dbs[schema.SESSIONS_BY_TIME])
            self._move(txn, tids, nid, 0, by=by, reason=reason, op="split", source=session_id)
            return nid

        return self.submit(op)

    def _session_in(self, txn: lmdb.Transaction, sid: str) -> dict:
        raw = txn.get(schema.check_id(sid, "session"), db=self._dbs[schema.SESSIONS])
        if raw is None:
            raise RecordNotFound(f"no session {sid!r} in {self.path}")
        return orjson.loads(raw)

    def _move(self, txn: lmdb.Transaction, tids: list[str], target: str, index: int | None, *,
              kind: str | None = None, by: str, reason: str, op: str, drop_empty: bool = False,
              source: str | None = None) -> int:
        """Move turns (in this order) into ``target`` from ``index`` on; see the callers."""
        dst = self._session_in(txn, target)
        tkey_db, idx_db = self._dbs[schema.TURNS], self._dbs[schema.TURNS_BY_SESSION]
        now = time.time_ns()
        nxt = int(dst.get("turns", 0)) if index is None else index
        sources: dict[str, dict] = {}
        moved = []
        for tid in tids:
            tkey = schema.check_id(tid, "turn")
            raw = txn.get(tkey, db=tkey_db)
            if raw is None:
                raise RecordNotFound(f"no turn {tid!r} in {self.path}")
            turn = _loads(raw)
            old_sid, old_idx = turn["session_id"], int(turn["index"])
            src = sources.get(old_sid)
            if src is None and old_sid != target:
                src = sources[old_sid] = self._session_in(txn, old_sid)
            while txn.get(schema.turn_index_key(target, nxt), db=idx_db) not in (None, tkey):
                nxt += 1
            txn.delete(schema.turn_index_key(old_sid, old_idx), db=idx_db)
            if src is not None:
                _count(src, turn, -1)
            turn.setdefault("moved_from", []).append({"session_id": old_sid, "index": old_idx, "at_ns": now,
                                                      "by": by, "op": op})
            if kind is not None and turn.get("kind", "main") != kind:
                turn["kind"] = kind
            turn["session_id"], turn["index"] = target, nxt
            txn.put(tkey, _compress(_dumps(turn)), db=tkey_db)
            txn.put(schema.turn_index_key(target, nxt), tkey, db=idx_db)
            _count(dst, turn, +1)
            dst["turns"] = max(int(dst.get("turns", 0)), nxt + 1)
            moved.append({"turn_id": tid, "from_session": old_sid, "from_index": old_idx, "index": nxt})
            nxt += 1
        edit = {"op": op, "at_ns": now, "by": by, "reason": reason, "turns": moved}
        for sid, src in sources.items():
            left = [k for k, _ in self._scan(txn, schema.TURNS_BY_SESSION, schema.child_prefix(sid, "session"))]
            src["turns"] = (schema.row_position(left[-1]) + 1) if left else 0
            if not left and drop_empty:
                txn.delete(schema.session_time_key(src["created_ns"], sid), db=self._dbs[schema.SESSIONS_BY_TIME])
                txn.delete(schema.check_id(sid, "session"), db=self._dbs[schema.SESSIONS])
                edit.setdefault("deleted_sessions", []).append(src)
            else:
                src.setdefault("edits", []).append({**edit, "to_session": target})
                txn.put(schema.check_id(sid, "session"), _dumps(src), db=self._dbs[schema.SESSIONS])
        if source is not None:
            edit["from_session"] = source
        dst.setdefault("edits", []).append(edit)
        txn.put(schema.check_id(target, "session"), _dumps(dst), db=self._dbs[schema.SESSIONS])
        return len(moved)

    def put_run(self, run: dict) -> Future:
        """Store or update a run (turn x backend x mode). Its id is the capture id."""
        run = {"created_ns": time.time_ns(), **run}
        if "id" not in run:  # not setdefault: no id is made for records that have one
            run["id"] = schema.new_id()
        return self._put_json(
            schema.RUNS,
            schema.check_id(run["id"], "run"),
            run,
            (schema.RUNS_BY_TURN, schema.child_prefix(run["turn_id"], "turn") + schema.check_id(run["id"], "run"), b""),
        )

    def write_rows(self, run_id: str,
                   rows: Sequence[tuple[int, bytes] | tuple[int, bytes, EngineState | None]]) -> Future:
        """Store encoded logits rows of a run, all in one transaction: `(position, blob)` or
        `(position, blob, engine_state)`. A row written without an engine state has none (a
        state left by an earlier write of the same row is removed)."""
        keyed = [(schema.row_key(run_id, int(r[0])), bytes(r[1]),
                  r[2].pack() if len(r) > 2 and r[2] is not None else None) for r in rows]

        def op(txn: lmdb.Transaction) -> int:
            db = self._dbs[schema.ROWS]
            edb = self._dbs[schema.ROW_ENGINE]
            for key, blob, state in keyed:
                txn.put(key, blob, db=db)
                if state is not None:
                    txn.put(key, state, db=edb)
                else:
                    txn.delete(key, db=edb)
            return len(keyed)

        return self.submit(op)

    def apply_compaction(self, turn_id: str, record: dict, changes: Sequence[RowChange]) -> Future:
        """Compact one turn's rows in one transaction (`tensorverse.store.compaction`): each
        change replaces a full row by its compact form (``compact``) or by a re-encoding of the
        same row (``full``: a delta against its reference), provided the stored blob is still
        the one the change was computed from (its length and trailing checksum): otherwise
        nothing is written and `CompactionConflict` is raised. ``record`` (what was kept and why)
        goes to ``compacted`` under the turn id; a turn is compacted once. Resolves to the bytes
        of row blobs removed minus those written."""
        tkey = schema.check_id(turn_id, "turn")
        keyed = [(schema.row_key(c.run_id, c.position), c) for c in changes]
        blob = _dumps(record)

        def op(txn: lmdb.Transaction) -> int:
            rows, compact = self._dbs[schema.ROWS], self._dbs[schema.ROWS_COMPACT]
            if txn.get(tkey, db=self._dbs[schema.COMPACTED]) is not None:
                raise CompactionConflict(f"turn {turn_id} is compacted already")
            if txn.get(tkey, db=self._dbs[schema.TURNS]) is None:
                raise RecordNotFound(f"no turn {turn_id!r} in {self.path}")
            saved = 0
            for key, c in keyed:
                cur = txn.get(key, db=rows)
                if cur is None or len(cur) != c.expect_len or cur[-4:] != c.expect_tail:
                    raise CompactionConflict(f"row {c.position} of run {c.run_id} changed while the turn was compacted")
                if c.compact is not None:
                    txn.delete(key, db=rows)
                    txn.delete(key, db=self._dbs[schema.ROW_ENGINE])
                    txn.put(key, c.compact, db=compact)
                    saved += len(cur) - len(c.compact)
                elif c.full is not None:
                    txn.put(key, c.full, db=rows)
                    saved += len(cur) - len(c.full)
            txn.put(tkey, blob, db=self._dbs[schema.COMPACTED])
            return saved

        return self.submit(op)

    def put_comparison(self, run_id: str, ref_run_id: str, result: dict) -> Future:
        return self._put_json(
            schema.COMPARISONS,
            schema.comparison_key(run_id, ref_run_id),
            {**result, "run_id": run_id, "ref_run_id": ref_run_id},
        )

    # -- retention -----------------------------------------------------------------------

    def delete_session(self, session_id: str) -> Future:
        """Delete a session with its turns, runs, rows and comparisons, atomically."""
        skey = schema.check_id(session_id, "session")

        def op(txn: lmdb.Transaction) -> bool:
            raw = txn.get(skey, db=self._dbs[schema.SESSIONS])
            if raw is None:
                return False
            session = orjson.loads(raw)
            for _, tkey in list(self._scan(txn, schema.TURNS_BY_SESSION, schema.child_prefix(session_id, "session"))):
                tid = tkey.decode()
                for rkey, _ in list(self._scan(txn, schema.RUNS_BY_TURN, schema.child_prefix(tid, "turn"))):
                    rid = rkey[len(tkey) + 1 :]
                    self._delete_prefix(txn, schema.ROWS, rid + schema.SEP)
                    self._delete_prefix(txn, schema.ROW_ENGINE, rid + schema.SEP)
                    self._delete_prefix(txn, schema.ROWS_COMPACT, rid + schema.SEP)
                    self._delete_prefix(txn, schema.COMPARISONS, rid + schema.SEP)
                    txn.delete(rid, db=self._dbs[schema.RUNS])
                self._delete_prefix(txn, schema.RUNS_BY_TURN, tkey + schema.SEP)
                txn.delete(tkey, db=self._dbs[schema.COMPACTED])
                txn.delete(tkey, db=self._dbs[schema.TURNS])
            self._delete_prefix(txn, schema.TURNS_BY_SESSION, skey + schema.SEP)
            txn.delete(schema.session_time_key(session["created_ns"], session_id), db=self._dbs[schema.SESSIONS_BY_TIME])
            txn.delete(skey, db=self._dbs[schema.SESSIONS])
            return True

        return self.submit(op)

    def drop_session_rows(self, session_id: str) -> Future:
        """Retention's middle step: delete every row of a session's runs (full, compact, engine
        states) in one transaction, keeping its turns, runs and comparisons (the verdict and the
        viewer's stored numbers live on). Each turn's ``compacted`` record says ``rows_pruned``
        (readers say so; comparisons are never recomputed). Resolves to the row bytes deleted."""
        skey = schema.check_id(session_id, "session")

        def op(txn: lmdb.Transaction) -> int:
            if txn.get(skey, db=self._dbs[schema.SESSIONS]) is None:
                raise RecordNotFound(f"session {session_id} does not exist")
            now = time.time_ns()
            freed = 0
            for _, tkey in list(self._scan(txn, schema.TURNS_BY_SESSION, schema.child_prefix(session_id, "session"))):
                for rkey, _ in list(self._scan(txn, schema.RUNS_BY_TURN, tkey + schema.SEP)):
                    rid = rkey[len(tkey) + 1:]
                    for db in (schema.ROWS, schema.ROWS_COMPACT, schema.ROW_ENGINE):
                        freed += sum(len(v) for _, v in self._scan(txn, db, rid + schema.SEP))
                        self._delete_prefix(txn, db, rid + schema.SEP)
                raw = txn.get(tkey, db=self._dbs[schema.COMPACTED])
                rec = _loads(raw) if raw is not None else {"turn_id": tkey.decode(), "runs": {}}
                rec["rows_pruned"] = now
                txn.put(tkey, _dumps(rec), db=self._dbs[schema.COMPACTED])
            return freed

        return self.submit(op)

    def pin_session(self, session_id: str, pinned: bool = True) -> Future:
        """Pin (or unpin) a session: retention never prunes a pinned session
        (`tensorverse.store.retention`). Kept when the proxy rewrites the session's record."""
        skey = schema.check_id(session_id, "session")

        def op(txn: lmdb.Transaction) -> bool:
            raw = txn.get(skey, db=self._dbs[schema.SESSIONS])
            if raw is None:
                raise RecordNotFound(f"session {session_id} does not exist")
            session = orjson.loads(raw)
            was = bool(session.get("pinned"))
            if pinned:
                session["pinned"] = True
            else:
                session.pop("pinned", None)
            txn.put(skey, _dumps(session), db=self._dbs[schema.SESSIONS])
            return was

        return self.submit(op)

    def table_bytes(self) -> dict[str, int]:
        """Live bytes per table: its pages in use (pages freed by deletions are reused)."""
        psize = self._env.stat()["psize"]
        with self._read() as txn:
            return {name.decode(): (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * psize
                    for name, st in ((n, txn.stat(db)) for n, db in self._dbs.items())}

    def session_bytes(self, session_id: str) -> tuple[int, dict[tuple[str, str], tuple[int, int]]]:
        """The bytes (keys and values) of a session's records and rows, and of its rows per
        (backend, mode): ``(total, {(backend, mode): (rows, bytes)})``. One read transaction."""
        dbs = self._dbs

        def kv(txn: lmdb.Transaction, db: bytes, prefix: bytes) -> tuple[int, int]:
            n = size = 0
            for k, v in self._scan(txn, db, prefix):
                n += 1
                size += len(k) + len(v)
            return n, size

        skey = schema.check_id(session_id, "session")
        by: dict[tuple[str, str], tuple[int, int]] = {}
        with self._read() as txn:
            raw = txn.get(skey, db=dbs[schema.SESSIONS])
            if raw is None:
                raise RecordNotFound(f"session {session_id} does not exist")
            total = len(skey) + len(raw)
            for _, tkey in list(self._scan(txn, schema.TURNS_BY_SESSION, schema.child_prefix(session_id, "session"))):
                total += len(tkey) + len(txn.get(tkey, db=dbs[schema.TURNS]) or b"")
                if schema.COMPACTED in dbs:
                    total += len(txn.get(tkey, db=dbs[schema.COMPACTED]) or b"")
                for rkey, _ in list(self._scan(txn, schema.RUNS_BY_TURN, schema.child_prefix(tkey.decode(), "turn"))):
                    rid = rkey[len(tkey) + 1:]
                    run_raw = txn.get(rid, db=dbs[schema.RUNS]) or b""
                    n_rows, row_bytes = kv(txn, schema.ROWS, rid + schema.SEP)
                    n_compact, compact_bytes = kv(txn, schema.ROWS_COMPACT, rid + schema.SEP)
                    n_rows += n_compact
                    row_bytes += compact_bytes
                    total += len(rid) + len(run_raw) + row_bytes + kv(txn, schema.ROW_ENGINE, rid + schema.SEP)[1] \
                        + kv(txn, schema.COMPARISONS, rid + schema.SEP)[1]
                    if n_rows and run_raw:
                        run = orjson.loads(run_raw)
                        key = (str(run.get("backend")), str(run.get("mode")))
                        r0, b0 = by.get(key, (0, 0))
                        by[key] = (r0 + n_rows, b0 + row_bytes)
        return total, by

    def delete_older_than(self, cutoff_ns: int) -> int:
        """Retention: delete every session created before `cutoff_ns`. Returns how many.

        One transaction per session, so a long purge never holds the writer for long.
        """
        old = [s["id"] for s in self.iter_sessions(until_ns=cutoff_ns)]
        deleted = sum(bool(self.delete_session(sid).result()) for sid in old)
        if deleted:
            self.note_space_freed()
        return deleted

    def note_space_freed(self) -> None:
        """After deletions: a store that refused writes for lack of space may take them again."""
        if self._writer is not None:
            self._writer.note_space_freed()

    # -- reads ----------------------------------------------------------------------------

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        lock = self._resize_lock
        lock.acquire_read()
        try:
            try:
                txn = self._env.begin(buffers=False)
            except lmdb.MapResizedError:  # grown by another process sharing the store
                lock.release_read()
                try:
                    adopt_map_size(self._env, lock)
                finally:
                    lock.acquire_read()
                txn = self._env.begin(buffers=False)
            with txn:
                yield txn
        finally:
            lock.release_read()

    def _scan(self, txn: lmdb.Transaction, db: bytes, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        cur = txn.cursor(db=self._dbs[db])
        if not cur.set_range(start or prefix):
            return
        for key, value in cur:
            if not key.startswith(prefix):
                return
            yield key, value

    def _delete_prefix(self, txn: lmdb.Transaction, db: bytes, prefix: bytes) -> None:
        for key in [k for k, _ in self._scan(txn, db, prefix)]:
            txn.delete(key, db=self._dbs[db])

    def _paged(self, db: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Scan a prefix in short read transactions, so no reader outlives a page."""
        start: bytes | None = None
        while True:
            with self._read() as txn:
                page = []
                for key, value in self._scan(txn, db, prefix, start):
                    if start is not None and key == start:
                        continue
                    page.append((key, value))
                    if len(page) >= _PAGE:
                        break
            yield from page
            if len(page) < _PAGE:
                return
            start = page[-1][0]

    def _get_json(self, db: bytes, key: bytes, what: str) -> dict:
        with self._read() as txn:
            raw = txn.get(key, db=self._dbs[db])
        if raw is None:
            raise RecordNotFound(f"no {what} {key.decode(errors='replace')!r} in {self.path}")
        return _loads(raw)

    def get_backend(self, name: str) -> dict:
        return self._get_json(schema.BACKENDS, schema.check_id(name, "backend"), "backend")

    def get_session(self, session_id: str) -> dict:
        return self._get_json(schema.SESSIONS, schema.check_id(session_id, "session"), "session")

    def get_turn(self, turn_id: str) -> dict:
        return read_turn(self._get_json(schema.TURNS, schema.check_id(turn_id, "turn"), "turn"))

    def get_run(self, run_id: str) -> dict:
        return self._get_json(schema.RUNS, schema.check_id(run_id, "run"), "run")

    def get_comparison(self, run_id: str, ref_run_id: str) -> dict:
        return self._get_json(schema.COMPARISONS, schema.comparison_key(run_id, ref_run_id), "comparison")

    def iter_backends(self) -> Iterator[dict]:
        for _, value in self._paged(schema.BACKENDS, b""):
            yield orjson.loads(value)

    def iter_sessions(self, *, since_ns: int = 0, until_ns: int | None = None) -> Iterator[dict]:
        """Sessions in creation order, created in [since_ns, until_ns)."""
        start = schema.session_time_bound(since_ns)
        stop = None if until_ns is None else schema.session_time_bound(until_ns)
        last: bytes | None = None
        while True:
            with self._read() as txn:
                cur = txn.cursor(db=self._dbs[schema.SESSIONS_BY_TIME])
                page: list[dict] = []
                if cur.set_range(last or start):
                    for key, _ in cur:
                        if key == last:
                            continue
                        if stop is not None and key >= stop:
                            break
                        raw = txn.get(key[8:], db=self._dbs[schema.SESSIONS])
                        last = key
                        if raw is not None:
                            page.append(orjson.loads(raw))
                        if len(page) >= _PAGE:
                            break
            yield from page
            if len(page) < _PAGE:
                return

    def iter_turns(self, session_id: str) -> Iterator[dict]:
        """The turns of a session in index order."""
        for _, tkey in self._paged(schema.TURNS_BY_SESSION, schema.child_prefix(session_id, "session")):
            yield read_turn(self._get_json(schema.TURNS, tkey, "turn"))

    def turn_ids(self, session_id: str) -> list[str]:
        """A session's turn ids in index order, from the index alone (no turn record read)."""
        return [tkey.decode() for _, tkey in
                self._paged(schema.TURNS_BY_SESSION, schema.child_prefix(session_id, "session"))]

    def comparison_keys(self, turn_id: str) -> list[tuple[str, str]]:
        """The (run id, reference run id) of every comparison of a turn's runs, keys only (no
        record read): a cheap way to know which comparisons are new."""
        out: list[tuple[str, str]] = []
        prefix = schema.child_prefix(turn_id, "turn")
        with self._read() as txn:
            runs = [k[len(prefix):] for k, _ in self._scan(txn, schema.RUNS_BY_TURN, prefix)]
            cur = txn.cursor(db=self._dbs[schema.COMPARISONS])
            for rid in runs:
                p = rid + schema.SEP
                if not cur.set_range(p):
                    continue
                for key in cur.iternext(keys=True, values=False):
                    if not key.startswith(p):
                        break
                    out.append((rid.decode(), key[len(p):].decode()))
        return out

    def iter_runs(self, turn_id: str) -> Iterator[dict]:
        prefix = schema.child_prefix(turn_id, "turn")
        for key, _ in self._paged(schema.RUNS_BY_TURN, prefix):
            yield self._get_json(schema.RUNS, key[len(prefix) :], "run")

    def iter_comparisons(self, run_id: str) -> Iterator[dict]:
        for _, value in self._paged(schema.COMPARISONS, schema.child_prefix(run_id, "run")):
            yield orjson.loads(value)

    _RECORD_DBS = {"session": schema.SESSIONS, "turn": schema.TURNS, "run": schema.RUNS,
                   "comparison": schema.COMPARISONS, "backend": schema.BACKENDS}

    def records(self, kind: str) -> Iterator[dict]:
        """Every stored record of ``kind`` (session, turn, run, comparison, backend) in key order,
        whatever it belongs to: for checks and exports of a whole store."""
        db = self._RECORD_DBS.get(kind)
        if db is None:
            raise ValueError(f"unknown record kind {kind!r} (one of {', '.join(self._RECORD_DBS)})")
        for _, value in self._paged(db, b""):
            yield read_turn(_loads(value)) if kind == "turn" else _loads(value)

    def read_rows(self, run_id: str) -> list[tuple[int, bytes]]:
        """All stored rows of a run as `(position, blob)`, in position order."""
        return [(schema.row_position(k), v) for k, v in self._paged(schema.ROWS, schema.row_prefix(run_id))]

    def read_engine_states(self, run_id: str) -> dict[int, EngineState]:
        """The engine state of each row of a run that has one (none in stores written before
        format 3, or by a plugin with engine state off), by position."""
        if schema.ROW_ENGINE not in self._dbs:
            return {}
        return {schema.row_position(k): EngineState.unpack(v)
                for k, v in self._paged(schema.ROW_ENGINE, schema.row_prefix(run_id))}

    def read_engine_state(self, run_id: str, position: int) -> EngineState | None:
        """The engine state of one row, or None when it has none."""
        if schema.ROW_ENGINE not in self._dbs:
            return None
        with self._read() as txn:
            raw = txn.get(schema.row_key(run_id, position), db=self._dbs[schema.ROW_ENGINE])
        return None if raw is None else EngineState.unpack(raw)

    def count_rows(self, run_id: str) -> int:
        """How many full rows a run has in the store (keys only)."""
        n = 0
        with self._read() as txn:
            cur = txn.cursor(db=self._dbs[schema.ROWS])
            prefix = schema.row_prefix(run_id)
            if cur.set_range(prefix):
                for key in cur.iternext(keys=True, values=False):
                    if not key.startswith(prefix):
                        break
                    n += 1
        return n

    def read_compact_rows(self, run_id: str) -> list[tuple[int, bytes]]:
        """The compact rows of a run (`tensorverse.store.compact`) as `(position, blob)`: the
        positions whose full row compaction replaced."""
        if schema.ROWS_COMPACT not in self._dbs:
            return []
        return [(schema.row_position(k), v) for k, v in self._paged(schema.ROWS_COMPACT, schema.row_prefix(run_id))]

    def read_compact_row(self, run_id: str, position: int) -> bytes | None:
        """The compact row of one position, or None when the position has none."""
        if schema.ROWS_COMPACT not in self._dbs:
            return None
        with self._read() as txn:
            return txn.get(schema.row_key(run_id, position), db=self._dbs[schema.ROWS_COMPACT])

    def compaction(self, turn_id: str) -> dict | None:
        """What compaction kept of a turn and why (`tensorverse.store.compaction`), or None when
        the turn's rows are as captured."""
        if schema.COMPACTED not in self._dbs:
            return None
        with self._read() as txn:
            raw = txn.get(schema.check_id(turn_id, "turn"), db=self._dbs[schema.COMPACTED])
        return None if raw is None else _loads(raw)

    def read_row(self, run_id: str, position: int) -> bytes:
        with self._read() as txn:
            raw = txn.get(schema.row_key(run_id, position), db=self._dbs[schema.ROWS])
        if raw is None:
            raise RecordNotFound(f"no row {position} of run {run_id!r} in {self.path}")
        return raw

    def turn_stamp(self, turn_id: str) -> bytes | None:
        """A cheap version token of a turn and everything hanging off it: a hash of the raw bytes
        of the turn, its runs, their comparisons and the backends, read in one transaction and
        none parsed. Any run added, replaced or deleted, comparison stored or backend changed
        gives a new stamp; readers (the viewer) use it to know a cached view is still current.
        None when the turn does not exist."""
        tkey = schema.check_id(turn_id, "turn")
        h = hashlib.sha1(usedforsecurity=False)  # a change detector, not a security boundary

        def feed(tag: bytes, key: bytes, value: bytes | None) -> None:
            h.update(b"%s%d:%d:" % (tag, len(key), -1 if value is None else len(value)))
            h.update(key)
            if value is not None:
                h.update(value)

        with self._read() as txn:
            raw = txn.get(tkey, db=self._dbs[schema.TURNS])
            if raw is None:
                return None
            feed(b"T", tkey, raw)
            if schema.COMPACTED in self._dbs:
                feed(b"K", tkey, txn.get(tkey, db=self._dbs[schema.COMPACTED]))
            prefix = tkey + schema.SEP
            for key, _ in list(self._scan(txn, schema.RUNS_BY_TURN, prefix)):
                rid = key[len(prefix) :]
                feed(b"R", rid, txn.get(rid, db=self._dbs[schema.RUNS]))
                for ckey, cval in self._scan(txn, schema.COMPARISONS, rid + schema.SEP):
                    feed(b"C", ckey, cval)
            for bkey, bval in self._scan(txn, schema.BACKENDS, b""):
                feed(b"B", bkey, bval)
        return h.digest()

    # -- health ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """Size, cap, and counts: for metrics and `doctor`."""
        info = self._env.info()
        stat = self._env.stat()
        used = (info["last_pgno"] + 1) * stat["psize"]
        with self._read() as txn:
            entries = {name.decode(): txn.stat(self._dbs[name])["entries"] for name in self._dbs}
        w = self._writer
        return {
            "path": str(self.path),
            "format_version": self.format_version,
            "used_bytes": used,
            "map_size": info["map_size"],
            "max_size": self.max_size,
            "full": bool(w and w.full),
            "writes_refused": w.refused if w else 0,
            "disk_full_refusals": w.disk_full if w else 0,
            "map_grows": w.grows if w else 0,
            "entries": entries,
        }


__all__ = ["Store", "StoreFullError", "StoreVersionError", "RecordNotFound", "CompactionConflict", "RowChange"]
