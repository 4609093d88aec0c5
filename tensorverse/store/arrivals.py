"""Rows committed by this process, announced to whoever waits for them in the same process.

A shadow run's rows reach the store through the proxy's ``/ingest`` (the capture plugin posts
them while the run is decoding and a little after); the shadow runner then waits until the rows of
every position are stored before it compares. Polling the store for them cost the proxy a thread
hop and a read transaction per run every 0.1 s. When the writes and the waits share a process (the
proxy: ingest and runner hold the same `Store`), the store's writes say what they committed here
instead, and a waiter wakes as soon as its last row is in.

It only ever speeds a waiter up: rows written by another process, or announced so long ago that
their run was forgotten (a bounded number of runs is kept), are still found by reading the store.
Thread-safe: the writer thread adds, asyncio tasks on any loop wait.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

MAX_RUNS = 4096  # runs remembered; a run's rows are waited for within seconds of their commit
MAX_POSITIONS = 262_144  # and positions over all of them (a few MiB), whichever bound comes first


class RowArrivals:
    """Positions committed per run, for in-process waiters (`wait`)."""

    def __init__(self, max_runs: int = MAX_RUNS, max_positions: int = MAX_POSITIONS) -> None:
        self.max_runs = max(1, int(max_runs))
        self.max_positions = max(1, int(max_positions))
        self._positions = 0  # over every remembered run
        self._lock = threading.Lock()
        # run id -> (positions stored in full, positions stored compact: the last write of each wins)
        self._runs: OrderedDict[str, tuple[set[int], set[int]]] = OrderedDict()
        # run id -> waiters: (loop, future, the positions it still needs, compact rows count)
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future, set[int], bool]]] = {}

    def add(self, run_id: str, full: Iterable[int] = (), compact: Iterable[int] = ()) -> None:
        """Record committed rows (called once their transaction has committed): ``full`` rows and
        ``compact`` ones (a compact write replaces a full row of the same position and back)."""
        wake = []
        with self._lock:
            sets = self._runs.get(run_id)
            if sets is None:
                sets = self._runs[run_id] = (set(), set())
            else:
                self._runs.move_to_end(run_id)
            f, c = set(full), set(compact)
            before = len(sets[0]) + len(sets[1])
            sets[0].difference_update(c)
            sets[0].update(f)
            sets[1].difference_update(f)
            sets[1].update(c)
            self._positions += len(sets[0]) + len(sets[1]) - before
            # runs nobody waits for (rows of another process's runs, rows after their wait) go
            # oldest first; the run just announced stays
            while len(self._runs) > 1 and (len(self._runs) > self.max_runs or self._positions > self.max_positions):
                _, (of, oc) = self._runs.popitem(last=False)
                self._positions -= len(of) + len(oc)
            for w in self._waiters.get(run_id, ()):
                w[2].difference_update(sets[0])
                if w[3]:
                    w[2].difference_update(sets[1])
                if not w[2]:
                    wake.append(w)
        for loop, fut, _, _ in wake:
            loop.call_soon_threadsafe(_resolve, fut)

    def knows(self, run_id: str) -> bool:
        """Whether rows of ``run_id`` were announced here (so this process writes them)."""
        with self._lock:
            return run_id in self._runs

    def forget(self, run_id: str) -> None:
        with self._lock:
            sets = self._runs.pop(run_id, None)
            if sets is not None:
                self._positions -= len(sets[0]) + len(sets[1])

    async def wait(self, run_id: str, positions: Sequence[int], timeout: float, *,
                   compact: bool = True) -> set[int]:
        """Wait at most ``timeout`` seconds until a row of every position of ``positions`` is
        announced (a full one unless ``compact``); returns those announced (all of them unless the
        time ran out)."""
        want = set(positions)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            full, comp = self._runs.get(run_id, (set(), set()))
            need = want - full - (comp if compact else set())
            if not need:
                return want
            entry = (loop, fut, need, compact)
            self._waiters.setdefault(run_id, []).append(entry)
        try:
            await asyncio.wait_for(fut, timeout=max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                ws = self._waiters.get(run_id, [])
                if entry in ws:
                    ws.remove(entry)
                if not ws:
                    self._waiters.pop(run_id, None)
                missing = set(entry[2])
        return want - missing


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
