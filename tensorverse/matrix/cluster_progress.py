"""Progress of points spread over a cluster: each point queued, running (on which node, which
attempt), done or failed.

On a terminal it is a rich progress display (the library ``tensorverse replay``'s bar uses): an
overall bar, then one row per point that is not done yet, with its state and node. Elsewhere (a
log file, CI) one line per change on the same stream as the matrix's other lines::

    matrix: dtype=float32: running on worker-3 (10.0.0.7), attempt 2 [1 queued, 2 running, 4 done, 0 failed]

The states come from :class:`PointState` records the tasks report (``ray_executor.PointBoard``)
and from the driver, which alone decides done and failed (a task's result is what counts).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["PointState", "ClusterProgress"]

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"


@dataclass
class PointState:
    state: str = QUEUED
    host: str | None = None
    node_ip: str | None = None
    pid: int | None = None
    attempt: int = 0
    note: str | None = None  # the task's last line (starting vLLM, ready in 61 s, ...)

    def where(self) -> str:
        if not self.host and not self.node_ip:
            return "?"
        if self.host and self.node_ip and self.host != self.node_ip:
            return f"{self.host} ({self.node_ip})"
        return str(self.host or self.node_ip)


class ClusterProgress:
    def __init__(self, labels: Sequence[str], *, log: Callable[[str], None], enabled: bool = True,
                 console: Any = None) -> None:
        self.states: dict[str, PointState] = {lb: PointState() for lb in labels}
        self.log, self.enabled = log, enabled
        self._live = None
        if enabled and console is None and sys.stderr.isatty():
            from rich.console import Console

            console = Console(stderr=True)
        if enabled and console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._live = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console, transient=False)
            self._total = self._live.add_task("matrix (ray)", total=len(labels))
            self._rows = {lb: self._live.add_task(f"  {lb}: queued", total=None, start=False)
                          for lb in labels}
            self._live.start()

    def counts(self) -> dict[str, int]:
        c = {QUEUED: 0, RUNNING: 0, DONE: 0, FAILED: 0}
        for s in self.states.values():
            c[s.state] += 1
        return c

    def _counts_text(self) -> str:
        c = self.counts()
        return f"[{c[QUEUED]} queued, {c[RUNNING]} running, {c[DONE]} done, {c[FAILED]} failed]"

    def _show(self, label: str, text: str) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            s = self.states[label]
            row = self._rows[label]
            self._live.update(row, description=f"  {label}: {text}")
            if s.state in (DONE, FAILED):
                self._live.update(row, visible=False)
                self._live.update(self._total, completed=self.counts()[DONE] + self.counts()[FAILED])
            return
        self.log(f"{label}: {text} {self._counts_text()}")

    def update(self, reported: Mapping[str, PointState]) -> None:
        """Fold in what the tasks reported (running, node, attempt, note); prints changes."""
        for label, r in reported.items():
            cur = self.states.get(label)
            if cur is None or cur.state in (DONE, FAILED) or r.state != RUNNING:
                continue
            moved = cur.state != RUNNING or r.attempt != cur.attempt
            noted = r.note != cur.note and r.note
            self.states[label] = PointState(RUNNING, r.host, r.node_ip, r.pid, r.attempt, r.note)
            if moved:
                again = f", attempt {r.attempt}" if r.attempt > 1 else ""
                self._show(label, f"running on {r.where()}{again}")
            elif noted and self._live is not None:
                self._show(label, f"running on {r.where()}: {r.note}")

    def finished(self, label: str, status: str, error: str | None = None) -> None:
        cur = self.states.setdefault(label, PointState())
        ok = status in ("ok", "start_failed")  # a point that cannot start is a result, not a lost task
        cur.state = DONE if ok else FAILED
        self._show(label, f"{'done' if ok else 'failed'}: {status} on {cur.where()}"
                   + (f" ({error})" if error and not ok else ""))

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
