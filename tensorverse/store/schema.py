"""The store's layout: named databases, key encodings, the format version and its migrations.

Everything that knows how bytes are arranged in LMDB lives here, so a format change is one
edit plus one migration. Keys are built so LMDB's byte order is the order readers want:
big-endian integers, ids separated by a NUL that no id contains.
"""

from __future__ import annotations

import random
import struct
import time
from typing import Callable

import lmdb

from tensorverse.store import blobs

# 2: turns compressed, and may hold ``upstream_logprobs`` (`tensorverse.store.turns`)
# 3: rows may have an engine state (``row_engine``, `tensorverse.store.engine_state`)
# 4: one name per field (`tensorverse.store.records`): a turn's answering backend is ``backend``
# 5: a turn's rows may be compacted (``rows_compact``, ``compacted``: `tensorverse.store.compaction`)
FORMAT_VERSION = 5

# Record databases (values: orjson metadata, or codec blobs for rows).
BACKENDS = b"backends"  # name -> backend info
SESSIONS = b"sessions"  # session id -> session
TURNS = b"turns"  # turn id -> turn (from format 2: JSON in a zstd frame)
RUNS = b"runs"  # run id (= capture id) -> run (one per turn x backend x mode)
ROWS = b"rows"  # run id NUL position(u32) -> logits row blob
ROW_ENGINE = b"row_engine"  # run id NUL position(u32) -> packed EngineState (format 3)
COMPARISONS = b"comparisons"  # run id NUL reference run id -> metrics summary
ROWS_COMPACT = b"rows_compact"  # run id NUL position(u32) -> compact row (format 5, store.compact)
COMPACTED = b"compacted"  # turn id -> what compaction kept and why (format 5)
META = b"meta"  # format_version, migration history
# Indexes, written in the same transaction as the record they point to.
SESSIONS_BY_TIME = b"idx_sessions_by_time"  # created_ns(u64) session id -> b""
TURNS_BY_SESSION = b"idx_turns_by_session"  # session id NUL index(u32) -> turn id
RUNS_BY_TURN = b"idx_runs_by_turn"  # turn id NUL run id -> b""

ALL_DBS = (
    BACKENDS,
    SESSIONS,
    TURNS,
    RUNS,
    ROWS,
    ROW_ENGINE,
    COMPARISONS,
    ROWS_COMPACT,
    COMPACTED,
    META,
    SESSIONS_BY_TIME,
    TURNS_BY_SESSION,
    RUNS_BY_TURN,
)

SEP = b"\x00"
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


def new_id() -> str:
    """A time-ordered unique id (16 hex digits of ns time + 8 random hex digits).

    The random part comes from `random` (seeded from the OS at start, reseeded in a forked
    child), not `os.urandom`: a system call here released the GIL on the proxy's event loop and
    then waited behind the store's writer thread."""
    return f"{time.time_ns():016x}{random.getrandbits(32):08x}"


def check_id(value: str, what: str) -> bytes:
    """Encode an id, refusing those that would break key ordering or be ambiguous."""
    if not isinstance(value, str) or not value or "\x00" in value or len(value) > 256:
        raise ValueError(f"invalid {what} id: {value!r}")
    return value.encode()


def row_key(run_id: str, position: int) -> bytes:
    return check_id(run_id, "run") + SEP + _U32.pack(position)


def row_prefix(run_id: str) -> bytes:
    return check_id(run_id, "run") + SEP


def row_position(key: bytes) -> int:
    return _U32.unpack(key[-4:])[0]


def session_time_key(created_ns: int, session_id: str) -> bytes:
    return _U64.pack(created_ns) + check_id(session_id, "session")


def session_time_bound(ns: int) -> bytes:
    return _U64.pack(max(0, ns))


def split_session_time_key(key: bytes) -> tuple[int, str]:
    return _U64.unpack(key[:8])[0], key[8:].decode()


def turn_index_key(session_id: str, index: int) -> bytes:
    return check_id(session_id, "session") + SEP + _U32.pack(index)


def child_prefix(parent_id: str, what: str) -> bytes:
    return check_id(parent_id, what) + SEP


def comparison_key(run_id: str, ref_run_id: str) -> bytes:
    return check_id(run_id, "run") + SEP + check_id(ref_run_id, "run")


# A migration takes the store from version N to N+1 inside one write transaction.
Migration = Callable[[lmdb.Transaction, dict[bytes, "lmdb._Database"]], None]


def _v1_to_v2(txn: lmdb.Transaction, dbs: dict[bytes, "lmdb._Database"]) -> None:
    """Nothing to rewrite: format-1 turns (plain JSON) read as they are. Format 2 writes turns as
    JSON in a zstd frame, and lets a choice hold its logprobs as the upstream wrote them
    (``upstream_logprobs``), which a reader of format 1 would fail on or take for a turn without
    logprobs; the new number makes such a reader refuse the store."""


def _v2_to_v3(txn: lmdb.Transaction, dbs: dict[bytes, "lmdb._Database"]) -> None:
    """Nothing to rewrite: format 3 adds the ``row_engine`` database (created empty when the store
    is opened writable), the engine state of each captured row. Rows of a format-2 store have
    none, and read as rows without an engine state. A format-2 reader would ignore the new
    database and drop engine states when it deletes or rewrites rows; the new number makes it
    refuse the store instead."""


# Fields renamed by format 4: record database -> {old name: name}.
RENAMED_V4 = {TURNS: {"primary": "backend"}}


def _v3_to_v4(txn: lmdb.Transaction, dbs: dict[bytes, "lmdb._Database"]) -> None:
    """Rename the fields that had two names (``RENAMED_V4``): ``tensorverse replay`` wrote a turn's
    answering backend as ``primary``, the proxy's recorder as ``backend``; readers looked under
    both. A record holding both keeps ``backend`` (the old name is dropped)."""
    for db, renames in RENAMED_V4.items():
        changed = []
        for key, raw in txn.cursor(db=dbs[db]):
            rec = blobs.loads(raw)
            if not isinstance(rec, dict) or not any(old in rec for old in renames):
                continue
            for old, new in renames.items():
                if old in rec:
                    value = rec.pop(old)
                    rec.setdefault(new, value)
            blob = blobs.dumps(rec)
            changed.append((key, blobs.compress(blob) if db == TURNS else blob))
        for key, blob in changed:  # not while the cursor walks the database
            txn.put(key, blob, db=dbs[db])


def _v4_to_v5(txn: lmdb.Transaction, dbs: dict[bytes, "lmdb._Database"]) -> None:
    """Nothing to rewrite: format 5 adds ``rows_compact`` (the compact form of rows that are no
    longer evidence) and ``compacted`` (per turn: what was kept in full and why), both created
    empty. A format-4 reader would take a compacted turn's missing rows for rows never captured
    (and recompute comparisons from what is left, or leave compact rows behind when it deletes a
    session); the new number makes it refuse the store instead."""


MIGRATIONS: dict[int, Migration] = {1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4, 4: _v4_to_v5}
