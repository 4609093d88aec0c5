"""The ``ray`` executor: every matrix point a Ray task on a cluster.

A task asks Ray for what its point needs (:func:`point_resources`: GPUs = tensor x pipeline x data
parallel size on a GPU cluster, CPUs, and custom resources such as ``accelerator_type:H200``),
unpacks the corpus the driver put in the object store, runs :func:`~tensorverse.matrix.run.run_config`
(starts vLLM on the node it landed on, replays the cases, stops the server) into a scratch
directory, and hands back the run's record and its run directory. The driver installs that
directory as ``OUT/runs/<key>`` and the matrix carries on exactly as with the local executor:
same cache, same comparison, same reports.

**How a run directory comes back.** By default as tar bytes through Ray's object store: it needs
nothing shared between the nodes (KubeRay pods have their own disks), the object store already
moves task results between nodes, and a point's directory is small for the corpora a matrix runs
(the full-vocabulary rows of the forced and free runs: ~200 KB per row at a 152k vocabulary,
so a 1,000-position corpus is ~0.2 GB per point; Ray spills large objects to disk). With
``--ray-shared-dir DIR`` (a filesystem every node and the driver mount at the same path: NFS, a
ReadWriteMany volume) the task writes the run there and the driver moves it into ``OUT``: no copy
through the object store, for corpora whose rows run into gigabytes.

**Failures.** A point whose server cannot start is a normal result (``start_failed``, recorded
and cached as with the local executor). A task whose worker process or node dies is rerun by Ray
(``max_retries``), in a fresh scratch directory, so a half-written attempt never meets the next
one, and the driver installs exactly one run directory per point: the result of the attempt that
finished. A task that still fails is reported as ``task_failed`` and *not* cached, so the next run
tries it again. Ctrl-C (or SIGTERM) cancels every queued and running task (``ray.cancel``: the
running ones stop their vLLM server on the way out) and leaves the points that already came back
cached in ``OUT/runs``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from tensorverse.matrix.cluster_progress import RUNNING, ClusterProgress, PointState
from tensorverse.cluster.options import ExecutorOptions, ExecutorUnavailable
from tensorverse.matrix.executor import Log, OnDone
from tensorverse.matrix.run import RunRequest, run_dir
from tensorverse.cluster.transfer import install_run_dir, pack_dir, unpack_dir

__all__ = ["RayExecutor", "point_resources", "fits_a_node", "PointBoard", "run_point_task", "RESOURCES_SETTING"]

# a point's own custom Ray resources: "NAME=AMOUNT,NAME=AMOUNT" (an environment-style setting, so it
# is part of the run's key: a point pinned to H200s is another configuration than one on H100s)
RESOURCES_SETTING = "TENSORVERSE_RAY_RESOURCES"


def _int_setting(eff: Mapping[str, Any], *keys: str) -> int:
    for k in keys:
        v = eff.get(k)
        if v is not None and v is not False:
            return max(1, int(v))
    return 1


def point_resources(effective: Mapping[str, Any], opts: ExecutorOptions, *, cluster_has_gpus: bool) -> dict[str, Any]:
    """The Ray task options of a point with these effective settings: ``num_cpus``, ``num_gpus``
    and ``resources``. GPUs: ``--ray-gpus-per-point`` when given, else (``auto``) tensor x
    pipeline x data parallel size on a cluster with GPUs and 0 on a CPU-only one. CPUs: the
    flag's, and on a CPU-only cluster at least one per rank (tensor x pipeline x data parallel:
    vLLM-CPU binds each rank to its own cores)."""
    if opts.gpus_per_point != "auto":
        gpus: float = float(opts.gpus_per_point)
    elif cluster_has_gpus:
        gpus = (_int_setting(effective, "--tensor-parallel-size", "-tp")
                * _int_setting(effective, "--pipeline-parallel-size", "-pp")
                * _int_setting(effective, "--data-parallel-size", "-dp"))
    else:
        gpus = 0
    resources = dict(opts.resources)
    own = effective.get(RESOURCES_SETTING)
    if own:
        for item in str(own).split(","):
            name, sep, amount = item.strip().rpartition("=")
            if not sep or not name:
                raise ValueError(f"{RESOURCES_SETTING}: {item!r} is not NAME=AMOUNT")
            resources[name] = float(amount)
    cpus = opts.cpus_per_point
    if not cluster_has_gpus:
        ranks = (_int_setting(effective, "--tensor-parallel-size", "-tp")
                 * _int_setting(effective, "--pipeline-parallel-size", "-pp")
                 * _int_setting(effective, "--data-parallel-size", "-dp"))
        cpus = max(cpus, ranks)
    return {"num_cpus": cpus, "num_gpus": gpus, "resources": resources}


def fits_a_node(ask: Mapping[str, Any], nodes: Sequence[Mapping[str, float]]) -> bool:
    """Whether some node's total resources cover the task's ask (``point_resources``)."""
    need = {"CPU": float(ask.get("num_cpus") or 0), "GPU": float(ask.get("num_gpus") or 0),
            **{k: float(v) for k, v in (ask.get("resources") or {}).items()}}
    return any(all(float(n.get(k, 0)) >= v for k, v in need.items() if v > 0) for n in nodes)


def describe_ask(ask: Mapping[str, Any]) -> str:
    parts = [f"{ask.get('num_cpus') or 0:g} CPU", f"{ask.get('num_gpus') or 0:g} GPU"]
    parts += [f"{v:g} {k}" for k, v in (ask.get("resources") or {}).items()]
    return ", ".join(parts)


class PointBoard:
    """A Ray actor (no CPU) the tasks report to: which point runs where, which attempt, its last
    line. The driver polls :meth:`snapshot`; the attempt count is how a retry is seen."""

    def __init__(self) -> None:
        self.states: dict[str, PointState] = {}

    def running(self, label: str, host: str, node_ip: str, pid: int) -> int:
        prev = self.states.get(label)
        attempt = (prev.attempt if prev else 0) + 1
        self.states[label] = PointState(RUNNING, host, node_ip, pid, attempt)
        return attempt

    def note(self, label: str, text: str) -> None:
        if label in self.states:
            self.states[label].note = text

    def snapshot(self) -> dict[str, PointState]:
        return dict(self.states)


OWNER = ".owner"  # the pid of the worker that made a scratch directory


def sweep_scratch(base: Path) -> list[Path]:
    """Remove the ``tv-point-*`` scratch directories in ``base`` whose worker process is gone (a
    worker killed by a lost node, a forced cancel or the end of the driver's job never ran its
    clean-up). Returns what was removed."""
    gone = []
    for d in base.glob("tv-point-*"):
        try:
            pid = int((d / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being made
        if not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _write_json(path: Path, obj: Any) -> None:
    from tensorverse.matrix.run import _write_json as write

    write(path, obj)


def run_point_task(req: RunRequest, expected_key: str, corpus_blob: bytes, board: Any,
                   shared_dir: str | None) -> dict[str, Any]:
    """The body of a point's Ray task (runs on the node Ray chose)."""
    import ray

    from tensorverse.matrix.run import run_config

    t_enter = time.monotonic()
    host, node_ip, pid = socket.gethostname(), ray.util.get_node_ip_address(), os.getpid()
    attempt = ray.get(board.running.remote(req.label, host, node_ip, pid))
    task_id = ray.get_runtime_context().get_task_id()
    if shared_dir:
        base = Path(shared_dir) / ".tensorverse-tasks"
        base.mkdir(parents=True, exist_ok=True)
    else:
        base = Path(tempfile.gettempdir())
        sweep_scratch(base)  # what killed or cancelled workers of this node left behind
    work = Path(tempfile.mkdtemp(prefix=f"tv-point-{(task_id or 'local')[:16]}-", dir=base))
    (work / OWNER).write_text(str(pid))
    keep = False
    try:
        corpus = unpack_dir(corpus_blob, work / "corpus")
        local = dataclasses.replace(req, corpus=str(corpus), out=work / "out")
        if local.key != expected_key:
            raise RuntimeError(f"{req.label}: the run key on {host} ({local.key}) is not the driver's "
                               f"({expected_key}): the corpus did not arrive intact")
        rec = run_config(local, log=lambda s: board.note.remote(req.label, s))
        rec["placement"] = {"executor": "ray", "host": host, "node_ip": node_ip, "attempt": attempt,
                            "task_id": task_id,
                            "task_s": round(time.monotonic() - t_enter, 3)}  # the task's own time so far
        d = run_dir(local.out, expected_key)
        if (d / "run.json").is_file():
            _write_json(d / "run.json", rec)
        if shared_dir:
            keep = True
            return {"record": rec, "path": str(d), "work": str(work)}
        return {"record": rec, "tar": pack_dir(d)}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


