"""Where a matrix point's run happens: the executor seam of ``tensorverse matrix``, ``bisect``
(and ``replay``'s ``--executor`` flag).

An executor takes :class:`~tensorverse.matrix.run.RunRequest` s and, for each, leaves the finished
run directory in ``req.out/runs/<key>/`` and calls ``on_done(req, record)`` with its ``run.json``
record. Everything before (which points are cached, the reference first, the basis) and after
(the comparison and the reports) stays in :mod:`tensorverse.matrix.grid`, so every executor writes
the same reports from the same run directories.

``local``  (the default) runs :func:`~tensorverse.matrix.run.run_config` in this process: one
           point after another, or ``[matrix] parallel`` threads.
``ray``    runs each point as a Ray task on a cluster (:mod:`tensorverse.matrix.ray_executor`);
           Ray is an optional extra (``pip install 'tensorverse[ray]'``).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:  # the CLI imports this module for its flags: nothing heavy at import time
    from tensorverse.matrix.run import RunRequest

__all__ = ["Executor", "LocalExecutor", "ExecutorUnavailable", "ExecutorOptions", "make_executor",
           "add_executor_arguments", "executor_options", "RAY_MISSING", "OnDone", "Log"]

OnDone = Callable[["RunRequest", dict[str, Any]], None]
Log = Callable[[str], None]

RAY_MISSING = ("--executor ray needs Ray, which is not installed in this environment: "
               "pip install 'tensorverse[ray]' (or pip install 'ray[default]'), "
               "then run the same command again")


class ExecutorUnavailable(RuntimeError):
    """The executor asked for cannot run here (Ray not installed, no cluster at the address)."""


class Executor(Protocol):
    name: str

    def run(self, reqs: Sequence[RunRequest], on_done: OnDone, *, log: Log, parallel: int = 1) -> None:
        """Run every request; ``on_done`` once per request, in the driver's thread of control."""

    def close(self) -> None:
        """Release what the executor holds (a Ray connection it made)."""


class LocalExecutor:
    """Today's behaviour: the points run here, one at a time or in ``parallel`` threads."""

    name = "local"

    def run(self, reqs: Sequence[RunRequest], on_done: OnDone, *, log: Log, parallel: int = 1) -> None:
        from tensorverse.matrix.run import run_config

        def one(req: RunRequest) -> None:
            on_done(req, run_config(req, log=log))

        if parallel <= 1 or len(reqs) <= 1:
            for req in reqs:
                one(req)
            return
        with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="matrix") as pool:
            list(pool.map(one, reqs))

    def close(self) -> None:
        pass


@dataclass
class ExecutorOptions:
    """The ``--executor`` flags (see :func:`add_executor_arguments`)."""

    name: str = "local"
    ray_address: str | None = None
    cpus_per_point: float = 1.0
    gpus_per_point: str = "auto"  # "auto": tensor x pipeline x data parallel when the cluster has GPUs
    resources: dict[str, float] = field(default_factory=dict)
    max_retries: int = 2
    shared_dir: str | None = None
    progress: bool = True


def add_executor_arguments(p: argparse.ArgumentParser, *, what: str = "point") -> None:
    g = p.add_argument_group("executor (docs/matrix.md, \"Run the hypercube on a Ray cluster\")")
    g.add_argument("--executor", choices=("local", "ray"), default="local",
                   help=f"where each {what} runs: here (local, the default) or as Ray tasks on a "
                   "cluster (ray; needs pip install 'tensorverse[ray]')")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="the Ray cluster: auto (the one this host belongs to), HOST:PORT, "
                   "ray://HOST:10001 (Ray Client) or local (a new one on this machine); default: "
                   "$RAY_ADDRESS, else a new local cluster")
    g.add_argument("--ray-cpus-per-point", type=float, default=1.0, metavar="N",
                   help=f"CPUs each {what}'s task asks Ray for (1; on CPU-only rigs, the cores one "
                   "vLLM-CPU server should have)")
    g.add_argument("--ray-gpus-per-point", default="auto", metavar="N|auto",
                   help="GPUs each task asks for; auto (default): tensor x pipeline x data parallel "
                   "size of the point when the cluster has GPUs, else 0")
    g.add_argument("--ray-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="a custom Ray resource every task asks for (repeatable), e.g. "
                   "accelerator_type:H200=0.001 or node:10.0.0.7=0.01")
    g.add_argument("--ray-max-retries", type=int, default=2, metavar="N",
                   help="times Ray reruns a task whose worker or node died (2)")
    g.add_argument("--ray-shared-dir", metavar="DIR",
                   help="a directory every node and the driver see at the same path: run "
                   "directories are written there and moved into OUT instead of travelling "
                   "through Ray's object store as tar bytes")


def parse_resources(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for it in items:
        name, sep, amount = it.rpartition("=")
        if not sep or not name:
            raise ValueError(f"--ray-resource {it!r}: expected NAME=AMOUNT")
        try:
            out[name] = float(amount)
        except ValueError:
            raise ValueError(f"--ray-resource {it!r}: {amount!r} is not a number") from None
    return out


def executor_options(args: argparse.Namespace, *, progress: bool = True) -> ExecutorOptions:
    gpus = str(args.ray_gpus_per_point)
    if gpus != "auto":
        try:
            float(gpus)
        except ValueError:
            raise ValueError(f"--ray-gpus-per-point {gpus!r}: a number or auto") from None
    return ExecutorOptions(name=args.executor, ray_address=args.ray_address,
                           cpus_per_point=args.ray_cpus_per_point, gpus_per_point=gpus,
                           resources=parse_resources(args.ray_resource), max_retries=max(0, args.ray_max_retries),
                           shared_dir=args.ray_shared_dir, progress=progress)


def make_executor(opts: ExecutorOptions | None = None) -> Executor:
    """The executor named by ``opts``; raises :class:`ExecutorUnavailable` (with how to install
    Ray) when ``ray`` cannot be imported."""
    opts = opts or ExecutorOptions()
    if opts.name == "local":
        return LocalExecutor()
    if opts.name != "ray":
        raise ValueError(f"unknown executor {opts.name!r} (local, ray)")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ExecutorUnavailable(RAY_MISSING) from None
    from tensorverse.matrix.ray_executor import RayExecutor

    return RayExecutor(opts)
