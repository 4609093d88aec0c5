"""The store's edits: corrections of the sessions' grouping by hand (recorded in the sessions'
``edits``), deletions and pins, and the accounting retention reads (bytes per table and session)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import lmdb
import orjson

from tensorverse.store import schema
from tensorverse.store.base import RecordNotFound, _compress, _count, _dumps, _loads
from tensorverse.store.reads import StoreReads


class StoreEdits(StoreReads):
    """The edits of :class:`~tensorverse.store.store.Store` (the module docstring)."""

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
        edit: dict[str, Any] = {"op": op, "at_ns": now, "by": by, "reason": reason, "turns": moved}
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
        old = [s.id for s in self.iter_sessions(until_ns=cutoff_ns)]
        deleted = sum(bool(self.delete_session(sid).result()) for sid in old)
        if deleted:
            self.note_space_freed()
        return deleted

    def note_space_freed(self) -> None:
        """After deletions: a store that refused writes for lack of space may take them again."""
        if self._writer is not None:
            self._writer.note_space_freed()

    def note_full_elsewhere(self) -> None:
        """Another process writing to this store (the proxy's ingest worker) had a write refused
        for lack of space: this one reports itself full too (``stats()["full"]``), so that the
        retention keeper compacts and prunes at once."""
        if self._writer is not None:
            self._writer.note_full_elsewhere()
