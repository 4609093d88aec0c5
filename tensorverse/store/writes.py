"""The store's writes: backends, sessions, turns, runs, logits rows, comparisons and compacted
rows, each one atomic record (with its index entries) committed by the writer thread."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Sequence

import lmdb
import msgspec
import orjson

from tensorverse.store import records, schema
from tensorverse.store.base import (
    _STORE_KEPT,
    CompactionConflict,
    RecordNotFound,
    RowChange,
    StoreBase,
    _compress,
    _count,
    _dumps,
)
from tensorverse.store.engine_state import EngineState
from tensorverse.store.writer import StoreFullError


class StoreWrites(StoreBase):
    """The writes of :class:`~tensorverse.store.store.Store` (the module docstring)."""

    def put_backend(self, name: str, info: records.BackendInfo) -> Future:
        """Create or replace backend ``name`` (``info``'s own ``name`` is set to it)."""
        if isinstance(info, records.BackendInfo):
            info = msgspec.structs.replace(info, name=name)
        stored = records.checked(info, records.BackendInfo)
        return self._put_json(schema.BACKENDS, schema.check_id(name, "backend"), stored)

    def put_session(self, session: records.Session) -> Future:
        """Create or replace a session; ``created_ns`` is the write's time if not set. Replacing
        keeps what the store maintains itself: the turn counters, the hand edits and the creation
        time (the proxy may submit the same new session's record twice: once with a conversation's
        first turn, once with a side request of it that finished first)."""
        stored = records.checked(session, records.Session, {"created_ns": time.time_ns()})
        sid = stored["id"]
        skey = schema.check_id(sid, "session")
        blob = _dumps(stored)

        def op(txn: lmdb.Transaction) -> None:
            raw = txn.get(skey, db=self._dbs[schema.SESSIONS])
            if raw is None:
                txn.put(skey, blob, db=self._dbs[schema.SESSIONS])
                txn.put(schema.session_time_key(stored["created_ns"], sid), b"", db=self._dbs[schema.SESSIONS_BY_TIME])
                return
            old = orjson.loads(raw)
            kept = {k: old[k] for k in _STORE_KEPT if k in old}
            txn.put(skey, _dumps({**stored, **kept}), db=self._dbs[schema.SESSIONS])

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

    def put_turn(self, turn: records.Turn) -> Future:
        """Store a turn of a session (`session_id`, `index`) and bump the session's counters.

        The session must exist (created by `put_session`) — checked in the same transaction.
        When another turn already holds that index (the session was merged or split by hand while
        a proxy kept writing it), the turn takes the session's next free index instead.
        Counters: ``turns`` (one past the highest index), ``side_turns`` (turns of ``kind``
        ``side``), ``tool_call_turns`` (other turns whose answer calls a tool).
        """
        stored = records.checked(turn, records.Turn, {"created_ns": time.time_ns()})
        tid, sid, index = stored["id"], stored["session_id"], int(stored["index"])
        tkey = schema.check_id(tid, "turn")
        skey = schema.check_id(sid, "session")
        blob = _dumps(stored)

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
                moved = {**stored, "index": max(int(session.get("turns", 0)), index + 1)}
                moved["index_requested"] = index
                data = _dumps(moved)
                idx = moved["index"]
            else:
                idx = index
            session["turns"] = max(int(session.get("turns", 0)), idx + 1)
            _count(session, stored, +1)
            session["updated_ns"] = stored["created_ns"]
            txn.put(skey, _dumps(session), db=self._dbs[schema.SESSIONS])
            txn.put(tkey, _compress(data), db=self._dbs[schema.TURNS])
            txn.put(schema.turn_index_key(sid, idx), tkey, db=self._dbs[schema.TURNS_BY_SESSION])
            return tid

        return self.submit(op)


    def put_run(self, run: records.Run) -> Future:
        """Store or update a run (turn x backend x mode). Its id is the capture id;
        ``created_ns`` is the write's time if not set."""
        stored = records.checked(run, records.Run, {"created_ns": time.time_ns()})
        rkey = schema.check_id(stored["id"], "run")
        return self._put_json(
            schema.RUNS, rkey, stored,
            (schema.RUNS_BY_TURN, schema.child_prefix(stored["turn_id"], "turn") + rkey, b""),
        )

    def write_rows(self, run_id: str,
                   rows: Sequence[tuple[int, bytes] | tuple[int, bytes, EngineState | None]
                                  | tuple[int, bytes, EngineState | None, bool]]) -> Future:
        """Store encoded logits rows of a run, all in one transaction: `(position, blob)`,
        `(position, blob, engine_state)` or `(position, blob, engine_state, compact)`. A row
        written without an engine state has none (a state left by an earlier write of the same row
        is removed). ``compact`` True: the blob is the row's compact form
        (`tensorverse.store.compact`, reduced at the source), stored where compaction puts its
        compact rows; a full row and a compact row of the same position replace each other."""
        keyed = [(schema.row_key(run_id, int(r[0])), bytes(r[1]),
                  r[2].pack() if len(r) > 2 and r[2] is not None else None,
                  bool(r[3]) if len(r) > 3 else False) for r in rows]

        def op(txn: lmdb.Transaction) -> int:
            db = self._dbs[schema.ROWS]
            edb = self._dbs[schema.ROW_ENGINE]
            cdb = self._dbs[schema.ROWS_COMPACT]
            for key, blob, state, compact in keyed:
                txn.put(key, blob, db=cdb if compact else db)
                txn.delete(key, db=db if compact else cdb)
                if state is not None:
                    txn.put(key, state, db=edb)
                else:
                    txn.delete(key, db=edb)
            return len(keyed)

        fut = self.submit(op)
        full = [int(r[0]) for r in rows if not (len(r) > 3 and r[3])]
        compact = [int(r[0]) for r in rows if len(r) > 3 and r[3]]

        def announce(f: Future) -> None:  # in the writer thread, once committed
            if not f.cancelled() and f.exception() is None:
                self.arrivals.add(run_id, full, compact)

        fut.add_done_callback(announce)
        return fut

    def apply_compaction(self, turn_id: str, record: records.Compaction, changes: Sequence[RowChange]) -> Future:
        """Compact one turn's rows in one transaction (`tensorverse.store.compaction`): each
        change replaces a full row by its compact form (``compact``) or by a re-encoding of the
        same row (``full``: a delta against its reference), provided the stored blob is still
        the one the change was computed from (its length and trailing checksum): otherwise
        nothing is written and `CompactionConflict` is raised. ``record`` (what was kept and why)
        goes to ``compacted`` under the turn id; a turn is compacted once. Resolves to the bytes
        of row blobs removed minus those written."""
        tkey = schema.check_id(turn_id, "turn")
        keyed = [(schema.row_key(c.run_id, c.position), c) for c in changes]
        blob = _dumps(records.checked(record, records.Compaction))

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

    def put_comparison(self, run_id: str, ref_run_id: str, result: records.Comparison) -> Future:
        """Store the comparison of run ``run_id`` against ``ref_run_id`` (``result``'s own
        ``run_id`` and ``ref_run_id`` are set to them): a forced or a free one, by its type."""
        if isinstance(result, records.ComparisonBase):
            result = msgspec.structs.replace(result, run_id=run_id, ref_run_id=ref_run_id)
        record = records.checked(result, records.comparison_type(result))  # a dict: refused there
        return self._put_json(schema.COMPARISONS, schema.comparison_key(run_id, ref_run_id), record)
