"""The single writer thread: the only place a write transaction is opened.

LMDB write transactions are bound to the thread that began them, and LMDB allows one writer
per environment anyway, so every write goes through one thread. Callers (threads or asyncio
code) submit an operation and get a `concurrent.futures.Future` (asyncio: `await
asyncio.wrap_future(fut)`). Operations queued together are committed together (group commit,
one fsync), but each operation's puts are all in the same transaction, so a record is never
half visible. When the map is full the batch is aborted, the map grown and the batch retried,
so no write is lost; past the configured size cap the operations fail with `StoreFullError`.
So do they when the file system itself is full (LMDB reports ENOSPC as a failed commit, an
I/O error): the transaction was aborted, nothing half-written is visible, and writes are tried
again as they come, so recording resumes once space is freed. Logged at most once a minute.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import lmdb

log = logging.getLogger("tensorverse.store")

Op = Callable[[lmdb.Transaction], Any]

_STOP = object()
MAX_BATCH = 64
#: a failed commit with less free space than this on the store's file system is "disk full"
DISK_FULL_FREE_BYTES = 1 << 20


class StoreFullError(RuntimeError):
    """The store reached its size cap: writes are refused, reads keep working."""


class StoreClosedError(RuntimeError):
    """The store was closed before the operation could run."""


class ResizeLock:
    """Readers share it; map growth takes it alone.

    `mdb_env_set_mapsize` may only be called while no transaction is active in the process
    (LMDB does not check this), so readers hold the shared side for the life of a read txn.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._resizing = False

    def acquire_read(self) -> None:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self._resizing = True
            while self._readers:
                self._cond.wait()

    def release_write(self) -> None:
        with self._cond:
            self._resizing = False
            self._cond.notify_all()


def adopt_map_size(env: lmdb.Environment, resize_lock: ResizeLock) -> None:
    """Pick up a map another process sharing the store has grown (`MDB_MAP_RESIZED`)."""
    resize_lock.acquire_write()
    try:
        env.set_mapsize(0)
    finally:
        resize_lock.release_write()


class Writer:
    """Owns the environment's write transactions; see the module docstring."""

    def __init__(
        self,
        env: lmdb.Environment,
        resize_lock: ResizeLock,
        *,
        max_size: int | None,
        queue_size: int = 1024,
    ) -> None:
        self._env = env
        self._resize_lock = resize_lock
        self._max_size = max_size
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.full = False
        self.refused = 0  # operations refused because of the size cap (or a full disk)
        self.disk_full = 0  # of which because the file system is full
        self._disk_full_logged = -1e9  # monotonic time of the last "disk full" log line
        self.grows = 0
        self.commits = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tensorverse-store-writer", daemon=True)
        self._thread.start()

    def submit(self, op: Op) -> Future:
        """Queue `op(txn)`; the future resolves with its result once committed."""
        fut: Future = Future()
        if self._closed:
            fut.set_exception(StoreClosedError("store is closed"))
            return fut
        self._queue.put((op, fut))
        return fut

    def close(self, timeout: float | None = 30.0) -> None:
        """Commit everything queued, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # -- writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[tuple[Op, Future]]) -> None:
        live = [(op, fut) for op, fut in batch if fut.set_running_or_notify_cancel()]
        while live:
            try:
                results = self._apply(live)
            except lmdb.MapFullError:
                if self._grow():
                    continue
                if len(live) > 1:  # commit what fits, one by one
                    for one in live:
                        self._commit_single(one)
                    return
                self._refuse(live[0][1])
                return
            except Exception as exc:  # noqa: BLE001 - a bad operation: isolate it from the rest of the batch
                if self._is_disk_full(exc):
                    for _, fut in live:
                        self._refuse_disk_full(fut, exc)
                    return
                if len(live) > 1:
                    for one in live:
                        self._commit_single(one)
                    return
                live[0][1].set_exception(exc)
                return
            self.commits += 1
            for (_, fut), res in zip(live, results):
                fut.set_result(res)
            return

    def _commit_single(self, item: tuple[Op, Future]) -> None:
        op, fut = item
        while True:
            try:
                (res,) = self._apply([item])
            except lmdb.MapFullError:
                if self._grow():
                    continue
                self._refuse(fut)
                return
            except Exception as exc:  # noqa: BLE001 - best effort
                if self._is_disk_full(exc):
                    self._refuse_disk_full(fut, exc)
                else:
                    fut.set_exception(exc)
                return
            self.commits += 1
            fut.set_result(res)
            return

    def _apply(self, items: list[tuple[Op, Future]]) -> list[Any]:
        try:
            txn = self._env.begin(write=True)
        except lmdb.MapResizedError:  # another process grew the map: adopt its size, retry
            adopt_map_size(self._env, self._resize_lock)
            txn = self._env.begin(write=True)
        with txn:  # aborts on exception, commits on exit
            return [op(txn) for op, _ in items]

    def _refuse(self, fut: Future) -> None:
        self.refused += 1
        if not self.full:
            log.error(
                "tensorverse store reached its size cap (%s bytes): capture stopped, "
                "reads keep working; free space with retention or raise the cap",
                self._max_size,
            )
        self.full = True
        fut.set_exception(StoreFullError(f"store is full (cap {self._max_size} bytes)"))

    def _is_disk_full(self, exc: BaseException) -> bool:
        """A failed LMDB write (ENOSPC surfaces as an I/O error of the commit) while the store's
        file system has (almost) no space left."""
        if not isinstance(exc, lmdb.Error) or isinstance(exc, lmdb.MapFullError):
            return False
        try:
            st = os.statvfs(self._env.path())
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < DISK_FULL_FREE_BYTES

    def _refuse_disk_full(self, fut: Future, exc: BaseException) -> None:
        self.refused += 1
        self.disk_full += 1
        now = time.monotonic()
        if now - self._disk_full_logged >= 60.0:
            self._disk_full_logged = now
            log.error("tensorverse store: the disk of %s is full (%s): capture stopped, proxying goes on; "
                      "writes resume once space is freed (%d write(s) refused so far)",
                      self._env.path(), exc, self.disk_full)
        fut.set_exception(StoreFullError(f"disk full: {exc}"))

    def _grow(self) -> bool:
        """Double the map (up to the cap). False when the cap forbids growing."""
        current = self._env.info()["map_size"]
        target = current * 2
        if self._max_size is not None:
            target = min(target, self._max_size)
        if target <= current:
            return False
        self._resize_lock.acquire_write()
        try:
            self._env.set_mapsize(target)
        finally:
            self._resize_lock.release_write()
        self.grows += 1
        log.info("tensorverse store map grown to %d bytes", target)
        return True

    def note_space_freed(self) -> None:
        """After retention frees pages, writes may succeed again."""
        self.full = False

    def note_full_elsewhere(self) -> None:
        """Another process's write to this store was refused for lack of space: so would ours be."""
        self.full = True
