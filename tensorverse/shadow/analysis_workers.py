"""The proxy's analysis in worker processes, so that it never holds the GIL the relay needs.

Two jobs read many full logits rows and compute with numpy, milliseconds per shadowed token at
Qwen3's vocabulary: comparing a shadowed turn (`tensorverse.shadow.compare`) and planning its
compaction (`tensorverse.store.compaction.plan_compaction`: every row decoded for its top-k and
log-sum-exp). Run in threads of the proxy's process they stall the proxy's event loop, and with
it every agent stream in flight. ``[shadow] analysis_workers`` (1 by default) runs both in that
many worker processes instead:

* a worker opens the store read-only by its path, once per process (LMDB readers in other
  processes see every committed write), computes, writes nothing, and returns the result: a
  turn's comparisons, or a turn's compaction plan (its record and row changes, a few hundred
  bytes per row);
* the proxy commits what comes back through its own writer (one writer per store, as always):
  the comparisons, then metrics and verdict as before; the plan in one transaction, refused
  (``conflict``) if a row changed since the worker read it.

Workers are forked from the proxy's one `forkserver` (`tensorverse.forkserver`), which has
imported the analysis code already, so a worker starts in tens of milliseconds and inherits none
of the proxy's threads or sockets. A worker
that dies (killed, out of memory) breaks its pool: the job it was doing is done in a thread of
the proxy instead (``in_thread``), on the proxy's own store object (an LMDB environment is opened
once per process); the pool starts again for the next job (``worker_restarts``). Nothing is
lost.
``analysis_workers = 0`` keeps both jobs in threads of the proxy.

A worker exits when the proxy does, however the proxy ends (:func:`exit_with`): a pool's worker
waits on a job queue whose pipe it holds both ends of, and holds the fork server's liveness pipe,
so a proxy killed without closing its pool (SIGKILL, the OOM killer) otherwise left its workers
and the fork server running for good, hundreds of MB each.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tensorverse.forkserver import worker_context

if TYPE_CHECKING:
    from tensorverse.store.records import Comparison

__all__ = ["AnalysisWorkers", "compare_in_worker", "plan_in_worker", "exit_with"]

log = logging.getLogger("tensorverse.shadow")

_stores: dict[str, Any] = {}  # in a worker: the store opened read-only, by path


def _store(path: str) -> Any:
    from tensorverse.store import Store

    st = _stores.get(path)
    if st is None:
        st = _stores[path] = Store.open(path, readonly=True)
    return st


def exit_with(pid: int) -> None:
    """A worker's initializer: exit as soon as process ``pid`` (the pool's owner) has ended (see
    the module docstring). A daemon thread waits on a pidfd of it (Linux 5.3+: readable when it
    exits, whichever process it is a child of), else checks once a second that it still exists."""
    threading.Thread(target=_watch, args=(pid,), name="tensorverse-watch-owner", daemon=True).start()


def _watch(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)  # gone already
    except (AttributeError, OSError):  # not Linux, or an older kernel
        fd = -1
    if fd >= 0:
        select.select([fd], [], [])
    else:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # exists, another user's: not ours to watch, keep waiting
                pass
    os._exit(0)  # nobody is left to read a result: no cleanup to run


def compare_in_worker(store_path: str, turn_id: str) -> list[Comparison]:
    """In a worker process: the comparisons of one stored turn, not stored."""
    from tensorverse.shadow.compare import compare_turn

    return compare_turn(_store(store_path), turn_id, store_results=False)


def plan_in_worker(store_path: str, turn_id: str, policy: Any, now_ns: int) -> Any:
    """In a worker process: the compaction plan of one stored turn, not applied."""
    from tensorverse.store.compaction import plan_compaction

    return plan_compaction(_store(store_path), turn_id, policy, now_ns=now_ns)


class AnalysisWorkers:
    """A pool of ``workers`` analysis processes over the store at ``store_path``."""

    def __init__(self, store_path: str | Path, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.store_path = str(store_path)
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.counters = {"compared": 0, "planned": 0, "in_thread": 0, "worker_restarts": 0}

    def _get_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the analysis workers are closed")
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=worker_context(),
                                                 initializer=exit_with, initargs=(os.getpid(),))
            return self._pool

    def _broken(self, pool: ProcessPoolExecutor, what: str) -> None:
        log.warning("tensorverse shadow: an analysis worker died; %s; the workers start again", what)
        with self._lock:
            if self._pool is pool:
                self._pool = None
                self.counters["worker_restarts"] += 1
        pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> tuple[ProcessPoolExecutor, Future]:
        pool = self._get_pool()
        try:
            return pool, pool.submit(fn, *args)
        except BrokenProcessPool:
            self._broken(pool, "the next job goes to a new worker")
            pool = self._get_pool()
            return pool, pool.submit(fn, *args)

    async def compare(self, store: Any, turn_id: str) -> list[Comparison]:
        """The turn's comparisons, computed in a worker (in a thread, over ``store``, the proxy's
        open store, if the worker died); not stored."""
        pool, fut = self._submit(compare_in_worker, self.store_path, turn_id)
        try:
            out = await asyncio.wrap_future(fut)
        except BrokenProcessPool:
            self._broken(pool, f"turn {turn_id} is compared in a thread")
            self.counters["in_thread"] += 1
            from tensorverse.shadow.compare import compare_turn

            out = await asyncio.to_thread(compare_turn, store, turn_id, store_results=False)
        self.counters["compared"] += 1
        return out

    def planner(self, store: Any) -> Callable[[str, Any, int], Any]:
        """A compaction planner (`tensorverse.store.compaction.Planner`) that plans in a worker;
        blocking: for the retention keeper's thread, never the relay's loop."""

        def plan(turn_id: str, policy: Any, now_ns: int) -> Any:
            pool, fut = self._submit(plan_in_worker, self.store_path, turn_id, policy, now_ns)
            try:
                out = fut.result()
            except BrokenProcessPool:
                self._broken(pool, f"the compaction of turn {turn_id} is planned in a thread")
                self.counters["in_thread"] += 1
                from tensorverse.store.compaction import plan_compaction

                out = plan_compaction(store, turn_id, policy, now_ns=now_ns)
            self.counters["planned"] += 1
            return out

        return plan

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
