"""What every part of the store shares: its errors, the records' small helpers, and the base of
:class:`~tensorverse.store.store.Store` (the environment, its named databases, the writer, and the
low-level reads and writes the parts build on). The store's methods live one job a file:
:mod:`~tensorverse.store.writes` (records and rows written), :mod:`~tensorverse.store.edits`
(corrections of the grouping, deletions, pins and retention accounting) and
:mod:`~tensorverse.store.reads` (every read); :mod:`~tensorverse.store.store` opens, creates and
migrates the store and assembles them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import lmdb

from tensorverse.store import blobs, schema
from tensorverse.store.arrivals import RowArrivals
from tensorverse.store.writer import ResizeLock, Writer, adopt_map_size

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


class StoreBase:
    """The state the store's parts share (set by :class:`~tensorverse.store.store.Store`) and the
    low-level operations they use."""

    path: Path
    readonly: bool
    max_size: int | None
    _env: lmdb.Environment
    _dbs: dict[bytes, Any]
    _resize_lock: ResizeLock
    _refused_sessions: OrderedDict[str, None]
    _writer: Writer | None
    arrivals: RowArrivals

    def _version(self, txn: lmdb.Transaction) -> int | None:
        raw = txn.get(b"format_version", db=self._dbs[schema.META])
        return None if raw is None else int(raw)

    def submit(self, op: Callable[[lmdb.Transaction], Any]) -> Future:
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

    def _paged(self, db: bytes, prefix: bytes,
               expand: Callable[[lmdb.Transaction, bytes, bytes], Iterable[Any]] | None = None, *,
               begin: bytes | None = None, stop: bytes | None = None) -> Iterator[Any]:
        """Scan a prefix in short read transactions, so no reader outlives a page. Yields each
        entry's ``(key, value)``, or with ``expand`` what ``expand(txn, key, value)`` gives for
        it, read in the page's own transaction (a page is ``_PAGE`` entries of ``db``). ``begin``,
        ``stop``: only the keys in ``[begin, stop)``."""
        start: bytes | None = None  # the last key read: the next page starts after it
        while True:
            entries = 0
            page: list[Any] = []
            with self._read() as txn:
                for key, value in self._scan(txn, db, prefix, start or begin):
                    if start is not None and key == start:
                        continue
                    if stop is not None and key >= stop:
                        entries = 0  # the range is done: no next page
                        break
                    start, entries = key, entries + 1
                    page.extend(expand(txn, key, value) if expand is not None else ((key, value),))
                    if entries >= _PAGE:
                        break
            yield from page
            if entries < _PAGE:
                return

    def _get_json(self, db: bytes, key: bytes, what: str) -> dict:
        with self._read() as txn:
            raw = txn.get(key, db=self._dbs[db])
        if raw is None:
            raise RecordNotFound(f"no {what} {key.decode(errors='replace')!r} in {self.path}")
        return _loads(raw)
