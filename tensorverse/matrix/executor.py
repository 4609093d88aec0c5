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

The ``--executor`` flags and their options live in :mod:`tensorverse.cluster.options`, beside the
directory transfer, since ``tensorverse replay --executor ray`` uses them too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, TypeVar

from tensorverse.cluster.options import RAY_MISSING, ExecutorOptions, ExecutorUnavailable

if TYPE_CHECKING:  # the CLI imports this module for its flags: nothing heavy at import time
    from tensorverse.matrix.run import RunRequest

__all__ = ["Executor", "LocalExecutor", "make_executor", "OnDone", "Log"]

OnDone = Callable[["RunRequest", dict[str, Any]], None]
Log = Callable[[str], None]
T = TypeVar("T")

class Executor(Protocol):
    name: str

    def run(self, reqs: Sequence[RunRequest], on_done: OnDone, *, log: Log, parallel: int = 1) -> None:
        """Run every request; ``on_done`` once per request, in the driver's thread of control."""

    def call(self, fn: Callable[[], T], like: RunRequest) -> T:
        """``fn()`` where ``like``'s point would run (its machine, with the resources it asks):
        what a rig run asks of the machine before its points (fingerprint, refusals)."""

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

    def call(self, fn: Callable[[], T], like: RunRequest) -> T:
        return fn()

    def close(self) -> None:
        pass


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
