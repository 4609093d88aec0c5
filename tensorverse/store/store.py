"""The capture store: one LMDB environment, one writer thread, many lock-free readers.

Records (backends, sessions, turns, runs, logits rows, comparisons) are JSON-like dicts stored
with orjson, except rows, which are codec blobs. Turns are stored zstd-compressed (compressed on
the writer thread, which zstd runs without the GIL: a turn holds the whole message history and
its logprobs as the upstream wrote them) and returned in their canonical shape
(`tensorverse.store.turns.read_turn`). Every `put_*`/`write_rows` returns a
`concurrent.futures.Future` that resolves once the record is committed; each call is one
atomic record (with its index entries), so a crash never exposes half of one.

This module opens, creates and migrates the store; its methods live one job a file, assembled
here behind one API: :mod:`~tensorverse.store.writes`, :mod:`~tensorverse.store.edits` (grouping
corrections, deletions, pins, retention accounting) and :mod:`~tensorverse.store.reads`, over
:mod:`~tensorverse.store.base` (errors, shared state, low-level transactions).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import lmdb

from tensorverse.store import schema
from tensorverse.store.base import (
    DEFAULT_MAP_SIZE,
    CompactionConflict,
    RecordNotFound,
    RowChange,
    StoreNotReadyError,
    StoreVersionError,
    _dumps,
    log,
)
from tensorverse.store.edits import StoreEdits
from tensorverse.store.writer import ResizeLock, StoreFullError, Writer
from tensorverse.store.arrivals import RowArrivals
from tensorverse.store.writes import StoreWrites


class Store(StoreWrites, StoreEdits):
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
        self.arrivals = RowArrivals()  # rows this process commits, for its own waiters
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

    @property
    def durable(self) -> bool:
        """Whether every commit is synced to disk (``durable=False``: the OS flushes it later)."""
        return self._durable

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


__all__ = ["Store", "StoreFullError", "StoreVersionError", "StoreNotReadyError", "RecordNotFound", "CompactionConflict",
           "RowChange", "DEFAULT_MAP_SIZE"]
