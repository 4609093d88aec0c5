"""``tensorverse matrix``: every point of the spec captured (one server at a time by default),
then compared with the reference point and summarized into the hypercube report.

Resumable: each configuration's run is cached under ``OUT/runs/<key>/`` and reused when its
``run.json`` says it finished (a point that failed to start is recorded and not retried unless
``retry_failed``); an interrupted matrix reruns only what is missing. The reference point runs
first: its free outputs are the basis every point decodes in forced mode
(:mod:`tensorverse.matrix.run`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tensorverse.matrix.executor import Executor, LocalExecutor
from tensorverse.matrix.outlock import output_lock
from tensorverse.matrix.run import RunRequest, load_run, reference_basis, satisfies
from tensorverse.matrix.spec import MatrixSpec, Point

__all__ = ["run_matrix", "ensure_runs", "Progress"]


class Progress:
    """``matrix: [k/N] ... ETA`` lines on stderr; the ETA is the mean time of the points run so
    far (cached points cost nothing) times the points left."""

    def __init__(self, total: int | None, enabled: bool = True, stream: Any = None) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream  # None: sys.stderr when printing (a live progress display may redirect it)
        self.spent: list[float] = []
        self.t0 = time.monotonic()

    def log(self, msg: str) -> None:
        if self.enabled:
            print(f"matrix: {msg}", file=self.stream or sys.stderr, flush=True)

    def finished(self, label: str, rec: dict[str, Any], cached: bool) -> None:
        self.done += 1
        if not cached:
            self.spent.append(float((rec.get("timings") or {}).get("total_s") or 0.0))
        if self.total is None:  # a bisection: no fixed number of points
            if not cached:
                t = rec.get("timings") or {}
                self.log(f"{label}: {rec.get('status')} (start {t.get('start_s', 0):.0f} s, "
                         f"run {t.get('replay_s', 0) or 0:.0f} s)")
            return
        left = self.total - self.done
        eta = (sum(self.spent) / len(self.spent) * left) if self.spent else None
        t = rec.get("timings") or {}
        what = "cached" if cached else (f"start {t.get('start_s', 0):.0f} s, replay {t.get('replay_s', 0) or 0:.0f} s"
                                        if rec.get("status") == "ok" else rec.get("status"))
        self.log(f"[{self.done}/{self.total}] {label}: {rec.get('status')} ({what})"
                 + (f"; ETA {eta / 60:.1f} min" if eta is not None and left else ""))


def ensure_runs(spec: MatrixSpec, corpus: str, out: Path, points: Sequence[Point], reference: Point, *,
                cases: Sequence[str] | None = None, progress: Progress | None = None,
                retry_failed: bool = False, parallel: int | None = None,
                executor: Executor | None = None) -> dict[str, dict[str, Any]]:
    """The finished run of each point (cached or made now), by point name. The reference runs
    first: its free outputs are the basis every other point decodes in forced mode. ``executor``
    runs what is not cached (:mod:`tensorverse.matrix.executor`; default: here)."""
    from tensorverse.replay.corpus import load_corpus

    corp = load_corpus(corpus)
    all_ids = [c["id"] for c in corp.cases]
    want = cases if cases is not None else (spec.replay.cases or None)
    prog = progress or Progress(len(points), enabled=False)
    runs: dict[str, dict[str, Any]] = {}
    ex = executor or LocalExecutor()

    def done(req: RunRequest, rec: dict[str, Any]) -> None:
        runs[req.label] = rec
        prog.finished(req.label, rec, cached=False)

    def cached(req: RunRequest) -> dict[str, Any] | None:
        rec = load_run(out, req.key)
        if rec is not None and rec.get("status") == "start_failed" and retry_failed:
            return None
        return rec if satisfies(rec, want, all_ids) else None

    # the reference: a cached run covering every case serves any subset, so look for it first
    ref_req = RunRequest(spec, corpus, out, dict(reference.settings), reference.name, cases=None)
    ref_rec = cached(ref_req)
    if ref_rec is None and want is not None:
        ref_req = RunRequest(spec, corpus, out, dict(reference.settings), reference.name, cases=want)
        ref_rec = cached(ref_req)
    if ref_rec is None:
        ex.run([ref_req], done, log=prog.log)
        ref_rec = runs[reference.name]
    else:
        prog.finished(reference.name, ref_rec, cached=True)
        runs[reference.name] = ref_rec
    basis = reference_basis(out, ref_rec, corp)

    todo: list[RunRequest] = []
    seen: dict[str, RunRequest] = {}
    dupes: dict[str, str] = {}
    for p in points:
        if p.name == reference.name:
            continue
        req = RunRequest(spec, corpus, out, dict(p.settings), p.name, cases=want, basis=basis)
        rec = cached(req)
        if rec is not None:
            runs[p.name] = rec
            prog.finished(p.name, rec, cached=True)
        elif req.key in seen:
            dupes[p.name] = seen[req.key].label  # same settings as another point: one run
        else:
            seen[req.key] = req
            todo.append(req)

    ex.run(todo, done, log=prog.log, parallel=max(1, parallel or spec.matrix.parallel))
    for name, other in dupes.items():
        runs[name] = runs[other]
        prog.finished(name, runs[name], cached=True)
    return runs


def run_matrix(spec: MatrixSpec, corpus: str, out: str | Path, *, progress: bool = True,
               retry_failed: bool = False, stream: Any = None, executor: Executor | None = None) -> dict[str, Any]:
    """Capture every point (with ``executor``; default: here), compare, and write the report
    (``OUT/matrix.json``, the merged replay-format results, Parquet and HTML). Returns the
    report. Raises :class:`~tensorverse.matrix.outlock.OutputBusy` when another driver uses ``out``."""
    from tensorverse.matrix.report import build_report, write_outputs

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    points = spec.all_points()
    ref = spec.reference
    prog = Progress(len(points), enabled=progress, stream=stream)
    prog.log(f"{len(points)} point(s), reference {ref!r}, results in {out}")
    t0 = time.monotonic()
    with output_lock(out):
        runs = ensure_runs(spec, corpus, out, points, spec.point(ref), progress=prog, retry_failed=retry_failed,
                           executor=executor)
        report = build_report(spec, corpus, out, points, runs, wall_s=time.monotonic() - t0)
        write_outputs(report, out)
    return report
