"""The store's reads: records by id as their typed Structs (`tensorverse.store.records`),
iterations in short read transactions (so no reader starves a map resize), rows and their engine
states, the turn stamp, and the store's stats."""

from __future__ import annotations

import hashlib
from typing import Iterator

import lmdb
import orjson

from tensorverse.store import records, schema
from tensorverse.store.base import RecordNotFound, StoreBase, _loads
from tensorverse.store.engine_state import EngineState
from tensorverse.store.records import BackendInfo, Compaction, Comparison, Run, Session, Turn
from tensorverse.store.turns import read_turn


class StoreReads(StoreBase):
    """The reads of :class:`~tensorverse.store.store.Store` (the module docstring)."""

    @property
    def format_version(self) -> int | None:
        with self._read() as txn:
            return self._version(txn)

    def get_backend(self, name: str) -> BackendInfo:
        return records.backend(self._get_json(schema.BACKENDS, schema.check_id(name, "backend"), "backend"))

    def get_session(self, session_id: str) -> Session:
        return records.session(self._get_json(schema.SESSIONS, schema.check_id(session_id, "session"), "session"))

    def get_turn(self, turn_id: str) -> Turn:
        return records.turn(read_turn(self._get_json(schema.TURNS, schema.check_id(turn_id, "turn"), "turn")))

    def get_run(self, run_id: str) -> Run:
        return records.run(self._get_json(schema.RUNS, schema.check_id(run_id, "run"), "run"))

    def get_comparison(self, run_id: str, ref_run_id: str) -> Comparison:
        return records.comparison(self._get_json(schema.COMPARISONS, schema.comparison_key(run_id, ref_run_id),
                                                 "comparison"))

    def iter_backends(self) -> Iterator[BackendInfo]:
        for _, value in self._paged(schema.BACKENDS, b""):
            yield records.backend(orjson.loads(value))

    def iter_sessions(self, *, since_ns: int = 0, until_ns: int | None = None) -> Iterator[Session]:
        """Sessions in creation order, created in [since_ns, until_ns)."""
        stop = None if until_ns is None else schema.session_time_bound(until_ns)
        return self._paged(schema.SESSIONS_BY_TIME, b"", self._session_at,
                           begin=schema.session_time_bound(since_ns), stop=stop)

    def _session_at(self, txn: lmdb.Transaction, time_key: bytes, _: bytes) -> list[Session]:
        """The session a time-index key names (none once it is deleted)."""
        raw = txn.get(time_key[8:], db=self._dbs[schema.SESSIONS])
        return [] if raw is None else [records.session(orjson.loads(raw))]

    def iter_turns(self, session_id: str) -> Iterator[Turn]:
        """The turns of a session in index order."""
        for _, tkey in self._paged(schema.TURNS_BY_SESSION, schema.child_prefix(session_id, "session")):
            yield records.turn(read_turn(self._get_json(schema.TURNS, tkey, "turn")))

    def turn_ids(self, session_id: str) -> list[str]:
        """A session's turn ids in index order, from the index alone (no turn record read)."""
        return [tkey.decode() for _, tkey in
                self._paged(schema.TURNS_BY_SESSION, schema.child_prefix(session_id, "session"))]

    def comparison_keys(self, turn_id: str) -> list[tuple[str, str]]:
        """The (run id, reference run id) of every comparison of a turn's runs, keys only (no
        record read): a cheap way to know which comparisons are new."""
        with self._read() as txn:
            return self._comparison_keys(txn, schema.check_id(turn_id, "turn"))

    def _comparison_keys(self, txn: lmdb.Transaction, tkey: bytes) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        prefix = tkey + schema.SEP
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

    def comparison_index(self) -> Iterator[tuple[str, str, list[tuple[str, str]]]]:
        """``(session id, turn id, comparison keys)`` of every turn that has comparisons:
        sessions in creation order, turns in index order, from the indexes alone (no record
        read), one read transaction per page of sessions. The verdict's refresh walks the whole
        store with it (`tensorverse.exporters.comparison_rows.StoreRows`); a transaction per
        session and per turn had cost it most of its time."""
        return self._paged(schema.SESSIONS_BY_TIME, b"", self._compared_turns)

    def _compared_turns(self, txn: lmdb.Transaction, time_key: bytes, _: bytes) -> list[tuple[str, str, list[tuple[str, str]]]]:
        """The compared turns of the session a time-index key names (none once it is deleted)."""
        skey = time_key[8:]
        if txn.get(skey, db=self._dbs[schema.SESSIONS]) is None:
            return []
        sid, out = skey.decode(), []
        for _, tkey in self._scan(txn, schema.TURNS_BY_SESSION, skey + schema.SEP):
            keys = self._comparison_keys(txn, tkey)
            if keys:
                out.append((sid, tkey.decode(), keys))
        return out

    def iter_runs(self, turn_id: str) -> Iterator[Run]:
        prefix = schema.child_prefix(turn_id, "turn")
        for key, _ in self._paged(schema.RUNS_BY_TURN, prefix):
            yield records.run(self._get_json(schema.RUNS, key[len(prefix) :], "run"))

    def iter_comparisons(self, run_id: str) -> Iterator[Comparison]:
        for _, value in self._paged(schema.COMPARISONS, schema.child_prefix(run_id, "run")):
            yield records.comparison(orjson.loads(value))

    _RECORD_DBS = {"session": schema.SESSIONS, "turn": schema.TURNS, "run": schema.RUNS,
                   "comparison": schema.COMPARISONS, "backend": schema.BACKENDS}

    def records(self, kind: str) -> Iterator[dict]:
        """Every stored record of ``kind`` (session, turn, run, comparison, backend) in key order,
        whatever it belongs to, **as the dict stored**: for checks of a whole store (a field no
        record type declares, a value of the wrong type), which the typed reads above would
        drop or refuse. Everything else reads the typed records."""
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

    def compaction(self, turn_id: str) -> Compaction | None:
        """What compaction kept of a turn and why (`tensorverse.store.compaction`), or None when
        the turn's rows are as captured."""
        if schema.COMPACTED not in self._dbs:
            return None
        with self._read() as txn:
            raw = txn.get(schema.check_id(turn_id, "turn"), db=self._dbs[schema.COMPACTED])
        return None if raw is None else records.compaction(_loads(raw))

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