class RayExecutor:
    """Points as Ray tasks (see the module's docstring)."""

    name = "ray"

    def __init__(self, opts: ExecutorOptions) -> None:
        import ray

        self.opts = opts
        self._owns = False
        if not ray.is_initialized():
            try:
                ray.init(address=opts.ray_address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ExecutorUnavailable(f"--executor ray: cannot reach a Ray cluster at "
                                          f"{opts.ray_address or '$RAY_ADDRESS or a new local one'}: {e}") from None
            self._owns = True
        res = ray.cluster_resources()
        self.has_gpus = float(res.get("GPU", 0)) > 0
        self.cluster = {"nodes": len([n for n in ray.nodes() if n.get("Alive")]), "cpus": res.get("CPU", 0),
                        "gpus": res.get("GPU", 0)}
        self._task = ray.remote(run_point_task)
        self._board: Any = None
        self._corpus: dict[str, Any] = {}

    def describe(self) -> str:
        c = self.cluster
        return f"Ray cluster: {c['nodes']} node(s), {c['cpus']:g} CPU(s), {c['gpus']:g} GPU(s)"

    def _corpus_ref(self, corpus: str) -> Any:
        import ray

        if corpus not in self._corpus:
            p = Path(corpus)
            if not p.is_dir():
                raise ValueError(f"--executor ray: the corpus must be a directory ({corpus})")
            self._corpus[corpus] = ray.put(pack_dir(p))
        return self._corpus[corpus]

    def board(self) -> Any:
        import ray

        if self._board is None:
            self._board = ray.remote(num_cpus=0)(PointBoard).remote()
        return self._board

    def run(self, reqs: Sequence[RunRequest], on_done: OnDone, *, log: Log, parallel: int = 1) -> None:
        import ray

        if not reqs:
            return
        asks = []
        for req in reqs:
            eff = req.spec.effective(req.settings)
            if "CUDA_VISIBLE_DEVICES" in eff:
                raise ValueError(f"{req.label}: CUDA_VISIBLE_DEVICES is set by the spec; with --executor ray, "
                                 "Ray gives each point its own GPUs (remove it from [server.env] and the points)")
            asks.append(point_resources(eff, self.opts, cluster_has_gpus=self.has_gpus))
        for req, opts in zip(reqs, asks):
            if not fits_a_node(opts, [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]):
                log(f"{req.label}: no node of the cluster has {describe_ask(opts)} now: its task waits "
                    "until one joins (an autoscaler), or Ctrl-C")
        board = self.board()
        pending: dict[Any, RunRequest] = {}
        for req, opts in zip(reqs, asks):
            ref = self._task.options(name=f"tensorverse-point:{req.label}", max_retries=self.opts.max_retries,
                                     retry_exceptions=False, **opts).remote(
                req, req.key, self._corpus_ref(req.corpus), board, self.opts.shared_dir)
            pending[ref] = req
        prog = ClusterProgress([r.label for r in reqs], log=log, enabled=self.opts.progress)
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                try:
                    prog.update(ray.get(board.snapshot.remote(), timeout=10))
                except ray.exceptions.GetTimeoutError:
                    pass
                for ref in ready:
                    req = pending.pop(ref)
                    rec = self._collect(ref, req)
                    prog.finished(req.label, str(rec.get("status")), rec.get("error"))
                    on_done(req, rec)
        except KeyboardInterrupt:
            self._cancel(list(pending), log)
            raise
        finally:
            prog.close()

    def call(self, fn: Any, like: RunRequest) -> Any:
        """``fn()`` as a Ray task asking what ``like``'s point asks (so it lands on a node where
        that point could run)."""
        import ray

        ask = point_resources(like.spec.effective(like.settings), self.opts, cluster_has_gpus=self.has_gpus)
        return ray.get(ray.remote(fn).options(max_retries=self.opts.max_retries, **ask).remote())

    def _collect(self, ref: Any, req: RunRequest) -> dict[str, Any]:
        """The task's record, its run directory installed in ``OUT/runs``; a lost task's record
        (``task_failed``, not cached)."""
        import ray

        try:
            got = ray.get(ref)
        except ray.exceptions.RayError as e:
            cause = getattr(e, "cause", None) or e
            msg = str(cause).strip().splitlines()
            return {"key": req.key, "label": req.label, "settings": dict(req.settings),
                    "effective": req.spec.effective(req.settings), "status": "task_failed",
                    "error": f"{type(cause).__name__}: {msg[-1] if msg else ''}"[:2000],
                    "timings": {}, "cases": []}
        rec = got["record"]
        runs = Path(req.out) / "runs"
        if "tar" in got:
            install_run_dir(runs, req.key, blob=got["tar"])
        else:
            install_run_dir(runs, req.key, src=got["path"])
            shutil.rmtree(got["work"], ignore_errors=True)
        return rec

    def _cancel(self, refs: list[Any], log: Log) -> None:
        """Cancel every task still out: politely first (KeyboardInterrupt in the task: its vLLM
        server is stopped), then by killing the worker of any that has not ended."""
        import ray

        if not refs:
            return
        log(f"interrupted: cancelling {len(refs)} Ray task(s)")
        for r in refs:
            try:
                ray.cancel(r, force=False)
            except Exception:  # noqa: BLE001 - already finished
                pass
        grace = 30.0
        t0 = time.monotonic()
        left = refs
        while left and time.monotonic() - t0 < grace:
            _, left = ray.wait(left, num_returns=len(left), timeout=1.0)
        for r in left:
            try:
                ray.cancel(r, force=True)
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        import ray

        if self._board is not None:
            try:
                ray.kill(self._board)
            except Exception:  # noqa: BLE001
                pass
            self._board = None
        if self._owns and ray.is_initialized():
            ray.shutdown()
            self._owns = False

